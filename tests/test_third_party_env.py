"""A third-party text game (``adventure``: Colossal Cave Adventure, from the registry) wrapped as
docs/wrappers.md says, end to end: Gymnasium's checker, the docs' vector recipe (AsyncVectorEnv
workers over one RemoteClient, several episodes per copy), and crl-train by its Gymnasium id,
crl-eval and --resume."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gymnasium.utils.env_checker import check_env
from gymnasium.vector import AsyncVectorEnv

from crl_gym.clients import RemoteClient
from crl_gym.envs import make
from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.embedders import HashingEmbedder
from crl_gym.experience.manager import ExperienceManager
from crl_gym.protocol import AddOp
from crl_gym.server import BackgroundServer
from crl_gym.wrappers import wrap
from crl_gym.wrappers.vector import end_step

HERE = Path(__file__).parent
BIN = Path(sys.executable).parent
ENV_ID = "adventure_env:Adventure-v0"
TIP = "Go into the building first: the lamp and the keys are inside."
SOLVE = {"Go into the brick building.": ["enter"], "Pick up the brass lamp.": ["enter", "take lamp"],
         "Pick up the keys.": ["enter", "take keys"]}


@pytest.fixture()
def on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``tests/_adventure_env.py`` as the user's module ``adventure_env``, importable here and in subprocesses."""
    shutil.copy(HERE / "_adventure_env.py", tmp_path / "adventure_env.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p))
    return tmp_path


def test_the_wrapped_game_passes_gymnasiums_checker_and_solves_its_tasks(on_path: Path) -> None:
    env = make(ENV_ID)
    check_env(env.unwrapped)
    seen = set()
    for seed in range(12):
        obs, info = env.reset(seed=seed)
        assert obs.startswith(info["task"]) and "END OF A ROAD" in obs
        seen.add(info["task"])
        for action in SOLVE[info["task"]]:
            obs, reward, terminated, truncated, info = env.step(action)
        assert terminated and reward == 1.0 and info["success"] is True
    assert seen == set(SOLVE)
    env.reset(seed=0)
    for _ in range(env.unwrapped.max_turns):  # type: ignore[attr-defined]
        *_, terminated, truncated, info = env.step("west")
    assert truncated and not terminated and info["success"] is False


def test_the_docs_vector_recipe_keeps_each_copys_condition(on_path: Path) -> None:
    emb = HashingEmbedder(64)
    manager = ExperienceManager(ExperienceBank(None, dim=64), emb)
    manager.apply_ops([AddOp(TIP)])
    copies, episodes = 2, 3
    try:
        with BackgroundServer(manager) as server:
            client = RemoteClient(server.url, timeout=30)
            envs = AsyncVectorEnv([lambda: wrap(make(ENV_ID), client) for _ in range(copies)], shared_memory=False)
            try:
                obs, info = envs.reset(seed=7, options={"experience": "guided", "rollout_step": 0})
                plans = [list(SOLVE[t]) for t in info["task"]]
                ended = [0] * copies
                while min(ended) < episodes:  # step until every copy ended three episodes (autoreset between)
                    obs, reward, terminated, truncated, info = envs.step([p.pop(0) if p else "enter" for p in plans])
                    for i in range(copies):
                        if terminated[i] or truncated[i]:
                            ended[i] += 1
                        if not plans[i] or terminated[i] or truncated[i]:
                            plans[i] = list(SOLVE.get(str(info["task"][i]), ["enter"])) if info["_task"][i] else []
                result = end_step(envs, client, 0)
            finally:
                envs.close()
                client.close()
            deadline = time.monotonic() + 30
            while manager.pending() < sum(ended) and time.monotonic() < deadline:
                time.sleep(0.01)
            requests = manager.get_requests(100)
        assert result.requests == len(requests) == sum(ended) >= copies * episodes
        assert all(r.condition == "guided" and r.experience is not None and r.experience.text == TIP for r in requests)
        assert all(r.rollout_step == 0 and r.env_id == "Adventure-v0" for r in requests)
        seeds = [r.seed for r in requests]
        assert None not in seeds and len(set(seeds)) == len(seeds)  # every autoreset episode seeded, none twice
        assert sum(r.success for r in requests) >= copies * (episodes - 1)
    finally:
        manager.close()


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([str(BIN / args[0]), *args[1:]], capture_output=True, text=True, env=env, timeout=900,
                          cwd=cwd)


@pytest.mark.slow
def test_crl_train_eval_and_resume_on_the_game_by_its_id(on_path: Path) -> None:
    run = on_path / "run"
    small = ["--set", "train.steps=2", "--set", "env.tasks_per_step=1", "--set", "env.group_size=2",
             "--set", "env.max_turns=4", "--set", "train.eval_episodes=0", "--set", "train.checkpoint_every=1",
             "--set", "algo.buffer_size=2", "--set", f"experience.seed_entries={json.dumps({ENV_ID: [TIP]})}"]
    proc = _run("crl-train", "--env", ENV_ID, *small, "--no-progress", "--out", str(run), cwd=on_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    bank = [json.loads(line) for line in (run / "bank" / "bank.jsonl").read_text().splitlines()]
    assert [(e["text"], e["tags"]) for e in bank if e["text"] == TIP] == [(TIP, [ENV_ID])]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and set(rows[-1]["success_by_env"]) == {ENV_ID}

    proc = _run("crl-eval", "--run", str(run), "--episodes", "2", "--json", cwd=on_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["with_experience"]["by_env"]) == set(result["without_experience"]["by_env"]) == {ENV_ID}

    proc = _run("crl-train", "--resume", str(run), "--set", "train.steps=3", "--no-progress", cwd=on_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
