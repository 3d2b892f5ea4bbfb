"""The ``env`` section: which environments the actor trains on and how rollouts are grouped."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from crl_gym.json_types import JSONDict
from crl_train.config.io import ConfigError


@dataclass(frozen=True)
class EnvConfig:
    """Which environments the actor trains on and how rollouts are grouped."""

    ids: tuple[str, ...] = ("crl/MiniHack-Room-5x5-v0",)
    """Gymnasium env ids; several ids = multi-task, tasks drawn round-robin. A ``crl/`` id, an id
    registered with ``gymnasium.register``, ``"module:EnvId-v0"`` (the module is imported first) or
    an id a package registers through the ``crl_gym.envs`` entry-point group (``crl_gym.envs.ids``).
    """
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for every env constructor (e.g. ``{max_turns: 10}``)."""
    id_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Keyword arguments for one env id only (e.g. ``{"crl/MiniHack-Room-5x5-v0": {max_turns:
    12}}``), under ``kwargs`` (a key given there wins); an id not in ``ids`` is ignored, so a
    preset's arguments for its env never reach another env."""
    tasks_per_step: int = 2
    """Task groups per rollout step (rollout batch = tasks_per_step × group_size)."""
    group_size: int = 8
    """K: env copies per task with one seed; K/2 guided and K/2 free (paper: 8)."""
    max_turns: int = 30
    """Turn cap applied by the trainer on top of the env's own (paper: 30)."""
    seed: int = 0
    """Base seed; task g of step t uses seed + t × tasks_per_step + g."""
    eval_seed_offset: int = 1_000_000
    """Held-out evaluation seeds start here (never used for training)."""

    def __post_init__(self) -> None:
        if not self.ids:
            raise ConfigError("env.ids must list at least one environment id")
        if self.tasks_per_step < 1:
            raise ConfigError(f"env.tasks_per_step must be >= 1, got {self.tasks_per_step}")
        if self.group_size < 2 or self.group_size % 2:
            raise ConfigError(
                "env.group_size must be an even number >= 2 (K/2 guided, K/2 free), got "
                f"{self.group_size}"
            )
        if self.max_turns < 1:
            raise ConfigError(f"env.max_turns must be >= 1, got {self.max_turns}")
        for env_id, kw in self.id_kwargs.items():
            if not isinstance(kw, dict):
                raise ConfigError(
                    f"env.id_kwargs[{env_id!r}]: expected a mapping of keyword arguments, "
                    f"got {kw!r}"
                )

    def kwargs_for(self, env_id: str) -> JSONDict:
        """The constructor's keyword arguments of ``env_id``: its ``id_kwargs``, then ``kwargs``."""
        return {**self.id_kwargs.get(env_id, {}), **self.kwargs}
