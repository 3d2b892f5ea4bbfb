"""The bank's vector index: a usearch cosine index (f32) keyed by entry id, and its files.

SQLite holds the truth (:mod:`crl_gym.experience.store`); this index is a cache of the entries'
embeddings that can always be rebuilt from it. :meth:`VectorIndex.open` says *why* it had to
rebuild (missing, stale or unreadable files) so the bank can log and count it.

>>> import numpy as np
>>> index = VectorIndex.build(2, {1: np.array([1.0, 0.0], np.float32), 2: np.array([0.0, 1.0], np.float32)})
>>> [[i for i, _ in hits] for hits in index.search(np.array([[0.2, 0.9]], np.float32), k=2)]
[[2, 1]]
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from usearch.index import Index

INDEX_FILE, INDEX_META_FILE = "index.usearch", "index.json"


class VectorIndex:
    """Cosine top-k search over ``{id: unit vector}``; not thread-safe (the bank's lock guards it)."""

    def __init__(self, dim: int) -> None:
        self.dim = int(dim)
        self._index = Index(ndim=self.dim, metric="cos", dtype="f32")

    @classmethod
    def build(cls, dim: int, vectors: Mapping[int, np.ndarray]) -> VectorIndex:
        """A fresh index holding ``vectors`` (``{id: [dim]}``)."""
        index = cls(dim)
        if vectors:
            ids = np.fromiter(vectors.keys(), dtype=np.uint64, count=len(vectors))
            index._index.add(ids, np.stack([vectors[int(i)] for i in ids]))
        return index

    @classmethod
    def open(
        cls, directory: Path, dim: int, vectors: Mapping[int, np.ndarray], generation: int
    ) -> tuple[VectorIndex, str | None]:
        """The index saved in ``directory`` if it matches ``vectors``/``generation``, else a
        rebuilt one; returns ``(index, why it was rebuilt or None)``.

        A missing file with no vectors is not a recovery (a new bank), so the reason is None.
        """
        ipath, mpath = directory / INDEX_FILE, directory / INDEX_META_FILE
        if not ipath.exists():
            return cls.build(dim, vectors), (f"{ipath} is missing" if vectors else None)
        try:
            meta = json.loads(mpath.read_text())
            if meta != {"generation": generation, "count": len(vectors), "dim": dim}:
                return cls.build(dim, vectors), f"{ipath} is out of date ({meta})"
            restored = Index.restore(str(ipath))
            if restored is None or restored.ndim != dim or len(restored) != len(vectors):
                return cls.build(dim, vectors), f"{ipath} does not match the database"
        except (OSError, ValueError, RuntimeError) as exc:
            return cls.build(dim, vectors), f"{ipath} or {mpath.name} unreadable ({exc})"
        index = cls(dim)
        index._index = restored
        return index, None

    def save(self, directory: Path, generation: int) -> None:
        """Write the index and its metadata next to the database (each an atomic replace)."""
        ipath, mpath = directory / INDEX_FILE, directory / INDEX_META_FILE
        tmp = ipath.with_suffix(".tmp")
        self._index.save(str(tmp))
        os.replace(tmp, ipath)
        meta = {"generation": generation, "count": len(self._index), "dim": self.dim}
        mtmp = mpath.with_suffix(".tmp")
        mtmp.write_text(json.dumps(meta))
        os.replace(mtmp, mpath)

    def replace(self, remove: Sequence[int], add: Mapping[int, np.ndarray]) -> None:
        """Drop the ``remove`` ids, then add ``add`` (an id in both gets its new vector)."""
        if remove:
            self._index.remove(np.asarray(remove, dtype=np.uint64))
        if add:
            self._index.add(
                np.asarray(list(add), dtype=np.uint64),
                np.stack(list(add.values())),
            )

    def search(self, queries: np.ndarray, k: int) -> list[list[tuple[int, float]]]:
        """Top-``k`` ``(id, cosine similarity)`` per row of ``queries`` [n, dim], best first.

        ``k`` is capped by the index size; an empty index gives ``[]`` rows.
        """
        n = len(queries)
        if len(self._index) == 0 or n == 0:
            return [[] for _ in range(n)]
        res = self._index.search(queries, min(k, len(self._index)), threads=1)
        keys = res.keys.reshape(n, -1)
        sims = 1.0 - res.distances.reshape(n, -1)
        # usearch answers a one-row batch with a single Matches (no .counts).
        counts = np.atleast_1d(getattr(res, "counts", len(res.keys)))
        return [[(int(keys[r, j]), float(sims[r, j])) for j in range(int(counts[r]))] for r in range(n)]

    def __len__(self) -> int:
        return len(self._index)
