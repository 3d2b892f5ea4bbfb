"""Outcome advantages for the actor: plain GRPO and Complementary RL's split subgroups.

Shapes: ``N`` trajectories in the batch. ``group_index[N]`` (long) says which task group a
trajectory belongs to; ``condition[N]`` (long) is ``GUIDED`` (0) or ``FREE`` (1).

Standard deviation: the *population* std (``unbiased=False``) is the default. With binary
rewards and subgroups of K_c = 4 the unbiased std inflates every advantage by √(4/3); the
population std makes the advantages of a subgroup have mean 0 and mean square 1, and it is
defined (zero) for a subgroup of one, which then gets advantage 0 like any zero-spread
subgroup. ``unbiased=True`` reproduces ``torch.std``'s default (verl's choice).

Invalid episodes: every estimator (here and in :mod:`crl_train.algorithms.edge`) takes an
optional ``valid[N]`` bool. An episode with ``valid = False`` (it ended because the env raised:
it is not trained on) is left out of every count, mean and std, and its advantage is 0; its
reward is never read (it may be NaN). ``valid=None`` means every episode is valid.

>>> import torch
>>> r = torch.tensor([1., 0., 1., 1., 0., 0., 0., 1.])
>>> g = torch.zeros(8, dtype=torch.long)
>>> c = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
>>> [round(x, 3) for x in split_subgroup_advantages(r, g, c).tolist()]
[0.577, -1.732, 0.577, 0.577, -0.577, -0.577, -0.577, 1.732]
>>> v = torch.tensor([True, True, True, False, True, True, True, True])  # episode 3 raised
>>> [round(x, 3) for x in split_subgroup_advantages(r, g, c, valid=v).tolist()][:4]
[0.707, -1.414, 0.707, 0.0]
"""

from __future__ import annotations

import torch

from crl_train.algorithms.registry import ADVANTAGES, AdvantageEstimator

GUIDED = 0
FREE = 1
ZERO_SPREAD = 1e-6
"""A subgroup whose std is below this has no learning signal: its advantages are set to 0."""


def _valid_mask(valid: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``valid[N]`` as bool (all True when ``None``), checked against ``like[N]``."""
    if valid is None:
        return torch.ones(like.shape, dtype=torch.bool, device=like.device)
    if valid.shape != like.shape:
        raise ValueError(f"valid must be [N]={tuple(like.shape)}, got {tuple(valid.shape)}")
    return valid.to(device=like.device, dtype=torch.bool)


def _segment_normalise(
    rewards: torch.Tensor,
    segment: torch.Tensor,
    eps: float,
    unbiased: bool,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """(r − mean_s) / (std_s + ε) inside each segment id ``segment[N]``; zero-spread → 0.

    Only episodes with ``valid[N]`` True count towards a segment's mean and std; the others get 0.
    """
    if rewards.dim() != 1 or segment.shape != rewards.shape:
        raise ValueError(
            f"rewards and segment ids must both be [N], got {tuple(rewards.shape)} and "
            f"{tuple(segment.shape)}"
        )
    ok = _valid_mask(valid, rewards)
    v = ok.to(torch.float64)
    r = torch.where(ok, rewards.to(torch.float64), torch.zeros((), dtype=torch.float64))
    _, inv = torch.unique(segment, return_inverse=True)
    n_seg = int(inv.max().item()) + 1 if inv.numel() else 0
    count = torch.zeros(n_seg, dtype=torch.float64).scatter_add_(0, inv, v)
    mean = torch.zeros(n_seg, dtype=torch.float64).scatter_add_(0, inv, r) / count.clamp(min=1.0)
    dev = (r - mean[inv]) * v
    sq = torch.zeros(n_seg, dtype=torch.float64).scatter_add_(0, inv, dev * dev)
    denom = (count - 1).clamp(min=1) if unbiased else count.clamp(min=1.0)
    std = (sq / denom).sqrt()
    std = torch.where(count > 1, std, torch.zeros_like(std))
    adv = dev / (std[inv] + eps)
    adv = torch.where((std[inv] < ZERO_SPREAD) | ~ok, torch.zeros_like(adv), adv)
    return adv.to(rewards.dtype)


@ADVANTAGES.register(AdvantageEstimator.GRPO)
def grpo_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    condition: torch.Tensor | None = None,
    *,
    valid: torch.Tensor | None = None,
    eps: float = 1e-6,
    unbiased: bool = False,
) -> torch.Tensor:
    """Plain GRPO: normalise over the whole group of K, conditions pooled.

    Args:
        rewards: ``[N]`` outcome reward per trajectory.
        group_index: ``[N]`` long, the task group of each trajectory.
        condition: ignored (accepted so every estimator has one signature).
        valid: ``[N]`` bool or ``None`` (all valid); invalid episodes are left out of the group's
            mean and std and get advantage 0.
        eps: added to the std.
        unbiased: Bessel-corrected std instead of the population std.
    Returns:
        ``[N]`` advantages.
    """
    del condition
    return _segment_normalise(rewards, group_index, eps, unbiased, valid)


@ADVANTAGES.register(AdvantageEstimator.SPLIT_SUBGROUP)
def split_subgroup_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    condition: torch.Tensor | None = None,
    *,
    valid: torch.Tensor | None = None,
    eps: float = 1e-6,
    unbiased: bool = False,
) -> torch.Tensor:
    """Eq. 5 advantages: Â = (r − mean_c) / (std_c + ε) inside each (group, condition).

    Args:
        rewards: ``[N]``.
        group_index: ``[N]`` long, non-negative.
        condition: ``[N]`` long, ``GUIDED`` (0) or ``FREE`` (1); ``None`` means all free.
        valid: ``[N]`` bool or ``None`` (all valid); invalid episodes are left out of their
            subgroup's mean and std and get advantage 0.
        eps: added to the std.
        unbiased: Bessel-corrected std instead of the population std.
    Returns:
        ``[N]`` advantages; a subgroup whose rewards are all equal gets 0.
    """
    if condition is None:
        condition = torch.full_like(group_index, FREE)
    if condition.shape != group_index.shape:
        raise ValueError(
            f"condition {tuple(condition.shape)} must match group_index {tuple(group_index.shape)}"
        )
    if bool(((condition != GUIDED) & (condition != FREE)).any()):
        raise ValueError("condition values must be 0 (guided) or 1 (free)")
    segment = group_index.long() * 2 + condition.long()
    return _segment_normalise(rewards, segment, eps, unbiased, valid)


def sequence_weights(
    group_index: torch.Tensor, condition: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-trajectory loss weights implementing Eq. 5's ½ Σ_c (1/K_c) Σ_k, averaged over groups.

    Trajectory k of subgroup c in group g gets 1 / (G · C_g · K_{g,c}), where G is the number
    of groups in the batch and C_g the number of conditions present in group g (2 normally,
    which gives the ½). Without ``condition`` this is GRPO's 1 / (G · K_g). Weights sum to 1.

    Args:
        group_index: ``[N]`` long.
        condition: ``[N]`` long or ``None``.
    Returns:
        ``[N]`` float32 weights.
    """
    if condition is None:
        condition = torch.zeros_like(group_index)
    _, g_inv = torch.unique(group_index, return_inverse=True)
    n_groups = int(g_inv.max().item()) + 1 if g_inv.numel() else 0
    seg = g_inv * 2 + condition.long()
    _, s_inv, s_count = torch.unique(seg, return_inverse=True, return_counts=True)
    # conditions present per group: count distinct segments of each group
    seg_ids = torch.unique(seg)
    conds_per_group = torch.zeros(n_groups, dtype=torch.float32).scatter_add_(
        0, seg_ids // 2, torch.ones(seg_ids.numel(), dtype=torch.float32)
    )
    w = 1.0 / (n_groups * conds_per_group[g_inv] * s_count[s_inv].float())
    return w
