"""Actor step time of grpo vs complementary (background track) vs complementary forced synchronous.

Runs the tiny preset for a few steps three ways, in one process, in interleaved rounds:

* ``grpo``: no experience; the actor gets its share (1 core).
* ``complementary`` asynchronous: the background track runs in its own thread of the trainer
  process and the extractor's model work in its own process (``crl_train.extractor_worker``).
* ``complementary`` synchronous: each actor step waits for distillation, the extractor update and
  the merge (``experience.asynchronous=false``; the extractor in process, as auto mode picks).

Core split: each track is pinned to its own cores (``os.sched_setaffinity``, ``crl_train.affinity``;
on 2 cores: trainer process → core 0, extractor process → core 1) and runs torch with 1 intra-op
thread. The trainer process holds the actor's primary loop and the light bank/manager work of the
background thread (which otherwise waits on the worker's pipe). The grpo run and the synchronous
run (extractor in process) get the actor's share. The split is printed in ``core_split``.

Extractor workload (``WORKLOAD``, applied to all three runs unless ``--tiny-extractor``): the
tiny preset's extractor answers one constrained op line, i.e. it does almost nothing, whereas the
paper's extractor is a 4B *thinking* model that writes its reasoning before its ops. The benchmark
lets it answer in free text (``extractor.constrained=false``) up to ``extractor.max_new_tokens``
tokens, so that its work per actor step (``extractor_busy_per_step_s`` of the async run, time the
trainer's calls into the worker took) is about 0.5–0.9× the actor's step — heavy enough that
waiting for it costs the synchronous run, light enough that the background track keeps up
(``queue_depth_end``).

``core_interference`` (measured first, before any run): how much a busy extractor core slows a
pure-Python loop on the actor's core. On a machine whose cores are independent it is ~1.0; where
the two vCPUs are SMT siblings of one physical core it reaches 1.5-1.8 (seen on this VM), and
then no split can keep the extractor's work from costing the actor: read ``async_over_grpo``
together with it. ``track_cpu_per_step_s`` is the CPU the background thread took in the trainer
process (its GIL and core) per actor step.

The first ``--warmup`` steps of each run are excluded (cold caches, the first search of an empty
bank); the worker's start-up happens while the trainer is built, before any timed step. Ratios are
of means over the kept steps of all rounds (``median_*``: the same with medians, less sensitive to
other users' load spikes). Prints one JSON object last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")


CORE_SPLIT = ("trainer process pinned to the actor's cores, torch 1 intra-op thread (primary loop; the background-track "
              "thread only does bank/manager work and waits on the worker's pipe); extractor worker process (spawn) "
              "pinned to the extractor's cores, torch 1 intra-op thread (distillation, refinement, merge generation, "
              "CISPO, checkpoints); grpo and sync (extractor in process): the actor's cores, 1 thread")


WORKLOAD = ["extractor.constrained=false", "extractor.max_new_tokens=96", "extractor.tiny_layers=4"]


def run(method: str, asynchronous: bool, steps: int, warmup: int, extra: list[str]) -> dict[str, Any]:
    from crl_train.config import load_config
    from crl_train.trainer import Trainer

    overrides = [f"method={method}", f"train.steps={steps}", "train.eval_episodes=0", "train.checkpoint_every=1000",
                 f"experience.asynchronous={str(asynchronous).lower()}", "experience.actor_threads=1",
                 "experience.extractor_threads=1", *extra]
    cfg = load_config(None, overrides)
    with tempfile.TemporaryDirectory(prefix=f"bench_{method}_") as d:
        t0 = time.perf_counter()
        trainer = Trainer(cfg, d, progress=False)
        times: list[float] = []
        phases: dict[str, list[float]] = {"rollout_time_s": [], "update_time_s": [], "search_latency_s": []}
        ext = trainer.c.extractor
        busy0 = track_cpu0 = 0.0
        try:
            trainer.c.track.start()
            for t in range(steps):
                if t == warmup:
                    busy0 = float(getattr(ext, "busy_s", 0.0))
                    track_cpu0 = trainer.c.track.stats.cpu_s
                row = trainer.step(t)
                times.append(row["step_time_s"])
                for k, v in phases.items():
                    v.append(float(row.get(k) or 0.0))
            busy = float(getattr(ext, "busy_s", 0.0)) - busy0
            # how far the extractor got while the actor ran (async: it may trail; sync: nothing pending)
            st = trainer.c.track.stats
            extra_out = {"distilled": st.distilled, "distill_batches": st.distill_batches,
                         "extractor_updates": st.updates, "merges": st.merges,
                         "queue_depth_end": trainer.c.manager.pending(), "track_errors": st.errors,
                         "extractor_process": ext.__class__.__name__ == "ExtractorWorker",
                         "extractor_busy_s": busy, "track_cpu_s": st.cpu_s - track_cpu0, "busy_by_op_s": {k: round(v, 3) for k, v in
                                                                    getattr(ext, "busy_by_op", {}).items()},
                         "core_split": trainer.c.cpu_split.describe() if trainer.c.cpu_split else None,
                         "phases_mean_s": {k: statistics.mean(v[warmup:] or v) for k, v in phases.items()}}
            trainer.c.track.stop()
        finally:
            trainer.close()
        wall = time.perf_counter() - t0
    kept = times[warmup:] or times
    return {"mean_step_s": statistics.mean(kept), "median_step_s": statistics.median(kept), "steps": len(kept),
            "step_times_s": [round(x, 4) for x in times], **extra_out, "wall_s": wall}


def _spin(cpus: list[int], seconds: float) -> None:
    """Child of :func:`core_interference`: a pure-Python busy loop on ``cpus``."""
    os.sched_setaffinity(0, cpus)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(1000))


def _python_loop_s(n: int = 3_000_000) -> float:
    t0 = time.thread_time()
    x = 0
    for i in range(n):
        x += i
    return time.thread_time() - t0


def core_interference(actor_cpus: list[int], extractor_cpus: list[int]) -> dict[str, Any]:
    """How much a busy extractor core slows the actor's core: a fixed pure-Python loop pinned to the
    actor's cores, timed (thread CPU time, best of 3) alone and while a process spins on the
    extractor's cores. 1.0 means independent cores; two SMT siblings of one physical core (how some
    VMs present 2 vCPUs) give ~1.5-1.8, and then any extractor work running beside the actor costs
    it that factor for as long as the two overlap."""
    import multiprocessing as mp

    if not hasattr(os, "sched_setaffinity") or not extractor_cpus:
        return {"slowdown": None, "why": "no separate extractor cores to probe"}
    before = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, actor_cpus)
    try:
        alone = min(_python_loop_s() for _ in range(3))
        proc = mp.get_context("spawn").Process(target=_spin, args=(extractor_cpus, 60.0), daemon=True)
        proc.start()
        try:
            time.sleep(1.0)  # the child is spinning
            busy = min(_python_loop_s() for _ in range(3))
        finally:
            proc.terminate()
            proc.join()
    finally:
        os.sched_setaffinity(0, before)
    return {"slowdown": round(busy / alone, 3), "alone_s": round(alone, 4), "beside_busy_core_s": round(busy, 4),
            "actor_cpus": actor_cpus, "extractor_cpus": extractor_cpus}


CONFIGS = {"grpo": ("grpo", True), "complementary_async": ("complementary", True),
           "complementary_sync": ("complementary", False)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8, help="actor steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="first steps of each run excluded")
    ap.add_argument("--rounds", type=int, default=2,
                    help="runs per configuration, interleaved (order reversed every other round) so that "
                         "load drift on a shared machine hits all three alike")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config overrides applied to all three runs")
    ap.add_argument("--tiny-extractor", action="store_true",
                    help="keep the tiny preset's constrained one-line extractor instead of the benchmark's WORKLOAD")
    ap.add_argument("--json", action="store_true", help="print only the JSON result")
    args = ap.parse_args(argv)
    import logging

    import torch

    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    load_start = os.getloadavg()
    overrides = ([] if args.tiny_extractor else WORKLOAD) + args.overrides
    from crl_train.affinity import available_cpus, split_cpus
    from crl_train.config import load_config

    # the split the runs will use, --set experience.actor_cpus=... included
    exp = load_config(None, overrides).experience
    split = split_cpus(available_cpus(), exp.actor_cpus, exp.extractor_cpus, pin=exp.pin_cpus)
    interference = core_interference(list(split.actor or ()), list(split.extractor or ()))
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in CONFIGS}
    for r in range(args.rounds):
        order = list(CONFIGS) if r % 2 == 0 else list(reversed(CONFIGS))
        for name in order:
            method, asynchronous = CONFIGS[name]
            runs[name].append(run(method, asynchronous, args.steps, args.warmup, overrides))
            if not args.json:
                print(f"round {r} {name}: mean {runs[name][-1]['mean_step_s']:.3f} s", file=sys.stderr)
    kept = {k: [t for x in v for t in x["step_times_s"][args.warmup:]] for k, v in runs.items()}
    mean = {k: statistics.mean(v) for k, v in kept.items()}
    median = {k: statistics.median(v) for k, v in kept.items()}
    a_runs = runs["complementary_async"]
    busy_per_step = sum(x["extractor_busy_s"] for x in a_runs) / max(1, sum(x["steps"] for x in a_runs))
    out = {
        "grpo_step_s": mean["grpo"],
        "async_step_s": mean["complementary_async"],
        "sync_step_s": mean["complementary_sync"],
        "async_over_grpo": mean["complementary_async"] / mean["grpo"],
        "sync_over_async": mean["complementary_sync"] / mean["complementary_async"],
        "median_async_over_grpo": median["complementary_async"] / median["grpo"],
        "median_sync_over_async": median["complementary_sync"] / median["complementary_async"],
        "steps_kept": {k: len(v) for k, v in kept.items()},
        "extractor_busy_per_step_s": busy_per_step,
        "extractor_busy_fraction": busy_per_step / mean["complementary_async"],
        # CPU the background thread took in the trainer process (the actor's core and GIL), per step
        "track_cpu_per_step_s": sum(x["track_cpu_s"] for x in a_runs) / max(1, sum(x["steps"] for x in a_runs)),
        "queue_depth_end_async": [x["queue_depth_end"] for x in a_runs],
        "phases_mean_s": {k: {p: statistics.mean(x["phases_mean_s"][p] for x in v) for p in v[0]["phases_mean_s"]}
                          for k, v in runs.items()},
        "core_split": {"split": a_runs[0]["core_split"], "threads": CORE_SPLIT},
        "core_interference": interference,
        "cpu_count": os.cpu_count(),
        "loadavg_start_end": [round(load_start[0], 2), round(os.getloadavg()[0], 2)],
        "overrides": overrides,
        "runs": runs,
    }
    if not args.json:
        for k, v in out.items():
            if k != "runs":
                print(f"{k}: {v}", file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
