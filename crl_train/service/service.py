"""``ExperienceService``: the extractor side of Complementary RL, for any trainer.

One owner of everything the extractor learns from: the bank and its manager (retrieval, the
distillation queue), the extractor (in this process, in its worker process, or none), credit
assignment, B_φ, CISPO updates and Merge scheduling. Whoever drives the actor only ``submit`` s
finished episodes (the wrappers do it) and calls ``end_step(t)`` when rollout step t is done:

* ``submit`` records the request in its step (:class:`~crl_gym.experience.service.StepLedger`)
  and queues it for distillation;
* ``end_step(t)`` credits every entry used in step t with r̄(m)
  (:func:`~crl_train.service.credit.step_credits`), updates EDGE's utilities and prunes (when the
  options say so), schedules a Merge every ``merge_every`` steps, and — synchronously — runs the
  extractor's loop to idle;
* the :class:`~crl_train.service.track.BackgroundTrack` does the model work: distil → ops → bank,
  credits → B_φ → CISPO, merge.

Each method's extractor-side behaviour is a :class:`ServiceOptions` (``crl_train.methods``):
no CISPO (``static_online``), a frozen bank (``offline_exp``), EDGE's utility and pruning.
The same object is served in process (``crl_gym.clients.LocalClient``) and over HTTP
(``crl-experience serve --extractor``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crl_gym.errors import StorageFault
from crl_gym.experience.manager import ExperienceManager
from crl_gym.experience.results import Health, ServiceStats
from crl_gym.experience.service import ClosedStep, RetrievalService
from crl_gym.experience.snapshots import default_name, prune_snapshots
from crl_gym.json_types import JSONDict
from crl_gym.protocol import DeleteOp, ExtractorSample, check_int, finite_float, guiding_entries
from crl_train.config import AlgoConfig, ExperienceConfig, TrainConfig
from crl_train.config.io import check_choices
from crl_train.config.names import EntryReward
from crl_train.extractor import AnyExtractor, ExtractorUnavailable
from crl_train.service.credit import reflections, step_credits, utility_updates
from crl_train.service.track import COLUMN, BackgroundTrack, TrackStats

log = logging.getLogger(__name__)
CHECKPOINT_SNAPSHOTS = 2
"""Bank snapshots kept for :meth:`ExperienceService.checkpoint` (one per checkpoint on disk)."""


@dataclass(frozen=True)
class EdgeUtility:
    """EDGE: each entry's EMA utility follows its groups' marginal gain; entries below η go."""

    momentum: float = 0.9
    """β in U ← β·U + (1 − β)·Δe."""
    prune_below: float = -0.2
    """η."""


@dataclass(frozen=True)
class EdgeReflection:
    """EDGE: task categories whose success rate in a step is below ξ make the extractor contrast
    their failed and successful episodes and write new entries (at most ``max_entries``
    per step)."""

    below: float = 0.5
    """ξ."""
    max_entries: int = 3
    """New entries per step, over every reflecting category."""


@dataclass(frozen=True)
class ServiceOptions:
    """What the service does with the requests it gets (a method's extractor side). The defaults
    are the config keys' (``algo.*``, ``experience.*``): :meth:`from_config` reads a run's."""

    extractor: bool = True
    """The service has an extractor π_φ (False: retrieval and queueing only, e.g. ``grpo``)."""
    distill: bool = True
    """The extractor distils finished episodes into the bank (False: the bank is frozen and the
    queue is drained unread)."""
    train: bool = True
    """CISPO updates of the extractor when |B_φ| reaches ``buffer_size``."""
    refine: bool = True
    """``ask`` (the actor's search_and_ask) lets the extractor rewrite the entry."""
    edge: EdgeUtility | None = None
    """EDGE's utility and pruning at each ``end_step``."""
    reflection: EdgeReflection | None = None
    """EDGE's reflection on low-success task categories at each ``end_step``."""
    dedup_similarity: float | None = None
    """Refuse new entries this close (cosine) to one in the bank (EDGE's near-duplicate refusal);
    None keeps the manager's own ``manager.dedup_similarity``."""
    seed_bank: bool = True
    """An empty bank starts with ``experience.seed_entries`` (EDGE: False, its bank
    starts empty)."""
    entry_reward: EntryReward = AlgoConfig.entry_reward
    """r(m) of a guided episode: ``direct`` (±1 by its success, the paper's choice) or ``relative``
    (minus the mean ±1 of its group's free subgroup, the variant the paper found worse)."""
    offline_source: str | None = None
    """A frozen bank is built from this file before the first step (a bank ``.jsonl`` export, or a
    ``trajectories.jsonl`` distilled once)."""
    buffer_size: int = AlgoConfig.buffer_size
    """|B_φ| that triggers a CISPO update (paper: 64)."""
    return_reward: float | None = AlgoConfig.return_reward
    """An answer that only Returns goes into B_φ with this reward when distilled; None (the paper's
    rule): never credited (``algo.return_reward``)."""
    merge_every: int = AlgoConfig.merge_every
    """Merge the bank every this many ended steps (paper: 5; 0 disables). Only while distilling."""
    merge_token_budget: int = AlgoConfig.merge_token_budget
    """Tokens per Merge window prompt."""
    merge_seeded: bool = False
    """Whether Merge may merge, rewrite or discard the pinned entries (a user's ``AddOp``s, a
    config's seed entries: ``crl_gym.experience.pinning.is_pinned``). False keeps them as written
    (``crl-experience serve`` without ``--merge-seeded``; a training run with
    ``manager.pin_user_entries``, the default)."""
    distill_batch: int = ExperienceConfig.distill_batch
    """Requests per distillation generate call."""
    distill_linger_s: float = ExperienceConfig.distill_linger_s
    """Asynchronously, after the first request wait up to this long for a full batch."""
    distill_fraction: float = ExperienceConfig.distill_fraction
    """Share of requests distilled, each drawn by
    :func:`~crl_train.service.track.drawn_for_distillation` (1: all, the paper;
    ``experience.distill_fraction``). Every request is still credited."""
    draw_seed: int = 0
    """Salt of that draw (a run's seed)."""
    distill_per_group: int = ExperienceConfig.distill_per_group
    """Copies of each rollout group distilled, chosen outcome-blind
    (:func:`~crl_train.service.track.drawn_in_group`; ``experience.distill_per_group``); 0: off."""
    asynchronous: bool = ExperienceConfig.asynchronous
    """The extractor's loop runs in its own thread; False runs it to idle inside
    each ``end_step``."""

    def __post_init__(self) -> None:
        check_choices(self, "ServiceOptions")

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> ServiceOptions:
        """The queue, buffer and merge settings of a run's config (a method adds its own choices
        with :func:`dataclasses.replace`)."""
        algo, exp = cfg.algo, cfg.experience
        return cls(
            buffer_size=algo.buffer_size,
            merge_every=algo.merge_every,
            merge_token_budget=algo.merge_token_budget,
            distill_batch=exp.distill_batch,
            distill_linger_s=exp.distill_linger_s,
            asynchronous=exp.asynchronous,
            distill_fraction=exp.distill_fraction,
            draw_seed=cfg.seed,
            distill_per_group=exp.distill_per_group,
            entry_reward=algo.entry_reward,
            return_reward=algo.return_reward,
            # a user's entries (seed_entries) are pinned unless the config unpins them all
            # (the paper's Merge compacts a run's seed entries too:
            # manager.pin_user_entries: false)
            merge_seeded=not cfg.manager.pin_user_entries,
        )


STATS_COLUMNS: tuple[str, ...] = (
    "bank_size",
    "queue_depth",
    "extractor_reward",
    "extractor_updates",
    "extractor_loss",
    "buffer_size",
)
"""Figures :meth:`ExperienceService.stats` computes (not :class:`TrackStats` counters) that every
metrics row shows."""


def row_columns() -> dict[str, str]:
    """Metrics-row column → key of :meth:`ExperienceService.stats`: :data:`STATS_COLUMNS`, then
    every :class:`TrackStats` counter marked as a column (under its field name, or the name its
    mark gives).

    >>> cols = row_columns()
    >>> cols["bank_size"], cols["distilled"], cols["track_errors"]
    ('bank_size', 'distilled', 'errors')
    """
    out = {k: k for k in STATS_COLUMNS}
    for f in dataclasses.fields(TrackStats):
        if COLUMN in f.metadata:
            out[f.metadata[COLUMN] or f.name] = f.name
    return out


def _object(value: object, what: str) -> JSONDict:
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _items(value: object, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"{what} must be a list, got {type(value).__name__}")
    return value


def _check_track_state(d: dict[str, Any], what: str) -> None:
    """The track's part (B_φ, the extractor's step, version and constraints), as
    ``BackgroundTrack.state`` writes it."""
    for i, item in enumerate(_items(d.get("buffer", []), f"{what}.buffer")):
        at = f"{what}.buffer[{i}]"
        item = _object(item, at)
        if not item.get("sample"):
            raise ValueError(f"{at}.sample is missing")
        ExtractorSample.from_dict(_object(item["sample"], f"{at}.sample"), f"{at}.sample")
        finite_float(item.get("reward"), f"{at}.reward")
        if item.get("entry_id") is not None:
            check_int(item["entry_id"], f"{at}.entry_id", low=0)
        check_int(item.get("step", 0), f"{at}.step")
    check_int(d.get("ext_step", 0), f"{what}.ext_step", low=0)
    check_int(d.get("version", 0), f"{what}.version", low=0)
    for i, step in enumerate(_items(d.get("merges", []), f"{what}.merges")):
        check_int(step, f"{what}.merges[{i}]", low=0)
    sets = _items(d.get("allowed_sets", []), f"{what}.allowed_sets")
    for i, a in enumerate(sets):
        for j, tok in enumerate(_items(a, f"{what}.allowed_sets[{i}]")):
            check_int(tok, f"{what}.allowed_sets[{i}][{j}]", low=0)
    constraints = _object(d.get("constraints", {}), f"{what}.constraints")
    for key, refs in constraints.items():
        at = f"{what}.constraints[{key!r}]"
        if isinstance(refs, dict):
            continue  # a grammar, written once; the extractor reads its fields
        if isinstance(refs, str):
            if refs not in constraints:
                raise ValueError(f"{at} refers to {refs!r}, which the state does not hold")
            continue
        for j, ref in enumerate(_items(refs, at)):
            if ref is None or isinstance(ref, list):
                continue  # no constraint, or a set written inline (the older form)
            if check_int(ref, f"{at}[{j}]", low=0) >= len(sets):
                raise ValueError(
                    f"{at}[{j}] refers to allowed set {ref}, but the state holds {len(sets)} sets"
                )


def check_service_state(d: object, what: str = "service") -> None:
    """Refuse a malformed :meth:`ExperienceService.state` before any of it is applied:
    ``ValueError`` naming the key (``service.track.buffer[3].reward must be a finite number,
    got nan``).

    Pure: it needs no service, so a resume checks the checkpoint before it builds (and
    changes) anything.
    """
    d = _object(d, what)
    if "last_ended" in d:
        check_int(d["last_ended"], f"{what}.last_ended", low=-1)
    for k, v in _object(d.get("counters", {}), f"{what}.counters").items():
        check_int(v, f"{what}.counters.{k}", low=0)
    if "clock" in d:
        finite_float(d["clock"], f"{what}.clock")
    for k, v in _object(d.get("merged_into", {}), f"{what}.merged_into").items():
        if not k.isdigit():
            raise ValueError(f"{what}.merged_into: key {k!r} is not an entry id")
        check_int(v, f"{what}.merged_into.{k}", low=0)
    if "track" in d:
        _check_track_state(_object(d["track"], f"{what}.track"), f"{what}.track")
    kinds = {f.name: f.type for f in dataclasses.fields(TrackStats)}
    for k, v in _object(d.get("track_stats", {}), f"{what}.track_stats").items():
        at = f"{what}.track_stats.{k}"
        kind = str(kinds.get(k, ""))
        if kind == "int":
            check_int(v, at, low=0)
        elif kind == "float":
            finite_float(v, at)
        elif kind == "str":
            if not isinstance(v, str):
                raise ValueError(f"{at} must be a string, got {type(v).__name__}")
        elif kind.startswith("list"):
            for i, x in enumerate(_items(v, at)):
                finite_float(x, f"{at}[{i}]")
        elif kind.startswith("dict"):
            for name, x in _object(
                v, at
            ).items():  # display only (the last update's metrics): NaN may be true
                if isinstance(x, bool) or not isinstance(x, (int, float)):
                    raise ValueError(f"{at}.{name} must be a number, got {x!r}")


class ContinuedClock:
    """Wall-clock seconds that go on from ``start`` (a checkpoint's manager clock) at creation.

    >>> clock = ContinuedClock(100.0)
    >>> 100.0 <= clock() < 101.0
    True
    """

    def __init__(self, start: float) -> None:
        self.offset = float(start) - time.time()

    def __call__(self) -> float:
        return time.time() + self.offset


class ExperienceService(RetrievalService):
    """See the module docstring. A caller that submits must end its steps: each open step's requests
    are held until then (that is what its credit is computed from).

    Args:
        manager: the bank's manager (closed with the service).
        extractor: π_φ in process or behind its worker, the oracle (never trained), or None (then
            options must say ``extractor=False``).
        options: the method's extractor side.
        last_ended: the last rollout step already ended (resume).
    """

    keeps_requests = True

    def __init__(
        self,
        manager: ExperienceManager,
        extractor: AnyExtractor | None,
        options: ServiceOptions = ServiceOptions(),
        *,
        last_ended: int = -1,
    ) -> None:
        if (extractor is None) == options.extractor:
            raise ValueError(
                f"ExperienceService: options.extractor={options.extractor} but an extractor was "
                f"{'not ' if extractor is None else ''}given"
            )
        super().__init__(manager, last_ended=last_ended)
        self.options = options
        self.extractor = extractor
        self.counters.update(
            {"credits": 0, "pruned": 0, "unlogged_credits": 0, "unsaved_utilities": 0}
        )
        self._resume_clock: float | None = None
        self.checkpoint_dir: Path | None = None
        """Where :meth:`close` writes a last :meth:`checkpoint`
        (``crl-experience serve --extractor``)."""
        self.track: BackgroundTrack | None = None
        if extractor is not None:
            self.track = BackgroundTrack(
                manager,
                extractor,
                buffer_size=options.buffer_size,
                distill_batch=options.distill_batch,
                distill_linger_s=options.distill_linger_s,
                # a weightless extractor (the oracle) has nothing for CISPO
                train=options.train and extractor.trainable,
                distill=options.distill,
                merge_token_budget=options.merge_token_budget,
                merge_seeded=options.merge_seeded,
                asynchronous=options.asynchronous,
                return_reward=options.return_reward,
                distill_fraction=options.distill_fraction,
                draw_seed=options.draw_seed,
                distill_per_group=options.distill_per_group,
            )
            self.track.actor_step = last_ended + 1
            if options.refine:
                manager.refiner = extractor.refine
        if options.dedup_similarity is not None:
            manager.dedup_similarity = options.dedup_similarity

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> ExperienceService:
        """Start the extractor's thread (asynchronous options); returns self. After a resume the
        manager's clock goes on from the checkpoint's: the time the service was down does not age
        the recency window."""
        if self._resume_clock is not None:
            self.manager.clock = ContinuedClock(self._resume_clock)
            self._resume_clock = None
        if self.track is not None:
            self.track.start()
        return self

    def stop(self) -> None:
        """Stop the extractor's thread (the queue and B_φ stay; ``start`` resumes)."""
        if self.track is not None:
            self.track.stop()

    def close(self) -> None:
        """Stop the loop, write a checkpoint into :attr:`checkpoint_dir` (when set), stop the
        extractor's process, close the manager and the bank."""
        if self._closed_service:
            return
        try:
            self.stop()
            if self.checkpoint_dir is not None:
                try:
                    self.checkpoint(self.checkpoint_dir)
                except Exception:  # noqa: BLE001 - closing goes on; the previous checkpoint stays
                    log.exception(
                        "closing: the service checkpoint in %s failed; the previous one stays",
                        self.checkpoint_dir,
                    )
        finally:
            try:
                if self.extractor is not None:
                    self.extractor.close()
            finally:
                super().close()

    # ---------------------------------------------------------------- ending a step
    def _closed(self, closed: list[ClosedStep]) -> int:
        credited = 0
        for step in closed:
            if self.options.edge is not None:
                try:
                    self._edge_utility(step, self.options.edge)
                except (
                    StorageFault
                ):  # the step is ended: its EDGE update is skipped, counted and logged
                    self.counters["unsaved_utilities"] += 1
                    log.exception(
                        "step %d: saving EDGE utilities failed (counted in unsaved_utilities)",
                        step.step,
                    )
            if self.track is None:
                continue
            if self.options.reflection is not None and self.options.distill:
                r = self.options.reflection
                self.track.request_reflections(reflections(step, r.below), r.max_entries)
            credits = step_credits(step, relative=self.options.entry_reward == "relative")
            self.track.credit(credits)
            self._log_credits(step, credits)
            credited += len(credits)
            if (
                self.options.distill
                and self.options.merge_every
                and (step.step + 1) % self.options.merge_every == 0
            ):
                self.track.request_merge(step.step)
        self.counters["credits"] += credited
        if self.track is not None:
            self.track.actor_step = closed[-1].step + 1
            if not self.options.asynchronous:
                self.track.run_until_idle()
        return credited

    def _log_credits(self, closed: ClosedStep, credits: list[Any]) -> None:
        """r̄(m) of the step and its episode count per entry, into the bank's event log: B_φ consumes
        the credits, and this is what the bank explorer shows of them."""
        from collections import Counter

        from crl_train.service.credit import credited_entries

        episodes = Counter(i for r in closed.requests for i in credited_entries(r))
        rows = [
            (c.entry_id, c.reward, episodes[c.entry_id]) for c in credits if c.entry_id is not None
        ]
        try:
            self.manager.bank.record_credits(closed.step, rows)
        except (
            StorageFault
        ):  # B_φ has them already: a full disk costs the log its rows, not the step its end
            self.counters["unlogged_credits"] += len(rows)
            log.exception(
                "step %d: logging %d credits in the bank failed (counted in unlogged_credits)",
                closed.step,
                len(rows),
            )

    def _edge_utility(self, closed: ClosedStep, edge: EdgeUtility) -> None:
        bank = self.manager.bank
        used = {e.id for r in closed.requests for e in guiding_entries(r)}
        current = {i: e.utility for i in used if (e := bank.get(i)) is not None}
        updates = utility_updates(
            closed, current, momentum=edge.momentum, prune_below=edge.prune_below
        )
        for u in updates:
            bank.set_utility(u.entry_id, u.utility)
        doomed = [DeleteOp(u.entry_id) for u in updates if u.prune]
        if doomed:
            self.manager.apply_ops(doomed, step=closed.step)
            self.counters["pruned"] += len(doomed)

    # ---------------------------------------------------------------- state
    def stats(self) -> ServiceStats:
        out = super().stats()
        if self.track is None:
            return out
        st = self.track.stats
        rewards = st.rewards[-200:]
        track = {
            k: v
            for k, v in dataclasses.asdict(st).items()
            if k not in ("rewards", "last_update", "distilled", "credited", "merges")
        }
        loss = st.last_update.get("loss")
        return dataclasses.replace(
            out,
            extractor="alive" if self.extractor is not None and self.extractor.alive else "gone",
            distilled=st.distilled,
            credited=st.credited,
            merges=st.merges,
            extractor_updates=st.updates,
            counters={
                **out.counters,
                **track,
                "extractor_loss": None if loss is None else float(loss),
                "extractor_reward": sum(rewards) / len(rewards) if rewards else None,
                "buffer_size": len(self.track.buffer),
            },
        )

    def health(self) -> Health:
        out = super().health()
        if self.extractor is not None:
            return dataclasses.replace(out, extractor="alive" if self.extractor.alive else "gone")
        return out

    def flush(self) -> None:
        """Bank statistics to SQLite and queued requests to the spill file (a kill after this
        loses none)."""
        self.manager.bank.flush()
        self.manager.persist_pending()

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the last ended step, B_φ, the extractor's version and counters,
        the manager's clock (the recency window's time) and the Merge redirections."""
        out: dict[str, Any] = {
            "last_ended": self.ledger.last_ended,
            "counters": dict(self.counters),
            "clock": float(self.manager.clock()),
            "merged_into": {str(k): v for k, v in self.manager.merged_into.items()},
        }
        if self.track is not None:
            out["track"] = (
                self.track.state()
            )  # waits for the track's current pass: buffer and weights agree
            st = dataclasses.asdict(self.track.stats)
            st["rewards"] = st["rewards"][-200:]  # the extractor_reward window
            out["track_stats"] = st
        return out

    def load_state(self, d: dict[str, Any]) -> None:
        """Inverse of :meth:`state`; an unknown counter is logged and ignored. A malformed state
        raises ``ValueError`` naming the key (:func:`check_service_state`) and changes nothing."""
        check_service_state(d)
        self.ledger.last_ended = int(d.get("last_ended", self.ledger.last_ended))
        if (
            "clock" in d
        ):  # the recency window goes on from the checkpoint's time once the service starts
            self._resume_clock = float(d["clock"])
        if "merged_into" in d:
            self.manager.merged_into = {int(k): int(v) for k, v in d["merged_into"].items()}
        for k, v in d.get("counters", {}).items():
            if k in self.counters:
                self.counters[k] = int(v)
        if self.track is None:
            return
        self.track.load_state(d.get("track", {}))
        self.track.actor_step = self.ledger.last_ended + 1
        for k, v in d.get("track_stats", {}).items():
            if hasattr(self.track.stats, k):
                setattr(self.track.stats, k, v)
            else:
                log.warning("checkpoint counter track.%s is unknown here; ignored", k)

    def save(
        self, target: Path, previous: Path | None = None, *, bank: bool = True
    ) -> dict[str, Any]:
        """One consistent checkpoint of the service into the new directory ``target``: returns
        :meth:`state`, and writes π_φ (``extractor/``) and, with ``bank``, the bank and the queue
        (``bank/``, :meth:`ExperienceManager.snapshot`), all while the extractor's loop is held
        between passes, so B_φ, the weights, the bank and the queue are of one moment.
        ``previous``: the last checkpoint's directory (its extractor stands in for a
        dead worker's)."""
        lock = self.track.held() if self.track is not None else contextlib.nullcontext()
        with lock:
            state = self.state()
            self.save_extractor(
                target / "extractor", None if previous is None else previous / "extractor"
            )
            if bank:
                self.manager.bank.flush_stats()
                self.manager.snapshot(target / "bank")
        return state

    def checkpoint(self, service_dir: Path) -> dict[str, Any]:
        """B_φ, π_φ and the counters into ``service_dir/checkpoint`` (:meth:`save` without the bank,
        by the run's checkpoint writer), for a face that serves several trainers (the HTTP server,
        the Ray actor): their bank is never rolled back, what a client was acknowledged stays.
        The bank as it was is kept as the snapshot ``checkpoint-step-N-TIME`` of the bank
        (:mod:`crl_gym.experience.snapshots`; the latest :data:`CHECKPOINT_SNAPSHOTS` are kept),
        named in the checkpoint's ``bank_snapshot``: ``crl-experience restore`` pairs the bank with
        it. Returns the checkpoint's path, last ended step and that snapshot's name."""
        from crl_train.service.checkpoint import CKPT, begin_checkpoint, commit_checkpoint

        self.flush()
        tmp = begin_checkpoint(service_dir)
        state = self.save(tmp, service_dir / CKPT, bank=False)
        snapshot = None
        if self.manager.bank.path is not None:
            prefix = f"checkpoint-step-{int(state['last_ended'])}-"
            snapshot = self.snapshot_bank(default_name(prefix)).name
            prune_snapshots(self.manager.bank.path, "checkpoint-step-", CHECKPOINT_SNAPSHOTS)
        final = commit_checkpoint(service_dir, tmp, {"service": state, "bank_snapshot": snapshot})
        return {
            "path": str(final),
            "last_ended": int(state["last_ended"]),
            "bank_snapshot": snapshot,
        }

    def restore(self, source: Path) -> None:
        """The bank and the queue become the checkpoint's copies in ``source`` (``bank/`` of
        :meth:`save`): what was written after that checkpoint is rolled back. Call after
        :meth:`load_state` with the same checkpoint's state, before the service starts."""
        self.manager.restore(source)
        self.reload_write_ids()

    def save_extractor(self, target: Path, previous: Path | None = None) -> None:
        """π_φ's weights into ``target`` (through the worker when it runs in a process). A dead
        worker has nothing to save: ``previous`` (the last checkpoint's extractor) is
        copied instead."""
        if self.extractor is None:
            return
        try:
            self.extractor.save(target)
        except ExtractorUnavailable:
            if previous is not None and previous.is_dir():
                shutil.copytree(previous, target)
                log.error(
                    "extractor worker is gone: the checkpoint keeps the extractor of the "
                    "previous checkpoint"
                )
            else:
                log.error(
                    "extractor worker is gone and no earlier extractor checkpoint exists: "
                    "a resume will start a fresh extractor"
                )
