"""bench/service.py: a tiny end-to-end run (real ``crl-experience serve`` subprocess, both faces)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from _bench import load_bench


@pytest.fixture(scope="module")
def bench() -> Any:
    return load_bench("service")


def test_tiny_run_prints_every_figure(bench: Any, capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    out = bench.main(["--entries", "200", "--clients", "32", "--rounds", "2", "--embedder", "hashing:64",
                      "--cache-dir", str(tmp_path), "--round-timeout", "60", "--warmup", "1", "--json"])
    assert set(out["cases"]) == {"warm", "cold", "submit", "warm_uncombined"}
    for name, case in out["cases"].items():
        for key in ("mean_ms", "p99_ms", "qps", "http_over_local"):
            assert isinstance(case[key], float) and case[key] > 0, (name, key)
        assert case["failed_calls"] == {"http": 0, "local": 0}, name
        assert len(case["rounds"]) == 2 and case["local"]["qps"] > 0
        assert case["cpu_ms"]["http"]["server"] >= 0 and case["cpu_ms"]["local"]["clients"] >= 0
    cold = out["cases"]["cold"]
    assert cold["embed_floor_ms"] > 0 and cold["cold_over_floor"] == pytest.approx(cold["mean_ms"] / cold["embed_floor_ms"], rel=1e-2)
    for suffix in ("", "_median_round"):
        assert set(out["meets" + suffix]) == {"warm_p99_ms", "cold_over_floor", "submit_p99_ms"}
        assert out["meets_targets" + suffix] == all(out["meets" + suffix].values())
    warm = out["cases"]["warm"]
    p99s = [r["p99_ms"] for r in warm["rounds"]]
    assert min(p99s) <= warm["median_round"]["http"]["p99_ms"] <= max(p99s) and warm["p99_ms"] >= min(p99s)
    assert out["meets"]["warm_p99_ms"] == (warm["p99_ms"] <= bench.TARGETS["warm_p99_ms"])
    # the submit latency is the caller's wait; delivered_ms runs until the server had them all
    submit = out["cases"]["submit"]
    assert all(r["delivered_ms"] >= r["p99_ms"] > 0 for r in submit["rounds"])
    for face in ("http", "local"):
        assert submit["delivered_ms"][face]["max"] >= submit["delivered_ms"][face]["mean"] > 0
    # every submit of every round reached the server, and every step was ended once
    stats = out["server_stats"]
    assert stats["submitted"] == 3 * 32 and stats["queue_depth"] == 0 and stats["late_requests"] == 0
    assert stats["steps_ended"] == 3 * (1 + 2) + (1 + 2)  # warm-up + 2 rounds per case (cold: 1 warm-up)
    assert out["server_exit_status"] == 0  # SIGTERM: the server closed its service and exited cleanly
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last)["benchmark"] == "service"


def test_queries_are_new_in_every_cold_round(bench: Any) -> None:
    a, b = bench.cold_queries(64, "r0-http"), bench.cold_queries(64, "r1-http")
    assert len(set(a)) == 64 and not set(a) & set(b)
    warm = bench.warm_queries(64)
    assert len(set(warm)) == bench.WARM_TEXTS and warm[:bench.WARM_TEXTS] == warm[bench.WARM_TEXTS:2 * bench.WARM_TEXTS]
