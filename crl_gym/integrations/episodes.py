"""What the trainer integrations share about one episode of a wrapped text env beyond the episode
driver (:mod:`crl_gym.episode`, which writes the text the model reads each turn): the reward the
rollout gets (``crl_gym.integrations.trl``'s environments, ``crl_gym.integrations.verl``'s
``crl_agent``). Both wrap the env with :func:`crl_gym.wrappers.wrap`.

>>> (rollout_reward("success", success=True, ret=0.5),
...  rollout_reward("return", success=True, ret=0.5))
(1.0, 0.5)
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from crl_gym.episode.prompt import user_text

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
    """Deprecated: the episode driver's user turn (:func:`crl_gym.episode.user_text`) of ``obs``
    and ``info["admissible_actions"]``."""
    warnings.warn(
        "crl_gym.integrations.episodes.with_actions is deprecated: use "
        "crl_gym.episode.user_text (the episode driver's user turn)",
        DeprecationWarning,
        stacklevel=2,
    )
    return user_text(obs, [str(a) for a in info.get("admissible_actions") or ()])


__all__ = ["REWARDS", "check_reward", "rollout_reward", "with_actions"]
