"""Generates the small WebShop catalog shipped under ``crl_gym/envs/webshop/data/``.

The files use the schemas of WebShop's originals, so the same loader reads both:

* ``items_shuffle_100.json`` — a list of products (``asin``, ``name``, ``full_description``,
  ``small_description``, ``pricing``, ``product_category``, ``customization_options``,
  ``category``, ``query``, ``average_rating``, ``images``);
* ``items_ins_v2_100.json`` — ``{asin: {attributes, instruction, instruction_attributes}}``;
* ``items_human_ins_100.json`` — ``{asin: [{asin, instruction, instruction_attributes,
  instruction_options}]}`` (here written from templates, standing in for the human ones).

Regenerate with ``python -m crl_gym.envs.webshop.generate [OUT_DIR]`` (deterministic).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

# (category, query, product_category, noun, attribute pool, option dimensions, price range)
KINDS: list[tuple[str, str, str, str, list[str], dict[str, list[str]], tuple[float, float]]] = [
    (
        "beauty",
        "toothpaste",
        "Beauty & Personal Care › Oral Care › Toothpaste",
        "toothpaste",
        ["fluoride free", "long lasting", "natural ingredients", "sensitive teeth"],
        {"flavor name": ["mint", "charcoal", "strawberry"], "size": ["pack of 1", "pack of 3"]},
        (3, 25),
    ),
    (
        "beauty",
        "shampoo",
        "Beauty & Personal Care › Hair Care › Shampoo",
        "shampoo",
        ["sulfate free", "paraben free", "dry hair", "natural ingredients"],
        {"scent": ["coconut", "lavender", "unscented"], "size": ["8 fl oz", "16 fl oz"]},
        (6, 40),
    ),
    (
        "beauty",
        "lipstick",
        "Beauty & Personal Care › Makeup › Lips › Lipstick",
        "lipstick",
        ["long lasting", "cruelty free", "easy apply", "high quality"],
        {"color": ["red", "nude", "pink", "plum"]},
        (5, 30),
    ),
    (
        "beauty",
        "face moisturizer",
        "Beauty & Personal Care › Skin Care › Face › Moisturizers",
        "face moisturizer",
        ["oil free", "fragrance free", "sensitive skin", "anti aging"],
        {"size": ["1.7 ounce", "3.4 ounce"]},
        (8, 60),
    ),
    (
        "fashion",
        "running shoes",
        "Clothing, Shoes & Jewelry › Men › Shoes › Athletic › Running",
        "running shoes",
        ["non slip", "rubber sole", "lace up", "memory foam"],
        {"color": ["black", "white", "navy blue", "grey"], "size": ["8", "9", "10", "11"]},
        (30, 120),
    ),
    (
        "fashion",
        "t-shirt",
        "Clothing, Shoes & Jewelry › Women › Clothing › Tops, Tees & Blouses › T-Shirts",
        "t-shirt",
        ["machine wash", "short sleeve", "cotton spandex", "relaxed fit"],
        {
            "color": ["white", "black", "heather grey", "red"],
            "size": ["small", "medium", "large", "x-large"],
        },
        (9, 35),
    ),
    (
        "fashion",
        "winter jacket",
        "Clothing, Shoes & Jewelry › Men › Clothing › Jackets & Coats",
        "winter jacket",
        ["water resistant", "hand wash", "zipper closure", "fleece lined"],
        {"color": ["black", "olive green", "navy"], "size": ["medium", "large", "x-large"]},
        (40, 150),
    ),
    (
        "fashion",
        "yoga pants",
        "Clothing, Shoes & Jewelry › Women › Clothing › Active › Leggings",
        "yoga pants",
        ["high waist", "tummy control", "moisture wicking", "machine wash"],
        {"color": ["black", "charcoal grey", "burgundy"], "size": ["small", "medium", "large"]},
        (15, 45),
    ),
    (
        "grocery",
        "green tea",
        "Grocery & Gourmet Food › Beverages › Tea › Green",
        "green tea",
        ["gluten free", "non gmo", "caffeine free", "usda organic"],
        {"size": ["20 count", "100 count"]},
        (4, 28),
    ),
    (
        "grocery",
        "protein bar",
        "Grocery & Gourmet Food › Snack Foods › Bars › Protein",
        "protein bar",
        ["gluten free", "low sugar", "high protein", "keto friendly"],
        {
            "flavor name": ["chocolate", "peanut butter", "vanilla"],
            "size": ["12 count", "24 count"],
        },
        (12, 45),
    ),
    (
        "grocery",
        "coffee beans",
        "Grocery & Gourmet Food › Beverages › Coffee › Whole Bean",
        "coffee beans",
        ["fair trade", "usda organic", "dark roast", "non gmo"],
        {"size": ["12 ounce", "2 pound"]},
        (9, 40),
    ),
    (
        "grocery",
        "olive oil",
        "Grocery & Gourmet Food › Pantry Staples › Oils › Olive",
        "olive oil",
        ["extra virgin", "cold pressed", "non gmo", "gluten free"],
        {"size": ["16.9 fl oz", "33.8 fl oz"]},
        (8, 35),
    ),
    (
        "electronics",
        "wireless earbuds",
        "Electronics › Headphones, Earbuds & Accessories › Earbuds",
        "wireless earbuds",
        ["noise cancelling", "long battery life", "water resistant", "fast charging"],
        {"color": ["black", "white", "blue"]},
        (20, 150),
    ),
    (
        "electronics",
        "usb c cable",
        "Electronics › Computers & Accessories › Cables › USB Cables",
        "usb c cable",
        ["fast charging", "high speed", "braided nylon", "durable"],
        {"size": ["3 ft", "6 ft", "10 ft"], "color": ["black", "white"]},
        (5, 20),
    ),
    (
        "electronics",
        "phone case",
        "Electronics › Cell Phones & Accessories › Cases & Covers",
        "phone case",
        ["shockproof", "slim fit", "wireless charging compatible", "easy install"],
        {"color": ["clear", "black", "pink", "blue"]},
        (7, 30),
    ),
    (
        "electronics",
        "bluetooth speaker",
        "Electronics › Portable Audio & Video › Portable Speakers",
        "bluetooth speaker",
        ["waterproof", "long battery life", "easy carry", "high fidelity"],
        {"color": ["black", "red", "teal"]},
        (25, 120),
    ),
    (
        "garden",
        "desk lamp",
        "Home & Kitchen › Lighting & Ceiling Fans › Lamps & Shades › Desk Lamps",
        "desk lamp",
        ["dimmable", "energy saving", "usb port", "easy assemble"],
        {"color": ["white", "black", "silver"]},
        (18, 70),
    ),
    (
        "garden",
        "throw pillow covers",
        "Home & Kitchen › Bedding › Decorative Pillows › Throw Pillow Covers",
        "throw pillow covers",
        ["machine washable", "living room", "zipper closure", "super soft"],
        {
            "color": ["beige", "navy blue", "grey", "mustard yellow"],
            "size": ["18 x 18 inch", "20 x 20 inch"],
        },
        (9, 30),
    ),
    (
        "garden",
        "office chair",
        "Home & Kitchen › Furniture › Home Office Furniture › Home Office Chairs",
        "office chair",
        ["lumbar support", "height adjustable", "easy assemble", "heavy duty"],
        {"color": ["black", "grey", "white"]},
        (60, 250),
    ),
    (
        "garden",
        "storage bins",
        "Home & Kitchen › Storage & Organization › Baskets, Bins & Containers",
        "storage bins",
        ["space saving", "foldable", "easy clean", "heavy duty"],
        {"color": ["grey", "beige", "white"], "size": ["pack of 3", "pack of 6"]},
        (12, 40),
    ),
]
BRANDS = [
    "Acme",
    "Brightly",
    "Cobalt",
    "Dune",
    "Evergreen",
    "Fable",
    "Glint",
    "Harbor",
    "Ivo",
    "Juniper",
]
ADJECTIVES = ["Premium", "Classic", "Everyday", "Deluxe", "Essential", "Pro"]
PER_KIND = 5


def _asin(rng: random.Random) -> str:
    return "B0" + "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ0123456789") for _ in range(8))


def generate(seed: int = 0) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """``(items_shuffle, items_ins_v2, items_human_ins)`` for ``len(KINDS) * 5`` products."""
    rng = random.Random(seed)
    items: list[dict[str, Any]] = []
    ins_v2: dict[str, Any] = {}
    human: dict[str, Any] = {}
    for category, query, product_category, noun, attr_pool, option_dims, (lo, hi) in KINDS:
        for _ in range(PER_KIND):
            asin = _asin(rng)
            attrs = rng.sample(attr_pool, 2)
            dims = {
                name: rng.sample(values, max(1, len(values) - rng.randint(0, 1)))
                for name, values in option_dims.items()
            }
            title = (
                f"{rng.choice(BRANDS)} {rng.choice(ADJECTIVES)} {noun.title()}, {attrs[0].title()}"
            )
            price = round(rng.uniform(lo, hi), 2)
            pricing = (
                f"${price:.2f}" if rng.random() < 0.8 else f"${price:.2f} - ${price * 1.3:.2f}"
            )
            items.append(
                {
                    "asin": asin,
                    "name": title,
                    "category": category,
                    "query": query,
                    "product_category": product_category,
                    "pricing": pricing,
                    "full_description": f"{title}. A {attrs[0]} {noun} that is also {attrs[1]}. "
                    "Made for everyday use.",
                    "small_description": [f"{a.capitalize()}: designed to be {a}." for a in attrs]
                    + [f"Great {noun} for home and travel."],
                    "customization_options": {
                        n: [{"value": v, "image": None} for v in vals] for n, vals in dims.items()
                    },
                    "average_rating": round(rng.uniform(3.0, 5.0), 1),
                    "images": [None],
                    "page": 1,
                }
            )
            ins_v2[asin] = {
                "attributes": attrs,
                "instruction": f"i want a {attrs[0]} {noun}",
                "instruction_attributes": [attrs[0]],
            }
            human[asin] = []
            for k in range(2):
                wanted = attrs[: k + 1]
                opts = [rng.choice(vals) for vals in dims.values()]
                opt_text = " and ".join(f"{v} {n}" for n, v in zip(dims, opts, strict=True))
                human[asin].append(
                    {
                        "asin": asin,
                        "instruction": f"i am looking for a {' and '.join(wanted)} {noun} "
                        f"in {opt_text}.",
                        "instruction_attributes": wanted,
                        "instruction_options": opts,
                    }
                )
    return items, ins_v2, human


def write(out_dir: Path, seed: int = 0) -> list[Path]:
    items, ins_v2, human = generate(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    n = len(items)
    paths = []
    for name, obj in (
        (f"items_shuffle_{n}.json", items),
        (f"items_ins_v2_{n}.json", ins_v2),
        (f"items_human_ins_{n}.json", human),
    ):
        path = out_dir / name
        path.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")
        paths.append(path)
    return paths


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "data"
    for p in write(target):
        print(p)
