"""LocalClient and RemoteClient behave the same: every method of the service interface runs here
against both faces, the remote one through a real uvicorn server on 127.0.0.1 (a free port, with
a token) over the same kind of RetrievalService."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from crl_gym.clients import (
    Combiner,
    ExperienceAuthError,
    ExperienceClient,
    ExperienceUnavailable,
    LocalClient,
    RemoteClient,
    SubmitCounts,
    SubmitUndelivered,
)
from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.embedders import HashingEmbedder
from crl_gym.experience.manager import ExperienceManager
from crl_gym.experience.service import RetrievalService, StepOrderError
from crl_gym.protocol import (
    AddOp,
    DeleteOp,
    DistillationRequest,
    ExperienceRef,
    ExtractorSample,
    ReturnOp,
    SearchCall,
    Step,
    Trajectory,
    UpdateOp,
)
from crl_gym.server import BackgroundServer

TEXTS = (
    "MiniHack room: the stairs are shown as '>'; walk straight to them.",
    "Sokoban: never push a box into a corner that is not a target.",
    "ALFWorld: to heat an apple, take it to the microwave and use heat.",
)


def make_manager(texts: tuple[str, ...] = TEXTS) -> ExperienceManager:
    emb = HashingEmbedder(64)
    bank = ExperienceBank(None, dim=64)
    for text in texts:
        bank.add(text, emb.encode([text])[0])
    return ExperienceManager(bank, emb)


@pytest.fixture(params=["local", "remote"])
def setup(request: pytest.FixtureRequest) -> Iterator[tuple[Any, RetrievalService]]:
    """(client, the service behind it): the service in process, or behind a real server."""
    service = RetrievalService(make_manager())
    if request.param == "local":
        yield LocalClient(service), service
    else:
        with BackgroundServer(service, token="face-token") as server:
            client = RemoteClient(server.url, timeout=10, token="face-token")
            yield client, service
            client.close()
    service.close()


def request_with_call() -> DistillationRequest:
    entry = ExperienceRef(id=1, text=TEXTS[0], version=0)
    call = SearchCall(query="where are the stairs", answer="walk east", entry=entry, turn=1, refined=True,
                      provenance={"prompt": "p", "response": "r", "logprobs": [-0.5]})
    traj = Trajectory(
        steps=[Step("You see a room.", "east", 0.0, {"turn": 1}),
               Step("You see a room.", "search_and_ask[where are the stairs]", 0.0, {}, kind="search_and_ask"),
               Step("The stairs!", "east", 1.0, {"success": True})],
        initial_observation="You see a room.", search_calls=[call])
    return DistillationRequest(task="reach the stairs", trajectory=traj, outcome=1.0, success=True,
                               experience=entry, condition="guided", env_id="crl/MiniHack-Room-5x5-v0", seed=3)


def test_is_an_experience_client(setup: tuple[Any, RetrievalService]) -> None:
    client, _ = setup
    assert isinstance(client, ExperienceClient)


def test_search_returns_the_closest_entry(setup: tuple[Any, RetrievalService]) -> None:
    client, _ = setup
    ref = client.search("Sokoban: push a box onto a target")
    assert isinstance(ref, ExperienceRef) and ref.text == TEXTS[1] and ref.version == 0


def test_search_many_keeps_order(setup: tuple[Any, RetrievalService]) -> None:
    client, _ = setup
    refs = client.search_many(["heat an apple in ALFWorld", "MiniHack room stairs", "Sokoban box corner"])
    assert [r.text for r in refs] == [TEXTS[2], TEXTS[0], TEXTS[1]]
    assert client.search_many([]) == []


def test_empty_bank_gives_none() -> None:
    for manager in (make_manager(()),):
        local = LocalClient(manager)
        with BackgroundServer(manager) as server:
            remote = RemoteClient(server.url)
            for client in (local, remote):
                assert client.search("anything") is None
                assert client.search_many(["a", "b"]) == [None, None]
            remote.close()
        manager.close()


def test_ask_without_extractor_returns_the_raw_entry(setup: tuple[Any, RetrievalService]) -> None:
    client, service = setup
    service.manager.refiner = None
    entry = client.search("Sokoban box")
    assert client.ask("I pushed a box to the wall", entry, "#####") == (entry.text, None)


def test_ask_with_extractor_refines(setup: tuple[Any, RetrievalService]) -> None:
    client, service = setup

    def refiner(query: str, entry: ExperienceRef, context: str) -> tuple[str, ExtractorSample]:
        return f"[{context}] {query}: {entry.text}", ExtractorSample(prompt=query, response="ok", logprobs=[-1.0], extractor_version=2)

    service.manager.refiner = refiner
    entry = client.search("Sokoban box")
    answer, provenance = client.ask("stuck", entry, "ctx")
    assert answer == f"[ctx] stuck: {TEXTS[1]}"
    assert provenance is not None and provenance["logprobs"] == [-1.0] and provenance["extractor_version"] == 2
    assert ExtractorSample.from_dict(provenance) == ExtractorSample(prompt="stuck", response="ok", logprobs=[-1.0], extractor_version=2)


def test_submit_and_get_requests_round_trip(setup: tuple[Any, RetrievalService]) -> None:
    client, service = setup
    reqs = [request_with_call(), request_with_call()]
    sent = [r.to_dict() for r in reqs]
    for r in reqs:
        client.submit(r)
    client.flush()  # RemoteClient: the sender thread has delivered both
    assert service.manager.pending() == 2
    got = client.get_requests(10, timeout=0.5)
    # FIFO, nothing lost; a request without a rollout step is filed under the open one (0)
    assert [g.to_dict() for g in got] == [{**d, "rollout_step": 0} for d in sent]
    assert client.get_requests(10, timeout=0.0) == []


def test_stats_and_health(setup: tuple[Any, RetrievalService]) -> None:
    client, _ = setup
    client.submit(request_with_call())
    client.flush()
    health = client.health()
    assert health.to_dict() == {"status": "ok", "pending": 1, "extractor": None, "storage": None}
    stats = client.stats().to_dict()
    for key in ("bank_size", "distilled", "credited", "extractor_updates", "merges", "queue_depth"):
        assert isinstance(stats[key], int), key
    assert stats["bank_size"] == len(TEXTS) and stats["queue_depth"] == 1 and stats["submitted"] == 1
    assert stats["extractor"] is None and stats["manager"]["bank_size"] == len(TEXTS)


def test_end_step_closes_steps_once_in_order(setup: tuple[Any, RetrievalService]) -> None:
    client, service = setup
    first, second = request_with_call(), request_with_call()
    client.submit(first)  # no rollout step: the open one, 0
    client.submit(second)
    assert client.end_step(0, bonus={first.request_id: 0.5}).to_dict() == {"step": 0, "ended": [0], "requests": 2, "credited": 0}
    with pytest.raises(StepOrderError, match="already ended"):
        client.end_step(0)  # twice
    later = request_with_call()
    later.rollout_step = 2
    client.submit(later)
    assert client.end_step(3).to_dict() == {"step": 3, "ended": [2, 3], "requests": 1, "credited": 0}
    with pytest.raises(StepOrderError, match="out of order"):
        client.end_step(1)
    with pytest.raises(StepOrderError, match="int >= 0"):
        client.end_step(-1)
    late = request_with_call()
    late.rollout_step = 1
    client.submit(late)  # its step is over: queued, but counted late and kept out of credit
    client.flush()
    stats = client.stats().to_dict()
    assert stats["steps_ended"] == 3 and stats["last_ended_step"] == 3  # the refused calls counted nothing
    assert stats["late_requests"] == 1 and stats["open_requests"] == 0 and stats["submitted"] == 4
    assert service.ledger.last_ended == 3


def test_apply_ops_changes_the_bank(setup: tuple[Any, RetrievalService]) -> None:
    client, service = setup
    bank = service.manager.bank
    out = client.apply_ops([AddOp("Crafter: collect wood before night falls.", tags=("crafter",)),
                            AddOp("WebShop: filter by price first.")]).to_dict()
    assert out["added"] == 2 and len(out["added_ids"]) == 2 and out["malformed"] == 0
    wood, shop = out["added_ids"]
    assert len(bank) == len(TEXTS) + 2 and bank.get(wood).text.startswith("Crafter") and "crafter" in bank.get(wood).tags
    assert client.search("collect wood in Crafter at night").id == wood
    out = client.apply_ops([UpdateOp(wood, "Crafter: collect wood, then build a table."), DeleteOp(shop),
                            UpdateOp(10**9, "nobody"), ReturnOp("nothing to add")]).to_dict()
    assert (out["added"], out["updated"], out["deleted"], out["returned"], out["malformed"]) == (0, 1, 1, 2, 1)
    entry = bank.get(wood)
    assert entry.text == "Crafter: collect wood, then build a table." and entry.version == 1
    assert shop not in bank and len(bank) == len(TEXTS) + 1
    assert client.apply_ops([]).to_dict() == {"added": 0, "added_ids": [], "updated": 0, "deleted": 0, "returned": 0, "malformed": 0,
                                             "repeated": False}
    assert client.stats().ops_applied == 3


def test_concurrent_searches_each_get_their_own_answer(setup: tuple[Any, RetrievalService]) -> None:
    """Simultaneous searches (coalesced into shared batches by the server) are answered per caller."""
    client, _ = setup
    queries = ["heat an apple in ALFWorld", "MiniHack room stairs", "Sokoban box corner"]
    def one(i: int, barrier: threading.Barrier, got: list[str | None]) -> None:
        barrier.wait(timeout=10)
        ref = client.search(queries[i])
        got[i] = ref.text if ref is not None else None

    for _ in range(5):  # each entry is used once per round: diversification keeps every caller's own
        got: list[str | None] = [None] * len(queries)
        barrier = threading.Barrier(len(queries))
        threads = [threading.Thread(target=one, args=(i, barrier, got)) for i in range(len(queries))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert got == [TEXTS[2], TEXTS[0], TEXTS[1]]


def test_local_client_wraps_a_manager_and_closes_nothing() -> None:
    manager = make_manager()
    client = LocalClient(manager)
    assert isinstance(client.service, RetrievalService) and client.manager is manager
    assert client.end_step(0).ended == [0]
    client.close()
    assert client.search("Sokoban box").text == TEXTS[1]  # the manager is still open
    service = RetrievalService(manager)
    assert LocalClient(service).service is service
    with pytest.raises(TypeError, match="RetrievalService or an ExperienceManager"):
        LocalClient(object())  # type: ignore[arg-type]
    manager.close()


def test_remote_errors_of_the_service_are_unavailable() -> None:
    class Broken(RetrievalService):
        def search_many(self, queries: list[str]) -> list[ExperienceRef | None]:
            raise RuntimeError("index on fire")

    service = Broken(make_manager())
    with BackgroundServer(service) as server:
        client = RemoteClient(server.url, timeout=10)
        with pytest.raises(ExperienceUnavailable, match="500"):
            client.search("x")
        with pytest.raises(ExperienceUnavailable, match="500"):
            client.search_many(["x"])
        assert client.health().status == "ok"  # the server itself survives
        client.close()
    service.close()


def test_remote_client_is_picklable_and_reconnects(tmp_path: Path) -> None:
    manager = make_manager()
    with BackgroundServer(manager) as server:
        client = RemoteClient(server.url, timeout=3, max_buffered=7, spill_path=tmp_path / "s.jsonl", retries=1,
                              retry_backoff_s=0.5)
        assert client.search("Sokoban").text == TEXTS[1]
        clone = pickle.loads(pickle.dumps(client))
        assert clone.url == client.url and clone.timeout == 3 and clone.token is None
        assert (clone.max_buffered, clone.spill_path, clone.retries, clone.retry_backoff_s) == (7, tmp_path / "s.jsonl", 1, 0.5)
        found = clone.search("Sokoban")  # diversified: any bank entry, not necessarily the same
        assert found is not None and found.text in TEXTS and clone.health().status == "ok"
        client.close()
        clone.close()
    manager.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_remote_client_down_raises_unavailable() -> None:
    client = RemoteClient(f"http://127.0.0.1:{free_port()}", timeout=2)
    with pytest.raises(ExperienceUnavailable, match="unreachable"):
        client.search("x")
    with pytest.raises(TypeError, match="DistillationRequest"):  # checked at once, never buffered
        client.submit({"task": "t"})  # type: ignore[arg-type]
    assert client.submit_counts.buffered == 0


def test_remote_client_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="url must start with http"):
        RemoteClient("localhost:8000")
    with pytest.raises(ValueError, match="timeout"):
        RemoteClient("http://127.0.0.1:1", timeout=0)
    with pytest.raises(ValueError, match="max_buffered"):
        RemoteClient("http://127.0.0.1:1", max_buffered=0)
    with pytest.raises(ValueError, match="retries"):
        RemoteClient("http://127.0.0.1:1", retries=-1)


def test_remote_bad_input_is_a_value_error_naming_the_field() -> None:
    manager = make_manager()
    with BackgroundServer(manager) as server:
        client = RemoteClient(server.url)
        with pytest.raises(ValueError, match="max_n"):
            client.get_requests(0)
        client.close()
    manager.close()


def test_docstring_examples_run() -> None:
    import doctest

    import crl_gym.clients as module

    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_combiner_batches_concurrent_calls_and_answers_each_caller() -> None:
    release, first_sent = threading.Event(), threading.Event()
    batches: list[list[int]] = []

    def send(items: list[int]) -> list[Any]:
        batches.append(list(items))
        if len(batches) == 1:  # hold the first batch on the wire while the others queue
            first_sent.set()
            assert release.wait(10)
        return [ValueError(f"bad {i}") if i == 7 else i * 10 for i in items]

    combiner = Combiner(send, max_batch=4, max_inflight=1)
    results: dict[int, Any] = {}

    def call(i: int) -> None:
        try:
            results[i] = combiner(i)
        except ValueError as exc:
            results[i] = str(exc)

    threads = [threading.Thread(target=call, args=(0,))]
    threads[0].start()
    assert first_sent.wait(10)
    threads += [threading.Thread(target=call, args=(i,)) for i in range(1, 10)]
    for t in threads[1:]:
        t.start()
    deadline = time.monotonic() + 10
    while combiner.waiting < 9 and time.monotonic() < deadline:  # all nine queued behind the first
        time.sleep(0.005)
    release.set()
    for t in threads:
        t.join(10)
    assert results == {i: ("bad 7" if i == 7 else i * 10) for i in range(10)}  # each caller its own answer
    assert batches[0] == [0] and [len(b) for b in batches[1:]] == [4, 4, 1]  # FIFO, at most max_batch
    assert sorted(i for b in batches for i in b) == list(range(10))  # every call sent exactly once
    assert combiner.inflight == 0 and combiner.waiting == 0


def test_combiner_hands_a_failed_send_to_every_caller_of_the_batch() -> None:
    def send(items: list[int]) -> list[int]:
        raise ExperienceUnavailable(f"down ({len(items)})")

    combiner = Combiner(send, max_batch=8, max_inflight=2)
    for i in range(3):  # the failure does not leave a batch counted on the wire
        with pytest.raises(ExperienceUnavailable, match=r"down \(1\)"):
            combiner(i)
        assert combiner.inflight == 0 and combiner.waiting == 0


def test_get_requests_skips_and_counts_a_malformed_request(caplog: pytest.LogCaptureFixture) -> None:
    good = [DistillationRequest(f"task {i}", Trajectory(), 1.0, True, None) for i in range(2)]

    class Raw:
        def __init__(self, d: dict[str, Any]) -> None:
            self.d = d

        def to_dict(self) -> dict[str, Any]:
            return self.d

    class MixedService(RetrievalService):
        """Hands out a good request, a broken one, then another good one."""

        def get_requests(self, max_n: int, timeout: float = 0.0) -> list[Any]:
            return [good[0], Raw({"task": "no trajectory"}), Raw({**good[1].to_dict(), "outcome": "lots"}), good[1]]

    service = MixedService(make_manager())
    try:
        with BackgroundServer(service) as server:
            client = RemoteClient(server.url)
            with caplog.at_level("ERROR", logger="crl_gym.clients"):
                got = client.get_requests(10)
            assert [r.task for r in got] == ["task 0", "task 1"]
            assert client.malformed_requests == 2
            assert "skipping malformed request 1 of 4" in caplog.text
            client.close()
    finally:
        service.close()


# ---------------------------------------------------------------- RemoteClient's submit buffer


class GatedService(RetrievalService):
    """A service whose ``submit`` waits for ``gate``: a server that is slow to take requests."""

    def __init__(self, manager: ExperienceManager) -> None:
        super().__init__(manager)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def submit_many(self, requests: list[DistillationRequest], *, durable: bool = False) -> int:
        self.entered.set()
        self.gate.wait(20)
        return super().submit_many(requests, durable=durable)


@pytest.fixture()
def gated() -> Iterator[tuple[GatedService, str]]:
    """(a gated service, the url of a real server over it); the gate opens at teardown."""
    service = GatedService(make_manager())
    with BackgroundServer(service) as server:
        yield service, server.url
        service.gate.set()
    service.close()


def test_remote_submit_returns_before_the_server_has_the_request(gated: tuple[GatedService, str]) -> None:
    service, url = gated
    client = RemoteClient(url, timeout=10)
    reqs = [request_with_call() for _ in range(3)]
    submitter = threading.Thread(target=lambda: [client.submit(r) for r in reqs])
    submitter.start()
    submitter.join(timeout=30)  # the server holds every request until the gate opens: a blocking submit stays here
    assert not submitter.is_alive() and not service.gate.is_set()
    assert service.entered.wait(10)  # the sender is on the wire, held by the server
    assert service.manager.pending() == 0 and client.submit_counts.buffered == 3
    with pytest.raises(TimeoutError, match="3 submitted requests not yet delivered"):
        client.flush(timeout=0.2)
    assert client.submit_counts.buffered == 3  # a flush that timed out dropped nothing
    service.gate.set()
    client.flush(timeout=10)
    assert client.submit_counts == SubmitCounts(buffered=0, delivered=3, rejected=0, failures=0, spilled=0, lost=0)
    assert [r.request_id for r in client.get_requests(10)] == [r.request_id for r in reqs]  # FIFO
    client.close()


def test_remote_end_step_delivers_the_step_requests_first(gated: tuple[GatedService, str]) -> None:
    service, url = gated
    client = RemoteClient(url, timeout=10)
    for _ in range(5):
        client.submit(request_with_call())
    assert service.entered.wait(10)
    threading.Timer(0.3, service.gate.set).start()  # the server takes them a moment later
    # Without the flush, /end_step would overtake the /submit the server is still holding.
    assert client.end_step(0).to_dict() == {"step": 0, "ended": [0], "requests": 5, "credited": 0}
    client.close()


def test_remote_close_flushes_and_stops_the_sender(gated: tuple[GatedService, str]) -> None:
    service, url = gated
    client = RemoteClient(url, timeout=10)
    for _ in range(3):
        client.submit(request_with_call())
    assert service.entered.wait(10)
    threading.Timer(0.2, service.gate.set).start()
    client.close()
    assert service.manager.pending() == 3 and client._box._thread is None
    client.submit(request_with_call())  # usable again: a new sender starts
    client.flush(timeout=10)
    assert service.manager.pending() == 4
    client.close()


def test_remote_submit_blocks_while_the_buffer_is_full(gated: tuple[GatedService, str]) -> None:
    service, url = gated
    client = RemoteClient(url, timeout=10, max_buffered=2)
    reqs = [request_with_call() for _ in range(4)]
    client.submit(reqs[0])
    assert service.entered.wait(10)  # on the wire: the buffer is empty again
    client.submit(reqs[1])
    client.submit(reqs[2])  # the buffer is full now
    blocked = threading.Thread(target=client.submit, args=(reqs[3],), daemon=True)
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive()  # it waits for room: backpressure, not a drop
    service.gate.set()
    blocked.join(10)
    assert not blocked.is_alive()
    client.flush(timeout=10)
    assert [r.request_id for r in client.get_requests(10)] == [r.request_id for r in reqs]
    client.close()


def test_remote_server_down_spills_and_flush_names_the_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    spill = tmp_path / "unsent.jsonl"
    client = RemoteClient(f"http://127.0.0.1:{free_port()}", timeout=2, spill_path=spill, retries=2, retry_backoff_s=0.01)
    reqs = [request_with_call() for _ in range(3)]
    with caplog.at_level("ERROR", logger="crl_gym.clients"):
        for r in reqs:
            client.submit(r)  # the server being down costs the caller nothing here
        with pytest.raises(SubmitUndelivered, match=re.escape(str(spill))) as info:
            client.flush(timeout=30)
    assert info.value.count == 3 and info.value.spill_path == spill
    lines = spill.read_text(encoding="utf-8").splitlines()
    assert [DistillationRequest.from_dict(json.loads(line)).to_dict() for line in lines] == [r.to_dict() for r in reqs]
    assert client.submit_counts == SubmitCounts(buffered=0, delivered=0, rejected=0, failures=3, spilled=3, lost=0)
    assert str(spill) in caplog.text  # logged with its path when written
    client.flush()  # reported once: the next flush has nothing new to say
    with pytest.raises(ExperienceUnavailable, match="unreachable"):
        client.end_step(0)
    client.close()


def test_remote_default_spill_file_is_per_process_under_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    port = free_port()
    client = RemoteClient(f"http://127.0.0.1:{port}", timeout=2, retries=0)
    expected = tmp_path / "complementary-rl" / "unsent" / f"requests-127.0.0.1-{port}-{os.getpid()}.jsonl"
    assert client.spill_file == expected
    client.submit(request_with_call())
    with pytest.raises(SubmitUndelivered, match=re.escape(str(expected))):
        client.flush(timeout=30)
    assert len(expected.read_text(encoding="utf-8").splitlines()) == 1
    client.close()


def test_remote_submit_retries_a_transient_server_failure(tmp_path: Path) -> None:
    class Flaky(RetrievalService):
        fails = 2

        def submit_many(self, requests: list[DistillationRequest], *, durable: bool = False) -> int:
            if self.fails > 0:
                self.fails -= 1
                raise RuntimeError("restarting")  # a 500 to the client
            return super().submit_many(requests, durable=durable)

    service = Flaky(make_manager())
    spill = tmp_path / "unsent.jsonl"
    with BackgroundServer(service) as server:
        client = RemoteClient(server.url, timeout=10, spill_path=spill, retries=3, retry_backoff_s=0.01)
        req = request_with_call()
        client.submit(req)
        client.flush(timeout=30)
        assert (client.submit_counts.delivered, client.submit_counts.spilled, service.fails) == (1, 0, 0) and not spill.exists()
        assert [r.request_id for r in client.get_requests(5)] == [req.request_id]
        client.close()
    service.close()


def test_remote_submit_with_a_wrong_token_raises_auth_error_at_flush(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    service = RetrievalService(make_manager())
    spill = tmp_path / "unsent.jsonl"
    with BackgroundServer(service, token="right") as server:
        client = RemoteClient(server.url, timeout=10, token="wrong", spill_path=spill, retries=3, retry_backoff_s=0.01)
        posts: list[str] = []
        real_call = client._call

        def counted(method: str, path: str, *args: Any, **kwargs: Any) -> Any:
            posts.append(path)
            return real_call(method, path, *args, **kwargs)

        monkeypatch.setattr(client, "_call", counted)
        client.submit(request_with_call())
        with pytest.raises(ExperienceAuthError, match=re.escape(str(spill))):
            client.flush(timeout=30)
        # one POST, not 1 + retries: a 401 is not an outage
        assert posts == ["/submit"] and client.submit_counts.spilled == 1 and service.manager.pending() == 0
        assert len(spill.read_text(encoding="utf-8").splitlines()) == 1
        with pytest.raises(ExperienceAuthError, match="401"):
            client.end_step(0)  # the flush is clean now; /end_step itself is refused
        client.close()
    service.close()


def test_remote_malformed_requests_in_a_batch_do_not_block_the_others(gated: tuple[GatedService, str],
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    service, url = gated
    client = RemoteClient(url, timeout=10)
    first = request_with_call()
    client.submit(first)
    assert service.entered.wait(10)  # held on the wire: the next 12 queue up and leave as one batch
    reqs = [request_with_call() for _ in range(12)]
    for i in (3, 7, 8):
        object.__setattr__(reqs[i], "condition", "sometimes")  # passes the client, fails the server's parse
    for r in reqs:
        client.submit(r)
    service.gate.set()
    with caplog.at_level("ERROR", logger="crl_gym.clients"):
        client.flush(timeout=30)  # no error: a malformed request is dropped, not undelivered
    assert client.submit_counts == SubmitCounts(buffered=0, delivered=10, rejected=3, failures=0, spilled=0, lost=0)
    good = [r.request_id for r in [first, *reqs] if r.condition != "sometimes"]
    assert [r.request_id for r in client.get_requests(100, timeout=1.0)] == good  # the rest in order
    assert "condition" in caplog.text and all(reqs[i].request_id in caplog.text for i in (3, 7, 8))
    client.close()


def test_remote_an_oversized_request_is_rejected_alone() -> None:
    """A 413 names no request: the batch is halved until the one too big for the server is alone."""
    service = GatedService(make_manager())
    with BackgroundServer(service, max_body_bytes=40_000) as server:
        client = RemoteClient(server.url, timeout=10)
        client.submit(request_with_call())
        assert service.entered.wait(10)
        reqs = [request_with_call() for _ in range(8)]
        object.__setattr__(reqs[5], "task", "x" * 60_000)
        for r in reqs:
            client.submit(r)
        service.gate.set()
        client.flush(timeout=30)
        assert client.submit_counts == SubmitCounts(buffered=0, delivered=8, rejected=1, failures=0, spilled=0, lost=0)
        client.close()
    service.close()


def _submit_in_child(client: RemoteClient, request: DistillationRequest) -> None:
    client.submit(request)  # and return at once: the process exits with the request buffered


def test_a_forked_worker_delivers_its_own_buffer_at_exit_and_none_of_the_parents(gated: tuple[GatedService, str]) -> None:
    service, url = gated
    client = RemoteClient(url, timeout=10)
    parent = [request_with_call(), request_with_call()]
    for r in parent:
        client.submit(r)  # one on the wire, one buffered when the child is forked
    assert service.entered.wait(10)
    child = request_with_call()
    proc = multiprocessing.get_context("fork").Process(target=_submit_in_child, args=(client, child))
    proc.start()
    threading.Timer(0.5, service.gate.set).start()
    proc.join(30)
    assert proc.exitcode == 0
    client.flush(timeout=10)
    got = sorted(r.request_id for r in client.get_requests(10, timeout=1.0))
    assert got == sorted(r.request_id for r in [*parent, child])  # each once: the child resent none of the parent's
    client.close()


def test_remote_submit_fixes_a_recorded_request_id_before_it_returns(gated: tuple[GatedService, str]) -> None:
    """A copy taken while the request waits unencoded (what an AsyncVectorEnv worker pickles to
    the trainer) carries the id the server gets: bonuses are keyed by it."""
    from crl_gym.wrappers.recording import RecordedRequest

    service, url = gated
    client = RemoteClient(url, timeout=10)
    client.submit(request_with_call())
    assert service.entered.wait(10)  # the sender is held: the next request waits in the buffer
    rec = RecordedRequest.from_record(["start", "east", 1.0, {}, "end"], task="t", experience=None,
                                      condition="free", env_id="corridor", seed=0)
    client.submit(rec)
    copy = pickle.loads(pickle.dumps(rec))
    service.gate.set()
    client.flush(timeout=10)
    assert [r.request_id for r in client.get_requests(10)][1] == copy.request_id == rec.request_id
    client.close()


def test_a_process_that_exits_with_requests_buffered_delivers_them_first(gated: tuple[GatedService, str]) -> None:
    service, url = gated
    script = ("import sys; from crl_gym.clients import RemoteClient; from crl_gym.protocol import DistillationRequest, Trajectory; "
              "c = RemoteClient(sys.argv[1], timeout=10); "
              "c.submit(DistillationRequest('exit task', Trajectory(), 1.0, True, None, request_id='at-exit'))")
    threading.Timer(0.5, service.gate.set).start()  # the server takes it only after the script has returned
    out = subprocess.run([sys.executable, "-c", script, url], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert [r.request_id for r in service.manager.get_requests(10, timeout=1.0)] == ["at-exit"]
