"""bench/extractor_learning.py: balanced secrets, what the reader plays, and the curve it reports.

The oracle extractor stands in for a model: it writes each success's winning action and returns on
each failure, so every entry is played correctly and the add rate is the share of successes (half).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _bench import load_bench

from crl_gym.envs.recall import task_name, task_secret
from crl_gym.experience.bank import ExperienceBank
from crl_train.config import load_config
from crl_train.service.build import embedder_of

bench = load_bench("extractor_learning")
ORACLE = ["--set", "extractor.model=oracle", "--set", "manager.dedup_similarity=null"]


def test_the_secret_seed_balances_the_secrets() -> None:
    seed = bench.balanced_secret_seed(8, 2)
    secrets = [task_secret(i, 1, 2, seed)[0] for i in range(8)]
    assert secrets.count("north") == secrets.count("east") == 4
    assert [task_secret(i, 1, 2, 0)[0] for i in range(8)].count("east") == 6  # the unbalanced default
    with pytest.raises(ValueError, match="multiple of num_actions"):
        bench.balanced_secret_seed(7, 2)


def test_a_block_holds_every_secret_won_and_lost_alike() -> None:
    cfg = load_config(None, ["env.kwargs={num_tasks: 8, length: 1, num_actions: 2, secret_seed: 3}",
                             "env.ids=[crl/Recall-v0]", "env.max_turns=2"])
    block = bench.stratified_episodes(cfg, 12, seed=5)
    cells: dict[tuple[str, bool], int] = {}
    for r in block:
        index = next(i for i in range(8) if task_name(i) in r.task)
        key = (task_secret(index, 1, 2, 3)[0], r.success)
        cells[key] = cells.get(key, 0) + 1
    assert cells == {("east", False): 3, ("east", True): 3, ("north", False): 3, ("north", True): 3}
    assert [r.task for r in bench.stratified_episodes(cfg, 12, seed=5)] == [r.task for r in block]  # seeded
    with pytest.raises(ValueError, match="multiple of 4"):
        bench.stratified_episodes(cfg, 10, seed=5)


def test_rows_written_before_right_per_request_are_read_by_their_old_name() -> None:
    old = {"request_share": 0.25, "correct": 2, "entries": 4}
    assert bench.metric(old, "right_per_request") == 0.25 and bench.metric(old, "precision") == 0.5


def test_the_reader_plays_the_first_action_an_entry_names() -> None:
    cfg = load_config(None, ["env.kwargs={num_tasks: 8, length: 1, num_actions: 2, secret_seed: 3}"])
    task = f"Task {task_name(5)}: repeat the 1 secret actions of {task_name(5)}."
    secret = task_secret(5, 1, 2, 3)[0]
    other = "north" if secret == "east" else "east"
    assert bench.reader_plays(f"Play {secret}, not {other}.", task, cfg) == (secret, secret)
    assert bench.reader_plays(f"Avoid {other}.", task, cfg) == (other, secret)
    assert bench.reader_plays("Nothing here.", task, cfg) == (None, secret)


def test_entries_are_tallied_by_their_episode_s_outcome() -> None:
    # [secret, played from the entry, the episode's action, won]; 2 blocks per arm, one per half
    won_right, lost_copied, lost_right = ["east", "east", "east", True], ["east", "north", "north", False], \
        ["north", "north", "east", False]
    runs = {(0, "trained"): [{"block": 0, "episodes": [won_right, lost_copied, lost_copied]},
                             {"block": 1, "episodes": [won_right, lost_right, ["east", "north", None, None]]}],
            (0, "frozen"): [{"block": 0, "episodes": []}, {"block": 1}]}
    rows = bench.by_episode(runs, [0], 2)
    assert rows == [
        {"seed": 0, "arm": "trained", "half": "first", "blocks": [0, 0], "won": 1, "won_right": 1, "lost": 2,
         "lost_right": 0, "lost_copied": 2},
        {"seed": 0, "arm": "trained", "half": "second", "blocks": [1, 1], "won": 1, "won_right": 1, "lost": 1,
         "lost_right": 1, "lost_copied": 0},
    ]  # the frozen arm wrote nothing with a known episode; the unknown one is left out


def test_an_oracle_run_reports_its_curve_and_misses_the_goal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*ORACLE, "--seeds", "0", "1", "--blocks", "2", "--requests-per-block", "8", "--out", str(tmp_path),
            "--figure", str(tmp_path / "curve.png"), "--markdown", str(tmp_path / "curve.md"), "--json"]
    assert bench.main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["blocks_done"] == 2 and len(report["curve"]) == 2 and report["secret_seed"] == 3
    for row in report["curve"]:
        for arm in ("trained", "frozen"):
            assert row[arm]["entry_share"][0] == row[arm]["precision"][0] == 1.0  # the winning actions
            assert row[arm]["add_rate"][0] == 0.5 and row[arm]["right_per_request"][0] == 0.5  # half the episodes won
        assert row["trained_minus_frozen"]["right_per_request"][0] == 0.0  # no difference: no goal
    assert report["goal_block"] == 1 and report["goal"]["metric"] == "right_per_request"
    assert not report["meets_goal"] and (tmp_path / "curve.png").stat().st_size > 0
    table = (tmp_path / "curve.md").read_text()
    assert "| 1 (goal block) | 16 | 0.500 [0.500, 0.500] |" in table and "* seed 1, frozen, block 1:" in table
    blocks = [json.loads(line) for line in (tmp_path / "runs" / "seed0_trained.jsonl").read_text().splitlines()]
    assert [b["block"] for b in blocks] == [0, 1] and blocks[0]["updates"] == 0  # the oracle is never trained
    assert [b["track_errors"] for b in blocks] == [0, 0]
    assert blocks[0]["by_secret"] and sum(v["entries"] for v in blocks[0]["by_secret"].values()) == 4
    # a second call finds the finished seeds and runs nothing; --report-only reads what is there
    assert bench.main([*argv[:-1], "--report-only", "--json"]) == 0
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["curve"] == report["curve"]
    # an earlier run's report drawn beside the curve (the dashed baseline)
    (tmp_path / "baseline.json").write_text(json.dumps({**report, "samples_per_request": 4}))
    assert bench.main([*argv[:-1], "--report-only", "--baseline", str(tmp_path / "baseline.json"),
                       "--figure", str(tmp_path / "compared.png")]) == 0
    assert (tmp_path / "compared.png").stat().st_size > (tmp_path / "curve.png").stat().st_size


def test_several_samples_per_request_distil_each_episode_that_many_times(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*ORACLE, "--seeds", "0", "--blocks", "1", "--requests-per-block", "8", "--samples-per-request", "3",
            "--out", str(tmp_path), "--json"]
    assert bench.main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["curve"][0]["requests_so_far"] == 24 and report["samples_per_request"] == 3
    (block,) = [json.loads(line) for line in (tmp_path / "runs" / "seed0_frozen.jsonl").read_text().splitlines()]
    assert block["requests"] == 24 and block["entries"] == 12  # every copy of the 4 won episodes adds one


TINY = ("env.kwargs={num_tasks: 8, length: 1, num_actions: 2, secret_seed: 3}", "env.ids=[crl/Recall-v0]",
        "env.max_turns=2", "experience.action_slot=1", "experience.seed_entries=[]", "algo.buffer_size=4",
        "experience.extractor_threads=1", "manager.dedup_similarity=null")
"""The probe's setting on the tiny random-initialised extractor (a test model: it learns nothing here,
but it trains, samples and checkpoints as a real one does)."""


def _blocks(out: Path, arm: str) -> list[dict[str, object]]:
    """A seed's blocks without their timings (the only part of a row that may differ between two runs)."""
    rows = [json.loads(line) for line in (out / "runs" / f"seed0_{arm}.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("distill_s", "train_s", "cpu_s")} for r in rows]


def _bank(out: Path, arm: str, dim: int) -> list[str]:
    """A seed's final bank, entry by entry."""
    bank = ExperienceBank(out / "runs" / "seed0" / f"bank_{arm}", dim=dim, create=False)
    try:
        return [e.text for e in bank]
    finally:
        bank.close()


def test_a_stopped_seed_resumes_after_its_last_checkpointed_block_as_if_never_stopped(tmp_path: Path) -> None:
    def setting(name: str, blocks: int) -> Any:
        return bench.Setting(None, TINY, blocks, 8, tmp_path / name)

    bench.run_seed(setting("straight", 3), 0)
    bench.run_seed(setting("stopped", 1), 0)
    # stopped after block 1's trained row was written but before its checkpoint: the row is dropped
    row = (tmp_path / "straight" / "runs" / "seed0_trained.jsonl").read_text().splitlines()[1]
    with (tmp_path / "stopped" / "runs" / "seed0_trained.jsonl").open("a", encoding="utf-8") as f:
        f.write(row + "\n")
    # ... and after block 1 had written an entry into the live bank, which the checkpoint's bank replaces
    cfg = setting("stopped", 1).cfg(0)
    embedder = embedder_of(cfg.experience)
    torn = ExperienceBank(tmp_path / "stopped" / "runs" / "seed0" / "bank_trained", dim=int(embedder.dim), create=False)
    torn.add("a torn block's entry", embedder.encode(["a torn block's entry"])[0])
    torn.close()
    bench.run_seed(setting("stopped", 3), 0)
    for arm in bench.ARMS:
        assert _blocks(tmp_path / "stopped", arm) == _blocks(tmp_path / "straight", arm)
        assert _bank(tmp_path / "stopped", arm, int(embedder.dim)) == _bank(tmp_path / "straight", arm, int(embedder.dim))
    trained = _blocks(tmp_path / "straight", "trained")
    assert [r["block"] for r in trained] == [0, 1, 2]
    assert sum(int(r["updates"]) for r in trained[1:]) > 0  # the resumed arm trained on restored weights and B_φ
    assert trained != _blocks(tmp_path / "straight", "frozen")
    with pytest.raises(RuntimeError, match="another setting"):  # a resume never mixes two settings
        bench.run_seed(bench.Setting(None, (*TINY, "extractor.lr=0.1"), 4, 8, tmp_path / "stopped"), 0)
