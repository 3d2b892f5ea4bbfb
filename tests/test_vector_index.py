"""Tests of crl_gym.experience.vector_index: the bank's usearch index and its files."""

from __future__ import annotations

import doctest
import json
from pathlib import Path

import numpy as np

import crl_gym.experience.vector_index as vector_index
from crl_gym.experience.vector_index import INDEX_FILE, INDEX_META_FILE, VectorIndex


def unit(*xs: float) -> np.ndarray:
    v = np.asarray(xs, dtype=np.float32)
    return v / np.linalg.norm(v)


VECS = {1: unit(1, 0, 0), 2: unit(0, 1, 0), 3: unit(1, 1, 0)}


def test_search_scores_are_cosine_similarities() -> None:
    index = VectorIndex.build(3, VECS)
    [hits] = index.search(unit(1, 0, 0)[None, :], k=3)
    # cos(e1, e1) = 1; cos(e1, (1,1,0)/sqrt 2) = 1/sqrt 2 ≈ 0.7071; cos(e1, e2) = 0
    assert [i for i, _ in hits] == [1, 3, 2]
    assert np.allclose([s for _, s in hits], [1.0, 2**-0.5, 0.0], atol=1e-5)


def test_k_is_capped_and_empty_index_gives_empty_rows() -> None:
    assert [len(r) for r in VectorIndex.build(3, VECS).search(np.stack([VECS[1], VECS[2]]), k=10)] == [3, 3]
    assert VectorIndex.build(3, {}).search(np.stack([VECS[1], VECS[2]]), k=2) == [[], []]


def test_replace_moves_a_vector() -> None:
    index = VectorIndex.build(3, VECS)
    index.replace([1, 2], {1: unit(0, 0, 1)})
    assert len(index) == 2
    assert index.search(unit(0, 0, 1)[None, :], k=1)[0][0][0] == 1


def test_open_round_trip_and_recovery_reasons(tmp_path: Path) -> None:
    index, reason = VectorIndex.open(tmp_path, 3, {}, generation=0)
    assert reason is None and len(index) == 0  # a new bank: nothing to recover
    _, reason = VectorIndex.open(tmp_path, 3, VECS, generation=1)
    assert reason is not None and "missing" in reason
    VectorIndex.build(3, VECS).save(tmp_path, 5, VECS)
    meta = json.loads((tmp_path / INDEX_META_FILE).read_text())
    assert {k: meta[k] for k in ("generation", "count", "dim")} == {"generation": 5, "count": 3, "dim": 3}
    assert meta["checksum"] == vector_index.file_digest(tmp_path / INDEX_FILE)
    assert meta["rows"] == vector_index.rows_digest(VECS)
    index, reason = VectorIndex.open(tmp_path, 3, VECS, generation=5)
    assert reason is None and len(index) == 3
    _, reason = VectorIndex.open(tmp_path, 3, VECS, generation=6)
    assert reason is not None and "out of date" in reason
    (tmp_path / INDEX_FILE).write_bytes(b"garbage")
    index, reason = VectorIndex.open(tmp_path, 3, VECS, generation=5)
    assert reason is not None and str(tmp_path) in reason and len(index) == 3


def _big(seed: int, n: int = 200, dim: int = 16) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    v = rng.normal(size=(n, dim)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    return {i + 1: v[i] for i in range(n)}


def test_damaged_bytes_that_usearch_would_load_are_never_trusted(tmp_path: Path) -> None:
    # Random bytes over part of the graph: usearch's loader accepts this file (it has no checksum
    # of its own), and searching such a graph can return wrong neighbours or crash.
    vecs = _big(0)
    VectorIndex.build(16, vecs).save(tmp_path, 1, vecs)
    raw = bytearray((tmp_path / INDEX_FILE).read_bytes())
    raw[80:200] = np.random.default_rng(1).integers(0, 256, 120, dtype=np.uint8).tobytes()
    (tmp_path / INDEX_FILE).write_bytes(bytes(raw))
    index, reason = VectorIndex.open(tmp_path, 16, vecs, generation=1)
    assert reason is not None and "checksum" in reason
    q = np.stack([vecs[7], vecs[150]])
    assert [hits[0][0] for hits in index.search(q, k=1)] == [7, 150]


def test_an_index_saved_for_other_rows_is_rebuilt(tmp_path: Path) -> None:
    # Same generation, count and dim (e.g. the index files of another bank, or of a database
    # restored from a backup): only the rows digest tells them apart.
    mine, theirs = _big(0), _big(1)
    VectorIndex.build(16, theirs).save(tmp_path, 3, theirs)
    index, reason = VectorIndex.open(tmp_path, 16, mine, generation=3)
    assert reason is not None and "other rows" in reason
    assert index.search(mine[42][None, :], k=1)[0][0][0] == 42


def test_an_index_without_checksum_is_rebuilt_once(tmp_path: Path) -> None:
    VectorIndex.build(3, VECS).save(tmp_path, 2, VECS)
    (tmp_path / INDEX_META_FILE).write_text(json.dumps({"generation": 2, "count": 3, "dim": 3}))  # an older version's
    _, reason = VectorIndex.open(tmp_path, 3, VECS, generation=2)
    assert reason is not None and "no checksum" in reason


def test_loaded_vectors_are_compared_with_the_database(tmp_path: Path) -> None:
    vecs = _big(0, n=40)
    other = dict(vecs)
    other[40] = -vecs[40]  # the last id: the sample always holds the first and the last
    VectorIndex.build(16, other).save(tmp_path, 1, vecs)  # saved with the wrong vector for id 40
    _, reason = VectorIndex.open(tmp_path, 16, vecs, generation=1)
    assert reason is not None and "other vectors" in reason


def test_docstring_examples_run() -> None:
    result = doctest.testmod(vector_index)
    assert result.attempted > 0 and result.failed == 0
