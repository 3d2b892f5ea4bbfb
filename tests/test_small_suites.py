"""The SmolLM2 suites (experiments/small_*.yaml) resolve to the cells they promise, and a suite run
writes the tables per fifth of training from what its cells recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from crl_train.experiment.suite import cell_config, cells, load_suite, suite_from_dict

EXPERIMENTS = Path(__file__).resolve().parents[1] / "experiments"


def test_small_recall_extractor_measures_the_extractor_alone() -> None:
    suite = load_suite(EXPERIMENTS / "small_recall_extractor.yaml")
    assert set(suite.rows) == {"static_online", "complementary", "oracle", "static_online_named",
                               "complementary_named"} and len(suite.seeds) >= 3
    assert suite.pairs == (("complementary", "static_online"), ("complementary_named", "static_online_named"))
    for c in cells(suite):
        cfg = cell_config(suite, c)
        assert cfg.actor.model == "reader" and cfg.env.ids == ("crl/Recall-v0",)
        assert cfg.extractor.model == ("oracle" if c.method == "oracle" else "smollm2-135m")
        assert cfg.method == ("complementary" if c.method.startswith("complementary") else "static_online")
        assert cfg.manager.name_task == c.method.endswith("_named")  # each pair differs only in it


def test_small_minihack_is_both_smollm2_models_on_the_room() -> None:
    suite = load_suite(EXPERIMENTS / "small_minihack.yaml")
    [c] = cells(suite)
    cfg = cell_config(suite, c)
    assert cfg.actor.model == cfg.extractor.model == "smollm2-135m"
    assert cfg.actor.lora_rank > 0 and cfg.extractor.lora_rank > 0
    assert cfg.env.ids == ("crl/MiniHack-Room-5x5-v0",)


def test_small_recall_is_the_whole_loop() -> None:
    suite = load_suite(EXPERIMENTS / "small_recall.yaml")
    assert {"grpo", "static_online", "complementary", "oracle"} == set(suite.rows)
    for c in cells(suite):
        cfg = cell_config(suite, c)
        assert cfg.actor.model != "reader"
        assert cfg.extractor.model == ("oracle" if c.method == "oracle" else "smollm2-135m")
        assert cfg.experience.distill_fraction == 1 / 20  # every extractor, the oracle too, sees the same share
        assert cfg.manager.name_task  # an entry must be found for its own task among 256


@pytest.mark.parametrize("name", ["small_recall_extractor", "small_recall"])
def test_the_recall_suites_train_the_extractor_as_the_probe_learnt(name: str) -> None:
    """docs/results/extractor_learning/max_ops: the probe met its goal with one op per answer, the
    per-sample normaliser, B_phi 8, lr 3e-4 and temperature 1.0; the suites ask whether that carries
    over to the loop, so every extractor cell runs with exactly those."""
    suite = load_suite(EXPERIMENTS / f"{name}.yaml")
    for c in cells(suite):
        cfg = cell_config(suite, c)
        assert cfg.experience.max_ops == 1 and cfg.algo.cispo_normalisation == "sequences"
        assert cfg.algo.buffer_size == 8 and cfg.extractor.lr == 3e-4 and cfg.extractor.temperature == 1.0


def test_a_suite_with_the_oracle_reports_every_new_entry_holding_its_secret(tmp_path: Path) -> None:
    """The oracle writes each success's actions verbatim: every entry it writes holds its task's secret,
    and the reader plays it, so once a task is solved its guided episodes win (r(m) = +1)."""
    from crl_train.experiment.report import write_report
    from crl_train.experiment.suite import run_suite
    from crl_train.run.new_entries import read_new_entries

    suite = suite_from_dict({
        "name": "oracle_reader", "methods": ["static_online"], "seeds": [0, 1], "envs": ["crl/Recall-v0"],
        "eval_episodes": 4, "set": [
            "actor.model=reader", "extractor.model=oracle", "env.kwargs={num_tasks: 2, length: 1, num_actions: 2}",
            "env.max_turns=2", "env.tasks_per_step=2", "env.group_size=4", "experience.seed_entries=[]",
            "experience.asynchronous=false", "manager.recency_window_s=0", "manager.diversity_lambda=0",
            "train.steps=5", "train.checkpoint_every=100"]})
    records = run_suite(suite, tmp_path, progress=False)
    for r in records:
        cell = tmp_path / "cells" / f"static_online/Recall-v0/seed{r['seed']}"
        logged = read_new_entries(cell)
        bank = [json.loads(x) for x in (cell / "bank" / "bank.jsonl").read_text().splitlines() if x.strip()]
        assert logged and {e["id"] for e in bank} <= {e["id"] for e in logged}
        assert all(0 <= e["step"] < 5 and e["prompt"] for e in logged)
    report = (write_report(suite, tmp_path, records)).read_text()
    table = report.split("## New entries that hold their task's secret, per fifth of training")[1].split("\n## ")[0]
    row = next(x for x in table.splitlines() if x.startswith("| static_online |"))
    shares = [c.strip() for c in row.split("|")[3:-1]]
    assert shares and all(s in ("n/a", "1.000 [1.000, 1.000]", "1.000") for s in shares) and "1.000" in row
    rbar = report.split("## r̄(m) of the entries retrieved")[1].split("\n## ")[0]
    last = next(x for x in rbar.splitlines() if x.startswith("| static_online |")).split("|")[-2].strip()
    assert last.startswith("1.000"), rbar  # two tasks, both solved by step 3 with 2 free coin flips each time
    assert "## Cells" in report and "New entries as first written" in report


@pytest.mark.parametrize("name", ["small_recall_extractor", "small_recall", "small_minihack"])
def test_small_suites_name_their_command(name: str) -> None:
    text = (EXPERIMENTS / f"{name}.yaml").read_text()
    assert f"crl-experiment --suite experiments/{name}.yaml" in text


def test_a_suite_reading_opens_its_report(tmp_path: Path) -> None:
    from crl_train.experiment.report import write_report

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "reading.md").write_text("## What this run shows\n\nNothing yet.\n")
    (tmp_path / "s.yaml").write_text("name: s\nmethods: [grpo]\nseeds: [0]\nreading: notes/reading.md\n")
    suite = load_suite(tmp_path / "s.yaml")
    assert suite.reading == str((tmp_path / "notes" / "reading.md").resolve())
    (tmp_path / "out").mkdir()
    report = write_report(suite, tmp_path / "out", []).read_text()
    assert report.index("## What this run shows") < report.index("## Final success")


@pytest.mark.parametrize(("name", "changed"), [
    ("small_recall_slot_long", {"train.steps": (30, 15)}),
    ("small_recall_slot_lr", {"extractor.lr": (0.001, 0.0001)}),
])
def test_slot_follow_ups_change_one_setting(name: str, changed: dict[str, tuple[float, float]]) -> None:
    follow_up, slot = (load_suite(EXPERIMENTS / f"{n}.yaml") for n in (name, "small_recall_slot"))
    assert follow_up.rows == slot.rows and follow_up.seeds == slot.seeds
    assert follow_up.reading is not None and follow_up.reading.endswith(f"docs/results/{name}/reading.md")
    assert f"crl-experiment --suite experiments/{name}.yaml --out runs/suite_{name}" in (EXPERIMENTS / f"{name}.yaml").read_text()
    (key, (new, old)), = changed.items()
    section, field = key.split(".")
    for c, s in zip(cells(follow_up), cells(slot), strict=True):
        cfg, ref = cell_config(follow_up, c), cell_config(slot, s)
        assert getattr(getattr(cfg, section), field) == new and getattr(getattr(ref, section), field) == old
        assert cfg.experience == ref.experience and cfg.env == ref.env and cfg.method == ref.method
        if key != "extractor.lr":
            assert cfg.extractor == ref.extractor
