"""summary.json: paired held-out comparisons per memory mode (grpo always with memory none) and the
extractors' right entries per request, against numbers worked out by hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from crl_train.experiment.summary import comparisons, heldout_success, right_entries_per_request


def _record(method: str, seed: int, frozen: float | None, none: float, envs: tuple[str, ...] = ("corridor",)) -> dict[str, Any]:
    memory = {"none": {"success": none}} | ({} if frozen is None else {"frozen": {"success": frozen}})
    return {"method": method, "seed": seed, "envs": list(envs), "steps": 10, "eval": {"memory": memory}}


def test_a_row_without_a_bank_is_compared_with_memory_none() -> None:
    grpo = _record("grpo", 0, None, 0.4)
    assert heldout_success(grpo, "frozen") == heldout_success(grpo, "none") == 0.4
    comp = _record("complementary", 0, 0.9, 0.5)
    assert heldout_success(comp, "online") is None  # not evaluated in that mode
    old = {"eval": {"with_experience": {"success": 0.7}, "without_experience": {"success": 0.2}}}
    assert heldout_success(old, "frozen") == 0.7 and heldout_success(old, "none") == 0.2  # an older eval.json


def test_comparisons_are_paired_over_the_seeds_both_rows_have(tmp_path: Path) -> None:
    records = [_record("complementary", 0, 0.9, 0.5), _record("complementary", 1, 0.7, 0.6),
               _record("complementary", 2, 0.8, 0.4),
               _record("grpo", 0, None, 0.5), _record("grpo", 1, None, 0.5)]  # grpo seed 2 missing
    rows = comparisons(records, tmp_path, [("complementary", "grpo")])
    frozen = next(r for r in rows if r["memory"] == "frozen")
    # seeds 0 and 1: differences 0.4 and 0.2 -> mean 0.3; sd 0.1414, t(0.975, 1) = 12.706, se 0.1
    assert frozen["n_seeds"] == 2 and frozen["diff"] == pytest.approx(0.3)
    assert frozen["ci95"] == pytest.approx([0.3 - 12.7062 * 0.1, 0.3 + 12.7062 * 0.1], abs=1e-3)
    none = next(r for r in rows if r["memory"] == "none")
    assert none["diff"] == pytest.approx(0.05)  # (0.0 + 0.1) / 2
    assert {r["metric"] for r in rows} == {"heldout_success"}  # not a Recall suite: no entry counts


def test_right_entries_per_request_counts_entries_holding_the_secret(tmp_path: Path) -> None:
    from crl_gym.envs.recall import task_name, task_secret

    cell = tmp_path / "cell"
    cell.mkdir()
    (cell / "config.yaml").write_text("env:\n  kwargs: {num_tasks: 4, length: 1, num_actions: 2, secret_seed: 0}\n")
    task = f"Task {task_name(1)}: repeat the 1 secret actions of {task_name(1)}."
    right, wrong = task_secret(1, 1, 2, 0)[0], "north" if task_secret(1, 1, 2, 0)[0] == "east" else "east"
    entries = [{"step": 1, "id": 1, "text": f"Play {right}.", "prompt": task},
               {"step": 9, "id": 2, "text": f"Play {wrong}.", "prompt": task},
               {"step": 9, "id": 3, "text": f"Play {right}.", "prompt": task}]
    (cell / "new_entries.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
    # distilled is cumulative: 4 requests by step 7, 10 by step 9 (6 in the last fifth, steps 8-9)
    rows = [{"step": 0, "distilled": 2}, {"step": 7, "distilled": 4}, {"step": 9, "distilled": 10}]
    (cell / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert right_entries_per_request(cell, 10) == pytest.approx(2 / 10)
    assert right_entries_per_request(cell, 10, last_part_only=True) == pytest.approx(1 / 6)


def test_the_report_shows_each_comparison_with_its_interval() -> None:
    from crl_train.experiment.summary import comparisons_table

    rows = [{"a": "complementary", "b": "grpo", "metric": "heldout_success", "memory": "frozen",
             "diff": 0.3, "ci95": [-0.971, 1.571], "n_seeds": 2},
            {"a": "complementary", "b": "static_online", "metric": "right_entries_per_request",
             "memory": None, "diff": -0.05, "ci95": [None, None], "n_seeds": 1}]
    table = comparisons_table(rows)
    assert "| complementary − grpo | heldout_success | frozen | +0.300 [-0.971, +1.571] | 2 |" in table
    assert "| complementary − static_online | right_entries_per_request | — | -0.050 [n/a, n/a] | 1 |" in table
    assert comparisons_table([]) == []


def test_the_report_gives_right_entries_per_request_per_method(tmp_path: Path) -> None:
    from crl_gym.envs.recall import task_name, task_secret
    from crl_train.experiment.summary import right_entries_table

    records = []
    for seed, distilled in ((0, 10), (1, 5)):  # one right entry each: 1/10 and 1/5
        cell = tmp_path / "cells" / "static_online" / "Recall-v0" / f"seed{seed}"
        cell.mkdir(parents=True)
        (cell / "config.yaml").write_text("env:\n  kwargs: {num_tasks: 4, length: 1, num_actions: 2, secret_seed: 0}\n")
        task = f"Task {task_name(1)}: repeat the 1 secret actions of {task_name(1)}."
        entry = {"step": 9, "id": 1, "text": f"Play {task_secret(1, 1, 2, 0)[0]}.", "prompt": task}
        (cell / "new_entries.jsonl").write_text(json.dumps(entry) + "\n")
        (cell / "metrics.jsonl").write_text(json.dumps({"step": 9, "distilled": distilled}) + "\n")
        records.append({"method": "static_online", "seed": seed, "envs": ["crl/Recall-v0"],
                        "steps": 10, "eval": {}})
    table = right_entries_table(records, ["grpo", "static_online"], tmp_path)
    # mean 0.15; sd of (0.1, 0.2) 0.0707, se 0.05, t(0.975, 1) 12.706 -> [-0.485, 0.785]
    assert "| static_online | 2 | 0.150 [-0.485, 0.785] | 0.150 [-0.485, 0.785] |" in table
    assert not any(line.startswith("| grpo") for line in table)
