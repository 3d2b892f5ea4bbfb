"""Loading WebShop's data files and building its goal pool.

Reads the original files (``items_shuffle_1000.json``, ``items_ins_v2_1000.json``,
``items_human_ins.json``; any ``items_shuffle*.json`` / ``items_ins_v2*.json`` /
``items_human_ins*.json`` in the directory) with the processing of
``web_agent_site/engine/engine.py:load_products`` and the goals of ``goal.py``:
``get_human_goals`` (one goal per human instruction) or ``get_synthetic_goals`` (one per
option combination of each templated instruction). Goals are weighted by attribute rarity,
``mean(1 / count(att))`` over a goal's attributes, as WebShop's synthetic pool is.

>>> from crl_gym.envs.webshop.catalog import load_catalog, SHIPPED_DATA
>>> cat = load_catalog(SHIPPED_DATA)
>>> len(cat.products), len(cat.goals) > 100
(100, True)
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, NotRequired, TypedDict

log = logging.getLogger(__name__)

SHIPPED_DATA = Path(__file__).parent / "data"
DATA_ENV_VAR = "WEBSHOP_DATA"
DOCS_SECTION = "docs/environments.md#webshop"
PRICE_RANGE: list[float] = [10.0 * i for i in range(1, 100)]  # goal.py
NO_PRICE_LIMIT = 1_000_000.0


class WebShopDataError(FileNotFoundError):
    """The WebShop data directory or one of its files is missing or malformed."""


class Product(TypedDict):
    """One product in WebShop's processed form (``load_products`` of ``engine.py``)."""

    asin: str
    name: str
    Title: str
    Description: str
    BulletPoints: list[str]
    category: str
    query: str
    product_category: str
    pricing: list[float]
    """One price, or the low and high end of a range."""
    price_tag: str
    options: dict[str, list[str]]
    """Option name (lower case) -> its values."""
    Attributes: list[str]
    instruction_text: str | None
    """The templated instruction of ``items_ins_v2`` (``None`` where it has none)."""
    instruction_attributes: list[str] | None
    Reviews: list[object]
    """As the data file has them (dicts with ``title`` / ``score`` / ``body``, read leniently)."""
    Rating: float | str


class Goal(TypedDict):
    """One goal of the pool (``goal.py``): the product to find, with the attributes, options and
    price cap its instruction asks for."""

    asin: str
    category: str
    query: str
    name: str
    product_category: str
    instruction_text: str
    attributes: list[str]
    price_upper: float
    goal_options: list[str] | dict[str, str]
    """A human goal's option values, or a synthetic goal's option name -> value."""
    weight: NotRequired[float]
    """``mean(1 / count(att))`` over the attributes, set by :func:`weight_goals`."""


RawRecord = Mapping[str, Any]
"""A record of WebShop's data files as parsed, not checked (a malformed product is skipped on the
``KeyError`` / ``TypeError`` its processing raises)."""


@dataclass
class Catalog:
    """Processed products, their sampled prices and the weighted goal pool."""

    products: list[Product]
    by_asin: dict[str, Product]
    prices: dict[str, float]
    goals: list[Goal]
    skipped: Counter[str] = field(default_factory=Counter)
    """Why products or instructions were dropped (``duplicate_asin``, ``bad_asin``, ...)."""


def _find(data_dir: Path, pattern: str, required: bool) -> Path | None:
    hits = sorted(data_dir.glob(pattern))
    if not hits:
        if required:
            raise WebShopDataError(
                f"{data_dir} has no {pattern} file (set {DATA_ENV_VAR} to WebShop's data dir; see "
                f"{DOCS_SECTION})"
            )
        return None
    return hits[0]


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise WebShopDataError(f"cannot read WebShop data file {path}: {exc}") from exc


def parse_pricing(pricing: object) -> tuple[list[float], str]:
    """``"$12.99"`` -> ``([12.99], "$12.99")``; ``"$10.00 - $20.00"`` -> a range; empty -> $100.

    >>> parse_pricing("$10.00 - $20.50")
    ([10.0, 20.5], '$10.0 to $20.5')
    """
    if not pricing:
        return [100.0], "$100.0"
    values: list[float] = []
    for chunk in str(pricing).split("$")[1:]:
        digits = re.sub(r"[^\d.]", "", chunk)
        try:
            values.append(float(Decimal(digits)))
        except InvalidOperation:
            continue
    if not values:
        return [100.0], "$100.0"
    if len(values) == 1:
        return values, f"${values[0]}"
    return values[:2], f"${values[0]} to ${values[1]}"


def process_product(p: RawRecord, attrs: RawRecord) -> Product:
    """One raw product (items_shuffle schema) in WebShop's processed form."""
    pricing, price_tag = parse_pricing(p.get("pricing"))
    options: dict[str, list[str]] = {}
    for name, contents in (p.get("customization_options") or {}).items():
        if contents is None:
            continue
        options[name.lower()] = [
            str(c["value"]).strip().replace("/", " | ").lower() for c in contents
        ]
    bullets = p.get("small_description")
    info = attrs.get(p["asin"], {})
    return {
        "asin": p["asin"],
        "name": p.get("name", ""),
        "Title": p.get("name", ""),
        "Description": p.get("full_description", "") or "",
        "BulletPoints": bullets if isinstance(bullets, list) else [bullets or ""],
        "category": p.get("category", ""),
        "query": str(p.get("query", "")).lower().strip(),
        "product_category": p.get("product_category", ""),
        "pricing": pricing,
        "price_tag": price_tag,
        "options": options,
        "Attributes": info.get("attributes") or ["DUMMY_ATTR"],
        "instruction_text": info.get("instruction"),
        "instruction_attributes": info.get("instruction_attributes"),
        "Reviews": p.get("Reviews") or p.get("reviews") or [],
        "Rating": p.get("average_rating") or "N.A.",
    }


def _price_upper(price: float, rng: random.Random) -> tuple[float, str]:
    price_range = [x for x in PRICE_RANGE if x > price][:4]
    if len(price_range) >= 2:
        _, upper = sorted(rng.sample(price_range, 2))
        return upper, f", and price lower than {upper:.2f} dollars"
    return NO_PRICE_LIMIT, ""


def _goal(
    p: Product,
    text: str,
    attributes: list[str],
    options: list[str] | dict[str, str],
    upper: float,
) -> Goal:
    return {
        "asin": p["asin"],
        "category": p["category"],
        "query": p["query"],
        "name": p["name"],
        "product_category": p["product_category"],
        "instruction_text": text,
        "attributes": list(attributes),
        "price_upper": upper,
        "goal_options": options,
    }


def human_goals(
    products: list[Product],
    human: RawRecord,
    prices: dict[str, float],
    rng: random.Random,
    skipped: Counter[str],
) -> list[Goal]:
    """``get_human_goals``: one goal per human instruction with attributes."""
    goals = []
    for p in products:
        for ins in human.get(p["asin"], []) or []:
            attributes = ins.get("instruction_attributes") or []
            if not attributes or not ins.get("instruction"):
                skipped["instruction_without_attributes"] += 1
                continue
            upper, price_text = _price_upper(prices[p["asin"]], rng)
            text = str(ins["instruction"]).strip(".") + price_text
            goals.append(
                _goal(p, text, attributes, list(ins.get("instruction_options") or []), upper)
            )
    return goals


def synthetic_goals(
    products: list[Product], prices: dict[str, float], rng: random.Random
) -> list[Goal]:
    """``get_synthetic_goals``: every option combination of each templated instruction."""
    goals = []
    for p in products:
        attributes = p.get("instruction_attributes")
        if not p.get("instruction_text") or not attributes:
            continue
        upper, price_text = _price_upper(prices[p["asin"]], rng)
        names = sorted(p["options"])
        for combo in itertools.product(*(p["options"][n] for n in names)):
            chosen = dict(zip(names, combo, strict=True))
            option_text = ", and ".join(f"{k}: {v}" for k, v in chosen.items())
            option_text = f" with {option_text}" if option_text else ""
            text = f"{p['instruction_text']}{option_text}{price_text}"
            goals.append(_goal(p, text, attributes, chosen, upper) | {"name": p["Title"]})
    return goals


def weight_goals(goals: list[Goal]) -> None:
    """Set ``goal["weight"] = mean(1 / count(att))``: rare attributes are drawn more often."""
    counts = Counter(att for g in goals for att in g["attributes"])
    for g in goals:
        g["weight"] = sum(1.0 / counts[a] for a in g["attributes"]) / len(g["attributes"])


def load_catalog(
    data_dir: str | Path, *, human: bool = True, seed: int = 0, num_products: int | None = None
) -> Catalog:
    """Load products and build the goal pool from a WebShop data directory.

    Args:
        data_dir: holds ``items_shuffle*.json`` and ``items_ins_v2*.json`` (and
            ``items_human_ins*.json`` for ``human=True``).
        human: human-written instructions (WebShop's default) or the templated ones.
        seed: fixes product prices within ranges and each goal's price cap, so a catalog
            loads identically every time.
        num_products: keep only the first N products (WebShop's ``num_products``).
    """
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise WebShopDataError(
            f"WebShop data dir {root} does not exist (see {DOCS_SECTION}; variable {DATA_ENV_VAR})"
        )
    raw = _read_json(_find(root, "items_shuffle*.json", True))  # type: ignore[arg-type]
    attrs = _read_json(_find(root, "items_ins_v2*.json", True))  # type: ignore[arg-type]
    if not isinstance(raw, list) or not isinstance(attrs, dict):
        raise WebShopDataError(
            f"{root}: items_shuffle must be a JSON list and items_ins_v2 a JSON object"
        )
    rng = random.Random(seed)
    skipped: Counter[str] = Counter()
    products: list[Product] = []
    seen: set[str] = set()
    for i, p in enumerate(raw[:num_products] if num_products else raw):
        asin = str(p.get("asin", "nan")) if isinstance(p, dict) else "nan"
        if asin == "nan" or len(asin) > 10:
            skipped["bad_asin"] += 1
            continue
        if asin in seen:
            skipped["duplicate_asin"] += 1
            continue
        try:
            products.append(process_product(p, attrs))
        except (KeyError, TypeError, AttributeError) as exc:
            log.warning("WebShop product #%d (%s) skipped: %r", i, asin, exc)
            skipped["malformed_product"] += 1
            continue
        seen.add(asin)
    prices = {}
    for p in products:  # generate_product_prices
        lo_hi = p["pricing"]
        prices[p["asin"]] = lo_hi[0] if len(lo_hi) == 1 else rng.uniform(*lo_hi[:2])
    if human:
        human_path = _find(root, "items_human_ins*.json", True)
        goals = human_goals(products, _read_json(human_path), prices, rng, skipped)  # type: ignore[arg-type]
    else:
        goals = synthetic_goals(products, prices, rng)
    if not goals:
        raise WebShopDataError(f"{root}: no goals with attributes could be built")
    weight_goals(goals)
    if skipped:
        log.info("WebShop catalog %s: skipped %s", root, dict(skipped))
    return Catalog(products, {p["asin"]: p for p in products}, prices, goals, skipped)
