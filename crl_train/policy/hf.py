"""``HFPolicy``: a transformers causal LM with batched sampling, log-prob recomputation and AdamW.

The same class runs the tiny preset on CPU and Qwen2.5-7B-Instruct / Qwen3-4B-Thinking-2507 on a
GPU. Log-probs follow the convention of :mod:`crl_train.policy.base` (tempered, constraint-masked,
top-p excluded). The model is kept in ``eval`` mode for generation and recomputation (no dropout),
so both see the same function; ``train_step`` switches to ``train`` only so that gradient
checkpointing engages (Qwen configs have zero dropout).
Checkpoint files (atomic save, strict weight loading) are :mod:`crl_train.policy.checkpoint`.

>>> from crl_train.policy.tiny import build_tiny_policy
>>> policy = build_tiny_policy(["go north", "go south"], vocab_size=300, hidden=32, layers=1,
...                            heads=2, kv_heads=1, intermediate=64)
>>> prompt = policy.apply_chat([{"role": "user", "content": "where?"}])
>>> [g.text for g in policy.generate([prompt], 8, allowed=[["go north", "go south"]])][0] in ("go north", "go south")
True
"""

from __future__ import annotations

import logging
import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .base import (
    LOSS_SCALE_NAMES,
    SUPPORT_IDS,
    AllowedRow,
    Generation,
    Generator,
    LossFn,
    LossScale,
    LossTerm,
    OptimConfig,
    SamplingConfig,
    StructuredGenerator,
    TrainBatch,
)
from .chat import ChatFormatter
from .checkpoint import (
    MODEL_DIR,
    Pretrained,
    load_weights,
    read_state,
    resolve_dtype,
    write_checkpoint,
)
from .generate import RowConstraint, RowKV, generate_batch
from .grammar import GrammarEngine, JsonGrammar
from .lora import (
    CheckpointView,
    LoraSpec,
    apply_lora,
    checkpoint_adapter_spec,
    is_lora,
    load_checkpoint_weights,
    named_weights,
)
from .precision import autocast_dtype, cast_frozen, compute_context, master_float32
from .sampling import selective_logprobs, support_logprobs
from .trie import ActionTrie, ThinkThenChoose

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

SHARE_PREFIX_TOKENS = 16
"""Default ``HFPolicy.share_prefix``: a shorter common prefix saves less than its own forward pass costs."""


class HFPolicy:
    """A causal LM + tokenizer + lazily created AdamW. See :class:`crl_train.policy.base.Policy`."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        name: str | None = None,
        device: str = "cpu",
        sampling: SamplingConfig | None = None,
        optim: OptimConfig | None = None,
        chat_kwargs: Mapping[str, Any] | None = None,
        generation_batch_size: int = 64,
    ) -> None:
        self.device = torch.device(device)
        self.model = model
        module: torch.nn.Module = model  # transformers types PreTrainedModel.to as the unbound Module.to
        module.to(self.device)
        self.model.eval()
        self.tokenizer = tokenizer
        self.name = name or str(model.config.name_or_path or type(model).__name__)
        self.sampling = sampling or SamplingConfig()
        self.optim = optim or OptimConfig()
        self.generation_batch_size = generation_batch_size
        self.chat = ChatFormatter(tokenizer, chat_kwargs)
        self.eos_token_ids = self._eos_ids()
        pad = tokenizer.pad_token_id
        self.pad_token_id: int = int(pad if pad is not None else self.eos_token_ids[0])
        self.step = 0
        self.optimizer: torch.optim.Optimizer | None = None
        self.skipped_steps = 0
        """Optimizer steps skipped for a non-finite loss or gradient (logged, never applied)."""
        self._generators: dict[int, torch.Generator] = {}  # one RNG stream per SamplingConfig.seed
        self.prefix_cache = False
        """Keep each ``cache_key``'s keys/values between ``generate`` calls (see ``generate``)."""
        self._kv: dict[Hashable, RowKV] = {}
        self.share_prefix = SHARE_PREFIX_TOKENS
        """A batch's common prompt prefix of at least this many tokens is encoded once, at batch 1,
        for all its rows (``generate.py``; 0 = off): the extractor's prompts share their instructions."""
        self.generator: Generator | None = None
        """Optional fast generator (``VLLMGenerator``) for unconstrained and JSON-grammar requests; see attach_generator."""
        self._grammar_engine: GrammarEngine | None = None
        self.autocast_dtype: torch.dtype | None = None
        """CPU mixed precision: every forward runs under ``torch.autocast("cpu", autocast_dtype)``
        (None: in the weights' own dtype); see :meth:`set_compute_dtype`."""

    def set_compute_dtype(self, dtype: torch.dtype) -> None:
        """Compute in ``dtype`` (:mod:`crl_train.policy.precision`). On CPU a 16-bit ``dtype`` runs
        every forward (sampling, recomputation, training) under autocast to it, stores the frozen
        weights in it and keeps the trained ones float32; float32 brings every weight to float32.
        On CUDA the weights were loaded in ``dtype`` (``from_pretrained``) and nothing changes."""
        if self.device.type != "cpu":
            return
        self.autocast_dtype = autocast_dtype(dtype, self.device)
        if self.autocast_dtype is None:
            self.model.float()
        else:
            master_float32(self.model)
            cast_frozen(self.model, self.autocast_dtype)
        self._kv.clear()

    def compute(self) -> AbstractContextManager[Any]:
        """The context every forward pass of this policy runs in (autocast, or nothing)."""
        return compute_context(self.autocast_dtype)

    def attach_generator(self, generator: Generator) -> None:
        """Serve unconstrained and JSON-grammar ``generate`` calls from ``generator`` (e.g.
        ``VLLMGenerator``; a grammar request only when the generator has ``structured_outputs``)
        and push this model's weights into it now and after every optimizer step."""
        self.generator = generator
        generator.sync_weights(named_weights(self.model))  # merged when the model has LoRA adapters

    def enable_lora(self, spec: LoraSpec) -> None:
        """Train LoRA adapters (``crl_train.policy.lora``) instead of the full weights from now on;
        before the first update (the optimizer holds the parameters it was created with)."""
        if self.optimizer is not None:
            raise ValueError(f"{self.name}: enable_lora after the optimizer exists (call it before the first train_step)")
        apply_lora(self.model, spec)
        if self.autocast_dtype is not None:  # the base is frozen now: store it in the compute dtype
            cast_frozen(self.model, self.autocast_dtype)
        self._kv.clear()
        if self.generator is not None:
            self.generator.sync_weights(named_weights(self.model))

    def _eos_ids(self) -> list[int]:
        # The tokenizer's EOS first (it ends constrained actions), then the generation config's.
        ids: list[int] = []
        if self.tokenizer.eos_token_id is not None:
            ids.append(int(self.tokenizer.eos_token_id))
        gen_cfg = getattr(self.model, "generation_config", None)
        extra = getattr(gen_cfg, "eos_token_id", None)
        for i in extra if isinstance(extra, (list, tuple)) else [extra]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
        if not ids:
            raise ValueError(f"{self.name}: neither the tokenizer nor the generation config defines an EOS token")
        return ids

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str | Path,
        *,
        device: str = "cpu",
        dtype: str | torch.dtype = "auto",
        sampling: SamplingConfig | None = None,
        optim: OptimConfig | None = None,
        enable_thinking: bool | None = None,
        gradient_checkpointing: bool = False,
        trust_remote_code: bool = False,
        attn_implementation: str | None = None,
    ) -> HFPolicy:
        """Load a causal LM and its tokenizer by HF id or local path.

        ``enable_thinking`` is passed to the chat template when set (Qwen3 hybrid templates read
        it; Qwen3-*-Thinking-2507 templates always think).
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = str(name_or_path)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        compute = resolve_dtype(dtype, device)
        kwargs: dict[str, Any] = {"dtype": _load_dtype(compute, device), "trust_remote_code": trust_remote_code}
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        if gradient_checkpointing:
            model.gradient_checkpointing_enable()
            model.config.use_cache = False
        chat_kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        policy = cls(model, tokenizer, name=path, device=device, sampling=sampling, optim=optim, chat_kwargs=chat_kwargs)
        policy.set_compute_dtype(compute)
        return policy

    # ---------------------------------------------------------------- chat and generation
    def apply_chat(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True) -> list[int]:
        return self.chat.prompt_ids(messages, add_generation_prompt=add_generation_prompt)

    @property
    def grammar_engine(self) -> GrammarEngine:
        """llguidance's view of this policy's tokenizer (built on first use, kept: it takes a moment)."""
        if self._grammar_engine is None:
            vocab = int(self.model.get_output_embeddings().weight.shape[0])
            self._grammar_engine = GrammarEngine(self.tokenizer, vocab_size=vocab, eos_token_id=self.eos_token_ids[0])
        return self._grammar_engine

    def replay_allowed(self, grammar: JsonGrammar, token_ids: Sequence[int]) -> list[tuple[int, ...] | None]:
        """Per-token allowed sets of ``token_ids`` sampled under ``grammar`` (``GrammarEngine.replay``)."""
        return self.grammar_engine.replay(grammar, token_ids)

    def _tries(self, allowed: Sequence[AllowedRow] | None, n: int) -> list[RowConstraint | None]:
        if allowed is None:
            return [None] * n
        if len(allowed) != n:
            raise ValueError(f"generate: allowed has {len(allowed)} entries for {n} prompts")
        out: list[RowConstraint | None] = []
        for i, a in enumerate(allowed):
            if isinstance(a, JsonGrammar):
                out.append(self.grammar_engine.start(a))
            elif a is None or isinstance(a, (ActionTrie, ThinkThenChoose)):
                out.append(a)
            elif isinstance(a, str):
                raise TypeError(f"generate: allowed[{i}] is a str; pass a list of action strings")
            else:
                out.append(ActionTrie.from_actions(list(a), self.tokenizer, self.eos_token_ids[0]))
        return out

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        allowed: Sequence[AllowedRow] | None = None,
        *,
        sampling: SamplingConfig | None = None,
        cache_keys: Sequence[Hashable] | None = None,
    ) -> list[Generation]:
        """See ``Policy.generate``. With ``prefix_cache`` on, ``cache_keys[i]`` names prompt i's
        conversation: its keys/values are kept after the call, and a later prompt under the same key
        that extends them encodes only its new tokens (``generate.py``). Weights change only in
        ``train_step`` / ``load``, which drop every kept cache; ``release_cache`` drops them too."""
        if max_new_tokens < 1:
            raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"generate: prompt {i} is empty")
        cfg = sampling or self.sampling
        if not math.isclose(cfg.temperature, self.sampling.temperature):
            log.warning(
                "generate: temperature %s differs from the policy's %s; recomputed log-probs will not match",
                cfg.temperature, self.sampling.temperature,
            )
        if self.generator is not None and self._generator_serves(allowed):
            return self._generate_on_generator(prompts, max_new_tokens, allowed, cfg)
        tries = self._tries(allowed, len(prompts))
        generator = None
        if cfg.seed is not None:
            generator = self._generators.get(cfg.seed)
            if generator is None:
                generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
                self._generators[cfg.seed] = generator
        self.model.eval()
        keys = list(cache_keys) if self.prefix_cache and cache_keys is not None else None
        if keys is not None and len(keys) != len(prompts):
            raise ValueError(f"generate: cache_keys has {len(keys)} entries for {len(prompts)} prompts")
        out: list[Generation] = []
        bs = self.generation_batch_size
        for s in range(0, len(prompts), bs):
            chunk = keys[s : s + bs] if keys is not None else None
            with self.compute():
                gens, kept = generate_batch(
                    self.model, self.tokenizer, [list(map(int, p)) for p in prompts[s : s + bs]],
                    tries[s : s + bs], max_new_tokens=max_new_tokens, sampling=cfg,
                    eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id,
                    device=self.device, generator=generator,
                    past=[self._kv.get(k) for k in chunk] if chunk is not None else None, keep_kv=chunk is not None,
                    share_prefix=self.share_prefix,
                )
            out.extend(gens)
            if chunk is not None and kept is not None:
                self._kv.update(zip(chunk, kept, strict=True))
        return out

    def _generator_serves(self, allowed: Sequence[AllowedRow] | None) -> bool:
        """Whether the attached generator can take this request: unconstrained rows, and JSON
        grammars when it has structured outputs (a thinking grammar only with its reasoning parser;
        ``think_tokens`` reasoning is an hf-only stand-in)."""
        if allowed is None or all(a is None for a in allowed):
            return True
        gen = self.generator
        if not (isinstance(gen, StructuredGenerator) and gen.structured_outputs):
            return False
        return all(a is None or (isinstance(a, JsonGrammar) and not a.think_tokens
                                 and (a.reasoning_end is None or bool(gen.reasoning_parser)))
                   for a in allowed)

    def _generate_on_generator(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                               allowed: Sequence[AllowedRow] | None, cfg: SamplingConfig) -> list[Generation]:
        """The generator's answers; a grammar row gets its allowed sets by replay (the engine
        applied the same llguidance masks), so training recomputes its log-probs exactly."""
        assert self.generator is not None
        if allowed is None or all(a is None for a in allowed):
            return list(self.generator.generate(prompts, max_new_tokens, sampling=cfg))
        gens = list(self.generator.generate(prompts, max_new_tokens, allowed=allowed, sampling=cfg))
        for g, a in zip(gens, allowed, strict=True):
            if isinstance(a, JsonGrammar):
                g.allowed = self.replay_allowed(a, g.token_ids)
        return gens

    def release_cache(self, keys: Iterable[Hashable] | None = None) -> None:
        """Drop the kept keys/values of ``keys`` (all when None)."""
        if keys is None:
            self._kv.clear()
        else:
            for k in keys:
                self._kv.pop(k, None)

    # ---------------------------------------------------------------- log-probs and training
    def _logits(self, batch: TrainBatch) -> torch.Tensor:
        ids = batch.input_ids.to(self.device)
        attn = batch.attention_mask.to(self.device)
        with self.compute():
            return self.model(input_ids=ids, attention_mask=attn, use_cache=False).logits

    def _sequence_logprobs(self, batch: TrainBatch, logits: torch.Tensor | None = None) -> torch.Tensor:
        """[b, T] log-probs with grad if enabled; 0 at position 0 and on padding."""
        ids = batch.input_ids.to(self.device)
        attn = batch.attention_mask.to(self.device)
        logits = self._logits(batch) if logits is None else logits
        temperature = self.sampling.temperature
        rows = []
        for b in range(ids.shape[0]):
            # Row t of logits predicts token t + 1, so a constraint on position p is row p - 1.
            cons = None
            if batch.constraints is not None and batch.constraints[b]:
                cons = {p - 1: a for p, a in batch.constraints[b].items() if p >= 1}
            lp = selective_logprobs(logits[b, :-1], ids[b, 1:], temperature, cons)
            rows.append(torch.cat([lp.new_zeros(1), lp]))
        lp = torch.stack(rows)
        # where(), not a product: -inf * 0 would be NaN on an off-trie padded position.
        return torch.where(attn.bool(), lp, torch.zeros_like(lp))

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        self.model.eval()
        mb = self.optim.micro_batch_size
        parts = [self._sequence_logprobs(batch.select(slice(s, s + mb))) for s in range(0, batch.batch_size, mb)]
        return torch.cat(parts).cpu()

    def _support(self, batch: TrainBatch, logits: torch.Tensor, k: int | None, ids: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, logprobs)`` ``[b, T, k]`` aligned like ``_sequence_logprobs`` (row t - 1 of the
        logits is position t's distribution); 0 at position 0 and on padding."""
        width = int(ids.shape[-1]) if ids is not None else max(1, min(int(k or 1), logits.shape[-1]))
        rows_ids, rows_lp = [], []
        for r in range(batch.batch_size):
            given = None if ids is None else ids[r, 1:].to(logits.device)
            i, lp = support_logprobs(logits[r, :-1], self.sampling.temperature, given, width)
            rows_ids.append(torch.cat([i.new_zeros((1, width)), i]))
            rows_lp.append(torch.cat([lp.new_zeros((1, width)), lp]))
        keep = batch.attention_mask.to(logits.device).bool()[..., None]  # padding holds 0, like logprobs
        out_ids, out_lp = torch.stack(rows_ids), torch.stack(rows_lp)
        return torch.where(keep, out_ids, torch.zeros_like(out_ids)), torch.where(keep, out_lp, torch.zeros_like(out_lp))

    @torch.no_grad()
    def support_logprobs(
        self, batch: TrainBatch, *, k: int | None = None, ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if (k is None) == (ids is None):
            raise ValueError("support_logprobs takes k (the policy's own top-k) or ids (given ids), not both or neither")
        if ids is not None and (ids.dim() != 3 or tuple(ids.shape[:2]) != tuple(batch.input_ids.shape)):
            raise ValueError(f"ids must be [B, T, k] with [B, T]={tuple(batch.input_ids.shape)}, got {tuple(ids.shape)}")
        self.model.eval()
        mb = self.optim.micro_batch_size
        parts = []
        for s in range(0, batch.batch_size, mb):
            part = batch.select(slice(s, s + mb))
            parts.append(self._support(part, self._logits(part), k, None if ids is None else ids[s : s + mb]))
        return torch.cat([p[0] for p in parts]).cpu(), torch.cat([p[1] for p in parts]).cpu()

    def _ensure_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            params = [p for p in self.model.parameters() if p.requires_grad]
            if not params:
                raise ValueError(f"{self.name}: no trainable parameters")
            o = self.optim
            self.optimizer = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
        return self.optimizer

    def _loss_scale(self, loss_scale: LossScale | None) -> LossScale:
        """``loss_scale``, or the policy's default when ``None``; anything else raises."""
        mode = self.optim.loss_scale if loss_scale is None else loss_scale
        if mode not in LOSS_SCALE_NAMES:
            raise ValueError(f"loss_scale must be one of {', '.join(map(repr, LOSS_SCALE_NAMES))}, got {mode!r}")
        return mode

    def _scale(self, mb: TrainBatch, batch: TrainBatch, total_tokens: int, loss_scale: LossScale | None = None) -> float:
        """The weight of micro-batch ``mb``'s loss in ``batch`` under ``loss_scale`` (default: the policy's)."""
        mode = self._loss_scale(loss_scale)
        if mode == "samples":
            return mb.batch_size / batch.batch_size
        if mode == "tokens":
            return mb.num_tokens / total_tokens
        return 1.0

    def accumulate_gradients(
        self, batch: TrainBatch, loss_fn: LossFn, *, loss_scale: LossScale | None = None, **loss_kw: object
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
            mbs = self.optim.micro_batch_size
            # sequences of like length share a micro-batch, cut to its own width: the summed
            # gradient is the same for any split into micro-batches, the padding is not
            order = batch.attention_mask.sum(1).argsort(descending=True, stable=True)
            for s in range(0, batch.batch_size, mbs):
                mb = batch.select(order[s : s + mbs]).trimmed()
                if mb.num_tokens == 0 and mode == "tokens":
                    continue
                kw: dict[str, Any] = {k: v.to(self.device) for k, v in mb.extra.items()}
                if mb.group_ids is not None:
                    kw["group_ids"] = mb.group_ids.to(self.device)
                if mb.condition_ids is not None:
                    kw["condition_ids"] = mb.condition_ids.to(self.device)
                kw.update(loss_kw)
                logits = self._logits(mb)
                lp = self._sequence_logprobs(mb, logits)
                if SUPPORT_IDS in mb.extra:
                    kw["support_logprobs"] = self._support(mb, logits, None, mb.extra[SUPPORT_IDS])[1]
                loss, m = loss_fn(
                    lp, mb.old_logprobs.to(self.device), mb.advantages.to(self.device),
                    mb.loss_mask.to(self.device), **kw,
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
        self, batch: TrainBatch, loss_fn: LossFn, *, loss_scale: LossScale | None = None, **loss_kw: object
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
        """One AdamW step on the sum of ``terms``: each term's micro-batch losses are weighted by its
        own ``loss_scale`` and their gradients accumulated, then one clip and one step (EDGE's joint
        objective: the RL loss and λ · the reverse KL of the same update).

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
            finite, term_loss, term_metrics = self.accumulate_gradients(term.batch, term.loss_fn, loss_scale=mode,
                                                                        **term.kwargs)
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
            log.warning("%s: non-finite loss or gradient at step %d; update skipped", self.name, self.step)
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

    # ---------------------------------------------------------------- checkpoints
    def save(self, directory: str | Path) -> None:
        """Write ``model/`` (weights + tokenizer) and ``policy_state.pt`` atomically: a crash
        mid-save leaves the previous checkpoint in place."""
        state = {
            "step": self.step,
            "name": self.name,
            "skipped_steps": self.skipped_steps,
            "sampling": asdict(self.sampling),
            "optim": asdict(self.optim),
            "chat_kwargs": self.chat.chat_kwargs,
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
        }
        # with LoRA: model/ holds the frozen base (HF layout) and adapter/ the adapters; the view has
        # the one method the writer calls (save_pretrained), not a model's type
        saved: Pretrained = CheckpointView(self.model) if is_lora(self.model) else self.model
        write_checkpoint(directory, saved, self.tokenizer, state)

    def load(self, directory: str | Path) -> None:
        """Load weights, optimizer state and step written by :meth:`save` into this policy."""
        if is_lora(self.model):
            load_checkpoint_weights(self.model, directory, self.device)
        else:
            load_weights(self.model, directory, self.device)
        self._kv.clear()
        state = read_state(directory)
        self.step = int(state["step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if state.get("optimizer") is not None:
            self._ensure_optimizer().load_state_dict(state["optimizer"])
        self.model.eval()

    @classmethod
    def from_checkpoint(cls, directory: str | Path, *, device: str = "cpu", dtype: str | torch.dtype = "auto") -> HFPolicy:
        """A policy rebuilt from a :meth:`save` directory (tiny preset included)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        state = read_state(directory)
        model_dir = str(Path(directory) / MODEL_DIR)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        compute = resolve_dtype(dtype, device)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=_load_dtype(compute, device))
        spec = checkpoint_adapter_spec(directory)
        if spec is not None:  # the base came from model/; load() fills the adapters and their optimizer state
            apply_lora(model, spec)
        optim = {**state["optim"], "betas": tuple(state["optim"]["betas"])}
        sampling = {**state["sampling"], "stop": tuple(state["sampling"]["stop"])}
        policy = cls(
            model, tokenizer, name=state["name"], device=device, sampling=SamplingConfig(**sampling),
            optim=OptimConfig(**optim), chat_kwargs=state["chat_kwargs"],
        )
        policy.set_compute_dtype(compute)
        policy.load(directory)
        return policy


def _load_dtype(compute: torch.dtype, device: str) -> torch.dtype:
    """The dtype weights are loaded in: float32 on CPU (the master copy; ``set_compute_dtype`` then
    stores the frozen ones in the compute dtype), the compute dtype on an accelerator."""
    return torch.float32 if torch.device(device).type == "cpu" else compute


# resolve_dtype lives in .checkpoint and is re-exported: callers import it from here.
__all__ = ["SHARE_PREFIX_TOKENS", "HFPolicy", "resolve_dtype"]
