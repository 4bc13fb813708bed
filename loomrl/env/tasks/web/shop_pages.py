"""The shop's HTML: short server-rendered pages a small model reads as text, no JavaScript, no CSS needed.

Every page is the same frame (a title, a nav bar with a search box, the page's own part). Every form control has a
label (or a placeholder and aria-label, for the search box) and an id, so a page-text view can name it; lists are
paginated (PAGE_SIZE items) so that a page stays within a small model's context. Values are escaped here, once.

Not here: routing, sessions and the database (shop.py).
"""

from __future__ import annotations

import sqlite3
from html import escape

from loomrl.env.tasks.web.catalogue import CONTACT_TOPICS, SHIPPING, money

PAGE_SIZE = 5  # products per category or search page


def frame(title: str, body: str, cart_count: int) -> str:
    """The whole page: a title, the nav bar (with the cart's item count and a search box) and `body`."""
    return (f"<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{escape(title)} - Loom Shop"
            f"</title></head><body><nav><a href=\"/\" id=\"nav-home\">Home</a> | "
            f"<a href=\"/cart\" id=\"nav-cart\">Cart ({cart_count})</a> | "
            f"<a href=\"/orders\" id=\"nav-orders\">Orders</a> | <a href=\"/contact\" id=\"nav-contact\">Contact</a>"
            f"<form action=\"/search\" method=\"get\" role=\"search\"><input type=\"search\" name=\"q\" id=\"search\" "
            f"placeholder=\"Search products\" aria-label=\"Search products\"> "
            f"<button type=\"submit\" id=\"search-button\">Search</button></form></nav>"
            f"<main><h1>{escape(title)}</h1>{body}</main></body></html>")


def error_note(message: str | None) -> str:
    return f"<p role=\"alert\" id=\"error\">Error: {escape(message)}</p>" if message else ""


def home(categories: list[sqlite3.Row]) -> str:
    items = "".join(f"<li><a href=\"/category/{c['slug']}\">{escape(c['title'])}</a> ({c['n']} products)</li>"
                    for c in categories)
    return f"<p>Search for a product or choose a category.</p><h2>Categories</h2><ul>{items}</ul>"


def product_list(rows: list[sqlite3.Row], page: int, pages: int, link: str) -> str:
    """A page of products (name and price) with previous/next links; `link` is the list's URL up to `page=`."""
    if not rows:
        return "<p>No products found.</p>"
    items = "".join(f"<li><a href=\"/product/{r['id']}\">{escape(r['name'])}</a> - {money(r['price_cents'])}</li>"
                    for r in rows)
    nav = [f"<a href=\"{link}{page - 1}\" id=\"prev-page\">Previous page</a>"] if page > 1 else []
    nav += [f"<a href=\"{link}{page + 1}\" id=\"next-page\">Next page</a>"] if page < pages else []
    return f"<p>Page {page} of {pages}</p><ul>{items}</ul><p>{' | '.join(nav)}</p>"


def product(p: sqlite3.Row, category_title: str, error: str | None = None) -> str:
    stock = f"In stock: {p['stock']}" if p["stock"] > 0 else "Out of stock"
    facts = (f"<ul><li>Price: {money(p['price_cents'])}</li><li>{stock}</li><li>Colour: {escape(p['colour'])}</li>"
             f"<li>Size: {escape(p['size'])}</li><li>Material: {escape(p['material'])}</li>"
             f"<li>Category: <a href=\"/category/{p['category']}\">{escape(category_title)}</a></li></ul>")
    add = ""
    if p["stock"] > 0:
        add = (f"<form method=\"post\" action=\"/cart/add\"><input type=\"hidden\" name=\"product_id\" "
               f"value=\"{p['id']}\"><label for=\"quantity\">Quantity</label> <input type=\"number\" id=\"quantity\" "
               f"name=\"quantity\" value=\"1\" min=\"1\" max=\"{p['stock']}\"> "
               f"<button type=\"submit\" id=\"add-to-cart\">Add to cart</button></form>")
    return f"{error_note(error)}{facts}<p>{escape(p['description'])}</p>{add}"


def cart(lines: list[sqlite3.Row], error: str | None = None) -> str:
    if not lines:
        return f"{error_note(error)}<p>Your cart is empty.</p>"
    rows = []
    for r in lines:
        pid, name = r["product_id"], escape(r["name"])
        rows.append(
            f"<li><a href=\"/product/{pid}\">{name}</a> - {money(r['price_cents'])} each"
            f"<form method=\"post\" action=\"/cart/update\"><input type=\"hidden\" name=\"product_id\" value=\"{pid}\">"
            f"<label for=\"qty-{pid}\">Quantity of {name}</label> <input type=\"number\" id=\"qty-{pid}\" "
            f"name=\"quantity\" value=\"{r['qty']}\" min=\"0\"> <button type=\"submit\" id=\"update-{pid}\">Update"
            f"</button></form><form method=\"post\" action=\"/cart/remove\"><input type=\"hidden\" name=\"product_id\" "
            f"value=\"{pid}\"><button type=\"submit\" id=\"remove-{pid}\">Remove {name}</button></form></li>")
    total = sum(r["qty"] * r["price_cents"] for r in lines)
    return (f"{error_note(error)}<ul>{''.join(rows)}</ul><p>Subtotal: {money(total)}</p>"
            f"<p><a href=\"/checkout\" id=\"checkout\">Go to checkout</a></p>")


def _field(name: str, label: str, value: str, kind: str = "text") -> str:
    return (f"<p><label for=\"{name}\">{label}</label> <input type=\"{kind}\" id=\"{name}\" name=\"{name}\" "
            f"value=\"{escape(value)}\"></p>")


def _select(name: str, label: str, options: list[tuple[str, str]], chosen: str) -> str:
    opts = "".join(f"<option value=\"{escape(v)}\"{' selected' if v == chosen else ''}>{escape(text)}</option>"
                   for v, text in options)
    return f"<p><label for=\"{name}\">{label}</label> <select id=\"{name}\" name=\"{name}\">{opts}</select></p>"


def checkout(lines: list[sqlite3.Row], values: dict[str, str], error: str | None = None) -> str:
    if not lines:
        return f"{error_note(error)}<p>Your cart is empty. <a href=\"/\">Find products</a> first.</p>"
    items = "".join(f"<li>{r['qty']} x {escape(r['name'])} - {money(r['qty'] * r['price_cents'])}</li>"
                    for r in lines)
    shipping = [(k, f"{label} {money(cents)}") for k, (label, cents) in SHIPPING.items()]
    form = (_field("full_name", "Full name", values.get("full_name", ""))
            + _field("street", "Street address", values.get("street", ""))
            + _field("city", "City", values.get("city", ""))
            + _field("postcode", "Postcode", values.get("postcode", ""))
            + _select("shipping", "Shipping", shipping, values.get("shipping", "standard")))
    return (f"{error_note(error)}<h2>Items</h2><ul>{items}</ul><form method=\"post\" action=\"/checkout\">{form}"
            f"<button type=\"submit\" id=\"place-order\">Place order</button></form>")


def order(o: sqlite3.Row, items: list[sqlite3.Row]) -> str:
    lines = "".join(f"<li>{r['qty']} x {escape(r['name'])} - {money(r['qty'] * r['price_cents'])}</li>"
                    for r in items)
    return (f"<p>Thank you! Your order is placed.</p><ul>{lines}</ul>"
            f"<p>Shipping: {escape(SHIPPING[o['shipping']][0])}</p><p>Total: {money(o['total_cents'])}</p>"
            f"<p>Ship to: {escape(o['full_name'])}, {escape(o['street'])}, {escape(o['city'])} "
            f"{escape(o['postcode'])}</p>")


def orders(rows: list[sqlite3.Row]) -> str:
    if not rows:
        return "<p>You have no orders yet.</p>"
    items = "".join(f"<li><a href=\"/orders/{r['id']}\">Order #{r['id']}</a> - {r['n']} items - "
                    f"{money(r['total_cents'])}</li>" for r in rows)
    return f"<ul>{items}</ul>"


def contact(values: dict[str, str], error: str | None = None) -> str:
    topics = [("", "Choose a topic")] + [(t, t) for t in CONTACT_TOPICS]
    form = (_field("name", "Your name", values.get("name", ""))
            + _field("email", "Email", values.get("email", ""), "email")
            + _select("topic", "Topic", topics, values.get("topic", ""))
            + _field("order_ref", "Order number (optional)", values.get("order_ref", ""))
            + f"<p><label for=\"message\">Message</label> <textarea id=\"message\" name=\"message\" rows=\"3\">"
              f"{escape(values.get('message', ''))}</textarea></p>")
    return (f"{error_note(error)}<form method=\"post\" action=\"/contact\">{form}"
            f"<button type=\"submit\" id=\"send\">Send message</button></form>")


def contact_sent(message_id: int, name: str) -> str:
    return f"<p>Thank you, {escape(name)}. Your message #{message_id} was sent.</p>"


def not_found() -> str:
    return "<p>This page does not exist. <a href=\"/\">Go to the home page</a>.</p>"
