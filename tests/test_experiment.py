"""crl-experiment: a grid of runs that survives an interruption, and its report."""

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
import torch
import yaml

from crl_gym.wrappers.examples import CorridorEnv
from crl_train.config import ConfigError
from crl_train.experiment.provenance import PACKAGES
from crl_train.experiment.suite import CELL_FILE, Cell, cells, load_suite, run_cell, suite_from_dict

SMALL = ["train.steps=2", "env.tasks_per_step=1", "env.group_size=4", "env.max_turns=4", "env.kwargs={max_turns: 4}",
         "experience.asynchronous=false", "train.checkpoint_every=1"]


def test_suite_validation_names_the_field() -> None:
    with pytest.raises(ConfigError, match="methods"):
        suite_from_dict({"name": "x", "methods": ["ppo"], "seeds": [0]})
    with pytest.raises(ConfigError, match="seeds"):
        suite_from_dict({"name": "x", "methods": ["grpo"], "seeds": [1, 1]})
    with pytest.raises(ConfigError, match="unknown key"):
        suite_from_dict({"name": "x", "methods": ["grpo"], "seeds": [0], "sedes": [1]})


@pytest.mark.parametrize("name", ["tiny", "pilot", "main", "scaling"])
def test_shipped_suites_load(name: str) -> None:
    suite = load_suite(Path(__file__).resolve().parents[1] / "experiments" / f"{name}.yaml")
    assert cells(suite) and "grpo" in suite.methods


def test_a_half_finished_cell_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    from crl_train.run.trainer import Trainer

    suite = suite_from_dict({"name": "t", "methods": ["complementary"], "seeds": [0], "eval_episodes": 4,
                             "set": [*SMALL, "env.ids=[corridor]", "actor.tiny_vocab_size=300",
                                     "extractor.tiny_vocab_size=300", "actor.tiny_hidden=32", "extractor.tiny_hidden=32",
                                     "actor.tiny_layers=1", "extractor.tiny_layers=1"]})
    cell = Cell("complementary", 0, ("corridor",))

    def corridor(env_id: str) -> Any:
        return CorridorEnv(length=1, max_turns=3)

    # what a kill after the first step's checkpoint leaves: a run directory at step 0 of 2
    from crl_train.experiment.suite import cell_config

    cell_dir = tmp_path / "cells" / cell.name
    first = Trainer(cell_config(suite, cell), cell_dir, progress=False, env_factory=corridor)
    try:
        first.metrics.write(first.step(0))  # type: ignore[union-attr]
        first.checkpoint(0)
    finally:
        first.close()
    record = run_cell(suite, cell, tmp_path, env_factory=corridor)
    steps = [json.loads(x)["step"] for x in (cell_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]  # step 0 kept, step 1 trained once
    assert record["resumed_from"] == [0]  # the second start continued after step 0's checkpoint
    assert record["commit"]  # the code it ran at, named in the report's provenance
    assert record["packages"]["torch"] == torch.__version__ and set(record["packages"]) == set(PACKAGES)
    assert record["eval"]["without_experience"]["episodes"] >= 4 and (cell_dir / CELL_FILE).is_file()
    mtime = (cell_dir / CELL_FILE).stat().st_mtime_ns
    assert run_cell(suite, cell, tmp_path, env_factory=corridor) == record  # finished: read back, not rerun
    assert (cell_dir / CELL_FILE).stat().st_mtime_ns == mtime


def test_the_cells_table_says_which_cells_resumed_and_their_last_counters(tmp_path: Path) -> None:
    from crl_train.experiment.report import cells_table
    from crl_train.experiment.suite import record_dir

    fresh = {"method": "complementary", "seed": 0, "envs": ["corridor"], "steps": 3, "resumed_from": []}
    resumed = {**fresh, "seed": 1, "resumed_from": [4, 9]}
    older = {k: v for k, v in {**fresh, "seed": 2}.items() if k != "resumed_from"}  # a cell.json from before
    rows = {0: [{"step": 0, "extractor_updates": 1, "track_errors": 0, "bank_size": 3, "step_time_s": 1.5},
                {"step": 1, "extractor_updates": 2, "track_errors": 1, "bank_size": 5, "step_time_s": 2.0}],
            1: [{"step": 0, "extractor_updates": 7, "track_errors": 3, "bank_size": 2, "step_time_s": 4.0}],
            2: [{"step": 0, "bank_size": 6, "step_time_s": 1.0}]}  # its rows predate both columns
    for r in (fresh, resumed, older):
        d = record_dir(tmp_path, r)
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows[int(r["seed"])]))
    (record_dir(tmp_path, resumed) / "config.yaml").write_text("algo:\n  buffer_size: 8\n")
    grpo = {"method": "grpo", "seed": 0, "envs": ["corridor"], "steps": 3, "resumed_from": []}
    record_dir(tmp_path, grpo).mkdir(parents=True)  # no extractor track: its counter is None
    (record_dir(tmp_path, grpo) / "metrics.jsonl").write_text(
        json.dumps({"step": 0, "extractor_updates": 0, "track_errors": None, "step_time_s": 1.0}) + "\n")
    table = cells_table([fresh, resumed, older, grpo], tmp_path)
    assert "| cell | steps | resumed | extractor updates (samples) | track errors |" in table[4]
    # the last row's counters, read by name: 2 and 1, not the first row's 1 and 0
    assert table[6] == "| complementary seed 0 | 3 | no | 2 | 1 | 0 | 5 | 4 |"  # no config: no samples
    assert table[7] == "| complementary seed 1 | 3 | after step 4, 9 | 7 (56) | 3 | 0 | 2 | 4 |"  # 7 x B_phi 8
    assert table[8] == "| complementary seed 2 | 3 | not recorded | not recorded | not recorded | 0 | 6 | 1 |"
    assert table[9] == "| grpo seed 0 | 3 | no | 0 | n/a | 0 | n/a | 1 |"


@pytest.mark.slow
def test_crl_experiment_is_interrupted_resumed_and_reports(tmp_path: Path) -> None:
    suite_file = tmp_path / "smoke.yaml"
    suite_file.write_text(yaml.safe_dump({"name": "smoke", "methods": ["grpo", "complementary"], "seeds": [0, 1],
                                          "eval_episodes": 4, "set": SMALL}))
    out = tmp_path / "out"
    cmd = [str(Path(sys.executable).parent / "crl-experiment"), "--suite", str(suite_file), "--out", str(out), "--no-progress"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    first_cell = out / "cells" / "grpo" / "MiniHack-Room-5x5-v0" / "seed0" / CELL_FILE
    deadline = time.monotonic() + 600
    while not first_cell.exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:] if proc.stderr else ""
        assert time.monotonic() < deadline, "the first cell did not finish in time"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)  # interrupted mid-grid
    proc.wait(timeout=60)
    kept = first_cell.read_text()
    assert not (out / "report.md").exists()
    partial = subprocess.run([*cmd, "--report-only"], capture_output=True, text=True, env=env, timeout=300)
    assert partial.returncode == 0, partial.stderr[-3000:]
    assert json.loads(partial.stdout.strip().splitlines()[-1])["cells"] == 1  # what has finished, nothing run
    assert "| grpo seed 0 |" in (out / "report.md").read_text() and first_cell.read_text() == kept
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert first_cell.read_text() == kept  # the finished cell was not run again
    assert sorted(p.parent.name for p in (out / "cells").rglob(CELL_FILE)) == ["seed0", "seed0", "seed1", "seed1"]
    report = (out / "report.md").read_text()
    assert "## Final success" in report and "| MiniHack-Room-5x5-v0 | complementary | 2 |" in report.replace(
        "crl/MiniHack-Room-5x5-v0", "MiniHack-Room-5x5-v0")
    assert "* cells run at `" in report and "* report written at `" in report
    assert f"* cells run with torch {torch.__version__}, transformers " in report
    assert "## The final bank" in report
    for png in ("success.png", "success_guided_free.png", "actions.png", "bank_size.png"):
        assert (out / png).stat().st_size > 0
    assert json.loads(done.stdout.strip().splitlines()[-1])["cells"] == 4


def test_a_cell_another_process_runs_is_skipped_then_awaited(tmp_path: Path) -> None:
    """Two crl-experiment processes may share one --out: a cell whose lock is held elsewhere is left
    alone (its directory untouched) while the rest of the grid runs, then run (or read back) once freed."""
    import fcntl
    import threading

    from crl_train.experiment.suite import LOCKS_DIR, lock_path, run_suite

    suite = suite_from_dict({"name": "t", "methods": ["grpo"], "seeds": [0, 1], "eval_episodes": 4,
                             "set": [*SMALL, "env.ids=[corridor]"]})
    grid = cells(suite)
    first, second = (tmp_path / "cells" / c.name for c in grid)

    def corridor(env_id: str) -> Any:
        return CorridorEnv(length=1, max_turns=3)

    lock_path(tmp_path, grid[0]).parent.mkdir(parents=True)
    other = lock_path(tmp_path, grid[0]).open("a")  # "another process" holds seed 0
    fcntl.flock(other.fileno(), fcntl.LOCK_EX)
    records: list[dict[str, Any]] = []
    runner = threading.Thread(target=lambda: records.extend(run_suite(suite, tmp_path, progress=False, env_factory=corridor)))
    runner.start()
    try:
        deadline = time.monotonic() + 300
        while not (second / CELL_FILE).exists():
            assert runner.is_alive() and time.monotonic() < deadline, "seed 1 did not run while seed 0 was held"
            time.sleep(0.1)
        time.sleep(0.5)
        assert runner.is_alive() and not first.exists()  # waiting for seed 0, its directory untouched
    finally:
        fcntl.flock(other.fileno(), fcntl.LOCK_UN)
        other.close()
    runner.join(timeout=300)
    assert not runner.is_alive()
    assert [r["seed"] for r in records] == [0, 1] and (first / CELL_FILE).is_file()
    for lock in (tmp_path / LOCKS_DIR).iterdir():  # every lock released
        with lock.open("a") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)


@pytest.mark.slow
def test_cells_run_as_ray_tasks_in_local_mode(tmp_path: Path) -> None:
    import ray

    from crl_train.experiment.suite import run_suite

    suite = suite_from_dict({"name": "ray", "methods": ["grpo"], "seeds": [0, 1], "eval_episodes": 4,
                             "set": SMALL, "resources": {"num_cpus": 1, "num_gpus": 0}})
    try:
        records = run_suite(suite, tmp_path, ray_address="local", progress=False)
    finally:
        ray.shutdown()
    assert [r["seed"] for r in records] == [0, 1]
    assert all((tmp_path / "cells" / "grpo" / "MiniHack-Room-5x5-v0" / f"seed{s}" / CELL_FILE).is_file() for s in (0, 1))


def test_importing_the_configs_leaves_usearch_unloaded_so_ray_can_start() -> None:
    # usearch's extension loaded before Ray's makes ray.init abort (std::regex_error): the suite driver
    # imports crl_train.config long before it starts Ray, so that import must not load usearch
    code = "import sys, crl_train.config, crl_gym.clients; print('usearch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


def test_curve_points_average_each_run_over_a_window_of_steps_then_the_seeds() -> None:
    from crl_train.experiment.report import band, curve_window

    run_a = [{"step": s, "x": v} for s, v in enumerate([0.0, 1.0, 1.0, 1.0, 0.0])]
    run_b = [{"step": s, "x": v} for s, v in enumerate([1.0, 1.0, 0.0, None, 1.0])]
    steps, mean, low, high = band([run_a, run_b], "x", window=2)
    # windows {0, 1}, {2, 3}, {4}: run a 0.5, 1.0, 0.0; run b 1.0, 0.0 (its None is skipped), 1.0
    assert steps == [0.5, 2.5, 4.5]
    assert mean == [0.75, 0.5, 0.5]
    # two runs: ± t(0.975, 1) · |a − b| / 2 = 12.7062 · 0.25, 0.5, 0.5
    assert low[0] == pytest.approx(0.75 - 12.7062047 * 0.25) and high[1] == pytest.approx(0.5 + 12.7062047 * 0.5)
    one = band([run_a], "x", window=5)
    assert one == ([2.0], [0.6], [0.6], [0.6])  # one run: no interval, the band is the line
    assert [curve_window(n) for n in (0, 24, 49, 50, 250, 1000)] == [1, 1, 1, 2, 10, 40]


def test_provenance_groups_the_cells_by_commit_and_by_package_set() -> None:
    from crl_train.experiment.provenance import provenance

    new = {"method": "complementary", "seed": 0, "commit": "abc", "packages": {"torch": "2.13.0", "transformers": "5.25.0"}}
    older = {"method": "grpo", "seed": 3}  # a cell.json written before commits and packages were recorded
    bumped = {**new, "seed": 1, "packages": {"torch": "2.13.0", "transformers": "5.26.0"}}
    lines = provenance([new, older, bumped])  # type: ignore[list-item]
    assert "* cells run at `abc`: 2 (complementary 0, complementary 1)" in lines
    assert "* cells whose commit is not recorded (an older cell.json): 1 (grpo 3)" in lines
    assert "* cells run with torch 2.13.0, transformers 5.25.0: 1 (complementary 0)" in lines
    assert "* cells run with torch 2.13.0, transformers 5.26.0: 1 (complementary 1)" in lines
    assert "* cells whose packages are not recorded (an older cell.json): 1 (grpo 3)" in lines
