"""The crl/ registry: every id registered lazily, clear errors for unknown ids and missing extras."""

from __future__ import annotations

import sys

import gymnasium as gym
import pytest

import crl_gym  # noqa: F401  (registers crl/ ids)
from crl_gym.envs import registry
from crl_gym.envs.registry import ENVS, MissingExtraError, make


def test_every_id_is_registered_with_gymnasium() -> None:
    crl_ids = sorted(i for i in gym.registry if i.startswith("crl/"))
    assert crl_ids == sorted(ENVS)
    assert "crl/MiniHack-Room-Ultimate-5x5-v0" in crl_ids and "crl/Sokoban-6x6-v0" in crl_ids
    registry.register_all()  # idempotent
    assert sorted(i for i in gym.registry if i.startswith("crl/")) == crl_ids


def test_unknown_id_lists_the_known_ids() -> None:
    with pytest.raises(gym.error.UnregisteredEnv) as err:
        make("crl/Sokoban-9x9-v0")
    message = str(err.value)
    assert "'crl/Sokoban-9x9-v0'" in message
    for env_id in ENVS:
        assert env_id in message


def test_missing_extra_names_the_env_package_and_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes `import minihack` raise ImportError, as if not installed.
    monkeypatch.setitem(sys.modules, "minihack", None)
    with pytest.raises(MissingExtraError) as err:
        make("crl/MiniHack-Room-5x5-v0")
    message = str(err.value)
    assert "crl/MiniHack-Room-5x5-v0" in message and "'minihack'" in message
    assert "pip install 'complementary-rl[envs]'" in message
    # plain gymnasium.make goes through the same check
    with pytest.raises(ImportError, match=r"complementary-rl\[envs\]"):
        gym.make("crl/MiniHack-River-Narrow-v0")


def test_make_passes_kwargs_and_spec_defaults() -> None:
    env = make("crl/Sokoban-6x6-v0", max_turns=7)
    assert env.unwrapped.max_turns == 7  # type: ignore[attr-defined]
    assert env.spec is not None and env.spec.id == "crl/Sokoban-6x6-v0"
    env.close()
    env = make("crl/MiniHack-MazeWalk-9x9-v0", render_mode="ansi")
    obs, info = env.reset(seed=0)
    assert env.unwrapped.task_name == "MazeWalk-9x9"  # type: ignore[attr-defined]
    assert env.render() == obs and info["task"]
    env.close()
