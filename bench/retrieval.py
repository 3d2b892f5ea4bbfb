"""Retrieval benchmark of the ExperienceManager (issue 4, Performance).

128 / 256 / 512 / 1024 searcher threads (K = 8 share each task text, as in group RL) are
released at once against a bank of 10,000 entries embedded with the default embedder
(bundled all-MiniLM-L6-v2). Optimised = the manager (batching, caches, workers, shared pools);
naive = one embedding and one bank search per request, straight from the caller's thread.

The first round of each concurrency is the cold one (every task text is new to the embedding
cache); it is reported as ``cold_mean_ms`` and the ``rounds`` after it are the warm figures
(tasks recur every training step, so that is the steady state). Bank embeddings are cached
on disk (``--cache-dir``) because computing 10,000 of them dominates the run time.

After the model and the bank are loaded, the start-up heap is frozen (``gc.freeze``), as
``crl-experience serve`` and ``bench/service.py`` do: otherwise a full cyclic collection walks
torch's ~5·10^5 objects (0.25-1 s on this machine) in whichever warm round it falls, and that one
pause is the p99. ``--no-gc-freeze`` measures without it; each level reports the collections that
ran during its warm rounds (``gc_full``: count and longest pause of generation-2 collections).

    python bench/retrieval.py --json      # last line: one JSON object
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import sys
import threading
import time
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


def run_round(n: int, fn: Any, queries: list[str]) -> tuple[list[float], float]:
    """Release ``n`` threads at once, each calling ``fn(query)``; per-call latencies (s), wall."""
    lat = [0.0] * n
    barrier = threading.Barrier(n + 1)

    def worker(i: int) -> None:
        barrier.wait()
        t0 = time.perf_counter()
        fn(queries[i])
        lat[i] = time.perf_counter() - t0

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    barrier.wait()
    for t in threads:
        t.join()
    return lat, time.perf_counter() - t0


def summary(lat: list[float], walls: list[float]) -> dict[str, float]:
    ms = sorted(x * 1000 for x in lat)
    return {
        "mean_ms": round(statistics.fmean(ms), 2),
        "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 2),
        "throughput_qps": round(len(lat) / sum(walls), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object as last line")
    ap.add_argument("--entries", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[128, 256, 512, 1024])
    ap.add_argument("--rounds", type=int, default=5, help="warm rounds per concurrency")
    ap.add_argument("--naive-rounds", type=int, default=1)
    ap.add_argument("--embedder", default=None, help="default: bundled all-MiniLM-L6-v2")
    ap.add_argument("--cache-dir", type=Path,
                    default=Path.home() / ".cache" / "complementary-rl" / "bench")
    ap.add_argument("--no-gc-freeze", action="store_true",
                    help="leave the start-up heap to the cyclic collector (see the module docstring)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="ManagerConfig override, e.g. --set adaptive_batching=False")
    args = ap.parse_args()
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
    result: dict[str, Any] = {"entries": len(bank), "k_group": K, "embedder": repr(emb),
                              "config": overrides, "cpus": os.cpu_count(), "gc_freeze": not args.no_gc_freeze,
                              "load_average_start": round(os.getloadavg()[0], 2), "levels": {}}
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
        lat, walls = [], []
        before = mgr.stats()
        pauses.clear()
        gc.callbacks.append(on_gc)
        for _ in range(args.rounds):
            lt, wall = run_round(n, mgr.search, queries)
            lat += lt
            walls.append(wall)
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
        result["levels"][str(n)] = row
        print(f"{n:5d} searchers: {row}", file=sys.stderr)
    result["runtime_s"] = round(time.perf_counter() - t_start, 1)
    result["load_average_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
