"""WebShop: reward terms against hand-computed numbers, the loader on the original schema, search,
pages and full episodes on the shipped catalog."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import crl_gym  # noqa: F401
from crl_gym.envs.webshop import generate
from crl_gym.envs.webshop.catalog import SHIPPED_DATA, WebShopDataError, load_catalog, weight_goals
from crl_gym.envs.webshop.env import WebShopEnv
from crl_gym.envs.webshop.reward import (
    get_reward,
    normalize_color,
    ratio,
    token_set_ratio,
    type_reward,
)
from crl_gym.envs.webshop.search import BM25Index

PRODUCT: dict[str, Any] = {
    "asin": "B000000001", "name": "Fluoride Free Mint Toothpaste", "Title": "Fluoride Free Mint Toothpaste",
    "query": "toothpaste", "product_category": "Beauty › Oral Care › Toothpaste",
    "Attributes": ["long-lasting"], "BulletPoints": ["Whitens teeth"], "Description": "A fresh paste.",
}
GOAL: dict[str, Any] = {
    "query": "toothpaste", "product_category": "Beauty › Oral Care › Toothpaste",
    "name": "Fluoride Free Mint Toothpaste", "attributes": ["long lasting", "fluoride free"],
    "goal_options": ["mint", "large"], "price_upper": 20.0,
}


# -- fuzzy matching ---------------------------------------------------------------------------
def test_fuzzy_ratios_by_hand() -> None:
    # LCS("of pack", "of pack 3") = 7 -> 2*7/(7+9) = 0.875 -> 88
    assert ratio("of pack", "of pack 3") == 88
    # tokens {pack, of, 2} vs {pack, of, 12}: "of pack 12" vs "of pack 2": LCS 9 -> 18/19 -> 95
    assert token_set_ratio("pack of 2", "pack of 12") == 95
    # "large" vs "small": no shared token; LCS 1 ("l" or "a") -> 2/10 -> 20
    assert token_set_ratio("large", "small") == 20
    assert token_set_ratio("Long-Lasting", "long lasting") == 100  # punctuation is dropped
    assert normalize_color("navy blue | white") == "blue"  # first COLOR_SET hit, in list order
    assert normalize_color("16 fl oz") == "16 fl oz"


# -- reward -------------------------------------------------------------------------------------
def test_reward_attribute_option_price_by_hand() -> None:
    d = get_reward(PRODUCT, GOAL, price=15.0, options={"flavor": "mint", "size": "small"})
    # attributes: "long lasting" ~ "long-lasting" (100 > 85); "fluoride free" in the title -> 2/2
    # options: "mint" matches, "large" vs "small" = 20 -> 1/2;  price 15 <= 20 -> 1
    # r = r_type * (2 + 1 + 1) / (2 + 2 + 1) = 1.0 * 4/5
    assert (d.num_attr_matches, d.num_option_matches, d.r_price) == (2, 1, True)
    assert d.r_type == 1.0 and d.query_match and d.category_match
    assert math.isclose(d.reward, 0.8)
    # too expensive and no options chosen: (2 + 0 + 0) / 5 = 0.4
    assert math.isclose(get_reward(PRODUCT, GOAL, price=25.0, options={}).reward, 0.4)
    # everything right: (2 + 2 + 1) / 5 = 1.0; goal options may also be a name -> value dict
    goal = GOAL | {"goal_options": {"flavor": "mint", "size": "large"}}
    assert get_reward(PRODUCT, goal, 20.0, {"flavor": "mint", "size": "large"}).reward == 1.0


def test_type_reward_levels_by_hand() -> None:
    other = {"query": "hair gel", "product_category": "Beauty › Hair Care › Gel"}
    # goal nouns: toothpaste, mint, paste, tube, whitening, gel (6); product shares "gel" -> 1/6
    # no query match, categories share only "Beauty" (< 2), 1/6 = 0.167 is not > 0.2 -> 0.5
    goal = {"query": "toothpaste", "product_category": "Beauty › Oral Care › Toothpaste",
            "name": "Toothpaste Mint Paste Tube Whitening Gel"}
    r_type, q, c, score = type_reward(other | {"name": "Styling Gel"}, goal)
    assert (r_type, q, c) == (0.5, False, False) and math.isclose(score, 1 / 6)
    # 1 of 11 nouns shared: 0.0909 < 0.1 -> 0.1
    goal11 = goal | {"name": "toothpaste mint paste tube whitening gel cavity enamel breath foam brush"}
    assert type_reward(other | {"name": "Styling Gel"}, goal11)[0] == 0.1
    # no shared noun -> 0, even with matching query: the reward is then 0 whatever else matches
    assert type_reward(PRODUCT | {"name": "Hair Gel"}, GOAL)[0] == 0.0
    assert get_reward(PRODUCT | {"name": "Hair Gel"}, GOAL, 1.0, {"a": "mint", "b": "large"}).reward == 0.0
    # query matches and 1/3 > 0.2 noun overlap -> 1.0
    assert type_reward(PRODUCT | {"name": "Mint Gel"}, GOAL)[0] == 1.0


# -- search -------------------------------------------------------------------------------------
def test_bm25_score_by_hand() -> None:
    idx = BM25Index(["a b", "a c c"])
    # "c": N=2, df=1 -> idf = ln(1 + (2-1+0.5)/(1+0.5)) = ln 2
    # doc 1: tf=2, |d|=3, avgdl=2.5 -> K = 0.9*(0.6 + 0.4*3/2.5) = 0.972
    # score = ln2 * 2 * 1.9 / (2 + 0.972) = 0.886219...
    assert math.isclose(idx.scores("c")[1], math.log(2) * 3.8 / 2.972, rel_tol=1e-12)
    assert idx.search("c") == [1] and idx.search("a") == [0, 1]  # shorter doc wins the tie in tf


# -- loader on WebShop's real schema -------------------------------------------------------------
def _raw(asin: str, **kw: Any) -> dict[str, Any]:
    base = {"asin": asin, "name": "Acme Green Tea", "full_description": "Tea.", "small_description": "Organic",
            "pricing": "$10.00 - $20.00", "product_category": "Grocery › Tea", "category": "grocery",
            "query": " Green Tea ", "images": ["x"], "average_rating": 4.5,
            "customization_options": {"Size": [{"value": "20/Pack", "image": None}], "Color": None}}
    return base | kw


def test_loader_reads_original_schema(tmp_path: Path) -> None:
    items = [_raw("B000000001"), _raw("B000000001"), _raw("nan"), _raw("B000000002", pricing="")]
    (tmp_path / "items_shuffle_1000.json").write_text(json.dumps(items))
    (tmp_path / "items_ins_v2_1000.json").write_text(json.dumps(
        {"B000000001": {"attributes": ["usda organic"], "instruction": "i want tea", "instruction_attributes": ["usda organic"]}}))
    (tmp_path / "items_human_ins.json").write_text(json.dumps({
        "B000000001": [{"asin": "B000000001", "instruction": "I need organic green tea.",
                        "instruction_attributes": ["usda organic"], "instruction_options": ["20 | pack"]},
                       {"asin": "B000000001", "instruction": "tea", "instruction_attributes": []}]}))
    cat = load_catalog(tmp_path)
    p = cat.by_asin["B000000001"]
    assert p["pricing"] == [10.0, 20.0] and p["price_tag"] == "$10.0 to $20.0"
    assert p["options"] == {"size": ["20 | pack"]} and p["query"] == "green tea"
    assert p["BulletPoints"] == ["Organic"] and p["Attributes"] == ["usda organic"]
    assert cat.by_asin["B000000002"]["Attributes"] == ["DUMMY_ATTR"] and cat.prices["B000000002"] == 100.0
    assert 10.0 <= cat.prices["B000000001"] <= 20.0
    assert dict(cat.skipped) == {"duplicate_asin": 1, "bad_asin": 1, "instruction_without_attributes": 1}
    (g,) = cat.goals
    # price caps come from the 10-dollar grid above the price: two of the next four, larger kept
    assert g["price_upper"] in (30.0, 40.0, 50.0) and g["instruction_text"].startswith("I need organic green tea, and price lower than")
    synthetic = load_catalog(tmp_path, human=False).goals
    assert [s["instruction_text"].split(",")[0] for s in synthetic] == ["i want tea with size: 20 | pack"]
    with pytest.raises(WebShopDataError, match="items_human_ins"):
        (tmp_path / "items_human_ins.json").unlink()
        load_catalog(tmp_path)


def test_goal_weights_by_attribute_rarity() -> None:
    goals: list[dict[str, Any]] = [{"attributes": ["a"]}, {"attributes": ["a", "b"]}, {"attributes": ["c"]}]
    weight_goals(goals)
    # counts: a=2, b=1, c=1 -> (1/2), (1/2 + 1)/2 = 0.75, 1
    assert [g["weight"] for g in goals] == [0.5, 0.75, 1.0]


def test_shipped_catalog_is_the_generator_output(tmp_path: Path) -> None:
    for path in generate.write(tmp_path):
        assert path.read_text() == (SHIPPED_DATA / path.name).read_text()
    cat = load_catalog(SHIPPED_DATA)
    assert len(cat.products) == 100 and len(cat.goals) == 200


# -- the env ----------------------------------------------------------------------------------
def play_goal(env: WebShopEnv, seed: int) -> tuple[float, dict[str, Any], int]:
    """Scripted policy: search the goal's query, page to its product, pick its options, buy."""
    _, info = env.reset(seed=seed)
    goal = env.goal
    obs, _, _, _, info = env.step(f"search[{goal['query']} {' '.join(goal['attributes'])}]")
    target = f"click[{goal['asin'].lower()}]"
    while target not in info["admissible_actions"]:
        obs, _, _, _, info = env.step("click[next >]")
    env.step(target)
    for value in goal["goal_options"]:
        env.step(f"click[{value}]")
    _, reward, terminated, _, info = env.step("click[buy now]")
    assert terminated
    return reward, info, info["turn"]


def test_scripted_policy_succeeds_on_shipped_goals() -> None:
    env = WebShopEnv(max_turns=30)
    for seed in range(8):
        reward, info, _ = play_goal(env, seed)
        assert reward == 1.0 and info["success"] is True, info


def test_pages_navigation_and_invalid_actions() -> None:
    env = WebShopEnv(render_mode="ansi")
    obs, info = env.reset(seed=1)
    assert info["admissible_actions"] == ["search[<query>]"] and info["task"] in obs
    obs, r, *_ , info = env.step("click[buy now]")  # no such button on the search page
    assert obs.startswith("Invalid action: 'click[buy now]'. Valid actions: search[<query>]") and r == 0.0
    obs, *_, info = env.step("search[shoes tea pillow cable lamp]")
    assert "Page 1 (Total results: " in obs and "click[next >]" in info["admissible_actions"]
    assert "click[< prev]" not in info["admissible_actions"]
    first_page = obs
    obs, *_, info = env.step("click[Next >]")  # labels are case-insensitive
    assert "Page 2" in obs and "click[< prev]" in info["admissible_actions"] and not info["invalid_action"]
    obs, *_, info = env.step("click[< prev]")
    assert obs == first_page
    obs, *_, info = env.step("search[again]")  # the search bar is gone on result pages
    assert obs.startswith("Invalid action") and first_page in obs and info["invalid_action"] is True
    asin = next(a for a in info["admissible_actions"] if a.startswith("click[b0"))
    obs, *_, info = env.step(asin)
    assert "Buy Now" in obs and "click[description]" in info["admissible_actions"]
    item_page = obs
    for detail in ("description", "features", "reviews"):
        obs, *_, info = env.step(f"click[{detail}]")
        assert info["admissible_actions"] == ["click[back to search]", "click[< prev]"]
        obs, *_ = env.step("click[< prev]")
        assert obs == item_page
    assert env.render() == item_page
    obs, *_, info = env.step("click[back to search]")
    assert info["page"] == "search" and info["turn"] == 13


def test_turn_limit_truncates_without_reward() -> None:
    env = WebShopEnv(max_turns=2)
    env.reset(seed=0)
    assert env.step("search[tea]")[3] is False
    _, reward, terminated, truncated, info = env.step("click[back to search]")
    assert truncated and not terminated and reward == 0.0 and info["success"] is False


def test_wrong_product_scores_partially() -> None:
    env = WebShopEnv()
    env.reset(options={"goal": 0})
    goal = env.goal
    obs, *_, info = env.step(f"search[{goal['query']}]")
    other = next(a for a in info["admissible_actions"] if a.startswith("click[b0") and goal["asin"].lower() not in a)
    env.step(other)
    _, reward, terminated, _, info = env.step("click[buy now]")
    d = info["reward_details"]
    expected = d["r_type"] * (d["num_attr_matches"] + d["num_option_matches"] + d["r_price"]) / (
        d["num_attrs"] + d["num_options"] + 1)
    assert terminated and reward == pytest.approx(expected) and reward < 1.0 and info["success"] is False
    assert d["num_option_matches"] == 0  # nothing was chosen


def test_seeding_and_env_checker() -> None:
    env = WebShopEnv()
    check_env(env.unwrapped)
    a = [env.reset(seed=4)[0], env.step("search[coffee]")[0]]
    b = [env.reset(seed=4)[0], env.step("search[coffee]")[0]]
    assert a == b
    assert len({env.reset(seed=s)[1]["task"] for s in range(20)}) > 10


def test_data_dir_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("WEBSHOP_DATA", str(tmp_path / "missing"))
    with pytest.raises(WebShopDataError, match=r"WEBSHOP_DATA.*docs/environments.md#webshop"):
        WebShopEnv()
    monkeypatch.delenv("WEBSHOP_DATA")
    assert WebShopEnv().data_dir == SHIPPED_DATA
    with pytest.raises(WebShopDataError, match="items_shuffle"):
        WebShopEnv(data_dir=tmp_path)
    with pytest.raises(WebShopDataError, match="split 'train'"):
        WebShopEnv(split="train")  # the shipped pool has 200 goals, train starts at 1500


def test_registered_id() -> None:
    env = gym.make("crl/WebShop-v0", max_turns=5)
    obs, info = env.reset(seed=0)
    assert obs.startswith("WebShop [SEP]") and info["task"]
    env.close()
