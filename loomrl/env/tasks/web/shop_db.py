"""The shop's state: one in-memory SQLite database per site, copied from a per-process template.

The template (catalogue rows, no carts, orders or messages) is built once per process and catalogue seed. Each site
gets its own copy through sqlite3's online backup API into a fresh in-memory connection, and `restore()` copies the
template over it again: an episode's orders and messages never reach another site, and a reset is a copy, not a
rebuild. The connections allow use from any thread (a site may be made on one thread and served on the event loop's);
the app uses them from async handlers only, so no two statements on one connection run at once.

Not here: the pages (shop.py) and the task checks (shop_tasks.py), which read the tables defined here.
"""

from __future__ import annotations

import sqlite3
import threading
from dataclasses import dataclass

from loomrl.env.tasks.web.catalogue import CATEGORIES, catalogue

SCHEMA = """
CREATE TABLE categories (slug TEXT PRIMARY KEY, title TEXT NOT NULL, position INTEGER NOT NULL);
CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT NOT NULL, base TEXT NOT NULL, colour TEXT NOT NULL,
    category TEXT NOT NULL REFERENCES categories(slug), size TEXT NOT NULL, material TEXT NOT NULL,
    price_cents INTEGER NOT NULL, stock INTEGER NOT NULL, description TEXT NOT NULL);
CREATE TABLE cart_items (sid TEXT NOT NULL, product_id INTEGER NOT NULL REFERENCES products(id),
    qty INTEGER NOT NULL, PRIMARY KEY (sid, product_id));
CREATE TABLE orders (id INTEGER PRIMARY KEY, sid TEXT NOT NULL, full_name TEXT NOT NULL, street TEXT NOT NULL,
    city TEXT NOT NULL, postcode TEXT NOT NULL, shipping TEXT NOT NULL, total_cents INTEGER NOT NULL);
CREATE TABLE order_items (order_id INTEGER NOT NULL REFERENCES orders(id), product_id INTEGER NOT NULL,
    qty INTEGER NOT NULL, price_cents INTEGER NOT NULL);
CREATE TABLE messages (id INTEGER PRIMARY KEY, sid TEXT NOT NULL, name TEXT NOT NULL, email TEXT NOT NULL,
    topic TEXT NOT NULL, order_ref TEXT NOT NULL, body TEXT NOT NULL);
"""

_templates: dict[int, sqlite3.Connection] = {}
# guards building the templates and reading them (a backup reads the source connection; sites may be made on threads)
_template_lock = threading.Lock()


def _connect() -> sqlite3.Connection:
    conn = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)  # autocommit: no open txn
    conn.row_factory = sqlite3.Row
    return conn


def _build_template(seed: int) -> sqlite3.Connection:
    conn = _connect()
    conn.executescript(SCHEMA)
    conn.executemany("INSERT INTO categories VALUES (?, ?, ?)",
                     [(slug, title, i) for i, (slug, (title, *_)) in enumerate(CATEGORIES.items())])
    conn.executemany("INSERT INTO products VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                     [(p.id, p.name, p.base, p.colour, p.category, p.size, p.material, p.price_cents, p.stock,
                       p.description) for p in catalogue(seed)])
    return conn


def _template(seed: int) -> sqlite3.Connection:
    """The process's template for `seed` (built on first use). Call with _template_lock held."""
    if seed not in _templates:
        _templates[seed] = _build_template(seed)
    return _templates[seed]


@dataclass(slots=True, kw_only=True)
class ShopDb:
    """One site's database: `conn` is its own in-memory copy of the catalogue template."""

    seed: int
    conn: sqlite3.Connection

    @classmethod
    def fresh(cls, seed: int = 0) -> ShopDb:
        """A new copy of the template for `seed`."""
        conn = _connect()
        db = cls(seed=seed, conn=conn)
        db.restore()
        return db

    def restore(self) -> None:
        """Back to the template: the backup API overwrites every table of this connection."""
        with _template_lock:
            _template(self.seed).backup(self.conn)

    def close(self) -> None:
        self.conn.close()
