"""Property-based fuzz of every route of the experience server, generated from the app's own
OpenAPI schema by schemathesis (positive and negative cases: bodies that fit the models and
bodies that break them), sent to a real ``crl-experience serve`` process on loopback with a token.

Promises checked on each of the >= 2,000 generated requests: no 5xx; every 4xx names its field
(a validation error's ``loc``, or the body field / ``body`` in its message); and the neighbours
of a bad request are unharmed: a well-formed search and submit sent between generated requests,
and another thread searching and submitting all along, get their answers, and the server's
stats at the end add up to what the accepted requests did. Generation is derandomised, so a run
in CI is the same every time; set ``CRL_FUZZ_EXAMPLES`` for a longer run.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from test_server import free_port, wait_healthy

from crl_gym.clients import TOKEN_ENV
from crl_gym.protocol import DistillationRequest, Step, Trajectory

TOKEN = "fuzz-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
EXAMPLES = int(os.environ.get("CRL_FUZZ_EXAMPLES", "95"))
"""Generated cases per route and generation mode (positive / negative)."""
MIN_REQUESTS = 2000
ADMIN_ROUTES = ("/restore", "/quarantine")
"""Routes that replace or hide the bank's entries wholesale (their answers are checked, not their effect)."""
GET_REQUESTS_WAIT_S = 0.05
"""``/get_requests`` may wait up to 60 s on an empty queue; the fuzz waits at most this long."""


def a_request(task: str) -> dict[str, Any]:
    return DistillationRequest(task=task, trajectory=Trajectory(steps=[Step("o", "a", 1.0)]), outcome=1.0,
                               success=True, experience=None).to_dict()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("fuzz")
    token_file = work / "token"
    token_file.write_text(TOKEN + "\n")
    port = free_port()
    exe = Path(sys.executable).with_name("crl-experience")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "crl_gym.cli"]
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    proc = subprocess.Popen(
        [*cmd, "serve", "--bank", str(work / "bank"), "--port", str(port), "--embedder", "hashing:64",
         "--log-level", "warning", "--token-file", str(token_file), "--persist-interval", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**env, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-4000:]
        assert "Traceback" not in err, err[-4000:]  # nothing failed inside the server either
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def route_fields(spec: dict[str, Any], path: str, method: str) -> set[str]:
    """The names a route's callers set: its query / path parameters and its JSON body's top-level
    fields, from the OpenAPI document."""
    op = spec["paths"][path][method]
    names = {p["name"] for p in op.get("parameters", [])}
    schema = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
    if "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
    return names | set(schema.get("properties", {}))


def names_its_field(detail: Any, fields: set[str], path_parameters: dict[str, Any] | None) -> bool:
    """Whether a 4xx ``detail`` says which part of the request was wrong: the field, or (a 404)
    the resource the path named."""
    if isinstance(detail, list):  # pydantic's errors: each with the path of the bad value
        return bool(detail) and all(isinstance(d, dict) and d.get("loc") and d.get("msg") for d in detail)
    text = str(detail)
    named = [form for v in (path_parameters or {}).values() for form in (str(v), unquote(str(v)), repr(unquote(str(v))))]
    return "body" in text or any(f in text for f in fields) or any(v in text for v in named)


class Ledger:
    """What the accepted requests did to the queue and the bank, to check the stats against."""

    def __init__(self, queue: int, bank: int) -> None:
        self.queue, self.bank = queue, bank
        self.lock = threading.Lock()

    def after(self, path: str, status: int, out: Any) -> None:
        if status != 200:
            return
        with self.lock:
            if path == "/submit":
                self.queue += out["new"]  # a resent request_id is not queued again
            elif path == "/get_requests":
                self.queue -= len(out["requests"])
            elif path == "/apply_ops" and not out["repeated"]:  # a resent write_id: the first call's answer
                self.bank += out["added"] - out["deleted"]


def neighbours(url: str, ledger: Ledger, stop: threading.Event, failures: list[str], done: Counter[str]) -> None:
    """Well-formed calls from another client while the fuzz runs: each must succeed."""
    with httpx.Client(base_url=url, headers=AUTH, timeout=30) as c:
        i = 0
        while not stop.is_set():
            r = c.post("/search", json={"query": f"neighbour {i}"})
            if r.status_code != 200 or "entry" not in r.json():
                failures.append(f"search: {r.status_code} {r.text[:200]}")
            r = c.post("/submit", json={"requests": [a_request(f"neighbour {i}")]})
            if r.status_code != 200 or r.json() != {"accepted": 1, "new": 1}:
                failures.append(f"submit: {r.status_code} {r.text[:200]}")
            else:
                ledger.after("/submit", 200, r.json())
            done["neighbour"] += 2
            i += 1
            stop.wait(0.05)


def fuzz_route(op: Any, fields: set[str], server: str, session: requests.Session, ledger: Ledger,
               sent: Counter[str], statuses: Counter[int]) -> None:
    """Send ``op``'s generated cases (positive and negative) and check each answer."""
    key = f"{op.method.upper()} {op.path}"

    # no shrinking: a failure is reported as generated, and a CI run stays short
    @settings(max_examples=EXAMPLES * 2, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=st.one_of(op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE)))
    def fuzz(case: Any) -> None:
        if op.path == "/get_requests" and isinstance(case.body, dict):
            t = case.body.get("timeout")
            if isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > GET_REQUESTS_WAIT_S:
                case.body["timeout"] = GET_REQUESTS_WAIT_S
        response = case.call(base_url=server, session=session, headers=AUTH, timeout=30)
        sent[key] += 1
        statuses[response.status_code] += 1
        assert response.status_code < 500, (key, case.body, response.status_code, response.text[:500])
        if 400 <= response.status_code < 500:
            detail = json.loads(response.content)["detail"]
            assert names_its_field(detail, fields, case.path_parameters), (key, case.body, response.status_code, detail)
        else:
            ledger.after(op.path, response.status_code, json.loads(response.content))
        if sent[key] % 25 == 0:  # the next caller, right after a (possibly bad) request
            r = session.post(server + "/search", json={"query": "Sokoban walls"}, headers=AUTH, timeout=30)
            # (a quarantine may have hidden every entry: then the answer is "none found")
            assert r.status_code == 200 and (r.json()["entry"] is not None or op.path in ADMIN_ROUTES), r.text[:200]
            sent["neighbour"] += 1

    fuzz()


def test_every_route_answers_generated_requests_without_a_5xx_and_names_the_field(server: str) -> None:
    spec = requests.get(server + "/openapi.json", timeout=10).json()
    schema = schemathesis.openapi.from_url(server + "/openapi.json", timeout=10)
    operations = [result.ok() for result in schema.get_all_operations()]
    routes = {f"{op.method.upper()} {op.path}" for op in operations}
    assert {"POST /search", "POST /submit", "POST /get_requests", "POST /end_step", "POST /apply_ops",
            "GET /stats", "GET /health"} <= routes, routes
    # a bank that search can find something in, so searches walk the whole pipeline
    with httpx.Client(base_url=server, headers=AUTH, timeout=30) as c:
        assert c.post("/apply_ops", json={"ops": [{"kind": "add", "text": "Sokoban: push along walls."}]}).status_code == 200
        start = c.get("/stats").json()
    ledger = Ledger(start["queue_depth"], start["bank_size"])
    sent: Counter[str] = Counter()
    statuses: Counter[int] = Counter()
    failures: list[str] = []
    session = requests.Session()
    stop = threading.Event()
    other = threading.Thread(target=neighbours, args=(server, ledger, stop, failures, sent), daemon=True)
    other.start()
    # the bank's administration (restore, quarantine) changes the bank as a whole: fuzzed after the
    # ledger's check below, which the other routes' accepted requests must add up to
    admin = [op for op in operations if op.path in ADMIN_ROUTES]
    try:
        for op in operations:
            if op not in admin:
                fuzz_route(op, route_fields(spec, op.path, op.method.lower()), server, session, ledger, sent, statuses)
    finally:
        stop.set()
        other.join(60)
    with httpx.Client(base_url=server, headers=AUTH, timeout=30) as c:
        end = c.get("/stats").json()
    assert (end["queue_depth"], end["bank_size"]) == (ledger.queue, ledger.bank), (end, vars(ledger))
    assert {f"POST {r}" for r in ADMIN_ROUTES} <= {f"{op.method.upper()} {op.path}" for op in admin}
    for op in admin:
        fuzz_route(op, route_fields(spec, op.path, op.method.lower()), server, session, ledger, sent, statuses)
    print("\nfuzz requests per route:", json.dumps(dict(sorted(sent.items()))), "statuses:",
          json.dumps(dict(sorted(statuses.items()))))
    assert not failures, failures[:5]
    generated = sum(n for k, n in sent.items() if k != "neighbour")
    assert generated >= MIN_REQUESTS and all(sent[r] > 0 for r in routes), sent
    assert not any(s >= 500 for s in statuses) and any(400 <= s < 500 for s in statuses), statuses
