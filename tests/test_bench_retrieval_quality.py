"""bench/retrieval_quality.py: own-task top-1 per key and embedder, on banks built through the manager
from real Recall and MiniHack episodes. The oracle writes each success's task and actions, so every
key finds a task's own entry; the report's shape, the goal check and the tables are what is tested."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _bench import load_bench

bench = load_bench("retrieval_quality")


def test_an_oracle_bank_is_found_by_every_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--json", "--writers", "oracle", "--embedders", "hashing", "--minihack-episodes", "1",
            "--minihack-turns", "3", "--markdown", str(tmp_path / "report.md")]
    assert bench.main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    recall = report["envs"]["recall"]["oracle"]
    assert recall["episodes"] == recall["successes"] == 256  # one success per task: the oracle writes only those
    for key in ("text", "task", "task_text", "text_named"):
        row = recall["hashing"][key]
        assert row["own_task_top1"] == 1.0 and row["queries"] == 256 and row["entries"] == 256
    assert report["envs"]["minihack"]["oracle"]["episodes"] == 5  # one per MiniHack task
    assert report["preset"]["retrieve_by"] == "task" and report["preset"]["embedder"] == "minilm"
    assert report["meets_goal"] is False  # the preset's embedder was not measured in this call
    assert "| oracle | hashing | 256 (256) | 1.000" in (tmp_path / "report.md").read_text()


def test_a_bank_keyed_by_text_misses_entries_that_name_no_task() -> None:
    """The bench's own measure on hand-written entries: texts that share nothing with their task."""
    from crl_gym.experience.embedders import HashingEmbedder
    from crl_gym.protocol import AddOp, DistillationRequest, Trajectory

    tasks = [f"Task {w}: repeat the secret of {w}." for w in ("amber badger", "bold falcon", "coral heron")]
    texts = ["Walk on, the road is long.", "The road is long, walk on.", "Long is the road: walk on."]
    reqs = [DistillationRequest(task=t, trajectory=Trajectory(), outcome=1.0, success=True, experience=None) for t in tasks]
    ops = [[AddOp(x)] for x in texts]
    emb = HashingEmbedder(64)
    assert bench.own_task_top1(reqs, ops, emb, "task")["own_task_top1"] == 1.0
    assert bench.own_task_top1(reqs, ops, emb, "text_named")["own_task_top1"] == 1.0
    assert bench.own_task_top1(reqs, ops, emb, "text")["own_task_top1"] < 1.0
