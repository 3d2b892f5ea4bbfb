"""Whether a recorded episode succeeded, when the env does not say so itself.

The env's ``info["success"]`` on the last step is the answer whenever it is there. Without it a
wrapper falls back to one documented rule: the episode succeeded when its return (the sum of its
rewards) reaches ``success_reward`` (default 1.0, the convention of GEM and of this project's
envs). Partial credit (a wrong answer scored 0.2, a loss scored 0.947) is therefore not a success.
Because a fallback can still be wrong for an env whose full reward is below 1, the first episode
with a fractional reward and no ``info["success"]`` logs one warning per env name and process.

>>> episode_success(None, [0.0, 0.2], 1.0), episode_success(None, [0.0, 1.0], 1.0), episode_success(True, [0.2], 1.0)
(False, True, True)
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_SUCCESS_REWARD = 1.0
"""Return at or above which an episode without ``info["success"]`` counts as a success."""

_WARNED: set[str] = set()
_WARN_LOCK = threading.Lock()


def episode_success(declared: object, rewards: Iterable[Any], success_reward: float) -> bool:
    """``bool(declared)`` when the env declared it, else ``sum(rewards) >= success_reward``
    (a reward that is not a finite number counts as no success: the request is refused later)."""
    if declared is not None:
        return bool(declared)
    try:
        total = math.fsum(map(float, rewards))
    except (TypeError, ValueError):
        return False
    return math.isfinite(total) and total >= success_reward


def warn_if_guessed(env_name: str, declared: object, rewards: list[Any], success_reward: float) -> bool:
    """Log, once per ``env_name`` and process, that success was decided by the reward rule while
    the rewards are fractional (partial credit is likely); returns whether it warned now."""
    if declared is not None or env_name in _WARNED:
        return False
    try:
        fractional = any(not float(r).is_integer() for r in rewards if math.isfinite(float(r)))
    except (TypeError, ValueError):
        return False
    if not fractional:
        return False
    with _WARN_LOCK:
        if env_name in _WARNED:
            return False
        _WARNED.add(env_name)
    logger.warning(
        "env %r gives fractional rewards but no info['success']: success is decided as "
        "'return >= %s' (partial credit is not a success); set info['success'] on the last step, "
        "or pass success_reward= to ExperienceWrapper", env_name, success_reward)
    return True
