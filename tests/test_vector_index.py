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
    VectorIndex.build(3, VECS).save(tmp_path, generation=5)
    assert json.loads((tmp_path / INDEX_META_FILE).read_text()) == {"generation": 5, "count": 3, "dim": 3}
    index, reason = VectorIndex.open(tmp_path, 3, VECS, generation=5)
    assert reason is None and len(index) == 3
    _, reason = VectorIndex.open(tmp_path, 3, VECS, generation=6)
    assert reason is not None and "out of date" in reason
    (tmp_path / INDEX_FILE).write_bytes(b"garbage")
    index, reason = VectorIndex.open(tmp_path, 3, VECS, generation=5)
    assert reason is not None and str(tmp_path) in reason and len(index) == 3


def test_docstring_examples_run() -> None:
    result = doctest.testmod(vector_index)
    assert result.attempted > 0 and result.failed == 0
