"""The extractor's background loop, owned by :class:`~crl_train.service.ExperienceService`.

:class:`BackgroundTrack` drains the manager's distillation queue, prompts the extractor, applies
the parsed ops (each new entry stored with its prompt / response / log-probs), turns the credits
the service hands it when a rollout step ends into rewarded samples in B_φ, runs a CISPO update
when |B_φ| ≥ ``buffer_size`` (then ``bank.record_training``), and runs the chunked Merge when the
service schedules one. ``asynchronous=True`` runs it in its own thread; ``False`` makes the
service run it to idle inside each ``end_step`` (the synchronous baseline of the benchmark).

The extractor is an :class:`~crl_train.extractor.Extractor` (model work in this process) or an
:class:`~crl_train.extractor.ExtractorWorker` (model work in a child process; the default for
asynchronous runs). With the worker this thread only does bank/manager work — applying ops,
embedding new texts, reading training counts, building merge windows — and otherwise waits on
the worker's pipe, so the actor keeps the GIL. Cores on the 2-core machine: the trainer process
runs torch with 1 intra-op thread (the actor's core), the worker with 1 (the extractor's core).

If the worker dies, the loop goes on without extractor model work: the requests, update batches
and merges it had to skip are counted (``skipped_distill``, ``skipped_updates``,
``skipped_merges``; a trainer's trajectories stay in its run's ``trajectories.jsonl``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from crl_gym.experience.manager import ExperienceManager
from crl_gym.experience.merge import merge_bank
from crl_gym.experience.pinning import is_pinned
from crl_gym.json_types import JSONDict
from crl_gym.protocol import (
    GROUP_COPY,
    GROUP_SIZE,
    DistillationRequest,
    ExperienceOp,
    ExtractorSample,
    ReturnOp,
)
from crl_train.extractor import BufferItem, ExtractorBackend, ExtractorUnavailable
from crl_train.service.checkpoint import fault_point

log = logging.getLogger(__name__)


@dataclass
class Credit:
    """Entry ``entry_id`` guided episodes of rollout step ``step`` with mean ±1 outcome ``reward``
    (or, with ``sample``, a search_and_ask refinement credited with its episode's outcome)."""

    step: int
    reward: float
    entry_id: int | None = None
    sample: ExtractorSample | None = None


@dataclass
class Reflection:
    """EDGE: reflect on a low-success category of step ``step``, within the step's entry budget."""

    step: int
    category: str
    failures: list[DistillationRequest]
    successes: list[DistillationRequest]


def _column(name: str | None = None) -> Any:
    """A counter that every metrics row shows, under its own name or ``name``
    (``crl_train.service.service.row_columns`` reads the marks: a new counter is one line here)."""
    return field(default=0, metadata={COLUMN: name})


COLUMN = "metrics_column"
"""Field-metadata key of :class:`TrackStats` counters that are metrics-row columns."""


@dataclass
class TrackStats:
    distilled: int = _column()
    undrawn: int = _column()
    """Requests left undistilled by the draw (``distill_per_group``, ``distill_fraction`` < 1);
    still credited."""
    ungrouped: int = 0
    """Requests ``distill_per_group`` could not place in a group (drawn by
    ``distill_fraction`` instead)."""
    distill_batches: int = _column()
    """Generate calls of distillation (distilled / distill_batches = the mean batch)."""
    added: int = _column()
    updated: int = _column()
    returned: int = 0
    malformed: int = _column()
    refused: int = _column()
    """New entries refused as near-duplicates of the bank's (``dedup_similarity``)."""
    stale: int = _column()
    """Ops on entries that changed after the episode saw them (merged away, pruned): redirected
    or kept as Adds."""
    pinned: int = 0
    """Update / Delete ops on a user's pinned entry (``crl_gym.experience.pinning``): the Update
    kept as an Add, the Delete dropped."""
    credited: int = _column()
    credited_returns: int = 0
    """Return-only answers put into B_φ with ``return_reward`` (0 unless that option is set)."""
    uncreditable: int = _column()
    updates: int = 0
    merges: int = _column()
    merge_failures: int = _column()
    reflections: int = 0
    """EDGE reflections run (low-success categories contrasted)."""
    reflected: int = 0
    """Entries the reflections added."""
    errors: int = _column("track_errors")
    skipped_distill: int = _column()
    """Requests not distilled because the extractor worker is gone."""
    skipped_updates: int = _column()
    """CISPO batches dropped because the extractor worker is gone."""
    unreplayable: int = _column()
    """Samples left out of CISPO updates: their tokens do not replay under their grammar."""
    skipped_merges: int = 0
    """Merges not run because the extractor worker is gone."""
    last_error: str = ""
    """The last failed pass's exception (type and message): what ``errors`` counts, for the progress
    bar and the run's summary."""
    cpu_s: float = 0.0
    """CPU seconds the track's passes took in the service's process (bank and manager work, talking
    to the worker): time taken from the actor loop's core and GIL when both share a process."""
    last_update: dict[str, float] = field(default_factory=dict)
    rewards: list[float] = field(default_factory=list)


def drawn_for_distillation(request: DistillationRequest, fraction: float, seed: int) -> bool:
    """Whether ``request`` is one of the ``fraction`` of requests the extractor distils: a uniform
    number from a hash of the request's content (its id and meta left out, so a resumed run draws
    the same episodes) and ``seed``, below ``fraction``. Identical episodes are drawn together: they
    would give the extractor the same prompt.

    >>> from crl_gym.protocol import Step, Trajectory
    >>> reqs = [DistillationRequest(task=f"task {i}",
    ...                             trajectory=Trajectory(steps=[Step("o", "east", 0.0)]),
    ...                             outcome=0.0, success=False, experience=None)
    ...         for i in range(1000)]
    >>> sum(drawn_for_distillation(r, 0.25, seed=0) for r in reqs)  # about a quarter (sd 14)
    227
    >>> all(drawn_for_distillation(r, 1.0, seed=0) for r in reqs)
    True
    """
    if fraction >= 1:
        return True
    content = {k: v for k, v in request.to_dict().items() if k not in ("request_id", "meta")}
    digest = hashlib.blake2b(
        f"{seed}\n{json.dumps(content, sort_keys=True)}".encode(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


def drawn_in_group(request: DistillationRequest, per_group: int, seed: int) -> bool | None:
    """Whether ``request`` is one of the ``per_group`` copies of its rollout group that the
    extractor distils, or None when the request does not carry its place in the group (``meta`` keys
    :data:`GROUP_COPY` and :data:`GROUP_SIZE`, set by the runner).

    Outcome-blind: the chosen copies depend on the group (env, task seed, rollout step) and
    ``seed``, never on how an episode went. They are spread evenly over the group from a hashed
    offset, so with two per group one is guided and one free (the runner's first half is guided), as
    the paper distils both halves. Every task played gets entries, at ``per_group`` requests per
    group instead of all of them.

    >>> from crl_gym.protocol import Step, Trajectory
    >>> def req(copy):
    ...     return DistillationRequest(task="t",
    ...                                trajectory=Trajectory(steps=[Step("o", "east", 0.0)]),
    ...                                outcome=0.0, success=False, experience=None,
    ...                                env_id="e", seed=3, rollout_step=7,
    ...                                meta={GROUP_COPY: copy, GROUP_SIZE: 8})
    >>> (sum(drawn_in_group(req(c), 1, seed=0) for c in range(8)),
    ...  sum(drawn_in_group(req(c), 2, seed=0) for c in range(8)))
    (1, 2)
    >>> [c for c in range(8) if drawn_in_group(req(c), 2, seed=0)] in ([c, c + 4] for c in range(4))
    True
    >>> lone = DistillationRequest("t", Trajectory(steps=[]), 0.0, False, None)
    >>> drawn_in_group(lone, 1, seed=0) is None
    True
    """
    copy, size = request.meta.get(GROUP_COPY), request.meta.get(GROUP_SIZE)
    if not isinstance(copy, int) or not isinstance(size, int) or not 0 <= copy < size:
        return None
    if per_group >= size:
        return True
    group = f"{seed}\n{request.env_id}\n{request.seed}\n{request.rollout_step}\n{request.task}"
    offset = int.from_bytes(hashlib.blake2b(group.encode(), digest_size=8).digest(), "big") % size
    return copy in {(offset + j * size // per_group) % size for j in range(per_group)}


def is_plain_return(ops: Sequence[ExperienceOp]) -> bool:
    """Whether an answer's ops are well-formed Returns only ("nothing new"): what ``return_reward``
    credits. A malformed answer, which the parser turns into a Return, is not one.

    >>> (is_plain_return([ReturnOp()]), is_plain_return([ReturnOp(malformed=True)]),
    ...  is_plain_return([]))
    (True, False, False)
    """
    return bool(ops) and all(isinstance(op, ReturnOp) and not op.malformed for op in ops)


class BackgroundTrack:
    """See the module docstring."""

    def __init__(
        self,
        manager: ExperienceManager,
        extractor: ExtractorBackend,
        *,
        buffer_size: int = 64,
        distill_batch: int = 8,
        distill_linger_s: float = 2.0,
        train: bool = True,
        distill: bool = True,
        merge_token_budget: int = 6000,
        merge_seeded: bool = False,
        asynchronous: bool = True,
        num_threads: int = 1,
        return_reward: float | None = None,
        distill_fraction: float = 1.0,
        draw_seed: int = 0,
        distill_per_group: int = 0,
    ) -> None:
        self.manager = manager
        self.extractor = extractor
        self.buffer_size = buffer_size
        self.distill_batch = distill_batch
        self.distill_linger_s = distill_linger_s
        self.train = train
        self.distill_on = distill
        self.merge_token_budget = merge_token_budget
        self.merge_seeded = merge_seeded
        self.asynchronous = asynchronous
        self.num_threads = num_threads
        self.return_reward = return_reward
        """The reward a Return-only answer enters B_φ with (None: never credited, the
        paper's rule)."""
        self.distill_fraction = distill_fraction
        """The share of requests distilled (:func:`drawn_for_distillation`; 1: all, the
        paper's rule)."""
        self.draw_seed = draw_seed
        self.distill_per_group = distill_per_group
        """Copies distilled per rollout group (:func:`drawn_in_group`; 0: off,
        ``distill_fraction`` decides)."""
        self.buffer: list[BufferItem] = []
        self.credits: queue.SimpleQueue[Credit] = queue.SimpleQueue()
        self.merge_requests: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.reflections: queue.SimpleQueue[Reflection] = queue.SimpleQueue()
        self.reflection_budget: dict[int, int] = {}
        """New entries reflections may still add, per step (EDGE: up to 3 per step)."""
        self.stats = TrackStats()
        self.actor_step = 0
        """The open rollout step (set by the service): the step of entries from requests
        without one."""
        self.ext_step = 0
        self._stop = threading.Event()
        self._busy = threading.RLock()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self.asynchronous and self._thread is None:
            self._thread = threading.Thread(
                target=self._loop, name="crl-background-track", daemon=True
            )
            self._thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._safe_once(0.05):
                time.sleep(0.01)

    def _safe_once(self, wait: float) -> bool:
        c0 = time.thread_time()
        try:
            return self.run_once(wait=wait)
        except Exception as exc:  # noqa: BLE001 - the track must survive a bad batch (in either mode)
            self.stats.errors += 1
            self.stats.last_error = f"{type(exc).__name__}: {exc}"[:500]
            log.exception("background track: iteration failed (counted; continuing)")
            return False
        finally:
            self.stats.cpu_s += time.thread_time() - c0

    # ---------------------------------------------------------------- work
    def credit(self, credits: list[Credit]) -> None:
        """Called by the service when a rollout step ends (never blocks)."""
        for c in credits:
            self.credits.put(c)

    def request_merge(self, step: int) -> None:
        self.merge_requests.put(step)

    def request_reflections(self, jobs: list[Reflection], budget: int) -> None:
        """Reflections of one step, worst category first; together they add at most
        ``budget`` entries."""
        if jobs:
            self.reflection_budget[jobs[0].step] = budget
            for job in jobs:
                self.reflections.put(job)

    def run_once(self, wait: float = 0.0) -> bool:
        """One pass: distil a batch, turn credits into samples, maybe train, maybe merge."""
        with self._busy:
            worked = False
            if self.distill_on:
                reqs = self._take_requests(wait)
                if reqs:
                    try:
                        self._distill(reqs)
                    except ExtractorUnavailable:
                        self.stats.skipped_distill += len(reqs)
                    worked = True
            else:  # frozen bank: drop requests from the queue so it does not grow
                worked = bool(self.manager.get_requests(self.distill_batch, timeout=wait))
            while True:
                try:
                    c = self.credits.get_nowait()
                except queue.Empty:
                    break
                self._take_credit(c)
                worked = True
            if self.train and len(self.buffer) >= self.buffer_size:
                batch, self.buffer = (
                    self.buffer[: self.buffer_size],
                    self.buffer[self.buffer_size :],
                )
                try:
                    m = self.extractor.update(batch, self.manager.bank, self.ext_step + 1)
                except ExtractorUnavailable:
                    self.stats.skipped_updates += 1
                else:
                    self.stats.unreplayable += int(m.get("unreplayable", 0))
                    self.ext_step += 1
                    self.stats.updates += 1
                    self.stats.last_update = m
                worked = True
            while True:
                try:
                    job = self.reflections.get_nowait()
                except queue.Empty:
                    break
                self._reflect(job)
                worked = True
            try:
                step = self.merge_requests.get_nowait()
            except queue.Empty:
                step = -1
            if step >= 0:
                self._merge(step)
                worked = True
            return worked

    def _take_requests(self, wait: float) -> list[DistillationRequest]:
        """Up to ``distill_batch`` requests that the draw keeps (:meth:`_drawn`). Asynchronously
        (``wait`` > 0) the batch is filled for up to ``distill_linger_s`` after the first request:
        episodes end one by one, and one batched generation of 8 costs about what one of 1 does
        (small models spend it in per-token Python), so distilling them as they trickle in would
        multiply the extractor's CPU time — taken from the actor's core when cores are shared.
        Synchronously, everything pending is taken now."""
        reqs = self._drawn(self.manager.get_requests(self.distill_batch, timeout=wait))
        if wait > 0 and reqs and self.distill_linger_s > 0:
            deadline = time.monotonic() + self.distill_linger_s
            while len(reqs) < self.distill_batch and not self._stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                reqs += self._drawn(
                    self.manager.get_requests(
                        self.distill_batch - len(reqs), timeout=min(left, 0.1)
                    )
                )
        return reqs

    def _drawn(self, reqs: list[DistillationRequest]) -> list[DistillationRequest]:
        """The requests the draw keeps (``distill_per_group``, else ``distill_fraction``); the
        others are counted as ``undrawn``. A request that does not say its place in its group (a
        loop that does not record it) is drawn by ``distill_fraction`` and counted
        as ``ungrouped``."""
        kept = []
        for r in reqs:
            keep = (
                drawn_in_group(r, self.distill_per_group, self.draw_seed)
                if self.distill_per_group
                else None
            )
            if keep is None:
                if self.distill_per_group:
                    if not self.stats.ungrouped:
                        log.warning(
                            "distill_per_group: a request without its place in its group (meta %r, "
                            "%r); such requests are drawn by distill_fraction",
                            GROUP_COPY,
                            GROUP_SIZE,
                        )
                    self.stats.ungrouped += 1
                keep = drawn_for_distillation(r, self.distill_fraction, self.draw_seed)
            if keep:
                kept.append(r)
        self.stats.undrawn += len(reqs) - len(kept)
        return kept

    def run_until_idle(self, max_rounds: int = 10_000) -> None:
        """Synchronous mode: process everything pending now (queue, credits, updates, merge)."""
        for _ in range(max_rounds):
            if not self._safe_once(0.0) and self.manager.pending() == 0:
                return

    def distill_now(self, reqs: list[DistillationRequest]) -> int:
        """Distil ``reqs`` in the caller's thread, under the run's draw, into the bank; returns how
        many were distilled. For held-out evaluation with a live bank
        (``crl-eval --memory online``): no credit follows, so no sample reaches an update."""
        kept = self._drawn(reqs)
        with self._busy:
            for i in range(0, len(kept), self.distill_batch):
                self._distill(kept[i : i + self.distill_batch])
        return len(kept)

    def _distill(self, reqs: list[DistillationRequest]) -> None:
        if not self.extractor.alive:
            raise ExtractorUnavailable("extractor worker is gone")
        results = self.extractor.distill(reqs)
        self.stats.distill_batches += 1
        for req, (sample, ops) in zip(reqs, results, strict=True):
            step = (
                self.actor_step
                if req.rollout_step is None or req.rollout_step < 0
                else req.rollout_step
            )
            res = self.manager.apply_ops(ops, sample=sample, step=step, request=req)
            self.stats.distilled += 1
            self.stats.added += len(res.added)
            self.stats.updated += len(res.updated)
            self.stats.returned += res.returned
            self.stats.malformed += res.malformed
            self.stats.refused += res.refused
            self.stats.stale += res.stale
            self.stats.pinned += res.pinned
            if (
                self.return_reward is not None
                and self.train
                and is_plain_return(ops)
                and sample.token_ids
            ):
                self.buffer.append(BufferItem(sample, self.return_reward, None, step))
                self.stats.credited_returns += 1

    def _take_credit(self, c: Credit) -> None:
        self.stats.rewards.append(c.reward)
        if c.sample is not None:
            self.buffer.append(BufferItem(c.sample, c.reward, None, c.step))
            self.stats.credited += 1
            return
        entry = self.manager.bank.get(c.entry_id) if c.entry_id is not None else None
        if entry is None or entry.provenance is None or not entry.provenance.token_ids:
            self.stats.uncreditable += 1  # seed entry, merged away, or written without a sample
            return
        self.buffer.append(BufferItem(entry.provenance, c.reward, entry.id, c.step))
        self.stats.credited += 1

    def _reflect(self, job: Reflection) -> None:
        left = self.reflection_budget.get(job.step, 0)
        if left <= 0:
            return
        if not self.extractor.alive:
            return
        try:
            sample, ops = self.extractor.reflect(job.category, job.failures, job.successes, left)
        except ExtractorUnavailable:
            return
        res = self.manager.apply_ops(ops[:left], sample=sample, step=job.step)
        self.stats.reflections += 1
        self.stats.reflected += len(res.added)
        self.stats.refused += res.refused
        self.reflection_budget[job.step] = left - len(res.added)
        if len(self.reflection_budget) > 8:  # only the last few steps can still have jobs queued
            for old in sorted(self.reflection_budget)[:-8]:
                del self.reflection_budget[old]

    def _merge(self, step: int) -> None:
        if len(self.manager.bank) < 2:
            return
        if not self.extractor.alive:
            self.stats.skipped_merges += 1
            return
        try:
            report = merge_bank(
                self.manager.bank,
                self.manager.embedder,
                self.extractor.merge_generate,
                token_budget=self.merge_token_budget,
                count_tokens=self.extractor.count_tokens,
                step=step,
                protect=None if self.merge_seeded else is_pinned,
                retrieve_by=self.manager.config.retrieve_by,
            )
        except ExtractorUnavailable:
            self.stats.skipped_merges += 1
            return
        except Exception as exc:  # noqa: BLE001 - a failed merge leaves the bank as it was
            report = None
            log.warning("merge at step %d failed: %s", step, exc)
        if report is not None and report.ok:
            self.stats.merges += 1
            self.manager.note_merge(report.updated)
            fault_point("merge-applied")  # the bank holds the Merge, no checkpoint does yet
        else:
            self.stats.merge_failures += 1
            if report is not None:
                log.info("merge at step %d not applied: %s", step, report.error)

    # ---------------------------------------------------------------- state
    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the loop between two passes (a checkpoint: B_φ, the weights and the bank of
        one moment)."""
        with self._busy:
            yield

    def state(self) -> JSONDict:
        """Buffer, Merges still to run and counters for a checkpoint (credits still queued are
        folded in first)."""
        with self._busy:
            while True:
                try:
                    self._take_credit(self.credits.get_nowait())
                except queue.Empty:
                    break
            merges = []
            while True:
                try:
                    merges.append(self.merge_requests.get_nowait())
                except queue.Empty:
                    break
            for step in merges:  # still to run here; the state keeps them for a resume
                self.merge_requests.put(step)
            out: dict[str, Any] = {
                "buffer": [b.to_dict() for b in self.buffer],
                "ext_step": self.ext_step,
                "merges": merges,
            }
            try:
                out.update(self.extractor.get_state())  # version + constraints of π_φ's samples
            except ExtractorUnavailable:
                log.error(
                    "checkpoint without the extractor's version/constraints: its worker is gone"
                )
            return out

    def load_state(self, d: dict[str, Any]) -> None:
        self.buffer = [BufferItem.from_dict(x) for x in d.get("buffer", [])]
        self.ext_step = int(d.get("ext_step", 0))
        while True:  # the checkpoint's Merges still to run replace any queued here
            try:
                self.merge_requests.get_nowait()
            except queue.Empty:
                break
        for step in d.get("merges", []):
            self.merge_requests.put(int(step))
        # "rng": the generators of the extractor's own process (its worker writes and reads them)
        self.extractor.set_state(
            {k: d[k] for k in ("version", "allowed_sets", "constraints", "rng") if k in d}
        )
