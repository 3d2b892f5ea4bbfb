"""Split-subgroup advantages inside OpenRLHF's experience maker, by our own estimators.

OpenRLHF computes advantages inline in ``RemoteExperienceMaker.compute_advantages_and_returns``
(rewards reshaped into groups of ``n_samples_per_prompt``; no hook). The trainer subclasses
(``crl_train.openrlhf.trainer``) install a maker whose class puts
:class:`SplitSubgroupAdvantageMixin` first, so this method replaces the inline one. It imports
nothing from OpenRLHF (``experience_maker`` needs CUDA packages to import); it reads only the fields
of OpenRLHF's ``Experience`` it needs and is tested on real ``Experience`` objects.

What it computes, per rollout batch (rewards in the original sample order, ``experience.index``):

* group g = sample // K (OpenRLHF's own grouping), condition from ``info["crl_guided"]`` (the
  executor's :class:`~crl_train.openrlhf.executor.ConditionAssigner`), ``valid`` from
  ``info["crl_valid"]`` (0: the episode ended by an env error);
* Â = the method's estimator (``split_subgroup_advantages`` for the guided methods,
  ``grpo_advantages`` for ``grpo``: ``crl_train.algorithms.advantages``, the same functions as the
  ``hf`` backend), and 0 where the method's ``train_mask`` is False
  (``crl_train.rollout.contract.trained_advantages``, handed the batch's
  :class:`~crl_train.rollout.contract.Outcomes`);
* ``advantages`` = ``returns`` = Â on every action token (outcome reward, γ = 1, no KL in the
  reward: what OpenRLHF's ``group_norm`` path produces from its own normalised reward), plus the
  ``group_reward_std`` and ``return`` logs OpenRLHF writes.

Refused (``ValueError``): a KL penalty in the reward (``--algo.kl.init_coef > 0`` without
``--algo.kl.use_loss``) and OpenRLHF's length penalties, which would change r before the split.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from crl_train.algorithms import FREE, GUIDED
from crl_train.rollout.contract import Outcomes, trained_advantages

if TYPE_CHECKING:
    from crl_train.methods import Method

GUIDED_KEY = "crl_guided"
VALID_KEY = "crl_valid"


def rollout_tensors(
    experiences: Sequence[Any], n_samples: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(reward, group, condition, valid, order)`` of a batch, each ``[N]`` in the original
    sample order.

    ``order[i]`` is the position (in the concatenation of ``experiences``) of original sample i.
    """
    index = list(itertools.chain.from_iterable(e.index for e in experiences))
    n = len(index)
    if n == 0 or n % n_samples:
        raise ValueError(
            f"{n} samples do not form whole groups of n_samples_per_prompt={n_samples}"
        )
    if sorted(index) != list(range(n)):
        raise ValueError(
            "experience.index must number the batch's samples 0..N-1 (OpenRLHF's "
            "split_rollout_samples)"
        )
    flat_reward = torch.cat([e.rewards.reshape(-1).to(torch.float32) for e in experiences])

    def info(key: str, default: float) -> torch.Tensor:
        parts = []
        for e in experiences:
            v = e.info.get(key)
            size = len(e.index)
            parts.append(
                torch.full((size,), default)
                if v is None
                else torch.as_tensor(v, dtype=torch.float32).reshape(-1)
            )
        return torch.cat(parts)

    flat_guided, flat_valid = info(GUIDED_KEY, 0.0), info(VALID_KEY, 1.0)
    if not (flat_reward.numel() == flat_guided.numel() == flat_valid.numel() == n):
        raise ValueError(
            f"rewards ({flat_reward.numel()}), {GUIDED_KEY} ({flat_guided.numel()}) and "
            f"{VALID_KEY} ({flat_valid.numel()}) must have one value per sample ({n})"
        )
    order = torch.empty(n, dtype=torch.long)
    order[torch.tensor(index)] = torch.arange(n)
    reward = flat_reward[order]
    condition = torch.where(
        flat_guided[order] > 0.5, torch.tensor(GUIDED), torch.tensor(FREE)
    ).long()
    valid = flat_valid[order] > 0.5
    group = torch.arange(n) // n_samples
    return reward, group, condition, valid, order


class SplitSubgroupAdvantageMixin:
    """Replaces ``compute_advantages_and_returns`` of the experience maker it is mixed into (see the
    module docstring).

    The host class gives ``self.strategy.args`` (OpenRLHF's hierarchical args) and ``self.kl_ctl``.
    ``crl_method`` is the method whose estimator is used (default: the launcher's settings).
    """

    strategy: Any
    kl_ctl: Any
    crl_method: Method | None = None

    def _crl_method(self) -> Method:
        if self.crl_method is None:
            from crl_train.methods import make_method
            from crl_train.openrlhf.settings import load_settings

            self.crl_method = make_method(load_settings().train_config())
        return self.crl_method

    @torch.no_grad()
    def compute_advantages_and_returns(self, experiences: list[Any]) -> list[Any]:
        args = self.strategy.args
        _check_supported(args, getattr(self.kl_ctl, "value", 0.0))
        n_samples = int(args.rollout.n_samples_per_prompt)
        for e in experiences:
            e.rewards = e.rewards.to(torch.promote_types(e.rewards.dtype, torch.float32))
        reward, group, condition, valid, order = rollout_tensors(experiences, n_samples)
        adv = trained_advantages(self._crl_method(), Outcomes(reward, group, condition, valid))
        std = reward.reshape(-1, n_samples).std(-1, keepdim=True).expand(-1, n_samples).reshape(-1)
        # back to the batch's own order, then split per experience
        flat_adv = torch.empty_like(adv)
        flat_adv[order] = adv
        flat_std = torch.empty_like(std)
        flat_std[order] = std
        sizes = [len(e.index) for e in experiences]
        for e, a, s in zip(experiences, flat_adv.split(sizes), flat_std.split(sizes), strict=True):
            mask = e.action_mask.to(torch.float32)
            e.advantages = a.to(mask.device)[:, None] * mask
            e.returns = e.advantages.clone()
            e.info["return"] = a.clone()
            if n_samples > 1:
                e.info["group_reward_std"] = s.clone()
            e.kl = None
        return experiences


def _check_supported(args: Any, kl_coef: float) -> None:
    """Refuse the OpenRLHF options that would change r before the split (see the
    module docstring)."""
    if kl_coef and not args.algo.kl.use_loss:
        raise ValueError(
            f"split-subgroup advantages use the outcome reward alone: a KL penalty in the reward "
            f"(--algo.kl.init_coef {kl_coef}) is not supported; use --algo.kl.init_coef 0 "
            "(the paper: no KL) or --algo.kl.use_loss"
        )
    reward = args.reward
    for flag in ("overlong_buffer_len", "stop_properly_penalty_coef"):
        if getattr(reward, flag, None) is not None:
            raise ValueError(
                f"--reward.{flag} changes the reward before the advantages; not supported with "
                "split-subgroup advantages"
            )


__all__ = ["GUIDED_KEY", "VALID_KEY", "SplitSubgroupAdvantageMixin", "rollout_tensors"]
