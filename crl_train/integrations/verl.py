"""Complementary RL's trainer side in verl 0.9.1: split-subgroup advantages and ``end_step``.

* **Advantages.** :func:`split_subgroup_estimator` is registered with verl's
  ``core_algos.register_adv_est`` as :data:`ADV_ESTIMATOR` (``algorithm.adv_estimator:
  crl_split_subgroup``). verl hands an estimator the rows' token-level rewards, response mask and
  ``uid`` (one per dataset row, shared by its ``rollout.n`` copies). The rows of
  ``crl_gym.integrations.verl.rows`` are one per task *and condition*, so a ``uid`` is one
  subgroup, and Â is :func:`~crl_train.rollout.contract.trained_advantages` of the method over
  :class:`~crl_train.rollout.contract.Outcomes` whose group is the ``uid`` and whose condition is
  the row's: for Complementary RL, ``split_subgroup_advantages`` (population std, ε = 1e-6, a
  zero-spread subgroup → 0), on every response token (outcome reward, γ = 1).
  :class:`ComplementaryTrainer` also reads what each episode reports (``extra_fields``:
  ``crl_group``, ``crl_condition``, ``crl_valid``) for the batch being estimated
  (:func:`batch_outcomes`): then the group is the task, the condition the one the episode ran
  (a guided row whose search failed, the service down, ran free and is normalised with the free
  half, as in every other loop), and an episode the env broke gets advantage 0.
* **Eq. 5's ½ Σ_c 1/K_c.** With both halves of K/2 in every group the paper's per-sequence
  weight times N is 1 (``crl_train.algorithms.sequence_weights``), so Â is trained as is; use
  ``actor_rollout_ref.actor.loss_agg_mode: seq-mean-token-mean`` for the paper's per-sequence mean.
* **end_step.** :class:`ComplementaryTrainer` (``@register_trainer("crl_sync")``, verl's
  synchronous v1 trainer) calls ``end_step(global_steps)`` on the service in ``on_step_end``, once
  per training step, after the step's update; every episode of the step carries
  ``rollout_step = global_steps`` (the v1 trainer puts ``global_steps`` in every row), and
  evaluation rows carry -1, which the service never credits.
* **Registration in verl's processes.** ``python -m verl.trainer.main_ppo`` imports no user code;
  its Ray workers run :func:`setup_worker` when given
  ``+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=crl_train.integrations.verl.setup_worker``
  (it imports this module and the loop: the estimator, the trainer and ``crl_agent`` register).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from crl_gym.integrations.verl import verl_required

with verl_required(__name__):
    from verl.trainer.ppo.core_algos import register_adv_est
    from verl.trainer.ppo.v1.trainer_base import register_trainer
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from crl_gym.integrations.verl.rows import TaskRow, task_rows
from crl_gym.integrations.verl.service import service_client
from crl_train.rollout.contract import (
    ActorSide,
    Outcomes,
    condition_ids,
    condition_of,
    trained_advantages,
)

logger = logging.getLogger(__name__)

ADV_ESTIMATOR = "crl_split_subgroup"
"""``algorithm.adv_estimator`` that selects :func:`split_subgroup_estimator`."""
TRAINER_MODE = "crl_sync"
"""``trainer.v1.trainer_mode`` that selects :class:`ComplementaryTrainer`."""


@dataclass(frozen=True)
class BatchOutcomes:
    """What the episodes of the batch being estimated reported, one entry per row, in the
    batch's order."""

    group: torch.Tensor
    condition: torch.Tensor
    valid: torch.Tensor


_BATCH: ContextVar[BatchOutcomes | None] = ContextVar("crl_verl_batch", default=None)
_METHOD: ContextVar[ActorSide | None] = ContextVar("crl_verl_method", default=None)


def default_method() -> ActorSide:
    """Complementary RL's method (``crl-train``'s default config)."""
    from crl_train.config import TrainConfig
    from crl_train.methods import make_method

    return make_method(TrainConfig())


def method_named(name: str, config_path: str | None = None) -> ActorSide:
    """The method ``name`` as ``crl-train --method NAME`` builds it (with
    ``config_path``'s settings)."""
    from crl_train.config import load_config
    from crl_train.methods import make_method

    return make_method(load_config(config_path, [f"method={name}"]))


def rows_for(
    seeds: Sequence[int],
    method: ActorSide | None = None,
    *,
    evaluation: bool = False,
    **kwargs: Any,
) -> list[TaskRow]:
    """The dataset rows for ``seeds`` under ``method``: two per task (the contract's
    :func:`~crl_train.rollout.contract.condition_of` over two rows: guided, free) for a guided
    method, one free row per task otherwise. Run each row :func:`rollout_n` times.

    >>> [r["extra_info"]["experience"] for r in rows_for([3])]
    ['guided', 'free']
    """
    guided = (method or default_method()).guided
    conditions = [condition_of(c, 2, guided=guided) for c in range(2)] if guided else ["free"]
    return task_rows(seeds, conditions, evaluation=evaluation, **kwargs)


def rollout_n(group_size: int, method: ActorSide | None = None) -> int:
    """``actor_rollout_ref.rollout.n`` for ``group_size`` = K episodes per task: K/2 per row of a
    guided method, K for a method without experience.

    >>> rollout_n(8), rollout_n(8, method_named("grpo"))
    (4, 8)
    """
    guided = (method or default_method()).guided
    if guided and (group_size < 2 or group_size % 2):
        raise ValueError(
            "a guided method splits each task's K episodes in halves: K must be even, got "
            f"{group_size}"
        )
    return group_size // 2 if guided else group_size


def _codes(index: Sequence[Any]) -> torch.Tensor:
    """``[N]`` long codes of the distinct values of ``index`` (verl's ``uid`` strings), in
    first-seen order."""
    seen: dict[Any, int] = {}
    return torch.tensor([seen.setdefault(u, len(seen)) for u in index], dtype=torch.long)


def batch_outcomes(
    extra_fields: Sequence[Mapping[str, Any] | None], uids: Sequence[Any]
) -> BatchOutcomes:
    """Group, condition and validity of each row from what its episode reported (``extra_fields``
    of ``crl_agent``). The group is ``(crl_group, uid)``'s task: rows of one ``crl_group`` share it;
    a row without one (another loop's) is a group of its own ``uid``, free, valid.

    >>> out = batch_outcomes([{"crl_group": 0, "crl_condition": "guided", "crl_valid": True},
    ...                       {"crl_group": 0, "crl_condition": "free", "crl_valid": False}, None],
    ...                      ["a", "b", "c"])
    >>> out.group.tolist(), out.condition.tolist(), out.valid.tolist()
    ([0, 0, 1], [0, 1, 1], [True, False, True])
    """
    if len(extra_fields) != len(uids):
        raise ValueError(f"{len(extra_fields)} rows of extra_fields for {len(uids)} uids")
    keys, conditions, valid = [], [], []
    for fields, uid in zip(extra_fields, uids, strict=True):
        fields = fields or {}
        group = fields.get("crl_group")
        keys.append(("task", int(group)) if group is not None else ("uid", uid))
        conditions.append(str(fields.get("crl_condition") or "free"))
        valid.append(bool(fields.get("crl_valid", True)))
    return BatchOutcomes(
        _codes(keys), condition_ids(conditions), torch.tensor(valid, dtype=torch.bool)
    )


@register_adv_est(ADV_ESTIMATOR)
def split_subgroup_estimator(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray | Sequence[Any] | None = None,
    config: Any = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's estimator interface: ``(advantages, returns)``, each ``[N, T]`` = Â on every
    response token.

    r = the row's summed token-level reward. Outcomes: those :class:`ComplementaryTrainer` set for
    the batch (:func:`batch_outcomes`), else one subgroup per ``uid`` under the row's own condition
    (module docstring). Â = ``trained_advantages(method, outcomes)``, the method being the
    trainer's (default: Complementary RL's).

    >>> r = torch.zeros(4, 3); r[[0, 2], -1] = 1.0
    >>> adv, _ = split_subgroup_estimator(r, torch.ones(4, 3),
    ...                                   np.array(["a", "a", "b", "b"], dtype=object))
    >>> [round(a, 4) for a in adv[:, 0].tolist()]
    [1.0, -1.0, 1.0, -1.0]
    """
    scores = token_level_rewards.sum(dim=-1).to(torch.float32).cpu()
    n = scores.numel()
    batch = _BATCH.get()
    if batch is not None:
        if batch.group.numel() != n:
            raise ValueError(
                f"the batch's outcomes have {batch.group.numel()} rows, its rewards {n}"
            )
        outcomes = Outcomes(scores, batch.group, batch.condition, batch.valid)
    else:
        if index is None:
            raise ValueError(
                f"{ADV_ESTIMATOR} needs verl's uid column (index) to find each row's subgroup"
            )
        group = _codes(list(index))
        outcomes = Outcomes(
            scores, group, torch.zeros(n, dtype=torch.long), torch.ones(n, dtype=torch.bool)
        )
    method = _METHOD.get() or default_method()
    adv = trained_advantages(method, outcomes).to(device=response_mask.device, dtype=torch.float32)
    out = adv[:, None] * response_mask.to(torch.float32)
    return out, out.clone()


@register_trainer(TRAINER_MODE)
class ComplementaryTrainer(PPOTrainerSync):
    """verl's synchronous v1 trainer with Complementary RL's two duties (module docstring).

    Reads ``crl.service_url`` / ``crl.token_file`` (else ``$CRL_EXPERIENCE_URL`` /
    ``$CRL_EXPERIENCE_TOKEN``), ``crl.method`` (default ``complementary``) and ``crl.config`` (a
    crl-train YAML for the method's settings) from verl's config (``+crl.service_url=...``).
    """

    def _crl(self) -> Mapping[str, Any]:
        section = self.config.get("crl") if hasattr(self.config, "get") else None
        return section if section is not None else {}

    def crl_method(self) -> ActorSide:
        if getattr(self, "_crl_method", None) is None:
            crl = self._crl()
            self._crl_method = method_named(
                str(crl.get("method", "complementary")), crl.get("config")
            )
        return self._crl_method

    def on_step_end(self) -> None:
        super().on_step_end()
        crl = self._crl()
        client = service_client(crl.get("service_url"), crl.get("token_file"))
        result = client.end_step(int(self.global_steps))
        logger.info("experience: step %d ended: %s", self.global_steps, result)

    def _compute_advantage(self, batch: Any, metrics: dict[str, Any]) -> Any:
        import transfer_queue as tq

        # what each episode reported, as verl's own trainer reads extra_fields back (a
        # NonTensorStack of dicts)
        data = tq.kv_batch_get(
            keys=batch.keys, partition_id=batch.partition_id, select_fields=["uid", "extra_fields"]
        )
        rows = batch_outcomes(data.pop("extra_fields").tolist(), data.pop("uid").tolist())
        token_batch, token_method = _BATCH.set(rows), _METHOD.set(self.crl_method())
        try:
            return super()._compute_advantage(batch, metrics)
        finally:
            _BATCH.reset(token_batch)
            _METHOD.reset(token_method)


def estimating(rows: BatchOutcomes | None, method: ActorSide | None = None) -> _Estimating:
    """Context manager: :func:`split_subgroup_estimator` reads ``rows`` (and ``method``) inside it,
    as under :class:`ComplementaryTrainer` (for a caller that runs verl's
    ``compute_advantage`` itself)."""
    return _Estimating(rows, method)


class _Estimating:
    def __init__(self, rows: BatchOutcomes | None, method: ActorSide | None) -> None:
        self.rows, self.method = rows, method

    def __enter__(self) -> None:
        self._tokens = (_BATCH.set(self.rows), _METHOD.set(self.method))

    def __exit__(self, *exc: object) -> None:
        _BATCH.reset(self._tokens[0])
        _METHOD.reset(self._tokens[1])


def setup_worker() -> None:
    """Ray's ``worker_process_setup_hook``: registers the estimator, the trainer and
    ``crl_agent`` in a verl process."""
    from crl_gym.integrations.verl.agent_loop import register_loop

    register_loop()


__all__ = [
    "ADV_ESTIMATOR",
    "TRAINER_MODE",
    "BatchOutcomes",
    "ComplementaryTrainer",
    "batch_outcomes",
    "default_method",
    "estimating",
    "method_named",
    "rollout_n",
    "rows_for",
    "setup_worker",
    "split_subgroup_estimator",
]
