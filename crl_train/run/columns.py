"""The columns of a metrics row that the actor loop fills, each declared next to the code that
fills it.

The trainer (:class:`~crl_train.run.trainer.Trainer`) calls these once per step; the schema that
collects them with the service's and the methods' own columns is :mod:`crl_train.run.metrics`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from crl_gym.experience.results import ServiceStats
from crl_gym.json_types import JSONDict
from crl_gym.protocol import FREE_CONDITION, GUIDED_CONDITION
from crl_train.rollout.contract import Rollout
from crl_train.rollout.runner import RolloutRunner
from crl_train.service.service import row_columns

RL_TERM = "rl"
"""Name of the RL loss among the terms of the actor's objective (its loss is ``actor_loss``)."""

ACTOR_FIELDS: tuple[str, ...] = (
    "actor_loss",
    "actor_objective",
    "actor_clip_frac",
    "actor_approx_kl",
    "actor_grad_norm",
)
"""Actor update; null when the actor did not train this step."""


def actor_columns(metrics: Mapping[str, float]) -> dict[str, float | None]:
    """:data:`ACTOR_FIELDS` from the metrics of ``Policy.train_objective`` (its RL term named
    :data:`RL_TERM`)."""
    return {
        "actor_loss": metrics.get(f"loss_{RL_TERM}"),
        "actor_objective": metrics.get("loss"),
        "actor_clip_frac": metrics.get("clip_frac"),
        "actor_approx_kl": metrics.get("approx_kl"),
        "actor_grad_norm": metrics.get("grad_norm"),
    }


ROLLOUT_FIELDS: tuple[str, ...] = (
    "success",
    "success_guided",
    "success_free",
    "success_by_env",
    "actions_per_episode",
    "turns_per_episode",
    "adv_mean",
    "adv_std",
    "adv_abs_mean",
    "search_latency_s",
    "env_errors",
    "context_truncations",
    "malformed_tool_calls",
    "extractor_alive",
)
"""Every step's rollout columns (``extractor_alive``: the service's ``extractor`` status, as
a bool)."""


def rollout_columns(
    rollout: Rollout, adv: torch.Tensor, runner: RolloutRunner, stats: ServiceStats
) -> JSONDict:
    """:data:`ROLLOUT_FIELDS` of one step: its episodes, their advantages, the runner's counters and
    the service's ``stats()`` (whether the extractor is alive)."""
    eps = rollout.episodes

    def rate(cond: str) -> float | None:
        xs = [e.success for e in eps if e.condition == cond]
        return sum(xs) / len(xs) if xs else None

    return {
        "success": float(rollout.reward.mean()),
        "success_guided": rate(GUIDED_CONDITION),
        "success_free": rate(FREE_CONDITION),
        "success_by_env": {
            env: sum(e.success for e in eps if e.env_id == env) / sum(e.env_id == env for e in eps)
            for env in dict.fromkeys(e.env_id for e in eps)
        },
        "actions_per_episode": sum(e.num_actions for e in eps) / len(eps),
        "turns_per_episode": sum(e.turns for e in eps) / len(eps),
        "adv_mean": float(adv.mean()),
        "adv_std": float(adv.std(unbiased=False)),
        "adv_abs_mean": float(adv.abs().mean()),
        "search_latency_s": runner.last_search_s,
        "env_errors": runner.errors,
        "context_truncations": runner.context_truncations,
        "malformed_tool_calls": runner.malformed_tool_calls,
        "extractor_alive": None if stats.extractor is None else stats.extractor == "alive",
    }


SERVICE_FIELDS: tuple[str, ...] = tuple(row_columns())
"""The experience service's columns, declared by the service
(:func:`crl_train.service.service.row_columns`)."""


def service_columns(stats: ServiceStats, method_columns: Mapping[str, str]) -> JSONDict:
    """:data:`SERVICE_FIELDS` and a method's own service columns (``Method.service_metrics``:
    column -> ``stats()`` key) from the service's ``stats()``."""
    return {k: stats.get(src) for k, src in {**row_columns(), **method_columns}.items()}


TIME_FIELDS: tuple[str, ...] = ("step_time_s", "rollout_time_s", "update_time_s")
"""Seconds of the step and of its rollout and update."""


def time_columns(total: float, rollout_s: float, update_s: float) -> dict[str, float]:
    """:data:`TIME_FIELDS`."""
    return {"step_time_s": total, "rollout_time_s": rollout_s, "update_time_s": update_s}
