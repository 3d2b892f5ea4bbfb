"""End to end through the installed ``crl-train`` / ``crl-eval`` commands: tiny preset, 2 steps, resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
SMALL = ["--set", "env.max_turns=4", "--set", "env.kwargs={max_turns: 4}", "--set", "env.tasks_per_step=1",
         "--set", "env.group_size=4", "--set", "train.eval_episodes=2", "--set", "algo.buffer_size=2",
         "--set", "algo.merge_every=2"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([str(BIN / args[0]), *args[1:]], capture_output=True, text=True, env=env, timeout=600)


def test_help_documents_every_option() -> None:
    out = _run("crl-train", "--help").stdout
    for opt in ("--config", "--set", "--out", "--resume", "--no-progress"):
        assert opt in out
    out = _run("crl-eval", "--help").stdout
    for opt in ("--run", "--episodes", "--memory"):
        assert opt in out
    assert "--with-exp" not in out  # deprecated: still accepted, no longer shown


def test_bad_key_fails_before_anything_starts(tmp_path: Path) -> None:
    proc = _run("crl-train", "--set", "train.stepz=2", "--out", str(tmp_path / "r"))
    assert proc.returncode != 0 and "unknown key 'train.stepz'" in proc.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_tiny_two_steps_then_resume_then_eval(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = _run("crl-train", "--set", "train.steps=2", *SMALL, "--out", str(run), "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    for key in ("success_guided", "success_free", "actions_per_episode", "adv_std", "bank_size", "queue_depth",
                "search_latency_s", "extractor_reward", "extractor_updates"):
        assert key in rows[-1]
    assert (run / "curves.png").stat().st_size > 1000
    assert list((run / "tb").iterdir())
    bank_lines = (run / "bank" / "bank.jsonl").read_text().splitlines()
    assert len(bank_lines) >= 1  # the seed entry at least; distilled entries carry provenance
    assert (run / "checkpoint" / "state.json").exists() and (run / "eval.json").exists()
    assert json.loads((run / "checkpoint" / "state.json").read_text())["step"] == 1

    proc = _run("crl-train", "--resume", str(run), "--set", "train.steps=3", "--set", "train.eval_episodes=0", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert json.loads((run / "checkpoint" / "state.json").read_text())["step"] == 2

    proc = _run("crl-eval", "--run", str(run), "--episodes", "2", "--memory", "none", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["without_experience"]["episodes"] >= 2 and "with_experience" not in result
    low, high = result["without_experience"]["success_ci"]
    assert 0.0 <= low <= result["without_experience"]["success"] <= high <= 1.0  # Wilson: always inside [0, 1]
    proc = _run("crl-eval", "--run", str(run), "--episodes", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "memory frozen: success" in proc.stdout and "internalisation (none / frozen)" in proc.stdout
    assert "frozen − none:" in proc.stdout  # the paired difference over the same held-out tasks
