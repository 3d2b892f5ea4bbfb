"""Flat combining: concurrent calls from this process's threads ride one request (:class:`Combiner`,
what :class:`~crl_gym.clients.RemoteClient`'s ``search`` goes through)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar, cast

from crl_gym.experience.batching import BatchLine, answer

T = TypeVar("T")
R = TypeVar("R")


class _Slot(Generic[T, R]):
    """One caller's place in a :class:`Combiner` batch."""

    __slots__ = ("item", "result", "error", "batch", "wake")

    def __init__(self, item: T) -> None:
        self.item = item
        self.result: R | None = None
        self.error: BaseException | None = None
        self.batch: list[_Slot[T, R]] | None = None
        self.wake = threading.Lock()
        self.wake.acquire()  # released once: by the leader that answered it, or to make it lead


class Combiner(Generic[T, R]):
    """Concurrent calls from this process's threads ride one HTTP request (flat combining).

    A caller that finds fewer than ``max_inflight`` batches on the wire sends its own call at
    once; the others queue, and whoever finishes a batch hands the queue (up to ``max_batch``
    calls) to its oldest caller, which sends it as one request. One thread alone pays one round
    trip, as without it; 1,024 env threads that search together cost a handful of
    requests instead of 1,024 (each of which would cost the server and this process far more
    than its share of a batch). ``send(items) -> results`` does one request; a result that is an
    exception is raised to its caller, and when ``send`` raises, every caller of the batch gets it.
    """

    def __init__(
        self, send: Callable[[list[T]], list[R]], max_batch: int = 1024, max_inflight: int = 2
    ) -> None:
        self._send = send
        self.max_batch, self.max_inflight = int(max_batch), int(max_inflight)
        self._line: BatchLine[_Slot[T, R]] = BatchLine(
            self.max_batch, max_inflight=self.max_inflight
        )

    @property
    def waiting(self) -> int:
        """Calls queued behind the batches on the wire."""
        return self._line.waiting

    @property
    def inflight(self) -> int:
        """Batches on the wire."""
        return self._line.inflight

    def __call__(self, item: T) -> R:
        slot: _Slot[T, R] = _Slot(item)
        slot.batch = self._line.offer(slot)
        if slot.batch is None:
            slot.wake.acquire()  # answered, or handed a batch to send (which holds this slot first)
        if slot.batch is not None:
            batch, slot.batch = slot.batch, None
            self._run(batch, slot)
        if slot.error is not None:
            raise slot.error
        return cast(R, slot.result)  # answered without an error: its result is set

    def _run(self, batch: list[_Slot[T, R]], own: _Slot[T, R]) -> None:
        # not isolated: retrying each call alone would send one request per caller to a server that
        # is down
        results = answer(self._send, [s.item for s in batch], isolate=False, catch=BaseException)
        for s, r in zip(batch, results, strict=True):
            if isinstance(r, BaseException):
                s.error = r
            else:
                s.result = r
        nxt = self._line.finish()
        if nxt is not None:
            nxt[0].batch = nxt
            nxt[0].wake.release()
        for s in batch:
            if s is not own:
                s.wake.release()


__all__ = ["Combiner"]
