"""Colossal Cave Adventure (the ``adventure`` package, a third-party text game) wrapped as
docs/wrappers.md says, as a user's own module: an adapter to a Gymnasium text env and its
``gymnasium.register``.

Tests copy this file as ``adventure_env.py`` into a directory on ``PYTHONPATH`` and pass the id
``"adventure_env:Adventure-v0"``.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
from adventure import load_advent_dat
from adventure.game import Game

from crl_gym.envs.base import text_space

ACTIONS = ("enter", "take lamp", "take keys", "out", "east", "west", "south", "north")
"""The moves offered at the start of the game (the actor may type any other)."""

TASKS = (
    ("Go into the brick building.", lambda game: game.loc.n == 3),
    ("Pick up the brass lamp.", lambda game: any("lamp" in o.names for o in game.inventory)),
    ("Pick up the keys.", lambda game: any("keys" in o.names for o in game.inventory)),
)
"""(task text, whether the game state achieves it); the reset seed picks one."""


class AdventureEnv(gym.Env[str, str]):
    """One task of the opening of Adventure per episode; reward 1 when it is done (``info["success"]``)."""

    def __init__(self, max_turns: int = 6) -> None:
        self.max_turns = max_turns
        self.observation_space = text_space(max_length=4096)
        self.action_space = text_space(max_length=64)
        self.game: Game | None = None
        self.task = 0
        self.turn = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self.task = int(self.np_random.integers(len(TASKS)))
        self.game = Game(int(self.np_random.integers(2**31)))  # the game's own dice, from our seed
        load_advent_dat(self.game)
        self.game.start()
        self.turn = 0
        text = self.game.do_command(["no"])  # no instructions: the game starts at the road
        return f"{TASKS[self.task][0]}\n{text.strip()}", self._info()

    def _info(self) -> dict[str, Any]:
        return {"task": TASKS[self.task][0], "admissible_actions": list(ACTIONS)}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        assert self.game is not None, "reset first"
        self.turn += 1
        words = str(action).lower().split()
        text = self.game.do_command(words) if words else "PARDON?"
        done = bool(TASKS[self.task][1](self.game))
        terminated = done or self.game.is_finished
        truncated = not terminated and self.turn >= self.max_turns
        info = self._info()
        if terminated or truncated:
            info["success"] = done
        return text.strip(), float(done), terminated, truncated, info


gym.register("Adventure-v0", entry_point=AdventureEnv)
