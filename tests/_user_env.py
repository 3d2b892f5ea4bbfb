"""A user's own env module, as a researcher writes it: a Gymnasium text env and its ``gymnasium.register``.

Tests copy this file under another name into a directory on ``PYTHONPATH`` and pass the id as
``"<module>:MyEnv-v0"``, so nothing of the project imports it.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym

from crl_gym.envs.base import text_space


class MyEnv(gym.Env[str, str]):
    """Say the colour of the task's lamp: one of three words, ``tries`` turns; reward 1 when right."""

    COLOURS = ("red", "green", "blue")

    def __init__(self, tries: int = 3) -> None:
        self.tries = tries
        self.observation_space = text_space(max_length=256)
        self.action_space = text_space(max_length=16)
        self.colour = ""
        self.turn = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self.colour = self.COLOURS[int(self.np_random.integers(len(self.COLOURS)))]
        self.turn = 0
        task = "Name the colour of the lamp in the hall"
        return task, {"task": task, "admissible_actions": list(self.COLOURS)}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.turn += 1
        right = action.strip() == self.colour
        truncated = not right and self.turn >= self.tries
        info: dict[str, Any] = {"admissible_actions": list(self.COLOURS)}
        if right or truncated:
            info["success"] = right
        return ("Right" if right else "Wrong"), float(right), right, truncated, info


gym.register("MyEnv-v0", entry_point=MyEnv)
