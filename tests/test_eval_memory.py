"""crl-eval's memory modes: none, frozen and online play the same held-out tasks; online writes its
copy of the bank, frozen does not; the evaluated bank is the checkpoint's; the old boolean modes
still work, with a DeprecationWarning."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.embedders import HashingEmbedder
from crl_train.cli import evaluate
from crl_train.config import load_config
from crl_train.run.evaluate import evaluate_dir, evaluate_run
from crl_train.run.trainer import Trainer

RECALL = ["env.ids=[crl/Recall-v0]", "env.kwargs={num_tasks: 16, length: 1, num_actions: 2}", "env.max_turns=2",
          "env.tasks_per_step=2", "env.group_size=4", "extractor.model=oracle", "experience.seed_entries=[]",
          "experience.asynchronous=false", "train.checkpoint_every=1", "train.eval_episodes=0",
          "manager.recency_window_s=0", "manager.diversity_lambda=0", "actor.tiny_vocab_size=300",
          "actor.tiny_hidden=32", "actor.tiny_layers=1"]


def _trained(run: Path, method: str = "static_online", steps: int = 2) -> None:
    trainer = Trainer(load_config(None, [f"method={method}", f"train.steps={steps}", *RECALL]), run, progress=False)
    try:
        trainer.run()
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("eval_memory") / "run"
    _trained(d)
    return d


def test_every_mode_plays_the_same_tasks_and_pairs_them(run: Path) -> None:
    cfg = load_config(run / "config.yaml")
    shutil.copytree(run / "checkpoint" / "bank", run.parent / "copy", ignore=shutil.ignore_patterns("*.lock"))
    trainer = Trainer(cfg, run, read_only=True, eval_bank_dir=run.parent / "copy", progress=False)
    try:
        before = len(trainer.c.bank)
        result = evaluate_run(trainer, 8, memory=("none", "frozen"))
        assert len(trainer.c.bank) == before  # frozen writes nothing
        online = evaluate_run(trainer, 8, memory=("online",))
        grown = len(trainer.c.bank) - before
    finally:
        trainer.close()
    modes = result["memory"]
    assert set(modes) == {"none", "frozen"} and modes["none"]["tasks"] == modes["frozen"]["tasks"] == 2
    assert modes["none"]["episodes"] == modes["frozen"]["episodes"] == 8  # 2 tasks x K = 4, guided ones only
    (pair,) = result["paired"]
    assert (pair["a"], pair["b"], pair["tasks"]) == ("frozen", "none", 2)
    by_task = pair["diff"]
    assert by_task == pytest.approx(modes["frozen"]["success"] - modes["none"]["success"])  # equal weights per task
    assert result["with_experience"] == modes["frozen"] and result["without_experience"] == modes["none"]
    # online: the oracle writes the held-out successes into the (copied) bank between rounds
    wins = online["memory"]["online"]["success"] * online["memory"]["online"]["episodes"]
    assert (grown > 0) == (wins > 0), (grown, online)


def test_a_method_without_experience_skips_the_bank_modes(tmp_path: Path) -> None:
    _trained(tmp_path / "grpo", method="grpo", steps=1)
    result = evaluate_dir(load_config(tmp_path / "grpo" / "config.yaml"), tmp_path / "grpo", 4,
                          memory=("none", "frozen", "online"))
    assert set(result["memory"]) == {"none"}
    assert set(result["skipped"]) == {"frozen", "online"} and "grpo" in result["skipped"]["frozen"]
    assert result["paired"] == []


def test_the_checkpoints_bank_is_evaluated_and_the_run_left_as_it_was(run: Path) -> None:
    # an entry written to the run's bank after its last checkpoint is not the checkpoint's
    with ExperienceBank(run / "bank", dim=256) as bank:
        bank.add("written after the checkpoint", HashingEmbedder(256).encode(["written after the checkpoint"])[0])
        rows = len(bank)
    result = evaluate_dir(load_config(run / "config.yaml"), run, 4, memory=("frozen",))
    assert result["bank"] == "checkpoint/bank"
    assert json.loads((run / "eval.json").read_text())["bank"] == "checkpoint/bank"
    with ExperienceBank(run / "bank", dim=256) as bank:
        assert len(bank) == rows  # the run's own bank is untouched


@pytest.mark.parametrize("memory", ["none", "frozen", "online"])
def test_crl_eval_memory_option(run: Path, memory: str) -> None:
    out = CliRunner().invoke(evaluate, ["--run", str(run), "--episodes", "4", "--memory", memory, "--json"])
    assert out.exit_code == 0, out.output
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result["memory"]) == {memory}


def test_the_boolean_modes_still_work_with_a_deprecation_warning(run: Path) -> None:
    with pytest.warns(DeprecationWarning, match="--memory"):
        result = evaluate_dir(load_config(run / "config.yaml"), run, 4, (True, False))
    assert set(result["memory"]) == {"frozen", "none"}
    out = CliRunner().invoke(evaluate, ["--run", str(run), "--episodes", "4", "--without-exp", "--json"])
    assert out.exit_code == 0 and "deprecated" in out.stderr
    assert set(json.loads(out.stdout.strip().splitlines()[-1])["memory"]) == {"none"}
