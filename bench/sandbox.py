"""Latency of the SWE-Bench Docker sandbox: container start, tool calls and grading.

Runs ``--rounds`` rounds of C concurrent episodes (C in ``--concurrency``, default 1, 4, 8) of a
scripted agent on the demo instance (a small buggy package, see
``crl_gym.envs.swebench.testing``): reset (container start), ``--tool-calls`` tool calls
(alternating ``execute_bash`` and ``str_replace_editor view``), then the fix and ``submit``
(grading in a fresh container). Prints median and p90 per metric and concurrency level; the last
line is one JSON object with ``--json``. Needs Docker and the base image (``bash .ci/docker.sh``).

    python bench/sandbox.py --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from crl_gym.envs.swebench.env import SWEBenchEnv
from crl_gym.envs.swebench.image import instance_image
from crl_gym.envs.swebench.sandbox import docker_client
from crl_gym.envs.swebench.testing import fixing_agent, make_demo_instance
from crl_gym.envs.swebench.tools import format_tool_call


def quantiles(values: list[float]) -> dict[str, float]:
    """Median and p90 (nearest-rank) of a sample, in seconds."""
    if not values:
        return {"median": float("nan"), "p90": float("nan"), "n": 0}
    ordered = sorted(values)
    rank = max(0, int(-(-0.9 * len(ordered) // 1)) - 1)  # ceil(0.9 n) - 1
    return {"median": round(statistics.median(ordered), 4), "p90": round(ordered[rank], 4), "n": len(ordered)}


def episode(instance: dict[str, Any], client: Any, tool_calls: int) -> dict[str, list[float]]:
    env = SWEBenchEnv(tasks=[instance], max_turns=tool_calls + 10, client=client)
    out: dict[str, list[float]] = {"container_start": [], "tool_call": [], "grading": [], "resolved": []}
    try:
        _, info = env.reset(options={"index": 0})
        out["container_start"].append(info["latency"]["container_start"])
        for i in range(tool_calls):
            action = (format_tool_call("execute_bash", command="ls calc && python3 -c 'print(6*7)'") if i % 2 == 0
                      else format_tool_call("str_replace_editor", command="view", path="/testbed/calc/ops.py"))
            *_, info = env.step(action)
            out["tool_call"].append(info["latency"]["tool_call"])
        messages = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]
        env.step(fixing_agent(messages))  # the str_replace fix
        *_, info = env.step(format_tool_call("submit"))
        out["grading"].append(info["latency"]["grading"])
        out["resolved"].append(float(info.get("success", False)))
    finally:
        env.close()
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", default="1,4,8", help="comma-separated concurrent episode counts")
    parser.add_argument("--tool-calls", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=1, help="rounds of C concurrent episodes per level")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    client = docker_client()
    with tempfile.TemporaryDirectory(prefix="crl-bench-") as tmp:
        instance = make_demo_instance(tmp)
        t0 = time.monotonic()
        image = instance_image(client, instance).name  # built once, outside the timings
        build_s = time.monotonic() - t0
        results: dict[str, Any] = {}
        try:
            for c in levels:
                merged: dict[str, list[float]] = {"container_start": [], "tool_call": [], "grading": [], "resolved": []}
                wall = time.monotonic()
                for _ in range(args.rounds):
                    with ThreadPoolExecutor(c) as pool:
                        for res in pool.map(lambda _: episode(instance, client, args.tool_calls), range(c)):
                            for k, v in res.items():
                                merged[k].extend(v)
                wall = time.monotonic() - wall
                results[str(c)] = {k: quantiles(v) for k, v in merged.items() if k != "resolved"}
                results[str(c)]["episodes"] = len(merged["resolved"])
                results[str(c)]["resolved_rate"] = sum(merged["resolved"]) / max(1, len(merged["resolved"]))
                results[str(c)]["wall_s"] = round(wall, 3)
                print(f"concurrency {c}: {json.dumps(results[str(c)])}", file=sys.stderr)
        finally:
            client.images.remove(image, force=True)
    base = results.get(str(levels[0]), {})
    summary = {
        "bench": "sandbox",
        "instance_image_build_s": round(build_s, 3),
        "tool_calls_per_episode": args.tool_calls,
        "levels": results,
        # slow-down of the median under load, relative to the first level (same run)
        "median_ratio_vs_first": {
            c: {m: round(r[m]["median"] / base[m]["median"], 3) for m in ("container_start", "tool_call", "grading")}
            for c, r in results.items() if base
        },
    }
    if args.json:
        print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
