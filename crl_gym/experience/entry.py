"""One experience entry of the bank, with its retrieval/training statistics and provenance.

>>> e = ExperienceEntry(id=7, text="Walk to the stairs first.", embedding=None)
>>> e.ref()
ExperienceRef(id=7, text='Walk to the stairs first.', version=0)
>>> ExperienceEntry.from_dict(e.to_dict()) == e
True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from crl_gym.json_types import JSONDict
from crl_gym.protocol import ExperienceRef, ExtractorSample, check_int, finite_float

UINT64_MAX = 2**64 - 1


def check_id(value: object, *, what: str = "id") -> int:
    """Return ``value`` as an int in the uint64 range, or raise ``ValueError`` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{what} must be an integer in [0, 2**64), got {value!r}")
    ivalue = int(value)
    if not 0 <= ivalue <= UINT64_MAX:
        raise ValueError(f"{what} must be in [0, 2**64), got {ivalue}")
    return ivalue


@dataclass
class ExperienceEntry:
    """An entry m of the experience bank M."""

    id: int
    """uint64 key, shared by the vector index and SQLite."""
    text: str
    """The experience text shown to the actor."""
    embedding: np.ndarray | None = None
    """L2-normalised float32 vector of shape ``(dim,)``; ``None`` when not loaded."""
    version: int = 0
    """Incremented by every update of the text."""
    created_step: int = 0
    """Training step at which the entry was added."""
    retrieval_count: int = 0
    """c(m): how many times retrieval returned this entry (diversification penalty)."""
    last_retrieved: float = 0.0
    """Clock value (seconds) of the last retrieval; 0 = never."""
    train_count: int = 0
    """c_train(m): how many extractor updates used a sample of this entry."""
    last_trained_step: int = -1
    """t_last(m): the last extractor step that trained on this entry; -1 = never."""
    utility: float = 0.0
    """EMA utility (EDGE)."""
    tags: tuple[str, ...] = ()
    """Task tags (e.g. env id or task category)."""
    provenance: ExtractorSample | None = None
    """The extractor sample (prompt, response, log-probs, version) that produced the text."""
    history: list[str] = field(default_factory=list)
    """Older texts, oldest first."""
    source: str = ""
    """The task (or state) of the episode the entry was distilled from; "" for an entry a user,
    a config or a Merge of several tasks wrote."""
    key: str | None = None
    """The text its embedding was computed from, when that is not :attr:`text` (the retrieval key:
    :mod:`crl_gym.experience.keys`); None = the text itself."""

    @property
    def retrieval_text(self) -> str:
        """What retrieval matches a query against: the key, or the text when there is none."""
        return self.text if self.key is None else self.key

    def ref(self) -> ExperienceRef:
        """What an episode records of this entry."""
        return ExperienceRef(id=self.id, text=self.text, version=self.version)

    def __eq__(self, other: object) -> bool:
        # Compare embeddings by value: the dataclass default would compare arrays elementwise.
        if not isinstance(other, ExperienceEntry):
            return NotImplemented
        a, b = self.embedding, other.embedding
        same_emb = (a is None and b is None) or (
            a is not None and b is not None and a.shape == b.shape and bool(np.array_equal(a, b))
        )
        return same_emb and self._key() == other._key()

    def _key(self) -> tuple[Any, ...]:
        prov = self.provenance.to_dict() if self.provenance else None
        return (
            self.id,
            self.text,
            self.version,
            self.created_step,
            self.retrieval_count,
            self.last_retrieved,
            self.train_count,
            self.last_trained_step,
            self.utility,
            tuple(self.tags),
            prov,
            list(self.history),
            self.source,
            self.key,
        )

    def to_dict(self, *, with_embedding: bool = True) -> JSONDict:
        """JSON-ready dict (the JSONL export format)."""
        d: dict[str, Any] = {
            "id": self.id,
            "text": self.text,
            "version": self.version,
            "created_step": self.created_step,
            "retrieval_count": self.retrieval_count,
            "last_retrieved": self.last_retrieved,
            "train_count": self.train_count,
            "last_trained_step": self.last_trained_step,
            "utility": self.utility,
            "tags": list(self.tags),
            "provenance": self.provenance.to_dict() if self.provenance else None,
            "history": list(self.history),
            "source": self.source,
            "key": self.key,
        }
        if with_embedding:
            d["embedding"] = None if self.embedding is None else self.embedding.tolist()
        return d

    @classmethod
    def from_dict(cls, d: object) -> ExperienceEntry:
        """Inverse of :meth:`to_dict`; raises ``ValueError``/``KeyError`` naming a bad field."""
        if not isinstance(d, dict):
            raise ValueError(f"an entry must be a JSON object, got {type(d).__name__}")
        if not isinstance(d.get("text"), str):
            raise ValueError(f"field 'text' must be a string, got {d.get('text')!r}")
        emb = d.get("embedding")
        tags = d.get("tags") or ()
        if isinstance(tags, str) or not isinstance(tags, (list, tuple)):
            raise ValueError("field 'tags' must be a list of strings")
        history = d.get("history") or []
        if not isinstance(history, list) or not all(isinstance(h, str) for h in history):
            raise ValueError("field 'history' must be a list of strings")
        if emb is not None:
            try:
                emb = np.asarray(emb, dtype=np.float32)
            except (TypeError, ValueError):
                raise ValueError("field 'embedding' must be a list of numbers") from None
            if emb.ndim != 1 or not np.all(np.isfinite(emb)):
                raise ValueError("field 'embedding' must be a flat list of finite numbers")

        source, key = d.get("source") or "", d.get("key")
        if not isinstance(source, str):
            raise ValueError(f"field 'source' must be a string, got {source!r:.80}")
        if key is not None and (not isinstance(key, str) or not key.strip()):
            raise ValueError(f"field 'key' must be a non-empty string or null, got {key!r:.80}")

        def count(name: str, default: int, low: int = 0) -> int:
            return check_int(d.get(name, default), f"field {name!r}", low=low)

        return cls(
            id=check_id(d.get("id"), what="field 'id'"),
            text=d["text"],
            embedding=emb,
            version=count("version", 0),
            created_step=count("created_step", 0, low=-(2**63)),
            retrieval_count=count("retrieval_count", 0),
            last_retrieved=finite_float(d.get("last_retrieved", 0.0), "field 'last_retrieved'"),
            train_count=count("train_count", 0),
            last_trained_step=count("last_trained_step", -1, low=-1),
            utility=finite_float(d.get("utility", 0.0), "field 'utility'"),
            tags=tuple(str(t) for t in tags),
            provenance=ExtractorSample.from_dict(d.get("provenance")),
            history=list(history),
            source=source,
            key=key,
        )
