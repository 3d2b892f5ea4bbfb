"""Retrieval diversification (paper, App. B): re-rank an over-fetched candidate pool by

    s(m) = s_rank(m) − λ · log(1 + c(m)) − 1[recent(m)]

where s_rank is the cosine similarity to the query, c(m) the retrieval count and recent(m) means
m was retrieved within the recency window. Pure functions over numpy arrays.

>>> import numpy as np
>>> diversity_scores(np.array([0.9, 0.8]), np.array([3, 0]), np.array([True, False]), lam=0.5)
array([-0.79314718,  0.8       ])
"""

from __future__ import annotations

import numpy as np


def is_recent(last_retrieved: np.ndarray, now: float, window: float) -> np.ndarray:
    """bool[n]: retrieved (last > 0) less than ``window`` before ``now``."""
    last = np.asarray(last_retrieved, dtype=np.float64)
    return (last > 0) & (now - last < window)


def diversity_scores(
    similarity: np.ndarray, counts: np.ndarray, recent: np.ndarray, lam: float
) -> np.ndarray:
    """s(m) for n candidates: ``similarity`` float[n], ``counts`` int[n], ``recent`` bool[n]."""
    sim = np.asarray(similarity, dtype=np.float64)
    return sim - lam * np.log1p(np.asarray(counts, dtype=np.float64)) - np.asarray(recent, float)


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
    """Indices (into the pool) of the top-``k`` candidates by s(m), best first.

    Ties keep pool order (more similar first) thanks to a stable sort.
    """
    scores = diversity_scores(similarity, counts, is_recent(last_retrieved, now, window), lam)
    order = np.argsort(-scores, kind="stable")
    return order[:k]
