"""bench/faults.py: a tiny run (a killed bank writer, a killed and a stopped server, hostile load)."""

from __future__ import annotations

from typing import Any

import pytest
from _bench import load_bench


@pytest.fixture(scope="module")
def bench() -> Any:
    return load_bench("faults")


def test_tiny_run_meets_the_targets(bench: Any, capsys: pytest.CaptureFixture[str]) -> None:
    out = bench.main(["--bank-trials", "1", "--serve-trials", "1", "--clients", "3", "--requests", "20",
                      "--hostile-fraction", "0.5", "--max-body-bytes", "65536", "--max-seconds", "120", "--json"])
    assert out["bank"]["trials"] == 1 and out["acknowledged_writes"] > 0 and out["lost_writes"] == 0
    assert out["serve"]["sigterm"]["acknowledged"] > 0 and out["lost_requests_sigterm"] == 0
    assert out["serve"]["sigterm"]["exit_codes"] == [0]
    assert out["serve"]["sigkill"]["acknowledged"] > 0 and out["lost_requests_beyond_window"] == 0
    hostile = out["hostile"]
    assert hostile["hostile"] > 0 and hostile["hostile_5xx"] == 0
    assert out["well_formed_success_rate"] == 1.0 and out["well_formed_p99_ms"] > 0
    assert out["meets_targets"] is True
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("{") and '"meets_targets": true' in last
