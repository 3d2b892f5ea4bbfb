"""EDGE pieces (seed 003): marginal gain, gain gate, pooled advantage, EMA utility, pruning.

Per group of K rollouts, K/2 are teacher (guided, condition 0) and K/2 student (free, 1).
Δe = mean r(teacher) − mean r(student). The gate opens when Δe > threshold (0): then the
group's advantage is GRPO pooled over all K and teacher rollouts are trained and distilled;
otherwise teacher rollouts are masked out and the students get plain GRPO among themselves.

Invalid episodes (``valid[N]`` False: the env raised) are left out of both means of Δe, of the
pooled or student-only mean/std, get advantage 0 and are never in the train mask. A group
whose teachers (or students) are all invalid has no measurable gain: Δe is NaN there and its
gate stays closed (callers skip NaN gains when they update an entry's utility).

>>> import torch
>>> r = torch.tensor([1., 1., 0., 0.,  0., 0., 1., 1.])
>>> g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]); c = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1])
>>> marginal_gain(r, g, c).tolist()
[1.0, -1.0]
>>> # a teacher of group 1 raised
>>> v = torch.tensor([True, True, True, True, True, False, True, True])
>>> marginal_gain(torch.tensor([1., 1., 0., 0., 1., 0., 1., 1.]), g, c, valid=v).tolist()
[1.0, 0.0]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from crl_train.algorithms.advantages import FREE, GUIDED, _segment_normalise, _valid_mask
from crl_train.algorithms.registry import ADVANTAGES, AdvantageEstimator, AdvantageParams


def _subgroup_means(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    condition: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted group ids ``[G]``, mean teacher reward ``[G]``, mean student reward ``[G]``).

    A mean over no valid episode is NaN; a group without any episode of a condition raises.
    """
    if rewards.dim() != 1 or group_index.shape != rewards.shape or condition.shape != rewards.shape:
        raise ValueError(
            f"rewards, group_index and condition must all be [N], got {tuple(rewards.shape)}, "
            f"{tuple(group_index.shape)} and {tuple(condition.shape)}"
        )
    ok = _valid_mask(valid, rewards)
    groups, g_inv = torch.unique(group_index, return_inverse=True)
    n = groups.numel()
    r = torch.where(ok, rewards.to(torch.float64), torch.zeros((), dtype=torch.float64))
    out = []
    for c in (GUIDED, FREE):
        present = torch.zeros(n, dtype=torch.float64).scatter_add_(
            0, g_inv, (condition == c).to(torch.float64)
        )
        if bool((present == 0).any()):
            raise ValueError(
                "every group needs both guided and free rollouts; group(s) "
                f"{groups[present == 0].tolist()} lack condition {c}"
            )
        sel = ((condition == c) & ok).to(torch.float64)
        s = torch.zeros(n, dtype=torch.float64).scatter_add_(0, g_inv, r * sel)
        k = torch.zeros(n, dtype=torch.float64).scatter_add_(0, g_inv, sel)
        out.append(torch.where(k > 0, s / k.clamp(min=1.0), torch.full_like(s, float("nan"))))
    return groups, out[0], out[1]


def marginal_gain(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    condition: torch.Tensor,
    *,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Δe = mean r(valid teachers) − mean r(valid students) per group.

    Args:
        rewards: ``[N]``.
        group_index: ``[N]`` long.
        condition: ``[N]`` long, ``GUIDED`` (0) or ``FREE`` (1); every group needs both.
        valid: ``[N]`` bool or ``None`` (all valid); invalid episodes are left out of both means.
    Returns:
        ``[G]`` float32, groups in sorted ``group_index`` order; NaN for a group whose teachers or
        students are all invalid.
    """
    _, guided, free = _subgroup_means(rewards, group_index, condition, valid)
    return (guided - free).to(torch.float32)


def gain_gate(gain: torch.Tensor, threshold: float = 0.0) -> torch.Tensor:
    """``[G]`` bool: the experience is admitted when Δe > threshold (a NaN gain never is)."""
    return gain > threshold


def _open_gates(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    condition: torch.Tensor,
    valid: torch.Tensor | None,
    threshold: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``[N]`` dense group id, ``[N]`` bool gate of each episode's group)."""
    _, g_inv = torch.unique(group_index, return_inverse=True)
    gates = gain_gate(marginal_gain(rewards, group_index, condition, valid=valid), threshold)[g_inv]
    return g_inv, gates


@dataclass(frozen=True)
class EdgeAdvantageParams(AdvantageParams):
    """:func:`edge_pooled_advantages`' keywords: the common ones and the gain
    gate's ``threshold``."""

    threshold: float = 0.0


@ADVANTAGES.register(AdvantageEstimator.EDGE_POOLED)
def edge_pooled_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    condition: torch.Tensor | None = None,
    *,
    valid: torch.Tensor | None = None,
    eps: float = 1e-6,
    unbiased: bool = False,
    threshold: float = 0.0,
) -> torch.Tensor:
    """Advantages under the gate; teacher rollouts of closed-gate groups get 0.

    Use :func:`edge_train_mask` (same ``valid`` and ``threshold``) for the matching
    per-trajectory inclusion mask.

    Args:
        rewards: ``[N]``.
        group_index: ``[N]`` long.
        condition: ``[N]`` long, required (``None`` raises).
        valid: ``[N]`` bool or ``None`` (all valid); invalid episodes are left out of the gain
            and of the mean/std, and get advantage 0.
        eps: added to the std.
        unbiased: Bessel-corrected std instead of the population std.
        threshold: the gate opens when Δe > threshold.
    Returns:
        ``[N]`` advantages.
    """
    if condition is None:
        raise ValueError("edge_pooled advantages need the condition of each trajectory")
    g_inv, gates = _open_gates(rewards, group_index, condition, valid, threshold)
    # open group: one segment over all K; closed group: the students alone (teachers masked).
    segment = torch.where(gates, g_inv * 2, g_inv * 2 + condition.long())
    adv = _segment_normalise(rewards, segment, eps, unbiased, valid)
    keep = (condition == FREE) | gates
    return torch.where(keep, adv, torch.zeros_like(adv))


def edge_train_mask(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    condition: torch.Tensor,
    *,
    valid: torch.Tensor | None = None,
    threshold: float = 0.0,
) -> torch.Tensor:
    """``[N]`` bool: valid students always; valid teachers only in groups whose gate is open.

    Args:
        rewards, group_index, condition: ``[N]`` as in :func:`marginal_gain`.
        valid: ``[N]`` bool or ``None`` (all valid); invalid episodes are never in the mask.
        threshold: the gate opens when Δe > threshold.
    """
    _, gates = _open_gates(rewards, group_index, condition, valid, threshold)
    return ((condition == FREE) | gates) & _valid_mask(valid, rewards)


def ema_utility(utility: torch.Tensor, gain: torch.Tensor, momentum: float = 0.9) -> torch.Tensor:
    """U ← β·U + (1 − β)·Δe, elementwise over ``[M]`` entries."""
    if not 0.0 <= momentum <= 1.0:
        raise ValueError(f"momentum must be in [0, 1], got {momentum}")
    return momentum * utility + (1.0 - momentum) * gain


def prune_mask(utility: torch.Tensor, threshold: float) -> torch.Tensor:
    """``[M]`` bool: entries whose EMA utility fell below η are pruned."""
    return utility < threshold
