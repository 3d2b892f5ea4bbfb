"""Mixed precision on CPU: compute in bfloat16 where the CPU has bf16 units, train in float32.

A CPU with AMX (``amx_bf16``) or AVX512-BF16 (``avx512_bf16``) multiplies bfloat16 matrices several
times faster than float32 ones; one without them emulates bf16 and is much slower (about 70x on an
AVX2-only core), so ``dtype: auto`` picks bf16 only where torch reports those units.

The split is the one GPU mixed-precision training uses: the frozen weights (a LoRA model's base)
are stored in the compute dtype, which halves what every decoding step reads; trained parameters
(LoRA adapters, or every weight when the whole model trains) and the optimizer state stay float32,
so small updates are not rounded away. Every forward pass of the policy (generation, log-prob
recomputation, training) runs under one ``torch.autocast("cpu", dtype)``. Sampling still rounds
apart from training (token-by-token decoding on cached keys/values against whole sequences: on a
CPU with AMX, SmolLM2's sampled log-probs differ by 0.035 on average, 0.23 at most), so a 16-bit
policy reports ``sampled_logprobs_exact`` False and π_old is recomputed through the
training forward.

>>> compute_context(None).__class__.__name__
'nullcontext'
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any

import torch

BF16_FLAGS = ("amx_bf16", "avx512_bf16")
"""CPU flags of hardware bfloat16 matrix products (x86: AMX tiles, AVX512-BF16 dot products)."""


@functools.cache
def cpu_bf16_supported() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (``BF16_FLAGS``): torch's own CPU
    capability report (cpuinfo), else ``/proc/cpuinfo``'s flags."""
    try:
        caps: object = torch._C._cpu._get_cpu_capability()
        if isinstance(caps, dict) and all(f in caps for f in BF16_FLAGS):
            return any(bool(caps[f]) for f in BF16_FLAGS)
    except (AttributeError, RuntimeError):
        pass
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")),
        [],
    )
    return any(f in flags for f in BF16_FLAGS)


def autocast_dtype(compute: torch.dtype, device: torch.device | str) -> torch.dtype | None:
    """The dtype CPU forwards autocast to: ``compute`` when it is 16-bit on a CPU, else None
    (float32 on CPU, or a CUDA model loaded in its dtype as before)."""
    if torch.device(device).type == "cpu" and compute in (torch.bfloat16, torch.float16):
        return compute
    return None


def compute_context(dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast("cpu", dtype)`` when ``dtype`` is set, else a no-op context."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=dtype)


def cast_frozen(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Store ``model``'s frozen floating-point parameters in ``dtype``, in place (tied weights stay
    tied: the tensor is replaced under the shared parameter); trained ones and buffers (rotary
    frequencies) stay as they are. Returns how many parameters were cast."""
    cast = 0
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
            cast += 1
    return cast


def master_float32(model: torch.nn.Module) -> int:
    """Bring trained parameters that are not float32 to float32 (the master copy AdamW updates)."""
    cast = 0
    for p in model.parameters():
        if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32:
            p.data = p.data.float()
            cast += 1
    return cast


__all__ = [
    "BF16_FLAGS",
    "autocast_dtype",
    "cast_frozen",
    "compute_context",
    "cpu_bf16_supported",
    "master_float32",
]
