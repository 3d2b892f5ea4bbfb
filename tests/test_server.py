"""The FastAPI app over a real ExperienceManager, its input validation, and the
``crl-experience serve`` command run as a real process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from crl_gym.clients import RemoteClient
from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.embedders import HashingEmbedder
from crl_gym.experience.manager import ExperienceManager
from crl_gym.protocol import DistillationRequest, Step, Trajectory
from crl_gym.server import cli, create_app

TIP = "In Sokoban, push boxes along walls only when the target is on that wall."


@pytest.fixture()
def app_client() -> Iterator[tuple[TestClient, ExperienceManager]]:
    emb = HashingEmbedder(32)
    bank = ExperienceBank(None, dim=32)
    bank.add(TIP, emb.encode([TIP])[0])
    manager = ExperienceManager(bank, emb)
    with TestClient(create_app(manager)) as client:
        yield client, manager
    manager.close()


def a_request() -> DistillationRequest:
    return DistillationRequest(task="t", trajectory=Trajectory(steps=[Step("o", "a", 1.0)]), outcome=1.0, success=True,
                               experience=None, condition="free")


def test_routes(app_client: tuple[TestClient, ExperienceManager]) -> None:
    client, manager = app_client
    assert client.get("/health").json() == {"status": "ok", "pending": 0}
    entry = client.post("/search", json={"query": "Sokoban boxes"}).json()["entry"]
    assert entry["text"] == TIP and set(entry) == {"id", "text", "version"}
    assert client.post("/search_many", json={"queries": ["Sokoban", "boxes"]}).json()["entries"] == [entry, entry]
    assert client.post("/ask", json={"query": "q", "entry": entry, "context": "c"}).json() == {"answer": TIP, "provenance": None}
    req = a_request()
    assert client.post("/submit", json={"requests": [req.to_dict()]}).json() == {"accepted": 1}
    assert manager.pending() == 1
    got = client.post("/get_requests", json={"max_n": 5, "timeout": 0.2}).json()["requests"]
    assert [DistillationRequest.from_dict(d).to_dict() for d in got] == [req.to_dict()]
    assert isinstance(client.get("/stats").json(), dict)


def test_malformed_bodies_are_rejected_naming_the_field(app_client: tuple[TestClient, ExperienceManager]) -> None:
    client, manager = app_client
    r = client.post("/search", json={"q": "x"})
    assert r.status_code == 422 and "query" in r.text
    r = client.post("/ask", json={"query": "q", "entry": {"id": -1, "text": "t"}})
    assert r.status_code == 422 and "id" in r.text
    r = client.post("/get_requests", json={"max_n": 0})
    assert r.status_code == 422 and "max_n" in r.text
    # One bad request rejects the whole batch: nothing half-queued, the caller keeps all of it.
    good = a_request().to_dict()
    bad = {**a_request().to_dict(), "condition": "sometimes"}
    r = client.post("/submit", json={"requests": [good, bad]})
    assert r.status_code == 422 and "requests[1]" in r.text and "condition" in r.text
    r = client.post("/submit", json={"requests": [{"task": "t"}]})
    assert r.status_code == 422 and "requests[0]" in r.text and "trajectory" in r.text
    assert manager.pending() == 0


def test_cli_help_names_the_options() -> None:
    result = CliRunner().invoke(cli, ["serve", "--help"])
    assert result.exit_code == 0
    for option in ("--bank", "--port", "--embedder", "--host"):
        assert option in result.output


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[Any], deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early with {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise AssertionError("server did not become healthy")


def test_serve_command_runs_a_real_server(tmp_path: Path) -> None:
    bank_dir = tmp_path / "bank"
    emb = HashingEmbedder(48)
    with ExperienceBank(bank_dir, dim=48) as bank:  # a persistent bank made beforehand
        bank.add(TIP, emb.encode([TIP])[0])
    port = free_port()
    exe = Path(sys.executable).with_name("crl-experience")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "crl_gym.server"]
    proc = subprocess.Popen(
        [*cmd, "serve", "--bank", str(bank_dir), "--port", str(port), "--embedder", "hashing:48", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        client = RemoteClient(url, timeout=10)
        assert client.search("Sokoban boxes").text == TIP
        client.submit(a_request())
        assert client.health()["pending"] == 1
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_with_a_mismatched_bank_fails_clearly(tmp_path: Path) -> None:
    bank_dir = tmp_path / "bank"
    ExperienceBank(bank_dir, dim=48).close()
    result = CliRunner().invoke(cli, ["serve", "--bank", str(bank_dir), "--embedder", "hashing:32"])
    assert result.exit_code != 0 and "dim" in result.output


def test_docstring_examples_run() -> None:
    import doctest

    import crl_gym.server as module

    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
