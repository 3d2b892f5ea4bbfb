"""The bank's vector index: a usearch cosine index (f32) keyed by entry id, and its files.

SQLite holds the truth (:mod:`crl_gym.experience.store`); this index is a cache of the entries'
embeddings that can always be rebuilt from it. The saved index is trusted only when it is, byte
for byte, the file that was saved for exactly these rows: ``index.json`` records the file's
checksum and a digest of the ids and vectors it was built from, both checked before usearch
reads a byte (a damaged file can crash usearch's loader or answer with the wrong neighbours),
and a sample of keys and vectors is compared after loading. Any mismatch rebuilds the index
from SQLite; :meth:`VectorIndex.open` says *why* so the bank can log and count it.

Answers of a small index are a function of the rows alone: the most similar first, equal
similarities in id order, and the ``k`` best cut after that order. usearch alone breaks ties by
the slot a key landed in, and a multi-threaded ``add`` hands out slots in thread order, so two
builds of one bank answered ties differently and the Merge walked one bank in different orders
from run to run. Vectors are added by one thread, so an HNSW graph (2,048 keys and more, whose
answers are ordered the same way) is the same for the same history of writes.

Ids that hold the very same vector share one usearch key (the smallest of them): an HNSW graph
loses recall when hundreds of its points lie at distance 0 from each other (their neighbour lists
fill up with one another, and searches for other points stop finding their way out), and a bank
whose extractor writes one advice many times holds exactly that. A search answers every id of a
matched vector, so the index still finds each copy.

>>> import numpy as np
>>> index = VectorIndex.build(2, {1: np.array([1.0, 0.0], np.float32),
...                               2: np.array([0.0, 1.0], np.float32)})
>>> [[i for i, _ in hits] for hits in index.search(np.array([[0.2, 0.9]], np.float32), k=2)]
[[2, 1]]
>>> index.replace([], {3: np.array([0.0, 1.0], np.float32)})  # a copy of 2: no new key
>>> found = index.search(np.array([[0.2, 0.9]], np.float32), k=3)
>>> len(index), index.keys, [[i for i, _ in hits] for hits in found]
(3, 2, [[2, 3, 1]])
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from usearch.index import Index

INDEX_FILE, INDEX_META_FILE = "index.usearch", "index.json"
SAMPLE_SIZE = 16
"""Keys whose vectors are read back from a loaded index and compared with SQLite's."""


def file_digest(path: Path) -> str:
    """BLAKE2b of a file's bytes (hex), read in 1 MiB blocks."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def rows_digest(vectors: Mapping[int, np.ndarray]) -> str:
    """BLAKE2b of the ids (sorted) and their f32 vectors: what an index of ``vectors`` mirrors."""
    h = hashlib.blake2b(digest_size=16)
    ids = np.array(sorted(vectors), dtype="<u8")
    h.update(ids.tobytes())
    for i in ids.tolist():
        h.update(np.ascontiguousarray(vectors[i], dtype="<f4").tobytes())
    return h.hexdigest()


def _sample(ids: Sequence[int], n: int = SAMPLE_SIZE) -> list[int]:
    """Up to ``n`` ids spread evenly over ``ids`` (sorted): first, last and between."""
    if len(ids) <= n:
        return list(ids)
    picks = np.linspace(0, len(ids) - 1, n).round().astype(int)
    return [ids[int(p)] for p in picks]


def _usearch() -> Any:
    """usearch's ``Index``, imported on first use: a process that loads usearch's extension before
    Ray's cannot start Ray any more (``ray.init`` aborts with ``std::regex_error``), and importing
    ``crl_gym.experience`` (configs, clients) must not decide that order for the caller."""
    from usearch.index import Index

    return Index


def vector_key(vector: np.ndarray) -> bytes:
    """What makes two vectors the same for the index: their f32 bytes (BLAKE2b, 16 bytes)."""
    return hashlib.blake2b(
        np.ascontiguousarray(vector, dtype="<f4").tobytes(), digest_size=16
    ).digest()


EXACT_SEARCH_BELOW = 2048
"""Indexes with fewer distinct vectors than this are searched exactly (a scan), larger ones
by HNSW."""
ADD_THREADS = 1
"""usearch threads of an ``add``: one, so that slots and the HNSW graph do not hang on thread timing
(measured on 2 shared cores: 10,000 x 384 built in 15 s with one thread, 23 s with all)."""


class VectorIndex:
    """Cosine top-k search over ``{id: unit vector}``; not thread-safe (the bank's lock guards it).

    One usearch key per distinct vector: the smallest id holding it (a pure function of the rows,
    so a saved index can be checked against them). ``len`` counts ids, :attr:`keys` the vectors.
    """

    def __init__(self, dim: int) -> None:
        self.dim = int(dim)
        self._index = _usearch()(ndim=self.dim, metric="cos", dtype="f32")
        self._group_of: dict[int, bytes] = {}  # id -> its vector's key
        self._groups: dict[bytes, list[int]] = {}  # vector key -> the ids holding it, sorted
        self._vector_of: dict[bytes, np.ndarray] = {}  # vector key -> the vector

    @classmethod
    def build(cls, dim: int, vectors: Mapping[int, np.ndarray]) -> VectorIndex:
        """A fresh index holding ``vectors`` (``{id: [dim]}``)."""
        index = cls(dim)
        index._group(vectors)
        if index._groups:
            keys = np.fromiter(
                (ids[0] for ids in index._groups.values()),
                dtype=np.uint64,
                count=len(index._groups),
            )
            index._index.add(keys, np.stack(list(index._vector_of.values())), threads=ADD_THREADS)
        return index

    def _group(self, vectors: Mapping[int, np.ndarray]) -> None:
        for i in sorted(vectors):
            g = vector_key(vectors[i])
            self._group_of[i] = g
            if g in self._groups:
                self._groups[g].append(i)
            else:
                self._groups[g] = [i]
                self._vector_of[g] = vectors[i]

    @property
    def keys(self) -> int:
        """Distinct vectors (usearch keys); at most ``len(self)``."""
        return len(self._index)

    @classmethod
    def open(
        cls, directory: Path, dim: int, vectors: Mapping[int, np.ndarray], generation: int
    ) -> tuple[VectorIndex, str | None]:
        """The index saved in ``directory`` if it is the one saved for ``vectors``/``generation``,
        else a rebuilt one; returns ``(index, why it was rebuilt or None)``. Never raises for a
        damaged file.

        A missing file with no vectors is not a recovery (a new bank), so the reason is None.
        """
        ipath, mpath = directory / INDEX_FILE, directory / INDEX_META_FILE
        if not ipath.exists():
            return cls.build(dim, vectors), (f"{ipath} is missing" if vectors else None)
        restored: Index | None = None
        try:
            reason = cls._mismatch(ipath, mpath, dim, vectors, generation)
            if reason is None:
                restored = _usearch().restore(str(ipath))
                reason = cls._content_mismatch(restored, ipath, dim, vectors)
        except (OSError, ValueError, TypeError, RuntimeError, MemoryError) as exc:
            reason = f"{ipath} or {mpath.name} unreadable ({type(exc).__name__}: {exc})"
        if reason is not None or restored is None:
            return cls.build(dim, vectors), reason
        index = cls(dim)
        index._group(vectors)
        index._index = restored
        return index, None

    @staticmethod
    def _mismatch(
        ipath: Path, mpath: Path, dim: int, vectors: Mapping[int, np.ndarray], generation: int
    ) -> str | None:
        """Why the saved files cannot be this index, checked before usearch reads them; None if
        they can."""
        meta = json.loads(mpath.read_text(encoding="utf-8"))
        if not isinstance(meta, dict):
            return f"{mpath} is not a JSON object"
        expected = {"generation": generation, "count": len(vectors), "dim": dim}
        if {k: meta.get(k) for k in expected} != expected:
            return (
                f"{ipath} is out of date ({ {k: meta.get(k) for k in expected} }, the database "
                f"has {expected})"
            )
        if "checksum" not in meta or "rows" not in meta:
            return f"{ipath} has no checksum (written by an older version)"
        if meta["rows"] != rows_digest(vectors):
            return f"{ipath} was saved for other rows than the database holds (rows digest differs)"
        if meta["checksum"] != file_digest(ipath):
            return f"{ipath} is damaged (its checksum does not match {mpath.name})"
        return None

    @staticmethod
    def _content_mismatch(
        restored: Index | None, ipath: Path, dim: int, vectors: Mapping[int, np.ndarray]
    ) -> str | None:
        """Why a loaded index does not mirror ``vectors`` (size, dim, a sample of keys
        and vectors)."""
        # the keys an index of these rows has: the smallest id of each distinct vector
        first: dict[bytes, int] = {}
        for i in sorted(vectors):
            first.setdefault(vector_key(vectors[i]), i)
        if restored is None or restored.ndim != dim or len(restored) != len(first):
            return f"{ipath} does not match the database"
        sample = _sample(sorted(first.values()))
        if sample:
            keys = np.asarray(sample, dtype=np.uint64)
            got = restored.get(keys)
            if got is None or any(v is None for v in got):
                return f"{ipath} lacks entries the database has"
            want = np.stack([vectors[i] for i in sample])
            if not np.allclose(
                np.asarray(got, dtype=np.float32).reshape(want.shape), want, atol=1e-6
            ):
                return f"{ipath} holds other vectors than the database"
        return None

    def save(self, directory: Path, generation: int, vectors: Mapping[int, np.ndarray]) -> None:
        """Write the index and its metadata next to the database (each an atomic replace).

        ``vectors`` are the rows the index mirrors (the bank's, at ``generation``): their digest
        and the file's checksum go into ``index.json`` for :meth:`open` to verify.
        """
        ipath, mpath = directory / INDEX_FILE, directory / INDEX_META_FILE
        tmp = ipath.with_suffix(".tmp")
        try:
            self._index.save(str(tmp))
        except BaseException:
            tmp.unlink(
                missing_ok=True
            )  # a half-written copy only takes space (a full disk's, likely)
            raise
        meta = {
            "generation": generation,
            "count": len(self),
            "dim": self.dim,
            "checksum": file_digest(tmp),
            "rows": rows_digest(vectors),
        }
        os.replace(tmp, ipath)
        # a kill between the two replaces leaves a new index with the old checksum: rebuilt on open
        mtmp = mpath.with_suffix(".tmp")
        mtmp.write_text(json.dumps(meta), encoding="utf-8")
        os.replace(mtmp, mpath)

    def replace(self, remove: Sequence[int], add: Mapping[int, np.ndarray]) -> None:
        """Drop the ``remove`` ids, then add ``add`` (an id in both gets its new vector).

        Only vectors whose key changes touch usearch: the first id of a new vector, the last id of
        a vector leaving, and a vector whose smallest id went (re-keyed to the next one).
        """
        before: dict[bytes, int | None] = {}  # each touched vector's usearch key before this call
        for i in [*remove, *add]:  # an id added again gets its new vector: its old one goes first
            g = self._group_of.pop(int(i), None)
            if g is None:
                continue
            ids = self._groups[g]
            before.setdefault(g, ids[0])
            ids.remove(int(i))
        for i, v in add.items():
            i = int(i)
            g = vector_key(v)
            self._group_of[i] = g
            ids = self._groups.setdefault(g, [])
            before.setdefault(g, ids[0] if ids else None)
            bisect.insort(ids, i)
            self._vector_of.setdefault(g, v)
        drop: list[int] = []
        put: list[tuple[int, np.ndarray]] = []
        for g, old in before.items():
            ids = self._groups[g]
            new = ids[0] if ids else None
            if new == old:
                continue
            if old is not None:
                drop.append(old)
            if new is None:
                del self._groups[g], self._vector_of[g]
            else:
                put.append((new, self._vector_of[g]))
        if drop:
            self._index.remove(np.asarray(drop, dtype=np.uint64))
        if put:
            self._index.add(
                np.asarray([k for k, _ in put], dtype=np.uint64),
                np.stack([v for _, v in put]),
                threads=ADD_THREADS,
            )

    def search(self, queries: np.ndarray, k: int) -> list[list[tuple[int, float]]]:
        """Top-``k`` ``(id, cosine similarity)`` per row of ``queries`` [n, dim], best first, equal
        similarities in id order.

        ``k`` is capped by the index size; an empty index (or ``k`` < 1) gives ``[]`` rows.
        """
        n = len(queries)
        size = len(self._index)
        if size == 0 or n == 0 or k < 1:
            return [[] for _ in range(n)]
        # A small index is scanned: the scan never misses, where HNSW's approximate walk can
        # skip the exact match of a small, clustered bank; at 2,000 keys it costs 2.7 ms a 16-query
        # batch (the walk 1.8 ms), at 500 less than the walk.
        exact = size < EXACT_SEARCH_BELOW
        # k keys give at least k ids: a key stands for one id or more
        keys, sims, counts = self._scan(queries, min(k, size), exact)
        valid = np.arange(keys.shape[1])[None, :] < counts[:, None]
        # best first, then the smaller key (an id group's smallest id); unfilled places last
        order = np.lexsort((keys, -np.where(valid, sims, -np.inf)), axis=-1)
        out: list[list[tuple[int, float]]] = []
        for r in range(n):
            row: list[tuple[int, float]] = []
            for j in order[r, : int(counts[r])]:
                key, sim = int(keys[r, j]), float(sims[r, j])
                row.extend((i, sim) for i in self._groups[self._group_of[key]])
                if len(row) >= k:
                    break
            out.append(row[:k])
        return out

    def _scan(
        self, queries: np.ndarray, k: int, exact: bool
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """usearch's best keys per query: ``keys`` [n, m], ``sims`` [n, m] (best first),
        ``counts`` [n].

        Scanning, it returns every key that ties with a query's k-th best (more than k when they
        do), so that the caller cuts the k best after putting ties in id order: usearch alone cuts
        them in slot order. A tie past the k-th is rare with real embeddings (one search of k + 1).
        """
        size = len(self._index)
        want = min(size, k + 1) if exact else k
        while True:
            res = self._index.search(queries, want, threads=1, exact=exact)
            n = len(queries)
            keys = res.keys.reshape(n, -1)
            sims = 1.0 - res.distances.reshape(n, -1)
            # usearch answers a one-row batch with a single Matches (no .counts).
            counts = np.atleast_1d(getattr(res, "counts", len(res.keys)))
            if not exact or want >= size:
                return keys, sims, counts
            # a row is whole when its last answer is below its k-th best (nothing past it can tie)
            if all(counts[r] <= k or sims[r, counts[r] - 1] < sims[r, k - 1] for r in range(n)):
                return keys, sims, counts
            want = min(size, 4 * want)

    def __len__(self) -> int:
        return len(self._group_of)
