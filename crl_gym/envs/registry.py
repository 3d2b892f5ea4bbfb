"""The ``crl/`` environment ids, where their classes live and which extra they need.

Registration is lazy: ``gymnasium.make("crl/Sokoban-6x6-v0")`` imports the module only then, so
``import crl_gym`` stays cheap and a missing optional package fails with a message that names
the extra to install. An adapter made without the argument it cannot work without (TextWorld's
game files, GEM's env id) says what to pass, with an example, before anything is imported.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym


@dataclass(frozen=True)
class EnvSpec:
    """One registered environment."""

    entry_point: str
    """``module:Class`` of the env."""
    extra: str | None = None
    """pip extra that provides its dependencies (``pip install 'complementary-rl[extra]'``)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    requires: tuple[str, ...] = ()
    """Modules that must import for the env to work."""
    needs: tuple[str, ...] = ()
    """Arguments of which one must be given (the env has nothing to run without it)."""
    usage: str = ""
    """What to pass for ``needs``, with an example (the error of a make without it)."""


TEXTWORLD_USAGE = (
    "game_files: a TextWorld game file (.z8, .ulx, .json, .tw-pddl) or a directory of them, e.g. "
    "crl_gym.envs.make('crl/TextWorld-v0', game_files='games/') (in a crl-train config: "
    "env.kwargs: {game_files: games/})"
)
GEM_USAGE = (
    "env_id: a gem-llm id, e.g. crl_gym.envs.make('crl/GEM-v0', "
    "env_id='game:GuessTheNumber-v0-easy') (in a crl-train config: env.kwargs: {env_id: "
    "'game:GuessTheNumber-v0-easy'}), or env: an object with GEM's reset/step"
)

ENVS: dict[str, EnvSpec] = {
    "crl/MiniHack-Room-5x5-v0": EnvSpec(
        "crl_gym.envs.minihack:MiniHackEnv", "envs", {"task": "Room-5x5"}, ("nle", "minihack")
    ),
    "crl/MiniHack-Room-Ultimate-5x5-v0": EnvSpec(
        "crl_gym.envs.minihack:MiniHackEnv",
        "envs",
        {"task": "Room-Ultimate-5x5"},
        ("nle", "minihack"),
    ),
    "crl/MiniHack-MazeWalk-9x9-v0": EnvSpec(
        "crl_gym.envs.minihack:MiniHackEnv", "envs", {"task": "MazeWalk-9x9"}, ("nle", "minihack")
    ),
    "crl/MiniHack-KeyRoom-Dark-S5-v0": EnvSpec(
        "crl_gym.envs.minihack:MiniHackEnv",
        "envs",
        {"task": "KeyRoom-Dark-S5"},
        ("nle", "minihack"),
    ),
    "crl/MiniHack-River-Narrow-v0": EnvSpec(
        "crl_gym.envs.minihack:MiniHackEnv", "envs", {"task": "River-Narrow"}, ("nle", "minihack")
    ),
    "crl/Sokoban-6x6-v0": EnvSpec("crl_gym.envs.sokoban:SokobanEnv"),
    "crl/Recall-v0": EnvSpec("crl_gym.envs.recall:RecallEnv"),
    "crl/ALFWorld-v0": EnvSpec(
        "crl_gym.envs.alfworld:ALFWorldEnv", "envs", {}, ("alfworld", "textworld")
    ),
    "crl/WebShop-v0": EnvSpec("crl_gym.envs.webshop.env:WebShopEnv"),
    "crl/TextWorld-v0": EnvSpec(
        "crl_gym.envs.textworld_env:TextWorldEnv",
        "envs",
        {},
        ("textworld",),
        ("game_files",),
        TEXTWORLD_USAGE,
    ),
    "crl/GEM-v0": EnvSpec(
        "crl_gym.envs.gem_adapter:GEMEnv", "gem", {}, ("gem",), ("env_id", "env"), GEM_USAGE
    ),
    "crl/SWEBench-v0": EnvSpec(
        "crl_gym.envs.swebench.env:SWEBenchEnv", "swe", {}, ("docker", "swebench")
    ),
}


class MissingExtraError(ImportError):
    """An env's optional dependency is not installed."""


class MissingEnvArgumentError(TypeError):
    """An env was made without an argument it needs; the message says what to pass."""


def check_arguments(env_id: str, spec: EnvSpec, kwargs: dict[str, Any]) -> None:
    """Raise :class:`MissingEnvArgumentError` when none of ``spec.needs`` is given, or (for an
    adapter without ``needs``) when a required parameter of its class is missing."""
    given = {**spec.kwargs, **kwargs}
    if spec.needs and all(given.get(k) is None for k in spec.needs):
        raise MissingEnvArgumentError(f"{env_id} needs {spec.usage or ' or '.join(spec.needs)}")
    if not spec.needs:
        module_name, class_name = spec.entry_point.split(":")
        cls = getattr(importlib.import_module(module_name), class_name)
        missing = [
            p.name
            for p in inspect.signature(cls).parameters.values()
            if p.default is p.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.name not in given
        ]
        if missing:
            raise MissingEnvArgumentError(
                f"{env_id} needs {', '.join(missing)}: pass it to crl_gym.envs.make({env_id!r}, "
                f"{missing[0]}=...) (in a crl-train config: env.kwargs)"
            )


def _check_requirements(env_id: str, spec: EnvSpec) -> None:
    for module in spec.requires:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            hint = (
                f"pip install 'complementary-rl[{spec.extra}]'"
                if spec.extra
                else "reinstall complementary-rl"
            )
            raise MissingExtraError(
                f"{env_id} needs the package {module!r}, which is not installed ({exc}). Install "
                f"it with: {hint}"
            ) from exc


def _creator(env_id: str, spec: EnvSpec) -> Callable[..., gym.Env]:
    def create(**kwargs: object) -> gym.Env:
        if spec.needs:
            check_arguments(env_id, spec, kwargs)
        _check_requirements(env_id, spec)
        if not spec.needs:
            check_arguments(env_id, spec, kwargs)
        module_name, class_name = spec.entry_point.split(":")
        cls = getattr(importlib.import_module(module_name), class_name)
        return cls(**{**spec.kwargs, **kwargs})

    return create


def register_all() -> None:
    """Register every ``crl/`` id with Gymnasium (idempotent)."""
    for env_id, spec in ENVS.items():
        if env_id not in gym.registry:
            gym.register(id=env_id, entry_point=_creator(env_id, spec), disable_env_checker=True)


def make(env_id: str, **kwargs: Any) -> gym.Env:
    """``gymnasium.make`` of any id :func:`crl_gym.envs.ids.resolve` finds (a ``crl/`` id, one a
    user registered, ``"module:EnvId-v0"``, an entry point's); an unknown id raises
    :class:`~crl_gym.envs.ids.UnknownEnvError` listing the ``crl/`` ids and how to register one."""
    from crl_gym.envs.ids import resolve

    resolve(env_id)
    spec = ENVS.get(env_id)
    if (
        spec is not None and spec.needs
    ):  # before gym.make, which would append its own note to the message
        check_arguments(env_id, spec, kwargs)
    return gym.make(env_id, **kwargs)
