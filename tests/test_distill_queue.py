import json
import os

import pytest

from crl_gym.experience.distill_queue import DistillQueue
from crl_gym.protocol import DistillationRequest, ExperienceRef, Trajectory


def req(i):
    return DistillationRequest(f"task {i}", Trajectory(), float(i), bool(i % 2),
                               ExperienceRef(i, f"tip {i}", 1) if i % 3 == 0 else None,
                               condition="guided" if i % 3 == 0 else "free", request_id=f"r{i}")


def test_fifo_across_memory_and_spill(tmp_path):
    f = tmp_path / "pending.jsonl"
    q = DistillQueue(maxsize=2, spill_path=f)
    for i in range(5):
        q.put(req(i))
    assert len(q) == 5 and q.spilled_total == 3
    assert [r.task for r in q.get(1)] == ["task 0"]
    q.put(req(5))  # spill not drained yet: must go behind the spilled ones
    assert [r.task for r in q.get(10)] == [f"task {i}" for i in range(1, 6)]
    assert len(q) == 0 and f.stat().st_size == 0  # fully drained file is truncated
    q.close()


def test_restart_resumes_from_offset(tmp_path):
    f = tmp_path / "pending.jsonl"
    q = DistillQueue(maxsize=1, spill_path=f)
    for i in range(6):
        q.put(req(i))
    assert [r.task for r in q.get(3)] == ["task 0", "task 1", "task 2"]
    # simulate a crash: no close(), the reader's position was recorded in the offset file
    q._writer.close()
    q2 = DistillQueue(maxsize=1, spill_path=f)
    assert len(q2) == 3  # tasks 3-5 were still unread in the file
    assert [r.task for r in q2.get(10)] == ["task 3", "task 4", "task 5"]
    q2.close()


def test_close_persists_memory_in_front(tmp_path):
    f = tmp_path / "pending.jsonl"
    q = DistillQueue(maxsize=2, spill_path=f)
    for i in range(4):
        q.put(req(i))
    q.close()
    lines = [json.loads(x)["task"] for x in f.read_text().splitlines()]
    assert lines == ["task 0", "task 1", "task 2", "task 3"]
    q2 = DistillQueue(maxsize=2, spill_path=f)
    assert q2.get(10) == [req(i) for i in range(4)]
    q2.close()


def test_bad_and_partial_lines(tmp_path):
    f = tmp_path / "pending.jsonl"
    f.write_text(req(1).to_json() + "\n{broken\n" + req(2).to_json() + "\n" + '{"task": "half')
    q = DistillQueue(maxsize=10, spill_path=f)
    got = q.get(10)
    # the unterminated last line (a crash mid-write) is closed at open and counted as bad
    assert [r.task for r in got] == ["task 1", "task 2"] and q.bad_lines == 2 and len(q) == 0
    q.put(req(3))
    assert q.get(1) == [req(3)]
    q.close()


def crash(q):
    """A hard kill: nothing more of the queue runs, its file handle just goes away."""
    q._writer.close()


def failing_replace(monkeypatch, when, target=".jsonl"):
    """The next ``os.replace`` onto a file whose name ends with ``target`` dies before or after it."""
    real = os.replace

    def replace(src, dst):
        if not str(dst).endswith(target):
            return real(src, dst)
        if when == "after":
            real(src, dst)
        raise OSError(f"killed {when} the replace")

    monkeypatch.setattr(os, "replace", replace)


def test_read_ahead_requests_survive_a_crash(tmp_path):
    f = tmp_path / "pending.jsonl"
    q = DistillQueue(maxsize=2, spill_path=f)
    for i in range(6):
        q.put(req(i))
    q.get(2)
    assert [r.task for r in q.get(1)] == ["task 2"]  # task 3 was read ahead into memory
    crash(q)
    q2 = DistillQueue(maxsize=2, spill_path=f)
    assert [r.task for r in q2.get(10)] == [f"task {i}" for i in range(3, 6)]
    q2.close()


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_crash_around_the_persist_rewrite_neither_skips_nor_repeats(tmp_path, monkeypatch, when):
    f = tmp_path / "pending.jsonl"
    q = DistillQueue(maxsize=2, spill_path=f)
    for i in range(4):
        q.put(req(i))  # 0, 1 in memory; 2, 3 spilled
    assert [r.task for r in q.get(2)] == ["task 0", "task 1"]
    assert [r.task for r in q.get(1)] == ["task 2"]  # task 3 read ahead: in memory, not handed out
    q.put(req(4))  # the spill is all read: into memory, on no disk yet
    q.put(req(5))  # memory full: spilled behind the read offset
    failing_replace(monkeypatch, when)
    with pytest.raises(OSError, match="killed"):
        q.persist()  # rewrites [3, 4, 5] as a new file read from its start
    monkeypatch.undo()
    crash(q)
    q2 = DistillQueue(maxsize=2, spill_path=f)
    # after: the old offset (past task 3 of the old file) must not be applied to the new one;
    # before: task 4 never reached the disk (the persist failed), the rest is there
    want = [3, 4, 5] if when == "after" else [3, 5]
    assert [r.task for r in q2.get(10)] == [f"task {i}" for i in want]
    q2.close()


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_crash_around_the_drained_reset_neither_skips_nor_repeats(tmp_path, monkeypatch, when):
    f = tmp_path / "pending.jsonl"
    q = DistillQueue(maxsize=1, spill_path=f)
    for i in range(3):
        q.put(req(i))
    q.get(1)
    failing_replace(monkeypatch, when)
    assert [r.task for r in q.get(5)] == ["task 1", "task 2"]  # then starts a fresh file: dies there
    monkeypatch.undo()
    crash(q)
    q2 = DistillQueue(maxsize=1, spill_path=f)
    assert q2.get(10) == [] and len(q2) == 0
    q2.put(req(9))
    assert q2.get(10) == [req(9)]
    q2.close()


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_crash_around_the_close_rewrite_loses_nothing_spilled(tmp_path, monkeypatch, when):
    f = tmp_path / "pending.jsonl"
    q = DistillQueue(maxsize=2, spill_path=f)
    for i in range(5):
        q.put(req(i))
    q.get(1)
    failing_replace(monkeypatch, when)
    with pytest.raises(OSError, match="killed"):
        q.close()
    monkeypatch.undo()
    q2 = DistillQueue(maxsize=2, spill_path=f)
    want = range(1, 5) if when == "after" else range(2, 5)  # before: task 1 only ever lived in memory
    assert [r.task for r in q2.get(10)] == [f"task {i}" for i in want]
    q2.close()


def test_a_file_of_the_old_format_is_taken_over_with_its_offset(tmp_path):
    f = tmp_path / "pending.jsonl"
    lines = [req(i).to_json() + "\n" for i in range(3)]
    f.write_text("".join(lines))
    (tmp_path / "pending.jsonl.offset").write_text(str(len(lines[0].encode())))
    q = DistillQueue(maxsize=4, spill_path=f)
    assert [r.task for r in q.get(10)] == ["task 1", "task 2"]
    inode, pos = (tmp_path / "pending.jsonl.offset").read_text().split()  # now tied to the file
    assert int(inode) == f.stat().st_ino and int(pos) == f.stat().st_size
    q.close()


def test_unreadable_lines_are_moved_to_a_rejected_file(tmp_path):
    f = tmp_path / "pending.jsonl"
    f.write_text(req(1).to_json() + "\n{broken\n" + '{"task": 3}\n' + req(2).to_json() + "\n")
    q = DistillQueue(maxsize=10, spill_path=f)
    assert [r.task for r in q.get(10)] == ["task 1", "task 2"] and q.bad_lines == 2
    assert q.rejected_path == tmp_path / "pending.rejected.jsonl"
    assert q.rejected_path.read_text().splitlines() == ["{broken", '{"task": 3}']
    q.close()
    q2 = DistillQueue(maxsize=10, spill_path=f)  # nothing left, nothing rejected twice
    assert q2.get(10) == [] and q2.bad_lines == 0
    q2.close()


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_crash_at_the_offset_write_delivers_at_least_once(tmp_path, monkeypatch, when):
    f = tmp_path / "pending.jsonl"
    q = DistillQueue(maxsize=1, spill_path=f)
    for i in range(4):
        q.put(req(i))
    q.get(1)
    failing_replace(monkeypatch, when, target=".offset")
    assert [r.task for r in q.get(1)] == ["task 1"]  # handed out; its offset write dies (logged)
    monkeypatch.undo()
    crash(q)
    q2 = DistillQueue(maxsize=1, spill_path=f)
    want = range(2, 4) if when == "after" else range(1, 4)  # before: task 1 again, never one lost
    assert [r.task for r in q2.get(10)] == [f"task {i}" for i in want]
    q2.close()


def test_persisting_only_read_ahead_requests_does_not_rewrite_the_spill(tmp_path):
    f = tmp_path / "pending.jsonl"
    q = DistillQueue(maxsize=2, spill_path=f)
    for i in range(6):
        q.put(req(i))
    q.get(2)
    q.get(1)  # task 3 read ahead: on disk behind the offset
    inode = f.stat().st_ino
    assert q.persist() == 3 and f.stat().st_ino == inode  # nothing to move: fsync only
    q.close()
    assert f.stat().st_ino == inode
    q2 = DistillQueue(maxsize=2, spill_path=f)
    assert [r.task for r in q2.get(10)] == ["task 3", "task 4", "task 5"]
    q2.close()
