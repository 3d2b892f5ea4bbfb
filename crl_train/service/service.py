"""``ExperienceService``: the extractor side of Complementary RL, for any trainer.

One owner of everything the extractor learns from: the bank and its manager (retrieval, the
distillation queue), the extractor (in this process, in its worker process, or none), credit
assignment, B_φ, CISPO updates and Merge scheduling. Whoever drives the actor only ``submit`` s
finished episodes (the wrappers do it) and calls ``end_step(t)`` when rollout step t is done:

* ``submit`` records the request in its step (:class:`~crl_gym.experience.service.StepLedger`)
  and queues it for distillation;
* ``end_step(t)`` credits every entry used in step t with r̄(m) (:func:`~crl_train.service.credit.step_credits`),
  updates EDGE's utilities and prunes (when the options say so), schedules a Merge every
  ``merge_every`` steps, and — synchronously — runs the extractor's loop to idle;
* the :class:`~crl_train.service.track.BackgroundTrack` does the model work: distil → ops → bank,
  credits → B_φ → CISPO, merge.

Each method's extractor-side behaviour is a :class:`ServiceOptions` (``crl_train.methods``):
no CISPO (``static_online``), a frozen bank (``offline_exp``), EDGE's utility and pruning.
The same object is served in process (``crl_gym.clients.LocalClient``) and over HTTP
(``crl-experience serve --extractor``).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crl_gym.experience.manager import ExperienceManager
from crl_gym.experience.service import ClosedStep, RetrievalService
from crl_gym.protocol import DeleteOp
from crl_train.extractor import Extractor, ExtractorUnavailable, ExtractorWorker
from crl_train.service.credit import step_credits, utility_updates
from crl_train.service.track import BackgroundTrack

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EdgeUtility:
    """EDGE: each entry's EMA utility follows its groups' marginal gain; entries below η go."""

    momentum: float = 0.9
    """β in U ← β·U + (1 − β)·Δe."""
    prune_below: float = -0.2
    """η."""


@dataclass(frozen=True)
class ServiceOptions:
    """What the service does with the requests it gets (a method's extractor side)."""

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
    offline_source: str | None = None
    """A frozen bank is built from this file before the first step (a bank ``.jsonl`` export, or a
    ``trajectories.jsonl`` distilled once)."""
    buffer_size: int = 64
    """|B_φ| that triggers a CISPO update (paper: 64)."""
    merge_every: int = 5
    """Merge the bank every this many ended steps (paper: 5; 0 disables). Only while distilling."""
    merge_token_budget: int = 6000
    """Tokens per Merge window prompt."""
    distill_batch: int = 8
    """Requests per distillation generate call."""
    distill_linger_s: float = 2.0
    """Asynchronously, after the first request wait up to this long for a full batch."""
    asynchronous: bool = True
    """The extractor's loop runs in its own thread; False runs it to idle inside each ``end_step``."""


class ExperienceService(RetrievalService):
    """See the module docstring.

    Args:
        manager: the bank's manager (closed with the service).
        extractor: π_φ in process or behind its worker, or None (then options must say ``extractor=False``).
        options: the method's extractor side.
        last_ended: the last rollout step already ended (resume).
    """

    def __init__(self, manager: ExperienceManager, extractor: Extractor | ExtractorWorker | None,
                 options: ServiceOptions = ServiceOptions(), *, last_ended: int = -1) -> None:
        if (extractor is None) == options.extractor:
            raise ValueError(f"ExperienceService: options.extractor={options.extractor} but an extractor was "
                             f"{'not ' if extractor is None else ''}given")
        super().__init__(manager, last_ended=last_ended)
        self.options = options
        self.extractor = extractor
        self.counters.update({"credits": 0, "pruned": 0})
        self.track: BackgroundTrack | None = None
        if extractor is not None:
            self.track = BackgroundTrack(manager, extractor, buffer_size=options.buffer_size,
                                         distill_batch=options.distill_batch, distill_linger_s=options.distill_linger_s,
                                         train=options.train, distill=options.distill,
                                         merge_token_budget=options.merge_token_budget,
                                         asynchronous=options.asynchronous)
            self.track.actor_step = last_ended + 1
            if options.refine:
                manager.refiner = extractor.refine

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> ExperienceService:
        """Start the extractor's thread (asynchronous options); returns self."""
        if self.track is not None:
            self.track.start()
        return self

    def stop(self) -> None:
        """Stop the extractor's thread (the queue and B_φ stay; ``start`` resumes)."""
        if self.track is not None:
            self.track.stop()

    def close(self) -> None:
        """Stop the loop, stop the extractor's process, close the manager and the bank."""
        if self._closed_service:
            return
        try:
            self.stop()
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
                self._edge_utility(step, self.options.edge)
            if self.track is None:
                continue
            credits = step_credits(step)
            self.track.credit(credits)
            credited += len(credits)
            if self.options.distill and self.options.merge_every and (step.step + 1) % self.options.merge_every == 0:
                self.track.request_merge(step.step)
        self.counters["credits"] += credited
        if self.track is not None:
            self.track.actor_step = closed[-1].step + 1
            if not self.options.asynchronous:
                self.track.run_until_idle()
        return credited

    def _edge_utility(self, closed: ClosedStep, edge: EdgeUtility) -> None:
        bank = self.manager.bank
        used = {r.experience.id for r in closed.requests if r.experience is not None}
        current = {i: e.utility for i in used if (e := bank.get(i)) is not None}
        updates = utility_updates(closed, current, momentum=edge.momentum, prune_below=edge.prune_below)
        for u in updates:
            bank.set_utility(u.entry_id, u.utility)
        doomed = [DeleteOp(u.entry_id) for u in updates if u.prune]
        if doomed:
            self.manager.apply_ops(doomed, step=closed.step)
            self.counters["pruned"] += len(doomed)

    # ---------------------------------------------------------------- state
    def stats(self) -> dict[str, Any]:
        out = super().stats()
        if self.track is None:
            return out
        st = self.track.stats
        rewards = st.rewards[-200:]
        out.update({k: v for k, v in dataclasses.asdict(st).items() if k not in ("rewards", "last_update")})
        out.update({
            "extractor": "alive" if self.extractor is not None and self.extractor.alive else "gone",
            "extractor_updates": st.updates, "extractor_loss": st.last_update.get("loss"),
            "extractor_reward": sum(rewards) / len(rewards) if rewards else None,
            "buffer_size": len(self.track.buffer),
        })
        return out

    def health(self) -> dict[str, Any]:
        out = super().health()
        if self.extractor is not None:
            out["extractor"] = "alive" if self.extractor.alive else "gone"
        return out

    def flush(self) -> None:
        """Bank statistics to SQLite and queued requests to the spill file (a kill after this loses none)."""
        self.manager.bank.flush()
        self.manager.persist_pending()

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the last ended step, B_φ, the extractor's version and counters."""
        out: dict[str, Any] = {"last_ended": self.ledger.last_ended, "counters": dict(self.counters)}
        if self.track is not None:
            out["track"] = self.track.state()  # waits for the track's current pass: buffer and weights agree
            st = dataclasses.asdict(self.track.stats)
            st["rewards"] = st["rewards"][-200:]  # the extractor_reward window
            out["track_stats"] = st
        return out

    def load_state(self, d: dict[str, Any]) -> None:
        """Inverse of :meth:`state`; an unknown counter is logged and ignored."""
        self.ledger.last_ended = int(d.get("last_ended", self.ledger.last_ended))
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

    def save_extractor(self, target: Path, previous: Path | None = None) -> None:
        """π_φ's weights into ``target`` (through the worker when it runs in a process). A dead
        worker has nothing to save: ``previous`` (the last checkpoint's extractor) is copied instead."""
        if self.extractor is None:
            return
        try:
            self.extractor.save(target)
        except ExtractorUnavailable:
            if previous is not None and previous.is_dir():
                shutil.copytree(previous, target)
                log.error("extractor worker is gone: the checkpoint keeps the extractor of the previous checkpoint")
            else:
                log.error("extractor worker is gone and no earlier extractor checkpoint exists: "
                          "a resume will start a fresh extractor")
