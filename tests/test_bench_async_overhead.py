"""bench/async_overhead.py: the core-interference probe reports what it measured."""

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
    assert os.sched_getaffinity(0) == before  # the probe gives the process its cores back
