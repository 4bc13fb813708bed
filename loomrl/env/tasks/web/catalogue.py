"""The shop's catalogue, generated in code from a seed: categories, products, shipping options.

Nothing binary ships with loomrl: the same seed gives the same products (ids, names, prices, stock, attributes) on
every machine, so a task generated from the catalogue names products the site's database holds. A product is one
colour of a base product ("Blue Canvas Tote"), so "the blue Canvas Tote" names exactly one product.

Held-out products: the last base product listed in each category (all its colours) appears only in held-out tasks
(`Product.heldout`), so held-out success also measures products training never named.

This module is data only; the database is shop_db.py, the pages shop.py, the tasks shop_tasks.py.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cache

# slug -> (title, base products (the last one held out), materials, sizes)
CATEGORIES: dict[str, tuple[str, list[str], list[str], list[str]]] = {
    "bags": ("Bags", ["Canvas Tote", "Travel Backpack", "Laptop Sleeve", "Weekend Duffel"],
             ["canvas", "nylon", "leather", "polyester"], ["small", "medium", "large"]),
    "kitchen": ("Kitchen", ["Stoneware Mug", "Travel Flask", "Glass Teapot", "Enamel Bowl"],
                ["stoneware", "steel", "glass", "enamel"], ["250 ml", "350 ml", "500 ml"]),
    "clothing": ("Clothing", ["Linen Shirt", "Cotton Tee", "Wool Sweater", "Rain Jacket"],
                 ["linen", "cotton", "wool", "polyester"], ["S", "M", "L", "XL"]),
    "shoes": ("Shoes", ["Trail Runner", "Canvas Sneaker", "Leather Boot", "Slip-on Loafer"],
              ["mesh", "canvas", "leather", "suede"], ["39", "41", "43", "45"]),
    "home": ("Home", ["Desk Lamp", "Floor Lamp", "Reading Light", "String Lights"],
             ["metal", "wood", "bamboo", "plastic"], ["small", "medium", "large"]),
    "audio": ("Audio", ["Wireless Headphones", "Bluetooth Speaker", "Sport Earbuds", "Pocket Radio"],
              ["plastic", "aluminium", "rubber", "wood"], ["compact", "standard"]),
}
COLOURS = ["Black", "White", "Blue", "Red", "Green", "Grey", "Yellow", "Pink"]
# id -> (label shown in the select, price in cents)
SHIPPING: dict[str, tuple[str, int]] = {
    "standard": ("Standard (3-5 days)", 499),
    "express": ("Express (next day)", 1299),
    "pickup": ("Pick up in store", 0),
}
CONTACT_TOPICS = ["Order question", "Returns", "Product question", "Other"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Product:
    id: int
    name: str  # "Blue Canvas Tote"
    base: str  # "Canvas Tote"
    colour: str  # "Blue"
    category: str  # slug
    size: str
    material: str
    price_cents: int
    stock: int
    description: str
    heldout: bool  # named only by held-out tasks


@cache
def catalogue(seed: int = 0) -> tuple[Product, ...]:
    """Every product of the shop generated from `seed`, ids 1..N in order (the same on every machine)."""
    rng = random.Random(f"shop-catalogue:{seed}")
    products: list[Product] = []
    for slug, (_title, bases, materials, sizes) in CATEGORIES.items():
        for b, base in enumerate(bases):
            low = rng.randint(8, 60)
            for colour in rng.sample(COLOURS, rng.randint(2, 4)):
                material, size = rng.choice(materials), rng.choice(sizes)
                # a few products are out of stock, as in a real shop (tasks never ask to buy those)
                stock = 0 if rng.random() < 0.08 else rng.randint(4, 40)
                products.append(Product(
                    id=len(products) + 1, name=f"{colour} {base}", base=base, colour=colour, category=slug,
                    size=size, material=material, price_cents=rng.randint(low, low + 25) * 100 - 1, stock=stock,
                    description=f"Our {base.lower()} in {colour.lower()}, size {size}, made of {material}.",
                    heldout=b == len(bases) - 1))
    return tuple(products)


def money(cents: int) -> str:
    """`$24.99` for 2499."""
    return f"${cents // 100}.{cents % 100:02d}"
