import math

import numpy as np
import pytest

from crl_gym.experience import diversify
from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.config import ManagerConfig
from crl_gym.experience.diversify import (
    diversity_score,
    diversity_scores,
    is_recent,
    rerank,
    select_diverse,
    was_recent,
)
from crl_gym.experience.embedders import HashingEmbedder
from crl_gym.experience.manager import ExperienceManager


def test_scores_hand_computed() -> None:
    # λ = 0.5; candidates (sim, count, recent):
    #   a: 0.9, c=3, recent -> 0.9 - 0.5*ln(4) - 1 = 0.9 - 0.693147 - 1 = -0.793147
    #   b: 0.8, c=0, no     -> 0.8 - 0 - 0            =  0.8
    #   c: 0.7, c=1, no     -> 0.7 - 0.5*ln(2)        =  0.7 - 0.346574 = 0.353426
    s = diversity_scores(np.array([0.9, 0.8, 0.7]), np.array([3, 0, 1]),
                         np.array([True, False, False]), lam=0.5)
    np.testing.assert_allclose(s, [-0.7931472, 0.8, 0.3534264], atol=1e-6)
    assert math.isclose(s[2], 0.7 - 0.5 * math.log(2))


def test_recent_window() -> None:
    # now = 100, window = 10: last=95 is recent, last=85 is not, 0 means never retrieved
    assert is_recent(np.array([95.0, 85.0, 0.0, 90.5]), 100.0, 10.0).tolist() == [
        True, False, False, True]


def test_select_diverse_prefers_unused_entries() -> None:
    sim = np.array([0.90, 0.85, 0.50])
    # first entry retrieved 9 times and 1 s ago: 0.9 - 0.1*ln(10) - 1 = -0.330; second 0.85
    idx = select_diverse(sim, np.array([9, 0, 0]), np.array([99.0, 0, 0]),
                         k=2, now=100.0, lam=0.1, window=5.0)
    assert idx.tolist() == [1, 2]
    # with λ = 0 and nothing recent the order is by similarity; ties keep pool order
    idx = select_diverse(np.array([0.5, 0.5, 0.7]), np.zeros(3), np.zeros(3),
                         k=3, now=1.0, lam=0.0, window=5.0)
    assert idx.tolist() == [2, 0, 1]


def test_rerank_hand_computed_skips_deleted_and_keeps_pool_order_on_ties() -> None:
    # λ = 0.5, window 10, now 100. Pool (id, sim), most similar first; stats (count, last):
    #   7: 0.9, c=3, last 95 (recent) -> 0.9 - 0.5 ln 4 - 1 = -0.7931
    #   8: 0.8, never retrieved       -> 0.8
    #   9: 0.7, c=1, last 80 (old)    -> 0.7 - 0.5 ln 2    =  0.3534
    #   5: 0.6, deleted (no stats)    -> skipped
    pool = [(7, 0.9), (8, 0.8), (9, 0.7), (5, 0.6)]
    stats = {7: (3, 95.0), 8: (0, 0.0), 9: (1, 80.0)}
    assert rerank(pool, stats, k=4, now=100.0, lam=0.5, window=10.0) == [8, 9, 7]
    assert rerank(pool, stats, k=1, now=100.0, lam=0.5, window=10.0) == [8]
    # equal scores: the earlier (more similar) pool position wins
    assert rerank([(1, 0.5), (2, 0.5)], {1: (0, 0.0), 2: (0, 0.0)}, k=2, now=1.0, lam=0.1, window=1.0) == [1, 2]
    assert math.isclose(diversity_score(0.7, 1, False, 0.5), 0.7 - 0.5 * math.log(2))
    assert math.isclose(diversity_score(0.9, 3, True, 0.5), 0.9 - 0.5 * math.log(4) - 1)
    assert was_recent(95.0, 100.0, 10.0) and not was_recent(0.0, 5.0, 10.0) and not was_recent(85.0, 100.0, 10.0)


def test_array_functions_agree_with_the_scalar_formula() -> None:
    rng = np.random.default_rng(0)
    sim, counts, last = rng.uniform(-1, 1, 20), rng.integers(0, 9, 20), rng.choice([0.0, 95.0, 50.0], 20)
    recent = is_recent(last, 100.0, 30.0)
    expect = [diversity_score(s, c, r, 0.2) for s, c, r in zip(sim.tolist(), counts.tolist(), recent.tolist(), strict=True)]
    np.testing.assert_array_equal(diversity_scores(sim, counts, recent, 0.2), expect)
    order = select_diverse(sim, counts, last, k=5, now=100.0, lam=0.2, window=30.0).tolist()
    assert order == sorted(range(20), key=lambda i: (-expect[i], i))[:5]
    with pytest.raises(ValueError, match="one value per candidate"):
        diversity_scores(sim, counts[:3], recent, 0.2)


def test_the_manager_ranks_with_this_module(monkeypatch: pytest.MonkeyPatch) -> None:
    # One implementation: a different formula here changes what the manager returns.
    emb = HashingEmbedder(32)
    bank = ExperienceBank(None, 32)
    for text in ("open the door with the key", "avoid the lava pools"):
        bank.add(text, emb.encode([text])[0])
    # λ = 0 and no recency window: s(m) = similarity, so the nearest entry wins every time
    with ExperienceManager(bank, emb, ManagerConfig(diversity_lambda=0.0, recency_window_s=0.0)) as mgr:
        for _ in range(2):
            assert [e.text for e in mgr.search_many(["open the door"])[0]] == ["open the door with the key"]
        monkeypatch.setattr(diversify, "diversity_score", lambda sim, count, recent, lam: -sim)
        assert [e.text for e in mgr.search_many(["open the door"])[0]] == ["avoid the lava pools"]
        assert [e.text for e in mgr.search("open the door")] == ["avoid the lava pools"]  # the batched path too
