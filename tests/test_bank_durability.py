"""Durable-or-refused writes at the store's boundary, write ids, writers and quarantine.

The real faults (a full disk, a file-size limit) are in test_disk_faults.py; here the faults a
test machine cannot make on demand (an I/O error, a read-only file system, a failed fsync) are
raised where the bank and the queue meet the disk, and each test checks what the caller sees
and that nothing refused was applied.
"""

from __future__ import annotations

import errno
import gc
import os
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from crl_gym.errors import StorageFault
from crl_gym.experience import distill_queue
from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.distill_queue import DistillQueue
from crl_gym.experience.embedders import HashingEmbedder
from crl_gym.experience.manager import ExperienceManager
from crl_gym.experience.origin import Origin
from crl_gym.experience.service import RetrievalService
from crl_gym.experience.store import SQLiteStore
from crl_gym.protocol import AddOp, DistillationRequest, ExtractorSample, Step, Trajectory, UpdateOp
from crl_gym.server import create_app

DIM = 32


def vec(i: int) -> np.ndarray:
    v = np.zeros(DIM, np.float32)
    v[i % DIM] = 1.0
    return v


def a_request(task: str = "t") -> DistillationRequest:
    return DistillationRequest(task=task, trajectory=Trajectory(steps=[Step("o", "a", 1.0)]), outcome=1.0,
                               success=True, experience=None)


def service_over(path: Path | None) -> RetrievalService:
    return RetrievalService(ExperienceManager(ExperienceBank(path, dim=DIM), HashingEmbedder(DIM)))


@pytest.mark.parametrize(("error", "cause", "status"), [
    (sqlite3.OperationalError("disk I/O error"), "I/O error", 503),
    (sqlite3.OperationalError("attempt to write a readonly database"), "read-only file system", 503),
    (sqlite3.OperationalError("database or disk is full"), "disk full", 507),
    (OSError(errno.EROFS, "Read-only file system"), "read-only file system", 503),
])
def test_a_write_the_store_cannot_make_durable_is_refused_and_applied_nowhere(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception, cause: str, status: int) -> None:
    bank = ExperienceBank(tmp_path / "bank", dim=DIM)
    a = bank.add("go north", vec(0))
    before = (bank.ids(), bank.generation, bank.search(vec(1)[None, :], k=2))

    def fail(*args: Any, **kwargs: Any) -> None:
        raise error

    with monkeypatch.context() as m:
        m.setattr(bank._store, "commit", fail)
        for write in (lambda: bank.add("go east", vec(1)), lambda: bank.update(a, "go south", vec(2)),
                      lambda: bank.delete(a)):
            with pytest.raises(StorageFault) as got:
                write()
            assert (got.value.cause, got.value.status) == (cause, status)
            assert str(got.value).startswith(f"{cause}: writing ")
        assert (bank.ids(), bank.generation, bank.search(vec(1)[None, :], k=2)) == before
        assert bank.get(a).text == "go north"  # type: ignore[union-attr]
        assert str(bank.storage_fault).startswith(cause) and bank.storage_faults == 3
    b = bank.add("go east", vec(1))  # the fault cleared: writes go on, without reopening
    assert bank.storage_fault is None and bank.ids() == [a, b]
    bank.close()
    with ExperienceBank(tmp_path / "bank", dim=DIM) as again:
        assert [e.text for e in again] == ["go north", "go east"]


def test_the_cause_survives_a_transaction_sqlite_already_rolled_back(tmp_path: Path) -> None:
    """A full disk makes SQLite end the transaction itself: the ROLLBACK that follows has nothing
    to roll back, and its own error must not replace the cause."""
    store = SQLiteStore(tmp_path / "bank.sqlite")
    with pytest.raises(sqlite3.OperationalError, match="disk is full"), store._transaction() as c:
        c.execute("ROLLBACK")  # as SQLite does on SQLITE_FULL
        raise sqlite3.OperationalError("database or disk is full")
    store.set_meta("after", 1)  # the connection is usable
    assert store.get_meta("after") == "1"
    store.close()


def test_a_durable_put_that_fails_queues_nothing_and_leaves_no_partial_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spill = tmp_path / "pending_requests.jsonl"
    q = DistillQueue(2, spill)
    first = [a_request("a"), a_request("b"), a_request("c")]
    q.put_many(first, durable=True)
    size = spill.stat().st_size

    def no_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    with monkeypatch.context() as m:
        m.setattr(distill_queue.os, "fsync", no_fsync)
        with pytest.raises(OSError, match="Input/output"):
            q.put_many([a_request("refused")], durable=True)
    assert spill.stat().st_size == size and len(q) == 3
    q.put_many([a_request("d")], durable=True)
    # a kill now (the queue never closed): its files, as a restart finds them, hold every acknowledged request once
    restart = tmp_path / "restart"
    restart.mkdir()
    for f in (spill, spill.with_name(spill.name + ".offset")):
        (restart / f.name).write_bytes(f.read_bytes())
    again = DistillQueue(2, restart / spill.name)
    assert [r.task for r in again.get(10)] == ["a", "b", "c", "d"]
    assert [r.task for r in q.get(10)] == ["a", "b", "c", "d"]
    q.close()
    again.close()


def test_a_refused_submit_is_neither_queued_nor_recorded_and_its_resend_lands_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    service = service_over(tmp_path / "bank")
    client = TestClient(create_app(service))
    req = a_request()

    def read_only(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    with monkeypatch.context() as m:
        m.setattr(service.manager.queue, "put_many", read_only)
        r = client.post("/submit", json={"requests": [req.to_dict()]})
        assert r.status_code == 503 and r.json()["detail"].startswith("read-only file system: queueing 1 request")
        health = client.get("/health").json()
        assert health["status"] == "ok" and health["storage"].startswith("read-only file system")
    assert service.manager.pending() == 0 and service.ledger.open_requests() == 0 and service.counters["submitted"] == 0
    for _ in range(2):  # the resend lands; a second resend (its answer lost, say) is not queued again
        assert client.post("/submit", json={"requests": [req.to_dict()]}).status_code == 200
    assert client.get("/health").json()["storage"] is None
    assert service.manager.pending() == 1 and service.counters["repeated_writes"] == 1
    service.close()


def test_an_ops_write_id_is_applied_once_across_a_restart(tmp_path: Path) -> None:
    service = service_over(tmp_path / "bank")
    first = service.apply_ops([AddOp("walk east")], write_id="w-1")
    assert first.added == 1 and not first.repeated
    service.close()
    service = service_over(tmp_path / "bank")
    again = service.apply_ops([AddOp("walk east")], write_id="w-1")
    assert again.repeated and again.added_ids == first.added_ids
    assert len(service.manager.bank) == 1
    assert not service.apply_ops([AddOp("walk west")], write_id="w-2").repeated
    assert len(service.manager.bank) == 2
    service.close()


def test_every_entry_records_its_writer_and_a_quarantine_hides_it_until_undone(tmp_path: Path) -> None:
    service = service_over(tmp_path / "bank")
    manager = service.manager
    user = service.apply_ops([AddOp("Sokoban: push boxes along walls.")], step=1).added_ids[0]
    sample = ExtractorSample("prompt", "response", extractor_version=12)
    bad = manager.apply_ops([AddOp("Sokoban: always push left.")], sample=sample, step=2).added
    late = manager.apply_ops([AddOp("Sokoban: wait.")], sample=ExtractorSample("p", "r", extractor_version=30), step=3).added
    origins = manager.bank.origins([user, *bad, *late])
    assert origins[user]["written_by"] == "user" and origins[user]["step"] == 1
    assert (origins[bad[0]]["written_by"], origins[bad[0]]["model_step"]) == ("extractor", 12)
    assert origins[bad[0]]["written_at"] > 0 and not origins[bad[0]]["quarantined"]

    assert service.quarantine("extractor", (10, 20)) == bad
    assert bad[0] not in manager.bank and manager.bank.ids() == sorted([user, *late])
    found = {e.id for hits in manager.search_many(["Sokoban: always push left."], k=3) for e in hits}
    assert bad[0] not in found
    # a quarantined entry takes no writes: an Update of it is kept as a new entry, as for one deleted since
    kept = service.apply_ops([UpdateOp(bad[0], "Sokoban: push right.")])
    assert kept.updated == 0 and kept.added == 1 and bad[0] not in manager.bank
    service.close()

    service = service_over(tmp_path / "bank")  # kept across a restart, then undone
    assert bad[0] not in service.manager.bank and service.manager.bank.quarantined_count() == 1
    assert service.quarantine("extractor", (10, 20), undo=True) == bad
    assert service.manager.bank.get(bad[0]).text == "Sokoban: always push left."  # type: ignore[union-attr]
    service.close()


def test_a_merge_and_an_import_are_writers_too(tmp_path: Path) -> None:
    bank = ExperienceBank(None, dim=DIM)
    a = bank.add("go north", vec(0))
    bank.apply_batch(updates=[{"id": a, "text": "go north twice", "embedding": vec(0)}], merged={a: [a]})
    assert bank.origins([a])[a]["written_by"] == "merge"
    bank.export_jsonl(tmp_path / "bank.jsonl")
    other = ExperienceBank(None, dim=DIM)
    other.import_jsonl(tmp_path / "bank.jsonl")
    assert other.origins([a])[a]["written_by"] == "import"
    with pytest.raises(ValueError, match="written_by must be one of"):
        Origin("robot")


def test_a_bank_written_before_writers_were_kept_opens_and_gains_the_tables(tmp_path: Path) -> None:
    with ExperienceBank(tmp_path / "bank", dim=DIM) as bank:
        bank.add("go north", vec(0))
    conn = sqlite3.connect(tmp_path / "bank" / "bank.sqlite")
    conn.executescript("DROP TABLE entry_origin; DROP TABLE write_ids;")
    conn.close()
    with ExperienceBank(tmp_path / "bank", dim=DIM) as bank:
        assert [e.text for e in bank] == ["go north"] and bank.origins([1]) == {}
        assert bank.quarantine("user") == []  # nothing recorded as the user's: nothing hidden
        b = bank.add("go east", vec(1))
        assert bank.origins([b])[b]["written_by"] == "user"


def test_a_temp_spill_goes_with_its_queue() -> None:
    q = DistillQueue(1, None)
    q.put(a_request("a"))
    q.put(a_request("b"))  # spilled to the temp file
    path = q.spill_path
    assert path.exists()
    q.close()
    assert not path.exists() and not path.with_name(path.name + ".offset").exists()
    q = DistillQueue(1, None)
    path = q.spill_path
    del q
    gc.collect()
    assert not path.exists()


def test_remote_apply_ops_resends_a_refused_call_with_the_same_write_id(tmp_path: Path) -> None:
    from crl_gym.clients import RemoteClient
    from crl_gym.server import BackgroundServer

    class FullOnce(RetrievalService):
        """Refuses its first ``apply_ops`` for a full disk, as the bank would."""

        ids: list[str | None] = []

        def apply_ops(self, ops: Any, *, step: int | None = None, write_id: str | None = None) -> Any:
            self.ids.append(write_id)
            if len(self.ids) == 1:
                raise StorageFault("disk full: writing 1 entries failed", cause="disk full", status=507)
            return super().apply_ops(ops, step=step, write_id=write_id)

    service = FullOnce(ExperienceManager(ExperienceBank(tmp_path / "bank", dim=DIM), HashingEmbedder(DIM)))
    with BackgroundServer(service) as server:
        client = RemoteClient(server.url, retries=2, retry_backoff_s=0.0)
        out = client.apply_ops([AddOp("walk east")])
        assert out.added == 1 and not out.repeated
        assert len(service.ids) == 2 and service.ids[0] == service.ids[1] is not None
        refusing = RemoteClient(server.url, retries=0)
        service.ids.clear()
        with pytest.raises(StorageFault, match="disk full"):  # no retries left: the cause reaches the caller
            refusing.apply_ops([AddOp("walk west")])
        client.close()
        refusing.close()
    assert len(service.manager.bank) == 1
    service.close()


def test_a_write_rolled_back_by_a_restore_is_applied_again_when_resent(tmp_path: Path) -> None:
    service = service_over(tmp_path / "bank")
    service.snapshot_bank("empty")
    assert service.apply_ops([AddOp("walk east")], write_id="w-1").added == 1
    req = a_request()
    assert service.submit_many([req], durable=True) == 1
    service.restore_bank("empty")
    assert len(service.manager.bank) == 0 and service.manager.pending() == 0
    again = service.apply_ops([AddOp("walk east")], write_id="w-1")
    assert not again.repeated and len(service.manager.bank) == 1
    assert service.submit_many([req], durable=True) == 1 and service.manager.pending() == 1
    service.close()


def test_write_ids_are_kept_to_a_bounded_number(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from crl_gym.experience import store
    from crl_gym.experience.write_ids import WriteRecord

    monkeypatch.setattr(store, "WRITE_ID_KEEP", 200)
    s = SQLiteStore(tmp_path / "bank.sqlite")
    for k in range(10):
        s.record_writes([WriteRecord(f"w{k}-{i}", "submit") for i in range(100)])
    kept = s.conn.execute("SELECT count(*) FROM write_ids").fetchone()[0]
    assert 200 <= kept <= 300 and s.find_writes(["w9-99"]) and not s.find_writes(["w0-0"])
    s.close()


def test_a_temp_spill_left_by_a_killed_process_is_swept(tmp_path: Path) -> None:
    import subprocess
    import sys

    from crl_gym.experience.distill_queue import TEMP_PREFIX, sweep_temp_spills

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    left = tmp_path / f"{TEMP_PREFIX}{dead}_abc.jsonl"
    mine = tmp_path / f"{TEMP_PREFIX}{os.getpid()}_def.jsonl"
    other = tmp_path / "crl_pending_old.jsonl"  # no pid: not ours to judge
    for f in (left, left.with_name(left.name + ".offset"), mine, other):
        f.write_text("{}\n")
    assert sweep_temp_spills(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, other.name])
