"""bench/rollout_overhead.py: a tiny end-to-end run, and which env each size gets."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "rollout_overhead.py"


@pytest.fixture(scope="module")
def bench() -> Any:
    spec = importlib.util.spec_from_file_location("rollout_overhead_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_tiny_run_prints_every_figure(bench: Any, capsys: pytest.CaptureFixture[str]) -> None:
    out = bench.main(["--sizes", "4", "--env", "crl/Sokoban-6x6-v0", "--pairs", "1", "--repeats", "1",
                      "--aa-pairs", "0", "--bank-size", "40", "--dim", "32", "--policy-ms", "1", "--json"])
    row = out["sizes"]["4"]
    assert row["env"] == "crl/Sokoban-6x6-v0" and row["requests_submitted_per_run"] == 4
    for key in ("ratio", "wrapper_us_per_step", "wrapper_ms_per_episode"):
        assert isinstance(row[key], float) and row[key] >= 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith('{"benchmark": "rollout_overhead"')


def test_minihack_at_every_size_unless_memory_is_short(bench: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    args = argparse.Namespace(env="crl/MiniHack-Room-5x5-v0", large_env="crl/Sokoban-6x6-v0", minihack_max=1024)
    monkeypatch.setattr(bench, "available_memory_mb", lambda: 20_000.0)
    assert bench.env_for_size(1024, args) == "crl/MiniHack-Room-5x5-v0"  # 2 x 1024 x 8 MB = 16 GB fits
    monkeypatch.setattr(bench, "available_memory_mb", lambda: 4_000.0)
    assert bench.env_for_size(1024, args) == "crl/Sokoban-6x6-v0"
    assert bench.env_for_size(128, args) == "crl/MiniHack-Room-5x5-v0"  # 2 GB fits in 4
    assert bench.env_for_size(2048, argparse.Namespace(**{**vars(args), "minihack_max": 1024})) == "crl/Sokoban-6x6-v0"
