"""LocalClient and RemoteClient behave the same: every method of the service interface runs here
against both faces, the remote one through a real uvicorn server on 127.0.0.1 (a free port, with
a token) over the same kind of RetrievalService."""

from __future__ import annotations

import pickle
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from crl_gym.clients import (
    Combiner,
    ExperienceClient,
    ExperienceUnavailable,
    LocalClient,
    RemoteClient,
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
    assert service.manager.pending() == 2
    got = client.get_requests(10, timeout=0.5)
    # FIFO, nothing lost; a request without a rollout step is filed under the open one (0)
    assert [g.to_dict() for g in got] == [{**d, "rollout_step": 0} for d in sent]
    assert client.get_requests(10, timeout=0.0) == []


def test_stats_and_health(setup: tuple[Any, RetrievalService]) -> None:
    client, _ = setup
    client.submit(request_with_call())
    health = client.health()
    assert health == {"status": "ok", "pending": 1, "extractor": None}
    stats = client.stats()
    for key in ("bank_size", "distilled", "credited", "extractor_updates", "merges", "queue_depth"):
        assert isinstance(stats[key], int), key
    assert stats["bank_size"] == len(TEXTS) and stats["queue_depth"] == 1 and stats["submitted"] == 1
    assert stats["extractor"] is None and stats["manager"]["bank_size"] == len(TEXTS)


def test_end_step_closes_steps_once_in_order(setup: tuple[Any, RetrievalService]) -> None:
    client, service = setup
    first, second = request_with_call(), request_with_call()
    client.submit(first)  # no rollout step: the open one, 0
    client.submit(second)
    assert client.end_step(0, bonus={first.request_id: 0.5}) == {"step": 0, "ended": [0], "requests": 2, "credited": 0}
    with pytest.raises(StepOrderError, match="already ended"):
        client.end_step(0)  # twice
    later = request_with_call()
    later.rollout_step = 2
    client.submit(later)
    assert client.end_step(3) == {"step": 3, "ended": [2, 3], "requests": 1, "credited": 0}
    with pytest.raises(StepOrderError, match="out of order"):
        client.end_step(1)
    with pytest.raises(StepOrderError, match="int >= 0"):
        client.end_step(-1)
    late = request_with_call()
    late.rollout_step = 1
    client.submit(late)  # its step is over: queued, but counted late and kept out of credit
    stats = client.stats()
    assert stats["steps_ended"] == 3 and stats["last_ended_step"] == 3  # the refused calls counted nothing
    assert stats["late_requests"] == 1 and stats["open_requests"] == 0 and stats["submitted"] == 4
    assert service.ledger.last_ended == 3


def test_apply_ops_changes_the_bank(setup: tuple[Any, RetrievalService]) -> None:
    client, service = setup
    bank = service.manager.bank
    out = client.apply_ops([AddOp("Crafter: collect wood before night falls.", tags=("crafter",)),
                            AddOp("WebShop: filter by price first.")])
    assert out["added"] == 2 and len(out["added_ids"]) == 2 and out["malformed"] == 0
    wood, shop = out["added_ids"]
    assert len(bank) == len(TEXTS) + 2 and bank.get(wood).text.startswith("Crafter") and "crafter" in bank.get(wood).tags
    assert client.search("collect wood in Crafter at night").id == wood
    out = client.apply_ops([UpdateOp(wood, "Crafter: collect wood, then build a table."), DeleteOp(shop),
                            UpdateOp(10**9, "nobody"), ReturnOp("nothing to add")])
    assert (out["added"], out["updated"], out["deleted"], out["returned"], out["malformed"]) == (0, 1, 1, 2, 1)
    entry = bank.get(wood)
    assert entry.text == "Crafter: collect wood, then build a table." and entry.version == 1
    assert shop not in bank and len(bank) == len(TEXTS) + 1
    assert client.apply_ops([]) == {"added": 0, "added_ids": [], "updated": 0, "deleted": 0, "returned": 0, "malformed": 0}
    assert client.stats()["ops_applied"] == 3


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
    assert client.end_step(0)["ended"] == [0]
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
        assert client.health()["status"] == "ok"  # the server itself survives
        client.close()
    service.close()


def test_remote_client_is_picklable_and_reconnects() -> None:
    manager = make_manager()
    with BackgroundServer(manager) as server:
        client = RemoteClient(server.url, timeout=3)
        assert client.search("Sokoban").text == TEXTS[1]
        clone = pickle.loads(pickle.dumps(client))
        assert clone.url == client.url and clone.timeout == 3 and clone.token is None
        found = clone.search("Sokoban")  # diversified: any bank entry, not necessarily the same
        assert found is not None and found.text in TEXTS and clone.health()["status"] == "ok"
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
    with pytest.raises(ExperienceUnavailable):
        client.submit(request_with_call())


def test_remote_client_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="url must start with http"):
        RemoteClient("localhost:8000")
    with pytest.raises(ValueError, match="timeout"):
        RemoteClient("http://127.0.0.1:1", timeout=0)


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
    while len(combiner._waiting) < 9 and time.monotonic() < deadline:  # all nine queued behind the first
        time.sleep(0.005)
    release.set()
    for t in threads:
        t.join(10)
    assert results == {i: ("bad 7" if i == 7 else i * 10) for i in range(10)}  # each caller its own answer
    assert batches[0] == [0] and [len(b) for b in batches[1:]] == [4, 4, 1]  # FIFO, at most max_batch
    assert sorted(i for b in batches for i in b) == list(range(10))  # every call sent exactly once
    assert combiner._inflight == 0 and not combiner._waiting


def test_combiner_hands_a_failed_send_to_every_caller_of_the_batch() -> None:
    def send(items: list[int]) -> list[int]:
        raise ExperienceUnavailable(f"down ({len(items)})")

    combiner = Combiner(send, max_batch=8, max_inflight=2)
    for i in range(3):  # the failure does not leave a batch counted on the wire
        with pytest.raises(ExperienceUnavailable, match=r"down \(1\)"):
            combiner(i)
        assert combiner._inflight == 0 and not combiner._waiting


def test_remote_submits_in_one_batch_fail_alone() -> None:
    """Concurrent submits share a request; one the server rejects fails alone, the rest are queued."""
    service = RetrievalService(make_manager())
    with BackgroundServer(service) as server:
        client = RemoteClient(server.url, timeout=10)
        reqs = [request_with_call() for _ in range(12)]
        object.__setattr__(reqs[5], "condition", "sometimes")  # passes the client, fails the server's parse
        outcome: dict[int, str] = {}
        barrier = threading.Barrier(len(reqs))

        def one(i: int) -> None:
            barrier.wait(timeout=10)
            try:
                client.submit(reqs[i])
                outcome[i] = "ok"
            except ValueError as exc:
                outcome[i] = str(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert "condition" in outcome.pop(5) and set(outcome.values()) == {"ok"} and len(outcome) == 11
        got = client.get_requests(100, timeout=1.0)
        assert sorted(r.request_id for r in got) == sorted(r.request_id for i, r in enumerate(reqs) if i != 5)
        client.close()
    service.close()


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
