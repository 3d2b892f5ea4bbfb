"""The gradient side of :class:`~crl_train.policy.hf.HFPolicy`: log-probs of given tokens (with and
without grad), the support log-probs of EDGE's KL, and the AdamW step over micro-batches with each
loss's scale (``train_step`` / ``train_objective``).

Log-probs follow :mod:`crl_train.policy.base` (tempered, constraint-masked, top-p excluded); every
forward runs in :meth:`HFTraining.compute` (CPU autocast or nothing,
:mod:`crl_train.policy.precision`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Hashable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from .base import (
    LOSS_SCALE_NAMES,
    SUPPORT_IDS,
    Generator,
    LossFn,
    LossScale,
    LossTerm,
    OptimConfig,
    SamplingConfig,
    TrainBatch,
)
from .generate import RowKV
from .lora import named_weights
from .precision import compute_context
from .sampling import selective_logprobs, support_logprobs
from .shared_forward import train_logits

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


class HFTraining:
    """Log-probs and updates of a transformers causal LM; :class:`~crl_train.policy.hf.HFPolicy`
    owns the state below."""

    name: str
    device: torch.device
    model: PreTrainedModel
    sampling: SamplingConfig
    optim: OptimConfig
    optimizer: torch.optim.Optimizer | None
    step: int
    skipped_steps: int
    share_prefix: int
    generator: Generator | None
    autocast_dtype: torch.dtype | None
    _kv: dict[Hashable, RowKV]

    def compute(self) -> AbstractContextManager[Any]:
        """The context every forward pass of this policy runs in (autocast, or nothing)."""
        return compute_context(self.autocast_dtype)

    def _logits(self, batch: TrainBatch) -> torch.Tensor:
        ids = batch.input_ids.to(self.device)
        attn = batch.attention_mask.to(self.device)
        with self.compute():
            return self.model(input_ids=ids, attention_mask=attn, use_cache=False).logits

    def _sequence_logprobs(
        self, batch: TrainBatch, logits: torch.Tensor, offset: int
    ) -> torch.Tensor:
        """[b, T] log-probs with grad if enabled; 0 at position 0 and on padding. ``logits`` start
        at position ``offset`` (``_train_forward``): positions up to ``offset`` hold 0 (no loss
        reads them)."""
        ids = batch.input_ids.to(self.device)
        attn = batch.attention_mask.to(self.device)
        temperature = self.sampling.temperature
        rows = []
        for b in range(ids.shape[0]):
            # Row t of logits (position offset + t) predicts token offset + t + 1, so a constraint
            # on position p is row p - 1 - offset.
            cons = None
            if batch.constraints is not None and batch.constraints[b]:
                cons = {
                    p - 1 - offset: a for p, a in batch.constraints[b].items() if p - 1 >= offset
                }
            lp = selective_logprobs(logits[b, :-1], ids[b, offset + 1 :], temperature, cons)
            rows.append(torch.cat([lp.new_zeros(offset + 1), lp]))
        lp = torch.stack(rows)
        # where(), not a product: -inf * 0 would be NaN on an off-trie padded position.
        return torch.where(attn.bool(), lp, torch.zeros_like(lp))

    def _micro_batches(self, batch: TrainBatch) -> Iterator[tuple[torch.Tensor, TrainBatch]]:
        """``(rows, micro-batch)`` as training runs them: sequences of like length share a
        micro-batch, cut to its own width (the summed gradient is the same for any split; the
        padding is not)."""
        mbs = self.optim.micro_batch_size
        order = batch.attention_mask.sum(1).argsort(descending=True, stable=True)
        for s in range(0, batch.batch_size, mbs):
            rows = order[s : s + mbs]
            yield rows, batch.select(rows).trimmed()

    def _train_forward(self, mb: TrainBatch) -> tuple[torch.Tensor, int]:
        """``(logits, offset)`` of a micro-batch, the prompt prefix its rows share run once
        (``shared_forward.train_logits``)."""
        with self.compute():
            return train_logits(
                self.model,
                mb.input_ids.to(self.device),
                mb.attention_mask.to(self.device),
                mb.loss_mask,
                share_min=self.share_prefix,
            )

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, T] log-probs through the very forward training runs (the same micro-batches, the same
        shared prefix), so a recomputed π_old is what the first epoch computes, also in bf16, whose
        rounding depends on the shapes. Positions before the batch's first trained token read by no
        loss hold 0 when a shared prefix skipped them."""
        self.model.eval()
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        for rows, mb in self._micro_batches(batch):
            logits, offset = self._train_forward(mb)
            lp = self._sequence_logprobs(mb, logits, offset)
            out[rows, : lp.shape[1]] = lp.float().cpu()
        return out

    def _support(
        self,
        batch: TrainBatch,
        logits: torch.Tensor,
        k: int | None,
        ids: torch.Tensor | None,
        offset: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, logprobs)`` ``[b, T, k]`` aligned like ``_sequence_logprobs`` (row t - 1 of the
        logits is position t's distribution, the logits starting at ``offset``); 0 at positions up
        to ``offset`` and on padding."""
        width = (
            int(ids.shape[-1]) if ids is not None else max(1, min(int(k or 1), logits.shape[-1]))
        )
        rows_ids, rows_lp = [], []
        for r in range(batch.batch_size):
            given = None if ids is None else ids[r, offset + 1 :].to(logits.device)
            i, lp = support_logprobs(logits[r, :-1], self.sampling.temperature, given, width)
            rows_ids.append(torch.cat([i.new_zeros((offset + 1, width)), i]))
            rows_lp.append(torch.cat([lp.new_zeros((offset + 1, width)), lp]))
        keep = batch.attention_mask.to(logits.device).bool()[
            ..., None
        ]  # padding holds 0, like logprobs
        out_ids, out_lp = torch.stack(rows_ids), torch.stack(rows_lp)
        return torch.where(keep, out_ids, torch.zeros_like(out_ids)), torch.where(
            keep, out_lp, torch.zeros_like(out_lp)
        )

    @torch.no_grad()
    def support_logprobs(
        self, batch: TrainBatch, *, k: int | None = None, ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if (k is None) == (ids is None):
            raise ValueError(
                "support_logprobs takes k (the policy's own top-k) or ids (given ids), not both "
                "or neither"
            )
        if ids is not None and (
            ids.dim() != 3 or tuple(ids.shape[:2]) != tuple(batch.input_ids.shape)
        ):
            raise ValueError(
                f"ids must be [B, T, k] with [B, T]={tuple(batch.input_ids.shape)}, got "
                f"{tuple(ids.shape)}"
            )
        self.model.eval()
        mb = self.optim.micro_batch_size
        parts = []
        for s in range(0, batch.batch_size, mb):
            part = batch.select(slice(s, s + mb))
            parts.append(
                self._support(part, self._logits(part), k, None if ids is None else ids[s : s + mb])
            )
        return torch.cat([p[0] for p in parts]).cpu(), torch.cat([p[1] for p in parts]).cpu()

    def _ensure_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            params = [p for p in self.model.parameters() if p.requires_grad]
            if not params:
                raise ValueError(f"{self.name}: no trainable parameters")
            o = self.optim
            self.optimizer = torch.optim.AdamW(
                params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay
            )
        return self.optimizer

    def _loss_scale(self, loss_scale: LossScale | None) -> LossScale:
        """``loss_scale``, or the policy's default when ``None``; anything else raises."""
        mode = self.optim.loss_scale if loss_scale is None else loss_scale
        if mode not in LOSS_SCALE_NAMES:
            raise ValueError(
                f"loss_scale must be one of {', '.join(map(repr, LOSS_SCALE_NAMES))}, got {mode!r}"
            )
        return mode

    def _scale(
        self,
        mb: TrainBatch,
        batch: TrainBatch,
        total_tokens: int,
        loss_scale: LossScale | None = None,
    ) -> float:
        """The weight of micro-batch ``mb``'s loss in ``batch`` under ``loss_scale`` (default:
        the policy's)."""
        mode = self._loss_scale(loss_scale)
        if mode == "samples":
            return mb.batch_size / batch.batch_size
        if mode == "tokens":
            return mb.num_tokens / total_tokens
        return 1.0

    def accumulate_gradients(
        self,
        batch: TrainBatch,
        loss_fn: LossFn,
        *,
        loss_scale: LossScale | None = None,
        **loss_kw: object,
    ) -> tuple[bool, float, dict[str, float]]:
        """Backward over ``batch`` micro-batch by micro-batch, each loss weighted by ``loss_scale``
        (``None``: ``OptimConfig.loss_scale``) so the summed gradient equals the full-batch one.

        Returns (all losses finite, weighted loss, loss metrics averaged over sequences). Stops
        at the first non-finite loss. Does not zero or step the optimizer.
        """
        mode = self._loss_scale(loss_scale)
        total_tokens = max(batch.num_tokens, 1)
        metrics: dict[str, float] = {}
        loss_total = 0.0
        self.model.train()
        try:
            for _, mb in self._micro_batches(batch):
                if mb.num_tokens == 0 and mode == "tokens":
                    continue
                kw: dict[str, Any] = {k: v.to(self.device) for k, v in mb.extra.items()}
                if mb.group_ids is not None:
                    kw["group_ids"] = mb.group_ids.to(self.device)
                if mb.condition_ids is not None:
                    kw["condition_ids"] = mb.condition_ids.to(self.device)
                kw.update(loss_kw)
                logits, offset = self._train_forward(mb)
                lp = self._sequence_logprobs(mb, logits, offset)
                if SUPPORT_IDS in mb.extra:
                    kw["support_logprobs"] = self._support(
                        mb, logits, None, mb.extra[SUPPORT_IDS], offset
                    )[1]
                loss, m = loss_fn(
                    lp,
                    mb.old_logprobs.to(self.device),
                    mb.advantages.to(self.device),
                    mb.loss_mask.to(self.device),
                    **kw,
                )
                if not torch.isfinite(loss):
                    return False, float("nan"), metrics
                scale = self._scale(mb, batch, total_tokens, mode)
                (loss * scale).backward()
                loss_total += float(loss.detach()) * scale
                weight = mb.batch_size / batch.batch_size
                for k, v in m.items():
                    metrics[k] = metrics.get(k, 0.0) + float(v) * weight
        finally:
            self.model.eval()
        return True, loss_total, metrics

    def train_step(
        self,
        batch: TrainBatch,
        loss_fn: LossFn,
        *,
        loss_scale: LossScale | None = None,
        **loss_kw: object,
    ) -> dict[str, float]:
        """One AdamW step over ``batch`` with gradient accumulation over micro-batches.

        ``loss_scale`` says how ``loss_fn``'s value scales with its micro-batch (``None``: the
        policy's ``OptimConfig.loss_scale``): ``"tokens"`` for a mean over the mask's tokens (CISPO,
        the reverse KL, the self-distillation NLL), ``"samples"`` for a mean over sequences,
        ``"none"`` for a sum with full-batch weights (the actor's clip loss). With the right one
        the update does not depend on ``OptimConfig.micro_batch_size``. See :meth:`train_objective`.
        """
        return self.train_objective([LossTerm(batch, loss_fn, loss_scale, dict(loss_kw))])

    def train_objective(self, terms: Sequence[LossTerm]) -> dict[str, float]:
        """One AdamW step on the sum of ``terms``: each term's micro-batch losses are weighted by
        its own ``loss_scale`` and their gradients accumulated, then one clip and one step (EDGE's
        joint objective: the RL loss and λ · the reverse KL of the same update).

        A term without trained tokens adds nothing; when no term has any, or a loss or the gradient
        norm is not finite, the update is skipped (``skipped`` = 1 in the metrics, counted in
        ``skipped_steps``, logged) instead of corrupting the weights.
        """
        modes = [self._loss_scale(t.loss_scale) for t in terms]
        self._kv.clear()  # kept keys/values are of the weights about to change
        live = [(t, m) for t, m in zip(terms, modes, strict=True) if t.batch.num_tokens > 0]
        total_tokens = sum(t.batch.num_tokens for t, _ in live)
        if not live:
            self.skipped_steps += 1
            log.warning("%s: train step got no trained tokens; skipped", self.name)
            return {"skipped": 1.0, "num_tokens": 0.0, "step": float(self.step)}
        opt = self._ensure_optimizer()
        opt.zero_grad(set_to_none=True)
        metrics: dict[str, float] = {}
        loss_total, finite = 0.0, True
        for term, mode in live:
            finite, term_loss, term_metrics = self.accumulate_gradients(
                term.batch, term.loss_fn, loss_scale=mode, **term.kwargs
            )
            metrics.update(term_metrics)
            if not finite:
                break
            loss_total += term_loss
            if term.name is not None:
                metrics[f"loss_{term.name}"] = term_loss
        grad_norm = float("nan")
        if finite:
            params = [p for g in opt.param_groups for p in g["params"]]
            clip = self.optim.grad_clip if self.optim.grad_clip > 0 else float("inf")
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
            finite = math.isfinite(grad_norm)
        if not finite:
            opt.zero_grad(set_to_none=True)
            self.skipped_steps += 1
            log.warning(
                "%s: non-finite loss or gradient at step %d; update skipped", self.name, self.step
            )
            return {**metrics, "skipped": 1.0, "grad_norm": grad_norm, "step": float(self.step)}
        opt.step()
        opt.zero_grad(set_to_none=True)
        self.step += 1
        if self.generator is not None:
            self.generator.sync_weights(named_weights(self.model))
        return {
            **metrics,
            "loss": loss_total,
            "grad_norm": grad_norm,
            "lr": float(opt.param_groups[0]["lr"]),
            "num_tokens": float(total_tokens),
            "skipped": 0.0,
            "step": float(self.step),
        }
