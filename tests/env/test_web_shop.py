"""The local shop site and its task families: the database snapshot (copy, reset, independence), the pages (driven
by httpx in process, as the browser's route handler drives them), the oracle solving generated tasks and the
end-state checks refusing wrong end states, the splits, the pages' size; one test through a real headless chromium
(contact form: a POST, its 303 redirect and the session cookie, fulfilled in process from `site.handle`)."""

from __future__ import annotations

import asyncio
import re
import shutil
import statistics
import time
from pathlib import Path

import pytest

from loomrl.config import ConfigError
from loomrl.env.browser.site import SiteRequest, final_url_script, follow_redirects
from loomrl.env.tasks.web.catalogue import CATEGORIES, catalogue
from loomrl.env.tasks.web.shop import shop_site
from loomrl.env.tasks.web.shop_checks import check_task
from loomrl.env.tasks.web.shop_db import ShopDb
from loomrl.env.tasks.web.shop_oracle import add_to_cart, checkout, client, send_contact, solve
from loomrl.env.tasks.web.shop_tasks import FAMILIES, make_splits, template_ids

ALL = sorted(FAMILIES)
MAX_TEXT = 700  # visible characters of any page (~175 tokens): a small model's 512-token context holds one
MAX_HTML = 4096
ADDRESS = {"full_name": "Ana Lopez", "street": "12 Elm Street", "city": "Riverton", "postcode": "12345"}


def _orders(site) -> int:
    return site.db.conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0]


def _stock(site, product_id: int) -> int:
    return site.db.conn.execute("SELECT stock FROM products WHERE id = ?", (product_id,)).fetchone()[0]


def test_snapshot_copy_and_reset():
    """A site's database is a copy of the template (under 5 ms); an order placed, reset: the order, the stock it
    took and the cart are gone."""
    ShopDb.fresh(0).close()  # the template, built once per process
    times = []
    for _ in range(20):
        t = time.perf_counter()
        ShopDb.fresh(0).close()
        times.append(time.perf_counter() - t)
    copy_ms = statistics.median(times) * 1e3
    print(f"database copy: median {copy_ms:.3f} ms")
    assert copy_ms < 5

    async def go():
        site, p = shop_site(), catalogue(0)[0]
        async with client(site) as c:
            await add_to_cart(c, p.name, 2)
            await checkout(c, ADDRESS, "express")
            await add_to_cart(c, p.name, 1)  # a cart line left behind
        assert _orders(site) == 1 and _stock(site, p.id) == p.stock - 2
        await site.reset()
        assert _orders(site) == 0 and _stock(site, p.id) == p.stock
        assert site.db.conn.execute("SELECT COUNT(*) FROM cart_items").fetchone()[0] == 0
        site.close()

    asyncio.run(go())


def test_two_sites_are_independent():
    async def go():
        a, b = shop_site(), shop_site()
        async with client(a) as c:
            await add_to_cart(c, catalogue(0)[0].name, 1)
            await checkout(c, ADDRESS, "standard")
        async with client(b) as c:
            await send_contact(c, {"name": "Ben", "email": "b@example.com", "topic": "Other", "message": "Hi"})
        assert (_orders(a), _orders(b)) == (1, 0)
        count = "SELECT COUNT(*) FROM messages"
        assert (a.db.conn.execute(count).fetchone()[0], b.db.conn.execute(count).fetchone()[0]) == (0, 1)

    asyncio.run(go())


def test_cart_quantity_change_remove_and_stock_limit():
    async def go():
        site = shop_site()
        p, q = [x for x in catalogue(0) if x.stock >= 5][:2]
        async with client(site) as c:
            await add_to_cart(c, p.name, 1)
            await add_to_cart(c, p.name, 2)  # adding again adds up
            await add_to_cart(c, q.name, 1)
            assert "Cart (4)" in (await c.get("/cart")).text
            r = await c.post("/cart/add", data={"product_id": str(p.id), "quantity": str(p.stock)})
            assert r.status_code == 400 and f"only {p.stock} in stock" in r.text
            assert (await c.post("/cart/update", data={"product_id": str(p.id), "quantity": "1"})).status_code == 200
            assert (await c.post("/cart/remove", data={"product_id": str(q.id)})).status_code == 200
            page = (await c.get("/cart")).text
            assert "Cart (1)" in page and q.name not in page
            assert (await c.post("/checkout", data={**ADDRESS, "street": ""})).status_code == 400
        rows = site.db.conn.execute("SELECT product_id, qty FROM cart_items").fetchall()
        assert [tuple(r) for r in rows] == [(p.id, 1)] and _orders(site) == 0

    asyncio.run(go())


def _sample(tasks, per_family: int):
    return [t for f in ALL for t in [t for t in tasks if t.family == f][:per_family]]


def test_oracle_solves_train_and_heldout_tasks_and_the_check_passes():
    """Every family, every split: solved through the pages alone, checked on the database; the same task on an
    untouched site (or with no answer) is not solved."""
    train, heldout = make_splits(ALL, 60, 30, seed=3)

    async def go():
        site = shop_site()
        for task in _sample(train, 12) + _sample(heldout, 12):
            await site.reset()
            untouched = check_task(task, site.db, None)
            assert not untouched.solved, (task.prompt, untouched)
            answer = await solve(task, site)
            verdict = check_task(task, site.db, answer)
            assert verdict.solved, (task.prompt, verdict)

    asyncio.run(go())
    assert {t.split for t in heldout} == {"heldout", "heldout_templates"}


def _task(family: str, want=lambda t: True):
    train, _ = make_splits(ALL, 90, 10, seed=0)
    return next(t for t in train if t.family == family and want(t))


def test_buy_check_refuses_wrong_orders():
    task = _task("buy", lambda t: len(t.data["items"]) == 1 and t.data["items"][0]["qty"] >= 2
                 and t.data["shipping"] is not None)
    item, ship = task.data["items"][0], task.data["shipping"]
    other = next(p for p in catalogue(0) if p.stock >= 3 and p.id != item["product_id"])
    wrong_ship = next(s for s in ("standard", "express", "pickup") if s != ship)

    async def verdict(site, lines, shipping=ship, address=task.data["address"], orders=1):
        await site.reset()
        async with client(site) as c:
            for _ in range(orders):
                for name, qty in lines:
                    await add_to_cart(c, name, qty)
                await checkout(c, address, shipping)
        return check_task(task, site.db)

    async def go():
        site = shop_site()
        right = [(item["name"], item["qty"])]
        assert (await verdict(site, right)).solved
        fewer = await verdict(site, [(item["name"], item["qty"] - 1)])
        assert fewer.reason == f"order has {item['qty'] - 1} of {item['name']}, task wants {item['qty']}"
        extra = await verdict(site, [*right, (other.name, 1)])
        assert not extra.solved and extra.reason == f"order has an extra item: {other.name}"
        assert (await verdict(site, right, orders=2)).reason == "2 orders were placed, task wants one"
        assert (await verdict(site, right, wrong_ship)).reason == f"order ships {wrong_ship}, task wants {ship}"
        moved = await verdict(site, right, address={**task.data["address"], "postcode": "00000"})
        assert not moved.solved and "postcode" in moved.reason
        spaced = {k: f"  {v.upper()} " for k, v in task.data["address"].items()}  # case and spaces do not count
        assert (await verdict(site, right, address=spaced)).solved

    asyncio.run(go())


def test_contact_and_find_checks_refuse_wrong_values():
    contact = _task("contact", lambda t: t.data["fields"]["order_ref"] != "")
    fields = contact.data["fields"]

    async def sent(site, **change):
        await site.reset()
        async with client(site) as c:
            await send_contact(c, {**fields, **change})
        return check_task(contact, site.db)

    async def go():
        site = shop_site()
        assert (await sent(site)).solved
        assert (await sent(site, topic="Other")).reason == f"the message's topic is 'Other', task wants " \
                                                           f"{fields['topic']!r}"
        assert not (await sent(site, order_ref="")).solved
        assert not (await sent(site, message=fields["message"] + " Thanks")).solved
        return site

    site = asyncio.run(go())
    price = _task("find", lambda t: t.data["attribute"] == "price")
    p = next(x for x in catalogue(0) if x.id == price.data["product_id"])
    dollars = f"{p.price_cents / 100:.2f}"
    assert check_task(price, site.db, f"The price is ${dollars}.").solved
    assert check_task(price, site.db, f"{dollars} dollars").solved
    assert not check_task(price, site.db, f"${p.price_cents / 100 + 1:.2f}").solved
    assert not check_task(price, site.db, f"${dollars} or $1.00").solved  # two numbers: a guess, not an answer
    material = _task("find", lambda t: t.data["attribute"] == "material")
    m = next(x for x in catalogue(0) if x.id == material.data["product_id"]).material
    assert check_task(material, site.db, f"It is made of {m.upper()}.").solved
    every = ", ".join(CATEGORIES[next(x.category for x in catalogue(0) if x.material == m)][2])
    assert not check_task(material, site.db, every).solved  # listing every material does not pass
    assert not check_task(material, site.db, None).solved


def test_splits_are_disjoint_and_deterministic():
    train, heldout = make_splits(ALL, 120, 60, seed=7)
    again = make_splits(ALL, 120, 60, seed=7)
    assert [t.prompt for t in train + heldout] == [t.prompt for t in again[0] + again[1]]
    assert [t.prompt for t in make_splits(ALL, 120, 60, seed=8)[0]] != [t.prompt for t in train]
    assert not {t.prompt for t in train} & {t.prompt for t in heldout}
    train_templates = {t.data["template"] for t in train}
    new = [t for t in heldout if t.split == "heldout_templates"]
    assert new and not {t.data["template"] for t in new} & train_templates
    assert all(t.data["template"] in train_templates for t in heldout if t.split == "heldout")
    assert {t.family for t in train} == set(ALL) == {t.family for t in heldout}
    held_ids = {p.id for p in catalogue(0) if p.heldout}
    assert {p.base for p in catalogue(0) if p.heldout} == {bases[-1] for _t, bases, _m, _s in CATEGORIES.values()}

    def products(t):
        return {i["product_id"] for i in t.data["items"]} if t.family == "buy" else {t.data["product_id"]}

    assert all(not products(t) & held_ids for t in train if t.family != "contact")
    assert all(products(t) <= held_ids for t in heldout if t.family != "contact")
    assert sum(len(v) for v in template_ids(ALL).values()) == 22


def _text(html: str) -> str:
    return " ".join(re.sub(r"<[^>]+>", " ", html).split())


def test_pages_stay_small():
    """Every page the shop has (each category page, search, every product, a cart of three, checkout, an order,
    the orders list, contact, not found): under MAX_TEXT visible characters and MAX_HTML bytes."""
    async def go():
        site, products = shop_site(), catalogue(0)
        sizes = {}
        async with client(site) as c:
            urls = ["/", "/search?q=blue", "/search?q=canvas&page=2", "/contact", "/nope", "/product/abc"]
            urls += [f"/category/{slug}?page={n}" for slug in CATEGORIES for n in (1, 2, 3, 4)]
            urls += [f"/product/{p.id}" for p in products]
            for p in [p for p in products if p.stock >= 3][:3]:
                await add_to_cart(c, p.name, 2)
            urls += ["/cart", "/checkout"]
            for url in urls:
                r = await c.get(url)
                sizes[url] = (len(_text(r.text)), len(r.content))
            sizes["order"] = (len(_text(await checkout(c, ADDRESS, "express"))), 0)
            r = await c.get("/orders")
            sizes["/orders"] = (len(_text(r.text)), len(r.content))
        return sizes

    sizes = asyncio.run(go())
    worst = max(sizes, key=lambda u: sizes[u][0])
    print(f"largest page: {worst}: {sizes[worst][0]} characters of text")
    assert all(text <= MAX_TEXT and size <= MAX_HTML for text, size in sizes.values()), sizes


# -- through a real chromium --------------------------------------------------------------------------------------
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.mark.browser
def test_contact_form_through_headless_chromium():
    """Home page, the Contact link, the form filled and sent, in a real chromium whose every request is fulfilled
    in process from `site.handle` (others aborted): the POST, its 303 redirect and the session cookie (the sent page
    shows the message only to its session) work, and the check sees the message."""
    async_api = pytest.importorskip("playwright.async_api", reason="playwright is not installed")
    if not Path(CHROMIUM).is_file():
        pytest.skip("chromium is not installed (apt-get install chromium); the browser tests need it")
    task = _task("contact")
    fields = task.data["fields"]
    site = shop_site()

    async def route(r):
        req = r.request
        if not req.url.startswith(site.origin + "/"):
            await r.abort()
            return
        # redirects followed in process, as the browser pool does (site.py says why)
        followed = await follow_redirects(site, SiteRequest(method=req.method, url=req.url,
                                                            headers=await req.all_headers(), body=req.post_data_buffer))
        res = followed.response
        prefix = final_url_script(followed.url) if followed.redirects and req.is_navigation_request() else b""
        await r.fulfill(status=res.status, headers=res.headers, body=prefix + res.body)

    async def go():
        async with async_api.async_playwright() as p:
            browser = await p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                context = await browser.new_context()
                await context.route("**/*", route)
                page = await context.new_page()
                await page.goto(site.origin + "/", timeout=15_000)
                await page.click("#nav-contact")
                for key in ("name", "email", "order_ref", "message"):
                    await page.fill(f"#{key}", fields[key])
                await page.select_option("#topic", fields["topic"])
                await page.click("#send")
                await page.wait_for_url(re.compile(r"/contact/sent/\d+$"), timeout=15_000)
                return await page.inner_text("main")
            finally:
                await browser.close()

    text = asyncio.run(go())
    assert f"Thank you, {fields['name']}" in text, text
    assert check_task(task, site.db).solved


def test_a_fresh_browser_context_gets_a_fresh_session_after_reset():
    """The browser context is the only cookie store: a request without a Cookie header (a fresh context after reset)
    starts a new session, not the previous episode's (AsgiSite keeps no cookie jar of its own)."""
    async def go():
        site = shop_site()
        first = await site.handle(SiteRequest(method="GET", url=site.origin + "/"))
        await site.reset()
        again = await site.handle(SiteRequest(method="GET", url=site.origin + "/"))  # no Cookie header: a new context
        return first.headers.get("set-cookie"), again.headers.get("set-cookie")

    first, again = asyncio.run(go())
    assert first and again and first != again


def test_asking_for_more_tasks_than_the_shop_has_is_one_line_naming_the_field():
    """Two held-out templates of `find` x 19 held-out products: 38 distinct tasks; 40 is refused naming env.n_heldout."""
    with pytest.raises(ConfigError, match=r"env.n_heldout=40: the shop has only 38 distinct heldout_templates tasks"):
        make_splits(["find"], 10, 40, seed=0)
