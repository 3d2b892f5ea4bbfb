"""One bad query fails only its own caller: the fallback of every batcher that shares a search.

The manager's batch workers and the HTTP server's ``/search`` coalescer both run many callers'
queries as one call (:func:`crl_gym.experience.batching.answer`, isolated). If that call raises,
:func:`run_isolated` runs each query alone, so a query the embedder chokes on fails its own caller
and the others still get their answers.

>>> def square_all(xs):
...     if any(x < 0 for x in xs):
...         raise ValueError(f"negative in {list(xs)}")
...     return [x * x for x in xs]
>>> run_isolated(square_all, [1, -2, 3])
[1, ValueError('negative in [-2]'), 9]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def run_isolated(
    run: Callable[[list[T]], Sequence[R]], batch: list[T], *, catch: type[BaseException] = Exception
) -> list[R | BaseException]:
    """``run(batch)``, one result per item; if it raises ``catch``, ``run([item])`` per item, each
    item's exception in its place. A batch of one that fails is not run twice."""
    try:
        return list(run(batch))
    except catch as exc:  # narrowed down per item below
        if len(batch) == 1:
            return [exc]
    out: list[R | BaseException] = []
    for item in batch:
        try:
            out.append(run([item])[0])
        except catch as exc:  # handed to that item's caller
            out.append(exc)
    return out
