"""The ``crl/`` environment ids, where their classes live and which extra they need.

Registration is lazy: ``gymnasium.make("crl/Sokoban-6x6-v0")`` imports the module only then, so
``import crl_gym`` stays cheap and a missing optional package fails with a message that names
the extra to install.
"""

from __future__ import annotations

import importlib
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


ENVS: dict[str, EnvSpec] = {
    "crl/MiniHack-Room-5x5-v0": EnvSpec("crl_gym.envs.minihack:MiniHackEnv", "envs", {"task": "Room-5x5"}, ("nle", "minihack")),
    "crl/MiniHack-Room-Ultimate-5x5-v0": EnvSpec("crl_gym.envs.minihack:MiniHackEnv", "envs", {"task": "Room-Ultimate-5x5"}, ("nle", "minihack")),
    "crl/MiniHack-MazeWalk-9x9-v0": EnvSpec("crl_gym.envs.minihack:MiniHackEnv", "envs", {"task": "MazeWalk-9x9"}, ("nle", "minihack")),
    "crl/MiniHack-KeyRoom-Dark-S5-v0": EnvSpec("crl_gym.envs.minihack:MiniHackEnv", "envs", {"task": "KeyRoom-Dark-S5"}, ("nle", "minihack")),
    "crl/MiniHack-River-Narrow-v0": EnvSpec("crl_gym.envs.minihack:MiniHackEnv", "envs", {"task": "River-Narrow"}, ("nle", "minihack")),
    "crl/Sokoban-6x6-v0": EnvSpec("crl_gym.envs.sokoban:SokobanEnv"),
    "crl/ALFWorld-v0": EnvSpec("crl_gym.envs.alfworld:ALFWorldEnv", "envs", {}, ("alfworld", "textworld")),
    "crl/WebShop-v0": EnvSpec("crl_gym.envs.webshop.env:WebShopEnv"),
    "crl/TextWorld-v0": EnvSpec("crl_gym.envs.textworld_env:TextWorldEnv", "envs", {}, ("textworld",)),
    "crl/GEM-v0": EnvSpec("crl_gym.envs.gem_adapter:GEMEnv", "gem", {}, ("gem",)),
    "crl/SWEBench-v0": EnvSpec("crl_gym.envs.swebench.env:SWEBenchEnv", "swe", {}, ("docker", "swebench")),
}


class MissingExtraError(ImportError):
    """An env's optional dependency is not installed."""


def _check_requirements(env_id: str, spec: EnvSpec) -> None:
    for module in spec.requires:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            hint = f"pip install 'complementary-rl[{spec.extra}]'" if spec.extra else "reinstall complementary-rl"
            raise MissingExtraError(
                f"{env_id} needs the package {module!r}, which is not installed ({exc}). Install it with: {hint}"
            ) from exc


def _creator(env_id: str, spec: EnvSpec) -> Any:
    def create(**kwargs: Any) -> gym.Env:
        _check_requirements(env_id, spec)
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
    """``gymnasium.make`` with an error that lists the known ids for an unknown one."""
    if env_id not in ENVS:
        known = ", ".join(sorted(ENVS))
        raise gym.error.UnregisteredEnv(f"unknown environment {env_id!r}; known crl environments: {known}")
    register_all()
    return gym.make(env_id, **kwargs)
