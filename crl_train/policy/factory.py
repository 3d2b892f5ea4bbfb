"""Build a policy from a :class:`~crl_train.config.ModelConfig`: the tiny preset, an HF model, a vLLM generator,
or the scripted reader actor (``model: reader``, no weights: :mod:`crl_train.policy.reader`).

One place for every model the project trains (the actor, the extractor in this process or in its
worker process), so both are built the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from crl_train.config import ModelConfig
from crl_train.config.names import ModelKind
from crl_train.policy.base import Generator, LossScale, OptimConfig, Policy, SamplingConfig
from crl_train.policy.checkpoint import resolve_dtype

if TYPE_CHECKING:
    from crl_train.policy.hf import HFPolicy

GeneratorFactory = Callable[["HFPolicy", ModelConfig, int], Generator]
"""``(policy, model_config, seed) -> generator``: builds the fast generator of ``generator: vllm``
(a :class:`~crl_train.policy.base.Generator`, e.g. ``VLLMGenerator``)."""

PolicyRole = Literal["actor", "extractor"]
"""Which model a policy is. The actor's trainer recomputes π_old with the trained model before each
update, so its generator may return inexact log-probs; the extractor trains on stored samples after
later updates, so its generator's log-probs must be exact."""


class GeneratorUnavailable(RuntimeError):
    """``generator: vllm`` on a machine without vLLM or without a CUDA GPU."""


def vllm_generator(policy: HFPolicy, mc: ModelConfig, seed: int) -> Generator:
    """A ``VLLMGenerator`` serving ``policy``'s current weights (vLLM is imported only here)."""
    import importlib.util
    import tempfile

    missing = []
    if importlib.util.find_spec("vllm") is None:
        missing.append("vLLM is not installed (pip install 'complementary-rl[vllm]')")
    if not torch.cuda.is_available():
        missing.append("no CUDA GPU is visible (vLLM has no CPU backend here)")
    if missing:
        raise GeneratorUnavailable(f"generator: vllm ({mc.model}) needs vLLM and a CUDA GPU: {'; '.join(missing)}. "
                                   "Use generator: hf on this machine.")
    from crl_train.policy.checkpoint import MODEL_DIR
    from crl_train.policy.vllm_engine import VLLMGenerator

    # vLLM loads a model directory: write the policy's current weights (a tiny model or a
    # checkpoint has no hub id); the engine reads them at start-up, so the directory can go.
    with tempfile.TemporaryDirectory(prefix="crl_vllm_") as tmp:
        policy.save(tmp)
        return VLLMGenerator(str(Path(tmp) / MODEL_DIR), policy.tokenizer, sampling=policy.sampling,
                             dtype="bfloat16" if mc.dtype == "auto" else mc.dtype,
                             gpu_memory_utilization=mc.gpu_memory_utilization, max_model_len=mc.max_context_tokens,
                             seed=seed)


def trains(mc: ModelConfig) -> bool:
    """Whether the model of ``mc`` has weights a trainer updates: False for the scripted reader
    actor (the trainer consults this once and then builds no actor objective).

    >>> trains(ModelConfig(model="tiny")), trains(ModelConfig(model="reader"))
    (True, False)
    """
    return mc.kind is not ModelKind.READER


def build_policy(mc: ModelConfig, texts: list[str] | None, *, loss_scale: LossScale, seed: int,
                 checkpoint: Path | None, generator_factory: GeneratorFactory | None = None,
                 role: PolicyRole | None = None) -> Policy:
    """The HF policy of ``mc``, with its fast generator attached when ``mc.generator`` is ``vllm``.

    ``role`` (:data:`PolicyRole`) says whether an inexact generator is acceptable: only for the
    ``"actor"``; an extractor, or a caller that does not say, needs exact engine log-probs.
    """
    if mc.kind is ModelKind.READER:  # no weights and no generator: a seeded script (crl_train.policy.reader)
        from crl_train.policy.reader import ReaderPolicy

        if checkpoint is not None:
            return ReaderPolicy.from_checkpoint(checkpoint)
        return ReaderPolicy(seed=seed)
    policy = _build_hf_policy(mc, texts, loss_scale=loss_scale, seed=seed, checkpoint=checkpoint)
    policy.prefix_cache = mc.prefix_cache
    if not mc.share_prefix:
        policy.share_prefix = 0
    if mc.generator == "vllm":
        gen = (generator_factory or vllm_generator)(policy, mc, seed)
        if role != "actor" and not gen.logprobs_exact:
            # the extractor's CISPO weighs by π_φ / π_φ_old at sampling time: recomputing later would
            # use newer weights, so only exact engine log-probs are correct there
            raise GeneratorUnavailable(f"extractor.generator: vllm needs exact log-probs (top_p = 1, sampling, "
                                       f"vLLM >= 0.10.2); this engine's are not (top_p={mc.top_p})")
        # attach_generator pushes the current weights now; HFPolicy.train_step after every update
        policy.attach_generator(gen)
    return policy


def model_dtype(mc: ModelConfig) -> str:
    """``mc.dtype``, except that ``auto`` keeps the tiny model in float32 on CPU: its matrices are
    too small for bf16 matrix units to pay, and its runs stay the same on every CPU.

    >>> model_dtype(ModelConfig(model="tiny")), model_dtype(ModelConfig(model="smollm2-135m"))
    ('float32', 'auto')
    """
    if mc.dtype == "auto" and mc.kind is ModelKind.TINY and torch.device(mc.device).type == "cpu":
        return "float32"
    return mc.dtype


def _build_hf_policy(mc: ModelConfig, texts: list[str] | None, *, loss_scale: LossScale, seed: int,
                     checkpoint: Path | None) -> HFPolicy:
    from crl_train.policy.hf import HFPolicy

    dtype = model_dtype(mc)
    if checkpoint is not None:
        # auto resumes in the dtype the run computed in, whichever CPU it resumes on
        return HFPolicy.from_checkpoint(checkpoint, device=mc.device, dtype=None if mc.dtype == "auto" else dtype)
    sampling = SamplingConfig(temperature=mc.temperature, top_p=mc.top_p)
    optim = OptimConfig(lr=mc.lr, micro_batch_size=mc.micro_batch_size, loss_scale=loss_scale)
    if mc.kind is ModelKind.TINY:
        from crl_train.policy.tiny import build_tiny_policy

        assert texts is not None
        tiny = build_tiny_policy(texts, vocab_size=mc.tiny_vocab_size, device=mc.device, sampling=sampling, optim=optim,
                                 seed=seed, hidden=mc.tiny_hidden, layers=mc.tiny_layers, heads=mc.tiny_heads,
                                 kv_heads=mc.tiny_kv_heads, intermediate=mc.tiny_intermediate,
                                 max_positions=max(mc.max_context_tokens, 512))
        tiny.set_compute_dtype(resolve_dtype(dtype, mc.device))
        return _with_lora(tiny, mc)
    from crl_train.policy.packaged import display_name, resolve_model

    # smollm2-135m and *.gguf: converted once into a cached model directory; HF ids and paths as given
    policy = HFPolicy.from_pretrained(resolve_model(mc.model), device=mc.device, dtype=dtype, sampling=sampling,
                                      optim=optim, enable_thinking=mc.enable_thinking)
    policy.name = display_name(mc.model)
    return _with_lora(policy, mc)


def _with_lora(policy: HFPolicy, mc: ModelConfig) -> HFPolicy:
    """``mc.lora_rank`` > 0: the policy trains adapters instead of its full weights (a checkpoint
    brings its own adapters back, so this applies to fresh policies only)."""
    if mc.lora_rank:
        from crl_train.policy.lora import LoraSpec

        policy.enable_lora(LoraSpec(mc.lora_rank, mc.lora_alpha, mc.lora_targets))
    return policy
