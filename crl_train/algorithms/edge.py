"""EDGE pieces (seed 003): marginal gain, gain gate, pooled advantage, EMA utility, pruning.

Per group of K rollouts, K/2 are teacher (guided, condition 0) and K/2 student (free, 1).
Δe = mean r(teacher) − mean r(student). The gate opens when Δe > threshold (0): then the
group's advantage is GRPO pooled over all K and teacher rollouts are trained and distilled;
otherwise teacher rollouts are masked out and the students get plain GRPO among themselves.

>>> import torch
>>> r = torch.tensor([1., 1., 0., 0.,  0., 0., 1., 1.])
>>> g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]); c = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1])
>>> marginal_gain(r, g, c).tolist()
[1.0, -1.0]
"""

from __future__ import annotations

import torch

from crl_train.algorithms.advantages import FREE, GUIDED, _segment_normalise
from crl_train.algorithms.registry import ADVANTAGES, AdvantageEstimator


def _subgroup_means(rewards: torch.Tensor, group_index: torch.Tensor, condition: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, g_inv = torch.unique(group_index, return_inverse=True)
    n = groups.numel()
    r = rewards.to(torch.float64)
    out = []
    for c in (GUIDED, FREE):
        sel = (condition == c).to(torch.float64)
        s = torch.zeros(n, dtype=torch.float64).scatter_add_(0, g_inv, r * sel)
        k = torch.zeros(n, dtype=torch.float64).scatter_add_(0, g_inv, sel)
        out.append(s / k.clamp(min=1.0))
        if bool((k == 0).any()):
            raise ValueError(f"every group needs both guided and free rollouts; group(s) {groups[k == 0].tolist()} lack condition {c}")
    return groups, out[0], out[1]


def marginal_gain(rewards: torch.Tensor, group_index: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
    """Δe per group, ``[G]`` (groups in sorted ``group_index`` order)."""
    _, guided, free = _subgroup_means(rewards, group_index, condition)
    return (guided - free).to(torch.float32)


def gain_gate(gain: torch.Tensor, threshold: float = 0.0) -> torch.Tensor:
    """``[G]`` bool: the experience is admitted when Δe > threshold."""
    return gain > threshold


@ADVANTAGES.register(AdvantageEstimator.EDGE_POOLED)
def edge_pooled_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    condition: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
    unbiased: bool = False,
    threshold: float = 0.0,
) -> torch.Tensor:
    """Advantages under the gate; teacher rollouts of closed-gate groups get 0.

    Use :func:`edge_train_mask` for the matching per-trajectory inclusion mask.
    Returns ``[N]``.
    """
    if condition is None:
        raise ValueError("edge_pooled advantages need the condition of each trajectory")
    _, g_inv = torch.unique(group_index, return_inverse=True)
    gates = gain_gate(marginal_gain(rewards, group_index, condition), threshold)[g_inv]
    # open group: one segment over all K; closed group: the students alone (teachers masked).
    segment = torch.where(gates, g_inv * 2, g_inv * 2 + condition.long())
    adv = _segment_normalise(rewards, segment, eps, unbiased)
    keep = (condition == FREE) | gates
    return torch.where(keep, adv, torch.zeros_like(adv))


def edge_train_mask(
    rewards: torch.Tensor, group_index: torch.Tensor, condition: torch.Tensor, *, threshold: float = 0.0
) -> torch.Tensor:
    """``[N]`` bool: students always; teachers only in groups whose gate is open."""
    _, g_inv = torch.unique(group_index, return_inverse=True)
    gates = gain_gate(marginal_gain(rewards, group_index, condition), threshold)[g_inv]
    return (condition == FREE) | gates


def ema_utility(utility: torch.Tensor, gain: torch.Tensor, momentum: float = 0.9) -> torch.Tensor:
    """U ← β·U + (1 − β)·Δe, elementwise over ``[M]`` entries."""
    if not 0.0 <= momentum <= 1.0:
        raise ValueError(f"momentum must be in [0, 1], got {momentum}")
    return momentum * utility + (1.0 - momentum) * gain


def prune_mask(utility: torch.Tensor, threshold: float) -> torch.Tensor:
    """``[M]`` bool: entries whose EMA utility fell below η are pruned."""
    return utility < threshold
