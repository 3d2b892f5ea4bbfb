"""Deprecated home of the episode rules: what the actor reads each turn is
:mod:`crl_gym.episode.prompt`'s (``user_text``, ``MAX_OBS_CHARS``, re-exported here), and the
request of an episode a loop cuts is written by the env's wrapper
(:meth:`crl_gym.episode.EpisodeDriver.cut`). :func:`cut_request` and :func:`shown_turn_entry`
stay one release for callers outside the project.

>>> user_text("abcdefghij", ["north", "south"], max_obs_chars=7)
'ab … ij\\nValid actions: north, south'
>>> user_text("room", ["north"], constrained=True)
'room'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from crl_gym.episode.driver import CUT_REASONS as DRIVER_CUT_REASONS
from crl_gym.episode.prompt import MAX_OBS_CHARS, user_text
from crl_gym.protocol import (
    FREE_CONDITION,
    GUIDED_CONDITION,
    DistillationRequest,
    ExperienceRef,
    Step,
    Trajectory,
    TurnGuidance,
)

CUT_REASONS: tuple[str, ...] = DRIVER_CUT_REASONS
"""Why the trainer ends an episode its env did not: the turn cap, or a next turn that would
not fit."""


def shown_turn_entry(info: Mapping[str, Any], turn: int) -> TurnGuidance | None:
    """The entry per-turn retrieval showed with this turn's observation (the wrapper's
    ``info["turn_experience"]``), as the ``TurnGuidance`` of a request the trainer writes itself."""
    shown = info.get("turn_experience")
    entry = ExperienceRef.from_dict(shown) if isinstance(shown, dict) else None
    return None if entry is None else TurnGuidance(turn, entry)


def cut_request(
    *,
    task: str,
    steps: Sequence[Step],
    outcome: float,
    experience: ExperienceRef | None,
    condition: str | None,
    env_id: str,
    seed: int | None,
    reasons: Mapping[str, Any],
    meta: Mapping[str, Any] | None = None,
    turn_experience: Sequence[TurnGuidance] = (),
) -> DistillationRequest:
    """The request of an episode the trainer cut: a failure (``success`` False) whatever its reward,
    ``meta`` with the cut's flags (``reasons``: only the keys of :data:`CUT_REASONS` are kept).

    >>> r = cut_request(task="t", steps=[], outcome=0.0, experience=None, condition=None,
    ...                 env_id="e", seed=3, reasons={"turn_cap": True, "gate": "x"})
    >>> r.success, r.condition, r.meta
    (False, 'free', {'turn_cap': True})
    """
    flags = {k: v for k, v in reasons.items() if k in CUT_REASONS}
    return DistillationRequest(
        task=task,
        trajectory=Trajectory(steps=list(steps)),
        outcome=float(outcome),
        success=False,
        experience=experience,
        condition=GUIDED_CONDITION if condition == GUIDED_CONDITION else FREE_CONDITION,
        env_id=env_id,
        seed=seed,
        meta={**(meta or {}), **flags},
        turn_experience=list(turn_experience),
    )


__all__ = ["CUT_REASONS", "MAX_OBS_CHARS", "cut_request", "shown_turn_entry", "user_text"]
