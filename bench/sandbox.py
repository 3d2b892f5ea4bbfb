"""Latency of the SWE-Bench Docker sandbox: container start, tool calls, the shell's own overhead, grading.

Runs ``--rounds`` rounds of C concurrent episodes (C in ``--concurrency``, default 1, 4, 8) of a
scripted agent on the demo instance (a small buggy package, see
``crl_gym.envs.swebench.testing``), once per shell (``--shells``, default the persistent shell
and the ``docker exec`` path it replaces, in the same run): reset (container start),
``--tool-calls`` tool calls (alternating ``execute_bash`` of ``ls calc && python3 -c 'print(6*7)'``
and ``str_replace_editor view``), ``--echo-calls`` tool calls of ``execute_bash`` with ``echo``
(the shell's own cost per call: a trivial command through the whole tool-call path), then the fix
and ``submit`` (grading in a fresh container). Prints median and p90 per metric, shell and
concurrency level, the speed-up of the persistent shell over ``docker exec`` and ``meets_targets``;
the last line is one JSON object with ``--json``. Needs Docker and the base image
(``bash .ci/docker.sh``). The machine is shared: the load average is reported with the figures.

    python bench/sandbox.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from crl_gym.envs.swebench.env import SWEBenchEnv, episode_config
from crl_gym.envs.swebench.image import ImageChoice, instance_image
from crl_gym.envs.swebench.pool import SandboxPool
from crl_gym.envs.swebench.sandbox import SandboxConfig, docker_client
from crl_gym.envs.swebench.testing import fixing_agent, make_demo_instance
from crl_gym.envs.swebench.tools import format_tool_call

METRICS = ("container_start", "tool_call", "echo_tool_call", "grading")
# Targets of the persistent shell (issue: "SWE-Bench sandbox at agent speed"). grading_8 is the
# docker-exec sandbox's median at 8 episodes measured before the change, used when the exec shell
# is not run; otherwise the exec shell's median in the same run is the bar.
TARGETS = {"echo_tool_call_1": 0.030, "echo_tool_call_8": 0.060, "speedup_vs_exec": 5.0,
           "container_start_8": 0.5, "grading_8": 4.20}


def quantiles(values: list[float]) -> dict[str, float]:
    """Median and p90 (nearest-rank) of a sample, in seconds."""
    if not values:
        return {"median": float("nan"), "p90": float("nan"), "n": 0}
    ordered = sorted(values)
    rank = max(0, int(-(-0.9 * len(ordered) // 1)) - 1)  # ceil(0.9 n) - 1
    return {"median": round(statistics.median(ordered), 5), "p90": round(ordered[rank], 5), "n": len(ordered)}


def episode(instance: dict[str, Any], client: Any, tool_calls: int, echo_calls: int, shell: str,
            pool: SandboxPool | None) -> dict[str, list[float]]:
    # the exec shell is today's path throughout: boot at reset, grading container booted at submit
    env = SWEBenchEnv(tasks=[instance], max_turns=tool_calls + echo_calls + 10, client=client,
                      sandbox_config=SandboxConfig(shell=shell), pool=pool, prestart_grading=shell == "persistent")
    out: dict[str, list[float]] = {m: [] for m in (*METRICS, "resolved")}
    try:
        _, info = env.reset(options={"index": 0})
        out["container_start"].append(info["latency"]["container_start"])
        for i in range(tool_calls):
            action = (format_tool_call("execute_bash", command="ls calc && python3 -c 'print(6*7)'") if i % 2 == 0
                      else format_tool_call("str_replace_editor", command="view", path="/testbed/calc/ops.py"))
            *_, info = env.step(action)
            out["tool_call"].append(info["latency"]["tool_call"])
        for _ in range(echo_calls):
            obs, *_, info = env.step(format_tool_call("execute_bash", command="echo ok"))
            if not obs.startswith("ok\n"):
                raise RuntimeError(f"echo through the {shell} shell answered {obs[:200]!r}")
            out["echo_tool_call"].append(info["latency"]["tool_call"])
        messages = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]
        env.step(fixing_agent(messages))  # the str_replace fix
        *_, info = env.step(format_tool_call("submit"))
        out["grading"].append(info["latency"]["grading"])
        out["resolved"].append(float(info.get("success", False)))
    finally:
        env.close()
    return out


def run_level(instance: dict[str, Any], image: ImageChoice, client: Any, c: int, args: argparse.Namespace,
              shell: str) -> dict[str, Any]:
    merged: dict[str, list[float]] = {m: [] for m in (*METRICS, "resolved")}
    pool = None
    prewarm_s = 0.0
    if shell == "persistent" and args.pool:
        # A training loop boots the next batch's containers (an episode's and its grading's) during
        # its update step; here they boot before the level, outside its timings, and none during it.
        pool = SandboxPool(client, spares=2 * c * args.rounds, refill=False)
        t0 = time.monotonic()
        pool.prewarm(image.name, episode_config(SandboxConfig(shell=shell), image))
        prewarm_s = time.monotonic() - t0
        boots_before = len(pool.boot_latencies)
    wall = time.monotonic()
    try:
        for _ in range(args.rounds):
            with ThreadPoolExecutor(c) as threads:
                for res in threads.map(lambda _: episode(instance, client, args.tool_calls, args.echo_calls, shell, pool),
                                       range(c)):
                    for k, v in res.items():
                        merged[k].extend(v)
    finally:
        if pool is not None:
            pool.close()
    result: dict[str, Any] = {m: quantiles(merged[m]) for m in METRICS}
    # a container's own boot (create, start, work tree, shell), whether or not a reset waited for it
    result["container_boot"] = quantiles(pool.boot_latencies if pool is not None else merged["container_start"])
    if pool is not None:
        result["pool"] = {"spares": pool.spares, "refill": pool.refill, "prewarm_s": round(prewarm_s, 3), "boots_before_level": boots_before,
                          "warm_resets": pool.stats["warm"], "cold_resets": pool.stats["cold"]}
    result["episodes"] = len(merged["resolved"])
    result["resolved_rate"] = sum(merged["resolved"]) / max(1, len(merged["resolved"]))
    result["wall_s"] = round(time.monotonic() - wall, 3)
    result["loadavg_1min"] = round(os.getloadavg()[0], 2)
    return result


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def check_targets(levels: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each target with its measured value and verdict (only the levels that were run)."""
    out: dict[str, Any] = {}
    fast, slow = levels.get("persistent", {}), levels.get("exec", {})
    for c in ("1", "8"):
        if c in fast:
            value = fast[c]["echo_tool_call"]["median"]
            out[f"echo_tool_call_{c}"] = {"value": value, "target": TARGETS[f"echo_tool_call_{c}"],
                                          "met": value <= TARGETS[f"echo_tool_call_{c}"]}
    speedups = {c: round(slow[c]["echo_tool_call"]["median"] / fast[c]["echo_tool_call"]["median"], 2)
                for c in fast if c in slow}
    if speedups:
        out["speedup_vs_exec"] = {"value": min(speedups.values()), "per_level": speedups,
                                  "target": TARGETS["speedup_vs_exec"],
                                  "met": min(speedups.values()) >= TARGETS["speedup_vs_exec"]}
    if "8" in fast:
        value = fast["8"]["container_start"]["median"]
        out["container_start_8"] = {"value": value, "target": TARGETS["container_start_8"],
                                    "met": value <= TARGETS["container_start_8"]}
        # "no slower than today": against today's path (the exec shell) in the same run, under the
        # same load; the figure measured before the change is kept for reference
        value = fast["8"]["grading"]["median"]
        target = slow["8"]["grading"]["median"] if "8" in slow else TARGETS["grading_8"]
        out["grading_8"] = {"value": value, "target": target, "reference_before_change": TARGETS["grading_8"],
                            "met": value <= target}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", default="1,4,8", help="comma-separated concurrent episode counts")
    parser.add_argument("--shells", default="persistent,exec", help="comma-separated SandboxConfig.shell modes")
    parser.add_argument("--tool-calls", type=int, default=6)
    parser.add_argument("--echo-calls", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=1, help="rounds of C concurrent episodes per level")
    parser.add_argument("--no-pool", dest="pool", action="store_false",
                        help="persistent shell without a SandboxPool (every reset boots its container)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    shells = [s.strip() for s in args.shells.split(",") if s.strip()]
    client = docker_client()
    load_start = round(os.getloadavg()[0], 2)
    t_all = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="crl-bench-") as tmp:
        instance = make_demo_instance(tmp)
        t0 = time.monotonic()
        choice = instance_image(client, instance)  # built once, outside the timings
        image = choice.name
        build_s = time.monotonic() - t0
        results: dict[str, dict[str, Any]] = {s: {} for s in shells}
        try:
            for c in levels:
                for shell in shells:  # the two paths back to back at each level, under the same load
                    results[shell][str(c)] = run_level(instance, choice, client, c, args, shell)
                    print(f"{shell} shell, concurrency {c}: {json.dumps(results[shell][str(c)])}", file=sys.stderr)
        finally:
            client.images.remove(image, force=True)
    targets = check_targets(results)
    summary = {
        "bench": "sandbox",
        "pool": args.pool,
        "instance_image_build_s": round(build_s, 3),
        "tool_calls_per_episode": args.tool_calls,
        "echo_calls_per_episode": args.echo_calls,
        "shells": results,
        # today's fields: the default (first) shell's levels and its slow-down under load
        "levels": results[shells[0]],
        "median_ratio_vs_first": {
            c: {m: _ratio(r[m]["median"], results[shells[0]][str(levels[0])][m]["median"]) for m in (*METRICS, "container_boot")}
            for c, r in results[shells[0]].items()
        },
        "targets": targets,
        "meets_targets": bool(targets) and all(t["met"] for t in targets.values()),
        "loadavg_1min_at_start": load_start,
        "loadavg_1min_at_end": round(os.getloadavg()[0], 2),
        "cpu_count": os.cpu_count(),
        "total_s": round(time.monotonic() - t_all, 1),
    }
    if args.json:
        print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
