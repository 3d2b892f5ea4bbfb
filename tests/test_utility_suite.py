"""experiments/utility_ranking.yaml resolves to the two rows it promises, and its seeded bank holds,
per Recall task, one entry naming the secret and one naming the other action."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from crl_gym.envs.recall import holds_secret
from crl_train.experiment.suite import cell_config, cells, load_suite

REPO = Path(__file__).resolve().parents[1]


def test_the_suite_differs_only_by_the_utility_term() -> None:
    suite = load_suite(REPO / "experiments" / "utility_ranking.yaml")
    assert suite.rows == ("offline_exp", "utility") and suite.pairs == (("utility", "offline_exp"),)
    by_row = {c.method: cell_config(suite, c) for c in cells(suite) if c.seed == 0}
    plain, ranked = by_row["offline_exp"], by_row["utility"]
    assert (plain.manager.utility_weight, ranked.manager.utility_weight) == (0.0, 1.0)
    assert ranked.method == plain.method == "offline_exp" and ranked.actor.model == "reader"
    assert dataclasses.replace(plain, manager=ranked.manager) == ranked  # nothing else differs


def test_the_seeded_bank_is_half_right(tmp_path: Path) -> None:
    out = tmp_path / "bank.jsonl"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "recall_seeded_bank.py"), "--num-tasks", "8",
                           "--out", str(out)], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(proc.stdout.splitlines()[-1])["entries"] == 16
    spec = importlib.util.spec_from_file_location("recall_seeded_bank", REPO / "scripts" / "recall_seeded_bank.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from crl_gym.envs.recall import RecallEnv

    for task, text, right in module.seeded_entries(8, 2):
        _, info = RecallEnv(num_tasks=8, length=1, num_actions=2).reset(seed=task)
        assert holds_secret(text, info["task"], length=1, num_actions=2) is right
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines[0]["embedding"]) == 256  # the tiny preset's hashing embedder
