"""The authors' retrieval knobs and ours: top-1 dropout, the utility term of s(m), a bounded bank
with FIFO / least-useful eviction (and a restart after eviction). Numbers worked out by hand."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest

from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.config import ManagerConfig
from crl_gym.experience.diversify import RankOptions, rerank, utility_term
from crl_gym.experience.embedders import HashingEmbedder
from crl_gym.experience.eviction import least_useful_victims
from crl_gym.experience.manager import ExperienceManager
from crl_gym.protocol import AddOp

EMB = HashingEmbedder(64)


# ------------------------------------------------------------------ top-1 dropout


class _Draws(random.Random):
    """A ``random.Random`` whose ``random()`` answers the given values in turn."""

    def __init__(self, values: list[float]) -> None:
        super().__init__(0)
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0)


def test_dropout_demotes_a_recent_top_candidate_with_its_probability() -> None:
    pool = [(1, 0.9), (2, 0.8), (3, 0.7)]
    stats = {1: (0, 95.0), 2: (0, 0.0), 3: (0, 0.0)}  # 1 retrieved 5 s ago (recent), 2 and 3 never
    opts = RankOptions(top1_dropout=0.5)
    # s: 1 → 0.9 − 1 = −0.1, 2 → 0.8, 3 → 0.7: ranking 2, 3, 1; the top (2) is not recent: no draw made
    draws = _Draws([0.0])
    assert rerank(pool, stats, k=3, now=100.0, lam=0.0, window=10.0, options=opts, rng=draws) == [2, 3, 1]
    assert draws.values == [0.0]
    # the top is recent once 2 and 3 are recent too (penalties equal): ranking 1, 2, 3
    stats = {1: (0, 95.0), 2: (0, 96.0), 3: (0, 97.0)}
    assert rerank(pool, stats, k=1, now=100.0, lam=0.0, window=10.0, options=opts, rng=_Draws([0.49])) == [2]
    assert rerank(pool, stats, k=1, now=100.0, lam=0.0, window=10.0, options=opts, rng=_Draws([0.5])) == [1]
    assert rerank(pool, stats, k=3, now=100.0, lam=0.0, window=10.0, options=opts, rng=_Draws([0.1])) == [2, 3, 1]
    # off (the default): never drawn
    assert rerank(pool, stats, k=1, now=100.0, lam=0.0, window=10.0, rng=_Draws([])) == [1]


def test_dropout_rate_over_many_draws() -> None:
    pool, stats = [(1, 0.9), (2, 0.8)], {1: (0, 99.0), 2: (0, 99.0)}
    rng = random.Random(3)
    picks = [rerank(pool, stats, k=1, now=100.0, lam=0.0, window=10.0, options=RankOptions(top1_dropout=0.3),
                    rng=rng)[0] for _ in range(4000)]
    share = picks.count(2) / len(picks)
    assert abs(share - 0.3) < 4 * math.sqrt(0.3 * 0.7 / 4000)  # within 4 standard errors


# ------------------------------------------------------------------ utility term


def test_utility_term_by_hand() -> None:
    # pool credits: entry 1 r̄ = +1 over 3 episodes, entry 2 r̄ = −1 over 1, entry 3 never; N = 4
    # u(1) = 0.5·(1 + 2·sqrt(ln 5 / 4)) = 0.5 + sqrt(1.609438/4) = 0.5 + 0.634318 = 1.134318
    # u(2) = 0.5·(−1 + 2·sqrt(ln 5 / 2)) = −0.5 + 0.897061 = 0.397061
    # u(3) = 0.5·(0 + 2·sqrt(ln 5 / 1)) = 1.268636
    assert utility_term(1.0, 3, 4, 0.5, 2.0) == pytest.approx(1.134318, abs=1e-6)
    assert utility_term(-1.0, 1, 4, 0.5, 2.0) == pytest.approx(0.397061, abs=1e-6)
    assert utility_term(0.0, 0, 4, 0.5, 2.0) == pytest.approx(1.268636, abs=1e-6)
    pool = [(1, 0.50), (2, 0.90), (3, 0.20)]
    stats = {i: (0, 0.0) for i in (1, 2, 3)}
    credit = {1: (1.0, 3), 2: (-1.0, 1)}
    # s = sim + u: 1 → 1.634318, 2 → 1.297061, 3 → 1.468636
    opts = RankOptions(utility_weight=0.5, utility_exploration=2.0)
    assert rerank(pool, stats, k=3, now=0.0, lam=0.0, window=0.0, options=opts, credit=credit) == [1, 3, 2]
    # without the bonus (κ = 0): 1 → 1.0, 2 → 0.4, 3 → 0.2
    opts = RankOptions(utility_weight=0.5, utility_exploration=0.0)
    assert rerank(pool, stats, k=3, now=0.0, lam=0.0, window=0.0, options=opts, credit=credit) == [1, 2, 3]
    # off: similarity alone
    assert rerank(pool, stats, k=3, now=0.0, lam=0.0, window=0.0, credit=credit) == [2, 1, 3]


def test_the_manager_ranks_by_credited_utility_when_asked() -> None:
    bank = ExperienceBank(None, dim=64)
    # two entries for one task; the more similar one failed its episodes, the other won them
    wrong = bank.add("to leave the room walk west", EMB.encode(["to leave the room walk west"])[0])
    right = bank.add("to leave the room go east now", EMB.encode(["to leave the room go east now"])[0])
    bank.record_credits(0, [(wrong, -1.0, 4), (right, 1.0, 4)])
    query = "leave the room walk"
    plain = ExperienceManager(bank, EMB, ManagerConfig(recency_window_s=0, diversity_lambda=0))
    assert plain.search(query)[0].id == wrong
    plain.close()
    cfg = ManagerConfig(recency_window_s=0, diversity_lambda=0, utility_weight=1.0, utility_exploration=0.0)
    ranked = ExperienceManager(bank, EMB, cfg)
    assert ranked.search(query)[0].id == right and ranked.search_many([query])[0][0].id == right
    ranked.close()


# ------------------------------------------------------------------ bounded bank


def _vec(text: str) -> np.ndarray:
    return EMB.encode([text])[0]


def test_fifo_eviction_keeps_bank_index_and_history_consistent_across_a_restart(tmp_path: Path) -> None:
    bank = ExperienceBank(tmp_path, dim=64, capacity=3)
    ids = [bank.add(f"advice number {n}", _vec(f"advice number {n}")) for n in range(5)]
    assert bank.ids() == ids[2:] and bank.evicted_count == 2
    hits = bank.search(np.stack([_vec("advice number 0"), _vec("advice number 4")]), k=5)
    assert all(i in ids[2:] for row in hits for i, _ in row)  # the index holds the kept entries only
    evicted = bank.read_sql("SELECT entry_id, kind, detail FROM entry_events WHERE kind = 'evict' ORDER BY seq")
    assert [(i, k) for i, k, _ in evicted] == [(ids[0], "evict"), (ids[1], "evict")]
    assert '"rule": "fifo"' in evicted[0][2] and "advice number 0" in evicted[0][2]
    bank.close()

    bank = ExperienceBank(tmp_path, dim=64, capacity=3)  # a restart with the same bound
    assert bank.ids() == ids[2:] and bank.index_recoveries == []  # the saved index matches the database
    new = bank.add("advice number 5", _vec("advice number 5"))
    assert bank.ids() == [ids[3], ids[4], new] and new == ids[-1] + 1  # ids are never reused
    assert [i for row in bank.search(_vec("advice number 2")[None], k=5) for i, _ in row] != [] and ids[2] not in bank
    bank.close()
    bank = ExperienceBank(tmp_path, dim=64)  # unbounded reopen: nothing more goes
    assert len(bank) == 3
    bank.close()


def test_least_useful_eviction_goes_by_credited_rbar(tmp_path: Path) -> None:
    bank = ExperienceBank(tmp_path, dim=64)
    a, b, c = (bank.add(t, _vec(t)) for t in ("alpha advice", "beta advice", "gamma advice"))
    bank.record_credits(0, [(a, 1.0, 2), (b, -0.5, 2)])  # c never credited: counts as 0
    assert bank.set_capacity(2, "least_useful") == [b]
    bank.add("delta advice", _vec("delta advice"))  # now c (0, older) goes before a (+1)
    assert c not in bank and a in bank
    bank.close()
    bank = ExperienceBank(tmp_path, dim=64)
    assert len(bank) == 2 and bank.credit_stats([a]) == {a: (1.0, 2)} and bank.credit_stats([b]) == {}
    bank.close()
    assert least_useful_victims([5, 6, 7], 2, {5: (0.2, 1), 6: (0.0, 3)}) == [6, 7]


def test_an_update_in_a_full_bank_evicts_nothing_and_an_updated_entry_is_kept() -> None:
    bank = ExperienceBank(None, dim=64, capacity=2)
    a, b = bank.add("one", _vec("one")), bank.add("two", _vec("two"))
    bank.update(a, "one again", _vec("one again"))
    assert bank.ids() == [a, b]
    from crl_gym.experience.bank import PendingAdd, PendingUpdate
    # a batch that updates a (the oldest) and adds one: b goes, not the entry being updated
    new = bank.apply_batch([PendingAdd("three", _vec("three"))], [PendingUpdate(a, "one more", _vec("one more"))])
    assert bank.ids() == [a, *new]


def test_the_manager_bounds_the_bank_from_its_config() -> None:
    bank = ExperienceBank(None, dim=64)
    manager = ExperienceManager(bank, EMB, ManagerConfig(bank_capacity=2))
    manager.apply_ops([AddOp("walk east"), AddOp("open the door"), AddOp("avoid the lava")])
    assert len(bank) == 2 and [e.text for e in bank] == ["open the door", "avoid the lava"]
    assert [e.text for e in manager.search("walk east", k=2)] != ["walk east"]  # evicted: never answered
    manager.close()
    # one batch of three into a bank of two: its first add is evicted, never stored
    bank2 = ExperienceBank(None, dim=64, capacity=2)
    ids = bank2.apply_batch([{"text": t, "embedding": _vec(t)} for t in ("x one", "x two", "x three")])
    assert bank2.ids() == ids[1:] and not bank2.was_issued(ids[-1] + 1) and bank2.was_issued(ids[0])
    with pytest.raises(ValueError, match="bank_capacity"):
        ManagerConfig(bank_capacity=0)
    with pytest.raises(ValueError, match="top1_dropout"):
        ManagerConfig(top1_dropout=1.5)


def test_the_explorer_timeline_adds_up_after_evictions(tmp_path: Path) -> None:
    from crl_gym.explorer import BankSource
    from crl_gym.explorer.queries import timeline

    bank = ExperienceBank(tmp_path, dim=64, capacity=3)
    for n in range(5):
        bank.apply_batch([{"text": f"entry {n}", "embedding": _vec(f"entry {n}")}], step=n)
    # one batch larger than the bank: its first add is evicted before it is ever stored
    bank.apply_batch([{"text": f"late {n}", "embedding": _vec(f"late {n}")} for n in range(4)], step=5)
    size = len(bank)
    bank.close()
    source = BankSource.open(tmp_path, search=False)
    line = timeline(source)
    assert line["bank_size"][-1] == size == 3 and sum(line["removed"]) == 2 + 3 + 1
