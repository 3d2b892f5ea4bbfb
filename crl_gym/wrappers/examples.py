"""A tiny deterministic text env for examples, docs and the wrappers' tests.

>>> env = CorridorEnv(length=2)
>>> obs, info = env.reset(seed=0)
>>> info["task"]
'Walk east 2 times to reach the exit of the corridor.'
>>> env.step("jump")[0]
"Invalid action: 'jump'. Valid actions: east, west."
>>> _ = env.step("east"); obs, reward, terminated, truncated, info = env.step("east")
>>> reward, terminated, info["success"]
(1.0, True, True)
"""

from __future__ import annotations

from crl_gym.envs.base import TextEnv
from crl_gym.json_types import EnvInfo, EnvOptions, JSONDict


class CorridorEnv(TextEnv):
    """Walk ``east`` ``length`` times to reach the exit; ``west`` walks back (not past cell 0).

    Reward 1 on reaching the exit, else 0; the episode is truncated after ``max_turns``.
    An invalid action is a turn whose observation lists the valid actions.
    """

    ACTIONS = ("east", "west")

    def __init__(
        self, length: int = 3, max_turns: int = 10, render_mode: str | None = None
    ) -> None:
        super().__init__(max_turns=max_turns, render_mode=render_mode)
        if length < 1:
            raise ValueError(f"length must be >= 1, got {length}")
        self.length = length
        self.pos = 0
        self.task = f"Walk east {length} times to reach the exit of the corridor."

    def _describe(self) -> str:
        return (
            f"You are at cell {self.pos} of a corridor; the exit is at cell {self.length}, to "
            "the east."
        )

    def _info(self) -> JSONDict:
        return {"task": self.task, "admissible_actions": list(self.ACTIONS), "turn": self.turn}

    def reset(
        self, *, seed: int | None = None, options: EnvOptions | None = None
    ) -> tuple[str, EnvInfo]:
        super().reset(seed=seed)
        self.pos = 0
        self.turn = 0
        self._last_obs = self._describe()
        return self._last_obs, self._info()

    def step(self, action: str) -> tuple[str, float, bool, bool, EnvInfo]:
        self.turn += 1
        act = str(action).strip().lower()
        if act == "east":
            self.pos += 1
            obs = self._describe()
        elif act == "west":
            self.pos = max(0, self.pos - 1)
            obs = self._describe()
        else:
            obs = self.invalid_action_observation(str(action), list(self.ACTIONS))
        terminated = self.pos >= self.length
        truncated = not terminated and self.turn >= self.max_turns
        info = self._info()
        if terminated or truncated:
            info["success"] = terminated
        self._last_obs = obs
        return obs, 1.0 if terminated else 0.0, terminated, truncated, info
