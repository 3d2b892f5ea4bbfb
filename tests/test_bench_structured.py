"""bench/structured.py: a tiny end-to-end run prints every figure."""

from __future__ import annotations

import json

import pytest
from _bench import load_bench


def test_tiny_run_prints_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench("structured")
    out = bench.main(["--prompts", "2", "--repeats", "2", "--json"])
    assert out["prompts"] == {"distill": 2, "refine": 1, "merge": 1} and len(out["ratios"]) == 2
    assert out["constrained_over_free"] > 0 and out["constrained_tokens_per_pass"] > 0
    assert set(out["grammar_compile_ms"]) == {"distill", "refine", "merge"}
    assert {"trie", "llguidance", "trie_build", "llguidance_build"} <= set(out["actor_mask_us"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last)["benchmark"] == "structured" and last.endswith("}")
    assert list(json.loads(last))[-1] == "constrained_over_free"  # the last field of the last line
