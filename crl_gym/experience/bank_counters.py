"""The counters a bank keeps beside its entries: retrievals, training, EDGE's utility and r̄(m).

They are statistics, not part of :meth:`~crl_gym.experience.bank.ExperienceBank.apply_batch`'s
atomic batches: each is persisted at once (or, for the manager's hot path, at
:meth:`BankCounters.flush_stats`).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from crl_gym.experience.entry import ExperienceEntry
from crl_gym.experience.rwlock import RWLock
from crl_gym.experience.storage_faults import as_fault
from crl_gym.experience.store import SQLiteStore
from crl_gym.protocol import check_int, finite_float

RETRIEVAL_SQL = "UPDATE entries SET retrieval_count=?, last_retrieved=? WHERE id=?"
log = logging.getLogger(__name__)


class BankCounters:
    """The counters' part of :class:`~crl_gym.experience.bank.ExperienceBank` (which owns the
    state below)."""

    lock: RWLock
    _db_lock: threading.Lock
    _store: SQLiteStore
    _entries: dict[int, ExperienceEntry]
    _dirty_stats: set[int]
    _credit: dict[int, tuple[float, int]]
    """r̄(m) bookkeeping per entry id: (reward sum, episodes)."""
    _last_step: int
    storage_fault: str | None = None
    """Why the bank's last write to disk failed (``"disk full: …"``), ``None`` once one succeeds
    again: what ``health()`` reports while the fault lasts."""
    storage_faults = 0
    """Writes refused for a storage fault since the bank was opened."""

    @contextmanager
    def _storage(self, doing: str) -> Iterator[None]:
        """Run one write to disk: a storage error becomes a :class:`~crl_gym.errors.StorageFault`
        naming its cause and is remembered in :attr:`storage_fault` until a write succeeds."""
        try:
            yield
        except Exception as exc:
            fault = as_fault(exc, doing)
            if fault is None:
                raise
            self.storage_fault = str(fault)
            self.storage_faults += 1
            log.error("bank %s: %s", getattr(self, "path", None), fault)
            raise fault from exc
        if self.storage_fault is not None:
            log.warning(
                "bank %s: writes succeed again (the fault was: %s)",
                getattr(self, "path", None),
                self.storage_fault,
            )
            self.storage_fault = None

    def record_credits(self, step: int, credits: Iterable[tuple[int, float, int]]) -> int:
        """Log r̄(m) of a closed rollout step for each ``(entry id, r̄(m), episodes)`` and fold it
        into the entry's r̄(m) over training (``entry_credit``); returns how many. The service calls
        this as it credits a step: it is the only place r̄(m) is kept once B_φ has used it."""
        rows = [
            (
                int(i),
                finite_float(v, f"record_credits: r̄({i})"),
                check_int(n, f"record_credits: episodes of {i}", low=0),
            )
            for i, v, n in credits
        ]
        if not rows:
            return 0
        with self._db_lock:
            with self._storage(f"recording {len(rows)} credits"):
                n = self._store.record_credits(int(step), rows)
            for i, v, k in rows:
                if i in self._entries:  # the store keeps a row only for an entry still in the bank
                    total, episodes = self._credit.get(i, (0.0, 0))
                    self._credit[i] = (total + v * k, episodes + k)
        self._last_step = max(self._last_step, int(step))
        return n

    def credit_stats(self, ids: Iterable[int]) -> dict[int, tuple[float, int]]:
        """``{id: (r̄(m), credited episodes)}`` for the ids that have been credited (the running r̄(m)
        of :meth:`record_credits`, kept in memory); an id never credited is absent."""
        with self._db_lock:
            out: dict[int, tuple[float, int]] = {}
            for i in ids:
                c = self._credit.get(i)
                if c is not None:
                    out[i] = (c[0] / max(1, c[1]), c[1])
            return out

    def _bump(
        self,
        sql: str,
        ids: Iterable[int],
        fn: Callable[[ExperienceEntry], tuple[Any, ...]],
        persist: bool = True,
    ) -> int:
        # The read lock keeps writers out: an update copies the counters of the entry it
        # replaces, so a concurrent increment on the old object would be lost.
        with self.lock.read(), self._db_lock:
            params: list[tuple[Any, ...]] = []
            for i in ids:
                e = self._entries.get(int(i))
                if e is not None:  # an entry merged away since retrieval is skipped
                    params.append(fn(e))
            if not persist:
                self._dirty_stats.update(p[-1] for p in params)
            elif params:
                with self._storage("updating entry counters"):
                    self._store.update_stats(sql, params)
            return len(params)

    def retrieval_stats(self, ids: Iterable[int]) -> dict[int, tuple[int, float]]:
        """``{id: (retrieval_count, last_retrieved)}`` for the ids that exist."""
        with self._db_lock:
            return {
                i: (e.retrieval_count, e.last_retrieved)
                for i in ids
                if (e := self._entries.get(i)) is not None
            }

    def record_retrieval(self, ids: Iterable[int], now: float, *, persist: bool = True) -> int:
        """c(m) += 1 and last_retrieved = now per occurrence of each id; returns how many.

        ``persist=False`` updates memory now and leaves SQLite to :meth:`flush_stats` (the
        manager's hot path); retrieval counters are statistics, not acknowledged data.
        """
        if not math.isfinite(now):
            raise ValueError(f"record_retrieval: now must be a finite number, got {now!r}")

        def fn(e: ExperienceEntry) -> tuple[Any, ...]:
            e.retrieval_count += 1
            e.last_retrieved = max(e.last_retrieved, float(now))
            return (e.retrieval_count, e.last_retrieved, e.id)

        return self._bump(RETRIEVAL_SQL, ids, fn, persist)

    def flush_stats(self) -> int:
        """Persist retrieval counters recorded with ``persist=False``; returns rows written."""
        with self._db_lock:
            params = [
                (e.retrieval_count, e.last_retrieved, e.id)
                for i in self._dirty_stats
                if (e := self._entries.get(i)) is not None
            ]
            if params and not getattr(self, "_closed", False):
                with self._storage(
                    "saving retrieval counters"
                ):  # a failure keeps them dirty: retried next flush
                    self._store.update_stats(RETRIEVAL_SQL, params)
            self._dirty_stats.clear()
            return len(params)

    def record_training(self, ids: Iterable[int], step: int) -> int:
        """c_train(m) += 1 and t_last(m) = step for each id (the trainer calls this per update)."""

        def fn(e: ExperienceEntry) -> tuple[Any, ...]:
            e.train_count += 1
            e.last_trained_step = max(e.last_trained_step, int(step))
            return (e.train_count, e.last_trained_step, e.id)

        return self._bump(
            "UPDATE entries SET train_count=?, last_trained_step=? WHERE id=?", ids, fn
        )

    def set_utility(self, id: int, value: float) -> None:
        """Set the EDGE EMA utility of ``id`` (``KeyError`` if absent; a NaN or inf value
        is refused)."""
        if int(id) not in self._entries:
            raise KeyError(f"set_utility: no entry with id {id}")
        utility = finite_float(value, f"set_utility({id}): utility")

        def fn(e: ExperienceEntry) -> tuple[Any, ...]:
            e.utility = utility
            return (e.utility, e.id)

        self._bump("UPDATE entries SET utility=? WHERE id=?", [int(id)], fn)
