"""TextWorld adapter: a game made by ``tw-make`` in a tmp dir, won by following its walkthrough."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

pytest.importorskip("textworld")

import crl_gym  # noqa: E402,F401
from crl_gym.envs.textworld_env import TextWorldEnv, clean_feedback, find_games  # noqa: E402

TW_MAKE = Path(sys.executable).parent / "tw-make"


@pytest.fixture(scope="module")
def game_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tw_games")
    for seed in (123, 7):
        subprocess.run(
            [str(TW_MAKE), "custom", "--world-size", "2", "--nb-objects", "3", "--quest-length", "2",
             "--seed", str(seed), "--output", str(out / f"game_{seed}.z8"), "-f", "--silent"],
            check=True, timeout=300,
        )
    return out


pytestmark = pytest.mark.slow  # tw-make compiles Inform 7 games: ~10 s each


def test_find_games_prefers_playable_file(game_dir: Path) -> None:
    # tw-make writes game.z8 and game.json side by side: only the .z8 is listed
    assert [p.name for p in find_games(game_dir)] == ["game_123.z8", "game_7.z8"]
    with pytest.raises(FileNotFoundError, match="not found"):
        find_games(game_dir / "missing.z8")


def test_walkthrough_policy_wins(game_dir: Path) -> None:
    env = TextWorldEnv(game_dir / "game_123.z8", expert_plan=True, render_mode="ansi")
    obs, info = env.reset(seed=0)
    assert info["task"] and info["admissible_actions"] and info["success"] is False
    steps = 0
    terminated = truncated = False
    total = 0.0
    while not (terminated or truncated):
        action = info["expert_plan"][0]  # the planner's next command from the current state
        assert action in info["admissible_actions"]
        obs, reward, terminated, truncated, info = env.step(action)
        total += reward
        steps += 1
    assert terminated and info["success"] is True and total == 1.0
    assert info["score"] == info["max_score"] and steps == info["turn"]
    assert env.render() == obs
    # stepping a finished episode is harmless
    assert env.step("look")[2] is True
    env.close()


def test_score_reward_mode_sums_to_max_score(game_dir: Path) -> None:
    env = TextWorldEnv(game_dir / "game_7.z8", expert_plan=True, reward_mode="score")
    _, info = env.reset(seed=0)
    plan = list(info["expert_plan"])
    total = sum(env.step(a)[1] for a in plan)
    assert total == info["max_score"] > 0


def test_invalid_action_and_turn_limit(game_dir: Path) -> None:
    env = TextWorldEnv(game_dir, max_turns=2)
    _, info = env.reset(options={"game": 0})
    obs, reward, terminated, truncated, info2 = env.step("dance wildly")
    assert obs.startswith("Invalid action: 'dance wildly'. Valid actions: ")
    assert info["admissible_actions"][0] in obs and reward == 0.0 and not truncated
    assert info2["invalid_action"] is True
    obs, reward, terminated, truncated, info3 = env.step("look")
    assert truncated and not terminated and reward == 0.0 and info3["success"] is False


def test_seed_reproduces_and_env_checker(game_dir: Path) -> None:
    env = TextWorldEnv(game_dir)
    check_env(env.unwrapped)
    a = [env.reset(seed=5)[0], env.step("look")[0]]
    b = [env.reset(seed=5)[0], env.step("look")[0]]
    assert a == b
    env.close()


def test_registered_id(game_dir: Path) -> None:
    env = gym.make("crl/TextWorld-v0", game_files=str(game_dir / "game_7.z8"))
    _, info = env.reset(seed=0)
    assert info["game_file"].endswith("game_7.z8")
    env.close()


def test_clean_feedback() -> None:
    assert clean_feedback("\n\n-= Office =-\nYou see a pen.\n\n\n\n>  \n") == "-= Office =-\nYou see a pen."
