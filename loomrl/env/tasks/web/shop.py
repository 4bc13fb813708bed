"""The local shop: a FastAPI app over one site's SQLite database, and `ShopSite`, the shop as a browser `Site`.

Pages: home (categories, search box), category and search lists (paginated), product pages (price, stock, colour,
size, material, an add-to-cart form), the cart (change a quantity, remove), checkout (name, address, a shipping
select), an order confirmation, the session's orders, and a contact form. Every POST answers 303 to a page (the
browser follows it), or the form again with an error (400). The cart and orders belong to a session cookie
(`shop_sid`), which the browser context keeps.

One app per process serves every site: a site binds its own database into the request scope (`_BoundApp`), so
making a site costs a database copy, not an app build. Handlers are async (run on the event loop, never on
a thread pool): statements on a site's connection never overlap.

Not here: the HTML (shop_pages.py), the tables (shop_db.py), the tasks and their checks (shop_tasks.py).
"""

from __future__ import annotations

import secrets
import sqlite3
from functools import cache
from urllib.parse import parse_qsl, quote_plus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from loomrl.env.browser.site import AsgiSite, SiteRequest, SiteResponse
from loomrl.env.tasks.web import shop_pages as pages
from loomrl.env.tasks.web.catalogue import CONTACT_TOPICS, SHIPPING
from loomrl.env.tasks.web.shop_db import ShopDb

DEFAULT_ORIGIN = "http://shop.loomrl.test"
SESSION_COOKIE = "shop_sid"
MAX_QUANTITY = 99


class _BoundApp:
    """The shared app with one site's database put into every request's scope."""

    def __init__(self, app: FastAPI, db: ShopDb):
        self.app, self.db = app, db

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app({**scope, "shop.db": self.db}, receive, send)


def _db(request: Request) -> sqlite3.Connection:
    return request.scope["shop.db"].conn


def _session(request: Request) -> tuple[str, bool]:
    """(session id, whether it is new): the cookie's id, or a new one that `_respond` sets. Kept in the request's
    scope, so one request sees one id."""
    if "shop.sid" not in request.scope:
        cookie = request.cookies.get(SESSION_COOKIE, "")
        sid = cookie if len(cookie) == 16 and cookie.isalnum() else secrets.token_hex(8)
        request.scope["shop.sid"] = (sid, sid != cookie)
    return request.scope["shop.sid"]


def _sid(request: Request) -> str:
    return _session(request)[0]


def _respond(request: Request, response: Response) -> Response:
    sid, new = _session(request)
    if new:
        response.set_cookie(SESSION_COOKIE, sid, path="/", httponly=True, samesite="lax")
    return response


def _page(request: Request, title: str, body: str, status: int = 200) -> Response:
    (count,) = _db(request).execute("SELECT COALESCE(SUM(qty), 0) FROM cart_items WHERE sid = ?",
                                    (_sid(request),)).fetchone()
    return _respond(request, HTMLResponse(pages.frame(title, body, count), status_code=status))


def _redirect(request: Request, url: str) -> Response:
    return _respond(request, RedirectResponse(url, status_code=303))


async def _form(request: Request) -> dict[str, str]:
    """The urlencoded form body, values stripped (parsed here: no multipart dependency for plain forms)."""
    body = (await request.body()).decode("utf-8", "replace")
    return {k: v.strip() for k, v in parse_qsl(body, keep_blank_values=True)}


def _int(text: str | None, default: int = 0) -> int:
    try:
        return int(text or "")
    except ValueError:
        return default


def _cart(db: sqlite3.Connection, sid: str) -> list[sqlite3.Row]:
    return db.execute("SELECT c.product_id, c.qty, p.name, p.price_cents, p.stock FROM cart_items c JOIN products p "
                      "ON p.id = c.product_id WHERE c.sid = ? ORDER BY p.id", (sid,)).fetchall()


def _listing(request: Request, title: str, where: str, args: tuple, page: int, link: str) -> Response:
    """A page of the products matching `where` (this module's SQL, never request text: that goes in `args`)."""
    db = _db(request)
    (n,) = db.execute(f"SELECT COUNT(*) FROM products WHERE {where}", args).fetchone()
    pages_n = max(1, -(-n // pages.PAGE_SIZE))
    page = min(max(page, 1), pages_n)
    rows = db.execute(f"SELECT id, name, price_cents FROM products WHERE {where} ORDER BY id LIMIT ? OFFSET ?",
                      (*args, pages.PAGE_SIZE, (page - 1) * pages.PAGE_SIZE)).fetchall()
    return _page(request, title, pages.product_list(rows, page, pages_n, link))


def _catalogue_routes(app: FastAPI) -> None:
    @app.get("/")
    async def home(request: Request) -> Response:
        rows = _db(request).execute("SELECT c.slug, c.title, COUNT(p.id) AS n FROM categories c JOIN products p "
                                    "ON p.category = c.slug GROUP BY c.slug ORDER BY c.position").fetchall()
        return _page(request, "Loom Shop", pages.home(rows))

    @app.get("/category/{slug}")
    async def category(request: Request, slug: str, page: int = 1) -> Response:
        row = _db(request).execute("SELECT title FROM categories WHERE slug = ?", (slug,)).fetchone()
        if row is None:
            return _page(request, "Not found", pages.not_found(), 404)
        return _listing(request, row["title"], "category = ?", (slug,), page, f"/category/{slug}?page=")

    @app.get("/search")
    async def search(request: Request, q: str = "", page: int = 1) -> Response:
        words = q.split()[:6]
        if not words:
            return _page(request, "Search", "<p>Type a product name in the search box.</p>")
        # every word must appear in the name, colour, material or category (case-insensitive, LIKE's escapes)
        where = " AND ".join(["(name || ' ' || material || ' ' || category) LIKE ? ESCAPE '\\'"] * len(words))
        args = tuple("%" + w.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%" for w in words)
        return _listing(request, f"Search results for \"{q}\"", where, args, page,
                        f"/search?q={quote_plus(q)}&page=")

    @app.get("/product/{product_id}")
    async def product(request: Request, product_id: int) -> Response:
        return _product_page(request, product_id)


def _product_page(request: Request, product_id: int, error: str | None = None) -> Response:
    row = _db(request).execute("SELECT p.*, c.title AS category_title FROM products p JOIN categories c "
                               "ON c.slug = p.category WHERE p.id = ?", (product_id,)).fetchone()
    if row is None:
        return _page(request, "Not found", pages.not_found(), 404)
    return _page(request, row["name"], pages.product(row, row["category_title"], error), 400 if error else 200)


def _cart_routes(app: FastAPI) -> None:
    @app.get("/cart")
    async def cart(request: Request) -> Response:
        return _page(request, "Your cart", pages.cart(_cart(_db(request), _sid(request))))

    @app.post("/cart/add")
    async def add(request: Request) -> Response:
        form, db, sid = await _form(request), _db(request), _sid(request)
        pid, qty = _int(form.get("product_id")), _int(form.get("quantity"), -1)
        row = db.execute("SELECT stock FROM products WHERE id = ?", (pid,)).fetchone()
        if row is None:
            return _page(request, "Not found", pages.not_found(), 404)
        have = db.execute("SELECT qty FROM cart_items WHERE sid = ? AND product_id = ?", (sid, pid)).fetchone()
        total = qty + (have["qty"] if have else 0)
        if not 1 <= qty <= MAX_QUANTITY:
            return _product_page(request, pid, f"the quantity must be a whole number from 1 to {MAX_QUANTITY}")
        if total > row["stock"]:
            return _product_page(request, pid, f"only {row['stock']} in stock ({total} wanted in the cart)")
        db.execute("INSERT INTO cart_items VALUES (?, ?, ?) ON CONFLICT (sid, product_id) DO UPDATE SET qty = ?",
                   (sid, pid, total, total))
        return _redirect(request, "/cart")

    @app.post("/cart/update")
    async def update(request: Request) -> Response:
        form, db, sid = await _form(request), _db(request), _sid(request)
        pid, qty = _int(form.get("product_id")), _int(form.get("quantity"), -1)
        line = db.execute("SELECT p.stock FROM cart_items c JOIN products p ON p.id = c.product_id "
                          "WHERE c.sid = ? AND c.product_id = ?", (sid, pid)).fetchone()
        error = ("that product is not in the cart" if line is None
                 else f"the quantity must be a whole number from 0 to {MAX_QUANTITY}" if not 0 <= qty <= MAX_QUANTITY
                 else f"only {line['stock']} in stock" if qty > line["stock"] else None)
        if error:
            return _page(request, "Your cart", pages.cart(_cart(db, sid), error), 400)
        if qty == 0:
            db.execute("DELETE FROM cart_items WHERE sid = ? AND product_id = ?", (sid, pid))
        else:
            db.execute("UPDATE cart_items SET qty = ? WHERE sid = ? AND product_id = ?", (qty, sid, pid))
        return _redirect(request, "/cart")

    @app.post("/cart/remove")
    async def remove(request: Request) -> Response:
        form = await _form(request)
        _db(request).execute("DELETE FROM cart_items WHERE sid = ? AND product_id = ?",
                             (_sid(request), _int(form.get("product_id"))))
        return _redirect(request, "/cart")


def _place_order(db: sqlite3.Connection, sid: str, form: dict[str, str]) -> int | str:
    """The new order's id, or why the order cannot be placed."""
    lines = _cart(db, sid)
    missing = [label for key, label in (("full_name", "full name"), ("street", "street address"), ("city", "city"),
                                        ("postcode", "postcode")) if not form.get(key)]
    short = [r["name"] for r in lines if r["qty"] > r["stock"]]
    if not lines:
        return "your cart is empty"
    if missing:
        return f"please fill in: {', '.join(missing)}"
    if form.get("shipping") not in SHIPPING:
        return "please choose a shipping option"
    if short:
        return f"not enough stock of {', '.join(short)}"
    total = sum(r["qty"] * r["price_cents"] for r in lines) + SHIPPING[form["shipping"]][1]
    with db:  # one transaction: the order, its items, the stock and the emptied cart together
        db.execute("BEGIN")
        cur = db.execute("INSERT INTO orders (sid, full_name, street, city, postcode, shipping, total_cents) "
                         "VALUES (?, ?, ?, ?, ?, ?, ?)", (sid, form["full_name"], form["street"], form["city"],
                                                          form["postcode"], form["shipping"], total))
        order_id = int(cur.lastrowid or 0)
        db.executemany("INSERT INTO order_items VALUES (?, ?, ?, ?)",
                       [(order_id, r["product_id"], r["qty"], r["price_cents"]) for r in lines])
        db.executemany("UPDATE products SET stock = stock - ? WHERE id = ?", [(r["qty"], r["product_id"]) for r in lines])
        db.execute("DELETE FROM cart_items WHERE sid = ?", (sid,))
    return order_id


def _order_routes(app: FastAPI) -> None:
    @app.get("/checkout")
    async def checkout(request: Request) -> Response:
        return _page(request, "Checkout", pages.checkout(_cart(_db(request), _sid(request)), {}))

    @app.post("/checkout")
    async def place(request: Request) -> Response:
        form, db, sid = await _form(request), _db(request), _sid(request)
        placed = _place_order(db, sid, form)
        if isinstance(placed, str):
            return _page(request, "Checkout", pages.checkout(_cart(db, sid), form, placed), 400)
        return _redirect(request, f"/orders/{placed}")

    @app.get("/orders")
    async def orders(request: Request) -> Response:
        rows = _db(request).execute("SELECT o.id, o.total_cents, SUM(i.qty) AS n FROM orders o JOIN order_items i "
                                    "ON i.order_id = o.id WHERE o.sid = ? GROUP BY o.id ORDER BY o.id",
                                    (_sid(request),)).fetchall()
        return _page(request, "Your orders", pages.orders(rows))

    @app.get("/orders/{order_id}")
    async def order(request: Request, order_id: int) -> Response:
        db = _db(request)
        row = db.execute("SELECT * FROM orders WHERE id = ? AND sid = ?", (order_id, _sid(request))).fetchone()
        if row is None:
            return _page(request, "Not found", pages.not_found(), 404)
        items = db.execute("SELECT i.qty, i.price_cents, p.name FROM order_items i JOIN products p "
                           "ON p.id = i.product_id WHERE i.order_id = ?", (order_id,)).fetchall()
        return _page(request, f"Order #{order_id} confirmed", pages.order(row, items))


def _contact_routes(app: FastAPI) -> None:
    @app.get("/contact")
    async def contact(request: Request) -> Response:
        return _page(request, "Contact us", pages.contact({}))

    @app.post("/contact")
    async def send(request: Request) -> Response:
        form = await _form(request)
        missing = [label for key, label in (("name", "your name"), ("email", "email"), ("message", "message"))
                   if not form.get(key)]
        error = (f"please fill in: {', '.join(missing)}" if missing
                 else "the email address needs an @" if "@" not in form["email"]
                 else "please choose a topic" if form.get("topic") not in CONTACT_TOPICS else None)
        if error:
            return _page(request, "Contact us", pages.contact(form, error), 400)
        cur = _db(request).execute(
            "INSERT INTO messages (sid, name, email, topic, order_ref, body) VALUES (?, ?, ?, ?, ?, ?)",
            (_sid(request), form["name"], form["email"], form["topic"], form.get("order_ref", ""), form["message"]))
        return _redirect(request, f"/contact/sent/{cur.lastrowid}")

    @app.get("/contact/sent/{message_id}")
    async def sent(request: Request, message_id: int) -> Response:
        row = _db(request).execute("SELECT name FROM messages WHERE id = ? AND sid = ?",
                                   (message_id, _sid(request))).fetchone()
        if row is None:
            return _page(request, "Not found", pages.not_found(), 404)
        return _page(request, "Message sent", pages.contact_sent(message_id, row["name"]))


@cache
def shop_app() -> FastAPI:
    """The process's one shop app (sites bind their database per request)."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    async def not_found(request: Request, _exc: Exception) -> Response:
        # unknown paths and malformed ids (/product/abc) answer an HTML page, not FastAPI's JSON
        return _page(request, "Not found", pages.not_found(), 404)

    app.add_exception_handler(StarletteHTTPException, not_found)
    app.add_exception_handler(RequestValidationError, not_found)
    _catalogue_routes(app)
    _cart_routes(app)
    _order_routes(app)
    _contact_routes(app)
    return app


class ShopSite:
    """One episode's shop: its own database copy behind the shared app, served as a `Site` (through AsgiSite)."""

    def __init__(self, origin: str = DEFAULT_ORIGIN, seed: int = 0):
        self.db = ShopDb.fresh(seed)
        self.app = _BoundApp(shop_app(), self.db)
        self._site = AsgiSite(self.app, origin, on_reset=self._restore, on_close=self.db.close)
        self.origin = self._site.origin

    async def _restore(self) -> None:
        self.db.restore()

    async def handle(self, request: SiteRequest) -> SiteResponse:
        return await self._site.handle(request)

    async def reset(self) -> None:
        await self._site.reset()

    def close(self) -> None:
        self._site.close()


def shop_site(origin: str = DEFAULT_ORIGIN, seed: int = 0) -> ShopSite:
    """A new shop site on `origin` with the catalogue of `seed` (its own database, copied from the template)."""
    return ShopSite(origin, seed)
