"""WebShop's reward (Yao et al., 2022), re-implemented from ``web_agent_site/engine/goal.py``.

For a purchased product with chosen options and price, and a goal::

    r = r_type * (|U_att ∩ Y_att| + |U_opt ∩ Y_opt| + 1[y_price <= u_price])
               / (|U_att| + |U_opt| + 1)

* an attribute matches if a product attribute fuzzy-matches it (token-set ratio > 85) or it is a
  substring of the title, bullet points or description;
* an option matches if a chosen option fuzzy-matches it (after colour normalisation);
* ``r_type`` is 1, 0.5, 0.1 or 0 from query / category / title-noun overlap (see
  :func:`type_reward`).

The original tags nouns with spaCy's ``en_core_web_lg``; that model is not installable from PyPI,
so :func:`title_nouns` approximates nouns as the words left after dropping function words, a few
common adjectives and numbers.
Pass ``nouns=`` to use a real tagger.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# web_agent_site/engine/normalize.py: an option naming one of these colours is that colour
COLOR_SET: tuple[str, ...] = (
    "alabaster",
    "apricot",
    "aqua",
    "ash",
    "asphalt",
    "azure",
    "banana",
    "beige",
    "black",
    "blue",
    "blush",
    "bordeaux",
    "bronze",
    "brown",
    "burgundy",
    "camel",
    "camo",
    "caramel",
    "champagne",
    "charcoal",
    "cheetah",
    "chestnut",
    "chocolate",
    "christmas",
    "coffee",
    "cognac",
    "copper",
    "coral",
    "cranberry",
    "cream",
    "crystal",
    "dark",
    "denim",
    "eggplant",
    "elephant",
    "espresso",
    "fuchsia",
    "gold",
    "granite",
    "grape",
    "graphite",
    "grass",
    "gray",
    "green",
    "grey",
    "heather",
    "indigo",
    "ivory",
    "ivy",
    "khaki",
    "lavender",
    "lemon",
    "leopard",
    "light",
    "lilac",
    "lime",
    "magenta",
    "maroon",
    "mauve",
    "merlot",
    "midnight",
    "mint",
    "mocha",
    "multicolor",
    "mushroom",
    "mustard",
    "natural",
    "navy",
    "nude",
    "olive",
    "orange",
    "peach",
    "pewter",
    "pink",
    "plum",
    "purple",
    "rainbow",
    "red",
    "rose",
    "royal",
    "rust",
    "sand",
    "sapphire",
    "seashell",
    "silver",
    "skull",
    "slate",
    "steel",
    "stone",
    "stonewash",
    "sunflower",
    "tan",
    "taupe",
    "teal",
    "tiger",
    "turquoise",
    "violet",
    "walnut",
    "wheat",
    "white",
    "wine",
    "yellow",
)
FUZZY_THRESHOLD = 85  # goal.py: ``score > 85``

_NON_ALNUM = re.compile(r"[^0-9a-z]+")
_STOP = frozenset(
    "a an the and or of for with in on to by from at as is are be this that these those it its "
    "your you our we i my me up down out over under into onto per very so not no "
    "free long short high low light heavy extra super ultra".split()
)


def _process(text: str) -> str:
    """fuzzywuzzy's ``full_process``: lower case, non-alphanumerics to spaces, stripped."""
    return _NON_ALNUM.sub(" ", text.lower()).strip()


def _lcs(a: str, b: str) -> int:
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b):
            cur.append(prev[j] + 1 if ca == cb else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def ratio(a: str, b: str) -> int:
    """Levenshtein (indel) similarity in 0-100, rounded, as ``fuzz.ratio``.

    >>> ratio("of pack", "of pack 3")   # 2 * 7 / (7 + 9) = 0.875
    88
    """
    if not a or not b:
        return 0
    return int(round(100 * 2 * _lcs(a, b) / (len(a) + len(b))))


def token_set_ratio(a: str, b: str) -> int:
    """``fuzz.token_set_ratio``: compare the shared tokens with each side's full token set.

    >>> token_set_ratio("Long-Lasting", "long lasting")
    100
    >>> token_set_ratio("large", "small")
    20
    """
    ta, tb = set(_process(a).split()), set(_process(b).split())
    if not ta or not tb:
        return 0
    sect = " ".join(sorted(ta & tb))
    ab = (sect + " " + " ".join(sorted(ta - tb))).strip()
    ba = (sect + " " + " ".join(sorted(tb - ta))).strip()
    return max(ratio(sect, ab), ratio(sect, ba), ratio(ab, ba))


def normalize_color(option: str) -> str:
    """An option that names a colour of :data:`COLOR_SET` becomes that colour."""
    for color in COLOR_SET:
        if color in option:
            return color
    return option


def title_nouns(title: str) -> list[str]:
    """Content words of a product name (stand-in for spaCy's NOUN/PROPN tags)."""
    return [w for w in _process(title).split() if len(w) > 1 and w not in _STOP and not w.isdigit()]


@dataclass(frozen=True)
class RewardDetails:
    """Every term of the reward, for logging and tests."""

    reward: float
    r_type: float
    num_attr_matches: int
    num_attrs: int
    num_option_matches: int
    num_options: int
    r_price: bool
    query_match: bool
    category_match: bool
    title_score: float


def type_reward(
    product: Mapping[str, Any],
    goal: Mapping[str, Any],
    nouns: Callable[[str], list[str]] = title_nouns,
) -> tuple[float, bool, bool, float]:
    """``(r_type, query_match, category_match, title_score)`` as in ``get_type_reward``.

    ``title_score`` is the fraction of the goal name's nouns found in the product name. ``r_type``
    is 1 if the query matches, or >= 2 category levels match, or ``title_score > 0.2``; else
    0.5; then 0.1 if ``title_score < 0.1`` and 0 if ``title_score == 0``.
    """
    query_match = product.get("query") == goal.get("query")
    cat_p = {x.strip() for x in str(product.get("product_category", "")).split("›")}
    cat_g = {x.strip() for x in str(goal.get("product_category", "")).split("›")}
    category_match = len(cat_p & cat_g) >= 2
    bought = {w.lower() for w in nouns(str(product.get("name", product.get("Title", ""))))}
    wanted = [w.lower() for w in nouns(str(goal.get("name", "")))]
    title_score = 0.2 if not wanted else len(bought & set(wanted)) / len(wanted)
    r_type = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return r_type, query_match, category_match, title_score


def attribute_matches(product: Mapping[str, Any], goal_attrs: Iterable[str]) -> int:
    """Goal attributes found in the product's attributes (fuzzy) or its texts (substring)."""
    texts = (
        str(product.get("Title", "")).lower(),
        " ".join(product.get("BulletPoints", []) or []).lower(),
        str(product.get("Description", "")).lower(),
    )
    count = 0
    for g_attr in goal_attrs:
        if any(
            token_set_ratio(p_attr, g_attr) > FUZZY_THRESHOLD
            for p_attr in product.get("Attributes", [])
        ):
            count += 1
        elif any(g_attr in t for t in texts):
            count += 1
    return count


def option_matches(chosen: Iterable[str], goal_options: Iterable[str]) -> int:
    """Goal options matched by a chosen option (colours normalised, token-set ratio > 85)."""
    chosen_n = [normalize_color(o) for o in chosen]
    return sum(
        any(token_set_ratio(p, normalize_color(g)) > FUZZY_THRESHOLD for p in chosen_n)
        for g in goal_options
    )


def get_reward(
    product: Mapping[str, Any],
    goal: Mapping[str, Any],
    price: float,
    options: Mapping[str, str],
    nouns: Callable[[str], list[str]] = title_nouns,
) -> RewardDetails:
    """The WebShop reward of buying ``product`` at ``price`` with ``options`` for ``goal``.

    ``goal`` needs ``attributes``, ``goal_options`` (list of values, or a name->value dict),
    ``price_upper``, ``query``, ``product_category`` and ``name``.
    """
    goal_options = goal.get("goal_options") or []
    goal_values = (
        list(goal_options.values()) if isinstance(goal_options, Mapping) else list(goal_options)
    )
    attrs = list(goal.get("attributes") or [])
    r_type, query_match, category_match, title_score = type_reward(product, goal, nouns)
    n_att = attribute_matches(product, attrs)
    n_opt = option_matches(options.values(), goal_values)
    r_price = price <= float(goal.get("price_upper", 1e6))
    total = (n_att + n_opt + int(r_price)) / (len(attrs) + len(goal_values) + 1)
    return RewardDetails(
        reward=total * r_type,
        r_type=r_type,
        num_attr_matches=n_att,
        num_attrs=len(attrs),
        num_option_matches=n_opt,
        num_options=len(goal_values),
        r_price=r_price,
        query_match=query_match,
        category_match=category_match,
        title_score=title_score,
    )
