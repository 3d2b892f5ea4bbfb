"""Checkpoint files of :class:`~crl_train.policy.hf.HFPolicy` and dtype resolution.

A checkpoint directory holds ``model/`` (HF weights + tokenizer, ``save_pretrained`` layout),
``policy_state.pt`` (step, skipped steps, configs, chat kwargs, optimizer state) and
``files.json`` (every file's size, written last). It is written into a temporary sibling
directory and swapped in, so a crash mid-save leaves the previous checkpoint whole.
:func:`verify_checkpoint` finds a missing, truncated or unreadable file without loading the
weights (sizes, safetensors headers, the state's zip directory), so a resume can refuse a bad
checkpoint, naming the file, before it changes anything.

>>> (resolve_dtype("auto", "cuda:0"), resolve_dtype("float32", "cpu"),
...  resolve_dtype("float16", "cpu"))
(torch.bfloat16, torch.float32, torch.float16)
>>> resolve_dtype("auto", "cpu") == (torch.bfloat16 if cpu_bf16_supported() else torch.float32)
True
"""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .precision import cpu_bf16_supported

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

STATE_FILE = "policy_state.pt"
MODEL_DIR = "model"
MANIFEST_FILE = "files.json"
STATE_KEYS = ("step", "name", "sampling", "optim", "chat_kwargs")
"""Keys :meth:`HFPolicy.from_checkpoint` reads from ``policy_state.pt``."""


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated or unreadable; the message names the file."""


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    """The dtype a model computes in: ``auto`` -> bfloat16 on CUDA and on a CPU with bf16 units
    (:func:`~crl_train.policy.precision.cpu_bf16_supported`), float32 elsewhere; strings like
    ``"bfloat16"`` accepted. On CPU a 16-bit dtype is the compute dtype only: trained parameters
    stay float32 (:mod:`crl_train.policy.precision`)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if str(device).startswith("cuda"):
            return torch.bfloat16
        return (
            torch.bfloat16
            if str(device).startswith("cpu") and cpu_bf16_supported()
            else torch.float32
        )
    value = getattr(torch, dtype, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(
            f"dtype must be 'auto' or a torch dtype name like 'bfloat16', got {dtype!r}"
        )
    return value


class Pretrained(Protocol):
    """What writes a model directory: a transformers model, or a view of one (its
    adapters apart)."""

    def save_pretrained(self, directory: Path, /) -> object: ...


def write_checkpoint(
    directory: str | Path,
    model: Pretrained,
    tokenizer: PreTrainedTokenizerBase,
    state: dict[str, Any],
) -> None:
    """Write ``model/`` and ``policy_state.pt`` into ``directory`` atomically (replacing it)."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        model.save_pretrained(tmp / MODEL_DIR)
        tokenizer.save_pretrained(tmp / MODEL_DIR)
        torch.save(state, tmp / STATE_FILE)
        _write_manifest(tmp)
        old = directory.with_name(directory.name + ".old")
        if directory.exists():
            shutil.rmtree(old, ignore_errors=True)
            directory.rename(old)
        tmp.rename(directory)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


TOKENIZER_PIPELINE = (
    "normalizer",
    "pre_tokenizer",
    "model",
    "decoder",
    "post_processor",
    "added_tokens",
)
"""The parts of ``tokenizer.json`` that decide how text becomes ids (a reloaded tokenizer must
keep them)."""


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer :func:`write_checkpoint` saved in ``model_dir``, exactly as it was saved.

    ``AutoTokenizer`` picks the class of the model's type, and a class may rebuild the pipeline
    from the vocabulary with its own rules: a tiny preset tokenizer (a byte-level BPE trained on
    the fly) comes back as ``Qwen2Tokenizer`` with Qwen's digit-splitting pre-tokenizer and NFC
    normaliser. Samples drawn before the save would then no longer replay under their grammars,
    and prompts would encode differently. So the reloaded pipeline is compared with the saved
    ``tokenizer.json``; on a difference the file is loaded as it is (``PreTrainedTokenizerFast``),
    and a tokenizer that still differs is a :class:`CheckpointError` naming the file.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    model_dir = Path(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return tokenizer  # a slow tokenizer's files: nothing to compare
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path} is unreadable ({type(exc).__name__}: {exc})") from None

    def same(tok: PreTrainedTokenizerBase) -> bool:
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is None:
            return False
        got = json.loads(backend.to_str())
        return all(got.get(k) == saved.get(k) for k in TOKENIZER_PIPELINE)

    if same(tokenizer):
        return tokenizer
    exact = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    if not same(exact):
        raise CheckpointError(f"{path}: the tokenizer does not reload as it was saved")
    return exact


def _write_manifest(directory: Path) -> None:
    """``files.json``: the size of every file of the checkpoint (a truncated copy is found
    by size)."""
    sizes = {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST_FILE
    }
    (directory / MANIFEST_FILE).write_text(json.dumps(sizes, indent=0), encoding="utf-8")


def _check_safetensors(path: Path) -> None:
    """The header parses and the tensors it lists end exactly at the end of the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated ({size} bytes, no safetensors header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(
                f"{path}: truncated or not a safetensors file (header of {n} bytes in a "
                f"{size}-byte file)"
            )
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, ValueError) as exc:
            raise CheckpointError(f"{path}: unreadable safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: unreadable safetensors header")
    ends = [
        t["data_offsets"][1]
        for k, t in header.items()
        if k != "__metadata__"
        and isinstance(t, dict)
        and isinstance(t.get("data_offsets"), list)
        and len(t["data_offsets"]) == 2
    ]
    expected = 8 + n + max(ends, default=0)
    if expected != size:
        raise CheckpointError(f"{path}: truncated ({size} bytes, its header describes {expected})")


def verify_checkpoint(directory: str | Path) -> None:
    """Raise :class:`CheckpointError` naming the first missing, truncated or unreadable file of a
    policy checkpoint; reads headers and sizes, not the weights (cheap on a multi-GB checkpoint).

    Checks: ``files.json`` sizes (checkpoints written before it existed skip this), every
    ``model/*.safetensors`` header against its size, ``policy_state.pt``'s zip directory and the
    keys a policy needs (loaded memory-mapped: the optimizer's tensors are not read).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is missing: not a policy checkpoint")
    manifest = directory / MANIFEST_FILE
    if manifest.exists():
        try:
            sizes = json.loads(manifest.read_text(encoding="utf-8"))
            if not isinstance(sizes, dict):
                raise ValueError("not a JSON object")
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise CheckpointError(f"{manifest}: unreadable ({exc})") from None
        for rel, size in sizes.items():
            f = directory / rel
            if not f.is_file():
                raise CheckpointError(f"{f} is missing (listed in {MANIFEST_FILE})")
            if f.stat().st_size != size:
                raise CheckpointError(
                    f"{f}: {f.stat().st_size} bytes, but {size} were written (truncated?)"
                )
    weights = sorted((directory / MODEL_DIR).glob("*.safetensors"))
    if not weights:
        raise CheckpointError(
            f"{directory / MODEL_DIR} holds no *.safetensors weights: not a policy checkpoint"
        )
    for f in weights:
        _check_safetensors(f)
    state = read_state(directory, mmap=True)
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise CheckpointError(f"{directory / STATE_FILE}: lacks {', '.join(missing)}")


def read_state(directory: str | Path, *, mmap: bool = False) -> dict[str, Any]:
    """The ``policy_state.pt`` of a checkpoint (``FileNotFoundError`` naming it if absent,
    :class:`CheckpointError` naming it if it does not load)."""
    path = Path(directory) / STATE_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: not a policy checkpoint")
    if not zipfile.is_zipfile(path):  # torch.save's format; a cut file has lost its zip directory
        raise CheckpointError(
            f"{path}: truncated or not a torch checkpoint ({path.stat().st_size} bytes)"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError, UnpicklingError, EOFError, …
        raise CheckpointError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a policy state")
    return state


def load_weights(model: torch.nn.Module, directory: str | Path, device: str | torch.device) -> None:
    """Load ``directory/model/*.safetensors`` into ``model``, strictly.

    Raises ``FileNotFoundError`` when the directory is not a checkpoint and ``ValueError`` naming
    the file when it has keys the model lacks, or lacks parameters (tied ``lm_head`` excepted).
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    files = sorted((directory / MODEL_DIR).glob("*.safetensors"))
    if not files or not (directory / STATE_FILE).exists():
        raise FileNotFoundError(
            f"{directory} is not a policy checkpoint (needs {MODEL_DIR}/*.safetensors and "
            f"{STATE_FILE})"
        )
    missing = {k for k, _ in model.named_parameters()}
    for f in files:
        try:
            sd = load_file(str(f), device=str(device))
        except Exception as exc:  # noqa: BLE001 - safetensors' own error type names no file
            raise CheckpointError(f"{f}: unreadable weights ({type(exc).__name__}: {exc})") from exc
        result = model.load_state_dict(sd, strict=False)
        if result.unexpected_keys:
            raise ValueError(f"{f}: keys not in the model: {result.unexpected_keys[:5]}")
        missing -= set(sd)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    missing = {k for k in missing if not (tied and k.startswith("lm_head"))}
    if missing:
        raise ValueError(f"{directory}: checkpoint lacks parameters {sorted(missing)[:5]}")
