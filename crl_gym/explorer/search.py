"""The search page's ranking: the manager's own diversified top-k, with every candidate's scores.

The same steps as :meth:`crl_gym.experience.manager.ExperienceManager.search`: the query cut to
``max_query_chars`` and embedded, ``overfetch × k`` candidates from the index, re-ranked by
:func:`crl_gym.experience.diversify.rerank` with s(m) = s_rank − λ·log(1 + c(m)) − 1[recent] and the
service's λ, window and clock. Unlike a real search it records no retrieval: looking at the bank
must not change what the next actor is handed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from crl_gym.experience.diversify import diversity_score, rerank, was_recent
from crl_gym.explorer.source import Searcher


def preview(searcher: Searcher, query: str, k: int = 1) -> dict[str, Any]:
    """``{"picked": [ids, best first], "candidates": [...], "settings": {...}}``; each candidate has
    ``id``, ``similarity`` (s_rank), ``retrievals`` (c(m)), ``recent``, ``score`` (s(m)) and
    ``rank`` (1-based among the picked, else None), in pool order (most similar first)."""
    cfg = searcher.config
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    settings = {
        "k": k,
        "overfetch": cfg.overfetch,
        "diversity_lambda": cfg.diversity_lambda,
        "recency_window_s": cfg.recency_window_s,
    }
    if len(searcher.bank) == 0:
        return {"picked": [], "candidates": [], "settings": settings}
    vec = np.asarray(
        searcher.embedder.encode([str(query)[: cfg.max_query_chars]]), dtype=np.float32
    )
    pool = searcher.bank.search(vec, cfg.overfetch * k)[0][: cfg.overfetch * k]
    stats = searcher.bank.retrieval_stats([i for i, _ in pool])
    now = searcher.clock()
    lam, window = cfg.diversity_lambda, cfg.recency_window_s
    picked = rerank(pool, stats, k=k, now=now, lam=lam, window=window)
    rank = {i: n + 1 for n, i in enumerate(picked)}
    candidates = []
    for i, sim in pool:
        if i not in stats:
            continue
        count, last = stats[i]
        recent = was_recent(last, now, window)
        candidates.append(
            {
                "id": int(i),
                "similarity": float(sim),
                "retrievals": int(count),
                "recent": recent,
                "score": diversity_score(sim, count, recent, lam),
                "rank": rank.get(i),
            }
        )
    return {"picked": [int(i) for i in picked], "candidates": candidates, "settings": settings}
