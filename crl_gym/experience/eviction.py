"""Which entries a bank at capacity gives up for new ones (the authors' bounded bank, and a rule of
ours that uses what the bank has learnt about each entry).

* ``fifo``: the oldest entries first (ids grow with insertion, so the smallest ids).
* ``least_useful``: the lowest credited r̄(m) first; an entry never credited counts as r̄ = 0
  (no evidence either way, so it outlives an entry that failed its episodes and goes before one
  that won them); ties go oldest first.

>>> fifo_victims([4, 2, 9, 7], 2)
[2, 4]
>>> least_useful_victims([4, 2, 9, 7], 2, {9: (-1.0, 3), 2: (0.5, 2)})
[9, 4]
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from typing import Literal

Eviction = Literal["fifo", "least_useful"]
EVICTIONS: tuple[str, ...] = ("fifo", "least_useful")


def fifo_victims(ids: Iterable[int], n: int) -> list[int]:
    """The ``n`` oldest (smallest) ids."""
    return heapq.nsmallest(max(0, n), ids)


def least_useful_victims(
    ids: Iterable[int], n: int, credit: Mapping[int, tuple[float, int]]
) -> list[int]:
    """The ``n`` ids of lowest r̄(m) (``credit``: id → (r̄(m), episodes); absent = 0), oldest first
    on ties."""
    return heapq.nsmallest(max(0, n), ids, key=lambda i: (credit[i][0] if i in credit else 0.0, i))


def victims(
    rule: str, ids: Iterable[int], n: int, credit: Mapping[int, tuple[float, int]]
) -> list[int]:
    """``n`` entries to evict among ``ids`` by ``rule`` (one of :data:`EVICTIONS`)."""
    if rule == "fifo":
        return fifo_victims(ids, n)
    if rule == "least_useful":
        return least_useful_victims(ids, n, credit)
    raise ValueError(f"eviction must be one of {EVICTIONS}, got {rule!r}")
