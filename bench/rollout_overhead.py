"""What the experience wrappers cost a rollout: the same episodes raw and wrapped.

For each size N (episodes in flight) the same N envs run the same seeded episodes, all advanced
together one turn at a time as a trainer does, raw (``gym.make``) and wrapped
(``ExperienceWrapper(SearchAndAskWrapper(env))`` over a ``LocalClient`` of an
``ExperienceManager`` with a 10,000-entry bank): the guided half gets its entries prefetched in
one ``search_many`` batch and passed in ``reset(options=...)``, the free half none, and every
finished episode submits its ``DistillationRequest``. After each wrapped run the queue is
drained and every request is read (its trajectory built and checked against the steps taken),
untimed: that is the consumer's work (the trainer's background track), not the rollout's.

Two policies:
* ``50 ms``: sleeps a stated 50 ms (``--policy-ms``) once per batched turn, standing in for
  batched LLM generation (real turns take seconds, so this is the harsh case). Raw and wrapped
  copies of the same episodes (two sets of N envs) run *interleaved*: every turn of each side
  (its sleep plus stepping its live envs) is one timed segment, the two sides alternate and
  their order flips every turn; resets alternate in chunks of 32 envs. A load burst from
  another process thus lands on both sides instead of on whichever whole run it overlapped
  (whole-run ratios moved by ±10 % on this shared 2-core machine). Two sets of N envs take
  turns being the raw and the wrapped side: a pair is two runs with the roles swapped and its
  ratio the geometric mean of their wrapped / raw wall times, which cancels a speed difference
  between the sets themselves. ``ratio`` is the median over ``--pairs`` pairs;
  ``ratio_pairs`` / ``ratio_runs`` list them, and ``ratio_aa`` gives set B raw vs set A raw
  with the same method (noise floor and set bias). Cyclic-GC time is charged to the wrapped side even when a collection runs in a raw
  segment (``gc_ms_charged_to_wrapped``): a raw loop frees each step's objects, so collections
  are caused by what the wrapped side keeps alive. ``ratio_cpu`` is the same median with the
  stepping in this thread's CPU time and the policy's 50 ms per turn counted as stated.
  ``--trainer-buffer`` makes both loops keep every step's result, as a trainer's trajectory
  buffer does; then only what the wrappers keep *beyond* that differs between the sides.
* ``zero-cost``: a scripted policy (precomputed actions), which exposes the wrappers' own cost.
  Differencing two wall times of a 60–700 µs env step on a shared machine is noisier than the
  microseconds being measured, so the episodes of a raw run are recorded and replayed through
  a ``ReplayEnv`` (≈0.1 µs per step), raw and wrapped, alternating ``--repeats`` times: the
  median difference is the wrappers' cost alone. Non-terminal steps are timed apart from the
  episode ends, giving ``wrapper_us_per_step`` (recording one step) and
  ``wrapper_ms_per_episode`` (the prefetch's share, reset, the terminal step and submitting
  the request), in thread CPU time so that other processes on a shared machine do not count.

Which env runs at which size: ``crl/MiniHack-Room-5x5-v0`` at every size. A MiniHack instance
takes ~30 ms to create and ~3.5 MB of memory here (2,100 of them: 80 s, 7.5 GB), and a size
needs two sets of N envs, so 1,024 fits a 24 GB machine. A size whose two sets would not fit
the memory available (``MEMORY_PER_MINIHACK_MB`` each, with headroom) runs on ``--large-env``
(Sokoban) instead, and the JSON's ``note`` says so; each size's row names its env.

    python bench/rollout_overhead.py --json            # last line: one JSON object
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium as gym

import crl_gym  # noqa: F401  (registers the crl/ envs)
from crl_gym.clients import LocalClient
from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.embedders import HashingEmbedder
from crl_gym.experience.manager import ExperienceManager
from crl_gym.protocol import AddOp
from crl_gym.wrappers import wrap

TARGETS = {"ratio": 1.02, "wrapper_us_per_step": 2.0, "wrapper_ms_per_episode": 1.0}
MEMORY_PER_MINIHACK_MB = 8.0
"""Budget per MiniHack instance when deciding whether a size fits (measured: ~3.5 MB)."""


def available_memory_mb() -> float:
    """``MemAvailable`` from /proc/meminfo (infinite where it cannot be read)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return math.inf


def env_for_size(n: int, args: argparse.Namespace, available_mb: float) -> str:
    """``--env`` when its two sets of ``n`` instances fit in ``available_mb`` (see the module
    docstring), else ``--large-env``."""
    if n > args.minihack_max or ("MiniHack" in args.env and 2 * n * MEMORY_PER_MINIHACK_MB > available_mb):
        return str(args.large_env)
    return str(args.env)


def build_manager(bank_size: int, dim: int) -> ExperienceManager:
    """A manager over an in-memory bank of ``bank_size`` distinct entries (hashing embedder)."""
    rooms, moves, verbs = ["room", "maze", "river", "key room", "box puzzle"], ["north", "east", "south", "west"], ["avoid", "use", "check"]
    texts = [
        f"Tip {i}: when the {rooms[i % 5]} has {i % 13} exits, go {moves[i % 4]} first and {verbs[i % 3]} item {i % 97}."
        for i in range(bank_size)
    ]
    emb = HashingEmbedder(dim)
    manager = ExperienceManager(ExperienceBank(None, dim=dim), emb)
    manager.apply_ops([AddOp(t) for t in texts])
    return manager


class ReplayEnv(gym.Env):
    """Replays one recorded episode: the env part of the cost drops to ~0.3 µs per step."""

    metadata = {"render_modes": []}

    def __init__(self, spaces_from: gym.Env, reset_out: tuple[Any, dict[str, Any]], steps: list[tuple[Any, ...]]) -> None:
        self.observation_space = spaces_from.observation_space
        self.action_space = spaces_from.action_space
        self._reset_out, self._steps, self._t = reset_out, steps, 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        self._t = 0
        return self._reset_out[0], dict(self._reset_out[1])  # a fresh dict, as a real env gives

    def step(self, action: Any) -> tuple[Any, ...]:
        out = self._steps[self._t]
        self._t += 1
        return out


def scripted_actions(actions: list[str], n: int, turns: int) -> list[list[str]]:
    """Deterministic per (env, turn), precomputed so that choosing costs nothing."""
    k = len(actions)
    return [[actions[(i * 7 + t * 3 + (t // 5)) % k] for i in range(n)] for t in range(turns)]


def prefetch(n: int, client: Any, task: str) -> list[Any]:
    """The guided half's entries (the first ``n // 2`` envs), fetched in one ``search_many``."""
    return list(client.search_many([task] * (n // 2)))


def reset_range(envs: Sequence[gym.Env], seeds: list[int], wrapped: bool, refs: list[Any], lo: int, hi: int) -> None:
    """Reset envs ``lo..hi-1``: plain when raw; guided with its prefetched entry or free when wrapped."""
    for i in range(lo, hi):
        if not wrapped:
            envs[i].reset(seed=seeds[i])
        elif i < len(refs):
            envs[i].reset(seed=seeds[i], options={"experience": "guided", "prefetched": refs[i]})
        else:
            envs[i].reset(seed=seeds[i], options={"experience": "free"})


def reset_all(envs: Sequence[gym.Env], seeds: list[int], client: Any, task: str, wrapped: bool) -> None:
    refs = prefetch(len(envs), client, task) if wrapped else []
    reset_range(envs, seeds, wrapped, refs, 0, len(envs))


def run_live(envs: Sequence[gym.Env], seeds: list[int], table: list[list[str]], client: Any, task: str,
             wrapped: bool, policy_s: float, record: list[Any] | None = None) -> tuple[float, int, float]:
    """All envs advance together one turn at a time; returns (wall s, steps, thread CPU s)."""
    t0, c0 = time.perf_counter(), time.thread_time()
    if record is not None:
        for env, seed in zip(envs, seeds, strict=True):
            record.append([env.reset(seed=seed), []])
    else:
        reset_all(envs, seeds, client, task, wrapped)
    active, t, steps = list(range(len(envs))), 0, 0
    while active:
        if policy_s:
            time.sleep(policy_s)
        row, still = table[t], []
        for i in active:
            out = envs[i].step(row[i])
            if record is not None:
                record[i][1].append(out)
            if not (out[2] or out[3]):
                still.append(i)
        steps += len(active)
        active, t = still, t + 1
    return time.perf_counter() - t0, steps, time.thread_time() - c0


def run_replay(envs: Sequence[gym.Env], seeds: list[int], table: list[list[str]], lengths: list[int], client: Any,
               task: str, wrapped: bool) -> tuple[float, float, float]:
    """Replay timing split into (reset phase, non-terminal steps, terminal steps) seconds of this
    thread's CPU time: on a shared machine, time spent descheduled is not the wrappers' cost."""
    clock = time.thread_time
    t0 = clock()
    reset_all(envs, seeds, client, task, wrapped)
    t_reset = clock() - t0
    t_mid = t_end = 0.0
    for t in range(max(lengths)):
        row = table[t]
        mid = [i for i in range(len(envs)) if t < lengths[i] - 1]
        end = [i for i in range(len(envs)) if t == lengths[i] - 1]
        t0 = clock()
        for i in mid:
            envs[i].step(row[i])
        t1 = clock()
        for i in end:
            envs[i].step(row[i])
        t_mid += t1 - t0
        t_end += clock() - t1
    return t_reset, t_mid, t_end


def drain(manager: ExperienceManager, expected_requests: int, expected_steps: int) -> None:
    """Take every queued request and read it as a consumer would: the trajectories must hold
    exactly the steps the run took (nothing lost, nothing duplicated)."""
    reqs: list[Any] = []
    while manager.pending():
        reqs += manager.get_requests(4096, 0.0)
    steps = sum(len(r.trajectory) for r in reqs)
    if len(reqs) != expected_requests or steps != expected_steps:
        raise RuntimeError(f"expected {expected_requests} requests with {expected_steps} steps, "
                           f"the manager received {len(reqs)} with {steps}")


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


class GcClock:
    """Seconds spent in cyclic garbage collection (via ``gc.callbacks``) while entered."""

    def __init__(self) -> None:
        self.total = 0.0
        self.collections = 0
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._t0
            self.collections += 1

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def run_lockstep(sides: Mapping[bool, Sequence[gym.Env]], seeds: list[int], table: list[list[str]], client: Any, task: str,
                 policy_s: float, gc_clock: GcClock, keep: bool = False, wrapped_side: bool = True,
                 ) -> dict[bool, dict[str, float]]:
    """Raw (``False``) and wrapped (``True``) copies of the same episodes, interleaved turn by turn.

    Each turn of each side is one timed segment: the policy's sleep, then stepping every live
    env of that side; the order of the two sides flips every turn (resets: every 32 envs, after
    the wrapped side's one ``search_many`` for its guided half). A load burst from another
    process therefore lands on both sides alike instead of on whichever whole run it overlapped
    (which on a shared 2-core machine moves a whole-run ratio by ±10 %). Cyclic-GC time inside
    the raw side's segments is charged to the wrapped side: raw episodes free their objects as
    they go (a raw run alone triggers almost no collection), so a collection there is paid for
    objects the wrapped side keeps alive — conservative, never in the wrappers' favour.

    ``keep``: both sides' loops also keep every step's result, as a trainer's trajectory buffer
    does; then only the wrappers' *additional* retention differs between the sides, both sides
    trigger collections, and each side's segments pay for the collections that run in them.
    ``wrapped_side=False``: the ``True`` side is raw too (an A/A run: the method's noise floor).
    """
    out = {w: {"wall": 0.0, "cpu": 0.0, "gc": 0.0, "steps": 0.0} for w in (False, True)}
    active = {w: list(range(len(seeds))) for w in (False, True)}
    turn_index = [0]
    buffers: dict[bool, list[Any]] = {False: [], True: []}

    refs: list[Any] = []
    chunk = [0, 0]

    def fetch(w: bool) -> None:
        refs.extend(prefetch(len(seeds), client, task))

    def reset(w: bool) -> None:
        reset_range(sides[w], seeds, w and wrapped_side, refs, chunk[0], chunk[1])

    def turn(w: bool) -> None:
        if policy_s:
            time.sleep(policy_s)
        envs, row, still = sides[w], table[turn_index[0]], []
        for i in active[w]:
            res = envs[i].step(row[i])
            if keep:
                buffers[w].append(res)
            if not (res[2] or res[3]):
                still.append(i)
        out[w]["steps"] += len(active[w])
        active[w] = still

    def timed(w: bool, fn: Any) -> None:
        g0, t0, c0 = gc_clock.total, time.perf_counter(), time.thread_time()
        fn(w)
        out[w]["wall"] += time.perf_counter() - t0
        out[w]["cpu"] += time.thread_time() - c0
        out[w]["gc"] += gc_clock.total - g0

    order = [False, True]
    # Resets are interleaved too, in chunks of 32 envs (a Sokoban reset generates a level, so
    # a whole side's resets would be one long segment exposed to a single load burst).
    if wrapped_side:
        timed(True, fetch)
    for lo in range(0, len(seeds), 32):
        chunk[:] = [lo, min(lo + 32, len(seeds))]
        order.reverse()
        for w in order:
            timed(w, reset)
    while active[False] or active[True]:
        order.reverse()
        for w in order:
            if active[w]:
                timed(w, turn)
        turn_index[0] += 1
    # With --trainer-buffer both sides keep their steps and cause collections: each pays its own.
    moved = 0.0 if keep else out[False]["gc"]
    for key in ("wall", "cpu"):
        out[False][key] -= moved
        out[True][key] += moved
    return out


def bench_size(n: int, env_id: str, manager: ExperienceManager, args: argparse.Namespace) -> dict[str, Any]:
    client = LocalClient(manager)
    raw = [gym.make(env_id) for _ in range(n)]
    probe_obs, probe_info = raw[0].reset(seed=0)
    task = str(probe_info.get("task", probe_obs))  # the trainer knows its tasks before reset
    acts = list(probe_info.get("admissible_actions") or ["north", "east", "south", "west"])
    table = scripted_actions(acts, n, 1000)
    seeds = [1000 * n + i for i in range(n)]
    wrapped = [wrap(env, client) for env in raw]

    # Zero-cost policy on the real env: record the episodes (and warm both paths up).
    record: list[Any] = []
    run_live(raw, seeds, table, client, task, False, 0.0, record)
    _, steps, _ = run_live(raw, seeds, table, client, task, False, 0.0)
    _, steps_w, _ = run_live(wrapped, seeds, table, client, task, True, 0.0)
    if steps_w != steps:
        raise RuntimeError(f"wrapped run took {steps_w} steps, raw {steps}: the wrappers changed the episodes")
    drain(manager, n, steps)

    # Zero-cost replay: the wrappers' own cost, per step and per episode (median of pairs).
    lengths = [len(r[1]) for r in record]
    mid_steps = sum(x - 1 for x in lengths)
    d_step: list[float] = []
    d_episode: list[float] = []
    for rep in range(args.repeats):
        timing = {}
        for is_wrapped in ((False, True) if rep % 2 == 0 else (True, False)):
            replay = [ReplayEnv(raw[0], r[0], r[1]) for r in record]
            envs = [wrap(e, client) for e in replay] if is_wrapped else replay
            gc.collect()
            timing[is_wrapped] = run_replay(envs, seeds, table, lengths, client, task, is_wrapped)
            if is_wrapped:
                drain(manager, n, steps)
        d_step.append((timing[True][1] - timing[False][1]) / max(1, mid_steps))
        d_episode.append(((timing[True][0] - timing[False][0]) + (timing[True][2] - timing[False][2])) / n)

    # 50 ms per batched turn: raw and wrapped interleaved turn by turn. Two sets of envs, A and
    # B; each pair is two runs with the roles swapped (A raw + B wrapped, then B raw + A
    # wrapped), and its ratio is the geometric mean of the two, which cancels any speed
    # difference between the sets themselves (``ratio_aa``: up to 4 % for MiniHack here).
    policy_s = args.policy_ms / 1000
    turns = max(lengths)
    twin_envs = [gym.make(env_id) for _ in range(n)]
    twins = [wrap(env, client) for env in twin_envs]
    roles: list[dict[bool, Sequence[gym.Env]]] = [{False: raw, True: twins}, {False: twin_envs, True: wrapped}]
    runs = []
    with GcClock() as gc_clock:
        for k in range(2 * args.pairs):
            gc.collect()
            c0 = gc_clock.collections
            res = run_lockstep(roles[k % 2], seeds, table, client, task, policy_s, gc_clock,
                               keep=args.trainer_buffer)
            res[True]["collections"] = gc_clock.collections - c0
            if res[True]["steps"] != steps or res[False]["steps"] != steps:
                raise RuntimeError(f"lockstep steps {res[False]['steps']}/{res[True]['steps']}, expected {steps}")
            drain(manager, n, steps)
            runs.append(res)
        aa = []  # A/A: the same method with both sides raw, i.e. what a ratio of 1.000 looks like
        for _ in range(args.aa_pairs):
            gc.collect()
            res = run_lockstep({False: raw, True: twin_envs}, seeds, table, client, task, policy_s, gc_clock,
                               keep=args.trainer_buffer, wrapped_side=False)
            aa.append(res[True]["wall"] / res[False]["wall"])
    one = [r[True]["wall"] / r[False]["wall"] for r in runs]
    one_cpu = [(turns * policy_s + r[True]["cpu"]) / (turns * policy_s + r[False]["cpu"]) for r in runs]
    ratios = [math.sqrt(a * b) for a, b in zip(one[0::2], one[1::2], strict=True)]
    ratios_cpu = [math.sqrt(a * b) for a, b in zip(one_cpu[0::2], one_cpu[1::2], strict=True)]
    live_cpu_diff = [(r[True]["cpu"] - r[False]["cpu"]) / steps for r in runs]
    for twin in twins:
        twin.close()
    for env in raw:
        env.close()
    return {
        "env": env_id,
        "episodes_in_flight": n,
        "steps": steps,
        "turns": turns,
        "ratio": round(median(ratios), 4),
        "ratio_cpu": round(median(ratios_cpu), 4),
        "ratio_min": round(min(ratios), 4),
        "ratio_max": round(max(ratios), 4),
        "pairs": args.pairs,
        "ratio_pairs": [round(x, 4) for x in ratios],
        "ratio_runs": [round(x, 4) for x in one],
        "ratio_aa": [round(x, 4) for x in aa],
        "wrapper_us_per_step": round(max(0.0, median(d_step)) * 1e6, 3),
        "wrapper_ms_per_episode": round(max(0.0, median(d_episode)) * 1e3, 4),
        "raw_s_50ms": round(median([r[False]["wall"] for r in runs]), 3),
        "wrapped_s_50ms": round(median([r[True]["wall"] for r in runs]), 3),
        "live_cpu_us_per_step": round(median(live_cpu_diff) * 1e6, 2),
        "env_cpu_us_per_step": round(median([r[False]["cpu"] for r in runs]) / steps * 1e6, 1),
        "gc_collections_per_run": median([r[True]["collections"] for r in runs]),
        "gc_ms_charged_to_wrapped": round(median([r[False]["gc"] + r[True]["gc"] for r in runs]) * 1e3, 2),
        "requests_submitted_per_run": n,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="128,256,512,1024", help="episodes in flight, comma separated")
    p.add_argument("--env", default="crl/MiniHack-Room-5x5-v0")
    p.add_argument("--large-env", default="crl/Sokoban-6x6-v0",
                   help="env for sizes above --minihack-max or whose MiniHack instances would not fit in memory")
    p.add_argument("--minihack-max", type=int, default=1024, help="largest size run on --env")
    p.add_argument("--bank-size", type=int, default=10_000)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--policy-ms", type=float, default=50.0, help="simulated generation time per batched turn")
    p.add_argument("--pairs", type=int, default=3,
                   help="pairs of interleaved raw+wrapped 50 ms runs (roles of the two env sets swapped) per size")
    p.add_argument("--repeats", type=int, default=7, help="alternating raw/wrapped zero-cost replays per size")
    p.add_argument("--aa-pairs", type=int, default=1, help="raw-vs-raw runs (set A vs set B) per size: noise and set bias")
    p.add_argument("--trainer-buffer", action="store_true",
                   help="both loops keep every step's result (a trainer's trajectory buffer), raw and wrapped alike")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    args = p.parse_args(argv)
    if args.pairs < 1 or args.repeats < 1:
        p.error("--pairs and --repeats must be >= 1")
    warnings.filterwarnings("ignore")
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    t0 = time.perf_counter()
    manager = build_manager(args.bank_size, args.dim)
    bank_s = time.perf_counter() - t0
    results = {}
    memory_mb = available_memory_mb()  # read once: the choice and the note must agree
    envs = {str(n): env_for_size(n, args, memory_mb) for n in sizes}
    try:
        for n in sizes:
            env_id = envs[str(n)]
            results[str(n)] = row = bench_size(n, env_id, manager, args)
            if not args.json:
                print(f"N={n:5d} {env_id}: ratio {row['ratio']:.4f} [{row['ratio_min']:.4f}, {row['ratio_max']:.4f}]  "
                      f"cpu {row['ratio_cpu']:.4f}  {row['wrapper_us_per_step']:.3f} us/step  "
                      f"{row['wrapper_ms_per_episode']:.4f} ms/episode  (env {row['env_cpu_us_per_step']} us/step)",
                      file=sys.stderr)
    finally:
        manager.close()
    out = {
        "benchmark": "rollout_overhead",
        "sizes": results,
        "targets": TARGETS,
        "meets_targets": all(
            r["ratio"] <= TARGETS["ratio"] and r["wrapper_us_per_step"] <= TARGETS["wrapper_us_per_step"]
            and r["wrapper_ms_per_episode"] <= TARGETS["wrapper_ms_per_episode"] for r in results.values()
        ),
        "bank_size": args.bank_size,
        "embedder": f"hashing:{args.dim}",
        "policy_ms": args.policy_ms,
        "trainer_buffer": args.trainer_buffer,
        "policy": f"time.sleep({args.policy_ms / 1000:g}) once per batched turn (stands in for batched LLM generation)",
        "wrappers": "ExperienceWrapper(SearchAndAskWrapper(env)), guided half prefetched with one search_many",
        "envs": envs,
        "note": (f"every size runs {args.env}" if all(e == args.env for e in envs.values()) else
                 f"sizes {[int(n) for n, e in envs.items() if e != args.env]} run {args.large_env}: above "
                 f"--minihack-max {args.minihack_max} or more than {MEMORY_PER_MINIHACK_MB:g} MB x 2 sets "
                 f"per MiniHack instance would exceed the {memory_mb:.0f} MB available"),
        "bank_build_s": round(bank_s, 2),
        "loadavg_1min_at_end": round(os.getloadavg()[0], 2),
        "cpu_count": os.cpu_count(),
        "total_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
