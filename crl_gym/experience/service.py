"""The experience service: one object behind every face (in-process, HTTP, Ray).

A service owns one bank and its :class:`~crl_gym.experience.manager.ExperienceManager`
(retrieval, the distillation queue, op application) and a :class:`StepLedger` of the requests it
received, grouped by rollout step. Whoever drives the actor closes a rollout step with
:meth:`RetrievalService.end_step`; the service then knows every episode of that step.

:class:`RetrievalService` is the service without an extractor: it retrieves, queues requests and
applies ops from outside, and ``end_step`` only closes steps.
``crl_train.service.ExperienceService`` is the same object with the extractor's whole loop behind it
(distil → ops → bank → credit → CISPO → merge): it overrides :meth:`RetrievalService._closed` to
credit the closed steps.

>>> from crl_gym.experience.bank import ExperienceBank
>>> from crl_gym.experience.embedders import HashingEmbedder
>>> from crl_gym.experience.manager import ExperienceManager
>>> from crl_gym.protocol import AddOp, DistillationRequest, Trajectory
>>> emb = HashingEmbedder(32)
>>> service = RetrievalService(ExperienceManager(ExperienceBank(None, dim=32), emb))
>>> service.apply_ops([AddOp("walk east")]).added
1
>>> service.submit(DistillationRequest(task="t", trajectory=Trajectory(), outcome=1.0, success=True,
...                                    experience=None, rollout_step=0))
>>> service.end_step(0).requests
1
>>> service.end_step(0)  # doctest: +NORMALIZE_WHITESPACE
Traceback (most recent call last):
...
crl_gym.experience.service.StepOrderError: end_step(0): step 0 is already ended
    (steps end once, in increasing order)
>>> service.close()
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypedDict

from crl_gym.errors import StorageFault
from crl_gym.experience.manager import ExperienceManager, Refiner
from crl_gym.experience.results import STATS_FIELDS, Health, OpsApplied, ServiceStats, StepEnded
from crl_gym.experience.snapshots import (
    SnapshotInfo,
    list_snapshots,
    restore_snapshot,
    take_snapshot,
)
from crl_gym.experience.write_ids import WriteIds, WriteRecord
from crl_gym.json_types import JSONInput
from crl_gym.protocol import DistillationRequest, ExperienceOp, ExperienceRef

log = logging.getLogger(__name__)


def ask_manager(
    manager: ExperienceManager, query: str, entry: ExperienceRef, context: str
) -> tuple[str, JSONInput | None]:
    """Shared ``ask`` logic of every face (``RetrievalService.ask`` calls it).

    The manager's ``refiner(query, entry, context) -> (text, ExtractorSample | None)`` rewrites
    the entry; without one the raw entry text is the answer. A refiner that fails or returns an
    empty text also falls back to the raw entry (counted in ``manager``-independent
    :data:`ASK_FALLBACKS`), so a broken extractor never costs the agent its answer.
    """
    refiner = manager.refiner
    if refiner is None:
        return entry.text, None
    try:
        text, sample = refiner(query, entry, context)
    except Exception as exc:  # noqa: BLE001 - a broken extractor must not break the episode
        _count_fallback(f"refiner raised {type(exc).__name__}: {exc}")
        return entry.text, None
    if not isinstance(text, str) or not text.strip():
        _count_fallback(f"refiner returned an empty answer ({text!r})")
        return entry.text, None
    return text, (sample.to_dict() if sample is not None else None)


class AskFallbacks(TypedDict):
    """How often ``ask`` answered the raw entry because the refiner failed, and the last reason."""

    count: int
    last_reason: str


ASK_FALLBACKS: AskFallbacks = {"count": 0, "last_reason": ""}
"""How many ``ask`` calls fell back to the raw entry because the refiner failed (per process)."""
_FALLBACK_LOCK = threading.Lock()


def _count_fallback(reason: str) -> None:
    with _FALLBACK_LOCK:
        ASK_FALLBACKS["count"] += 1
        ASK_FALLBACKS["last_reason"] = reason
    log.warning("search_and_ask: returning the raw entry: %s", reason)


class StepOrderError(ValueError):
    """``end_step`` for a step that is already ended (twice, or out of order)."""


@dataclass
class ClosedStep:
    """One rollout step's requests, handed over when the step ends."""

    step: int
    requests: list[DistillationRequest] = field(default_factory=list)
    """The step's requests (empty when the ledger only counts them)."""
    bonus: dict[str, float] = field(default_factory=dict)
    """Extra reward per ``request_id`` added to r(m) (e.g. the perplexity bonus)."""
    count: int = -1
    """How many requests the step received (−1: ``len(requests)``)."""

    def __post_init__(self) -> None:
        if self.count < 0:
            self.count = len(self.requests)


class StepLedger:
    """Requests by rollout step; steps end once each, in increasing order.

    A request without ``rollout_step`` belongs to the open step (the one after the last ended).
    A request for a step that already ended is *late*: it is counted and kept out of every
    credit (its step's rewards were computed without it and are never recomputed). A negative
    step marks an episode of no training step (held-out evaluation): counted, never credited.
    """

    def __init__(self, last_ended: int = -1, *, keep: bool = True) -> None:
        self.last_ended = last_ended
        self.keep = keep
        """Hold each open step's requests until it ends (what credit needs); False only
        counts them."""
        self.late = 0
        self.held_out = 0
        self._open: dict[int, list[DistillationRequest]] = {}
        self._counts: dict[int, int] = {}
        self._lock = threading.Lock()

    def record(self, request: DistillationRequest) -> bool:
        """Add ``request`` to its step; False (and counted) when that step already ended."""
        with self._lock:
            if request.rollout_step is None:
                request.rollout_step = self.last_ended + 1
            step = int(request.rollout_step)
            if step < 0:
                self.held_out += 1
                return False
            if step <= self.last_ended:
                self.late += 1
                return False
            self._counts[step] = self._counts.get(step, 0) + 1
            if self.keep:
                self._open.setdefault(step, []).append(request)
            return True

    def close(self, step: int) -> list[ClosedStep]:
        """End every open step up to ``step``, oldest first.

        Raises :class:`StepOrderError` when ``step`` is not after the last ended step.
        """
        with self._lock:
            if step <= self.last_ended:
                where = (
                    "is already ended"
                    if step == self.last_ended
                    else f"is out of order: step {self.last_ended} already ended"
                )
                raise StepOrderError(
                    f"end_step({step}): step {step} {where} (steps end once, in increasing order)"
                )
            steps = sorted(s for s in self._counts if s <= step)
            closed = [
                ClosedStep(s, self._open.pop(s, []), count=self._counts.pop(s)) for s in steps
            ]
            if not closed or closed[-1].step != step:
                closed.append(ClosedStep(step))
            self.last_ended = step
            return closed

    def open_requests(self) -> int:
        with self._lock:
            return sum(self._counts.values())


class RetrievalService:
    """The service without an extractor (see the module docstring).

    Args:
        manager: the bank's manager; the service closes it (and the bank) in :meth:`close`.
        last_ended: the last rollout step already ended (a resumed run passes its own).
    """

    keeps_requests = False
    """Whether ending a step needs its requests (a subclass that credits them sets it)."""

    def __init__(self, manager: ExperienceManager, *, last_ended: int = -1) -> None:
        self.manager = manager
        self.ledger = StepLedger(last_ended, keep=self.keeps_requests)
        self.counters: dict[str, int] = dict.fromkeys(
            ("submitted", "steps_ended", "ops_applied"), 0
        )
        self.counters["repeated_writes"] = 0
        self.write_ids = WriteIds(manager.bank)
        """Submits and ``apply_ops`` calls applied, by id: a resend of one is answered, not
        applied again."""
        self.reload_write_ids()
        # a write id is checked and applied by one caller at a time; submits and ops apart, so an
        # ops call embedding its texts never holds up a submit
        self._submit_lock = threading.Lock()
        self._ops_lock = threading.Lock()
        self._queue_fault: str | None = (
            None  # why the last submit could not be queued (health reports it)
        )
        self._closed_service = False

    def reload_write_ids(self) -> None:
        """Know the write ids of the bank and the queue as they are now (at start, after a restore):
        the ids kept in memory go, and the queue's own requests count as submitted, which covers a
        kill between queueing a request and storing its id."""
        self.write_ids.forget()
        self.write_ids.remember(
            [WriteRecord(i, "submit") for i in self.manager.queue.pending_ids()], durable=False
        )

    # ---------------------------------------------------------------- retrieval
    @property
    def refiner(self) -> Refiner | None:
        """Rewrites an entry for the actor's own query (``ask``); None answers with the
        raw entry."""
        return self.manager.refiner

    def search(self, query: str) -> ExperienceRef | None:
        hits = self.manager.search(query, k=1)
        return hits[0].ref() if hits else None

    def search_many(self, queries: list[str]) -> list[ExperienceRef | None]:
        if not queries:
            return []
        return [
            hits[0].ref() if hits else None for hits in self.manager.search_many(list(queries), k=1)
        ]

    def ask(self, query: str, entry: ExperienceRef, context: str) -> tuple[str, JSONInput | None]:
        return ask_manager(self.manager, query, entry, context)

    # ---------------------------------------------------------------- requests and steps
    def submit(self, request: DistillationRequest) -> None:
        """Record ``request`` in its rollout step and queue it for distillation (never blocks)."""
        self.submit_many([request])

    def submit_many(self, requests: list[DistillationRequest], *, durable: bool = False) -> int:
        """Queue ``requests`` as one write and record each in its rollout step; returns how many
        were new. A request whose ``request_id`` was submitted before is a resend: counted in
        ``repeated_writes``, not queued again. ``durable`` (the HTTP face): the new ones are on
        disk before this returns; a write that cannot be made durable raises
        :class:`~crl_gym.errors.StorageFault` with none of them queued or recorded."""
        for r in requests:
            if not isinstance(r, DistillationRequest):
                raise TypeError(f"submit expects a DistillationRequest, got {type(r).__name__}")
        with self._submit_lock:
            seen = self.write_ids.seen([r.request_id for r in requests], stored=durable)
            fresh = list({r.request_id: r for r in requests if r.request_id not in seen}.values())
            for r in (
                fresh
            ):  # filed under the open step before it is written, so the queue's copy says which
                if r.rollout_step is None:
                    r.rollout_step = self.ledger.last_ended + 1
            try:
                self.manager.submit_many(
                    fresh, durable=durable
                )  # first: one it cannot take is kept and resent by the caller
            except StorageFault as exc:
                self._queue_fault = str(exc)
                raise
            self._queue_fault = None
            self.write_ids.remember(
                [WriteRecord(r.request_id, "submit") for r in fresh], durable=durable
            )
        for r in fresh:
            self.ledger.record(r)
        self.counters["submitted"] += len(fresh)
        self.counters["repeated_writes"] += len(requests) - len(fresh)
        return len(fresh)

    def get_requests(self, max_n: int, timeout: float = 0.0) -> list[DistillationRequest]:
        """Take up to ``max_n`` queued requests (a trainer that distils on its own)."""
        return list(self.manager.get_requests(max_n, timeout))

    def end_step(self, step: int, bonus: dict[str, float] | None = None) -> StepEnded:
        """Close rollout ``step`` (and any earlier step still open).

        ``bonus`` maps a ``request_id`` of the step to an extra reward for the entry it used.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise StepOrderError(f"end_step: step must be an int >= 0, got {step!r}")
        closed = self.ledger.close(step)
        if bonus:
            closed[-1].bonus = dict(bonus)
        self.counters["steps_ended"] += len(closed)
        credited = self._closed(closed)
        return StepEnded(
            step=step,
            ended=[c.step for c in closed],
            requests=sum(c.count for c in closed),
            credited=credited,
        )

    def _closed(self, closed: list[ClosedStep]) -> int:
        """What ending ``closed`` does; returns how many credits it made. Nothing without
        an extractor."""
        del closed
        return 0

    # ---------------------------------------------------------------- bank writes from outside
    def apply_ops(
        self, ops: Iterable[ExperienceOp], *, step: int | None = None, write_id: str | None = None
    ) -> OpsApplied:
        """Apply Add / Update / Delete / Return ops (seeding a bank, a user's own extractor),
        written by ``user``. ``write_id`` (the client's id of this call): applied at most once; a
        resend of an applied id gets that call's answer back with ``repeated`` set, and nothing
        is applied."""
        at = self.ledger.last_ended + 1 if step is None else step
        if write_id is None:
            res = self.manager.apply_ops(list(ops), step=at)
        else:
            with self._ops_lock:
                prior = self.write_ids.seen([write_id]).get(write_id)
                if prior is not None:
                    self.counters["repeated_writes"] += 1
                    return _ops_answer(prior.result or {})
                res = self.manager.apply_ops(list(ops), step=at, write=WriteRecord(write_id, "ops"))
                self.write_ids.remember(
                    [WriteRecord(write_id, "ops", res.summary())], durable=False
                )  # the bank stored it with the ops
        self.counters["ops_applied"] += 1
        return OpsApplied(
            added=len(res.added),
            added_ids=list(res.added),
            updated=len(res.updated),
            deleted=len(res.deleted),
            returned=res.returned,
            malformed=res.malformed,
        )

    # ---------------------------------------------------------------- snapshots and quarantine
    def snapshot_bank(self, name: str | None = None) -> SnapshotInfo:
        """Snapshot the bank and the queue as ``BANK/snapshots/NAME``
        (:mod:`~crl_gym.experience.snapshots`)."""
        with self._submit_lock, self._ops_lock:
            return take_snapshot(self.manager, name)

    def bank_snapshots(self) -> list[SnapshotInfo]:
        """The bank's snapshots, newest first (none for an in-memory bank)."""
        path = self.manager.bank.path
        return [] if path is None else list_snapshots(path)

    def restore_bank(self, name: str) -> SnapshotInfo:
        """Make the bank and the queue the snapshot ``name``; returns the snapshot of the state
        before (``before-restore-TIME``), which undoes it."""
        with self._submit_lock, self._ops_lock:
            before = restore_snapshot(self.manager, name)
            # a write rolled back by the restore is applied again when resent
            self.reload_write_ids()
            return before

    def quarantine(
        self,
        written_by: str,
        steps: tuple[int | None, int | None] = (None, None),
        *,
        undo: bool = False,
    ) -> list[int]:
        """Hide (``undo``: bring back) what ``written_by`` wrote at steps ``steps`` (see
        :meth:`ExperienceBank.quarantine`); returns the entry ids."""
        with self._ops_lock:
            return self.manager.bank.quarantine(
                written_by, steps, undo=undo
            )  # a new generation: cached pools go

    # ---------------------------------------------------------------- state
    def stats(self) -> ServiceStats:
        """``bank_size``, ``queue_depth``, the step ledger's figures, this service's counters and
        the manager's report (the extractor's figures are 0 without one)."""
        return ServiceStats(
            bank_size=len(self.manager.bank),
            queue_depth=int(self.manager.pending()),
            last_ended_step=self.ledger.last_ended,
            late_requests=self.ledger.late,
            held_out_requests=self.ledger.held_out,
            open_requests=self.ledger.open_requests(),
            submitted=self.counters["submitted"],
            steps_ended=self.counters["steps_ended"],
            ops_applied=self.counters["ops_applied"],
            manager=self.manager.stats(),
            counters={k: v for k, v in self.counters.items() if k not in STATS_FIELDS},
        )

    def health(self) -> Health:
        return Health(
            pending=int(self.manager.pending()),
            storage=self.manager.bank.storage_fault or self._queue_fault,
        )

    def close(self) -> None:
        """Close the manager (queue persisted) and the bank; safe to call twice."""
        if self._closed_service:
            return
        self._closed_service = True
        self.manager.close()
        self.manager.bank.close()

    def __enter__(self) -> RetrievalService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ops_answer(result: dict[str, Any]) -> OpsApplied:
    """The answer of an ``apply_ops`` call as remembered with its write id, marked ``repeated``."""
    added = [int(i) for i in result.get("added_ids", [])]
    return OpsApplied(
        added=len(added),
        added_ids=added,
        updated=len(result.get("updated", [])),
        deleted=len(result.get("deleted", [])),
        returned=int(result.get("returned", 0)),
        malformed=int(result.get("malformed", 0)),
        repeated=True,
    )
