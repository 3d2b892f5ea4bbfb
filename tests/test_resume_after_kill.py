"""A run killed with SIGKILL mid-training resumes from its last checkpoint, bank intact, with its
--set saved, its counters continued and no step or trajectory written twice."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from crl_gym.experience.service import ClosedStep
from crl_gym.protocol import DistillationRequest
from crl_train.service.credit import credited_entries, step_credits

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
    proc = subprocess.Popen([str(BIN / "crl-train"), "--set", "train.steps=6", *SMALL, "--out", str(run), "--no-progress"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while len(_steps(run)) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be killed: " + (proc.stderr.read() if proc.stderr else "")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)

    killed_at = json.loads((run / "checkpoint" / "state.json").read_text())
    checkpoint_step = killed_at["step"]
    assert checkpoint_step >= 1
    ids_before = _bank_ids(run)
    assert ids_before, "the bank should hold at least the seed entry"

    # (a) a --set given with --resume (train.steps 6 -> 8) is saved to config.yaml
    done = subprocess.run([str(BIN / "crl-train"), "--resume", str(run), "--set", "train.steps=8", "--no-progress"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = _steps(run)
    assert steps == list(range(8)), steps  # no step lost, none duplicated
    assert json.loads((run / "checkpoint" / "state.json").read_text())["step"] == 7
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"] == 8
    # (b) cumulative counters continue from the checkpoint: never lower than an earlier row
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for key in ("distilled", "distill_batches", "added", "extractor_updates"):
        values = [r[key] for r in rows]
        assert values == sorted(values), (key, values)
    # (c) trajectories.jsonl: K episodes per step, no row twice; TensorBoard: one point per step
    traj = (run / "trajectories.jsonl").read_text().splitlines()
    assert len(traj) == len(set(traj))
    assert sorted(json.loads(x)["rollout_step"] for x in traj) == [t for t in range(8) for _ in range(4)]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("success")] == list(range(8))
    # Every entry acknowledged before the kill is still there (ids survive updates).
    assert ids_before <= _bank_ids(run)
    _assert_the_asynchronous_invariants(run, [DistillationRequest.from_json(x) for x in traj], killed_at)


def _assert_the_asynchronous_invariants(run: Path, requests: list[DistillationRequest], killed_at: dict[str, Any]) -> None:
    """What an asynchronous run keeps across a kill (docs/reliability.md, "Asynchronous runs resume
    consistently"), read at its last checkpoint, where the extractor's loop was held between passes:
    every request the service acknowledged was distilled once or is still queued; every entry that
    guided an episode is credited once for its step (the bank's credit events) and each credit went
    into B_φ once; the extractor went on training after the resume."""
    state = json.loads((run / "checkpoint" / "state.json").read_text())["service"]
    st = state["track_stats"]
    assert st["errors"] == 0, st["last_error"]
    queued = (run / "checkpoint" / "bank" / "pending_requests.jsonl").read_text().splitlines()
    assert state["counters"]["submitted"] == len(requests)
    assert st["distilled"] + st["skipped_distill"] + len(queued) == len(requests), (st["distilled"], len(queued))
    by_step: dict[int, list[DistillationRequest]] = {}
    for r in requests:
        by_step.setdefault(int(r.rollout_step), []).append(r)
    want = sorted((t, i, n) for t, reqs in by_step.items()
                  for i, n in Counter(i for r in reqs for i in credited_entries(r)).items())
    with sqlite3.connect(run / "bank" / "bank.sqlite") as db:
        got = sorted(db.execute("SELECT step, entry_id, n FROM entry_events WHERE kind = 'credit'"))
    assert got == want and want, (got, want)
    credits = sum(len(step_credits(ClosedStep(t, reqs))) for t, reqs in by_step.items())
    assert st["credited"] + st["uncreditable"] == credits
    assert st["updates"] > killed_at["service"]["track_stats"]["updates"], "no CISPO update after the resume"
