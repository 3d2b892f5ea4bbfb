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


# ------------------------------------------------------------------ one key per distinct vector

def test_ids_of_one_vector_share_a_key_and_are_all_found() -> None:
    index = VectorIndex.build(3, {**VECS, 7: VECS[1].copy(), 5: VECS[1].copy()})
    assert (len(index), index.keys) == (5, 3)
    [hits] = index.search(VECS[1][None, :], k=4)
    assert [i for i, _ in hits] == [1, 5, 7, 3]  # the copies in id order, each with the copy's score
    assert np.allclose([s for _, s in hits], [1.0, 1.0, 1.0, 2**-0.5], atol=1e-5)
    assert [i for i, _ in index.search(VECS[1][None, :], k=2)[0]] == [1, 5]  # k ids, not k keys


def test_removing_the_key_id_rekeys_its_copies_and_the_last_copy_removes_the_key() -> None:
    index = VectorIndex.build(3, {**VECS, 5: VECS[1].copy()})
    index.replace([1], {})  # the key of the copy pair: 5 takes over
    assert (len(index), index.keys) == (3, 3)
    assert index.search(VECS[1][None, :], k=1)[0][0][0] == 5
    index.replace([5], {})
    assert (len(index), index.keys) == (2, 2)
    assert [i for i, _ in index.search(VECS[1][None, :], k=3)[0]] == [3, 2]
    index.replace([], {9: VECS[2].copy()})  # a copy of 2 arriving later
    index.replace([2], {2: VECS[3].copy()})  # 2 moves to 3's vector: 9 keys 2's old one
    assert (len(index), index.keys) == (3, 2)
    assert [i for i, _ in index.search(VECS[3][None, :], k=3)[0]] == [2, 3, 9]


def test_random_replaces_agree_with_exact_search() -> None:
    """Any sequence of replaces: each id is found with its own vector's score (checked by brute force)."""
    rng = np.random.default_rng(0)
    pool = [unit(*rng.normal(size=3)) for _ in range(6)]  # few vectors: many ids share each
    index, truth = VectorIndex.build(3, {}), {}
    for _ in range(300):
        remove = [int(i) for i in rng.choice(list(truth), size=min(len(truth), int(rng.integers(0, 3))), replace=False)]
        add = {int(i): pool[int(rng.integers(len(pool)))].copy() for i in rng.integers(1, 40, size=int(rng.integers(0, 4)))}
        index.replace(remove, add)
        for i in remove:
            truth.pop(i)
        truth.update(add)
        assert (len(index), index.keys) == (len(truth), len({v.tobytes() for v in truth.values()}))
    q = unit(1, 2, 3)
    [hits] = index.search(q[None, :], k=len(truth))
    assert sorted(i for i, _ in hits) == sorted(truth)
    assert all(abs(s - float(truth[i] @ q)) < 1e-5 for i, s in hits)


def test_an_index_with_copies_reopens_without_a_rebuild_and_an_old_one_is_rebuilt(tmp_path: Path) -> None:
    rows = {**VECS, 5: VECS[1].copy()}
    VectorIndex.build(3, rows).save(tmp_path, 1, rows)
    index, why = VectorIndex.open(tmp_path, 3, rows, 1)
    assert why is None and (len(index), index.keys) == (4, 3)
    assert [i for i, _ in index.search(VECS[1][None, :], k=2)[0]] == [1, 5]
    # a file written with a key per id (before copies shared one): it does not match, so it is rebuilt
    old = VectorIndex.build(3, VECS)
    old._index.add(np.asarray([5], dtype=np.uint64), VECS[1][None, :])
    old.save(tmp_path, 1, rows)
    meta = json.loads((tmp_path / INDEX_META_FILE).read_text())
    (tmp_path / INDEX_META_FILE).write_text(json.dumps({**meta, "count": 4}))  # it counted usearch keys: ids then
    index, why = VectorIndex.open(tmp_path, 3, rows, 1)
    assert why is not None and "does not match" in why and index.keys == 3


ONE_HOT = {i: np.eye(32, dtype=np.float32)[i - 1] for i in range(1, 31)}
"""30 orthogonal vectors: a query orthogonal to them all (the 32nd axis) ties with every one."""
AXIS_32 = np.eye(32, dtype=np.float32)[31][None, :]


def _answers(index: VectorIndex) -> list[list[list[tuple[int, float]]]]:
    queries = np.stack([AXIS_32[0], unit(*[1.0] * 32), ONE_HOT[7] + ONE_HOT[9]])
    return [index.search(queries, k) for k in (1, 5, 30)]


def test_equal_similarities_come_in_id_order_and_the_k_best_are_the_smallest_ids() -> None:
    # usearch alone orders a tie by the key's slot (here the last written first) and cuts the k best
    # wherever its slots put them
    index = VectorIndex.build(32, {})
    for i, v in ONE_HOT.items():
        index.replace([], {i: v})
    [hits] = index.search(AXIS_32, k=5)
    assert hits == [(1, 0.0), (2, 0.0), (3, 0.0), (4, 0.0), (5, 0.0)]
    # cos((e7 + e9) / |.|, e7) = cos(., e9) = 1/sqrt 2: the tie at the top too, then the zeros from id 1
    [hits] = index.search(unit(*(1.0 if j in (6, 8) else 0.0 for j in range(32)))[None, :], k=4)
    assert [i for i, _ in hits] == [7, 9, 1, 2]


def test_an_index_answers_the_same_whatever_order_its_vectors_were_written_in() -> None:
    """Slots differ with the history of writes (one batch, one by one backwards, removed and written
    again); the answers are a function of the rows alone."""
    batch = VectorIndex.build(32, ONE_HOT)
    backwards = VectorIndex.build(32, {})
    for i in sorted(ONE_HOT, reverse=True):
        backwards.replace([], {i: ONE_HOT[i]})
    rewritten = VectorIndex.build(32, ONE_HOT)
    rewritten.replace(list(range(1, 16)), {})
    rewritten.replace([], {i: ONE_HOT[i] for i in range(15, 0, -1)})
    want = _answers(batch)
    assert _answers(backwards) == want and _answers(rewritten) == want
    assert [i for i, _ in want[1][0]] == [1, 2, 3, 4, 5]
