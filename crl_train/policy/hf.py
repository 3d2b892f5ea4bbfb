"""``HFPolicy``: a transformers causal LM with batched sampling, log-prob recomputation and AdamW.

The same class runs the tiny preset on CPU and Qwen2.5-7B-Instruct / Qwen3-4B-Thinking-2507 on a
GPU. Log-probs follow the convention of :mod:`crl_train.policy.base` (tempered, constraint-masked,
top-p excluded). The model is kept in ``eval`` mode for generation and recomputation (no dropout),
so both see the same function; ``train_step`` switches to ``train`` only so that gradient
checkpointing engages (Qwen configs have zero dropout).
Checkpoint files (atomic save, strict weight loading) are :mod:`crl_train.policy.checkpoint`; the
log-probs and the AdamW step, :class:`crl_train.policy.hf_train.HFTraining` (a base of this class).

>>> from crl_train.policy.tiny import build_tiny_policy
>>> policy = build_tiny_policy(["go north", "go south"], vocab_size=300, hidden=32, layers=1,
...                            heads=2, kv_heads=1, intermediate=64)
>>> prompt = policy.apply_chat([{"role": "user", "content": "where?"}])
>>> gens = policy.generate([prompt], 8, allowed=[["go north", "go south"]])
>>> [g.text for g in gens][0] in ("go north", "go south")
True
"""

from __future__ import annotations

import logging
import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .base import (
    AllowedRow,
    Generation,
    Generator,
    OptimConfig,
    SamplingConfig,
    StructuredGenerator,
)
from .chat import ChatFormatter
from .checkpoint import (
    MODEL_DIR,
    Pretrained,
    load_tokenizer,
    load_weights,
    read_state,
    resolve_dtype,
    write_checkpoint,
)
from .generate import RowConstraint, RowKV, generate_batch
from .grammar import GrammarEngine, JsonGrammar
from .hf_train import HFTraining
from .lora import (
    CheckpointView,
    LoraSpec,
    apply_lora,
    checkpoint_adapter_spec,
    is_lora,
    load_checkpoint_weights,
    named_weights,
)
from .precision import autocast_dtype, cast_frozen, master_float32
from .trie import ActionTrie, ThinkThenChoose

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

SHARE_PREFIX_TOKENS = 16
"""Default ``HFPolicy.share_prefix``: a shorter common prefix saves less than its own forward
pass costs."""


class HFPolicy(HFTraining):
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
        module: torch.nn.Module = (
            model  # transformers types PreTrainedModel.to as the unbound Module.to
        )
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
        for all its rows, in generation (``generate.py``) and in training (``shared_forward.py``);
        0 = off. The extractor's prompts share their instructions."""
        self.generator: Generator | None = None
        """Optional fast generator (``VLLMGenerator``) for unconstrained and JSON-grammar
        requests; see attach_generator."""
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

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype forwards compute in: the CPU autocast dtype, else the weights' own."""
        return self.autocast_dtype or self.model.dtype

    @property
    def sampled_logprobs_exact(self) -> bool:
        """See ``Policy.sampled_logprobs_exact``. False in 16 bits: sampling decodes token by token
        on cached keys/values while training runs whole sequences, and bf16 rounds the two apart
        (SmolLM2 on a CPU with AMX: mean |log ρ| 0.035, max 0.23 over 16 sampled tokens); False too
        behind a generator whose log-probs are inexact."""
        exact_engine = self.generator is None or self.generator.logprobs_exact
        return self.compute_dtype in (torch.float32, torch.float64) and exact_engine

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
            raise ValueError(
                f"{self.name}: enable_lora after the optimizer exists (call it before the "
                "first train_step)"
            )
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
            raise ValueError(
                f"{self.name}: neither the tokenizer nor the generation config defines an EOS token"
            )
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
        kwargs: dict[str, Any] = {
            "dtype": _load_dtype(compute, device),
            "trust_remote_code": trust_remote_code,
        }
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        if gradient_checkpointing:
            model.gradient_checkpointing_enable()
            model.config.use_cache = False
        chat_kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        policy = cls(
            model,
            tokenizer,
            name=path,
            device=device,
            sampling=sampling,
            optim=optim,
            chat_kwargs=chat_kwargs,
        )
        policy.set_compute_dtype(compute)
        return policy

    # ---------------------------------------------------------------- chat and generation
    def apply_chat(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        return self.chat.prompt_ids(messages, add_generation_prompt=add_generation_prompt)

    @property
    def grammar_engine(self) -> GrammarEngine:
        """llguidance's view of this policy's tokenizer (built on first use, kept: it takes
        a moment)."""
        if self._grammar_engine is None:
            vocab = int(self.model.get_output_embeddings().weight.shape[0])
            self._grammar_engine = GrammarEngine(
                self.tokenizer, vocab_size=vocab, eos_token_id=self.eos_token_ids[0]
            )
        return self._grammar_engine

    def replay_allowed(
        self, grammar: JsonGrammar, token_ids: Sequence[int]
    ) -> list[tuple[int, ...] | None]:
        """Per-token allowed sets of ``token_ids`` sampled under ``grammar``
        (``GrammarEngine.replay``)."""
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
                "generate: temperature %s differs from the policy's %s; recomputed log-probs will "
                "not match",
                cfg.temperature,
                self.sampling.temperature,
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
            raise ValueError(
                f"generate: cache_keys has {len(keys)} entries for {len(prompts)} prompts"
            )
        out: list[Generation] = []
        bs = self.generation_batch_size
        for s in range(0, len(prompts), bs):
            chunk = keys[s : s + bs] if keys is not None else None
            with self.compute():
                gens, kept = generate_batch(
                    self.model,
                    self.tokenizer,
                    [list(map(int, p)) for p in prompts[s : s + bs]],
                    tries[s : s + bs],
                    max_new_tokens=max_new_tokens,
                    sampling=cfg,
                    eos_token_ids=self.eos_token_ids,
                    pad_token_id=self.pad_token_id,
                    device=self.device,
                    generator=generator,
                    past=[self._kv.get(k) for k in chunk] if chunk is not None else None,
                    keep_kv=chunk is not None,
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
        return all(
            a is None
            or (
                isinstance(a, JsonGrammar)
                and not a.think_tokens
                and (a.reasoning_end is None or bool(gen.reasoning_parser))
            )
            for a in allowed
        )

    def _generate_on_generator(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        allowed: Sequence[AllowedRow] | None,
        cfg: SamplingConfig,
    ) -> list[Generation]:
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
            "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
        }
        # with LoRA: model/ holds the frozen base (HF layout) and adapter/ the adapters; the
        # view has the one method the writer calls (save_pretrained), not a model's type
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
    def from_checkpoint(
        cls, directory: str | Path, *, device: str = "cpu", dtype: str | torch.dtype | None = None
    ) -> HFPolicy:
        """A policy rebuilt from a :meth:`save` directory (tiny preset included). ``dtype`` None
        computes in the dtype the saved policy computed in (a checkpoint written before that was
        recorded: ``auto``), so a resumed run's numbers are the interrupted run's on any CPU."""
        from transformers import AutoModelForCausalLM

        state = read_state(directory)
        model_dir = str(Path(directory) / MODEL_DIR)
        tokenizer = load_tokenizer(model_dir)  # as saved: samples replay, prompts encode as before
        compute = resolve_dtype(
            state.get("compute_dtype", "auto") if dtype is None else dtype, device
        )
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=_load_dtype(compute, device))
        spec = checkpoint_adapter_spec(directory)
        if (
            spec is not None
        ):  # the base came from model/; load() fills the adapters and their optimizer state
            apply_lora(model, spec)
        optim = {**state["optim"], "betas": tuple(state["optim"]["betas"])}
        sampling = {**state["sampling"], "stop": tuple(state["sampling"]["stop"])}
        policy = cls(
            model,
            tokenizer,
            name=state["name"],
            device=device,
            sampling=SamplingConfig(**sampling),
            optim=OptimConfig(**optim),
            chat_kwargs=state["chat_kwargs"],
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
