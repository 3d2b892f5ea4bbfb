"""The report's tables per fifth of training, on run directories made by hand (numbers worked out here)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from crl_gym.envs.recall import task_name, task_secret
from crl_gym.experience import ExperienceBank
from crl_gym.experience.bank import PendingAdd, PendingUpdate
from crl_train.experiment.fifths import (
    MEASURES,
    fifths_tables,
    headline,
    last_part_contrast,
    own_task_share_by_part,
    part_of,
    retrieved_rbar_by_part,
    secret_share_by_part,
    table_rows,
    values,
)
from crl_train.run.new_entries import NEW_ENTRIES, NewEntryLog, read_new_entries

RECALL = "crl/Recall-v0"


def _task(i: int) -> str:
    return f"## Task\nTask {task_name(i)}: repeat the 1 secret actions of {task_name(i)}.\n"


def _cell(out: Path, method: str, seed: int) -> Path:
    d = out / "cells" / method / "Recall-v0" / f"seed{seed}"
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"env": {"ids": [RECALL], "kwargs": {"length": 1, "num_actions": 2}}}))
    return d


def _other(word: str) -> str:
    return "east" if word == "north" else "north"


def test_part_of_cuts_training_into_equal_spans() -> None:
    assert [part_of(t, 10) for t in range(10)] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert [part_of(t, 7) for t in range(7)] == [0, 0, 1, 2, 2, 3, 4]  # t * 5 // 7
    with pytest.raises(ValueError, match="at least one step"):
        part_of(0, 0)


def test_secret_share_of_new_entries_by_hand(tmp_path: Path) -> None:
    d = _cell(tmp_path, "complementary", 0)
    s = [task_secret(i, 1, 2)[0] for i in range(4)]
    rows = [
        {"step": 0, "id": 1, "text": f"Play {s[0]}.", "prompt": _task(0)},                   # holds it
        {"step": 1, "id": 2, "text": f"Play {_other(s[1])}.", "prompt": _task(1)},           # the other word
        {"step": 4, "id": 3, "text": f"Task {task_name(2)}: repeat the 1 secret actions. {s[2]}", "prompt": ""},  # task in the entry
        {"step": 9, "id": 4, "text": "xq;; soup", "prompt": _task(3)},                        # no action
        {"step": 9, "id": 5, "text": "north", "prompt": None},                                # names no task
    ]
    (d / NEW_ENTRIES).write_text("".join(json.dumps(r) + "\n" for r in rows) + "{cut by a kill\n")
    # steps 10 → spans {0,1} {2,3} {4,5} {6,7} {8,9}: 1/2, none, 1/1, none, 0/2
    assert secret_share_by_part(d, steps=10) == [0.5, None, 1.0, None, 0.0]


def _bank_with_credits(d: Path, credits: list[tuple[int, int, float, int]]) -> None:
    bank = ExperienceBank(d / "bank", dim=2)
    try:
        bank.apply_batch(adds=[PendingAdd(f"entry {i}", np.array([1.0, float(i)]), 0, ()) for i in (1, 2, 3)])
        for step in sorted({s for _, s, _, _ in credits}):
            bank.record_credits(step, [(i, v, n) for i, s, v, n in credits if s == step])
    finally:
        bank.close()


def test_rbar_of_retrieved_entries_by_hand(tmp_path: Path) -> None:
    d = _cell(tmp_path, "complementary", 0)
    _bank_with_credits(d, [(1, 0, 1.0, 2), (1, 1, -1.0, 2), (2, 1, 1.0, 1),  # span 0: entry 1 (2 − 2)/4 = 0, entry 2: 1
                           (1, 2, 0.5, 4),                                 # span 1: entry 1: 0.5
                           (2, 9, -1.0, 3), (3, 8, 1 / 3, 3)])             # span 4: (−1 + 1/3) / 2
    got = retrieved_rbar_by_part(d, steps=10)
    assert got[:4] == [0.5, 0.5, None, None]
    assert got[4] == pytest.approx(-1 / 3)
    assert retrieved_rbar_by_part(tmp_path / "nowhere", steps=10) == [None] * 5


def _metrics(d: Path, guided: list[float]) -> None:
    rows = [{"step": t, "success_guided": g, "success_free": 0.5} for t, g in enumerate(guided)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_own_task_share_of_guided_episodes_by_hand(tmp_path: Path) -> None:
    # entry 1 was distilled from task 0, entry 2 from task 1 (its prompt), entry 3 by the oracle
    # (its prompt is the task itself). 4 steps in 2 spans:
    # span 0: task 0 shown entry 1 (own), task 0 shown entry 2 (not), a free episode and a guided one
    #         shown nothing (neither counts) → 1/2;
    # span 1: task 1 shown entry 2 (own), task 1 shown entry 3 (task 0's: not), task 0 shown entry 3 (own) → 2/3
    d = _cell(tmp_path, "static_online", 0)
    tasks = [f"Task {task_name(i)}: repeat the 1 secret actions of {task_name(i)}." for i in (0, 1)]
    rows = [{"step": 0, "id": 1, "text": "Play east.", "tags": [], "prompt": "Rules.\n\n" + _task(0) + "\n## Outcome\nSUCCESS"},
            {"step": 0, "id": 2, "text": "Play east.", "tags": [], "prompt": "Rules.\n\n" + _task(1) + "\n## Outcome\nFAILURE"},
            {"step": 1, "id": 3, "text": tasks[0] + " Winning actions: east", "tags": [], "prompt": tasks[0]}]
    (d / NEW_ENTRIES).write_text("".join(json.dumps(r) + "\n" for r in rows))

    def episode(step: int, task: int, entry: int | None, condition: str = "guided") -> str:
        return json.dumps({"task": tasks[task], "condition": condition, "rollout_step": step,
                           "experience": {"id": entry, "text": "x"} if entry else None}) + "\n"

    (d / "trajectories.jsonl").write_text(
        episode(0, 0, 1) + episode(1, 0, 2) + episode(0, 0, None, "free") + episode(1, 1, None)
        + episode(2, 1, 2) + episode(3, 1, 3) + episode(3, 0, 3))
    assert own_task_share_by_part(d, steps=4, parts=2) == [0.5, 2 / 3]
    (d / "trajectories.jsonl").unlink()  # a cell that logged no trajectories has nothing to measure
    assert own_task_share_by_part(d, steps=4, parts=2) == [None, None]


def test_guided_success_table_with_paired_difference_by_hand(tmp_path: Path) -> None:
    # 5 steps: one step per fifth. Last fifth: complementary 1.0, 0.75, 1.0; static_online 0.5, 0.5, 0.5
    # → differences 0.5, 0.25, 0.5: mean 5/12, sd = sqrt(((1/12)² · 2 + (1/6)²) / 2) = 0.144338,
    # half-width t(0.975, 2) · sd / √3 = 4.302653 · 0.083333 = 0.358554 → [0.0581, 0.7752]
    records = []
    for seed, (comp, stat) in enumerate([(1.0, 0.5), (0.75, 0.5), (1.0, 0.5)]):
        for method, last in (("complementary", comp), ("static_online", stat)):
            _metrics(_cell(tmp_path, method, seed), [0.5, 0.5, 0.5, 0.5, last])
            records.append({"method": method, "seed": seed, "envs": [RECALL], "steps": 5})
    guided = next(m for m in MEASURES if m.title.startswith("Guided"))
    per = values(records, tmp_path, guided)
    assert per["complementary"][1] == [0.5, 0.5, 0.5, 0.5, 0.75]
    text, excludes = last_part_contrast(per, "complementary", "static_online")
    assert text == "0.417 [0.058, 0.775]" and excludes is True
    rows = table_rows(per, ["static_online", "complementary"], [("complementary", "static_online")])
    assert rows[0].startswith("| static_online | 3 | 0.500 [0.500, 0.500] |")
    assert rows[1].endswith("| 0.917 [0.558, 1.275] |")  # 1.0, 0.75, 1.0: the spread of the differences
    assert rows[2].startswith("| **complementary − static_online** (paired) | 3 | 0.000 [0.000, 0.000] |")
    lines = headline(records, tmp_path, [("complementary", "static_online")])
    assert "Guided success, last fifth, complementary − static_online: **0.417 [0.058, 0.775]** (the interval excludes 0)." in lines[-1]
    # no bank, no new entries: those tables have no rows; the guided table has its three
    tables = fifths_tables(records, ["static_online", "complementary"], tmp_path, [("complementary", "static_online")])
    assert [x for x in tables if x.startswith("## ")] == ["## Guided success, per fifth of training"]


def test_a_contrast_needs_two_seeds_for_an_interval(tmp_path: Path) -> None:
    per = {"complementary": {0: [None, None, None, None, 0.5]}, "static_online": {0: [None, None, None, None, 0.0]}}
    assert last_part_contrast(per, "complementary", "static_online") == ("0.500", None)
    assert last_part_contrast(per, "complementary", "oracle") == ("n/a", None)


def test_new_entry_log_keeps_the_first_text_and_prompt(tmp_path: Path) -> None:
    from crl_gym.protocol import ExtractorSample

    bank = ExperienceBank(None, dim=2)
    bank.apply_batch(adds=[PendingAdd("seed entry", np.array([0.0, 1.0]), 0, ())])
    log = NewEntryLog(bank, tmp_path)  # the seed entry was there before the run: not logged
    first = ExtractorSample(prompt=_task(0), response="[]")
    [new] = bank.apply_batch(adds=[PendingAdd("go north", np.array([1.0, 0.0]), 4, ("crl/Recall-v0",), first,
                                              source=_task(0), key=_task(0))])
    assert log.record() == 1
    bank.apply_batch(updates=[PendingUpdate(new, "go east", np.array([1.0, 1.0]), ExtractorSample(prompt=_task(1), response="[]"))])
    assert log.record() == 0
    [row] = read_new_entries(tmp_path)
    assert row == {"step": 4, "id": new, "text": "go north", "tags": ["crl/Recall-v0"], "prompt": _task(0),
                   "source": _task(0), "key": _task(0)}
