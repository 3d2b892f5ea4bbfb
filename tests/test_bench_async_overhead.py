"""bench/async_overhead.py: a tiny interleaved run end to end, and the core-interference probe."""

from __future__ import annotations

import os
from typing import Any

import pytest
from _bench import load_bench


@pytest.fixture(scope="module")
def bench() -> Any:
    return load_bench("async_overhead")


def test_no_extractor_cores_means_no_probe(bench: Any) -> None:
    assert bench.core_interference([0], [])["slowdown"] is None


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_probe_times_the_loop_alone_and_beside_a_busy_core(bench: Any) -> None:
    before = os.sched_getaffinity(0)
    cores = sorted(before)
    out = bench.core_interference([cores[0]], [cores[1]])
    assert out["alone_s"] > 0 and out["beside_busy_core_s"] > 0
    assert out["slowdown"] == pytest.approx(out["beside_busy_core_s"] / out["alone_s"], abs=2e-3)
    assert out["spinner_cpu_s"] >= 0.5 * out["beside_busy_core_s"]  # the busy core really was busy meanwhile
    assert os.sched_getaffinity(0) == before  # the probe gives the process its cores back


SMALL = ["env.tasks_per_step=1", "env.group_size=4", "env.max_turns=3", "actor.tiny_vocab_size=300",
         "extractor.tiny_vocab_size=300", "actor.tiny_hidden=32", "extractor.tiny_hidden=32", "actor.tiny_layers=1",
         "extractor.tiny_layers=1", "algo.buffer_size=2", "experience.max_prompt_chars=600",
         "extractor.max_context_tokens=512", "extractor.think_tokens=8"]


def test_interleaved_run_prints_the_json_and_leaves_nothing_behind(bench: Any, capsys: pytest.CaptureFixture[str]) -> None:
    import json
    import multiprocessing as mp

    before = os.sched_getaffinity(0)
    args = ["--steps", "3", "--warmup", "1", "--tiny-extractor", "--json"]
    for s in SMALL:
        args += ["--set", s]
    assert bench.main(args) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["steps_kept"] == {"grpo": 2, "complementary_async": 2, "complementary_sync": 2}
    assert out["async_over_grpo"] == pytest.approx(out["async_step_s"] / out["grpo_step_s"])
    assert out["sync_over_async"] == pytest.approx(out["sync_step_s"] / out["async_step_s"])
    assert all(len(v) == 3 for v in out["step_times_s"].values())
    # the sync run distilled in process, every step; the async run's worker did its share
    assert out["counters"]["complementary_sync"]["distilled"] == 3 * 4
    assert out["counters"]["grpo"]["distilled"] == 0 and out["counters"]["complementary_async"]["track_errors"] == 0
    if len(before) >= 2:
        assert out["counters"]["complementary_async"]["extractor_process"] and out["extractor_cpu_per_step_s"] > 0
    assert os.sched_getaffinity(0) == before  # the process gets its cores back
    assert mp.active_children() == []  # the (stopped, then continued) worker is gone


def test_warmup_must_leave_steps(bench: Any) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--steps", "2", "--warmup", "2"])
