"""Whether a recorded episode succeeded, when the env does not say so itself.

The env's ``info["success"]`` on the last step is the answer whenever it is there. Without it a
wrapper uses the rule its user declared: a callable ``success_rule(rewards, last_info) -> bool``,
or a threshold ``success_reward`` (the episode succeeded when its return reaches it). Neither
declared, the threshold is 1.0 (the convention of GEM and of this project's envs) and the first
such episode logs one warning per env name and process that says what is counted: an env with
+1 per legal move would otherwise have every positive episode counted as a success, silently.
Partial credit (a wrong answer scored 0.2) is no success under the threshold.

>>> (episode_success(None, [0.0, 0.2], 1.0), episode_success(None, [0.0, 1.0], 1.0),
...  episode_success(True, [0.2], 1.0))
(False, True, True)
>>> solved = lambda rewards, info: info.get("solved", False)
>>> episode_success(None, [1.0, 1.0], 1.0, rule=solved, last_info={})
False
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable
from typing import Any

from crl_gym.json_types import EnvInfo

logger = logging.getLogger(__name__)

DEFAULT_SUCCESS_REWARD = 1.0
"""Return at or above which an episode without ``info["success"]`` counts as a success."""

SuccessRule = Callable[[list[float], EnvInfo], bool]
"""``rule(rewards, last_info) -> bool``: a user's own success rule for an env without
``info["success"]``."""

_WARNED: set[str] = set()
_WARN_LOCK = threading.Lock()


def episode_success(
    declared: object,
    rewards: Iterable[Any],
    success_reward: float,
    *,
    rule: SuccessRule | None = None,
    last_info: EnvInfo | None = None,
) -> bool:
    """``bool(declared)`` when the env declared it, else ``rule(rewards, last_info)`` when given,
    else ``sum(rewards) >= success_reward`` (a reward that is not a finite number counts as no
    success: the request is refused later)."""
    if declared is not None:
        return bool(declared)
    try:
        values = [float(r) for r in rewards]
    except (TypeError, ValueError):
        return False
    if rule is not None:
        return bool(rule(values, last_info or {}))
    total = math.fsum(values)
    return math.isfinite(total) and total >= success_reward


def ended_success(info: EnvInfo, rewards: list[float], env_name: str) -> bool:
    """The success of an episode that just ended with ``info`` (its last step's): the wrapper's
    request's ``success`` when there is one (the env's word or its declared rule), else
    ``info["success"]``, else the default rule (``return >= 1.0``, warned once per ``env_name``).
    Every trainer path reads success through this, so none counts an episode its own way."""
    request = info.get("distillation_request")
    success = getattr(request, "success", None)
    if isinstance(success, bool):
        return success
    declared = info.get("success")
    warn_if_guessed(env_name, declared, rewards, DEFAULT_SUCCESS_REWARD)
    return episode_success(declared, rewards, DEFAULT_SUCCESS_REWARD)


def warn_if_guessed(
    env_name: str,
    declared: object,
    rewards: list[Any],
    success_reward: float,
    *,
    rule_declared: bool = False,
) -> bool:
    """Log, once per ``env_name`` and process, that an episode ended without ``info["success"]``
    and without a declared rule, saying what is counted (and that partial credit is likely when
    the rewards are fractional); returns whether it warned now."""
    if declared is not None or rule_declared or env_name in _WARNED:
        return False
    try:
        fractional = any(not float(r).is_integer() for r in rewards if math.isfinite(float(r)))
    except (TypeError, ValueError):
        return False
    with _WARN_LOCK:
        if env_name in _WARNED:
            return False
        _WARNED.add(env_name)
    logger.warning(
        "env %r ends episodes without info['success'] and no success rule is declared: an episode "
        "counts as a success when its return >= %s%s. Set info['success'] on the last step, or "
        "declare the rule: success_reward= (a threshold) or success_rule= (a callable) of "
        "ExperienceWrapper",
        env_name,
        success_reward,
        " (its rewards are fractional: partial credit is no success)"
        if fractional
        else " (with a reward per move, any episode that scored that much)",
    )
    return True
