"""What the trainer integrations share about one episode of a wrapped text env: the text the model
reads each turn and the reward the rollout gets (``crl_gym.integrations.trl``'s environments,
``crl_gym.integrations.verl.agent_loop``'s ``crl_agent``). Both wrap the env with
:func:`crl_gym.wrappers.wrap`.

>>> with_actions("You are at cell 0.", {"admissible_actions": ["east", "west"]})
'You are at cell 0.\\nAdmissible actions: east, west'
>>> rollout_reward("success", success=True, ret=0.5), rollout_reward("return", success=True, ret=0.5)
(1.0, 0.5)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

REWARDS = ("success", "return")
"""How a rollout is scored: ``"success"`` (1.0 when the episode succeeded, else 0.0: the paper's R)
or ``"return"`` (the sum of the env's rewards)."""


def check_reward(reward: str) -> str:
    """``reward`` when it is one of :data:`REWARDS`, else a ``ValueError`` naming them.

    >>> check_reward("score")
    Traceback (most recent call last):
    ...
    ValueError: reward must be one of ('success', 'return'), got 'score'
    """
    if reward not in REWARDS:
        raise ValueError(f"reward must be one of {REWARDS}, got {reward!r}")
    return reward


def rollout_reward(reward: str, *, success: bool, ret: float) -> float:
    """The rollout's score under ``reward`` (:data:`REWARDS`) for an episode that ended with
    ``success`` after a return of ``ret``."""
    if reward == "success":
        return 1.0 if success else 0.0
    return ret


def with_actions(obs: object, info: Mapping[str, Any]) -> str:
    """The observation, with the admissible actions named when the env lists them."""
    text = obs if isinstance(obs, str) else str(obs)
    actions = info.get("admissible_actions")
    if actions:
        text = f"{text}\nAdmissible actions: {', '.join(str(a) for a in actions)}"
    return text


__all__ = ["REWARDS", "check_reward", "rollout_reward", "with_actions"]
