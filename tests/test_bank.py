import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from crl_gym.experience.bank import (
    INDEX_FILE,
    INDEX_META_FILE,
    LOCK_FILE,
    BankCorruptError,
    BankEmbedderError,
    BankLockedError,
    ExperienceBank,
    PendingAdd,
    PendingUpdate,
)
from crl_gym.experience.embedders import HashingEmbedder
from crl_gym.experience.entry import ExperienceEntry
from crl_gym.protocol import ExtractorSample

DIM = 32
EMB = HashingEmbedder(DIM)


def vec(text: str) -> np.ndarray:
    return EMB.encode([text])[0]


def got(bank: ExperienceBank, id_: int) -> ExperienceEntry:
    """``bank.get(id_)``, which must exist."""
    e = bank.get(id_)
    assert e is not None, id_
    return e


def fill(bank: ExperienceBank, n: int) -> list[int]:
    return [bank.add(f"tip number {i} about {'doors' if i % 2 else 'keys'}", vec(f"tip {i}"),
                     created_step=i, tags=("t",)) for i in range(n)]


def test_every_operation_in_memory() -> None:
    bank = ExperienceBank(None, DIM)
    assert len(bank) == 0 and bank.search(vec("x")[None], 3) == [[]]
    sample = ExtractorSample("prompt", "ADD: hug walls", [-0.5], [4], [1, 2], 3)
    a = bank.add("hug the walls in a maze", vec("hug the walls in a maze"), created_step=2,
                 tags=("maze",), provenance=sample)
    b = bank.add("pick up the key first", vec("pick up the key first"))
    assert (a, b) == (1, 2) and len(bank) == 2 and bank.ids() == [1, 2] and a in bank
    e = got(bank, a)
    assert e.text == "hug the walls in a maze" and e.created_step == 2 and e.tags == ("maze",)
    assert e.provenance == sample and e.version == 0 and e.last_trained_step == -1
    hits = bank.search(np.stack([vec("pick up the key first"), vec("hug the walls in a maze")]), 1)
    assert hits[0][0][0] == b and hits[1][0][0] == a and hits[0][0][1] == pytest.approx(1.0)
    u = bank.update(a, "hug the left wall", vec("hug the left wall"))
    assert u.version == 1 and u.history == ["hug the walls in a maze"] and u.provenance == sample
    assert bank.search(vec("hug the left wall")[None], 1)[0][0][0] == a
    bank.record_retrieval([a, a, b, 999], now=5.0)
    bank.record_training([b], step=7)
    bank.set_utility(b, 0.75)
    ea, eb = got(bank, a), got(bank, b)
    assert (ea.retrieval_count, ea.last_retrieved) == (2, 5.0)
    assert (eb.train_count, eb.last_trained_step, eb.utility) == (1, 7, 0.75)
    bank.delete(a)
    assert bank.get(a) is None and len(bank) == 1 and [e.id for e in bank] == [b]
    assert bank.search(vec("hug the left wall")[None], 5)[0] == [(b, pytest.approx(
        bank.search(vec("hug the left wall")[None], 5)[0][0][1]))]
    assert bank.add("new", vec("new")) == 3  # ids are never reused
    with pytest.raises(KeyError):
        bank.delete(a)
    with pytest.raises(KeyError):
        bank.set_utility(a, 1.0)


def test_returned_entries_are_copies() -> None:
    bank = ExperienceBank(None, DIM)
    i = bank.add("x", vec("x"))
    e = got(bank, i)
    e.history.append("mutated")
    e.retrieval_count = 99
    assert got(bank, i).history == [] and got(bank, i).retrieval_count == 0
    with pytest.raises(ValueError):
        e.embedding[0] = 1.0  # type: ignore[index]  # stored vectors are read-only


def test_apply_batch_is_atomic() -> None:
    bank = ExperienceBank(None, DIM)
    ids = fill(bank, 3)
    before = [e.to_dict() for e in bank]
    gen = bank.generation
    with pytest.raises(KeyError, match="999"):
        bank.apply_batch(adds=[PendingAdd("a", vec("a"))],
                         updates=[PendingUpdate(ids[0], "u", vec("u")), PendingUpdate(999, "v", vec("v"))])
    with pytest.raises(ValueError, match=r"adds\[1\].*dim 5.*32"):
        bank.apply_batch(adds=[PendingAdd("a", vec("a")), PendingAdd("b", np.ones(5))])
    assert [e.to_dict() for e in bank] == before and bank.generation == gen
    new = bank.apply_batch(adds=[{"text": "n1", "embedding": vec("n1")}, PendingAdd("n2", vec("n2"))],
                           updates=[PendingUpdate(ids[0], "u", vec("u"))], deletes=[ids[1]])
    assert new == [4, 5] and bank.ids() == [1, 3, 4, 5] and got(bank, 1).text == "u"


def test_bad_vectors_and_queries() -> None:
    bank = ExperienceBank(None, DIM)
    with pytest.raises(ValueError, match="non-zero"):
        bank.add("z", np.zeros(DIM))
    with pytest.raises(ValueError, match="finite"):
        bank.add("z", np.full(DIM, np.nan))
    with pytest.raises(ValueError, match=r"expected \(n, 32\)"):
        bank.search(np.ones((2, 3)), 1)
    with pytest.raises(ValueError, match="k must be"):
        bank.search(np.ones((1, DIM)), 0)
    with pytest.raises(ValueError, match="dim"):
        ExperienceBank(None, 0)


def test_persistence_and_index_rebuild(tmp_path: Path) -> None:
    d = tmp_path / "bank"
    with ExperienceBank(d, DIM) as bank:
        ids = fill(bank, 20)
        bank.update(ids[3], "changed", vec("changed"))
        bank.record_training([ids[5]], 11)
        q = vec("tip 7")[None]
        expect = bank.search(q, 5)
    assert (d / INDEX_FILE).exists()
    with ExperienceBank(d, DIM) as bank:
        assert bank.index_recoveries == [] and len(bank) == 20
        assert bank.search(q, 5) == expect
        assert got(bank, ids[3]).history == ["tip number 3 about doors"]
        assert got(bank, ids[5]).train_count == 1
    # missing index -> rebuilt from SQLite
    (d / INDEX_FILE).unlink()
    with ExperienceBank(d, DIM) as bank:
        assert "missing" in bank.index_recoveries[0] and bank.search(q, 5) == expect
    # an index that does not match the database (written before later changes)
    stale = (d / INDEX_FILE).read_bytes(), (d / INDEX_META_FILE).read_text()
    with ExperienceBank(d, DIM) as bank:
        bank.delete(ids[7])
    (d / INDEX_FILE).write_bytes(stale[0])
    (d / INDEX_META_FILE).write_text(stale[1])
    with ExperienceBank(d, DIM) as bank:
        assert "out of date" in bank.index_recoveries[0]
        assert ids[7] not in [i for i, _ in bank.search(q, 5)[0]]


@pytest.mark.parametrize("damage", ["garbage", "truncate", "meta"])
def test_corrupt_index_is_recovered_from_sqlite(tmp_path: Path, damage: str) -> None:
    d = tmp_path / "bank"
    with ExperienceBank(d, DIM) as bank:
        fill(bank, 10)
        expect = bank.search(vec("tip 2")[None], 3)
    f = d / (INDEX_META_FILE if damage == "meta" else INDEX_FILE)
    data = f.read_bytes()
    f.write_bytes(b"\x00garbage" * 10 if damage != "truncate" else data[: len(data) // 2])
    with ExperienceBank(d, DIM) as bank:
        assert len(bank.index_recoveries) == 1 and str(d) in bank.index_recoveries[0]
        assert bank.search(vec("tip 2")[None], 3) == expect


@pytest.mark.parametrize("damage", ["garbage", "truncate"])
def test_corrupt_database_names_the_file(tmp_path: Path, damage: str) -> None:
    d = tmp_path / "bank"
    with ExperienceBank(d, DIM) as bank:
        fill(bank, 200)  # several pages, so truncation cuts real data
    db = d / "bank.sqlite"
    data = db.read_bytes()
    db.write_bytes(b"this is not sqlite" * 100 if damage == "garbage" else data[: len(data) // 3])
    for extra in ("bank.sqlite-wal", "bank.sqlite-shm"):
        (d / extra).unlink(missing_ok=True)
    with pytest.raises(BankCorruptError, match="bank.sqlite"):
        ExperienceBank(d, DIM)


def test_wrong_dimension_names_both_sizes(tmp_path: Path) -> None:
    with ExperienceBank(tmp_path, DIM) as bank:
        fill(bank, 1)
    with pytest.raises(ValueError, match=r"dim 32.*dim 64"):
        ExperienceBank(tmp_path, 64)


def test_jsonl_roundtrip_and_errors(tmp_path: Path) -> None:
    src = ExperienceBank(None, DIM)
    ids = fill(src, 5)
    src.update(ids[0], "v2", vec("v2"), provenance=ExtractorSample("p", "r", [-1.0]))
    src.record_retrieval([ids[1]], 3.0)
    f = tmp_path / "bank.jsonl"
    assert src.export_jsonl(f) == 5
    dst = ExperienceBank(tmp_path / "dst", DIM)
    assert dst.import_jsonl(f) == 5
    assert list(dst) == list(src)
    assert dst.add("after import", vec("after")) == 6  # next id continues after imported ids
    lines = f.read_text().splitlines()
    bad = json.loads(lines[2])
    bad["embedding"] = [1.0, 2.0]
    lines[2] = json.dumps(bad)
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n{not json\n")
    fresh = ExperienceBank(None, DIM)
    with pytest.raises(ValueError, match=r"bad.jsonl:3: .*dim 2.*32"):
        fresh.import_jsonl(tmp_path / "bad.jsonl")
    assert len(fresh) == 0  # all or nothing


def test_concurrent_readers_and_writers_no_lost_update_no_torn_read() -> None:
    bank = ExperienceBank(None, DIM)
    pair = [bank.add("start", vec("a")), bank.add("start", vec("b"))]
    stop = threading.Event()
    torn: list[object] = []
    reads: list[int] = [0]
    errors: list[Exception] = []

    def writer(w: int) -> None:
        try:
            for n in range(40):
                # both entries change together in one batch: readers must see both or neither
                bank.apply_batch(updates=[PendingUpdate(i, f"w{w}-{n}", vec(f"w{w}-{n}")) for i in pair])
                bank.add(f"writer {w} item {n}", vec(f"writer {w} item {n}"))
        except Exception as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    def reader() -> None:
        while not stop.is_set():
            with bank.lock.read():
                a, b = got(bank, pair[0]), got(bank, pair[1])
                n_entries = len(bank)
            if (a.version, a.text) != (b.version, b.text):
                torn.append((a.text, b.text))
            snap = {e.id: e for e in bank}
            if snap[pair[0]].text != snap[pair[1]].text:
                torn.append("iter")
            bank.search(vec("writer")[None], 3)
            reads[0] += 1
            assert n_entries >= 2

    rs = [threading.Thread(target=reader) for _ in range(3)]
    ws = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in rs + ws:
        t.start()
    for t in ws:
        t.join()
    stop.set()
    for t in rs:
        t.join()
    assert not errors and not torn and reads[0] > 0
    assert len(bank) == 2 + 4 * 40  # no lost add
    assert got(bank, pair[0]).version == 4 * 40  # no lost update
    assert len(got(bank, pair[0]).history) == 160


KILL_SCRIPT = textwrap.dedent("""
    import sys
    from crl_gym.experience.bank import ExperienceBank
    from crl_gym.experience.embedders import HashingEmbedder
    emb = HashingEmbedder(32)
    bank = ExperienceBank(sys.argv[1], 32)
    i = 0
    while True:
        eid = bank.add(f"entry {i}", emb.encode([f"entry {i}"])[0], created_step=i)
        if i % 3 == 0:
            bank.update(eid, f"entry {i} v2", emb.encode([f"entry {i} v2"])[0])
        bank.record_training([eid], i)
        print(f"ack {eid} {i}", flush=True)
        i += 1
""")


def test_kill_and_reopen_keeps_acknowledged_writes(tmp_path: Path) -> None:
    d = tmp_path / "bank"
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(d)], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    acked: list[tuple[int, int]] = []
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            _, eid_s, i_s = line.split()
            acked.append((int(eid_s), int(i_s)))
            if len(acked) >= 60:
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert len(acked) == 60
    with ExperienceBank(d, DIM) as bank:
        assert bank.index_recoveries  # the index was never saved: rebuilt from SQLite
        for eid, i in acked:
            e = bank.get(eid)
            assert e is not None, eid
            assert e.text == (f"entry {i} v2" if i % 3 == 0 else f"entry {i}")
            assert e.train_count == 1 and e.last_trained_step == i
        hit = bank.search(EMB.encode(["entry 5"]), 1)[0][0][0]
        assert got(bank, hit).text == "entry 5"


# ------------------------------------------------------------------------ one writer per directory
def _snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}


def test_a_second_open_in_this_process_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    d = tmp_path / "bank"
    first = ExperienceBank(d, DIM)
    fill(first, 3)
    first.flush()
    assert (d / LOCK_FILE).read_text().strip() == str(os.getpid())
    before = _snapshot(d)
    (tmp_path / "alias").symlink_to(d)
    for path in (d, tmp_path / "alias"):  # the same directory under another name
        with pytest.raises(BankLockedError, match=rf"bank .*{path.name} is locked by PID {os.getpid()}; .*close the other"):
            ExperienceBank(path, DIM)
    assert _snapshot(d) == before
    assert first.add("still writable", vec("still")) == 4  # the first bank is unaffected
    first.close()
    with ExperienceBank(d, DIM) as again:  # released on close
        assert len(again) == 4
    a, b = ExperienceBank(None, DIM), ExperienceBank(None, DIM)  # in memory: nothing to lock
    assert a.add("x", vec("x")) == b.add("y", vec("y")) == 1


def test_a_failed_open_releases_the_lock(tmp_path: Path) -> None:
    with ExperienceBank(tmp_path, DIM) as bank:
        fill(bank, 1)
    with pytest.raises(ValueError, match="dim 32"):
        ExperienceBank(tmp_path, 64)
    with ExperienceBank(tmp_path, DIM) as bank:
        assert len(bank) == 1


HOLD_SCRIPT = textwrap.dedent("""
    import sys
    from crl_gym.experience.bank import ExperienceBank
    bank = ExperienceBank(sys.argv[1], 32)
    print("open", flush=True)
    sys.stdin.readline()
""")


def test_another_process_holding_the_bank_is_named_until_it_exits(tmp_path: Path) -> None:
    d = tmp_path / "bank"
    proc = subprocess.Popen([sys.executable, "-c", HOLD_SCRIPT, str(d)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "open"
        with pytest.raises(BankLockedError, match=f"locked by PID {proc.pid};"):
            ExperienceBank(d, DIM)
    finally:
        proc.send_signal(signal.SIGKILL)  # no close(): the OS releases the lock with the process
        proc.wait()
    with ExperienceBank(d, DIM) as bank:
        assert len(bank) == 0


# ------------------------------------------------------------------------ bank files
def test_a_zero_length_database_is_an_error_never_a_new_empty_bank(tmp_path: Path) -> None:
    d = tmp_path / "bank"
    with ExperienceBank(d, DIM) as bank:
        fill(bank, 12)
    (d / "bank.sqlite").write_bytes(b"")
    with pytest.raises(BankCorruptError, match=r"bank.sqlite is empty \(0 bytes\).*Restore bank.sqlite"):
        ExperienceBank(d, DIM)
    assert (d / "bank.sqlite").stat().st_size == 0  # nothing was created over it
    ExperienceBank(d / "fresh", DIM).close()  # a directory without a database still starts a bank


def test_a_foreign_sqlite_file_is_refused_and_left_alone(tmp_path: Path) -> None:
    d = tmp_path / "bank"
    d.mkdir()
    with sqlite3.connect(d / "bank.sqlite") as db:
        db.execute("CREATE TABLE users (name TEXT)")
        db.execute("INSERT INTO users VALUES ('ada')")
    db.close()
    before = (d / "bank.sqlite").read_bytes()
    with pytest.raises(BankCorruptError, match=r"bank.sqlite: an SQLite database, but not an experience bank \(its tables: users\)"):
        ExperienceBank(d, DIM)
    assert (d / "bank.sqlite").read_bytes() == before


def test_a_wal_without_its_database_is_refused(tmp_path: Path) -> None:
    d, other = tmp_path / "bank", tmp_path / "other"
    other.mkdir()
    with ExperienceBank(d, DIM) as bank:
        fill(bank, 3)  # committed to the WAL, not yet checkpointed into bank.sqlite
        shutil.copy(d / "bank.sqlite-wal", other / "bank.sqlite-wal")
    with pytest.raises(BankCorruptError, match=r"bank.sqlite is missing but bank.sqlite-wal is there"):
        ExperienceBank(other, DIM)
    assert not (other / "bank.sqlite").exists()


def test_create_false_refuses_a_directory_without_a_bank(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no bank here"):
        ExperienceBank(tmp_path / "gone", DIM, create=False)
    with ExperienceBank(tmp_path / "here", DIM) as bank:
        fill(bank, 1)
    with ExperienceBank(tmp_path / "here", DIM, create=False) as bank:
        assert len(bank) == 1


def test_a_bank_written_before_the_format_mark_still_opens(tmp_path: Path) -> None:
    d = tmp_path / "bank"
    with ExperienceBank(d, DIM) as bank:
        ids = fill(bank, 4)
    with sqlite3.connect(d / "bank.sqlite") as db:
        db.execute("DELETE FROM meta WHERE key IN ('format', 'embedder')")
    db.close()
    with ExperienceBank(d, DIM, embedder_name="hashing:32") as bank:
        assert bank.ids() == ids
    with ExperienceBank(d, DIM) as bank:
        assert bank.embedder_name == "hashing:32"  # recorded on that open


def test_the_index_of_another_bank_is_never_used(tmp_path: Path) -> None:
    # Two banks with the same generation, size and dim: the index files of one copied into the
    # other (a restore that mixed two backups) must not answer for it.
    a, b = tmp_path / "a", tmp_path / "b"
    with ExperienceBank(a, DIM) as bank:
        for i in range(20):
            bank.add(f"alpha fact {i}", vec(f"alpha fact {i}"))
    with ExperienceBank(b, DIM) as bank:
        for i in range(20):
            bank.add(f"beta rule {i * 7} of the zone", vec(f"beta rule {i * 7} of the zone"))
        q = vec("beta rule 63 of the zone")[None]
        expect = bank.search(q, 3)
    for name in (INDEX_FILE, INDEX_META_FILE):
        shutil.copy(a / name, b / name)
    with ExperienceBank(b, DIM) as bank:
        assert len(bank.index_recoveries) == 1
        assert bank.search(q, 3) == expect
        assert got(bank, expect[0][0][0]).text == "beta rule 63 of the zone"


def test_damaged_index_bytes_are_detected_before_loading(tmp_path: Path) -> None:
    d = tmp_path / "bank"
    with ExperienceBank(d, DIM) as bank:
        fill(bank, 200)
        q = np.stack([vec("tip 3"), vec("tip 150")])
        expect = bank.search(q, 4)
    raw = bytearray((d / INDEX_FILE).read_bytes())
    raw[80:200] = bytes(range(120))  # usearch itself loads this file without complaint
    (d / INDEX_FILE).write_bytes(bytes(raw))
    with ExperienceBank(d, DIM) as bank:
        assert len(bank.index_recoveries) == 1 and "checksum" in bank.index_recoveries[0]
        found = bank.search(q, 4)
        # the rebuilt index answers for the right rows: each hit's score is its entry's true cosine
        # (HNSW is approximate, so a rebuild may rank near-ties differently), and the best hit is exact
        for row, hits, before in zip(q, found, expect, strict=True):
            assert hits[0] == before[0]
            for id_, score in hits:
                assert score == pytest.approx(float(row @ vec(f"tip {id_ - 1}")), abs=1e-5)


def test_another_embedder_of_the_same_dim_is_refused_naming_both(tmp_path: Path) -> None:
    d = tmp_path / "bank"
    with ExperienceBank(d, DIM, embedder_name="hashing:32") as bank:
        fill(bank, 2)
    with pytest.raises(BankEmbedderError, match=r"created with embedding dim 32 \(embedder 'hashing:32'\), "
                                                 r"but dim 32 \(embedder 'my-minilm-32'\) was requested"):
        ExperienceBank(d, DIM, embedder_name="my-minilm-32")
    with pytest.raises(BankEmbedderError, match=r"dim 32 \(embedder 'hashing:32'\).*dim 64 \(embedder 'hashing:64'\)"):
        ExperienceBank(d, 64, embedder_name="hashing:64")
    # the same model under its hub id and under a local directory of that name
    with ExperienceBank(tmp_path / "st", DIM, embedder_name="sentence-transformers/all-MiniLM-L6-v2"):
        pass
    ExperienceBank(tmp_path / "st", DIM, embedder_name="all-MiniLM-L6-v2").close()
    with ExperienceBank(d, DIM) as bank:  # no name given: no check, the recorded one is reported
        assert bank.embedder_name == "hashing:32"


def test_backup_of_an_open_bank_is_a_consistent_bank(tmp_path: Path) -> None:
    d = tmp_path / "bank"
    bank = ExperienceBank(d, DIM)
    try:
        ids = fill(bank, 30)
        bank.record_retrieval(ids[:3], 5.0, persist=False)  # counters still only in memory
        q = vec("tip 9")[None]
        expect = bank.search(q, 3)
        target = bank.backup(tmp_path / "backup")
        assert not (target / "bank.sqlite-wal").exists() or (target / "bank.sqlite-wal").stat().st_size == 0
        with pytest.raises(FileExistsError):
            bank.backup(target)
        bank.add("after the backup", vec("after"))
    finally:
        bank.close()
    with ExperienceBank(target, DIM) as copy:
        assert copy.ids() == ids and copy.index_recoveries == []
        assert copy.search(q, 3) == expect
        assert got(copy, ids[0]).retrieval_count == 1


def test_non_finite_or_empty_entry_fields_are_refused(tmp_path: Path) -> None:
    bank = ExperienceBank(None, DIM)
    (eid,) = fill(bank, 1)
    with pytest.raises(ValueError, match=r"utility must be a finite number, got nan"):
        bank.set_utility(eid, float("nan"))
    with pytest.raises(ValueError, match=r"adds\[0\]: text must be a non-empty string"):
        bank.add("   ", vec("x"))
    with pytest.raises(ValueError, match=r"updates\[0\]: text must be a non-empty string"):
        bank.update(eid, "", vec("x"))
    with pytest.raises(ValueError, match=r"now must be a finite number"):
        bank.record_retrieval([eid], float("inf"))
    assert got(bank, eid).utility == 0.0 and got(bank, eid).retrieval_count == 0
    f = tmp_path / "b.jsonl"
    bank.export_jsonl(f)
    row = json.loads(f.read_text())
    row["utility"] = float("nan")
    (tmp_path / "nan.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"nan.jsonl:1: field 'utility' must be a finite number, got nan"):
        ExperienceBank(None, DIM).import_jsonl(tmp_path / "nan.jsonl")


# ------------------------------------------------------------------ copies of one text share one vector

def nudged(v: np.ndarray, k: int) -> np.ndarray:
    """``v`` one ulp apart in component ``k``: the same text embedded in another batch."""
    out = v.copy()
    out[k] = np.nextafter(out[k], np.float32(2.0))
    return out


def test_copies_of_one_text_are_stored_with_the_vector_it_has() -> None:
    bank = ExperienceBank(None, DIM)
    v = vec("hug the left wall")
    a = bank.add("hug the left wall", v)
    b, c = bank.apply_batch([PendingAdd("hug the left wall", nudged(v, 0), 0), PendingAdd("go east", vec("go east"), 0)])
    d = bank.apply_batch([PendingAdd("go east", nudged(vec("go east"), 1), 0),
                          PendingAdd("go east", nudged(vec("go east"), 2), 0)])[0]
    assert np.array_equal(got(bank, b).embedding, v) and np.array_equal(got(bank, d).embedding, got(bank, c).embedding)
    assert bank._index.keys == 2 and len(bank) == 5
    # an update to a text the bank holds takes its vector; the holder's deletion leaves the copies theirs
    bank.update(c, "hug the left wall", nudged(v, 3))
    bank.delete(a)
    e = bank.add("hug the left wall", nudged(v, 4))
    assert all(np.array_equal(got(bank, i).embedding, v) for i in (b, c, e))
    assert sorted(i for i, _ in bank.search(v, 3)[0]) == [b, c, e]


def test_a_bank_written_before_copies_shared_a_vector_opens_with_them_shared(tmp_path: Path) -> None:
    from crl_gym.experience.store import SQLiteStore

    v = vec("hug the left wall")
    store = SQLiteStore(tmp_path / "bank.sqlite")
    store.commit([ExperienceEntry(id=1, text="hug the left wall", embedding=v),
                  ExperienceEntry(id=2, text="hug the left wall", embedding=nudged(v, 0)),
                  ExperienceEntry(id=3, text="go east", embedding=vec("go east"))], [], {"next_id": 4, "generation": 1})
    store.close()
    bank = ExperienceBank(tmp_path, DIM)
    try:
        assert np.array_equal(got(bank, 2).embedding, v) and bank._index.keys == 2
        assert sorted(i for i, _ in bank.search(v, 2)[0]) == [1, 2]
    finally:
        bank.close()
