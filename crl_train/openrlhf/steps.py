"""The trainer's side of the experience service: ``end_step`` after every actor update.

Mixed in front of OpenRLHF's trainer actors (``PPOTrainer`` in sync mode, ``TrainingActor`` in
async mode; see ``crl_train.openrlhf.trainer``), whose ``train_step(rollout_samples, global_step)``
turns a rollout batch into one actor update and returns ``(status, global_step + 1)``. After it,
:class:`ServiceStepMixin` ends the service's rollout step — the service credits every entry used
in it with r̄(m), fills B_φ, runs CISPO when it is full and schedules a Merge every
``algo.merge_every`` steps — and adds the service's counters and the rollout's per-condition
success to the status OpenRLHF logs (prefix ``crl/``). Every ``train.checkpoint_every`` steps the
service checkpoints itself (B_φ, π_φ, counters) on the head node.

Step numbers are the service's own (its last ended step + 1, read at start): a rerun after a
crash continues the count instead of ending a step twice. The episodes' requests carry no step;
the service files each under the step open when it arrives, so in async mode (the next batch is
generated while this one trains) a few episodes may be credited one step late, never twice.
A service that cannot be reached costs the step's credit (logged), never the actor's update.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from crl_gym.clients import ExperienceClient, ExperienceUnavailable
from crl_gym.protocol import FREE_CONDITION, GUIDED_CONDITION
from crl_train.openrlhf.advantages import GUIDED_KEY

log = logging.getLogger(__name__)

LOGGED_STATS: tuple[str, ...] = (
    "bank_size",
    "queue_depth",
    "distilled",
    "credited",
    "extractor_updates",
    "extractor_loss",
    "extractor_reward",
    "buffer_size",
    "merges",
    "malformed",
    "late_requests",
)
"""Service counters added to each step's status as ``crl/<name>``."""


class ServiceStepMixin:
    """See the module docstring. The host calls :meth:`crl_setup` at the end of its ``__init__``."""

    crl_client: ExperienceClient | None = None
    crl_step: int = 0
    crl_checkpoint_every: int = 0

    def crl_setup(
        self, client: ExperienceClient | None = None, *, checkpoint_every: int | None = None
    ) -> None:
        """Connect to the service (default: the launcher's settings) and read where its
        steps are."""
        if client is None or checkpoint_every is None:
            from crl_train.openrlhf.settings import load_settings
            from crl_train.service.ray_actor import RayServiceClient

            settings = load_settings()
            if client is None:
                client = RayServiceClient(settings.service_name, settings.namespace)
            if checkpoint_every is None:
                checkpoint_every = settings.train_config().train.checkpoint_every
        self.crl_client = client
        self.crl_checkpoint_every = int(checkpoint_every)
        try:
            self.crl_step = client.stats().last_ended_step + 1
        except ExperienceUnavailable as exc:
            log.error(
                "experience service unreachable at start (%s): its steps are counted from 0", exc
            )
            self.crl_step = 0

    def train_step(self, rollout_samples: Any, global_step: int) -> tuple[dict[str, Any], int]:
        status, step = super().train_step(rollout_samples, global_step)  # type: ignore[misc]
        status.update(rollout_metrics(rollout_samples))
        status.update(self.crl_end_step())
        return status, step

    def crl_end_step(self) -> dict[str, float]:
        """End the service's open step (and checkpoint it when due); the metrics to log."""
        client = self.crl_client
        if client is None:
            raise RuntimeError(
                "ServiceStepMixin.crl_setup was not called: no experience service to end the "
                "step on"
            )
        out: dict[str, float] = {"crl/service_step": float(self.crl_step)}
        step, self.crl_step = self.crl_step, self.crl_step + 1
        try:
            ended = client.end_step(step)
            stats = client.stats()
        except ExperienceUnavailable as exc:
            log.error("experience service unreachable: step %d is not credited (%s)", step, exc)
            out["crl/service_up"] = 0.0
            return out
        out["crl/service_up"] = 1.0
        out["crl/step_requests"] = float(ended.requests)
        for key in LOGGED_STATS:
            value = stats.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"crl/{key}"] = float(value)
        checkpoint = getattr(
            client, "checkpoint", None
        )  # the Ray face has one; in process, the caller's
        if (
            checkpoint is not None
            and self.crl_checkpoint_every
            and (step + 1) % self.crl_checkpoint_every == 0
        ):
            try:
                checkpoint()
            except ExperienceUnavailable as exc:
                log.error("experience service checkpoint after step %d failed: %s", step, exc)
        return out


def rollout_metrics(samples: Iterable[object] | None) -> dict[str, float]:
    """Success of the guided and the free episodes of a rollout batch (``info["crl_*"]`` of
    each sample)."""
    guided: list[float] = []
    success: list[float] = []
    for s in samples or []:
        info = getattr(s, "info", None) or {}
        g, ok = info.get(GUIDED_KEY), info.get("crl_success")
        if g is None or ok is None:
            continue
        guided += torch.as_tensor(g, dtype=torch.float32).reshape(-1).tolist()
        success += torch.as_tensor(ok, dtype=torch.float32).reshape(-1).tolist()
    out: dict[str, float] = {}
    for name, flag in ((GUIDED_CONDITION, 1.0), (FREE_CONDITION, 0.0)):
        vals = [s for g, s in zip(guided, success, strict=True) if g == flag]
        if vals:
            out[f"crl/success_{name}"] = sum(vals) / len(vals)
    return out


__all__ = ["LOGGED_STATS", "ServiceStepMixin", "rollout_metrics"]
