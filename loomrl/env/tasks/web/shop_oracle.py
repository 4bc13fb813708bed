"""Scripted solvers of shop tasks by plain HTTP against the app (httpx in process): they show that every generated
task is solvable through the pages (search, product page, forms), as an agent would, and give the tests right and
wrong end states to check. They read nothing from the database: what they need they find on the pages.

Not an agent and not a baseline: a test fixture that lives beside the tasks so that it changes with them.
"""

from __future__ import annotations

import re
from html import unescape

import httpx

from loomrl.env.tasks.web.shop import ShopSite
from loomrl.types import Task

_LINK = re.compile(r'<a href="(/product/\d+)">([^<]+)</a>')


def client(site: ShopSite) -> httpx.AsyncClient:
    """A client of the site's app with its own cookie jar (one shopper's session); redirects followed."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=site.app), base_url=site.origin,
                             follow_redirects=True)


def _expect(r: httpx.Response, what: str) -> httpx.Response:
    if r.status_code != 200:
        raise AssertionError(f"{what}: HTTP {r.status_code} at {r.url}: {r.text[:300]}")
    return r


async def product_url(c: httpx.AsyncClient, name: str) -> str:
    """The product page of the product called `name`, found with the search box."""
    page = _expect(await c.get("/search", params={"q": name}), f"search {name!r}").text
    for url, text in _LINK.findall(page):
        if unescape(text) == name:
            return url
    raise AssertionError(f"search for {name!r} does not list it")


async def add_to_cart(c: httpx.AsyncClient, name: str, qty: int) -> None:
    url = await product_url(c, name)
    _expect(await c.post("/cart/add", data={"product_id": url.rsplit("/", 1)[1], "quantity": str(qty)}),
            f"add {qty} of {name}")


async def checkout(c: httpx.AsyncClient, address: dict[str, str], shipping: str) -> str:
    """Place the order; the confirmation page's text."""
    page = _expect(await c.post("/checkout", data={**address, "shipping": shipping}), "checkout").text
    if "Order #" not in page:
        raise AssertionError(f"no confirmation after checkout: {page[:300]}")
    return page


async def send_contact(c: httpx.AsyncClient, fields: dict[str, str]) -> None:
    _expect(await c.get("/contact"), "contact page")
    _expect(await c.post("/contact", data=fields), "contact form")


async def read_fact(c: httpx.AsyncClient, name: str, attribute: str) -> str:
    """The product's `attribute` as its page shows it (`$24.99`, `12`, `canvas`), found by name through search."""
    page = _expect(await c.get(await product_url(c, name)), f"product {name!r}").text
    label = {"price": "Price", "stock": "In stock", "material": "Material", "size": "Size"}[attribute]
    m = re.search(rf"<li>{label}: ([^<]+)</li>", page)
    if m is None:
        if attribute == "stock" and "Out of stock" in page:
            return "0"
        raise AssertionError(f"the page of {name!r} shows no {label}")
    return unescape(m.group(1))


async def solve(task: Task, site: ShopSite) -> str | None:
    """Solve `task` on `site` through its pages; the final answer (find) or None."""
    async with client(site) as c:
        if task.family == "buy":
            for item in task.data["items"]:
                await add_to_cart(c, item["name"], item["qty"])
            await checkout(c, task.data["address"], task.data["shipping"] or "standard")
            return None
        if task.family == "contact":
            await send_contact(c, task.data["fields"])
            return None
        if task.family == "find":
            return await read_fact(c, task.data["name"], task.data["attribute"])
    raise ValueError(f"not a shop task family: {task.family!r}")

