"""WebShop's pages as text, in the ``[SEP]``-joined form of its ``text`` observation mode.

Each function returns ``(text, clickables)``; ``clickables`` are the lower-cased button labels
that ``click[...]`` accepts on that page.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from crl_gym.envs.webshop.catalog import Product

SEP = " [SEP] "
BACK = "back to search"
NEXT = "next >"
PREV = "< prev"
BUY = "buy now"
DETAILS = ("description", "features", "reviews")


def _head(instruction: str) -> list[str]:
    return ["Instruction:", instruction]


def search_page(instruction: str) -> tuple[str, list[str]]:
    return SEP.join(["WebShop", *_head(instruction), "Search"]), []


def results_page(
    instruction: str, items: list[Product], page: int, total: int, per_page: int
) -> tuple[str, list[str]]:
    parts = [*_head(instruction), "Back to Search", f"Page {page} (Total results: {total})"]
    clickables = [BACK]
    if page > 1:
        parts.append("< Prev")
        clickables.append(PREV)
    if page * per_page < total:
        parts.append("Next >")
        clickables.append(NEXT)
    for p in items:
        parts += [p["asin"], p["Title"], p["price_tag"]]
        clickables.append(p["asin"].lower())
    if not items:
        parts.append("No products match your search.")
    return SEP.join(parts), clickables


def item_page(
    instruction: str, product: Product, selected: dict[str, str]
) -> tuple[str, list[str]]:
    parts = [*_head(instruction), "Back to Search", "< Prev"]
    clickables = [BACK, PREV]
    for name, values in product["options"].items():
        parts.append(name)
        for v in values:
            parts.append(f"[selected] {v}" if selected.get(name) == v else v)
            if v not in clickables:
                clickables.append(v)
    price = product["price_tag"]
    parts += [
        product["Title"],
        f"Price: {price}",
        f"Rating: {product.get('Rating', 'N.A.')}",
        "Description",
        "Features",
        "Reviews",
        "Buy Now",
    ]
    clickables += [*DETAILS, BUY]
    return SEP.join(parts), clickables


def detail_page(instruction: str, product: Product, kind: str) -> tuple[str, list[str]]:
    if kind == "description":
        body = [product.get("Description") or "No description."]
    elif kind == "features":
        body = [b for b in product.get("BulletPoints", []) if b] or ["No features."]
    else:
        reviews = product.get("Reviews") or []
        body = [
            f"{r.get('title', '')} {r.get('score', r.get('stars', ''))} "
            f"{r.get('body', r.get('review', ''))}".strip()
            for r in reviews
            if isinstance(r, dict)
        ] or ["No reviews yet."]
    return SEP.join([*_head(instruction), "Back to Search", "< Prev", *body]), [BACK, PREV]


def done_page(asin: str, options: dict[str, str], reward: float) -> str:
    chosen = ", ".join(f"{k}: {v}" for k, v in options.items()) or "none"
    return SEP.join(
        [
            "Thank you for shopping with us!",
            "Purchased",
            asin,
            f"Options: {chosen}",
            "Your score (min 0.0, max 1.0)",
            f"{reward:.4f}",
        ]
    )
