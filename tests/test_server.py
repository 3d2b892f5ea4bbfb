"""The FastAPI app over a real RetrievalService: its routes, input validation and token check,
and the ``crl-experience serve`` command (its binding rule, and run as a real process)."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _servers import free_port
from click.testing import CliRunner
from fastapi.testclient import TestClient

from crl_gym.cli import cli, is_loopback, resolve_token
from crl_gym.clients import TOKEN_ENV, ExperienceAuthError, RemoteClient
from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.embedders import HashingEmbedder
from crl_gym.experience.manager import ExperienceManager
from crl_gym.experience.service import StepOrderError
from crl_gym.protocol import AddOp, DistillationRequest, Step, Trajectory
from crl_gym.server import BackgroundServer, create_app

TIP = "In Sokoban, push boxes along walls only when the target is on that wall."


def make_manager() -> ExperienceManager:
    emb = HashingEmbedder(32)
    bank = ExperienceBank(None, dim=32)
    bank.add(TIP, emb.encode([TIP])[0])
    return ExperienceManager(bank, emb)


@pytest.fixture()
def app_client() -> Iterator[tuple[TestClient, ExperienceManager]]:
    manager = make_manager()  # a bare manager is served through a RetrievalService of its own
    with TestClient(create_app(manager)) as client:
        yield client, manager
    manager.close()


def a_request() -> DistillationRequest:
    return DistillationRequest(task="t", trajectory=Trajectory(steps=[Step("o", "a", 1.0)]), outcome=1.0, success=True,
                               experience=None, condition="free")


def test_routes(app_client: tuple[TestClient, ExperienceManager]) -> None:
    client, manager = app_client
    assert client.get("/health").json() == {"status": "ok", "pending": 0, "extractor": None, "storage": None}
    entry = client.post("/search", json={"query": "Sokoban boxes"}).json()["entry"]
    assert entry["text"] == TIP and set(entry) == {"id", "text", "version"}
    assert client.post("/search_many", json={"queries": ["Sokoban", "boxes"]}).json()["entries"] == [entry, entry]
    assert client.post("/ask", json={"query": "q", "entry": entry, "context": "c"}).json() == {"answer": TIP, "provenance": None}
    req = a_request()
    assert client.post("/submit", json={"requests": [req.to_dict()]}).json() == {"accepted": 1, "new": 1}
    # a resend (same request_id) is answered as accepted and not queued again
    assert client.post("/submit", json={"requests": [req.to_dict()]}).json() == {"accepted": 1, "new": 0}
    assert manager.pending() == 1
    got = client.post("/get_requests", json={"max_n": 5, "timeout": 0.2}).json()["requests"]
    # filed under the open rollout step (0): the client gave none
    assert [DistillationRequest.from_dict(d).to_dict() for d in got] == [{**req.to_dict(), "rollout_step": 0}]
    stats = client.get("/stats").json()
    assert stats["bank_size"] == 1 and stats["submitted"] == 1 and stats["queue_depth"] == 0
    for key in ("distilled", "credited", "extractor_updates", "merges"):
        assert stats[key] == 0
    assert client.post("/end_step", json={"step": 0, "bonus": {req.request_id: 1.0}}).json() == {
        "step": 0, "ended": [0], "requests": 1, "credited": 0}
    r = client.post("/end_step", json={"step": 0})
    assert r.status_code == 409 and "already ended" in r.json()["detail"]
    out = client.post("/apply_ops", json={"ops": [{"kind": "add", "text": "Sokoban: count the targets first."},
                                                  {"kind": "return", "reason": "nothing new"}]}).json()
    assert out["added"] == 1 and out["returned"] == 1 and len(manager.bank) == 2
    new_id = out["added_ids"][0]
    out = client.post("/apply_ops", json={"ops": [{"kind": "delete", "id": new_id}], "step": 4}).json()
    assert out["deleted"] == 1 and new_id not in manager.bank


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
    for body, field in (({"step": -1}, "step"), ({"step": "3"}, "step"), ({}, "step"),
                        ({"step": 1, "bonus": {"r": "lots"}}, "bonus")):
        r = client.post("/end_step", json=body)
        assert r.status_code == 422 and field in r.text, body
    for ops, field in (([{"kind": "grow", "text": "x"}], "kind"), ([{"kind": "add"}], "text"),
                       ([{"kind": "add", "text": ""}], "text"), ([{"kind": "update", "id": -2, "text": "x"}], "id"),
                       ([{"kind": "delete"}], "id")):
        r = client.post("/apply_ops", json={"ops": ops})
        assert r.status_code == 422 and field in r.text, ops
    r = client.post("/apply_ops", json={"ops": [], "step": -1})
    assert r.status_code == 422 and "step" in r.text
    assert len(manager.bank) == 1 and client.get("/stats").json()["steps_ended"] == 0


def test_every_route_but_health_needs_the_token() -> None:
    manager = make_manager()
    with TestClient(create_app(manager, token="s3cret-token")) as client:
        assert client.get("/health").json()["status"] == "ok"  # probes need no secret
        calls = [("GET", "/stats", None), ("POST", "/search", {"query": "q"}), ("POST", "/search_many", {"queries": ["q"]}),
                 ("POST", "/ask", {"query": "q", "entry": {"id": 1, "text": "t"}}), ("POST", "/submit", {"requests": []}),
                 ("POST", "/get_requests", {"max_n": 1}), ("POST", "/end_step", {"step": 0}), ("POST", "/apply_ops", {"ops": []})]
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-token"},
                        {"Authorization": "Bearer s3cret-token-and-more"}):
            for method, path, body in calls:
                r = client.request(method, path, json=body, headers=headers)
                assert r.status_code == 401 and "bearer token" in r.json()["detail"], (path, headers)
                assert r.headers["www-authenticate"] == "Bearer"
        assert manager.pending() == 0 and client.get("/health").json()["pending"] == 0
        ok = {"Authorization": "Bearer s3cret-token"}
        for method, path, body in calls:
            assert client.request(method, path, json=body, headers=ok).status_code == 200, path
    manager.close()
    with pytest.raises(ValueError, match="printable ASCII"):
        create_app(make_manager(), token="two words")


def test_remote_client_sends_the_token(monkeypatch: pytest.MonkeyPatch) -> None:
    manager = make_manager()
    with BackgroundServer(manager, token="t0ken") as server:
        monkeypatch.delenv(TOKEN_ENV, raising=False)
        with pytest.raises(ExperienceAuthError, match="no token was sent") as info:
            RemoteClient(server.url).search("Sokoban")
        assert isinstance(info.value, ValueError) and isinstance(info.value, PermissionError)
        with pytest.raises(ExperienceAuthError, match="wrong token"):
            RemoteClient(server.url, token="nope").stats()
        assert RemoteClient(server.url).health().status == "ok"
        assert RemoteClient(server.url, token="t0ken").search("Sokoban").text == TIP
        monkeypatch.setenv(TOKEN_ENV, "t0ken")
        from_env = RemoteClient(server.url)
        assert from_env.token == "t0ken" and from_env.search("Sokoban boxes").text == TIP
        clone = pickle.loads(pickle.dumps(from_env))
        monkeypatch.delenv(TOKEN_ENV)
        assert clone.token == "t0ken" and clone.end_step(0).ended == [0]  # the token travels with it
        assert "t0ken" not in repr(clone)
        with pytest.raises(StepOrderError, match="already ended"):
            clone.end_step(0)
        from_env.close()
        clone.close()
    manager.close()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "example.org"])
def test_serve_refuses_to_bind_beyond_loopback_without_a_token(host: str, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    bank_dir = tmp_path / "bank"
    result = CliRunner().invoke(cli, ["serve", "--bank", str(bank_dir), "--host", host, "--embedder", "hashing:8"])
    assert result.exit_code == 2 and f"refusing to bind {host} without a token" in result.output
    assert TOKEN_ENV in result.output and "--token-file" in result.output
    assert not bank_dir.exists()  # refused before opening anything (and before binding)


def test_loopback_hosts_and_token_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for host in ("127.0.0.1", "127.8.0.1", "::1", "[::1]", "localhost", "LOCALHOST"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.0.0.1", "my-host"):
        assert not is_loopback(host), host
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert resolve_token(None) is None
    monkeypatch.setenv(TOKEN_ENV, "  from-env\n")
    assert resolve_token(None) == "from-env"
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    assert resolve_token(str(token_file)) == "from-file"  # the file wins over the env
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    result = CliRunner().invoke(cli, ["serve", "--bank", str(tmp_path / "b"), "--token-file", str(empty)])
    assert result.exit_code == 2 and "is empty" in result.output and not (tmp_path / "b").exists()


def test_serve_extractor_without_crl_train_fails_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # makes the import fail, also when an earlier test already imported the module the command loads
    monkeypatch.setitem(sys.modules, "crl_train.service", None)
    monkeypatch.setitem(sys.modules, "crl_train.serve", None)
    result = CliRunner().invoke(cli, ["serve", "--bank", str(tmp_path / "bank"), "--extractor", "tiny"])
    assert result.exit_code == 1 and "--extractor needs the crl_train package" in result.output


def test_cli_help_names_the_options() -> None:
    result = CliRunner().invoke(cli, ["serve", "--help"])
    assert result.exit_code == 0
    for option in ("--bank", "--port", "--embedder", "--host", "--extractor", "--token-file"):
        assert option in result.output


def test_python_m_crl_gym_server_still_runs_the_command() -> None:
    """Scripts written before the command moved to ``crl_gym.cli`` keep working."""
    out = subprocess.run([sys.executable, "-m", "crl_gym.server", "serve", "--help"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr
    assert "--bank" in out.stdout and "--token-file" in out.stdout


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
    """A real ``crl-experience serve`` with a token: serves, and on SIGTERM closes the service
    (queue persisted, bank flushed) and exits 0."""
    bank_dir = tmp_path / "bank"
    emb = HashingEmbedder(48)
    with ExperienceBank(bank_dir, dim=48) as bank:  # a persistent bank made beforehand
        bank.add(TIP, emb.encode([TIP])[0])
    token_file = tmp_path / "token"
    token_file.write_text("cli-token\n")
    port = free_port()
    exe = Path(sys.executable).with_name("crl-experience")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "crl_gym.cli"]
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    proc = subprocess.Popen(
        [*cmd, "serve", "--bank", str(bank_dir), "--port", str(port), "--embedder", "hashing:48", "--log-level", "warning",
         "--token-file", str(token_file)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**env, "HF_HUB_OFFLINE": "1"},
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        client = RemoteClient(url, timeout=10, token="cli-token")
        assert client.search("Sokoban boxes").text == TIP
        client.submit(a_request())
        client.flush()  # submit only buffers; the sender thread delivers
        assert client.health().pending == 1
        assert client.apply_ops([AddOp("Sokoban: solve the corner box first.")]).added == 1
        assert client.end_step(0).requests == 1
        with pytest.raises(ExperienceAuthError):
            RemoteClient(url, timeout=10, token="other").search("x")
        client.close()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "bank closed" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    with ExperienceBank(bank_dir, dim=48) as bank:  # reopenable, with what the server wrote
        assert len(bank) == 2 and {e.text for e in bank} == {TIP, "Sokoban: solve the corner box first."}
    manager = ExperienceManager(ExperienceBank(bank_dir, dim=48), emb)
    assert manager.pending() == 1  # the queued request was persisted on the way out
    manager.close()
    manager.bank.close()


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


def test_a_sigkill_loses_no_request_queued_before_the_persist_interval(tmp_path: Path) -> None:
    """Queued requests are checkpointed every ``--persist-interval`` s: after a SIGKILL (no
    shutdown at all) the bank dir's spill file holds every request submitted before it."""
    bank_dir = tmp_path / "bank"
    port = free_port()
    exe = Path(sys.executable).with_name("crl-experience")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "crl_gym.cli"]
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    proc = subprocess.Popen(
        [*cmd, "serve", "--bank", str(bank_dir), "--port", str(port), "--embedder", "hashing:32", "--log-level",
         "warning", "--persist-interval", "0.2"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**env, "HF_HUB_OFFLINE": "1"},
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        client = RemoteClient(url, timeout=10)
        sent = [DistillationRequest(task=f"task {i}", trajectory=Trajectory(steps=[Step("o", "a", 1.0)]), outcome=1.0,
                                    success=True, experience=None) for i in range(7)]
        for r in sent[:3]:
            client.submit(r)
        client.flush()
        assert [r.task for r in client.get_requests(1)] == ["task 0"]  # taken: not pending any more
        for r in sent[3:]:
            client.submit(r)
        client.flush()
        assert client.health().pending == 6
        time.sleep(1.0)  # > the persist interval
        client.close()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    manager = ExperienceManager(ExperienceBank(bank_dir, dim=32), HashingEmbedder(32))
    try:
        assert [r.task for r in manager.get_requests(100)] == [f"task {i}" for i in range(1, 7)]
    finally:
        manager.close()
        manager.bank.close()
