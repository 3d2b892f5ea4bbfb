"""Retrieval diversification (paper, App. B): re-rank an over-fetched candidate pool by

    s(m) = s_rank(m) − λ · log(1 + c(m)) − 1[recent(m)]  [+ u(m)]

where s_rank is the cosine similarity to the query, c(m) the retrieval count and recent(m) means
m was retrieved within the recency window. Two options beyond the paper, both off by default:

* top-1 dropout (the authors' code, ``diversity_dropout_p``): with probability p the best
  candidate, when it was itself retrieved within the recency window, goes to the end of the
  ranking, so a group's copies do not all see one entry;
* utility (ours): u(m) = β · (r̄(m) + κ · sqrt(ln(1 + N) / (1 + n(m)))), with r̄(m) the entry's
  credited mean ±1 outcome (0 before any credit), n(m) its credited episodes and N the sum of
  n over the pool: a UCB1-style bonus, so an entry that won its episodes rises and one never
  tried is still tried (:func:`utility_term`).

The formula lives in :func:`diversity_score` and :func:`was_recent` only; :func:`rerank` is what
:class:`~crl_gym.experience.manager.ExperienceManager` calls per requester (plain Python: pools
are tiny, N×k ≈ 8, and numpy's per-call overhead would dominate at 1,024 requests per batch);
the array functions below apply the same scalar functions element-wise, for analysis and tests.

>>> import numpy as np
>>> diversity_scores(np.array([0.9, 0.8]), np.array([3, 0]), np.array([True, False]), lam=0.5)
array([-0.79314718,  0.8       ])
>>> rerank([(7, 0.9), (8, 0.8)], {7: (3, 99.0), 8: (0, 0.0)}, k=1, now=100.0, lam=0.5, window=10.0)
[8]
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


def was_recent(last_retrieved: float, now: float, window: float) -> bool:
    """1[recent(m)]: retrieved (``last > 0``; 0 means never) less than ``window`` s
    before ``now``."""
    return last_retrieved > 0 and now - last_retrieved < window


def diversity_score(similarity: float, count: float, recent: bool, lam: float) -> float:
    """s(m) of one candidate: ``similarity − lam·log(1 + count) − recent``."""
    return similarity - lam * math.log1p(count) - (1.0 if recent else 0.0)


def utility_term(
    rbar: float, episodes: int, total: int, weight: float, exploration: float
) -> float:
    """u(m) = ``weight`` · (r̄(m) + ``exploration`` · sqrt(ln(1 + total) / (1 + episodes))).

    >>> round(utility_term(0.5, 3, 5, weight=1.0, exploration=1.0), 6)  # 0.5 + sqrt(ln 6 / 4)
    1.169283
    """
    return weight * (rbar + exploration * math.sqrt(math.log1p(total) / (1 + episodes)))


@dataclass(frozen=True)
class RankOptions:
    """The optional parts of the ranking (both off by default; see the module docstring)."""

    top1_dropout: float = 0.0
    """p: probability that a recently retrieved best candidate goes to the end of the ranking."""
    utility_weight: float = 0.0
    """β of u(m); 0 leaves s(m) as the paper's."""
    utility_exploration: float = 1.0
    """κ of u(m): the weight of the bonus of rarely credited entries."""


def rerank(
    pool: Sequence[tuple[int, float]],
    stats: Mapping[int, tuple[float, float]],
    *,
    k: int,
    now: float,
    lam: float,
    window: float,
    options: RankOptions | None = None,
    credit: Mapping[int, tuple[float, int]] | None = None,
    rng: random.Random | None = None,
) -> list[int]:
    """Ids of the top-``k`` of ``pool`` (``(id, similarity)``, most similar first) by s(m).

    ``stats`` maps id → ``(retrieval_count, last_retrieved)``; a pool id missing from it (deleted
    since the pool was cached) is skipped. Ties keep pool order (the more similar entry first).
    ``options`` adds top-1 dropout (drawn from ``rng``) and u(m), with ``credit`` mapping id →
    ``(r̄(m), credited episodes)`` (an id absent from it was never credited).
    """
    use_utility = options is not None and options.utility_weight != 0.0
    credit = credit or {}
    total = sum(credit[i][1] for i, _ in pool if i in credit) if use_utility else 0
    scored = []
    for pos, (i, sim) in enumerate(pool):
        st = stats.get(i)
        if st is None:
            continue
        score = diversity_score(sim, st[0], was_recent(st[1], now, window), lam)
        if use_utility:
            assert options is not None
            rbar, n = credit.get(i, (0.0, 0))
            score += utility_term(
                rbar, n, total, options.utility_weight, options.utility_exploration
            )
        scored.append((-score, pos, i))
    scored.sort()
    ranked = [i for _, _, i in scored]
    if options is not None and options.top1_dropout > 0 and len(ranked) > 1:
        last = stats[ranked[0]][1]
        if was_recent(last, now, window) and (rng or random).random() < options.top1_dropout:
            ranked = ranked[1:] + ranked[:1]
    return ranked[:k]


def is_recent(last_retrieved: np.ndarray, now: float, window: float) -> np.ndarray:
    """bool[n]: :func:`was_recent` per candidate."""
    last = np.asarray(last_retrieved, dtype=np.float64).reshape(-1)
    return np.fromiter(
        (was_recent(x, now, window) for x in last.tolist()), dtype=bool, count=last.size
    )


def diversity_scores(
    similarity: np.ndarray, counts: np.ndarray, recent: np.ndarray, lam: float
) -> np.ndarray:
    """s(m) for n candidates (:func:`diversity_score` per candidate): ``similarity`` float[n],
    ``counts`` int[n], ``recent`` bool[n]."""
    sim = np.asarray(similarity, dtype=np.float64).reshape(-1).tolist()
    cnt = np.asarray(counts, dtype=np.float64).reshape(-1).tolist()
    rec = np.asarray(recent, dtype=bool).reshape(-1).tolist()
    if not len(sim) == len(cnt) == len(rec):
        raise ValueError(
            f"similarity, counts and recent must have one value per candidate, "
            f"got {len(sim)}, {len(cnt)} and {len(rec)}"
        )
    return np.array(
        [diversity_score(s, c, r, lam) for s, c, r in zip(sim, cnt, rec, strict=True)],
        dtype=np.float64,
    )


def select_diverse(
    similarity: np.ndarray,
    counts: np.ndarray,
    last_retrieved: np.ndarray,
    *,
    k: int,
    now: float,
    lam: float,
    window: float,
) -> np.ndarray:
    """Indices (into the pool) of the top-``k`` candidates by s(m), best first (:func:`rerank`
    over the pool positions, so ties keep pool order)."""
    sim = np.asarray(similarity, dtype=np.float64).reshape(-1).tolist()
    cnt = np.asarray(counts, dtype=np.float64).reshape(-1).tolist()
    last = np.asarray(last_retrieved, dtype=np.float64).reshape(-1).tolist()
    if not len(sim) == len(cnt) == len(last):
        raise ValueError(
            f"similarity, counts and last_retrieved must have one value per candidate, "
            f"got {len(sim)}, {len(cnt)} and {len(last)}"
        )
    pool = list(enumerate(sim))
    stats = dict(enumerate(zip(cnt, last, strict=True)))
    return np.array(rerank(pool, stats, k=k, now=now, lam=lam, window=window), dtype=np.int64)
