"""A real ``crl-experience serve`` whose bank's disk fills up, run as a script (see test_disk_faults.py).

``python tests/_disk_faults.py MODE WORK OUT.json``. ``MODE`` is how the disk fills:

* ``tmpfs``: the bank lives on a 16 MiB tmpfs mounted in this process's own mount namespace
  (run it under ``unshare -rm``: root in a user namespace may mount one), filled with a file;
* ``fsize``: the server's file-size limit (``RLIMIT_FSIZE``, set from outside with ``prlimit``)
  is lowered to the bank files' sizes, so every write that grows a file fails (``EFBIG``).

The script writes while the disk is full (ops with a ``write_id``, submits), checks reads and
health, frees the disk, resends the refused writes with the same ids, fills the disk again and
stops the server with SIGTERM; then it reopens the bank itself and reports what it holds. It
asserts nothing: ``OUT.json`` holds what it saw, for the test to judge.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

DIM = 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def a_request(task: str) -> dict[str, Any]:
    return {"task": task, "trajectory": {"steps": [{"observation": "o", "action": "a", "reward": 1.0}]},
            "outcome": 1.0, "success": True, "experience": None, "request_id": uuid.uuid4().hex}


class Disk:
    """Fills and frees the bank's disk, by the mode's means."""

    def __init__(self, mode: str, root: Path) -> None:
        self.mode, self.root = mode, root
        self.filler = root / "filler"
        self.pid = 0

    def fill(self) -> None:
        if self.mode == "fsize":  # no file may grow past the queue's size now (the database is larger)
            limit = (self.root / "bank" / "pending_requests.jsonl").stat().st_size
            resource.prlimit(self.pid, resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
            return
        with open(self.filler, "ab", buffering=0) as f:  # unbuffered: nothing left to fail at close
            for chunk in (1 << 20, 1 << 12, 1):
                try:
                    while True:
                        f.write(b"\0" * chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise

    def free(self) -> None:
        if self.mode == "fsize":
            try:
                resource.prlimit(self.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            except ProcessLookupError:  # it has exited: its limit went with it
                pass
        else:
            self.filler.unlink(missing_ok=True)


def start(bank: Path, port: int, log: list[bytes]) -> subprocess.Popen[bytes]:
    exe = Path(sys.executable).with_name("crl-experience")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "crl_gym.cli"]
    # SIGXFSZ ignored (inherited through exec): a write over the size limit fails with EFBIG
    # instead of killing the server
    proc = subprocess.Popen(
        [*cmd, "serve", "--bank", str(bank), "--port", str(port), "--embedder", f"hashing:{DIM}",
         "--log-level", "warning", "--persist-interval", "0"],
        # stderr through a pipe: a log file would be held to the size limit too
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGXFSZ, signal.SIG_IGN), env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.stderr is not None
    threading.Thread(target=lambda: log.extend(iter(proc.stderr.readline, b"")), daemon=True).start()  # type: ignore[union-attr]
    return proc


def wait_up(c: httpx.Client, proc: subprocess.Popen[bytes]) -> None:
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"the server exited early with {proc.returncode}")
        try:
            if c.get("/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit("the server did not come up")


class Writer:
    """Sends writes and keeps the books: which were acknowledged, which refused (and why)."""

    def __init__(self, c: httpx.Client) -> None:
        self.c = c
        self.acked_texts: list[str] = []
        self.acked_requests: list[str] = []
        self.refused: list[dict[str, Any]] = []
        self.n = 0

    def add(self, text: str | None = None, write_id: str | None = None) -> httpx.Response:
        self.n += 1
        text = text or f"entry {self.n}: " + "push the box along the wall " * 40
        write_id = write_id or uuid.uuid4().hex
        r = self.c.post("/apply_ops", json={"ops": [{"kind": "add", "text": text}], "write_id": write_id})
        if r.status_code == 200:
            self.acked_texts.append(text)
        else:
            self.refused.append({"kind": "ops", "status": r.status_code, "detail": r.json().get("detail"),
                                 "text": text, "write_id": write_id})
        return r

    def submit(self, request: dict[str, Any] | None = None) -> httpx.Response:
        request = request or a_request(f"task {self.n}")
        self.n += 1
        r = self.c.post("/submit", json={"requests": [request]})
        if r.status_code == 200:
            self.acked_requests.append(request["request_id"])
        else:
            self.refused.append({"kind": "submit", "status": r.status_code, "detail": r.json().get("detail"),
                                 "request": request})
        return r


def main(mode: str, work: Path, out: Path) -> None:
    root = work / "disk"
    root.mkdir(parents=True, exist_ok=True)
    if mode == "tmpfs":
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(root)], check=True)
    bank, log = root / "bank", list[bytes]()
    port = free_port()
    report: dict[str, Any] = {"mode": mode}
    disk = Disk(mode, root)
    proc = start(bank, port, log)
    disk.pid = proc.pid
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
        wait_up(c, proc)
        w = Writer(c)
        for _ in range(5):
            w.add()
            w.submit()
        report["before"] = {"acked_texts": len(w.acked_texts), "acked_requests": len(w.acked_requests)}

        disk.fill()
        for _ in range(400):  # until both kinds of write were refused (the WAL may hold a few first)
            w.add()
            w.submit()
            kinds = {r["kind"] for r in w.refused}
            if kinds == {"ops", "submit"} and len(w.refused) >= 4:
                break
        report["health_during"] = c.get("/health").json()
        report["search_during"] = c.post("/search", json={"query": "push the box"}).status_code
        report["stats_during"] = {k: v for k, v in c.get("/stats").json().items() if k in ("bank_size", "queue_depth")}
        report["acked_during"] = {"texts": len(w.acked_texts), "requests": len(w.acked_requests)}
        report["refused"] = [{k: v for k, v in r.items() if k in ("kind", "status", "detail")} for r in w.refused]

        disk.free()
        # resend every refused write but the last of each kind, with the same id: each lands once
        kept_out = {r["kind"]: r for r in w.refused}
        resent = [r for r in w.refused if r is not kept_out[r["kind"]]]
        report["resent"] = []
        for r in resent:
            got = w.add(r["text"], r["write_id"]) if r["kind"] == "ops" else w.submit(r["request"])
            report["resent"].append(got.status_code)
        again = next((r for r in resent if r["kind"] == "ops"), None)
        if again is not None:  # its answer was lost, say: sent a second time
            r2 = c.post("/apply_ops", json={"ops": [{"kind": "add", "text": again["text"]}], "write_id": again["write_id"]})
            report["repeat"] = r2.json()
        report["fresh_after"] = [w.add().status_code, w.submit().status_code]  # new writes go through too
        report["never_resent"] = {"text": kept_out["ops"]["text"], "request_id": kept_out["submit"]["request"]["request_id"]}
        report["health_after"] = c.get("/health").json()
        report["stats_after"] = {k: v for k, v in c.get("/stats").json().items() if k in ("bank_size", "queue_depth")}

        disk.fill()  # the shutdown meets a full disk too
        proc.send_signal(signal.SIGTERM)
        report["rc"] = proc.wait(timeout=120)
    disk.free()
    report["log"] = b"".join(log).decode(errors="replace")
    report["acked_texts"] = w.acked_texts
    report["acked_requests"] = w.acked_requests

    # what the bank holds now, read by a process of its own
    from crl_gym.experience.bank import ExperienceBank
    from crl_gym.experience.distill_queue import DistillQueue

    with ExperienceBank(bank, dim=DIM, create=False) as b:
        report["bank_texts"] = [e.text for e in b]
    queue = DistillQueue(10**6, bank / "pending_requests.jsonl")
    report["queued_ids"] = [r.request_id for r in queue.get(10**6)]
    queue.close()
    out.write_text(json.dumps(report))
    if mode == "tmpfs":
        subprocess.run(["umount", str(root)], check=False)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
