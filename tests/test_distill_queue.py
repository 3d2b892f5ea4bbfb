import json

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
