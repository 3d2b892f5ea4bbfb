"""Faults: hard kills of a bank writer and of the server, and hostile requests under load.

Loopback only (127.0.0.1), bounded in time (``--max-seconds`` stops starting new trials). Parts:

* ``bank``: ``--bank-trials`` times, a child process writes entries to a bank on disk through
  ``ExperienceManager.apply_ops`` and prints each entry's text once ``apply_ops`` has returned (an
  *acknowledged* write); it is SIGKILLed at a random moment. The bank is reopened and every
  acknowledged text that is missing is a *lost write* (target: 0).
* ``serve``: ``--serve-trials`` times each, a real ``crl-experience serve`` (``--persist-interval
  W``) gets distillation requests from a submitting thread (each ``submit`` then ``flush``: acknowledged
  once the server answered it), then SIGTERM or SIGKILL. The bank dir's
  queue is reopened and compared with the acknowledged submits. SIGTERM: every one must be there
  (target: 0 lost). SIGKILL: a request acknowledged within the stated window (W + 0.2 s of
  scheduling slack) before the kill may be lost; one acknowledged earlier is *lost beyond the
  window* (target: 0).
* ``hostile``: ``--clients`` threads make ``--requests`` calls each against one server; a
  ``--hostile-fraction`` of them are hostile (a body above ``--max-body-bytes``, bad JSON, lone
  surrogates, a query of 200,000 characters), the rest well-formed ``/search`` calls. Reported:
  the success rate and p99 latency of the well-formed calls (target: 100 % answered), and the
  status codes of the hostile ones (none may be a 5xx).

    python bench/faults.py --json                 # last line: one JSON object
    python bench/faults.py --bank-trials 2 --serve-trials 1 --clients 4 --requests 10 --json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from crl_gym.cli import build_manager  # noqa: E402
from crl_gym.clients import TOKEN_ENV, RemoteClient  # noqa: E402
from crl_gym.protocol import AddOp, DistillationRequest, Step, Trajectory  # noqa: E402

EMBEDDER = "hashing:64"
TARGETS = {"lost_writes": 0, "lost_requests_sigterm": 0, "lost_requests_beyond_window": 0,
           "well_formed_success_rate": 1.0}
SLACK_S = 0.2
"""Scheduling slack added to the persist interval for the SIGKILL window (timer jitter, the fsync)."""


def writer_child(bank_dir: str) -> None:
    """The process killed in the ``bank`` part: one acknowledged add per printed line."""
    manager = build_manager(bank_dir, EMBEDDER)
    i = 0
    while True:
        text = f"entry {os.getpid()}-{i}: keep the key before opening the door"
        manager.apply_ops([AddOp(text)])
        print(text, flush=True)
        i += 1


def bank_trial(work: Path, rng: random.Random) -> dict[str, int]:
    bank_dir = work / f"bank-{rng.randrange(10**9)}"
    proc = subprocess.Popen([sys.executable, __file__, "--writer", str(bank_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    acked: list[str] = []
    first = proc.stdout.readline()  # started and wrote once
    if first:
        acked.append(first.rstrip("\n"))
    time.sleep(rng.uniform(0.05, 0.4))
    proc.send_signal(signal.SIGKILL)
    acked += [line.rstrip("\n") for line in proc.stdout if line.endswith("\n")]  # printed before the kill
    proc.wait(30)
    manager = build_manager(bank_dir, EMBEDDER)
    try:
        present = {e.text for e in manager.bank}
    finally:
        manager.close()
        manager.bank.close()
    return {"acknowledged": len(acked), "lost": sum(t not in present for t in acked)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``crl-experience serve`` on 127.0.0.1 (no token: loopback), in a subprocess."""

    def __init__(self, bank_dir: Path, *extra: str, startup_s: float = 60.0) -> None:
        exe = Path(sys.executable).with_name("crl-experience")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "crl_gym.cli"]
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
        self.proc = subprocess.Popen([*cmd, "serve", "--bank", str(bank_dir), "--port", str(port), "--embedder",
                                      EMBEDDER, "--log-level", "error", *extra],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + startup_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"crl-experience serve exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("crl-experience serve did not start")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def a_request(i: int) -> DistillationRequest:
    return DistillationRequest(task=f"task {i}", trajectory=Trajectory(steps=[Step("look", "go north", 1.0)]),
                               outcome=1.0, success=True, experience=None, request_id=f"req-{i}")


def serve_trial(work: Path, sig: signal.Signals, persist_s: float, rng: random.Random) -> dict[str, Any]:
    bank_dir = work / f"serve-{sig.name}-{rng.randrange(10**9)}"
    server = Server(bank_dir, "--persist-interval", str(persist_s))
    acked: list[tuple[str, float]] = []
    stop = threading.Event()

    def submitter() -> None:
        # submit only buffers: acknowledged = flushed, the server answered the request's POST.
        # No retries: the kill ends the loop at once (what it held is spilled to the trial dir).
        client = RemoteClient(server.url, timeout=10, retries=0, spill_path=bank_dir.with_suffix(".unsent.jsonl"))
        i = 0
        try:
            while not stop.is_set():
                req = a_request(i)
                client.submit(req)
                client.flush()
                acked.append((req.request_id, time.monotonic()))
                i += 1
        except Exception:  # noqa: BLE001 - the server was killed under it
            pass
        finally:
            client.close()

    thread = threading.Thread(target=submitter, daemon=True)
    thread.start()
    time.sleep(rng.uniform(2 * persist_s, 4 * persist_s) + 0.2)
    if sig == signal.SIGTERM:
        stop.set()
        thread.join(30)  # SIGTERM after the last acknowledged submit: all of them must survive
    kill_at = time.monotonic()
    server.proc.send_signal(sig)
    rc = server.proc.wait(60)
    stop.set()
    thread.join(30)
    manager = build_manager(bank_dir, EMBEDDER)
    try:
        found = {r.request_id for r in manager.get_requests(10**6)}
    finally:
        manager.close()
        manager.bank.close()
    window = persist_s + SLACK_S
    lost = [(rid, t) for rid, t in acked if rid not in found]
    return {"acknowledged": len(acked), "lost": len(lost), "exit_code": rc,
            "lost_beyond_window": sum(t < kill_at - window for _, t in lost)}


HOSTILE = ("oversized", "bad_json", "surrogates", "huge_query", "chunked_oversized")


def hostile_load(work: Path, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    server = Server(work / "hostile", "--max-body-bytes", str(args.max_body_bytes))
    try:
        with httpx.Client(timeout=30) as c:
            ops = [{"kind": "add", "text": f"tip {i}: push the box along the wall"} for i in range(50)]
            c.post(server.url + "/apply_ops", json={"ops": ops}).raise_for_status()
        lat: list[float] = []
        good_fail = [0]
        hostile_codes: dict[str, dict[str, int]] = {h: {} for h in HOSTILE}
        lock = threading.Lock()
        plans = [[rng.choice(HOSTILE) if rng.random() < args.hostile_fraction else None for _ in range(args.requests)]
                 for _ in range(args.clients)]
        big = b'{"query": "' + b"x" * (args.max_body_bytes + 1024) + b'"}'

        def chunks() -> Any:
            for _ in range(args.max_body_bytes // 4096 + 2):
                yield b" " * 4096

        def client(plan: list[str | None]) -> None:
            with httpx.Client(timeout=30, headers={"content-type": "application/json"}) as c:
                for j, kind in enumerate(plan):
                    url = server.url + "/search"
                    try:
                        if kind is None:
                            t0 = time.perf_counter()
                            r = c.post(url, json={"query": f"how do I push box {j}"})
                            dt = (time.perf_counter() - t0) * 1000
                            ok = r.status_code == 200 and r.json().get("entry") is not None
                            with lock:
                                lat.append(dt)
                                good_fail[0] += not ok
                            continue
                        if kind == "oversized":
                            r = c.post(url, content=big)
                        elif kind == "chunked_oversized":
                            r = c.post(url, content=chunks())
                        elif kind == "bad_json":
                            r = c.post(url, content=b'{"query": "unterminated')
                        elif kind == "surrogates":
                            r = c.post(url, content=b'{"query": "\\ud800 box \\udfff"}')
                        else:
                            r = c.post(url, json={"query": "push " * 40_000})
                        code = str(r.status_code)
                    except httpx.HTTPError as exc:
                        if kind is None:
                            with lock:
                                good_fail[0] += 1
                            continue
                        code = type(exc).__name__  # the server may close on an oversized body
                    with lock:
                        hostile_codes[kind][code] = hostile_codes[kind].get(code, 0) + 1

        threads = [threading.Thread(target=client, args=(p,)) for p in plans]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(args.max_seconds)
        wall = time.perf_counter() - t0
        well_formed = sum(k is None for p in plans for k in p)
        answered = len(lat) - good_fail[0]
        lat.sort()
        return {"well_formed": well_formed, "answered": answered,
                "success_rate": round(answered / well_formed, 4) if well_formed else 1.0,
                "p50_ms": round(statistics.median(lat), 2) if lat else None,
                "p99_ms": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 2) if lat else None,
                "hostile": sum(k is not None for p in plans for k in p), "hostile_codes": hostile_codes,
                "hostile_5xx": sum(n for codes in hostile_codes.values() for c, n in codes.items() if c.startswith("5")),
                "wall_s": round(wall, 2)}
    finally:
        server.kill()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--writer", help=argparse.SUPPRESS)
    p.add_argument("--bank-trials", type=int, default=10)
    p.add_argument("--serve-trials", type=int, default=3, help="Trials per signal (SIGTERM, SIGKILL).")
    p.add_argument("--persist-interval", type=float, default=0.5)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=100, help="Calls per client in the hostile load.")
    p.add_argument("--hostile-fraction", type=float, default=0.2)
    p.add_argument("--max-body-bytes", type=int, default=1024 * 1024)
    p.add_argument("--max-seconds", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.writer:
        writer_child(args.writer)
        return {}
    rng = random.Random(args.seed)
    t_start = time.perf_counter()
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="crl_faults_") as tmp:
        work = Path(tmp)
        bank = []
        for i in range(args.bank_trials):
            if time.perf_counter() - t_start > args.max_seconds / 3:
                notes.append(f"bank: stopped after {i} trials (--max-seconds)")
                break
            bank.append(bank_trial(work, rng))
        serve: dict[str, list[dict[str, Any]]] = {"SIGTERM": [], "SIGKILL": []}
        for i in range(args.serve_trials):
            if time.perf_counter() - t_start > 2 * args.max_seconds / 3:
                notes.append(f"serve: stopped after {i} trials per signal (--max-seconds)")
                break
            for sig in (signal.SIGTERM, signal.SIGKILL):
                serve[sig.name].append(serve_trial(work, sig, args.persist_interval, rng))
        hostile = hostile_load(work, args, rng)
    term, kill = serve["SIGTERM"], serve["SIGKILL"]
    result: dict[str, Any] = {
        "bank": {"trials": len(bank), "acknowledged_writes": sum(b["acknowledged"] for b in bank),
                 "lost_writes": sum(b["lost"] for b in bank)},
        "serve": {"persist_interval_s": args.persist_interval, "window_s": args.persist_interval + SLACK_S,
                  "sigterm": {"trials": len(term), "acknowledged": sum(t["acknowledged"] for t in term),
                              "lost": sum(t["lost"] for t in term), "exit_codes": [t["exit_code"] for t in term]},
                  "sigkill": {"trials": len(kill), "acknowledged": sum(t["acknowledged"] for t in kill),
                              "lost_within_window": sum(t["lost"] - t["lost_beyond_window"] for t in kill),
                              "lost_beyond_window": sum(t["lost_beyond_window"] for t in kill)}},
        "hostile": hostile,
    }
    result.update({
        "acknowledged_writes": result["bank"]["acknowledged_writes"],
        "lost_writes": result["bank"]["lost_writes"],
        "lost_requests_sigterm": result["serve"]["sigterm"]["lost"],
        "lost_requests_beyond_window": result["serve"]["sigkill"]["lost_beyond_window"],
        "well_formed_success_rate": hostile["success_rate"],
        "well_formed_p99_ms": hostile["p99_ms"],
    })
    result["meets_targets"] = (result["lost_writes"] == 0 and result["lost_requests_sigterm"] == 0
                               and result["lost_requests_beyond_window"] == 0
                               and result["well_formed_success_rate"] >= 1.0 and hostile["hostile_5xx"] == 0
                               and all(c == 0 for c in result["serve"]["sigterm"]["exit_codes"]))
    if notes:
        result["note"] = notes
    result["runtime_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
