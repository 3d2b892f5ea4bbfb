"""WebShop as a ``crl/`` text env: ``search[query]`` and ``click[button]`` over a product catalog.

Pages and buttons follow WebShop's text mode: the search page, result pages (10 per page, 50
results, ``Next >`` / ``< Prev``), an item page with its options, ``Description`` /
``Features`` / ``Reviews`` sub-pages, ``Back to Search`` and ``Buy Now``. Buying ends the episode
with WebShop's reward (:mod:`crl_gym.envs.webshop.reward`); success means reward 1.0.

The catalog is ``data_dir=`` if given, else ``$WEBSHOP_DATA``, else the small generated catalog
shipped with the package (100 products). Goals are drawn from the instruction pool, weighted by
attribute rarity.

>>> from crl_gym.envs.webshop.env import WebShopEnv
>>> env = WebShopEnv()
>>> obs, info = env.reset(seed=0)
>>> obs.startswith("WebShop [SEP] Instruction:")
True
>>> obs, reward, terminated, truncated, info = env.step("search[toothpaste]")
>>> "Total results" in obs
True
"""

from __future__ import annotations

import functools
import os
import random
import re
from dataclasses import asdict
from pathlib import Path
from typing import Literal

import numpy as np

from crl_gym.envs.base import MAX_TEXT, TextEnv, to_charset
from crl_gym.envs.webshop import pages
from crl_gym.envs.webshop.catalog import (
    DATA_ENV_VAR,
    DOCS_SECTION,
    SHIPPED_DATA,
    Catalog,
    Goal,
    Product,
    WebShopDataError,
    load_catalog,
)
from crl_gym.envs.webshop.reward import get_reward
from crl_gym.envs.webshop.search import BM25Index, product_document
from crl_gym.json_types import EnvInfo, EnvOptions, JSONDict
from crl_gym.templates import WEBSHOP_SEARCH_ACTION

ACTION = re.compile(r"^\s*(search|click)\s*\[(.*)\]\s*$", re.IGNORECASE | re.DOTALL)
SEARCH_TEMPLATE = WEBSHOP_SEARCH_ACTION
Split = Literal["all", "train", "eval", "test"]
# web_agent_site: goals shuffled with seed 233; test = [0, 500), eval = [500, 1500), train = rest
SPLIT_BOUNDS: dict[str, tuple[int, int | None]] = {
    "all": (0, None),
    "test": (0, 500),
    "eval": (500, 1500),
    "train": (1500, None),
}


def resolve_data_dir(data_dir: str | Path | None) -> Path:
    """``data_dir``, else ``$WEBSHOP_DATA``, else the shipped catalog; a missing dir is an error."""
    raw = data_dir if data_dir is not None else os.environ.get(DATA_ENV_VAR)
    if raw is None or raw == "":
        return SHIPPED_DATA
    path = Path(raw).expanduser()
    if not path.is_dir():
        raise WebShopDataError(
            f"WebShop data dir {path} (from data_dir= or {DATA_ENV_VAR}) does not exist; put "
            "items_shuffle_1000.json, items_ins_v2_1000.json and items_human_ins.json there. See "
            f"{DOCS_SECTION}."
        )
    return path


@functools.lru_cache(maxsize=4)
def _load(path: str, human: bool, seed: int, num_products: int | None) -> tuple[Catalog, BM25Index]:
    # one catalog + index per process, shared by every env instance (vector envs make many)
    catalog = load_catalog(path, human=human, seed=seed, num_products=num_products)
    return catalog, BM25Index([product_document(p) for p in catalog.products])


class WebShopEnv(TextEnv):
    """WebShop's text interface and reward over a catalog.

    Args:
        data_dir: WebShop data dir (see :func:`resolve_data_dir`).
        max_turns: turn limit (WebShop agents commonly get 15).
        human_goals: human-written instructions (default) or the templated ones.
        split: goal subset as WebShop splits it (``all`` for the shipped catalog).
        catalog_seed: fixes sampled prices and price caps of the catalog.
        results_per_page / max_results: search paging (WebShop: 10 / 50).
        num_products: keep the first N products only.
    """

    def __init__(
        self,
        data_dir: str | Path | None = None,
        max_turns: int = 15,
        render_mode: str | None = None,
        human_goals: bool = True,
        split: Split = "all",
        catalog_seed: int = 0,
        results_per_page: int = 10,
        max_results: int = 50,
        num_products: int | None = None,
    ) -> None:
        super().__init__(max_turns=max_turns, render_mode=render_mode)
        if split not in SPLIT_BOUNDS:
            raise ValueError(f"split must be one of {sorted(SPLIT_BOUNDS)}, got {split!r}")
        self.data_dir = resolve_data_dir(data_dir)
        self.catalog, self.index = _load(
            str(self.data_dir), human_goals, catalog_seed, num_products
        )
        goals = list(self.catalog.goals)
        random.Random(233).shuffle(goals)
        lo, hi = SPLIT_BOUNDS[split]
        self.goals = goals[lo:hi]
        if not self.goals:
            raise WebShopDataError(
                f"split {split!r} of {self.data_dir} has no goals ({len(goals)} in all)"
            )
        w = np.array([g["weight"] for g in self.goals], dtype=np.float64)
        self._weights = w / w.sum()
        self.per_page, self.max_results = results_per_page, max_results
        self.goal: Goal | None = None
        self._page = "search"
        self._page_text = ""
        self._clickables: list[str] = []
        self._results: list[int] = []
        self._result_page = 1
        self._item: Product | None = None
        self._selected: dict[str, str] = {}
        self._done = True
        self._invalid = False
        self._end: EnvInfo = {}
        """The purchase's part of ``info`` (empty until one)."""

    @property
    def instruction(self) -> str:
        return self.goal["instruction_text"] if self.goal is not None else ""

    def reset(
        self, *, seed: int | None = None, options: EnvOptions | None = None
    ) -> tuple[str, EnvInfo]:
        super().reset(seed=seed)
        idx = (options or {}).get("goal")
        if idx is None:
            idx = int(self.np_random.choice(len(self.goals), p=self._weights))
        self.goal = self.goals[int(idx) % len(self.goals)]
        self.turn, self._done, self._end, self._invalid = 0, False, {}, False
        return self._show(*pages.search_page(self.instruction), "search"), self._info()

    def admissible_actions(self) -> list[str]:
        if self._done:
            return []
        listed = [SEARCH_TEMPLATE] if self._page == "search" else []
        return listed + [f"click[{c}]" for c in self._clickables]

    def step(self, action: str) -> tuple[str, float, bool, bool, EnvInfo]:
        if self._done:
            return self._emit("The episode is over; call reset()."), 0.0, True, False, self._info()
        self.turn += 1
        reward, terminated, self._invalid = 0.0, False, False
        m = ACTION.match(str(action))
        kind, arg = (m.group(1).lower(), " ".join(m.group(2).split())) if m else ("", "")
        if kind == "search" and self._page == "search" and arg:
            obs = self._search(arg)
        elif kind == "click" and arg.lower() in self._clickables:
            obs, reward, terminated = self._click(arg.lower())
        else:  # the page does not change; the agent sees the valid actions and the page again
            self._invalid = True
            obs = self._emit(
                self.invalid_action_observation(action, self.admissible_actions())
                + "\n"
                + self._page_text
            )
        truncated = not terminated and self.turn >= self.max_turns
        self._done = terminated or truncated
        return obs, reward, terminated, truncated, self._info()

    # -- page transitions ------------------------------------------------------------------
    def _search(self, query: str) -> str:
        self._results = self.index.search(query, k=self.max_results)
        return self._results_page(1)

    def _results_page(self, page: int) -> str:
        self._result_page = page
        start = (page - 1) * self.per_page
        items = [self.catalog.products[i] for i in self._results[start : start + self.per_page]]
        return self._show(
            *pages.results_page(self.instruction, items, page, len(self._results), self.per_page),
            "results",
        )

    def _item_page(self) -> str:
        assert self._item is not None
        return self._show(*pages.item_page(self.instruction, self._item, self._selected), "item")

    def _click(self, button: str) -> tuple[str, float, bool]:
        if button == pages.BACK:
            self._item, self._selected = None, {}
            return self._show(*pages.search_page(self.instruction), "search"), 0.0, False
        if self._page == "results":
            if button == pages.NEXT:
                return self._results_page(self._result_page + 1), 0.0, False
            if button == pages.PREV:
                return self._results_page(self._result_page - 1), 0.0, False
            self._item = next(p for p in self.catalog.products if p["asin"].lower() == button)
            self._selected = {}
            return self._item_page(), 0.0, False
        assert self._item is not None
        if self._page == "detail":  # only "< prev" is left: back to the item
            return self._item_page(), 0.0, False
        if button == pages.PREV:
            return self._results_page(self._result_page), 0.0, False
        if button in pages.DETAILS:
            return (
                self._show(*pages.detail_page(self.instruction, self._item, button), "detail"),
                0.0,
                False,
            )
        if button == pages.BUY:
            return self._buy()
        for name, values in self._item["options"].items():  # an option value
            if button in values:
                self._selected[name] = button
                break
        return self._item_page(), 0.0, False

    def _buy(self) -> tuple[str, float, bool]:
        assert self._item is not None
        goal = self.goal
        assert goal is not None
        asin = self._item["asin"]
        details = get_reward(self._item, goal, self.catalog.prices[asin], self._selected)
        self._end = {
            "purchased": asin,
            "options": dict(self._selected),
            "reward_details": asdict(details),
            "goal": {
                "asin": goal["asin"],
                "attributes": goal["attributes"],
                "goal_options": goal["goal_options"],
                "price_upper": goal["price_upper"],
            },
        }
        self._clickables = []
        self._page = "done"
        return (
            self._emit(pages.done_page(asin, self._selected, details.reward)),
            details.reward,
            True,
        )

    # -- helpers -----------------------------------------------------------------------------
    def _show(self, text: str, clickables: list[str], page: str) -> str:
        self._page, self._clickables, self._page_text = page, clickables, text
        return self._emit(text)

    def _emit(self, text: str) -> str:
        self._last_obs = to_charset(text)[:MAX_TEXT]
        return self._last_obs

    def _info(self) -> JSONDict:
        info: EnvInfo = {
            "task": self.instruction,
            "admissible_actions": self.admissible_actions(),
            "turn": self.turn,
            "page": self._page,
            "invalid_action": self._invalid,
            "success": bool(self._end and self._end["reward_details"]["reward"] >= 1.0 - 1e-9),
        }
        info.update(self._end)
        return info
