"""The crl/ registry: every id registered lazily, clear errors for unknown ids and missing extras."""

from __future__ import annotations

import sys

import gymnasium as gym
import pytest

import crl_gym  # noqa: F401  (registers crl/ ids)
from crl_gym.envs import registry
from crl_gym.envs.registry import ENVS, MissingEnvArgumentError, MissingExtraError, make


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


def test_an_adapter_made_without_its_argument_says_what_to_pass() -> None:
    from crl_gym.envs.textworld_env import TextWorldEnv

    usage = r"needs game_files: a TextWorld game file \(.z8, .ulx, .json, .tw-pddl\) or a directory of them, e.g. " \
            r"crl_gym.envs.make\('crl/TextWorld-v0', game_files='games/'\)"
    with pytest.raises(MissingEnvArgumentError, match="crl/TextWorld-v0 " + usage):
        make("crl/TextWorld-v0")
    with pytest.raises(TypeError, match="crl/TextWorld-v0 " + usage):  # a TypeError still, for callers that catch one
        gym.make("crl/TextWorld-v0", max_turns=3)
    with pytest.raises(MissingEnvArgumentError, match="TextWorldEnv " + usage):
        TextWorldEnv()


def test_a_required_parameter_of_any_adapter_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import crl_gym.wrappers.examples as examples

    class NeedyEnv(examples.CorridorEnv):
        def __init__(self, layout: str, max_turns: int = 4) -> None:
            super().__init__(max_turns=max_turns)
            self.layout = layout

    monkeypatch.setattr(examples, "NeedyEnv", NeedyEnv, raising=False)
    spec = registry.EnvSpec("crl_gym.wrappers.examples:NeedyEnv")
    with pytest.raises(MissingEnvArgumentError, match=r"crl/Needy-v0 needs layout: pass it to crl_gym.envs.make"):
        registry.check_arguments("crl/Needy-v0", spec, {"max_turns": 3})
    registry.check_arguments("crl/Needy-v0", spec, {"layout": "x"})
