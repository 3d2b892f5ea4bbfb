"""The experience service's two faces under a storm: HTTP (``crl-experience serve``) vs in process.

A 10,000-entry bank (``bench/retrieval.py``'s texts, embedded with the bundled MiniLM; the
embeddings are cached on disk as that script does) is served by a real ``crl-experience serve``
subprocess on 127.0.0.1 (loopback only, with a bearer token), and the same bank is opened in this
process behind a ``LocalClient``. ``--clients`` threads (1,024) are released at once by a barrier,
each making one call; its latency is timed from the release to the answer. Cases:

* ``warm``: searches for 16 task texts cycled over the clients (the embedding cache answers: what
  a training step costs once its tasks have been seen);
* ``cold``: searches for as many distinct task texts as clients, new in every round (so every one
  is embedded); ``embed_floor_ms`` is one batched encode of the same texts in this process,
  the least any server could take to answer the last of them, and ``cold_over_floor`` the
  mean latency over that floor;
* ``submit``: every client submits one ``DistillationRequest`` (an 8-turn episode). The latency
  is what the caller waits for (``RemoteClient.submit`` returns once the request is in its
  buffer); ``delivered_ms`` is the time from the release until ``flush`` returned, i.e. until
  the server had all of them (per round: ``rounds[i].delivered_ms``; ``cpu_ms`` covers it too);
* ``warm_uncombined`` (no target): ``warm`` with one ``RemoteClient`` per thread, as 1,024
  ``AsyncVectorEnv`` worker processes would each have: 1,024 HTTP requests, only the server's
  coalescing batches them.

HTTP clients share one ``RemoteClient`` (its pool keeps a connection alive per concurrent
caller, it combines concurrent searches into one request and sends submits in batches from its
sender thread, as a trainer's env threads would get);
in-process clients share one ``LocalClient``. ``cpu_ms`` is the CPU time per round of the server
process and of this process (the clients), from ``/proc``, from the release to the last answer:
the cost of a round, which other load on a shared machine changes far less than latencies. Each round runs both faces back to
back (order alternating), after ``--warmup`` untimed rounds per face (connections opened, caches
and torch warmed; one for ``cold``, whose rounds are long). Both processes freeze their start-up
heap (``gc.freeze``) so that a full collection of torch's objects (~250 ms) does not land in a
round. This process runs with a 0.5 ms GIL switch interval (``--switch-interval``): with
CPython's 5 ms, 1,024 threads woken at once convoy on the GIL, and the threads that answer
them (the manager's batcher, the client's batch sender) wait behind the herd: the median warm
round of *both* faces was ~52 / 56 ms mean with 5 ms and 1.3 / 7.6 ms with 0.5 ms (in process /
HTTP, same run, interleaved).
Between rounds the queue is drained and the
step ended, untimed. ``mean_ms`` / ``p99_ms`` / ``qps`` are the HTTP face's over all rounds,
``local`` the in-process face's, ``http_over_local`` the ratio of the means; ``rounds`` lists each
round's HTTP mean and p99 (and the in-process mean of the same round: a round where both are
slow was slowed by other load), ``median_round`` the median over rounds of each round's mean and
p99, and ``noise`` the spread of the round means ((max − min) / median). ``meets_targets`` checks
the targets on the pooled figures, ``meets_targets_median_round`` on the median round.

    python bench/service.py --json                     # last line: one JSON object
    python bench/service.py --entries 200 --clients 32 --embedder hashing:64 --rounds 1 --json
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.util
import json
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from crl_gym.clients import TOKEN_ENV, LocalClient, RemoteClient  # noqa: E402
from crl_gym.experience.bank import ExperienceBank, PendingAdd  # noqa: E402
from crl_gym.experience.embedders import Embedder, load_embedder  # noqa: E402
from crl_gym.experience.manager import ExperienceManager  # noqa: E402
from crl_gym.experience.service import RetrievalService  # noqa: E402
from crl_gym.protocol import DistillationRequest, ExperienceRef, Step, Trajectory  # noqa: E402

TARGETS = {"warm_p99_ms": 100.0, "cold_over_floor": 1.3, "submit_p99_ms": 20.0}
WARM_TEXTS = 16
CASES = ("warm", "cold", "submit", "warm_uncombined")


def _retrieval_module() -> Any:
    """``bench/retrieval.py`` (its bank texts, task texts and embedding cache are shared)."""
    spec = importlib.util.spec_from_file_location("retrieval_bench", Path(__file__).with_name("retrieval.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


RETRIEVAL = _retrieval_module()


def bank_vectors(emb: Embedder, texts: list[str], cache_dir: Path) -> np.ndarray:
    """Embeddings of ``texts``, cached under the same key as ``bench/retrieval.py``'s."""
    key = hashlib.sha256((repr(emb) + "\n".join(texts)).encode()).hexdigest()[:16]
    f = cache_dir / f"retrieval_bank_{key}.npy"
    if f.exists():
        return np.asarray(np.load(f), dtype=np.float32)
    t0 = time.perf_counter()
    vecs = np.concatenate([emb.encode(texts[i:i + 256]) for i in range(0, len(texts), 256)])
    print(f"embedded {len(texts)} bank texts in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if not repr(emb).startswith("HashingEmbedder"):  # cheap to recompute: not worth a file
        cache_dir.mkdir(parents=True, exist_ok=True)
        np.save(f, vecs)
    return vecs


def fill_bank(path: Path | None, texts: list[str], vecs: np.ndarray) -> ExperienceBank:
    bank = ExperienceBank(path, dim=int(vecs.shape[1]))
    bank.apply_batch([PendingAdd(t, v) for t, v in zip(texts, vecs, strict=True)])
    return bank


def warm_queries(n: int) -> list[str]:
    return [RETRIEVAL.task_texts(WARM_TEXTS)[i % WARM_TEXTS] for i in range(n)]


def cold_queries(n: int, tag: str) -> list[str]:
    """``n`` task texts no cache has seen (``tag`` names the round and face)."""
    return [f"{t} (episode {tag}-{j})" for j, t in enumerate(RETRIEVAL.task_texts(n))]


def episode(j: int, tag: str) -> DistillationRequest:
    """A finished 8-turn guided episode, as an ExperienceWrapper would submit it."""
    steps = [Step(f"You are in a 5x5 room. The stairs are {k} steps east. You see a fountain.", "east", 0.0,
                  {"turn": k}) for k in range(7)]
    steps.append(Step("You reach the stairs.", "east", 1.0, {"turn": 7, "success": True}))
    traj = Trajectory(steps=steps, initial_observation="You are in a 5x5 room.")
    entry = ExperienceRef(id=1 + j % 100, text=f"Tip {j}: walk east along the wall.", version=0)
    return DistillationRequest(task=f"Task {tag}-{j}: reach the stairs", trajectory=traj, outcome=1.0, success=True,
                               experience=entry, condition="guided", env_id="crl/MiniHack-Room-5x5-v0", seed=j)


def run_round(fn: Callable[[Any], Any], args: Sequence[Any], timeout_s: float,
              probe: Callable[[], tuple[float, ...]] | None = None,
              finish: Callable[[], Any] | None = None) -> tuple[list[float], float, int, tuple[float, ...], float]:
    """Release one thread per item of ``args`` at once, each calling ``fn(arg)``, then ``finish()``
    (e.g. a client's ``flush``) once every call has returned.

    Returns the per-call latencies (s; failed calls excluded), the wall time from the release to
    the last answer, how many calls failed, how much each counter of ``probe()`` (CPU seconds)
    grew from the release to the end of ``finish`` (thread start-up is not counted), and the
    time from the release to the end of ``finish`` (the wall time when there is none).
    Bounded: the barrier and every join time out.
    """
    n = len(args)
    lat: list[float | None] = [None] * n
    errors: list[BaseException] = []
    barrier = threading.Barrier(n + 1, timeout=timeout_s)

    def worker(i: int) -> None:
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            return
        t0 = time.perf_counter()
        try:
            fn(args[i])
        except Exception as exc:  # noqa: BLE001 - counted and reported
            errors.append(exc)
            return
        lat[i] = time.perf_counter() - t0

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    before = probe() if probe is not None else ()
    deadline = t0 + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.perf_counter()))
    wall = time.perf_counter() - t0
    failed_finish = 0
    if finish is not None:
        try:
            finish()
        except Exception as exc:  # noqa: BLE001 - counted and reported
            failed_finish = 1
            print(f"  finishing the round failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    finished = time.perf_counter() - t0
    grew = tuple(b - a for a, b in zip(before, probe(), strict=True)) if probe is not None else ()
    if errors:
        print(f"  {len(errors)} calls failed, e.g. {type(errors[0]).__name__}: {errors[0]}", file=sys.stderr)
    done = [x for x in lat if x is not None]
    return done, wall, n - len(done) + failed_finish, grew, finished


def summary(lat: list[float], walls: list[float]) -> dict[str, float]:
    if not lat:
        return {"mean_ms": float("nan"), "p99_ms": float("nan"), "qps": 0.0}
    ms = sorted(x * 1000 for x in lat)
    return {"mean_ms": round(statistics.fmean(ms), 3), "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 3),
            "qps": round(len(lat) / max(sum(walls), 1e-9), 1)}


def process_cpu_s(pid: int | None = None) -> float:
    """User + system CPU seconds of process ``pid`` (this one when None), all threads."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """``crl-experience serve`` on 127.0.0.1 in a subprocess, with a token; stopped by SIGTERM."""

    def __init__(self, bank_dir: Path, embedder: str | None, token: str, startup_s: float = 300.0) -> None:
        exe = Path(sys.executable).with_name("crl-experience")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "crl_gym.cli"]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [*cmd, "serve", "--bank", str(bank_dir), "--host", "127.0.0.1", "--port", str(self.port),
                "--log-level", "warning"]
        if embedder is not None:
            args += ["--embedder", embedder]
        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=self._log,
                                     env={**os.environ, TOKEN_ENV: token, "HF_HUB_OFFLINE": "1"})
        probe = RemoteClient(self.url, timeout=2.0, token=token)
        deadline = time.monotonic() + startup_s
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"crl-experience serve exited with {self.proc.returncode}: {self.log()[-2000:]}")
                try:
                    probe.health()
                    break
                except Exception:  # noqa: BLE001 - not up yet
                    if time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(f"crl-experience serve did not answer within {startup_s} s") from None
                    time.sleep(0.2)
        finally:
            probe.close()

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read()

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, wait; the exit status (the server closes its service first)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        self._log.close()
        return int(self.proc.returncode)


def floor_ms(emb: Embedder, texts: list[str]) -> float:
    """One batched encode of ``texts`` in this process (no cache involved), in ms."""
    t0 = time.perf_counter()
    emb.encode(list(texts))
    return (time.perf_counter() - t0) * 1000


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object as last line")
    ap.add_argument("--entries", type=int, default=10_000)
    ap.add_argument("--clients", type=int, default=1024, help="concurrent callers released at once")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per case and face")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds per face before them (cold: always 1)")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--embedder", default=None, help="default: bundled all-MiniLM-L6-v2; 'hashing:64' for a smoke run")
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "complementary-rl" / "bench")
    ap.add_argument("--round-timeout", type=float, default=120.0, help="seconds one round may take")
    ap.add_argument("--max-seconds", type=float, default=1800.0, help="rounds stop starting after this budget")
    ap.add_argument("--switch-interval", type=float, default=0.0005,
                    help="GIL switch interval (s) of this, the clients' process, during the run (CPython: 0.005)")
    args = ap.parse_args(argv)
    if args.clients < 1 or args.rounds < 1 or args.entries < 1:
        ap.error("--clients, --rounds and --entries must be >= 1")
    t_start = time.perf_counter()
    load_start = round(os.getloadavg()[0], 2)
    switch_before = sys.getswitchinterval()
    sys.setswitchinterval(args.switch_interval)
    emb = load_embedder(args.embedder)
    texts = RETRIEVAL.bank_texts(args.entries)
    vecs = bank_vectors(emb, texts, args.cache_dir)
    work = Path(tempfile.mkdtemp(prefix="crl_bench_service_"))
    token = secrets.token_urlsafe(24)
    result: dict[str, Any] = {"benchmark": "service", "entries": args.entries, "clients": args.clients,
                              "rounds": args.rounds, "embedder": repr(emb), "cpus": os.cpu_count(),
                              "switch_interval_s": args.switch_interval,
                              "targets": TARGETS, "cases": {}}
    server: ServerProcess | None = None
    service: RetrievalService | None = None
    remote: RemoteClient | None = None
    separate: list[RemoteClient] = []  # warm_uncombined: one client (pool, connection) per thread
    try:
        fill_bank(work / "bank", texts, vecs).close()
        server = ServerProcess(work / "bank", args.embedder, token)
        remote = RemoteClient(server.url, timeout=args.round_timeout, token=token)
        service = RetrievalService(ExperienceManager(fill_bank(None, texts, vecs), emb))
        local = LocalClient(service)
        # As the server does: freeze the start-up heap (torch's objects), so that a full cyclic
        # collection (~250 ms here) does not land on whichever round it falls in, either face.
        gc.collect()
        gc.freeze()
        faces: dict[str, Any] = {"http": remote, "local": local}
        pid = server.proc.pid

        def probe() -> tuple[float, float]:
            return process_cpu_s(pid), process_cpu_s()

        steps = dict.fromkeys(faces, 0)

        def settle(face: str) -> None:
            """Untimed: drain the queue and end the step, so no round inherits the last one's."""
            client = faces[face]
            client.flush()  # a round that failed to finish may have left submits in the buffer
            for _ in range(64):  # bounded: 64 x 4,096 requests
                if not client.get_requests(4096):
                    break
            client.end_step(steps[face])
            steps[face] += 1

        def calls(case: str, face: str, tag: str) -> tuple[Callable[[Any], Any], list[Any]]:
            client = faces[face]
            if case == "warm_uncombined":
                if face == "local":
                    return client.search, warm_queries(args.clients)
                if not separate:
                    separate.extend(RemoteClient(server.url, timeout=args.round_timeout, token=token)
                                    for _ in range(args.clients))
                return (lambda pair: pair[0].search(pair[1])), list(zip(separate, warm_queries(args.clients), strict=True))
            if case == "warm":
                return client.search, warm_queries(args.clients)
            if case == "cold":
                return client.search, cold_queries(args.clients, f"{tag}-{face}")
            return client.submit, [episode(j, f"{tag}-{face}") for j in range(args.clients)]

        for case in args.cases:
            rows: dict[str, dict[str, list[float]]] = {
                f: {"lat": [], "walls": [], "round_means": [], "round_p99": [], "cpu_server": [], "cpu_here": [],
                    "delivered": []}
                for f in faces}
            failed = dict.fromkeys(faces, 0)
            floors: list[float] = []
            for w in range(1 if case == "cold" else args.warmup):  # untimed warm-up rounds per face
                for face in faces:
                    fn, items = calls(case, face, f"warmup{w}")
                    run_round(fn, items, args.round_timeout, finish=faces[face].flush if case == "submit" else None)
                    settle(face)
            for r in range(args.rounds):
                if time.perf_counter() - t_start > args.max_seconds:
                    result.setdefault("note", []).append(f"{case}: stopped after {r} rounds (--max-seconds)")
                    break
                order = list(faces) if r % 2 == 0 else list(faces)[::-1]
                for face in order:
                    fn, items = calls(case, face, f"r{r}")
                    lat, wall, fails, cpu, delivered = run_round(
                        fn, items, args.round_timeout, probe, finish=faces[face].flush if case == "submit" else None)
                    settle(face)
                    rows[face]["delivered"].append(delivered)
                    row = rows[face]
                    row["cpu_server"].append(cpu[0])
                    row["cpu_here"].append(cpu[1])
                    row["lat"] += lat
                    row["walls"].append(wall)
                    s = summary(lat, [wall])
                    row["round_means"].append(s["mean_ms"])
                    row["round_p99"].append(s["p99_ms"])
                    failed[face] += fails
                    if case == "cold" and face == "http":
                        floors.append(floor_ms(emb, items))
                print(f"{case} round {r}: http {rows['http']['round_means'][-1]} ms mean / "
                      f"{rows['http']['round_p99'][-1]} p99, local {rows['local']['round_means'][-1]} ms mean",
                      file=sys.stderr)
            http, loc = (summary(rows[f]["lat"], rows[f]["walls"]) for f in ("http", "local"))
            means = rows["http"]["round_means"]
            ratio = statistics.fmean(rows["http"]["lat"]) / statistics.fmean(rows["local"]["lat"]) if (
                rows["http"]["lat"] and rows["local"]["lat"]) else float("nan")
            out: dict[str, Any] = {**http, "http_over_local": round(ratio, 2),
                                   "local": loc,
                                   "median_round": {f: {"mean_ms": round(statistics.median(rows[f]["round_means"]), 3),
                                                        "p99_ms": round(statistics.median(rows[f]["round_p99"]), 3)}
                                                    for f in faces if rows[f]["round_means"]},
                                   "rounds": [{"mean_ms": m, "p99_ms": p, "local_mean_ms": lm} for m, p, lm in
                                              zip(means, rows["http"]["round_p99"], rows["local"]["round_means"], strict=True)],
                                   "loadavg_1min": round(os.getloadavg()[0], 2),
                                   "noise": round((max(means) - min(means)) / statistics.median(means), 3) if means else None,
                                   "cpu_ms": {f: {"server": round(1000 * statistics.fmean(rows[f]["cpu_server"]), 1),
                                                  "clients": round(1000 * statistics.fmean(rows[f]["cpu_here"]), 1)}
                                              for f in faces if rows[f]["cpu_server"]},
                                   "failed_calls": failed}
            if case == "submit":
                # until the server has every request of the round (what end_step waits for)
                out["delivered_ms"] = {f: {"mean": round(1000 * statistics.fmean(rows[f]["delivered"]), 3),
                                           "max": round(1000 * max(rows[f]["delivered"]), 3)}
                                       for f in faces if rows[f]["delivered"]}
                for row, d in zip(out["rounds"], rows["http"]["delivered"], strict=True):
                    row["delivered_ms"] = round(1000 * d, 3)
            if case == "cold" and floors:
                out["embed_floor_ms"] = round(statistics.median(floors), 2)
                out["cold_over_floor"] = round(http["mean_ms"] / out["embed_floor_ms"], 3)
                out["local_over_floor"] = round(loc["mean_ms"] / out["embed_floor_ms"], 3)
                # each round against the floor measured right after it (load drifts between rounds)
                out["round_over_floor"] = [round(m / f, 3) for m, f in zip(means, floors, strict=False)]
                out["round_floor_ms"] = [round(f, 1) for f in floors]
            result["cases"][case] = out
        result["server_stats"] = {k: v for k, v in remote.stats().to_dict().items() if k != "manager"}
        result["server_mean_batch"] = round(float(remote.stats().manager["mean_batch"]), 1)
    finally:
        sys.setswitchinterval(switch_before)
        for c in separate:
            c.close()
        if remote is not None:
            remote.close()
        if server is not None:
            result["server_exit_status"] = server.stop()
        if service is not None:
            service.close()
        shutil.rmtree(work, ignore_errors=True)
    cases = result["cases"]
    failed_any = any(sum(c["failed_calls"].values()) for c in cases.values())
    for suffix, pick in (("", lambda c: c), ("_median_round", lambda c: c["median_round"]["http"])):
        checks = {}
        if "warm" in cases:
            checks["warm_p99_ms"] = pick(cases["warm"])["p99_ms"] <= TARGETS["warm_p99_ms"]
        if "cold" in cases and "cold_over_floor" in cases["cold"]:
            cold = cases["cold"]
            ratio = cold["cold_over_floor"] if not suffix else statistics.median(cold["round_over_floor"])
            checks["cold_over_floor"] = ratio <= TARGETS["cold_over_floor"]
        if "submit" in cases:
            checks["submit_p99_ms"] = pick(cases["submit"])["p99_ms"] <= TARGETS["submit_p99_ms"]
        result["meets" + suffix] = checks
        result["meets_targets" + suffix] = bool(checks) and all(checks.values()) and not failed_any
    result["loadavg_start_end"] = [load_start, round(os.getloadavg()[0], 2)]
    result["runtime_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
