"""The shop's task families and their end-state checks.

Families (several phrasings each, template ids `family/index`):
  buy      "Buy 2 of the blue Canvas Tote ... ship to ..." -> exactly one order, with exactly those products and
           quantities and nothing else, shipped to that name and address, with the shipping option when the
           template names one (two templates say any option will do)
  contact  "Send the shop a message ..." -> the last contact message has exactly those values (name, email, topic,
           order number or none, message)
  find     "What is the price of the blue Canvas Tote?" -> the agent's final answer holds the database's value (price,
           stock, material or size; see `check_find` for the normalisation); the one family whose check reads text

Splits: templates split by env/registry.template_splits (a seeded share of each family's templates held out: the
`heldout_templates` split), and products by the catalogue: the last base product of each category (all its colours:
Weekend Duffel, Enamel Bowl, Rain Jacket, Slip-on Loafer, String Lights, Pocket Radio) is named only by held-out
tasks, training tasks name the others. The checks are shop_checks.py: each reads the site's database after the episode.
"""

from __future__ import annotations

import random

from loomrl.config import ConfigError
from loomrl.env.registry import template_splits
from loomrl.env.tasks.web.catalogue import CONTACT_TOPICS, SHIPPING, Product, catalogue, money
from loomrl.types import Task

ENV_VERSION = "shop-v1"
# {shipping} absent: any option passes
BUY = [
    "Buy {items}. Ship the order to {address} with {shipping} shipping.",
    "Order {items} for {address}. Use {shipping} shipping.",
    "Please purchase {items} and choose {shipping} shipping. Deliver to {address}.",
    "I need {items}. Check out with {shipping} shipping; the address is {address}.",
    "Add {items} to the cart, then place the order with {shipping} shipping for {address}.",
    "Buy {items} for {address}.",
    "Get me {items}. Send it to {address}; any shipping option is fine.",
    "Place an order for {items}, delivered to {address}, shipping: {shipping}.",
]
CONTACT = [
    "Send the shop a message with the contact form. Name: {name}. Email: {email}. Topic: {topic}. Message: {message}",
    "Use the contact page to write to the shop as {name} ({email}), topic \"{topic}\": {message}",
    "Contact the shop. Your name is {name} and your email is {email}. Choose the topic {topic} and write: {message}",
    "Fill in the contact form: name {name}, email {email}, topic {topic}, message \"{message}\"",
    "Write to customer service as {name}, email {email}, under the topic {topic}, saying: {message}",
    "Go to the contact page and send \"{message}\" as {name} <{email}> with the topic {topic}",
]
# (attribute, question)
FIND = [
    ("price", "What is the price of the {product}?"),
    ("price", "How much does the {product} cost?"),
    ("price", "Find the {product} in the shop and tell me its price."),
    ("stock", "How many of the {product} are in stock?"),
    ("stock", "Check the stock: how many units of the {product} are left?"),
    ("material", "What material is the {product} made of?"),
    ("material", "Look up the {product}. Which material is it?"),
    ("size", "What size is the {product}?"),
]
FAMILIES = {"buy": BUY, "contact": CONTACT, "find": FIND}
SHIPPING_WORDS = {"standard": "standard", "express": "express", "pickup": "in-store pickup"}
_FIRST = ["Ana", "Ben", "Chloe", "David", "Elif", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kara", "Liam", "Mei",
          "Noah", "Olga", "Pedro", "Rosa", "Sami", "Tara", "Umar"]
_LAST = ["Lopez", "Smith", "Novak", "Okafor", "Berg", "Rossi", "Tanaka", "Weber", "Khan", "Silva", "Moreau", "Jensen"]
_STREETS = ["Elm Street", "Oak Avenue", "Mill Lane", "Park Road", "River Way", "Station Road", "Hill Street"]
_CITIES = ["Springfield", "Riverton", "Lakeside", "Fairview", "Greenville", "Maplewood", "Brookfield"]
_MESSAGES = {
    "Order question": ["When will my order arrive?", "Can I change the address of my order?",
                       "Please cancel my order."],
    "Returns": ["I want to return a mug that arrived broken.", "How do I send back shoes that do not fit?",
                "Can I exchange my shirt for a larger size?"],
    "Product question": ["Is the desk lamp dimmable?", "Do the trail runners fit wide feet?",
                         "Is the travel flask dishwasher safe?"],
    "Other": ["Do you ship to Canada?", "Do you sell gift cards?", "Are you open on Sundays?"],
}


def check_families(families: list[str], field: str = "env.families") -> None:
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ConfigError(f"config error: {field}: unknown shop family {', '.join(map(repr, unknown))}; "
                          f"choose from {', '.join(sorted(FAMILIES))}")


def template_ids(families: list[str]) -> dict[str, list[str]]:
    check_families(families)
    return {f: [f"{f}/{i}" for i in range(len(FAMILIES[f]))] for f in families}


def _phrase(p: Product) -> str:
    return f"{p.colour.lower()} {p.base}"


def _person(rng: random.Random) -> tuple[str, str]:
    first, last = rng.choice(_FIRST), rng.choice(_LAST)
    return f"{first} {last}", f"{first.lower()}.{last.lower()}@example.com"


def _buy(template: int, products: list[Product], rng: random.Random) -> tuple[str, str, dict]:
    first = rng.choice(products)
    picked = [first]
    if rng.random() < 0.4:  # a second product, of another base so each phrase names one product
        picked.append(rng.choice([p for p in products if p.base != first.base]))
    items = [{"product_id": p.id, "name": p.name, "qty": rng.randint(1, min(3, p.stock))} for p in picked]
    phrase = " and ".join(f"{i['qty']} of the {_phrase(p)}" for i, p in zip(items, picked, strict=True))
    name, _email = _person(rng)
    address = {"full_name": name, "street": f"{rng.randint(1, 99)} {rng.choice(_STREETS)}",
               "city": rng.choice(_CITIES), "postcode": f"{rng.randint(10000, 99999)}"}
    text = BUY[template]
    shipping = rng.choice(sorted(SHIPPING)) if "{shipping}" in text else None
    where = f"{name}, {address['street']}, {address['city']}, postcode {address['postcode']}"
    prompt = text.format(items=phrase, address=where, shipping=SHIPPING_WORDS.get(shipping or "", ""))
    answer = "; ".join(f"{i['qty']} x {i['name']}" for i in items) + (f"; {shipping}" if shipping else "")
    return prompt, answer, {"items": items, "shipping": shipping, "address": address}


def _contact(template: int, rng: random.Random) -> tuple[str, str, dict]:
    name, email = _person(rng)
    topic = rng.choice(CONTACT_TOPICS)
    message = rng.choice(_MESSAGES[topic])
    order_ref = str(rng.randint(1000, 9999)) if topic in ("Order question", "Returns") else ""
    prompt = CONTACT[template].format(name=name, email=email, topic=topic, message=message)
    if order_ref:
        prompt += f" Give the order number {order_ref}."
    fields = {"name": name, "email": email, "topic": topic, "order_ref": order_ref, "message": message}
    return prompt, message, {"fields": fields}


def _find(template: int, products: list[Product], rng: random.Random) -> tuple[str, str, dict]:
    attribute, text = FIND[template]
    p = rng.choice(products)
    answer = {"price": money(p.price_cents), "stock": str(p.stock), "material": p.material, "size": p.size}[attribute]
    return text.format(product=_phrase(p)), answer, {"product_id": p.id, "name": p.name, "attribute": attribute}


def _one(family: str, template: int, products: list[Product], rng: random.Random) -> tuple[str, str, dict]:
    if family == "buy":
        return _buy(template, [p for p in products if p.stock >= 3], rng)
    if family == "contact":
        return _contact(template, rng)
    return _find(template, products, rng)


def generate_tasks(families: list[str], n: int, seed: int, split: str, exclude: set[str] | None = None,
                   templates: dict[str, list[str]] | None = None, catalogue_seed: int = 0) -> list[Task]:
    """`n` tasks cycling through `families`, reproducible from (seed, split), none with a prompt in `exclude`.
    Training tasks name training products only, held-out ones held-out products only."""
    allowed = templates if templates is not None else template_ids(families)
    usable = [f for f in families if allowed.get(f)]
    if not usable:
        return []
    products = [p for p in catalogue(catalogue_seed) if p.heldout == (split != "train")]
    rng = random.Random(f"shop:{seed}:{split}")
    seen, tasks = set(exclude or ()), []
    for _ in range(n * 50):
        if len(tasks) == n:
            break
        family = usable[len(tasks) % len(usable)]
        template = rng.choice(allowed[family])
        prompt, answer, data = _one(family, int(template.rsplit("/", 1)[1]), products, rng)
        if prompt in seen:
            continue
        seen.add(prompt)
        tasks.append(Task(task_id=f"shop-{split}-{len(tasks):05d}", prompt=prompt, answer=answer, split=split,
                          family=family, data={**data, "template": template, "catalogue_seed": catalogue_seed}))
    if len(tasks) < n:
        which = "env.n_train" if split == "train" else "env.n_heldout"
        raise ConfigError(f"{which}={n}: the shop has only {len(tasks)} distinct {split} tasks of {families} (its "
                          f"templates x its {'training' if split == 'train' else 'held-out'} products); lower {which} "
                          "or add families")
    return tasks


def make_splits(families: list[str], n_train: int, n_heldout: int, seed: int, heldout_template_share: float = 0.25,
                catalogue_seed: int = 0) -> tuple[list[Task], list[Task]]:
    """(train, held-out): held-out is `heldout` (training templates, held-out products) and, when the share holds
    templates out, `heldout_templates` (held-out templates, held-out products); see registry.template_splits."""
    check_families(families)
    return template_splits(lambda split, n, templates, exclude: generate_tasks(
        families, n, seed, split, exclude, templates, catalogue_seed),
        template_ids(families), n_train, n_heldout, seed, heldout_template_share)

