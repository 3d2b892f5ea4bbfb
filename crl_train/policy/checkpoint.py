"""Checkpoint files of :class:`~crl_train.policy.hf.HFPolicy` and dtype resolution.

A checkpoint directory holds ``model/`` (HF weights + tokenizer, ``save_pretrained`` layout) and
``policy_state.pt`` (step, skipped steps, configs, chat kwargs, optimizer state). It is written
into a temporary sibling directory and swapped in, so a crash mid-save leaves the previous
checkpoint whole.

>>> resolve_dtype("auto", "cuda:0"), resolve_dtype("auto", "cpu"), resolve_dtype("float16", "cpu")
(torch.bfloat16, torch.float32, torch.float16)
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "policy_state.pt"
MODEL_DIR = "model"


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    """``auto`` -> bfloat16 on CUDA, float32 elsewhere; strings like ``"bfloat16"`` accepted."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    value = getattr(torch, dtype, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype must be 'auto' or a torch dtype name like 'bfloat16', got {dtype!r}")
    return value


def write_checkpoint(directory: str | Path, model: Any, tokenizer: Any, state: dict[str, Any]) -> None:
    """Write ``model/`` and ``policy_state.pt`` into ``directory`` atomically (replacing it)."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        model.save_pretrained(tmp / MODEL_DIR)
        tokenizer.save_pretrained(tmp / MODEL_DIR)
        torch.save(state, tmp / STATE_FILE)
        old = directory.with_name(directory.name + ".old")
        if directory.exists():
            shutil.rmtree(old, ignore_errors=True)
            directory.rename(old)
        tmp.rename(directory)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def read_state(directory: str | Path) -> dict[str, Any]:
    """The ``policy_state.pt`` of a checkpoint (``FileNotFoundError`` naming it if absent)."""
    path = Path(directory) / STATE_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: not a policy checkpoint")
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return state


def load_weights(model: Any, directory: str | Path, device: str | torch.device) -> None:
    """Load ``directory/model/*.safetensors`` into ``model``, strictly.

    Raises ``FileNotFoundError`` when the directory is not a checkpoint and ``ValueError`` naming
    the file when it has keys the model lacks, or lacks parameters (tied ``lm_head`` excepted).
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    files = sorted((directory / MODEL_DIR).glob("*.safetensors"))
    if not files or not (directory / STATE_FILE).exists():
        raise FileNotFoundError(
            f"{directory} is not a policy checkpoint (needs {MODEL_DIR}/*.safetensors and {STATE_FILE})"
        )
    missing = {k for k, _ in model.named_parameters()}
    for f in files:
        sd = load_file(str(f), device=str(device))
        result = model.load_state_dict(sd, strict=False)
        if result.unexpected_keys:
            raise ValueError(f"{f}: keys not in the model: {result.unexpected_keys[:5]}")
        missing -= set(sd)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    missing = {k for k in missing if not (tied and k.startswith("lm_head"))}
    if missing:
        raise ValueError(f"{directory}: checkpoint lacks parameters {sorted(missing)[:5]}")
