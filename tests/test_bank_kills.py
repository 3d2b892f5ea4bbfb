"""SIGKILL a real ``crl-experience serve`` at random points while writers add entries and submit
requests concurrently, eleven times; each writer resends what was not answered, with the same
id, until it is acknowledged (as :class:`~crl_gym.clients.RemoteClient` does).

Checked on the bank's own files once the server has stopped: every acknowledged entry and
request is there, exactly once (a resend after a kill that came between the write and its
answer is recognised by its id), and nothing else is.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from _servers import free_port

from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.distill_queue import DistillQueue

KILLS = 11
WRITERS = 3
DIM = 64


def start(bank: Path, port: int) -> subprocess.Popen[bytes]:
    exe = Path(sys.executable).with_name("crl-experience")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "crl_gym.cli"]
    return subprocess.Popen([*cmd, "serve", "--bank", str(bank), "--port", str(port), "--embedder", f"hashing:{DIM}",
                             "--log-level", "warning", "--persist-interval", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def wait_up(url: str, proc: subprocess.Popen[bytes]) -> None:
    while True:
        assert proc.poll() is None, f"the server exited with {proc.returncode}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.05)


def a_request(task: str) -> dict[str, Any]:
    return {"task": task, "trajectory": {"steps": [{"observation": "o", "action": "a", "reward": 1.0}]},
            "outcome": 1.0, "success": True, "experience": None, "request_id": uuid.uuid4().hex}


class Writer(threading.Thread):
    """Adds an entry and submits a request per round, each resent with its id until acknowledged."""

    def __init__(self, url: str, n: int, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.url, self.n, self.stop = url, n, stop
        self.texts: list[str] = []
        self.requests: list[str] = []
        self.resent = 0
        self.failure: str | None = None

    def send(self, c: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
        while True:  # the same body (the same id) until the server answers it
            try:
                r = c.post(path, json=body)
            except httpx.HTTPError:
                self.resent += 1
                time.sleep(0.02)
                continue
            if r.status_code >= 500:  # shutting down: resend
                self.resent += 1
                continue
            assert r.status_code == 200, (path, r.status_code, r.text)
            out: dict[str, Any] = r.json()
            return out

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=10) as c:
                i = 0
                while not self.stop.is_set():
                    text = f"writer {self.n} entry {i}: keep the box off the corner"
                    self.send(c, "/apply_ops", {"ops": [{"kind": "add", "text": text}], "write_id": uuid.uuid4().hex})
                    self.texts.append(text)
                    req = a_request(f"writer {self.n} task {i}")
                    self.send(c, "/submit", {"requests": [req]})
                    self.requests.append(req["request_id"])
                    i += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.failure = repr(exc)


def test_eleven_kills_under_concurrent_writers_lose_and_duplicate_nothing_acknowledged(tmp_path: Path) -> None:
    bank, port = tmp_path / "bank", free_port()
    url = f"http://127.0.0.1:{port}"
    rng = random.Random(51)
    proc = start(bank, port)
    wait_up(url, proc)
    stop = threading.Event()
    writers = [Writer(url, n, stop) for n in range(WRITERS)]
    for w in writers:
        w.start()
    try:
        for _ in range(KILLS):
            before = sum(len(w.texts) for w in writers)
            time.sleep(rng.uniform(0.05, 0.5))
            while sum(len(w.texts) for w in writers) == before:  # kill only once writes went through
                assert all(w.is_alive() for w in writers), [w.failure for w in writers]
                time.sleep(0.02)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            proc = start(bank, port)
            wait_up(url, proc)
        stop.set()
        for w in writers:
            w.join(timeout=120)
            assert not w.is_alive() and w.failure is None, w.failure
    finally:
        stop.set()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0

    acked_texts = [t for w in writers for t in w.texts]
    acked_requests = [r for w in writers for r in w.requests]
    assert len(acked_texts) >= KILLS and sum(w.resent for w in writers) > 0
    with ExperienceBank(bank, dim=DIM, create=False) as b:
        texts = Counter(e.text for e in b)
    assert texts == Counter(acked_texts)  # all there, each once, nothing else
    queue = DistillQueue(10**6, bank / "pending_requests.jsonl")
    queued = Counter(r.request_id for r in queue.get(10**6))
    queue.close()
    assert queued == Counter(acked_requests)
