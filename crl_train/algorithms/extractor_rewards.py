"""Rewards and advantages for the experience extractor (Sec. 2.3 of the paper).

r(m, τ) = +1 if episode τ (guided by entry m) succeeded, −1 otherwise (:func:`episode_rewards`: the
one place r(m, τ) is made, with the optional baseline, gate score and perplexity bonus).
r̄(m) = mean over the trajectories T_m guided by m in one rollout step (:func:`entry_rewards`).
Â_i = w(m_i) · (r̄(m_i) − mean_j r̄(m_j)), the batch-level advantage over the CISPO batch.

>>> import torch
>>> ids, rbar = entry_rewards(torch.tensor([7, 7, 9, 7]), torch.tensor([True, False, True, True]))
>>> ids.tolist(), rbar.tolist()
([7, 9], [0.3333333432674408, 1.0])
"""

from __future__ import annotations

import torch

from crl_train.config.names import PERPLEXITY_TRANSFORMS

GATE_SCORES: dict[str, float] = {"accept": 1.0, "refine": 0.5, "reject": 0.0}
"""Actor-critic gate (paper appendix, off by default): score added to r(m) per verdict."""


def outcome_rewards(success: torch.Tensor) -> torch.Tensor:
    """``[N]`` bool → ``[N]`` float32 in {−1, +1}."""
    return success.to(torch.float32) * 2.0 - 1.0


def episode_rewards(
    success: torch.Tensor,
    *,
    baseline: torch.Tensor | None = None,
    gate_score: torch.Tensor | None = None,
    bonus: torch.Tensor | None = None,
) -> torch.Tensor:
    """r(m, τ) of each episode: ±1 by success, minus ``baseline`` (the ``relative`` variant: its
    group's free-subgroup mean ±1, :func:`free_baselines`), plus the gate's ``gate_score`` s_c and
    the perplexity ``bonus`` b. Shapes: ``[N]`` each; None adds nothing.

    >>> episode_rewards(torch.tensor([True, False]), gate_score=torch.tensor([1.0, 0.5]),
    ...                 bonus=torch.tensor([0.25, 0.0])).tolist()
    [2.25, -0.5]
    """
    r = outcome_rewards(success)
    for name, term in (("baseline", baseline), ("gate_score", gate_score), ("bonus", bonus)):
        if term is not None and term.shape != r.shape:
            raise ValueError(f"{name} must be [N]={r.shape[0]}, got {tuple(term.shape)}")
    if baseline is not None:
        r = r - baseline.to(r.dtype)
    # s_c + b are summed in their own dtype first (a float64 caller keeps 0.5 + 0.1 exact before
    # the cast)
    extra = [t for t in (gate_score, bonus) if t is not None]
    if extra:
        r = r + (extra[0] if len(extra) == 1 else extra[0] + extra[1]).to(r.dtype)
    return r


def entry_rewards(
    entry_ids: torch.Tensor,
    success: torch.Tensor,
    gate_bonus: torch.Tensor | None = None,
    *,
    baseline: torch.Tensor | None = None,
    bonus: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """r̄(m): the mean of :func:`episode_rewards` per entry over the guided trajectories of one
    rollout step.

    Args:
        entry_ids: ``[N]`` long, the entry each guided trajectory saw.
        success: ``[N]`` bool.
        gate_bonus: optional ``[N]`` float, the actor-critic gate score of each trajectory's
            verdict on its entry (see :data:`GATE_SCORES`), added to r before averaging.
        baseline: optional ``[N]``, subtracted from r (``relative``: :func:`free_baselines`).
        bonus: optional ``[N]``, the perplexity bonus of each trajectory's entry, added to r.
    Returns:
        (``[M]`` sorted unique entry ids, ``[M]`` r̄(m)).
    """
    if entry_ids.shape != success.shape or entry_ids.dim() != 1:
        raise ValueError(
            f"entry_ids and success must both be [N], got {tuple(entry_ids.shape)} and "
            f"{tuple(success.shape)}"
        )
    if gate_bonus is not None and gate_bonus.shape != success.shape:
        raise ValueError(
            f"gate_bonus must be [N]={success.shape[0]}, got {tuple(gate_bonus.shape)}"
        )
    r = episode_rewards(success, baseline=baseline, gate_score=gate_bonus, bonus=bonus)
    return entry_mean_rewards(entry_ids, r)


def entry_mean_rewards(
    entry_ids: torch.Tensor, rewards: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean of ``rewards[N]`` per entry of ``entry_ids[N]``: (``[M]`` sorted unique ids,
    ``[M]`` means).

    >>> ids, mean = entry_mean_rewards(torch.tensor([4, 2, 4]), torch.tensor([1.0, -1.0, 0.0]))
    >>> ids.tolist(), mean.tolist()
    ([2, 4], [-1.0, 0.5])
    """
    if entry_ids.shape != rewards.shape or entry_ids.dim() != 1:
        raise ValueError(
            f"entry_ids and rewards must both be [N], got {tuple(entry_ids.shape)} and "
            f"{tuple(rewards.shape)}"
        )
    ids, inv = torch.unique(entry_ids, return_inverse=True)
    total = torch.zeros(ids.numel(), dtype=rewards.dtype).scatter_add_(0, inv, rewards)
    count = torch.zeros(ids.numel(), dtype=rewards.dtype).scatter_add_(
        0, inv, torch.ones_like(rewards)
    )
    return ids, total / count


def free_baselines(
    success: torch.Tensor, group_index: torch.Tensor, condition: torch.Tensor, guided: int = 0
) -> torch.Tensor:
    """Each episode's group's free-subgroup mean ±1 outcome (0 when the group has no free episode).

    Shapes: ``[N]`` each; ``condition`` holds ``guided`` (GUIDED = 0) or anything else for free.

    >>> free_baselines(torch.tensor([True, False, True, False]), torch.tensor([0, 0, 1, 1]),
    ...                torch.tensor([0, 1, 0, 0])).tolist()
    [-1.0, -1.0, 0.0, 0.0]
    """
    if not (success.shape == group_index.shape == condition.shape) or success.dim() != 1:
        raise ValueError("success, group_index and condition must all be [N]")
    r = outcome_rewards(success)
    is_free = condition != guided
    groups, inv = torch.unique(group_index, return_inverse=True)
    free_sum = torch.zeros(groups.numel()).scatter_add_(
        0, inv, torch.where(is_free, r, torch.zeros_like(r))
    )
    free_n = torch.zeros(groups.numel()).scatter_add_(0, inv, is_free.to(r.dtype))
    baseline = torch.where(free_n > 0, free_sum / free_n.clamp(min=1.0), torch.zeros_like(free_sum))
    return baseline[inv]


def relative_outcomes(
    success: torch.Tensor, group_index: torch.Tensor, condition: torch.Tensor, guided: int = 0
) -> torch.Tensor:
    """The relative reward the paper compared against direct reward (appendix B.2): each guided
    episode's ±1 outcome minus the mean ±1 outcome of its group's free subgroup (0 baseline when
    the group has no free episode). Free episodes get 0.

    Shapes: ``[N]`` each; ``condition`` holds ``guided`` (GUIDED = 0) or anything else for free.

    >>> relative_outcomes(torch.tensor([True, False, True, False]), torch.tensor([0, 0, 0, 0]),
    ...                   torch.tensor([0, 0, 1, 1])).tolist()
    [1.0, -1.0, 0.0, 0.0]
    >>> relative_outcomes(torch.tensor([True, False, False]), torch.tensor([0, 0, 0]),
    ...                   torch.tensor([0, 1, 1])).tolist()
    [2.0, 0.0, 0.0]
    """
    r = episode_rewards(success, baseline=free_baselines(success, group_index, condition, guided))
    return torch.where(condition != guided, torch.zeros_like(r), r)


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


def perplexity_bonus(
    delta_h: torch.Tensor,
    h_without: torch.Tensor,
    *,
    transform: str,
    weight: float = 1.0,
    temperature: float = 1.0,
    clip: float = 1.0,
    clip_negative: float = 0.1,
) -> torch.Tensor:
    """b = w · f(ΔH(m)), ΔH(m) = H(π_θ | q) − H(π_θ | q, m): how much the entry lowered the
    actor's entropy.

    Shapes: ``[M]`` each (``h_without`` is H(π_θ | q), read only by ``relative``).

    * ``relative``: f = clip(ΔH / H(π_θ | q), −clip, clip) (scale-free share of the
      entropy removed);
    * ``tanh``: f = tanh(ΔH);
    * ``sigmoid``: f = 2σ(ΔH / τ) − 1 (τ = ``temperature``);
    * ``asymmetric``: f = clip(ΔH, −clip_negative, clip) (a small penalty, a larger reward);
    * ``log``: f = sgn(ΔH) · log(1 + |ΔH|).

    >>> d = torch.tensor([0.5, -2.0]); h = torch.tensor([2.0, 1.0])
    >>> [round(x, 4) for x in perplexity_bonus(d, h, transform="relative").tolist()]
    [0.25, -1.0]
    >>> [round(x, 4) for x in perplexity_bonus(d, h, transform="asymmetric", weight=2.0).tolist()]
    [1.0, -0.2]
    """
    if delta_h.shape != h_without.shape or delta_h.dim() != 1:
        raise ValueError(
            f"delta_h and h_without must both be [M], got {tuple(delta_h.shape)} and "
            f"{tuple(h_without.shape)}"
        )
    if transform == "relative":
        f = (delta_h / h_without.clamp(min=1e-8)).clamp(-clip, clip)
    elif transform == "tanh":
        f = torch.tanh(delta_h)
    elif transform == "sigmoid":
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        f = 2.0 * torch.sigmoid(delta_h / temperature) - 1.0
    elif transform == "asymmetric":
        f = delta_h.clamp(-clip_negative, clip)
    elif transform == "log":
        f = torch.sign(delta_h) * torch.log1p(delta_h.abs())
    else:
        raise ValueError(
            f"unknown perplexity transform {transform!r}; accepted: "
            f"{', '.join(PERPLEXITY_TRANSFORMS)}"
        )
    return weight * f
