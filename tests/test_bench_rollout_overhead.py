"""bench/rollout_overhead.py: a tiny end-to-end run, and which env each size gets."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from _bench import load_bench


@pytest.fixture(scope="module")
def bench() -> Any:
    return load_bench("rollout_overhead")


def test_tiny_run_prints_every_figure(bench: Any, capsys: pytest.CaptureFixture[str]) -> None:
    out = bench.main(["--sizes", "4", "--env", "crl/Sokoban-6x6-v0", "--pairs", "1", "--repeats", "1",
                      "--aa-pairs", "0", "--bank-size", "40", "--dim", "32", "--policy-ms", "1", "--json"])
    row = out["sizes"]["4"]
    assert row["env"] == "crl/Sokoban-6x6-v0" and row["requests_submitted_per_run"] == 4
    for key in ("ratio", "wrapper_us_per_step", "wrapper_ms_per_episode"):
        assert isinstance(row[key], float) and row[key] >= 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith('{"benchmark": "rollout_overhead"')


def test_minihack_at_every_size_unless_memory_is_short(bench: Any) -> None:
    args = argparse.Namespace(env="crl/MiniHack-Room-5x5-v0", large_env="crl/Sokoban-6x6-v0", minihack_max=1024)
    assert bench.env_for_size(1024, args, 20_000.0) == "crl/MiniHack-Room-5x5-v0"  # 2 x 1024 x 8 MB = 16 GB fits
    assert bench.env_for_size(1024, args, 4_000.0) == "crl/Sokoban-6x6-v0"
    assert bench.env_for_size(128, args, 4_000.0) == "crl/MiniHack-Room-5x5-v0"  # 2 GB fits in 4
    assert bench.env_for_size(2048, args, 1e9) == "crl/Sokoban-6x6-v0"  # above --minihack-max
