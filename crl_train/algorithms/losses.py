"""Losses over per-token log-probs. Each returns ``(loss, metrics)``; the loss is minimised.

Shapes: ``B`` sequences, ``T`` padded tokens. ``mask[B, T]`` is 1 on the tokens being trained
(the agent's own action tokens, or the extractor's response tokens) and 0 on observations,
experience text, prompts and padding.
"""

from __future__ import annotations

from typing import Literal

import torch

from crl_train.algorithms.registry import LOSSES, PolicyLoss

Metrics = dict[str, float]
RatioLevel = Literal["token", "sequence"]


def _check(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor) -> None:
    if logprobs.dim() != 2 or logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs, old_logprobs and mask must share a [B, T] shape, got "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(mask.shape)}"
        )
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be [B]={logprobs.shape[0]}, got {tuple(advantages.shape)}")


@LOSSES.register(PolicyLoss.CLIP)
def clip_surrogate_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    clip_eps: float = 0.2,
    ratio_level: RatioLevel = "token",
) -> tuple[torch.Tensor, Metrics]:
    """−Σ_k w_k · L_clip(ρ_k, Â_k), the split-subgroup GRPO objective of Eq. 5 (no KL).

    ``L_clip(ρ, A) = min(ρA, clip(ρ, 1−ε, 1+ε)A)``.

    * ``ratio_level="sequence"``: ρ_k = exp(mean_t(logπ − logπ_old)) over the masked tokens
      (the length-normalised sequence ratio of Eq. 5), one L_clip per trajectory.
    * ``ratio_level="token"``: ρ_{k,t} per token; L_k = mean_t L_clip(ρ_{k,t}, Â_k).

    Args:
        logprobs: ``[B, T]`` log π_θ of the taken tokens (with grad).
        old_logprobs: ``[B, T]`` log π_θ_old at generation time.
        advantages: ``[B]``.
        mask: ``[B, T]`` 1 on the agent's own tokens.
        weights: ``[B]`` per-trajectory weights, e.g. :func:`~crl_train.algorithms.advantages.sequence_weights`
            (½·1/K_c per group); ``None`` = 1/B each.
    Returns:
        (scalar loss, metrics: ``clip_frac``, ``ratio_mean``, ``approx_kl``).
    """
    _check(logprobs, old_logprobs, mask, advantages)
    if ratio_level not in ("token", "sequence"):
        raise ValueError(f"ratio_level must be 'token' or 'sequence', got {ratio_level!r}")
    b = logprobs.shape[0]
    m = mask.to(logprobs.dtype)
    n_tok = m.sum(dim=1).clamp(min=1.0)
    w = torch.full((b,), 1.0 / max(b, 1), dtype=logprobs.dtype) if weights is None else weights.to(logprobs.dtype)
    log_ratio = (logprobs - old_logprobs.detach()) * m
    adv = advantages.to(logprobs.dtype).detach()
    lo, hi = 1.0 - clip_eps, 1.0 + clip_eps
    if ratio_level == "sequence":
        ratio = torch.exp(log_ratio.sum(dim=1) / n_tok)  # [B]
        surr = torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)
        per_seq = surr
        clipped = ((ratio < lo) | (ratio > hi)).to(logprobs.dtype)
        clip_frac = clipped.mean()
        ratio_mean = ratio.mean()
    else:
        ratio_t = torch.exp(log_ratio)  # [B, T]
        a = adv[:, None]
        surr_t = torch.minimum(ratio_t * a, ratio_t.clamp(lo, hi) * a)
        per_seq = (surr_t * m).sum(dim=1) / n_tok
        clipped_t = ((ratio_t < lo) | (ratio_t > hi)).to(logprobs.dtype) * m
        clip_frac = clipped_t.sum() / m.sum().clamp(min=1.0)
        ratio_mean = (ratio_t * m).sum() / m.sum().clamp(min=1.0)
    loss = -(w * per_seq).sum()
    approx_kl = ((-log_ratio) * m).sum() / m.sum().clamp(min=1.0)
    metrics = {
        "loss": float(loss.detach()),
        "clip_frac": float(clip_frac.detach()),
        "ratio_mean": float(ratio_mean.detach()),
        "approx_kl": float(approx_kl.detach()),
    }
    return loss, metrics


@LOSSES.register(PolicyLoss.CISPO)
def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    eps_low: float = 0.1,
    eps_high: float = 0.1,
) -> tuple[torch.Tensor, Metrics]:
    """Eq. 3 (CISPO), negated: −Σ_i Σ_t sg(clip(ρ_it, 1−ε_low, 1+ε_high)) Â_i log π_φ(m_it) / Σ_i |m_i|.

    The clipped IS weight carries no gradient, so every token's gradient is
    ``−sg(ρ̂_it) Â_i / Σ|m|`` times ∇log π — clipped tokens still learn (unlike PPO).

    Args:
        logprobs: ``[B, T]`` log π_φ of the extractor's response tokens (with grad).
        old_logprobs: ``[B, T]`` log-probs stored when the entry was generated.
        advantages: ``[B]`` Â_i = w(m_i)·(r̄(m_i) − mean r̄).
        mask: ``[B, T]`` 1 on response tokens.
        weights: unused (accepted so losses share a signature).
    Returns:
        (scalar loss, metrics: ``clip_frac``, ``is_weight_mean``, ``num_tokens``).
    """
    del weights
    _check(logprobs, old_logprobs, mask, advantages)
    m = mask.to(logprobs.dtype)
    total = m.sum().clamp(min=1.0)
    ratio = torch.exp((logprobs.detach() - old_logprobs.detach()) * m)
    is_w = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)  # detached: sg(·)
    adv = advantages.to(logprobs.dtype).detach()[:, None]
    loss = -(is_w * adv * logprobs * m).sum() / total
    clipped = (((ratio < 1.0 - eps_low) | (ratio > 1.0 + eps_high)).to(logprobs.dtype) * m).sum() / total
    metrics = {
        "loss": float(loss.detach()),
        "clip_frac": float(clipped),
        "is_weight_mean": float((is_w * m).sum() / total),
        "num_tokens": float(m.sum()),
    }
    return loss, metrics


@LOSSES.register(PolicyLoss.REVERSE_KL_TOPK)
def reverse_kl_topk_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    top_k: int = 20,
) -> tuple[torch.Tensor, Metrics]:
    """EDGE's on-support reverse KL, KL(π_student ‖ sg(π_teacher)), over the student's top-k tokens.

    Both models score the *student's own* generated prefix (teacher = same policy with the
    experience in context). Per position: Σ_{v ∈ topk(p_s)} p_s(v) (log p_s(v) − log p_t(v));
    averaged over masked positions. The teacher side is detached.

    Args:
        student_logits: ``[B, T, V]`` (with grad).
        teacher_logits: ``[B, T, V]``.
        mask: ``[B, T]``.
        top_k: vocabulary entries kept per position (clamped to V).
    Returns:
        (scalar loss, metrics: ``reverse_kl``, ``topk_mass``).
    """
    if student_logits.shape != teacher_logits.shape or student_logits.dim() != 3:
        raise ValueError(f"logits must share a [B, T, V] shape, got {tuple(student_logits.shape)} and {tuple(teacher_logits.shape)}")
    if mask.shape != student_logits.shape[:2]:
        raise ValueError(f"mask must be [B, T]={tuple(student_logits.shape[:2])}, got {tuple(mask.shape)}")
    k = max(1, min(top_k, student_logits.shape[-1]))
    log_ps = torch.log_softmax(student_logits, dim=-1)
    log_pt = torch.log_softmax(teacher_logits.detach(), dim=-1)
    top_lp, idx = log_ps.topk(k, dim=-1)
    top_lt = log_pt.gather(-1, idx)
    per_pos = (top_lp.exp() * (top_lp - top_lt)).sum(-1)  # [B, T]
    m = mask.to(per_pos.dtype)
    denom = m.sum().clamp(min=1.0)
    loss = (per_pos * m).sum() / denom
    mass = (top_lp.exp().sum(-1) * m).sum() / denom
    return loss, {"reverse_kl": float(loss.detach()), "topk_mass": float(mass.detach())}


@LOSSES.register(PolicyLoss.REVERSE_KL_SAMPLED)
def reverse_kl_sampled_loss(
    logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    coef: float = 1.0,
) -> tuple[torch.Tensor, Metrics]:
    """KL(π_s ‖ sg π_t) on the student's own sampled tokens, from per-token log-probs only.

    ∇ KL = E_{a∼π_s}[(log π_s(a) − log π_t(a)) ∇ log π_s(a)], so the surrogate is
    coef · Σ sg(lp_s − lp_t) · lp_s / Σ mask; its value at the sampled tokens estimates the KL
    (reported as ``edge_kl``). Used when full logits are not available (the Policy protocol
    returns per-token log-probs); :func:`reverse_kl_topk_loss` is the top-k version.

    Args:
        logprobs: ``[B, T]`` student log-probs of its own tokens (with grad).
        teacher_logprobs: ``[B, T]`` log-probs of the same tokens with the experience in context.
        mask: ``[B, T]`` student tokens to distil.
        coef: loss scale.
    Returns:
        (scalar loss, metrics: ``edge_kl``).
    """
    if logprobs.shape != teacher_logprobs.shape or logprobs.shape != mask.shape or logprobs.dim() != 2:
        raise ValueError(f"logprobs, teacher_logprobs and mask must share a [B, T] shape, got "
                         f"{tuple(logprobs.shape)}, {tuple(teacher_logprobs.shape)}, {tuple(mask.shape)}")
    m = mask.to(logprobs.dtype)
    diff = (logprobs.detach() - teacher_logprobs.detach()) * m
    denom = m.sum().clamp(min=1.0)
    return coef * (diff * logprobs).sum() / denom, {"edge_kl": float(diff.sum() / denom)}


@LOSSES.register(PolicyLoss.SELF_DISTILL_NLL)
def self_distill_nll_loss(
    logprobs: torch.Tensor, mask: torch.Tensor, *, coef: float = 1.0
) -> tuple[torch.Tensor, Metrics]:
    """Self-distillation: coef · mean next-token NLL over the kept (agent) tokens.

    Args:
        logprobs: ``[B, T]`` log-probs of the trajectory's tokens, experience stripped (with grad).
        mask: ``[B, T]`` the agent's own tokens.
        coef: loss scale.
    Returns:
        (scalar loss, metrics: ``self_distill_nll`` — the unscaled NLL).
    """
    if logprobs.shape != mask.shape or logprobs.dim() != 2:
        raise ValueError(f"logprobs and mask must share a [B, T] shape, got {tuple(logprobs.shape)}, {tuple(mask.shape)}")
    m = mask.to(logprobs.dtype)
    nll = -(logprobs * m).sum() / m.sum().clamp(min=1.0)
    return coef * nll, {"self_distill_nll": float(nll.detach())}
