"""The report's information-flow tables: the guided − free gap by hand, and Recall's secret share."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from crl_gym.envs.recall import RecallEnv, holds_secret, task_name, task_secret
from crl_train.experiment.information import gap_by_part, gap_table, secret_share, secret_table


def test_gap_by_part_by_hand() -> None:
    # 6 rows in 3 parts of 2: gaps (0, .5), (1, None), (−.5, .25) → 0.25, 1.0, −0.125
    rows = [{"success_guided": 0.5, "success_free": 0.5}, {"success_guided": 1.0, "success_free": 0.5},
            {"success_guided": 1.0, "success_free": 0.0}, {"success_guided": None, "success_free": 0.0},
            {"success_guided": 0.0, "success_free": 0.5}, {"success_guided": 0.75, "success_free": 0.5}]
    assert gap_by_part(rows, parts=3) == [0.25, 1.0, -0.125]
    assert gap_by_part([{"success_free": 0.5}], parts=2) == [None, None]


def test_holds_secret_needs_exactly_the_secret_in_order() -> None:
    task = RecallEnv(num_tasks=8, length=3, num_actions=4)
    task.reset(seed=5)
    secret = task.secret
    assert secret == task_secret(5, 3, 4)
    ok = "Winning actions, one per line:\n" + "\n".join(secret)
    assert holds_secret(ok, task.task, length=3, num_actions=4) is True
    assert holds_secret("\n".join(reversed(secret)), task.task, length=3, num_actions=4) is (tuple(reversed(secret)) == secret)
    assert holds_secret(ok + "\nnorth", task.task, length=3, num_actions=4) is False  # one action too many
    assert holds_secret(ok + "\nthen turn right", task.task, length=3, num_actions=4) is True  # "right" is not one of A = 4
    assert holds_secret(ok, "You are in a 5x5 room.", length=3, num_actions=4) is None


def _cell(tmp: Path, texts: list[str], prompts: list[str]) -> Path:
    cell = tmp / "cells" / "oracle" / "Recall-v0" / "seed0"
    (cell / "bank").mkdir(parents=True)
    (cell / "config.yaml").write_text(yaml.safe_dump({"env": {"kwargs": {"length": 2, "num_actions": 4}}}))
    rows = [{"id": i, "text": t, "provenance": {"prompt": p}} for i, (t, p) in enumerate(zip(texts, prompts, strict=True))]
    (cell / "bank" / "bank.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return cell


def test_secret_share_of_a_bank_by_hand(tmp_path: Path) -> None:
    a, b = task_secret(0, 2, 4), task_secret(1, 2, 4)
    ta = f"Task {task_name(0)}: repeat the 2 secret actions of {task_name(0)}."
    tb = f"Task {task_name(1)}: repeat the 2 secret actions of {task_name(1)}."
    texts = [" ".join(a),                 # right, task from the provenance prompt
             f"{tb} " + " ".join(b),       # right, task named in the entry itself
             " ".join(b) if b != a else "west west west",  # task 0's entry with another answer
             "xq;; soup"]                   # no action at all
    prompts = [f"## Task\n{ta}\n", "", f"## Task\n{ta}\n", f"## Task\n{ta}\n"]
    _cell(tmp_path, texts, prompts)
    assert secret_share(tmp_path / "cells" / "oracle" / "Recall-v0" / "seed0") == (2, 4)
    record = {"method": "oracle", "seed": 0, "envs": ["crl/Recall-v0"]}
    table = secret_table([record], ["oracle"], tmp_path)
    assert any(row.startswith("| oracle | 1 | 4.0 | 0.500") for row in table)
    assert secret_table([{**record, "envs": ["crl/MiniHack-Room-5x5-v0"]}], ["oracle"], tmp_path) == []


def test_gap_table_rows_and_intervals(tmp_path: Path) -> None:
    for seed, gaps in ((0, [0.0, 0.5]), (1, [0.5, 0.5])):
        d = tmp_path / "cells" / "complementary" / "Recall-v0" / f"seed{seed}"
        d.mkdir(parents=True)
        rows = [{"step": i, "success_guided": 0.5 + g, "success_free": 0.5} for i, g in enumerate(gaps * 5)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recs = [{"method": "complementary", "seed": s, "envs": ["crl/Recall-v0"]} for s in (0, 1)]
    table = gap_table(recs, ["grpo", "complementary"], tmp_path)
    row = next(r for r in table if r.startswith("| complementary"))
    # each fifth holds the two steps (g0, g1): seed 0 → 0.25, seed 1 → 0.5; mean 0.375 over two seeds
    cells = [c.strip() for c in row.split("|")[2:-1]]
    assert len(cells) == 5 and all(c.startswith("0.375 [") for c in cells)
    lo, hi = (float(x) for x in cells[0][len("0.375 ["):-1].split(", "))
    assert lo == pytest.approx(0.375 - 12.7062 * 0.125, abs=1e-3) and hi == pytest.approx(0.375 + 12.7062 * 0.125, abs=1e-3)
    assert not any(r.startswith("| grpo") for r in table)
