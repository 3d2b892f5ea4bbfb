"""Complementary RL's actor side in TRL 1.16: ``ComplementaryGRPOTrainer``, a ``GRPOTrainer``.

TRL computes GRPO advantages inline in ``GRPOTrainer._generate_and_score_completions``
(``rewards - mean_grouped_rewards`` over ``rewards.view(-1, num_generations)``, divided by the
Bessel-corrected group std + 1e-4): one group per prompt, guided and free pooled. This subclass
replaces them with the paper's split-subgroup advantages (Eq. 5,
:func:`crl_train.algorithms.split_subgroup_advantages`): inside each prompt's group the guided and
the free generations are normalised apart (population std, ε = 1e-6, a zero-spread subgroup → 0).

Which generations are guided: TRL's ``RepeatSampler`` puts the ``num_generations`` copies of a
row next to each other in the generation batch (process ``p`` holds the slice starting at
``p * len(inputs)``), so generation ``j`` of a row sits at global index ``i`` with
``j = i mod num_generations``. For a row whose ``experience`` is ``"split"`` (or absent), the
first ``num_generations // 2`` copies are guided and the rest free; ``"guided"`` / ``"free"`` rows
keep their value. The resolved value is written into each copy's ``experience`` before TRL calls
``reset(**row)``, so the environment runs that condition
(:mod:`crl_gym.integrations.trl`); after the rollout the condition is read back from each
environment (``env.condition``: an episode whose search failed ran free and is normalised with
the free half), or taken from the row for an environment without one.

Eq. 5's ½ Σ_c 1/K_c weighting: TRL's ``loss_type="grpo"`` averages per-sequence losses over the
N sequences (weight 1/N); the paper's weight is w_k = 1/(G · C_g · K_{g,c})
(:func:`crl_train.algorithms.sequence_weights`). The clipped surrogate is positively homogeneous
in Â, so handing TRL Â_k · N · w_k makes its mean the paper's weighted sum
(:func:`trl_advantages`). With both halves of K/2 in every group N · w_k = 1: the advantages
TRL trains on are exactly ``split_subgroup_advantages``. Set ``loss_type="grpo"``,
``importance_sampling_level="sequence"`` and ``beta=0.0`` for the paper's objective
(:data:`PAPER_SETTINGS`); other loss types keep TRL's own token aggregation on top.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from crl_gym.integrations.trl import split_conditions
from crl_train.algorithms import sequence_weights, split_subgroup_advantages
from crl_train.algorithms.advantages import FREE, GUIDED
from crl_train.rollout.contract import (
    CONDITION_IDS,
    ActorSide,
    Outcomes,
    trained_advantages,
)

try:
    from trl import GRPOTrainer
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "crl_train.integrations.trl needs trl==1.16.0: pip install 'complementary-rl[train]'"
    ) from exc

if TYPE_CHECKING:
    from crl_gym.integrations.trl import TRLExperience

logger = logging.getLogger(__name__)

PAPER_SETTINGS: dict[str, Any] = {
    "loss_type": "grpo",
    "importance_sampling_level": "sequence",
    "beta": 0.0,
}
"""``GRPOConfig`` keys for the paper's actor objective: a length-normalised sequence ratio, the
per-sequence mean the Eq. 5 weights are folded into, no KL term."""


def trl_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    condition: torch.Tensor,
    *,
    valid: torch.Tensor | None = None,
    method: ActorSide | None = None,
) -> torch.Tensor:
    """Split-subgroup Â with Eq. 5's weights folded in for a loss that averages over the
    N sequences.

    Returns ``split_subgroup_advantages(r, g, c, valid) · N · sequence_weights(g, c)`` (weights over
    the valid episodes; an invalid one gets 0), which is the split-subgroup Â itself when every
    group has two halves of equal size. With a ``method``: its advantages where its train mask is
    True (:func:`crl_train.rollout.contract.trained_advantages`, what every loop trains on) times
    ``N · sequence_weights`` over the trained episodes (by condition only for a guided method), the
    weights our own loop puts in its loss.

    >>> r = torch.tensor([1., 0., 1., 1., 0., 0., 0., 1.])
    >>> g = torch.zeros(8, dtype=torch.long)
    >>> c = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    >>> torch.allclose(trl_advantages(r, g, c), split_subgroup_advantages(r, g, c))
    True
    >>> # uneven halves: 1 guided (a singleton: Â 0), 2 free (Â ±1) weighted 1/4 each, N = 3
    >>> a = trl_advantages(torch.tensor([1., 1., 0.]), torch.zeros(3, dtype=torch.long),
    ...                    torch.tensor([0, 1, 1]))
    >>> [round(x, 4) for x in a.tolist()]
    [0.0, 0.75, -0.75]
    """
    n = rewards.numel()
    ok = torch.ones(n, dtype=torch.bool) if valid is None else valid.to(torch.bool).cpu()
    by_condition = True
    if method is None:
        adv = split_subgroup_advantages(rewards, group_index, condition, valid=valid)
    else:
        outcomes = Outcomes(rewards.cpu().to(torch.float32), group_index.cpu(), condition.cpu(), ok)
        adv = trained_advantages(method, outcomes).to(rewards.device)
        ok = method.train_mask(outcomes).to(torch.bool) & ok
        by_condition = method.guided
    scale = torch.zeros(n, dtype=torch.float32)
    if bool(ok.any()):
        scale[ok] = n * sequence_weights(
            group_index.cpu()[ok], condition.cpu()[ok] if by_condition else None
        )
    return adv * scale.to(device=adv.device, dtype=adv.dtype)


@dataclass(frozen=True)
class SplitBatch:
    """One generation batch's split-subgroup inputs and outputs, over every process
    (``[N]`` each)."""

    rewards: torch.Tensor
    group_index: torch.Tensor
    condition: torch.Tensor
    valid: torch.Tensor
    advantages: torch.Tensor


class ComplementaryGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose advantages are Complementary RL's split-subgroup ones
    (module docstring).

    Args:
        *args, **kwargs: ``GRPOTrainer``'s.
        experience: a :class:`crl_gym.integrations.trl.TRLExperience`: its ``environment_factory``
            is used when none is given, and its end-step callback is added; evaluation episodes
            (``trainer.evaluate()``) carry ``rollout_step = -1``, which the service never credits.
        method: the method whose actor side decides the conditions and the advantages
            (``crl_train.methods.make_method(cfg)``, as ``crl-train --method`` builds it: ``grpo``
            runs every copy free and pools the group, ``edge`` trains only the groups its gate
            opens); None is Complementary RL's split-subgroup advantages.

    ``last_split`` holds the latest generation batch's :class:`SplitBatch`.
    """

    def __init__(
        self,
        *args: Any,
        experience: TRLExperience | None = None,
        method: ActorSide | None = None,
        **kwargs: Any,
    ) -> None:
        self._crl_session = experience
        self.crl_method = method
        if experience is not None:
            kwargs.setdefault("environment_factory", experience.environment_factory)
            kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), experience.callback()]
        super().__init__(*args, **kwargs)
        if self.scale_rewards != "group":
            raise ValueError(
                "split-subgroup advantages normalise inside each half; scale_rewards must be "
                f"'group', got {self.scale_rewards!r}"
            )
        if self.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError(
                "split-subgroup advantages sum the reward functions first: "
                "multi_objective_aggregation must be 'sum_then_normalize', got "
                f"{self.multi_objective_aggregation!r}"
            )
        self.last_split: SplitBatch | None = None
        self._crl_rewards: torch.Tensor | None = None

    def _calculate_rewards(
        self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any
    ) -> torch.Tensor:
        rewards_per_func: torch.Tensor = super()._calculate_rewards(
            inputs, prompts, completions, completion_ids_list
        )
        self._crl_rewards = rewards_per_func  # gathered over processes: [N, reward functions]
        return rewards_per_func

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        mode = "train" if getattr(self.model, "training", False) else "eval"
        count = self.num_generations if mode == "train" else self.num_generations_eval
        if count is None:
            raise ValueError("GRPOConfig.num_generations is not set")
        num_generations = int(count)
        offset = self.accelerator.process_index * len(inputs)
        positions = [(offset + i) % num_generations for i in range(len(inputs))]
        guided = self.crl_method is None or self.crl_method.guided
        conditions = split_conditions(
            [x.get("experience") for x in inputs], positions, num_generations, guided=guided
        )
        rows = [{**x, "experience": c} for x, c in zip(inputs, conditions, strict=True)]
        self._crl_rewards = None
        session, open_step = self._crl_session, None
        if (
            session is not None and mode == "eval"
        ):  # held-out episodes: a negative step is never credited
            open_step, session.step = session.step, -1
        try:
            output: dict[str, Any] = super()._generate_and_score_completions(rows)
        finally:
            if session is not None and open_step is not None:
                session.step = open_step
        if self._crl_rewards is None:
            raise RuntimeError(
                "GRPOTrainer computed no rewards for the batch (its _calculate_rewards was "
                "not called)"
            )
        device = self.accelerator.device
        envs = self.environments or []
        ran = (
            [getattr(env, "condition", c) for env, c in zip(envs, conditions, strict=True)]
            if envs
            else conditions
        )
        local = torch.tensor([CONDITION_IDS[c] for c in ran], dtype=torch.long, device=device)
        condition = self.accelerator.gather(local).cpu()
        per_func = self._crl_rewards.cpu()
        valid = ~torch.isnan(per_func).all(dim=1)
        rewards = (per_func * self.reward_weights.cpu().unsqueeze(0)).nansum(dim=1)
        group_index = torch.arange(rewards.numel()) // num_generations
        advantages = trl_advantages(
            rewards, group_index, condition, valid=valid, method=self.crl_method
        )
        self.last_split = SplitBatch(rewards, group_index, condition, valid, advantages)
        part = slice(
            self.accelerator.process_index * len(inputs),
            (self.accelerator.process_index + 1) * len(inputs),
        )
        output["advantages"] = advantages[part].to(device=device, dtype=output["advantages"].dtype)
        logged = self._logs["advantages"]  # TRL's completions table: show the advantages trained on
        for _ in range(min(len(logged), advantages.numel())):
            logged.pop()
        logged.extend(advantages.tolist())
        guided = (condition == GUIDED) & valid
        free = (condition == FREE) & valid
        metrics = self._metrics[mode]
        metrics["crl/guided_fraction"].append(float(guided.float().mean()))
        if bool(guided.any()):
            metrics["crl/guided_reward"].append(float(rewards[guided].mean()))
        if bool(free.any()):
            metrics["crl/free_reward"].append(float(rewards[free].mean()))
        return output


__all__ = [
    "PAPER_SETTINGS",
    "ComplementaryGRPOTrainer",
    "SplitBatch",
    "split_conditions",
    "trl_advantages",
]
