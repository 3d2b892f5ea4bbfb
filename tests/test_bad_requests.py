"""Bad requests get a 4xx, never a 500, and never hurt another client: oversized bodies, huge
queries, lone surrogates, bad JSON, and one failing query inside a shared search batch. Through
a real server on 127.0.0.1 and through the manager directly."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest
from fastapi import APIRouter, FastAPI, Request
from fastapi.testclient import TestClient
from starlette.exceptions import HTTPException as StarletteHTTPException

from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.config import ManagerConfig
from crl_gym.experience.embedders import HashingEmbedder
from crl_gym.experience.manager import ExperienceManager
from crl_gym.protocol import DistillationRequest, Step, Trajectory
from crl_gym.server import MAX_JSON_ITEMS, BackgroundServer, GuardedRoute

TIP = "In Sokoban, push boxes along walls only when the target is on that wall."


class PickyEmbedder(HashingEmbedder):
    """Fails any batch holding a text with 'poison' in it; sleeps on 'slow' (to fill a batch)."""

    def encode(self, texts: list[str]) -> np.ndarray:
        if any("poison" in t for t in texts):
            raise ValueError("the embedder cannot read this text")
        if any("slow" in t for t in texts):
            time.sleep(0.4)
        return super().encode(texts)


def make_manager(config: ManagerConfig | None = None) -> ExperienceManager:
    emb = PickyEmbedder(32)
    bank = ExperienceBank(None, dim=32)
    bank.add(TIP, emb.encode([TIP])[0])
    return ExperienceManager(bank, emb, config)


@pytest.fixture()
def served() -> Iterator[tuple[str, ExperienceManager]]:
    manager = make_manager(ManagerConfig(max_query_chars=100))
    with BackgroundServer(manager, max_body_bytes=64 * 1024) as server:
        yield server.url, manager
    manager.close()


def a_request(task: str = "t") -> dict[str, Any]:
    return DistillationRequest(task=task, trajectory=Trajectory(steps=[Step("o", "a", 1.0)]), outcome=1.0,
                               success=True, experience=None).to_dict()


def raw(url: str, path: str, body: bytes, **headers: str) -> httpx.Response:
    return httpx.post(url + path, content=body, headers={"content-type": "application/json", **headers}, timeout=10)


def test_an_oversized_body_is_413_unread_and_the_server_goes_on(served: tuple[str, ExperienceManager]) -> None:
    url, manager = served
    big = json.dumps({"requests": [a_request("x" * 1000) for _ in range(100)]}).encode()
    assert len(big) > 64 * 1024
    r = raw(url, "/submit", big)
    assert r.status_code == 413 and "limit" in r.json()["detail"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it streams in
        for _ in range(200):
            yield b" " * 1024

    r = httpx.post(url + "/search", content=chunks(), headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 413
    assert manager.pending() == 0
    assert httpx.post(url + "/search", json={"query": "Sokoban"}, timeout=10).json()["entry"]["text"] == TIP


def test_bad_json_is_422_and_a_declared_huge_body_413(served: tuple[str, ExperienceManager]) -> None:
    url, _ = served
    for body in (b"{not json", b"\xff\xfe", b"[1, 2", b'{"query": 3}', b""):
        assert raw(url, "/search", body).status_code == 422, body
    with socket.create_connection(urlsplit(url).netloc.split(":"), timeout=10) as sock:  # type: ignore[arg-type]
        sock.sendall(b"POST /search HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 99999999999\r\n\r\n{")
        assert sock.recv(64).startswith(b"HTTP/1.1 413")  # declared too large: refused before reading


def test_a_huge_query_is_cut_not_refused(served: tuple[str, ExperienceManager]) -> None:
    url, manager = served
    r = httpx.post(url + "/search", json={"query": "Sokoban boxes " * 4000}, timeout=10)
    assert r.status_code == 200 and r.json()["entry"]["text"] == TIP
    r = httpx.post(url + "/search_many", json={"queries": ["walls " * 5000, "q"]}, timeout=10)
    assert r.status_code == 200 and len(r.json()["entries"]) == 2
    assert max(len(k) for k in manager._cache) <= 100  # what was embedded is the cut query


def test_the_manager_cuts_a_huge_query() -> None:
    manager = make_manager(ManagerConfig(max_query_chars=20))
    try:
        assert [e.text for e in manager.search("Sokoban " * 10_000)] == [TIP]
        assert [len(r) for r in manager.search_many(["boxes " * 10_000])] == [1]
        assert all(len(k) <= 20 for k in manager._cache)
    finally:
        manager.close()


def test_lone_surrogates_are_cleaned_at_the_boundary(served: tuple[str, ExperienceManager]) -> None:
    url, manager = served
    # valid JSON, but "\ud800" alone is not encodable as UTF-8
    r = raw(url, "/search", b'{"query": "Sokoban \\ud800 boxes"}')
    assert r.status_code == 200 and r.json()["entry"]["text"] == TIP
    r = raw(url, "/search_many", b'{"queries": ["\\udfff", "ok"]}')
    assert r.status_code == 200
    r = raw(url, "/apply_ops", b'{"ops": [{"kind": "add", "text": "tip \\ud83d alone", "tags": ["\\udc00"]}]}')
    assert r.status_code == 200, r.text
    new_id = r.json()["added_ids"][0]
    assert manager.bank.get(new_id).text == "tip \ufffd alone"  # type: ignore[union-attr]
    body = json.dumps({"requests": [a_request("task \ud800 x")]})  # json.dumps escapes it as \ud800
    r = raw(url, "/submit", body.encode())
    assert r.status_code == 200, r.text
    got = httpx.post(url + "/get_requests", json={"max_n": 5}, timeout=10)
    assert got.status_code == 200 and got.json()["requests"][0]["task"] == "task \ufffd x"
    r = raw(url, "/end_step", b'{"step": 0, "bonus": {"\\ud800": 1.0}}')
    assert r.status_code == 200, r.text
    r = raw(url, "/ask", b'{"query": "\\ud800", "entry": {"id": 1, "text": "\\udfff"}, "context": "\\ud800"}')
    assert r.status_code == 200, r.text
    # a real pair is one character, kept as it is
    r = raw(url, "/apply_ops", b'{"ops": [{"kind": "add", "text": "smile \\ud83d\\ude00"}]}')
    assert manager.bank.get(r.json()["added_ids"][0]).text == "smile \U0001f600"  # type: ignore[union-attr]


def test_one_bad_query_in_a_shared_batch_fails_only_its_caller() -> None:
    # a wide batching window: the good queries and the bad one form one batch
    manager = make_manager(ManagerConfig(batch_size=64, max_batch_size=64, max_wait_ms=200.0))
    try:
        with ThreadPoolExecutor(16) as pool:
            futs = [pool.submit(manager.search, "poison" if i == 5 else f"Sokoban {i}") for i in range(16)]
            outcomes = []
            for f in futs:
                try:
                    outcomes.append([e.text for e in f.result(timeout=30)])
                except RuntimeError as exc:
                    outcomes.append(str(exc))
        assert manager.stats()["batches"] >= 1
        assert "cannot read" in outcomes[5]  # type: ignore[operator]
        assert all(o == [TIP] for i, o in enumerate(outcomes) if i != 5), outcomes
    finally:
        manager.close()


def test_one_bad_query_in_a_coalesced_http_batch_fails_only_its_caller(served: tuple[str, ExperienceManager]) -> None:
    url, _ = served
    # two slow searches occupy both in-flight slots; the calls that arrive meanwhile are
    # gathered into one batch, which holds the bad query
    statuses: dict[int, int] = {}

    def call(i: int, query: str) -> None:
        statuses[i] = httpx.post(url + "/search", json={"query": query}, timeout=30).status_code

    slow = [threading.Thread(target=call, args=(-1 - j, f"slow {j}")) for j in range(2)]
    for t in slow:
        t.start()
    time.sleep(0.15)
    rest = [threading.Thread(target=call, args=(i, "poison" if i == 3 else f"Sokoban {i}")) for i in range(12)]
    for t in rest:
        t.start()
    for t in slow + rest:
        t.join(30)
    assert statuses[3] == 500
    assert all(s == 200 for i, s in statuses.items() if i != 3), statuses
    assert httpx.post(url + "/search", json={"query": "Sokoban"}, timeout=10).status_code == 200


@pytest.mark.parametrize(("path", "body"), [
    ("/get_requests", b'{"timeout": 1e309}'),
    ("/get_requests", b'{"timeout": NaN}'),
    ("/get_requests", b'{"timeout": -Infinity, "max_n": 1e999}'),
    ("/end_step", b'{"step": 0, "bonus": {"a": 1e309}}'),
    ("/end_step", b'{"step": NaN}'),
    ("/search_many", b'{"queries": [Infinity, NaN]}'),
])
def test_a_non_finite_number_is_422_naming_the_field_not_500(served: tuple[str, ExperienceManager], path: str,
                                                              body: bytes) -> None:
    # pydantic refuses the value and echoes it as ``input``; rendered as a JSON number that
    # would be invalid JSON, so the 422 carries it as a string
    r = raw(served[0], path, body)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert all(isinstance(d["loc"], list) and d["loc"][0] == "body" for d in detail), detail
    assert {str(d["input"]) for d in detail if isinstance(d.get("input"), str)} <= {"inf", "-inf", "nan"}
    assert raw(served[0], "/search", b'{"query": "Sokoban"}').json()["entry"]["text"] == TIP


@pytest.mark.parametrize("opener", [b"[", b'{"a":'])
def test_deep_nesting_is_refused_before_parsing_not_500(opener: bytes) -> None:
    manager = make_manager()
    try:
        with BackgroundServer(manager) as server:  # the default 4 MiB body limit
            closer = b"]" if opener == b"[" else b"}"
            for depth in (100_000, 65):
                body = b'{"requests": [' + opener * depth + b"1" + closer * depth + b"]}"
                r = raw(server.url, "/submit", body)
                assert r.status_code == 400, (depth, r.status_code, r.text[:200])
                assert "nesting" in r.json()["detail"] and "body" in r.json()["detail"]
            unclosed = b'{"requests": [' + opener * 100_000
            assert raw(server.url, "/submit", unclosed).status_code == 400
            ok = b'{"requests": [' + b"[" * 30 + b"]" * 30 + b"]}"  # shallow enough: the model refuses it
            assert raw(server.url, "/submit", ok).status_code == 422
            assert manager.pending() == 0
            assert raw(server.url, "/search", b'{"query": "Sokoban"}').json()["entry"]["text"] == TIP
    finally:
        manager.close()


def test_brackets_inside_strings_do_not_count_as_nesting(served: tuple[str, ExperienceManager]) -> None:
    url, manager = served
    text = '[{"\\"' * 2000 + ' a tip with brackets'
    r = raw(url, "/apply_ops", json.dumps({"ops": [{"kind": "add", "text": text}]}).encode())
    assert r.status_code == 200, r.text
    assert manager.bank.get(r.json()["added_ids"][0]).text == text  # type: ignore[union-attr]


def test_too_many_items_are_refused_before_parsing(served: tuple[str, ExperienceManager]) -> None:
    url, _ = served
    with BackgroundServer(make_manager()) as server:
        body = b'{"queries": [' + b"0," * (MAX_JSON_ITEMS + 1) + b"0]}"
        r = raw(server.url, "/search_many", body)
        assert r.status_code == 413 and "items" in r.json()["detail"], r.text[:200]
        server.app.state.service.close()
    assert raw(url, "/search", b'{"query": "Sokoban"}').status_code == 200


def test_a_starlette_http_exception_keeps_its_status() -> None:
    # the body parser raises Starlette's HTTPException (not FastAPI's subclass) on a body it cannot
    # read; the route guard must answer with its status, not the catch-all 500
    router = APIRouter(route_class=GuardedRoute)

    @router.post("/t")
    async def boom(request: Request) -> None:
        raise StarletteHTTPException(status_code=418, detail="teapot")

    app = FastAPI()
    app.include_router(router)
    r = TestClient(app).post("/t", json={})
    assert r.status_code == 418 and r.json()["detail"] == "teapot"


def test_an_op_the_bank_refuses_is_422_and_writes_nothing(served: tuple[str, ExperienceManager]) -> None:
    # the hashing embedder (dim 32) maps "aij" to the zero vector (its features cancel), which the bank refuses
    url, manager = served
    before = len(manager.bank)
    r = raw(url, "/apply_ops", b'{"ops": [{"kind": "add", "text": "a real tip"}, {"kind": "add", "text": "aij"}]}')
    assert r.status_code == 422 and r.json()["detail"].startswith("ops: "), r.text
    assert len(manager.bank) == before  # atomic: the good op of the batch was not written either
    r = raw(url, "/end_step", b'{"step": 9223372036854775808}')  # steps are signed 64-bit in the bank
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "step"]
    r = raw(url, "/apply_ops", b'{"ops": [{"kind": "add", "text": "tip"}], "step": 9223372036854775808}')
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "step"]
