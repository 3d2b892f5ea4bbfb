"""bench/async_overhead.py: the core-interference probe reports what it measured."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "async_overhead.py"


@pytest.fixture(scope="module")
def bench() -> Any:
    spec = importlib.util.spec_from_file_location("async_overhead_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_no_extractor_cores_means_no_probe(bench: Any) -> None:
    assert bench.core_interference([0], [])["slowdown"] is None


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_probe_times_the_loop_alone_and_beside_a_busy_core(bench: Any) -> None:
    before = os.sched_getaffinity(0)
    cores = sorted(before)
    out = bench.core_interference([cores[0]], [cores[1]])
    assert out["alone_s"] > 0 and out["beside_busy_core_s"] > 0
    assert out["slowdown"] == pytest.approx(out["beside_busy_core_s"] / out["alone_s"], abs=2e-3)
    assert os.sched_getaffinity(0) == before  # the probe gives the process its cores back
