"""A run killed with SIGKILL mid-training resumes from its last checkpoint, bank intact."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
SMALL = ["--set", "env.max_turns=4", "--set", "env.kwargs={max_turns: 4}", "--set", "env.tasks_per_step=1",
         "--set", "env.group_size=4", "--set", "train.eval_episodes=0", "--set", "algo.buffer_size=2",
         "--set", "train.checkpoint_every=1",
         "--set", "algo.merge_every=1000"]  # no Merge: only a merge may delete entries


def _bank_ids(run: Path) -> set[int]:
    with sqlite3.connect(run / "bank" / "bank.sqlite") as db:
        return {row[0] for row in db.execute("SELECT id FROM entries")}


def _steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_sigkill_then_resume(tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([str(BIN / "crl-train"), "--set", "train.steps=8", *SMALL, "--out", str(run), "--no-progress"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while len(_steps(run)) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be killed: " + (proc.stderr.read() if proc.stderr else "")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)

    checkpoint_step = json.loads((run / "checkpoint" / "state.json").read_text())["step"]
    assert checkpoint_step >= 1
    ids_before = _bank_ids(run)
    assert ids_before, "the bank should hold at least the seed entry"

    done = subprocess.run([str(BIN / "crl-train"), "--resume", str(run), "--no-progress"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = _steps(run)
    assert steps == list(range(8)), steps  # no step lost, none duplicated
    assert json.loads((run / "checkpoint" / "state.json").read_text())["step"] == 7
    # Every entry acknowledged before the kill is still there (ids survive updates).
    assert ids_before <= _bank_ids(run)
