"""Search batching: concurrent callers' items run as one call, each caller gets its own answer.

Three faces batch searches: the manager's batch thread and search workers (threads that block),
the HTTP server's ``/search`` coalescer (asyncio futures, batches run in a thread pool), and the
:class:`~crl_gym.clients.Combiner` of a ``RemoteClient`` (the callers' own threads take turns to
send one HTTP request for all of them). They share two pieces, both here:

* :class:`BatchLine` — the callers' items in arrival order and when a batch leaves: a dispatcher
  thread's :meth:`~BatchLine.next_batch` waits until ``batch_size`` items wait or the first has
  waited ``max_wait_s`` (the manager: 16 or 1 ms); faces without a dispatcher
  :meth:`~BatchLine.start` a batch at once while fewer than ``max_inflight`` are out, and
  :meth:`~BatchLine.finish` one (handing on the next batch, if any waits). A batch holds at most
  ``max_batch`` items.
* :func:`answer` — run a batch once and give each caller its own result or its own error:
  isolated (:func:`~crl_gym.experience.isolation.run_isolated`: a failed batch is retried one item
  at a time, so one bad query fails only its caller), or not, where a retry per item would
  multiply the work that failed (the client: one request per caller to a server that is down).

>>> line = BatchLine(max_batch=2, max_inflight=1)
>>> for q in "abc":
...     _ = line.put(q)
>>> line.start(), line.start(), line.finish(), line.finish(), line.inflight
(['a', 'b'], None, ['c'], None, 0)
>>> answer(lambda xs: [1 / x for x in xs], [1, 0], isolate=True)
[1.0, ZeroDivisionError('division by zero')]
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from crl_gym.experience.isolation import run_isolated

T = TypeVar("T")
R = TypeVar("R")


class BatchLine(Generic[T]):
    """Items waiting to run in a batch, FIFO, and how many batches are out.

    ``max_inflight=None``: no bound (a dispatcher thread hands batches to workers of its own).
    ``adaptive``: a batch from :meth:`next_batch` takes everything waiting (up to ``max_batch``),
    not only ``batch_size``. Thread-safe; :attr:`cond` is the condition a dispatcher waits on.
    """

    def __init__(
        self,
        max_batch: int,
        *,
        max_inflight: int | None = None,
        batch_size: int = 1,
        max_wait_s: float = 0.0,
        adaptive: bool = True,
    ) -> None:
        if max_batch < 1 or batch_size < 1 or (max_inflight is not None and max_inflight < 1):
            raise ValueError(
                f"max_batch, batch_size and max_inflight must be >= 1, got {max_batch}, "
                f"{batch_size}, {max_inflight}"
            )
        self.max_batch, self.max_inflight = int(max_batch), max_inflight
        self.batch_size, self.max_wait_s, self.adaptive = (
            int(batch_size),
            float(max_wait_s),
            adaptive,
        )
        self.cond = threading.Condition(threading.Lock())
        self._waiting: deque[T] = deque()
        self.inflight = 0
        self.closed = False

    @property
    def waiting(self) -> int:
        """Items not yet in a batch."""
        return len(self._waiting)

    def put(self, item: T) -> bool:
        """Queue ``item``; False (nothing queued) once the line is closed. Wakes the dispatcher
        when the line was empty or now holds a full batch."""
        with self.cond:
            if self.closed:
                return False
            self._waiting.append(item)
            if len(self._waiting) in (1, self.batch_size):
                self.cond.notify()
            return True

    def offer(self, item: T) -> list[T] | None:
        """:meth:`put` and :meth:`start` at once: a caller that may send its batch itself."""
        with self.cond:
            self._waiting.append(item)
            return self._start()

    def start(self) -> list[T] | None:
        """The next batch if one may go out (items wait, fewer than ``max_inflight`` out),
        else None."""
        with self.cond:
            return self._start()

    def finish(self) -> list[T] | None:
        """End one batch that was out; the next batch to send in its place, if items wait."""
        with self.cond:
            self.inflight -= 1
            return self._start()

    def release(self) -> None:
        """End one batch that was out, starting none."""
        with self.cond:
            self.inflight -= 1

    def _start(self) -> list[T] | None:
        if not self._waiting or (
            self.max_inflight is not None and self.inflight >= self.max_inflight
        ):
            return None
        self.inflight += 1
        return self._take(len(self._waiting))

    def _take(self, n: int) -> list[T]:
        return [self._waiting.popleft() for _ in range(min(n, self.max_batch, len(self._waiting)))]

    def next_batch(self) -> list[T] | None:
        """Block until a batch is due (``batch_size`` wait, or the first has waited ``max_wait_s``,
        or the line is closing) and take it; None once closed and drained. For one dispatcher
        thread; batches it takes are not counted in :attr:`inflight`."""
        with self.cond:
            while not self._waiting and not self.closed:
                self.cond.wait()
            if not self._waiting:
                return None
            if len(self._waiting) < self.batch_size and not self.closed:
                deadline = time.monotonic() + self.max_wait_s
                while len(self._waiting) < self.batch_size:
                    left = deadline - time.monotonic()
                    if left <= 0 or not self.cond.wait(left):
                        break
            return self._take(len(self._waiting) if self.adaptive else self.batch_size)

    def close(self) -> bool:
        """Refuse new items; the dispatcher drains what waits. False if it was closed already."""
        with self.cond:
            if self.closed:
                return False
            self.closed = True
            self.cond.notify_all()
            return True


def answer(
    run: Callable[[list[T]], Sequence[R]],
    batch: list[T],
    *,
    isolate: bool,
    catch: type[BaseException] = Exception,
) -> list[R | BaseException]:
    """``run(batch)`` once: one result per item, where a result may be an exception for its item
    alone. When ``run`` raises ``catch``: ``isolate`` retries each item alone (its own exception in
    its place); otherwise every item gets the batch's exception. An answer of another length than
    its batch is the batch's failure (a ``ValueError``), so no caller is left without one."""

    def checked(items: list[T]) -> list[R]:
        out = list(run(items))
        if len(out) != len(items):
            raise ValueError(f"a batch of {len(items)} got {len(out)} answers")
        return out

    if isolate:
        return run_isolated(checked, batch, catch=catch)
    try:
        results: list[R | BaseException] = [*checked(batch)]
    except catch as exc:  # the batch's failure is each caller's
        return [exc] * len(batch)
    return results
