"""LocalClient and RemoteClient behave the same: every test here runs against both, the
remote one through a real uvicorn server on 127.0.0.1 (a free port) over the same manager."""

from __future__ import annotations

import pickle
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from crl_gym.clients import ExperienceClient, ExperienceUnavailable, LocalClient, RemoteClient
from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.embedders import HashingEmbedder
from crl_gym.experience.manager import ExperienceManager
from crl_gym.protocol import (
    DistillationRequest,
    ExperienceRef,
    ExtractorSample,
    SearchCall,
    Step,
    Trajectory,
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
def setup(request: pytest.FixtureRequest) -> Iterator[tuple[Any, ExperienceManager]]:
    manager = make_manager()
    if request.param == "local":
        yield LocalClient(manager), manager
    else:
        with BackgroundServer(manager) as server:
            client = RemoteClient(server.url, timeout=10)
            yield client, manager
            client.close()
    manager.close()


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


def test_is_an_experience_client(setup: tuple[Any, ExperienceManager]) -> None:
    client, _ = setup
    assert isinstance(client, ExperienceClient)


def test_search_returns_the_closest_entry(setup: tuple[Any, ExperienceManager]) -> None:
    client, _ = setup
    ref = client.search("Sokoban: push a box onto a target")
    assert isinstance(ref, ExperienceRef) and ref.text == TEXTS[1] and ref.version == 0


def test_search_many_keeps_order(setup: tuple[Any, ExperienceManager]) -> None:
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


def test_ask_without_extractor_returns_the_raw_entry(setup: tuple[Any, ExperienceManager]) -> None:
    client, manager = setup
    manager.refiner = None
    entry = client.search("Sokoban box")
    assert client.ask("I pushed a box to the wall", entry, "#####") == (entry.text, None)


def test_ask_with_extractor_refines(setup: tuple[Any, ExperienceManager]) -> None:
    client, manager = setup

    def refiner(query: str, entry: ExperienceRef, context: str) -> tuple[str, ExtractorSample]:
        return f"[{context}] {query}: {entry.text}", ExtractorSample(prompt=query, response="ok", logprobs=[-1.0], extractor_version=2)

    manager.refiner = refiner
    entry = client.search("Sokoban box")
    answer, provenance = client.ask("stuck", entry, "ctx")
    assert answer == f"[ctx] stuck: {TEXTS[1]}"
    assert provenance is not None and provenance["logprobs"] == [-1.0] and provenance["extractor_version"] == 2
    assert ExtractorSample.from_dict(provenance) == ExtractorSample(prompt="stuck", response="ok", logprobs=[-1.0], extractor_version=2)


def test_submit_and_get_requests_round_trip(setup: tuple[Any, ExperienceManager]) -> None:
    client, manager = setup
    reqs = [request_with_call(), request_with_call()]
    for r in reqs:
        client.submit(r)
    assert manager.pending() == 2
    got = client.get_requests(10, timeout=0.5)
    assert [g.to_dict() for g in got] == [r.to_dict() for r in reqs]  # FIFO, nothing lost
    assert client.get_requests(10, timeout=0.0) == []


def test_stats_and_health(setup: tuple[Any, ExperienceManager]) -> None:
    client, _ = setup
    client.submit(request_with_call())
    health = client.health()
    assert health == {"status": "ok", "pending": 1}
    assert isinstance(client.stats(), dict)


def test_remote_client_is_picklable_and_reconnects() -> None:
    manager = make_manager()
    with BackgroundServer(manager) as server:
        client = RemoteClient(server.url, timeout=3)
        assert client.search("Sokoban").text == TEXTS[1]
        clone = pickle.loads(pickle.dumps(client))
        assert clone.url == client.url and clone.timeout == 3
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
