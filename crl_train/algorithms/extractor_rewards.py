"""Rewards and advantages for the experience extractor (Sec. 2.3 of the paper).

r(m, τ) = +1 if episode τ (guided by entry m) succeeded, −1 otherwise.
r̄(m) = mean over the trajectories T_m guided by m in one rollout step.
Â_i = w(m_i) · (r̄(m_i) − mean_j r̄(m_j)), the batch-level advantage over the CISPO batch.

>>> import torch
>>> ids, rbar = entry_rewards(torch.tensor([7, 7, 9, 7]), torch.tensor([True, False, True, True]))
>>> ids.tolist(), rbar.tolist()
([7, 9], [0.3333333432674408, 1.0])
"""

from __future__ import annotations

import torch

GATE_SCORES: dict[str, float] = {"accept": 1.0, "refine": 0.5, "reject": 0.0}
"""Actor-critic gate (paper appendix, off by default): score added to r(m) per verdict."""


def outcome_rewards(success: torch.Tensor) -> torch.Tensor:
    """``[N]`` bool → ``[N]`` float32 in {−1, +1}."""
    return success.to(torch.float32) * 2.0 - 1.0


def entry_rewards(
    entry_ids: torch.Tensor, success: torch.Tensor, gate_bonus: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Average ±1 outcomes per entry over the guided trajectories of one rollout step.

    Args:
        entry_ids: ``[N]`` long, the entry each guided trajectory saw.
        success: ``[N]`` bool.
        gate_bonus: optional ``[N]`` float, the actor-critic gate score of each trajectory's
            verdict on its entry (see :data:`GATE_SCORES`), added to r before averaging.
    Returns:
        (``[M]`` sorted unique entry ids, ``[M]`` r̄(m)).
    """
    if entry_ids.shape != success.shape or entry_ids.dim() != 1:
        raise ValueError(f"entry_ids and success must both be [N], got {tuple(entry_ids.shape)} and {tuple(success.shape)}")
    r = outcome_rewards(success)
    if gate_bonus is not None:
        if gate_bonus.shape != r.shape:
            raise ValueError(f"gate_bonus must be [N]={r.shape[0]}, got {tuple(gate_bonus.shape)}")
        r = r + gate_bonus.to(r.dtype)
    ids, inv = torch.unique(entry_ids, return_inverse=True)
    total = torch.zeros(ids.numel(), dtype=r.dtype).scatter_add_(0, inv, r)
    count = torch.zeros(ids.numel(), dtype=r.dtype).scatter_add_(0, inv, torch.ones_like(r))
    return ids, total / count


def batch_advantages(rbar: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Â_i = w_i · (r̄_i − mean r̄) over the ``[M]`` samples of one CISPO batch.

    The mean is taken over all samples (weighted or not): w only scales each sample's
    advantage, it does not move the baseline.
    """
    if rbar.dim() != 1:
        raise ValueError(f"rbar must be [M], got {tuple(rbar.shape)}")
    adv = rbar - rbar.mean() if rbar.numel() else rbar
    if weights is not None:
        if weights.shape != rbar.shape:
            raise ValueError(f"weights must be [M]={rbar.shape[0]}, got {tuple(weights.shape)}")
        adv = adv * weights.to(adv.dtype)
    return adv
