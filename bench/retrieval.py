"""Retrieval benchmark of the ExperienceManager.

Two modes over a bank of 10,000 entries embedded with the default embedder (bundled
all-MiniLM-L6-v2), K = 8 searches sharing each task text as in group RL:

* ``--mode open`` (the default): an open-loop load, searches arriving as envs issue them, at a
  fixed offered rate (Poisson arrivals, seeded), each handed to one of ``--callers`` caller threads
  that are idle until it arrives. Latency is timed from the search's scheduled arrival (a search
  that waits for a free caller counts that wait), so the figures do not depend on how fast the OS
  wakes threads. Per rate: achieved throughput, mean / p50 / p99 latency, the dispatcher's lag
  behind the schedule, and the floor: the same schedule with a search that does nothing, run
  alternately with the manager's so both see the same machine load; ``added_*`` is the manager's
  latency minus the floor's, which is what the manager costs whatever else the machine runs.
  Each rate ``--repeats`` times (median and range). Then the throughput ceiling: the same callers
  searching back to back (closed loop) for ``--duration`` s.
* ``--mode burst``: 128 / 256 / 512 / 1024 searcher threads released at once by a barrier
  (the earlier benchmark); optimised = the manager (batching, caches, workers, shared pools),
  naive = one embedding and one bank search per request, straight from the caller's thread.
  Its rounds are bimodal: a released thread needs the GIL to call ``search``, so 1,024 threads
  arrive over a spread that the OS's scheduling decides, round by round (``arrival_spread_ms``),
  and that spread, not the manager, sets the round's latency. It is a stress test, not a
  reproducible latency figure.

The first round of each concurrency is the cold one (every task text is new to the embedding
cache); it is reported as ``cold_mean_ms`` and the ``rounds`` after it are the warm figures
(tasks recur every training step, so that is the steady state). Bank embeddings are cached
on disk (``--cache-dir``) because computing 10,000 of them dominates the run time.

After the model and the bank are loaded, the start-up heap is frozen (``gc.freeze``), as
``crl-experience serve`` and ``bench/service.py`` do: otherwise a full cyclic collection walks
torch's ~5·10^5 objects (0.25-1 s on this machine) in whichever warm round it falls, and that one
pause is the p99. ``--no-gc-freeze`` measures without it; each level reports the collections that
ran during its warm rounds (``gc_full``: count and longest pause of generation-2 collections).

    python bench/retrieval.py --json                  # open loop; last line: one JSON object
    python bench/retrieval.py --mode burst --json     # barrier-released searcher threads
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import queue
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from crl_gym.experience import ExperienceBank, ExperienceManager, ManagerConfig  # noqa: E402
from crl_gym.experience.bank import PendingAdd  # noqa: E402
from crl_gym.experience.embedders import Embedder, load_embedder  # noqa: E402

K = 8
VERBS = ["open", "find", "reach", "avoid", "pick up", "push", "cross", "unlock", "light", "read"]
OBJS = ["the door", "the key", "the stairs", "the lava", "the box", "the river", "the chest",
        "the fountain", "the monster", "the wand", "the scroll", "the boulder"]
HOW = ["by moving along the wall", "after checking every corner", "before the monster wakes",
       "using the shortest path", "while keeping distance", "when the corridor is dark",
       "once the key is in the inventory", "without stepping on traps", "by backtracking once",
       "after reading the map", "if the room is locked", "with one step at a time"]
WHERE = ["in a 5x5 room", "in a maze", "in a dark room", "near the river", "in a key room",
         "in an ultimate room", "in a narrow corridor"]


def bank_texts(n: int) -> list[str]:
    out = []
    for i in range(n):
        v, o = VERBS[i % len(VERBS)], OBJS[(i // len(VERBS)) % len(OBJS)]
        h, w = HOW[(i // 120) % len(HOW)], WHERE[(i // 1440) % len(WHERE)]
        out.append(f"Tip {i}: {v} {o} {w} {h}.")
    return out


def task_texts(n: int) -> list[str]:
    return [f"Task {j}: {VERBS[j % 10]} {OBJS[j % 12]} {WHERE[j % 7]}; avoid dying." for j in range(n)]


def build_bank(emb: Embedder, n: int, cache_dir: Path) -> ExperienceBank:
    texts = bank_texts(n)
    key = hashlib.sha256((repr(emb) + "\n".join(texts)).encode()).hexdigest()[:16]
    f = cache_dir / f"retrieval_bank_{key}.npy"
    if f.exists():
        vecs = np.load(f)
    else:
        t0 = time.perf_counter()
        vecs = np.concatenate([emb.encode(texts[i:i + 256]) for i in range(0, n, 256)])
        print(f"embedded {n} bank texts in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        cache_dir.mkdir(parents=True, exist_ok=True)
        np.save(f, vecs)
    bank = ExperienceBank(None, emb.dim)
    bank.apply_batch([PendingAdd(t, v) for t, v in zip(texts, vecs, strict=True)])
    return bank


def run_round(n: int, fn: Any, queries: list[str], starts: list[float] | None = None) -> tuple[list[float], float]:
    """Release ``n`` threads at once, each calling ``fn(query)``; per-call latencies (s), wall.
    ``starts`` (when given) receives each call's start time (``perf_counter``)."""
    lat = [0.0] * n
    began = [0.0] * n
    barrier = threading.Barrier(n + 1)

    def worker(i: int) -> None:
        barrier.wait()
        t0 = began[i] = time.perf_counter()
        fn(queries[i])
        lat[i] = time.perf_counter() - t0

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    barrier.wait()
    for t in threads:
        t.join()
    if starts is not None:
        starts.extend(began)
    return lat, time.perf_counter() - t0


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0-1) of ``values`` by the nearest-rank rule (as ``summary``'s p99)."""
    xs = sorted(values)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def open_loop(search: Callable[[str], Any], queries: list[str], rate: float, n: int, callers: int,
              seed: int) -> dict[str, float]:
    """``n`` searches arriving at ``rate`` per second (exponential gaps, seeded), each run by an idle
    caller thread; latency from the scheduled arrival to the answer (ms)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n)).tolist()
    picks = rng.integers(len(queries), size=n).tolist()
    work: queue.SimpleQueue[tuple[int, float] | None] = queue.SimpleQueue()
    lat = [math.nan] * n
    finished = [0.0] * n

    def caller() -> None:
        while (item := work.get()) is not None:
            i, due = item
            search(queries[picks[i]])
            finished[i] = time.perf_counter()
            lat[i] = finished[i] - due

    threads = [threading.Thread(target=caller, daemon=True) for _ in range(callers)]
    for t in threads:
        t.start()
    lag = 0.0
    t0 = time.perf_counter() + 0.02
    for i, at in enumerate(arrivals):
        due = t0 + at
        delay = due - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        lag += max(0.0, time.perf_counter() - due)
        work.put((i, due))
    for _ in threads:
        work.put(None)
    for t in threads:
        t.join()
    ms = [x * 1000 for x in lat]
    return {
        "offered_qps": round(rate, 1),
        "achieved_qps": round(n / (max(finished) - t0), 1),
        "mean_ms": round(statistics.fmean(ms), 3),
        "p50_ms": round(percentile(ms, 0.50), 3),
        "p99_ms": round(percentile(ms, 0.99), 3),
        "max_ms": round(max(ms), 3),
        "dispatch_lag_ms": round(lag / n * 1000, 3),
    }


def _no_search(query: str) -> None:
    """The floor's search: nothing, so its latency is the dispatch and the caller thread's wake-up."""


def ceiling(search: Callable[[str], Any], queries: list[str], callers: int, duration: float) -> float:
    """Searches per second of ``callers`` threads searching back to back for ``duration`` s."""
    stop = threading.Event()
    done = [0] * callers

    def caller(c: int) -> None:
        i = c
        while not stop.is_set():
            search(queries[i % len(queries)])
            done[c] += 1
            i += callers

    threads = [threading.Thread(target=caller, args=(c,), daemon=True) for c in range(callers)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(duration)
    stop.set()
    for t in threads:
        t.join()
    return sum(done) / (time.perf_counter() - t0)


def spread(rows: list[dict[str, float]], key: str) -> dict[str, float]:
    """Median, min and max of ``key`` over repeats."""
    xs = [r[key] for r in rows]
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3)}


def summary(lat: list[float], walls: list[float]) -> dict[str, float]:
    ms = sorted(x * 1000 for x in lat)
    return {
        "mean_ms": round(statistics.fmean(ms), 2),
        "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 2),
        "throughput_qps": round(len(lat) / sum(walls), 1),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object as last line")
    ap.add_argument("--mode", choices=("open", "burst"), default="open")
    ap.add_argument("--entries", type=int, default=10_000)
    ap.add_argument("--rates", type=float, nargs="+", default=[250, 500, 1000, 2000, 4000],
                    help="open loop: offered searches per second")
    ap.add_argument("--duration", type=float, default=2.0, help="open loop: seconds of arrivals per rate")
    ap.add_argument("--repeats", type=int, default=3, help="open loop: runs of each rate")
    ap.add_argument("--callers", type=int, default=256, help="open loop: caller threads")
    ap.add_argument("--tasks", type=int, default=128, help="open loop: distinct task texts (K = 8 searches each)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[128, 256, 512, 1024],
                    help="burst: searcher threads per level")
    ap.add_argument("--rounds", type=int, default=5, help="burst: warm rounds per concurrency")
    ap.add_argument("--naive-rounds", type=int, default=1, help="burst: rounds of the naive baseline")
    ap.add_argument("--embedder", default=None, help="default: bundled all-MiniLM-L6-v2")
    ap.add_argument("--cache-dir", type=Path,
                    default=Path.home() / ".cache" / "complementary-rl" / "bench")
    ap.add_argument("--no-gc-freeze", action="store_true",
                    help="leave the start-up heap to the cyclic collector (see the module docstring)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="ManagerConfig override, e.g. --set adaptive_batching=False")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    emb = load_embedder(args.embedder)
    bank = build_bank(emb, args.entries, args.cache_dir)
    overrides = {}
    for kv in args.set:
        k, _, v = kv.partition("=")
        overrides[k] = json.loads(v.lower() if v in ("True", "False") else v)
    cfg = ManagerConfig(**overrides)
    if not args.no_gc_freeze:
        gc.collect()
        gc.freeze()
    result: dict[str, Any] = {"mode": args.mode, "entries": len(bank), "k_group": K, "embedder": repr(emb),
                              "config": overrides, "cpus": os.cpu_count(), "gc_freeze": not args.no_gc_freeze,
                              "load_average_start": round(os.getloadavg()[0], 2)}
    if args.mode == "open":
        result.update(run_open(args, bank, emb, cfg))
    else:
        result["levels"] = run_burst(args, bank, emb, cfg)
    result["runtime_s"] = round(time.perf_counter() - t_start, 1)
    result["load_average_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return result


def run_open(args: argparse.Namespace, bank: ExperienceBank, emb: Embedder, cfg: ManagerConfig) -> dict[str, Any]:
    """The open-loop rates, then the closed-loop ceiling (see the module docstring)."""
    queries = [t for t in task_texts(args.tasks) for _ in range(K)]
    mgr = ExperienceManager(bank, emb, cfg)
    try:
        mgr.search_many(sorted(set(queries)))  # warm: every task text embedded once (tasks recur each step)
        embedded = mgr.stats()["embedded"]
        rates: dict[str, Any] = {}
        for rate in args.rates:
            n = max(50, int(rate * args.duration))
            runs, floors = [], []
            for r in range(args.repeats):  # the manager and the floor alternate: both see the same load
                runs.append(open_loop(mgr.search, queries, rate, n, args.callers, seed=r))
                floors.append(open_loop(_no_search, queries, rate, n, args.callers, seed=r))
            row = {key: spread(runs, key) for key in ("achieved_qps", "mean_ms", "p50_ms", "p99_ms", "dispatch_lag_ms")}
            for key in ("p50_ms", "p99_ms"):
                row["floor_" + key] = spread(floors, key)
                row["added_" + key] = spread([{key: a[key] - f[key]} for a, f in zip(runs, floors, strict=True)], key)
            row["runs"] = runs
            rates[str(int(rate))] = row
            print(f"{rate:7.0f}/s offered: p99 {row['p99_ms']}, achieved {row['achieved_qps']['median']}/s",
                  file=sys.stderr)
        ceilings = [ceiling(mgr.search, queries, args.callers, args.duration) for _ in range(args.repeats)]
        st = mgr.stats()
    finally:
        mgr.close()
    return {"callers": args.callers, "tasks": args.tasks, "duration_s": args.duration, "repeats": args.repeats,
            "rates": rates,
            "ceiling_qps": {"median": round(statistics.median(ceilings), 1), "min": round(min(ceilings), 1),
                            "max": round(max(ceilings), 1)},
            "mean_batch": round(st["mean_batch"], 1), "embedded_after_warmup": st["embedded"] - embedded}


def run_burst(args: argparse.Namespace, bank: ExperienceBank, emb: Embedder, cfg: ManagerConfig) -> dict[str, Any]:
    """Barrier-released searcher threads per concurrency (see the module docstring)."""
    levels: dict[str, Any] = {}
    pauses: list[float] = []
    started: list[float] = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if info["generation"] == 2:
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                pauses.append(time.perf_counter() - started[0])
    for n in args.concurrency:
        queries = [t for t in task_texts(n // K) for _ in range(K)]
        mgr = ExperienceManager(bank, emb, cfg)
        cold, wall = run_round(n, mgr.search, queries)
        lat, walls, spreads = [], [], []
        before = mgr.stats()
        pauses.clear()
        gc.callbacks.append(on_gc)
        for _ in range(args.rounds):
            starts: list[float] = []
            lt, wall = run_round(n, mgr.search, queries, starts)
            lat += lt
            walls.append(wall)
            spreads.append(round((max(starts) - min(starts)) * 1000, 1))
        gc.callbacks.remove(on_gc)
        st = mgr.stats()
        mgr.close()
        looked = (st["cache_hits"] + st["cache_misses"]) - (before["cache_hits"] + before["cache_misses"])
        row = summary(lat, walls)
        # Requests answered without computing an embedding, over the warm rounds.
        row["cache_hit_rate"] = round(1.0 - (st["embedded"] - before["embedded"]) / len(lat), 4)
        row["distinct_lookups"] = looked
        row["mean_batch"] = round((st["requests"] - before["requests"])
                                  / max(1, st["batches"] - before["batches"]), 1)
        row["cold_mean_ms"] = round(statistics.fmean(cold) * 1000, 2)
        row["round_p99_ms"] = [summary(lat[i * n:(i + 1) * n], [1.0])["p99_ms"] for i in range(args.rounds)]
        row["arrival_spread_ms"] = spreads  # first to last call of each round: the OS's wake-up of the threads
        row["gc_full"] = {"count": len(pauses), "max_ms": round(max(pauses, default=0.0) * 1000, 1)}

        def naive(q: str) -> None:
            bank.search(emb.encode([q]), 1)

        nlat, nwalls = [], []
        for _ in range(args.naive_rounds):
            lt, wall = run_round(n, naive, queries)
            nlat += lt
            nwalls.append(wall)
        if nlat:  # --naive-rounds 0 skips the (slow) naive baseline
            row["naive_mean_ms"] = summary(nlat, nwalls)["mean_ms"]
            row["naive_p99_ms"] = summary(nlat, nwalls)["p99_ms"]
            row["speedup_vs_naive"] = round(row["naive_mean_ms"] / max(row["mean_ms"], 1e-9), 1)
        levels[str(n)] = row
        print(f"{n:5d} searchers: {row}", file=sys.stderr)
    return levels


if __name__ == "__main__":
    main()
