"""Losses over per-token log-probs. Each returns ``(loss, metrics)``; the loss is minimised.

Shapes: ``B`` sequences, ``T`` padded tokens. ``mask[B, T]`` is 1 on the tokens being trained
(the agent's own action tokens, or the extractor's response tokens) and 0 on observations,
experience text, prompts and padding.

**One calling convention.** Every loss registered in :data:`LOSSES` is called as

    loss_fn(logprobs [B,T], old_logprobs [B,T], advantages [B], mask [B,T], **kw) -> (loss, metrics)

which is how :meth:`crl_train.policy.hf.HFPolicy.train_step` calls it (``LossFn`` in
:mod:`crl_train.policy.base`): ``kw`` holds the batch's ``group_ids`` / ``condition_ids`` when set,
every tensor of ``TrainBatch.extra`` (``weights``, ``teacher`` …) and the caller's own keyword
arguments (``clip_eps``, ``ratio_level``, ``coef`` …). A loss reads the keywords it declares; a
*tensor* (or ``None``) keyword it does not use is batch context and is ignored, while any other
unknown keyword (a misspelt hyper-parameter) raises ``TypeError``. Arguments a loss does not need
(``advantages`` for the distillation losses) are accepted and unused.

**Micro-batch scaling.** Each loss is registered with its scale
(``@LOSSES.register(name, scale=...)``); :func:`loss_scale_for` names, per loss, the ``loss_scale``
a train step must use so that the gradient accumulated over micro-batches equals the full-batch
gradient: ``tokens`` for a mean over the mask's tokens, ``none`` for a sum whose weights the caller
normalised over the full batch.

**Top-k reverse KL.** :func:`reverse_kl_topk_loss` is EDGE's definition on full ``[B, T, V]``
logits (the reference, and what a caller holding logits uses). Training uses its registered form,
:func:`reverse_kl_support_loss`: the policy hands the loss the log-probs of a per-position support
of k token ids (``TrainBatch.extra["support_ids"]``, the student's own top-k chosen under the
weights being trained), so only ``[B, T, k]`` tensors leave the model; with that support both
give the same value and gradient (``tests/test_losses.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from crl_train.algorithms.registry import LOSSES, LossParams, LossScale, PolicyLoss

Metrics = dict[str, float]
RatioLevel = Literal["token", "sequence"]


@dataclass(frozen=True)
class ClipParams(LossParams):
    """:func:`clip_surrogate_loss`'s hyper-parameters."""

    clip_eps: float = 0.2
    ratio_level: RatioLevel = "token"


@dataclass(frozen=True)
class CispoParams(LossParams):
    """:func:`cispo_loss` / :func:`cispo_sequences_loss`'s IS-weight clip range [1 − eps_low,
    1 + eps_high]."""

    eps_low: float = 0.1
    eps_high: float = 0.1


@dataclass(frozen=True)
class CoefParams(LossParams):
    """The weight of a distillation term (the reverse KLs, the self-distillation NLL)."""

    coef: float = 1.0


def _batch_context_only(loss: str, kw: dict[str, Any]) -> None:
    """Raise ``TypeError`` for a keyword that is neither a tensor nor ``None`` (a
    misspelt option)."""
    bad = sorted(k for k, v in kw.items() if v is not None and not isinstance(v, torch.Tensor))
    if bad:
        raise TypeError(f"{loss}() got unexpected keyword argument(s) {', '.join(map(repr, bad))}")


def _check(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor
) -> None:
    if logprobs.dim() != 2 or logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            f"logprobs, old_logprobs and mask must share a [B, T] shape, got "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(mask.shape)}"
        )
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(
            f"advantages must be [B]={logprobs.shape[0]}, got {tuple(advantages.shape)}"
        )


@LOSSES.register(PolicyLoss.CLIP, scale="none", params=ClipParams)
def clip_surrogate_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    clip_eps: float = 0.2,
    ratio_level: RatioLevel = "token",
    **context: torch.Tensor,
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
        weights: ``[B]`` per-trajectory weights, e.g.
            :func:`~crl_train.algorithms.advantages.sequence_weights` (½·1/K_c per group); ``None``
            = 1/B each.
        clip_eps: ε of the clip.
        ratio_level: ``"token"`` or ``"sequence"``.
        context: other batch tensors (``group_ids`` …), ignored.
    Returns:
        (scalar loss, metrics: ``clip_frac``, ``ratio_mean``, ``approx_kl``).

    Micro-batching: with ``weights`` normalised over the full batch the loss is a weighted sum, so
    ``loss_scale="none"`` (:func:`loss_scale_for`); with ``weights=None`` it is a mean over the
    micro-batch's sequences and needs ``loss_scale="samples"``.
    """
    _batch_context_only("clip_surrogate_loss", context)
    _check(logprobs, old_logprobs, mask, advantages)
    if ratio_level not in ("token", "sequence"):
        raise ValueError(f"ratio_level must be 'token' or 'sequence', got {ratio_level!r}")
    b = logprobs.shape[0]
    m = mask.to(logprobs.dtype)
    n_tok = m.sum(dim=1).clamp(min=1.0)
    w = (
        torch.full((b,), 1.0 / max(b, 1), dtype=logprobs.dtype)
        if weights is None
        else weights.to(logprobs.dtype)
    )
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


def _cispo_terms(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token −sg(ρ̂) Â log π on the mask, the mask, the clipped IS weights and the
    clipped tokens."""
    m = mask.to(logprobs.dtype)
    ratio = torch.exp((logprobs.detach() - old_logprobs.detach()) * m)
    is_w = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)  # detached: sg(·)
    adv = advantages.to(logprobs.dtype).detach()[:, None]
    clipped = ((ratio < 1.0 - eps_low) | (ratio > 1.0 + eps_high)).to(logprobs.dtype) * m
    return -(is_w * adv * logprobs * m), m, is_w, clipped


@LOSSES.register(PolicyLoss.CISPO_SEQUENCES, scale="samples", params=CispoParams)
def cispo_sequences_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    eps_low: float = 0.1,
    eps_high: float = 0.1,
    **context: torch.Tensor,
) -> tuple[torch.Tensor, Metrics]:
    """CISPO normalised per sample (an option, ``algo.cispo_normalisation: sequences``):
    −(1/B) Σ_i (1/|m_i|) Σ_t sg(clip(ρ_it, 1−ε_low, 1+ε_high)) Â_i log π_φ(m_it).

    Eq. 3 divides by Σ_i |m_i| over the batch, so a sample's total push grows with its length: with
    mostly negative advantages, long answers are pushed down hardest and short ones (a Return) gain.
    Here every sample weighs the same whatever its length. Samples without tokens add 0.

    Micro-batching: a mean over sequences, ``loss_scale="samples"``.

    >>> lp = torch.tensor([[-1.0, -1.0], [-2.0, 0.0]], requires_grad=True)
    >>> loss, _ = cispo_sequences_loss(lp, lp.detach(), torch.tensor([1.0, -1.0]),
    ...                                torch.tensor([[1, 1], [1, 0]]))
    >>> round(loss.item(), 4)  # −((−1 − 1) / 2 · 1 + (−2) / 1 · (−1)) / 2 = −(−1 + 2) / 2
    -0.5
    """
    del weights
    _batch_context_only("cispo_sequences_loss", context)
    _check(logprobs, old_logprobs, mask, advantages)
    terms, m, is_w, clipped = _cispo_terms(
        logprobs, old_logprobs, advantages, mask, eps_low, eps_high
    )
    per_sample = terms.sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
    loss = per_sample.mean()
    total = m.sum().clamp(min=1.0)
    return loss, {
        "loss": float(loss.detach()),
        "clip_frac": float(clipped.sum() / total),
        "is_weight_mean": float((is_w * m).sum() / total),
        "num_tokens": float(m.sum()),
    }


@LOSSES.register(PolicyLoss.CISPO, scale="tokens", params=CispoParams)
def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    eps_low: float = 0.1,
    eps_high: float = 0.1,
    **context: torch.Tensor,
) -> tuple[torch.Tensor, Metrics]:
    """Eq. 3 (CISPO), negated: −Σ_i Σ_t sg(clip(ρ_it, 1−ε_low, 1+ε_high)) Â_i log π_φ(m_it) /
    Σ_i |m_i|.

    The clipped IS weight carries no gradient, so every token's gradient is
    ``−sg(ρ̂_it) Â_i / Σ|m|`` times ∇log π — clipped tokens still learn (unlike PPO).

    Args:
        logprobs: ``[B, T]`` log π_φ of the extractor's response tokens (with grad).
        old_logprobs: ``[B, T]`` log-probs stored when the entry was generated.
        advantages: ``[B]`` Â_i = w(m_i)·(r̄(m_i) − mean r̄).
        mask: ``[B, T]`` 1 on response tokens.
        weights: unused (accepted so losses share a signature).
        eps_low, eps_high: the IS-weight clip range [1 − ε_low, 1 + ε_high].
        context: other batch tensors, ignored.
    Returns:
        (scalar loss, metrics: ``clip_frac``, ``is_weight_mean``, ``num_tokens``).

    Micro-batching: a mean over the mask's tokens, ``loss_scale="tokens"``.
    """
    del weights
    _batch_context_only("cispo_loss", context)
    _check(logprobs, old_logprobs, mask, advantages)
    terms, m, is_w, clipped = _cispo_terms(
        logprobs, old_logprobs, advantages, mask, eps_low, eps_high
    )
    total = m.sum().clamp(min=1.0)
    loss = terms.sum() / total
    metrics = {
        "loss": float(loss.detach()),
        "clip_frac": float(clipped.sum() / total),
        "is_weight_mean": float((is_w * m).sum() / total),
        "num_tokens": float(m.sum()),
    }
    return loss, metrics


def reverse_kl_topk_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    top_k: int = 20,
) -> tuple[torch.Tensor, Metrics]:
    """EDGE's on-support reverse KL, KL(π_student ‖ sg(π_teacher)), over the student's top-k tokens.

    **Own signature, not in** :data:`LOSSES`: the definition on full ``[B, T, V]`` logits. The
    trainer uses :func:`reverse_kl_support_loss` (``LOSSES["reverse_kl_topk"]``), which computes the
    same from ``[B, T, k]`` log-probs of the student's top-k support; a caller with logits calls
    this directly. It is a token mean (``loss_scale="tokens"``).

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
        raise ValueError(
            f"logits must share a [B, T, V] shape, got {tuple(student_logits.shape)} and "
            f"{tuple(teacher_logits.shape)}"
        )
    if mask.shape != student_logits.shape[:2]:
        raise ValueError(
            f"mask must be [B, T]={tuple(student_logits.shape[:2])}, got {tuple(mask.shape)}"
        )
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


@LOSSES.register(PolicyLoss.REVERSE_KL_TOPK, scale="tokens", params=CoefParams)
def reverse_kl_support_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    support_logprobs: torch.Tensor | None = None,
    teacher_support: torch.Tensor | None = None,
    coef: float = 1.0,
    **context: torch.Tensor,
) -> tuple[torch.Tensor, Metrics]:
    """EDGE's top-k reverse KL from the log-probs of a per-position support (the registered form).

    Per position: Σ_{v ∈ S} p_s(v) (log p_s(v) − log sg p_t(v)), S = the k ids of
    ``extra["support_ids"]``; coef · the mean over masked positions. With S the student's top-k
    under the weights being trained this is :func:`reverse_kl_topk_loss`, value and gradient.

    Args:
        logprobs: ``[B, T]``, unused (the shared signature; the support carries the student).
        old_logprobs: ``[B, T]``, unused.
        advantages: ``[B]``, unused.
        mask: ``[B, T]`` student tokens to distil.
        support_logprobs: ``[B, T, k]`` student log-probs of the support ids (with grad), handed
            to the loss by the policy when the batch has ``extra["support_ids"]``; required.
        teacher_support: ``[B, T, k]`` the teacher's log-probs of the same ids at the same
            positions (``extra["teacher_support"]``); required.
        coef: loss scale (EDGE's λ).
        context: other batch tensors (``support_ids``), ignored.
    Returns:
        (scalar loss, metrics: ``edge_kl`` — the unscaled KL, ``topk_mass`` — the student's mass
        on S).

    Micro-batching: a mean over the mask's tokens, ``loss_scale="tokens"``.

    >>> s = torch.log(torch.tensor([[[0.0, 0.0], [0.5, 0.25]]]).clamp(min=1e-30))
    >>> t = torch.log(torch.tensor([[[1.0, 1.0], [0.25, 0.25]]]))
    >>> loss, m = reverse_kl_support_loss(None, None, None, torch.tensor([[0.0, 1.0]]),
    ...                                   support_logprobs=s, teacher_support=t)
    >>> round(float(loss), 4), m["topk_mass"]   # 0.5·ln 2 + 0.25·ln 1
    (0.3466, 0.75)
    """
    del logprobs, old_logprobs, advantages
    _batch_context_only("reverse_kl_support_loss", context)
    if support_logprobs is None or teacher_support is None:
        raise ValueError(
            "reverse_kl_support_loss needs support_logprobs and teacher_support [B, T, k]: put "
            "extra['support_ids'] and extra['teacher_support'] in the batch (see "
            "crl_train.methods.edge)"
        )
    if support_logprobs.shape != teacher_support.shape or support_logprobs.dim() != 3:
        raise ValueError(
            f"support_logprobs and teacher_support must share a [B, T, k] shape, got "
            f"{tuple(support_logprobs.shape)} and {tuple(teacher_support.shape)}"
        )
    if mask.shape != support_logprobs.shape[:2]:
        raise ValueError(
            f"mask must be [B, T]={tuple(support_logprobs.shape[:2])}, got {tuple(mask.shape)}"
        )
    # A padded position's support may hold -inf on either side, and so may an id the student gives
    # no mass: such terms are filled with 0 *before* any product, because inf * 0 is NaN, in the
    # value (a masked sum) and in the gradient (a where() after the product still
    # back-propagates it).
    keep = (mask != 0)[..., None] & (support_logprobs > float("-inf"))
    student = support_logprobs.masked_fill(~keep, 0.0)
    teacher = teacher_support.detach().to(student.dtype).masked_fill(~keep, 0.0)
    p = student.exp().masked_fill(~keep, 0.0)
    per_pos = (p * (student - teacher)).sum(
        -1
    )  # exactly 0 where masked out, so the product below is finite
    m = mask.to(per_pos.dtype)
    denom = m.sum().clamp(min=1.0)
    kl = (per_pos * m).sum() / denom
    mass = (p.sum(-1) * m).sum() / denom
    return coef * kl, {"edge_kl": float(kl.detach()), "topk_mass": float(mass.detach())}


@LOSSES.register(PolicyLoss.REVERSE_KL_SAMPLED, scale="tokens", params=CoefParams)
def reverse_kl_sampled_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    teacher: torch.Tensor | None = None,
    coef: float = 1.0,
    **context: torch.Tensor,
) -> tuple[torch.Tensor, Metrics]:
    """KL(π_s ‖ sg π_t) on the student's own sampled tokens, from per-token log-probs only.

    ∇ KL = E_{a∼π_s}[(log π_s(a) − log π_t(a)) ∇ log π_s(a)], so the surrogate is
    coef · Σ sg(lp_s − lp_t) · lp_s / Σ mask; its value at the sampled tokens estimates the KL
    (reported as ``edge_kl``). The cheaper option (``algo.edge_kl_estimator: sampled``): it needs
    one teacher log-prob per token; :func:`reverse_kl_support_loss` is the top-k version.

    Args:
        logprobs: ``[B, T]`` student log-probs of its own tokens (with grad).
        old_logprobs: ``[B, T]``, unused (the shared signature).
        advantages: ``[B]``, unused (the shared signature).
        mask: ``[B, T]`` student tokens to distil.
        teacher: ``[B, T]`` log-probs of the same tokens with the experience in context
            (``TrainBatch.extra["teacher"]``); required.
        coef: loss scale.
        context: other batch tensors, ignored.
    Returns:
        (scalar loss, metrics: ``edge_kl``).

    Micro-batching: a mean over the mask's tokens, ``loss_scale="tokens"``.
    """
    del old_logprobs, advantages
    _batch_context_only("reverse_kl_sampled_loss", context)
    if teacher is None:
        raise ValueError(
            "reverse_kl_sampled_loss needs the teacher's log-probs of the student's tokens: "
            "pass teacher=[B, T] (TrainBatch.extra['teacher'])"
        )
    if logprobs.shape != teacher.shape or logprobs.shape != mask.shape or logprobs.dim() != 2:
        raise ValueError(
            f"logprobs, teacher and mask must share a [B, T] shape, got "
            f"{tuple(logprobs.shape)}, {tuple(teacher.shape)}, {tuple(mask.shape)}"
        )
    m = mask.to(logprobs.dtype)
    diff = (logprobs.detach() - teacher.detach().to(logprobs.dtype)) * m
    denom = m.sum().clamp(min=1.0)
    return coef * (diff * logprobs).sum() / denom, {"edge_kl": float(diff.sum() / denom)}


@LOSSES.register(PolicyLoss.SELF_DISTILL_NLL, scale="tokens", params=CoefParams)
def self_distill_nll_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    coef: float = 1.0,
    **context: torch.Tensor,
) -> tuple[torch.Tensor, Metrics]:
    """Self-distillation: coef · mean next-token NLL over the kept (agent) tokens.

    Args:
        logprobs: ``[B, T]`` log-probs of the trajectory's tokens, experience stripped (with grad).
        old_logprobs: ``[B, T]``, unused (the shared signature).
        advantages: ``[B]``, unused (the shared signature).
        mask: ``[B, T]`` the agent's own tokens.
        coef: loss scale.
        context: other batch tensors, ignored.
    Returns:
        (scalar loss, metrics: ``self_distill_nll`` — the unscaled NLL).

    Micro-batching: a mean over the mask's tokens, ``loss_scale="tokens"``.
    """
    del old_logprobs, advantages
    _batch_context_only("self_distill_nll_loss", context)
    if logprobs.shape != mask.shape or logprobs.dim() != 2:
        raise ValueError(
            f"logprobs and mask must share a [B, T] shape, got {tuple(logprobs.shape)}, "
            f"{tuple(mask.shape)}"
        )
    m = mask.to(logprobs.dtype)
    nll = -(logprobs * m).sum() / m.sum().clamp(min=1.0)
    return coef * nll, {"self_distill_nll": float(nll.detach())}


def loss_scale_for(name: PolicyLoss | str) -> LossScale:
    """The ``loss_scale`` a train step must use for the loss registered as ``name``.

    ``clip``'s ``"none"`` assumes ``weights`` normalised over the full batch, as
    :func:`~crl_train.algorithms.advantages.sequence_weights` gives (without weights the clip loss
    is a sequence mean and needs ``"samples"``); the other losses are token means (``"tokens"``).

    >>> loss_scale_for("reverse_kl_sampled"), loss_scale_for(PolicyLoss.CLIP)
    ('tokens', 'none')
    """
    return LOSSES.scale(name)
