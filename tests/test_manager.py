import threading
import time

import numpy as np
import pytest

from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.config import ManagerConfig
from crl_gym.experience.embedders import HashingEmbedder
from crl_gym.experience.manager import ExperienceManager
from crl_gym.protocol import (
    AddOp,
    DeleteOp,
    DistillationRequest,
    ExtractorSample,
    ReturnOp,
    Trajectory,
    UpdateOp,
)

DIM = 64


class CountingEmbedder(HashingEmbedder):
    def __init__(self, dim=DIM, fail=False):
        super().__init__(dim)
        self.calls: list[list[str]] = []
        self.fail = fail

    def encode(self, texts):
        self.calls.append(list(texts))
        if self.fail:
            raise OSError("embedding service down")
        return super().encode(texts)


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def make(n_entries=0, config=None, clock=None, path=None, emb=None):
    emb = emb or CountingEmbedder()
    bank = ExperienceBank(path, DIM)
    mgr = ExperienceManager(bank, emb, config or ManagerConfig(), clock=clock or Clock())
    if n_entries:
        mgr.apply_ops([AddOp(f"strategy {i} for opening doors") for i in range(n_entries)])
    return mgr, bank, emb


def test_empty_bank_returns_nothing():
    mgr, _, _ = make()
    assert mgr.search("anything") == [] and mgr.search_many(["a", "b"]) == [[], []]
    mgr.close()


def test_search_finds_relevant_entry_and_updates_counts():
    clock = Clock(50.0)
    mgr, bank, _ = make(clock=clock)
    ids = mgr.apply_ops([AddOp("pick up the key then open the door"),
                         AddOp("avoid lava by walking around it")]).added
    [e] = mgr.search("how to avoid the lava", k=1)
    assert e.id == ids[1] and e.text == "avoid lava by walking around it"
    got = bank.get(ids[1])
    assert (got.retrieval_count, got.last_retrieved) == (1, 50.0)
    mgr.close()
    assert bank.get(ids[1]).retrieval_count == 1


def test_diversification_hand_computed():
    # λ = 0.5, recency window 10 s. Entries A (exact match, sim 1.0) and B (sim s_B < 1).
    clock = Clock(100.0)
    cfg = ManagerConfig(diversity_lambda=0.5, recency_window_s=10.0, overfetch=2)
    mgr, bank, emb = make(config=cfg, clock=clock)
    a, b = mgr.apply_ops([AddOp("find the stairs"), AddOp("find the stairs quickly")]).added
    q = "find the stairs"
    s_b = float(emb.encode([q])[0] @ emb.encode(["find the stairs quickly"])[0])
    assert 0.5 < s_b < 1.0
    # 1st: s(A) = 1.0 > s(B) = s_B -> A
    assert [e.id for e in mgr.search(q)] == [a]
    # 2nd (same time): s(A) = 1 - 0.5*ln 2 - 1 = -0.3466 < s(B) = s_B -> B
    assert [e.id for e in mgr.search(q)] == [b]
    # 3rd: both recent, both c = 1: s(A) = 1 - 0.3466 - 1 > s(B) = s_B - 0.3466 - 1 -> A
    assert [e.id for e in mgr.search(q)] == [a]
    # 11 s later nothing is recent: s(A) = 1 - 0.5 ln 3 = 0.4507, s(B) = s_B - 0.5 ln 2
    clock.t = 111.0
    expect = a if 1 - 0.5 * np.log(3) > s_b - 0.5 * np.log(2) else b
    assert [e.id for e in mgr.search(q)] == [expect]
    assert bank.get(a).retrieval_count + bank.get(b).retrieval_count == 4
    mgr.close()


def test_group_members_get_different_entries_concurrently():
    mgr, bank, emb = make(n_entries=12, config=ManagerConfig(max_wait_ms=20.0))
    results, barrier = [None] * 8, threading.Barrier(8)

    def run(i):
        barrier.wait()
        results[i] = mgr.search("strategy for opening doors", k=1)[0].id

    ts = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(set(results)) == 8  # recency + count penalties spread the group
    # the task text was embedded once (plus the 12 entry texts in apply_ops)
    query_calls = [c for c in emb.calls if "strategy for opening doors" in c]
    assert len(query_calls) == 1 and query_calls[0].count("strategy for opening doors") == 1
    assert mgr.stats()["requests"] == 8
    mgr.close()


def test_search_many_shares_pool_and_cache():
    mgr, bank, emb = make(n_entries=10)
    res = mgr.search_many(["strategy for opening doors"] * 8 + ["lava"], k=1)
    assert len({r[0].id for r in res[:8]}) == 8 and len(res[8]) == 1
    n_calls = len(emb.calls)
    mgr.search_many(["strategy for opening doors"], k=2)  # k=2 needs a bigger pool: one search
    mgr.search_many(["strategy for opening doors"], k=2)  # cached pool and cached embedding
    assert len(emb.calls) == n_calls  # text already in the LRU cache
    st = mgr.stats()
    assert st["cache_hits"] >= 1 and st["pool_hits"] >= 1 and 0 < st["cache_hit_rate"] < 1
    with pytest.raises(ValueError):
        mgr.search_many(["x"], k=0)
    mgr.close()


def test_pool_cache_invalidated_by_writes():
    mgr, bank, _ = make(n_entries=3)
    mgr.search("exact new tip")
    new = mgr.apply_ops([AddOp("exact new tip")]).added[0]
    assert mgr.search("exact new tip")[0].id == new  # not served from the stale pool
    mgr.close()


def test_batching_embeds_misses_in_one_call():
    cfg = ManagerConfig(batch_size=16, max_wait_ms=200.0, adaptive_batching=False)
    mgr, bank, emb = make(n_entries=4, config=cfg)
    emb.calls.clear()
    barrier, out = threading.Barrier(16), []

    def run(i):
        barrier.wait()
        out.append(mgr.search(f"distinct query {i}"))

    ts = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(out) == 16
    assert len(emb.calls) < 16 and sum(len(c) for c in emb.calls) == 16  # batched, no repeats
    mgr.close()


def test_lru_cache_evicts_oldest():
    mgr, _, emb = make(n_entries=2, config=ManagerConfig(cache_size=2, pool_cache=False))
    for q in ["a", "b", "a", "c", "a", "b"]:
        mgr.search_many([q])
    # a miss, b miss, a hit, c miss (evicts b), a hit, b miss
    assert [c for c in emb.calls if len(c) == 1] == [["a"], ["b"], ["c"], ["b"]]
    mgr.close()


def test_embedder_failure_reaches_caller_and_manager_survives():
    emb = CountingEmbedder(fail=True)
    mgr, bank, _ = make(emb=emb)
    bank.add("x", HashingEmbedder(DIM).encode(["x"])[0])
    with pytest.raises(RuntimeError, match="embedding service down"):
        mgr.search("q")
    emb.fail = False
    assert mgr.search("q")[0].text == "x"
    assert mgr.stats()["errors"] == 1
    mgr.close()
    with pytest.raises(RuntimeError, match="closed"):
        mgr.search("q")


def test_dim_mismatch():
    with pytest.raises(ValueError, match="embedder dim 32 .* dim 64"):
        ExperienceManager(ExperienceBank(None, DIM), HashingEmbedder(32))


def test_apply_ops_all_kinds_with_provenance():
    mgr, bank, _ = make()
    sample = ExtractorSample("distil this", "ADD: x", [-0.1, -0.2], [5, 6], [1], 4)
    req = DistillationRequest("t", Trajectory(), 1.0, True, None, env_id="crl/Sokoban-6x6-v0")
    r = mgr.apply_ops([AddOp("first", tags=("sokoban",)), AddOp("second")], sample=sample, step=3,
                      request=req)
    a, b = r.added
    e = bank.get(a)
    assert e.provenance == sample and e.created_step == 3
    assert e.tags == ("sokoban", "crl/Sokoban-6x6-v0")
    r = mgr.apply_ops([UpdateOp(a, "first, refined"), DeleteOp(b), UpdateOp(999, "ghost"),
                       DeleteOp(998), ReturnOp("nothing new"), ReturnOp("bad", malformed=True)],
                      sample=sample)
    assert r.updated == [a] and r.deleted == [b] and r.added == []
    assert r.returned == 4 and r.malformed == 3  # two unknown ids + one malformed Return
    e = bank.get(a)
    assert e.text == "first, refined" and e.version == 1 and e.history == ["first"]
    assert bank.get(b) is None
    # update and delete of the same id in one batch: the delete wins, nothing half-applied
    r = mgr.apply_ops([UpdateOp(a, "again"), DeleteOp(a)])
    assert r.updated == [] and r.deleted == [a] and len(bank) == 0
    assert mgr.refiner is None
    mgr.refiner = lambda q, ref, ctx: (ref.text + " (refined)", None)
    mgr.close()


@pytest.mark.parametrize("name_task", [False, True])
def test_name_task_lets_a_query_find_the_entry_of_its_own_task(name_task):
    """Two entries with the same text, written from episodes of two tasks: as written (the paper's
    rule) the query for either task cannot tell them apart and gets the same one; with the task
    named in front, each task's query gets its own entry."""
    mgr, bank, emb = make(config=ManagerConfig(name_task=name_task, diversity_lambda=0.0, recency_window_s=0.0))
    tasks = ["Task amber badger: repeat the 1 secret actions of amber badger.",
             "Task bold falcon: repeat the 1 secret actions of bold falcon."]
    ids = [mgr.apply_ops([AddOp("Play east.")], request=DistillationRequest(t, Trajectory(), 1.0, True, None)).added[0]
           for t in tasks]
    texts = [bank.get(i).text for i in ids]
    assert texts == ([f"{t}\nPlay east." for t in tasks] if name_task else ["Play east.", "Play east."])
    found = [mgr.search(t)[0].id for t in tasks]
    assert found == ids if name_task else found[0] == found[1]
    # an Update from an episode of the task is named too, once; an op without a request is not
    mgr.apply_ops([UpdateOp(ids[0], f"{tasks[0]}\nPlay north.")], request=DistillationRequest(tasks[0], Trajectory(), 0.0, False, None))
    mgr.apply_ops([AddOp("seeded")])
    assert bank.get(ids[0]).text == f"{tasks[0]}\nPlay north." and bank.get(max(ids) + 1).text == "seeded"
    mgr.close()


def test_submit_never_drops_and_survives_restart(tmp_path):
    cfg = ManagerConfig(queue_size=3)
    mgr, bank, _ = make(config=cfg, path=tmp_path)
    reqs = [DistillationRequest(f"task {i}", Trajectory(), float(i), i % 2 == 0, None)
            for i in range(10)]
    for r in reqs:
        mgr.submit(r)  # 3 in memory, 7 spilled
    assert mgr.pending() == 10 and (tmp_path / "pending_requests.jsonl").exists()
    got = mgr.get_requests(2)
    assert [g.task for g in got] == ["task 0", "task 1"]
    mgr.close()
    bank.close()
    mgr2, bank2, _ = make(config=cfg, path=tmp_path)
    assert mgr2.pending() == 8
    rest = mgr2.get_requests(100)
    assert rest == reqs[2:]  # FIFO, nothing lost, exact round trip
    assert mgr2.get_requests(5, timeout=0.01) == []
    with pytest.raises(TypeError):
        mgr2.submit("not a request")
    mgr2.close()


def test_get_requests_waits_for_submit():
    mgr, _, _ = make()
    req = DistillationRequest("late", Trajectory(), 0.0, False, None)
    t = threading.Timer(0.05, mgr.submit, args=(req,))
    t.start()
    assert mgr.get_requests(1, timeout=5.0) == [req]
    t.join()
    mgr.close()


def test_concurrent_searches_and_writes_lose_no_counts():
    mgr, bank, _ = make(n_entries=20, config=ManagerConfig(num_workers=4))
    errors, stop = [], threading.Event()

    def writer():
        # bounded and paced: a writer-preferring lock lets a tight write loop starve readers
        for n in range(20):
            if stop.is_set():
                break
            ids = bank.ids()
            mgr.apply_ops([AddOp(f"new tip {n}"), UpdateOp(ids[n % len(ids)], f"rewritten {n}")])
            time.sleep(0.005)

    def searcher(i):
        try:
            for j in range(5):
                assert len(mgr.search(f"strategy {i % 4} for doors {j % 2}")) == 1
            assert all(len(r) == 1 for r in mgr.search_many(["doors"] * 3))
        except Exception as exc:  # pragma: no cover - surfaced below
            errors.append(exc)

    w = threading.Thread(target=writer)
    w.start()
    ts = [threading.Thread(target=searcher, args=(i,)) for i in range(48)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    stop.set()
    w.join()
    assert not errors
    # 48 threads x (5 searches + 3 batch queries), k = 1: every retrieval counted exactly once
    assert sum(e.retrieval_count for e in bank) == 48 * 8
    mgr.close()
