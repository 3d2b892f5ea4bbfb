"""bench/retrieval.py: both modes on a tiny bank (hashing embedder), every figure present and sane."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _bench import load_bench


@pytest.fixture(scope="module")
def bench() -> Any:
    return load_bench("retrieval")


def test_open_loop_reports_rates_floor_and_ceiling(bench: Any, tmp_path: Path) -> None:
    out = bench.main(["--embedder", "hashing:64", "--entries", "300", "--rates", "100", "400", "--duration", "0.3",
                      "--repeats", "2", "--callers", "16", "--tasks", "16", "--cache-dir", str(tmp_path), "--json"])
    assert out["mode"] == "open" and set(out["rates"]) == {"100", "400"}
    for row in out["rates"].values():
        assert len(row["runs"]) == 2
        for key in ("achieved_qps", "mean_ms", "p50_ms", "p99_ms", "floor_p50_ms", "added_p50_ms", "added_p99_ms"):
            assert row[key]["min"] <= row[key]["median"] <= row[key]["max"], key
        assert row["p99_ms"]["median"] >= row["p50_ms"]["median"] > 0
        assert row["achieved_qps"]["median"] > 0
    assert out["ceiling_qps"]["median"] > 0 and out["embedded_after_warmup"] == 0  # warmed before the rates


def test_open_loop_times_from_the_scheduled_arrival(bench: Any) -> None:
    import time

    # a search that takes 20 ms, one caller, arrivals every ~2 ms: later searches wait for the caller,
    # and that wait is in their latency (no coordinated omission)
    row = bench.open_loop(lambda q: time.sleep(0.02), ["q"], rate=500.0, n=10, callers=1, seed=0)
    assert row["max_ms"] > 150 and row["achieved_qps"] < 60


def test_burst_reports_each_rounds_arrival_spread(bench: Any, tmp_path: Path) -> None:
    out = bench.main(["--mode", "burst", "--embedder", "hashing:64", "--entries", "300", "--concurrency", "32",
                      "--rounds", "2", "--naive-rounds", "0", "--cache-dir", str(tmp_path), "--json"])
    level = out["levels"]["32"]
    assert len(level["arrival_spread_ms"]) == 2 and all(s >= 0 for s in level["arrival_spread_ms"])
    assert level["p99_ms"] >= level["mean_ms"] > 0
