"""bench/explorer.py on a small bank: every case answers, the filters count right, the JSON line is last."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _bench import load_bench


@pytest.fixture(scope="module")
def bench() -> Any:
    return load_bench("explorer")


def test_small_run(bench: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = bench.main(["--entries", "1200", "--dir", str(tmp_path), "--repeats", "3", "--per-page", "50", "--json"])
    assert out["entries"] == 1200
    pages = out["pages"]
    assert set(pages) == set(bench.CASES) and set(out["text_filter"]) == set(bench.TEXT_CASES)
    assert pages["default"]["rows"] == 50 and pages["default"]["total"] == 1200
    assert pages["last_page"]["rows"] == 0  # page 2000 of a 24-page bank is past the end
    assert pages["filter_credited"]["total"] == int(1200 * 0.6)
    assert 0 < pages["filter_retrievals"]["total"] < 1200
    assert out["worst_page_p95_ms"] == max(v["p95_ms"] for v in pages.values())
    assert out["meets_targets"] == (out["worst_page_p95_ms"] <= bench.TARGET_MS)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last)["entries"] == 1200
    again = bench.main(["--entries", "1200", "--dir", str(tmp_path), "--repeats", "1"])  # reuses the bank
    assert again["entries"] == 1200 and again["pages"]["filter_credited"]["total"] == int(1200 * 0.6)
