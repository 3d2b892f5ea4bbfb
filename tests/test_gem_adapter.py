"""GEM adapter: a tiny object with GEM's interface (always), a real gem-llm env (when installed),
and the missing-package error."""

from __future__ import annotations

import random
import re
import sys
from typing import Any

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

import crl_gym  # noqa: F401
from crl_gym.envs.gem_adapter import GEMEnv, GEMMissingError
from crl_gym.envs.registry import MissingEnvArgumentError, MissingExtraError, make


class CountdownGEM:
    """GEM-style env: guess the hidden number in \\boxed{}; raises on an empty action."""

    def __init__(self, max_turns: int = 5) -> None:
        self.max_turns = max_turns

    def reset(self, seed: int | None = None) -> tuple[str, dict[str, Any]]:
        rng = random.Random(seed)
        self.target = rng.randint(1, 9)
        self.turns = 0
        return "Guess a number from 1 to 9 as \\boxed{n}.", {"suffix": "Enter your guess."}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if not action.strip():
            raise ValueError("empty action")
        self.turns += 1
        m = re.search(r"\\boxed\{(\d+)\}", action)
        if m is None:
            return "Format error: wrap the guess in \\boxed{}.", -0.1, True, False, {}
        guess = int(m.group(1))
        if guess == self.target:
            return "Correct!", 1.0, True, False, {}
        hint = "higher" if guess < self.target else "lower"
        return f"Go {hint}.", 0.0, False, self.turns >= self.max_turns, {}

    def get_valid_actions(self) -> list[str]:
        return [f"\\boxed{{{i}}}" for i in range(1, 10)]


def solve(env: GEMEnv, seed: int) -> tuple[list[str], float, dict[str, Any]]:
    """Binary search by hints: the scripted policy."""
    obs, info = env.reset(seed=seed)
    lo, hi, total, seen = 1, 9, 0.0, [obs]
    terminated = truncated = False
    while not (terminated or truncated):
        guess = (lo + hi) // 2
        obs, reward, terminated, truncated, info = env.step(f"I think \\boxed{{{guess}}}")
        total += reward
        seen.append(obs)
        if "higher" in obs:
            lo = guess + 1
        elif "lower" in obs:
            hi = guess - 1
    return seen, total, info


def test_adapter_over_gem_interface_object() -> None:
    env = GEMEnv(env=CountdownGEM(), render_mode="ansi")
    seen, total, info = solve(env, seed=3)
    assert total == 1.0 and info["success"] is True and seen[-1] == "Correct!"
    assert info["task"] == seen[0] and info["turn"] == len(seen) - 1
    assert info["admissible_actions"][0] == "\\boxed{1}" and info["gem_env_id"] == "CountdownGEM"
    assert env.render() == "Correct!"
    assert solve(env, seed=3)[0] == seen  # seed reproduces the episode


def test_failure_invalid_action_and_turn_limit() -> None:
    env = GEMEnv(env=CountdownGEM(max_turns=100), max_turns=2)
    env.reset(seed=0)
    # an exception inside the GEM env becomes an invalid turn that lists the valid actions
    obs, reward, terminated, truncated, info = env.step("")
    assert obs.startswith("empty action. Invalid action: ''. Valid actions: \\boxed{1}")
    assert (reward, terminated, truncated) == (0.0, False, False) and env.errors == 1
    assert info["invalid_action"] is True and obs.endswith("Guess a number from 1 to 9 as \\boxed{n}.")
    obs, reward, terminated, truncated, info = env.step("\\boxed{0}")
    assert truncated and not terminated and info["success"] is False  # adapter's 2-turn limit
    assert info["invalid_action"] is False
    # GEM's own terminal failure (format error) is not a success
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step("no box here")
    assert terminated and reward == -0.1 and info["success"] is False


def test_env_checker_on_interface_object() -> None:
    check_env(GEMEnv(env=CountdownGEM()))


def test_constructor_errors() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        GEMEnv("game:GuessTheNumber-v0-easy", env=object())
    with pytest.raises(TypeError, match="callable reset"):
        GEMEnv(env=object())


def test_made_without_an_env_id_says_what_to_pass() -> None:
    usage = r"needs env_id: a gem-llm id, e.g. crl_gym.envs.make\('crl/GEM-v0', env_id='game:GuessTheNumber-v0-easy'\)"
    with pytest.raises(MissingEnvArgumentError, match="GEMEnv " + usage):
        GEMEnv()
    with pytest.raises(MissingEnvArgumentError, match="crl/GEM-v0 " + usage):
        make("crl/GEM-v0")
    with pytest.raises(TypeError, match="crl/GEM-v0 " + usage):  # plain gymnasium.make too
        gym.make("crl/GEM-v0", max_turns=5)


def test_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gem", None)  # makes `import gem` raise ImportError
    with pytest.raises(GEMMissingError, match=r"gem-llm.*complementary-rl\[gem\]"):
        GEMEnv("game:GuessTheNumber-v0-easy")
    with pytest.raises(MissingExtraError, match=r"crl/GEM-v0.*complementary-rl\[gem\]"):
        gym.make("crl/GEM-v0", env_id="game:GuessTheNumber-v0-easy")


def test_real_gem_env() -> None:
    pytest.importorskip("gem")
    env = gym.make("crl/GEM-v0", env_id="game:GuessTheNumber-v0-easy", max_turns=30)
    check_env(env.unwrapped)
    obs, info = env.reset(seed=11)
    assert "Guess The Number" in obs and info["task"] == obs
    gem_env = env.unwrapped.gem_env
    lo, hi = gem_env.min_number, gem_env.max_number  # binary search finds it within max_turns
    terminated = truncated = False
    while not (terminated or truncated):
        guess = (lo + hi) // 2
        obs, reward, terminated, truncated, info = env.step(f"\\boxed{{{guess}}}")
        if "higher" in obs:
            lo = guess + 1
        elif "lower" in obs:
            hi = guess - 1
    assert info["success"] is True and reward == 1.0
    first = env.reset(seed=11)[0]
    assert first == env.reset(seed=11)[0]
    env.close()
