"""End-state checks of shop tasks: a task against a site's database after its episode, as a typed `Verdict`.

`buy` and `contact` read only the database (what the agent says does not count); `find` compares the agent's final
answer with the database's value, normalised (see `check_find`). A verdict's reason is a few words for the viewer
("order has 1 of Blue Canvas Tote, task wants 2").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from loomrl.env.tasks.web.catalogue import catalogue
from loomrl.env.tasks.web.shop_db import ShopDb
from loomrl.types import Task


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """A task checked against a site's end state: solved or not, and why in a few words."""

    solved: bool
    reason: str


def norm(text: str) -> str:
    """Case, surrounding quotes and spaces, a final full stop and runs of spaces do not count."""
    return " ".join(text.casefold().split()).strip("\"' ").rstrip(".").strip()


def check_task(task: Task, db: ShopDb, answer: str | None = None) -> Verdict:
    """Whether `task` is solved on the site whose database is `db`; `answer`: the agent's final answer (find)."""
    if task.data["catalogue_seed"] != db.seed:  # another catalogue's ids name other products: a wiring error
        raise ValueError(f"task {task.task_id} is on catalogue {task.data['catalogue_seed']}, the site on {db.seed}")
    if task.family == "buy":
        return check_buy(task, db)
    if task.family == "contact":
        return check_contact(task, db)
    if task.family == "find":
        return check_find(task, db, answer)
    raise ValueError(f"not a shop task family: {task.family!r} (task {task.task_id})")


def check_buy(task: Task, db: ShopDb) -> Verdict:
    orders = db.conn.execute("SELECT * FROM orders ORDER BY id").fetchall()
    if len(orders) != 1:
        return Verdict(solved=False, reason="no order was placed" if not orders
                       else f"{len(orders)} orders were placed, task wants one")
    order = orders[0]
    rows = db.conn.execute("SELECT i.product_id, i.qty, p.name FROM order_items i JOIN products p "
                           "ON p.id = i.product_id WHERE i.order_id = ?", (order["id"],)).fetchall()
    have = {r["product_id"]: (r["qty"], r["name"]) for r in rows}
    for item in task.data["items"]:
        qty = have.pop(item["product_id"], (0, ""))[0]
        if qty != item["qty"]:
            return Verdict(solved=False, reason=f"order has {qty} of {item['name']}, task wants {item['qty']}")
    if have:
        return Verdict(solved=False, reason=f"order has an extra item: {', '.join(n for _q, n in have.values())}")
    want_ship = task.data["shipping"]
    if want_ship is not None and order["shipping"] != want_ship:
        return Verdict(solved=False, reason=f"order ships {order['shipping']}, task wants {want_ship}")
    for key, want in task.data["address"].items():
        if norm(order[key]) != norm(want):
            return Verdict(solved=False, reason=f"order's {key} is {order[key]!r}, task wants {want!r}")
    return Verdict(solved=True, reason=f"order #{order['id']} matches the task")


def check_contact(task: Task, db: ShopDb) -> Verdict:
    row = db.conn.execute("SELECT * FROM messages ORDER BY id DESC LIMIT 1").fetchone()
    if row is None:
        return Verdict(solved=False, reason="no message was sent")
    for key, want in task.data["fields"].items():
        got = row["body" if key == "message" else key]
        if norm(got) != norm(want):
            return Verdict(solved=False, reason=f"the message's {key} is {got!r}, task wants {want!r}")
    return Verdict(solved=True, reason=f"message #{row['id']} matches the task")


def _tokens(text: str) -> list[str]:
    """Words and numbers apart (`350ml` and `350 ml` alike)."""
    return re.findall(r"[a-z]+|\d+(?:\.\d+)?", text.casefold().replace(",", ""))


def _mentions(answer: list[str], value: str) -> bool:
    want = _tokens(value)
    return any(answer[i:i + len(want)] == want for i in range(len(answer) - len(want) + 1))


def check_find(task: Task, db: ShopDb, answer: str | None) -> Verdict:
    """The answer must name the database's value and no other: a price or a stock is the answer's only number
    (`$24.99`, `24.99 dollars`; a stock of 0 may be said as "out of stock"); a material or size must appear as
    words and no other material or size of the catalogue may, so listing every candidate does not pass."""
    attribute = task.data["attribute"]
    row = db.conn.execute(f"SELECT {attribute if attribute != 'price' else 'price_cents'} AS v FROM products "
                          "WHERE id = ?", (task.data["product_id"],)).fetchone()
    if answer is None or not answer.strip():
        return Verdict(solved=False, reason="no answer was given")
    if row is None:
        raise ValueError(f"task {task.task_id} names product {task.data['product_id']}, which the site does not have")
    tokens = _tokens(answer)
    numbers = sorted({float(t) for t in tokens if t[0].isdigit()})
    if attribute == "price":
        ok = numbers == [row["v"] / 100]
    elif attribute == "stock":
        ok = numbers == [float(row["v"])] or (row["v"] == 0 and not numbers and "out of stock" in norm(answer))
    else:
        others = {getattr(p, attribute) for p in catalogue(db.seed)} - {row["v"]}
        ok = _mentions(tokens, row["v"]) and not any(_mentions(tokens, o) for o in others)
    want = f"${row['v'] / 100:.2f}" if attribute == "price" else str(row["v"])
    return Verdict(solved=ok, reason=f"the {attribute} is {want}; the answer {'names it' if ok else 'does not'}")
