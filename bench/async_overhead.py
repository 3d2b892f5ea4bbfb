"""Actor step time of grpo vs complementary (background track) vs complementary forced synchronous.

Runs the tiny preset three ways, in one process, **interleaved step by step**:

* ``grpo``: no experience; the actor gets its share (1 core).
* ``complementary`` asynchronous: the background track runs in its own thread of the trainer
  process and the extractor's model work in its own process (``crl_train.extractor.worker``).
* ``complementary`` synchronous: each actor step waits for distillation, the extractor update and
  the merge (``experience.asynchronous=false``; the extractor in process, as auto mode picks).

**Interleaving.** The three trainers are built first; then step t of each runs in turn, the order
cycling through all six permutations, so that load drift on a shared host (seen here: the same
loop taking 2x as long a few seconds later) hits the three alike and no configuration always
follows the same one. The asynchronous run's extractor process runs only during that run's own
steps: it is stopped (``SIGSTOP``) when its step ends and continued (``SIGCONT``) when its next
step starts, so its work overlaps exactly the actor steps it would overlap in a run of its own,
and never the other two configurations' steps. (The background *thread* is not stopped: it only
waits on the worker's pipe or does bank work, ``track_cpu_per_step_s``, a few ms per step.)

Core split: each track is pinned to its own cores (``os.sched_setaffinity``, ``crl_train.policy.affinity``;
on 2 cores: trainer process → core 0, extractor process → core 1) and runs torch with 1 intra-op
thread. The grpo run and the synchronous run (extractor in process) get the actor's share. The
split is printed in ``core_split``.

Extractor workload (``WORKLOAD``, applied to all three runs unless ``--tiny-extractor``): the
paper's extractor is a 4B *thinking* model that reasons at length before writing a short op. The
tiny preset's extractor chooses its op line at once, i.e. does almost nothing; here it first
samples ``extractor.think_tokens`` free reasoning tokens (``ThinkThenChoose``), so that its work
per actor step (``extractor_cpu_per_step_s``: CPU of the extractor process per asynchronous step)
is a large part of the actor's step, while its entries — what guided prompts carry — keep the
length of a real op. ``actor.lr=1e-6`` (the paper's value): the benchmark measures time, not
learning; with the tiny preset's 1e-3 the configuration that learns fastest gets shorter
episodes, so cheaper steps, for that reason alone (``actions_per_episode`` in ``phases_mean_s``).

``core_interference`` (measured first): how much a busy extractor core slows a pure-Python loop on
the actor's core. ~1.0 on independent cores; 1.5-1.8 where the two vCPUs share a physical core
(seen on this VM at times), and then the extractor's work costs the actor that factor while the
two overlap: read ``async_over_grpo`` with it.

The first ``--warmup`` steps of each configuration are excluded (cold caches, the first search of
an empty bank). Ratios are of means over the kept steps (``median_*``: of medians;
``paired_median_*``: the median over steps t of the per-step ratio). Prints one JSON object last.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")


CORE_SPLIT = ("trainer process pinned to the actor's cores, torch 1 intra-op thread (primary loop; the background-track "
              "thread only does bank/manager work and waits on the worker's pipe); extractor worker process (spawn) "
              "pinned to the extractor's cores, torch 1 intra-op thread (distillation, refinement, merge generation, "
              "CISPO, checkpoints); grpo and sync (extractor in process): the actor's cores, 1 thread")


WORKLOAD = ["extractor.think_tokens=64", "actor.lr=1e-6"]

CONFIGS = {"grpo": ("grpo", True), "complementary_async": ("complementary", True),
           "complementary_sync": ("complementary", False)}

PHASES = ("rollout_time_s", "update_time_s", "search_latency_s", "actions_per_episode", "success")


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads), from ``/proc``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Arm:
    """One configuration: its trainer, and what its steps measured."""

    name: str
    trainer: Any
    tmp: Any
    times: list[float] = field(default_factory=list)
    phases: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in PHASES})
    extractor_cpu: list[float] = field(default_factory=list)

    @property
    def worker_pid(self) -> int | None:
        ext = self.trainer.c.service.extractor
        return ext.pid if ext.__class__.__name__ == "ExtractorWorker" else None

    def step(self, t: int) -> None:
        pid = self.worker_pid
        cpu0 = 0.0
        if pid is not None:
            cpu0 = _process_cpu_s(pid)
            os.kill(pid, signal.SIGCONT)
        try:
            row = self.trainer.step(t)
        finally:
            if pid is not None:
                os.kill(pid, signal.SIGSTOP)
                self.extractor_cpu.append(_process_cpu_s(pid) - cpu0)
        self.times.append(row["step_time_s"])
        for k in PHASES:
            self.phases[k].append(float(row.get(k) or 0.0))

    def close(self) -> dict[str, Any]:
        """Stop the track, release the worker, and report the run's counters."""
        c = self.trainer.c
        pid = self.worker_pid
        try:
            if pid is not None:
                os.kill(pid, signal.SIGCONT)  # a stopped child could not answer close()
            st = c.service.stats().to_dict()
            out = {"distilled": st["distilled"], "distill_batches": st.get("distill_batches", 0),
                   "extractor_updates": st["extractor_updates"], "merges": st["merges"],
                   "queue_depth_end": st["queue_depth"], "track_errors": st.get("errors", 0),
                   "track_cpu_s": st.get("cpu_s", 0.0), "extractor_process": pid is not None,
                   "core_split": c.cpu_split.describe() if c.cpu_split else None}
            c.service.stop()
        finally:
            self.trainer.close()
            self.tmp.cleanup()
        return out


def build(name: str, steps: int, extra: list[str], cpus: set[int]) -> Arm:
    from crl_train.config import load_config
    from crl_train.run.trainer import Trainer

    method, asynchronous = CONFIGS[name]
    overrides = [f"method={method}", f"train.steps={steps}", "train.eval_episodes=0", "train.checkpoint_every=1000",
                 f"experience.asynchronous={str(asynchronous).lower()}", "experience.actor_threads=1",
                 "experience.extractor_threads=1", *extra]
    tmp = tempfile.TemporaryDirectory(prefix=f"bench_{name}_")
    # each trainer splits the cores it finds: give it the process's original set, not the
    # actor's share the previous trainer pinned the process to
    os.sched_setaffinity(0, cpus)
    trainer = Trainer(load_config(None, overrides), tmp.name, progress=False)
    arm = Arm(name, trainer, tmp)
    if arm.worker_pid is not None:
        os.kill(arm.worker_pid, signal.SIGSTOP)  # runs only during its own run's steps
    trainer.c.service.start()
    return arm


SPIN = """
import os, sys, time
os.sched_setaffinity(0, [int(c) for c in sys.argv[1].split(",")])
end = time.perf_counter() + float(sys.argv[2])
while time.perf_counter() < end:
    sum(range(1000))
"""
"""Child of :func:`core_interference`: a pure-Python busy loop on the given cores (run with ``-c``,
so it needs nothing importable from this script)."""


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
    import subprocess

    if not hasattr(os, "sched_setaffinity") or not extractor_cpus:
        return {"slowdown": None, "why": "no separate extractor cores to probe"}
    before = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, actor_cpus)
    try:
        alone = min(_python_loop_s() for _ in range(3))
        proc = subprocess.Popen([sys.executable, "-c", SPIN, ",".join(map(str, extractor_cpus)), "60"])
        try:
            time.sleep(1.0)  # the child is spinning
            busy = min(_python_loop_s() for _ in range(3))
            spinner_cpu = _process_cpu_s(proc.pid)  # proves the child really ran beside the loop
        finally:
            proc.terminate()
            proc.wait()
    finally:
        os.sched_setaffinity(0, before)
    return {"slowdown": round(busy / alone, 3), "alone_s": round(alone, 4), "beside_busy_core_s": round(busy, 4),
            "spinner_cpu_s": round(spinner_cpu, 2), "actor_cpus": actor_cpus, "extractor_cpus": extractor_cpus}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="actor steps per configuration (interleaved)")
    ap.add_argument("--warmup", type=int, default=2, help="first steps of each configuration excluded")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config overrides applied to all three runs")
    ap.add_argument("--tiny-extractor", action="store_true",
                    help="keep the tiny preset's one-line extractor instead of the benchmark's WORKLOAD")
    ap.add_argument("--json", action="store_true", help="print only the JSON result")
    args = ap.parse_args(argv)
    if args.warmup >= args.steps:
        ap.error(f"--warmup ({args.warmup}) must be < --steps ({args.steps})")
    import logging

    import torch

    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    load_start = os.getloadavg()
    overrides = ([] if args.tiny_extractor else WORKLOAD) + args.overrides
    from crl_train.config import load_config
    from crl_train.policy.affinity import available_cpus, split_cpus

    # the split the runs will use, --set experience.actor_cpus=... included
    exp = load_config(None, overrides).experience
    split = split_cpus(available_cpus(), exp.actor_cpus, exp.extractor_cpus, pin=exp.pin_cpus)
    interference = core_interference(list(split.actor or ()), list(split.extractor or ()))
    t0 = time.perf_counter()
    cpus = os.sched_getaffinity(0)
    arms: dict[str, Arm] = {}
    counters: dict[str, dict[str, Any]] = {}
    orders = list(itertools.permutations(CONFIGS))
    try:
        for name in CONFIGS:
            arms[name] = build(name, args.steps, overrides, cpus)
        for t in range(args.steps):
            for name in orders[t % len(orders)]:
                arms[name].step(t)
            if not args.json:
                print(f"step {t}: " + ", ".join(f"{n} {a.times[-1]:.3f} s" for n, a in arms.items()), file=sys.stderr)
    finally:
        for name in reversed(list(arms)):
            counters[name] = arms[name].close()
        os.sched_setaffinity(0, cpus)
    w = args.warmup
    kept = {k: a.times[w:] for k, a in arms.items()}
    mean = {k: statistics.mean(v) for k, v in kept.items()}
    median = {k: statistics.median(v) for k, v in kept.items()}

    def paired(num: str, den: str) -> float:
        return statistics.median(x / y for x, y in zip(kept[num], kept[den], strict=True))

    a = arms["complementary_async"]
    ext_cpu = statistics.mean(a.extractor_cpu[w:]) if a.extractor_cpu else 0.0
    out = {
        "grpo_step_s": mean["grpo"],
        "async_step_s": mean["complementary_async"],
        "sync_step_s": mean["complementary_sync"],
        "async_over_grpo": mean["complementary_async"] / mean["grpo"],
        "sync_over_async": mean["complementary_sync"] / mean["complementary_async"],
        "median_async_over_grpo": median["complementary_async"] / median["grpo"],
        "median_sync_over_async": median["complementary_sync"] / median["complementary_async"],
        "paired_median_async_over_grpo": paired("complementary_async", "grpo"),
        "paired_median_sync_over_async": paired("complementary_sync", "complementary_async"),
        "steps_kept": {k: len(v) for k, v in kept.items()},
        "extractor_cpu_per_step_s": ext_cpu,
        "extractor_busy_fraction": ext_cpu / mean["complementary_async"],
        # CPU the background thread took in the trainer process (the actor's core and GIL), per step
        "track_cpu_per_step_s": counters["complementary_async"]["track_cpu_s"] / args.steps,
        "queue_depth_end_async": counters["complementary_async"]["queue_depth_end"],
        "phases_mean_s": {k: {p: statistics.mean(v[w:]) for p, v in arm.phases.items()} for k, arm in arms.items()},
        "core_split": {"split": counters["complementary_async"]["core_split"], "threads": CORE_SPLIT},
        "core_interference": interference,
        "cpu_count": os.cpu_count(),
        "loadavg_start_end": [round(load_start[0], 2), round(os.getloadavg()[0], 2)],
        "wall_s": round(time.perf_counter() - t0, 1),
        "overrides": overrides,
        "counters": counters,
        "step_times_s": {k: [round(x, 4) for x in arm.times] for k, arm in arms.items()},
    }
    if not args.json:
        for k, v in out.items():
            if k != "step_times_s":
                print(f"{k}: {v}", file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
