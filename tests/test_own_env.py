"""A user's own env by Gymnasium id: ``module:EnvId-v0``, entry points, clear errors, and
``crl-train`` / ``crl-eval`` / ``--resume`` end to end on it with the tiny preset."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import pytest

from crl_gym.envs import ENTRY_POINT_GROUP, UnknownEnvError, make, resolve
from crl_gym.envs import ids as env_ids
from crl_train.config import load_config

HERE = Path(__file__).parent
BIN = Path(sys.executable).parent


def user_module(tmp_path: Path, name: str) -> Path:
    """``tests/_user_env.py`` as the module ``name`` in ``tmp_path`` (which it returns)."""
    shutil.copy(HERE / "_user_env.py", tmp_path / f"{name}.py")
    return tmp_path


def test_module_colon_id_imports_the_users_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(user_module(tmp_path, "own_env_a")))
    env = make("own_env_a:MyEnv-v0", tries=2)
    obs, info = env.reset(seed=0)
    assert info["task"] == obs and env.unwrapped.tries == 2  # type: ignore[attr-defined]
    wrong = next(c for c in info["admissible_actions"] if c != env.unwrapped.colour)  # type: ignore[attr-defined]
    assert env.step(wrong)[2:4] == (False, False)
    *_, truncated, info = env.step(wrong)
    assert truncated and info["success"] is False
    assert resolve("MyEnv-v0") == "MyEnv-v0"  # registered now: the plain id works too


def test_unknown_id_and_missing_module_say_how_to_register(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UnknownEnvError, match=r"unknown environment 'NoSuch-v0'.*gymnasium\.register"):
        make("NoSuch-v0")
    with pytest.raises(ModuleNotFoundError, match=r"'not_a_module_here:X-v0'.*PYTHONPATH"):
        resolve("not_a_module_here:X-v0")
    (tmp_path / "registers_nothing.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UnknownEnvError, match=r"importing 'registers_nothing' did not register 'Other-v0'"):
        resolve("registers_nothing:Other-v0")


def test_an_entry_point_registers_its_packages_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    user_module(tmp_path, "own_env_plugin")
    (tmp_path / "own_env_plugin.py").write_text(
        (tmp_path / "own_env_plugin.py").read_text().replace('gym.register("MyEnv-v0"', 'gym.register("PluginEnv-v0"'))
    dist = tmp_path / "own_env_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: own-env-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nplugin = own_env_plugin\nbroken = no_such_pkg_x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(env_ids, "_loaded", {})
    assert "PluginEnv-v0" not in gym.registry
    env = make("PluginEnv-v0")
    assert env.reset(seed=1)[1]["task"]
    assert env_ids._loaded["plugin"] is None and "no_such_pkg_x" in str(env_ids._loaded["broken"])
    with pytest.raises(UnknownEnvError, match=r"Entry point 'broken' failed to load"):
        make("StillUnknown-v0")


def test_a_presets_seed_entries_and_kwargs_stay_with_their_env() -> None:
    cfg = load_config(None, ['env.ids=["own:MyEnv-v0"]'])
    assert cfg.experience.seeds_for(cfg.env.ids) == [] and cfg.env.kwargs_for("own:MyEnv-v0") == {}
    tiny = load_config(None)
    (minihack,) = tiny.env.ids
    assert [tags for _, tags in tiny.experience.seeds_for(tiny.env.ids)] == [(minihack,)]
    assert tiny.env.kwargs_for(minihack) == {"max_turns": 12}
    assert load_config(None, ["env.kwargs={max_turns: 4}"]).env.kwargs_for(minihack) == {"max_turns": 4}
    plain = load_config(None, ["experience.seed_entries=[a, b]"]).experience
    assert plain.seeds_for(("x", "y")) == [("a", ()), ("b", ())]
    from crl_train.config import ConfigError

    with pytest.raises(ConfigError, match=r"seed_entries\['x'\]: expected a list of texts"):
        load_config(None, ["experience.seed_entries={x: 3}"])


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    return subprocess.run([str(BIN / args[0]), *args[1:]], capture_output=True, text=True, env=env, timeout=900)


TINY = ["--set", "train.steps=2", "--set", "env.tasks_per_step=1", "--set", "env.group_size=2",
        "--set", "train.eval_episodes=0", "--set", "train.checkpoint_every=1", "--set", "algo.buffer_size=2",
        "--no-progress"]


@pytest.mark.slow
def test_train_eval_and_resume_by_module_id(tmp_path: Path) -> None:
    user_module(tmp_path, "mymodule")
    run = tmp_path / "run"
    config = str(HERE.parent / "configs" / "tiny.yaml")
    proc = _run(tmp_path, "crl-train", "--config", config, "--set", 'env.ids=["mymodule:MyEnv-v0"]', *TINY,
                "--out", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    recorded = load_config(run / "config.yaml").env
    assert recorded.ids == ("mymodule:MyEnv-v0",) and recorded.kwargs_for("mymodule:MyEnv-v0") == {}
    bank = [json.loads(line) for line in (run / "bank" / "bank.jsonl").read_text().splitlines()]
    assert not any("staircase" in e["text"] for e in bank)  # the preset's MiniHack entry stays MiniHack's
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]

    proc = _run(tmp_path, "crl-eval", "--run", str(run), "--episodes", "2", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["without_experience"]["by_env"]) == {"mymodule:MyEnv-v0"}

    proc = _run(tmp_path, "crl-train", "--resume", str(run), "--set", "train.steps=3", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]

    # the module off PYTHONPATH: the recorded id is named, with what to do
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([str(BIN / "crl-eval"), "--run", str(run), "--json"], capture_output=True, text=True,
                          env=env, timeout=900, cwd=run)
    assert proc.returncode == 2 and "mymodule:MyEnv-v0" in proc.stderr and "PYTHONPATH" in proc.stderr


def test_env_shorthand_and_unknown_id_fail_before_anything_starts(tmp_path: Path) -> None:
    proc = _run(tmp_path, "crl-train", "--env", "NoSuchEnv-v0", "--out", str(tmp_path / "r"))
    assert proc.returncode == 2 and "unknown environment 'NoSuchEnv-v0'" in proc.stderr
    assert "gymnasium.register" in proc.stderr and not (tmp_path / "r").exists()
    user_module(tmp_path, "mymodule2")
    proc = _run(tmp_path, "crl-train", "--env", "mymodule2:MyEnv-v0", "--show-config")
    assert proc.returncode == 0 and "ids: ['mymodule2:MyEnv-v0']" in proc.stdout


def test_a_suite_cell_trains_on_a_module_id(tmp_path: Path) -> None:
    from crl_train.experiment.suite import cell_config, cells, suite_from_dict

    suite = suite_from_dict({"name": "mine", "methods": ["grpo"], "seeds": [0], "envs": ["mymodule:MyEnv-v0"],
                             "set": ["train.steps=1"]})
    (cell,) = cells(suite)
    cfg = cell_config(suite, cell)
    assert cfg.env.ids == ("mymodule:MyEnv-v0",) and cfg.experience.seeds_for(cfg.env.ids) == []
    assert cell.name.endswith("mymodule:MyEnv-v0/seed0")
