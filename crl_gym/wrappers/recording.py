"""A ``DistillationRequest`` built from an episode's flat record on first read.

At episode end :class:`~crl_gym.wrappers.ExperienceWrapper` hands over the list it appended
references to while the episode ran — ``[obs0, action1, reward1, info1, obs1, action2, ...]``
— instead of building one ``Step`` per turn, a ``Trajectory`` and a uuid for every episode of a
rollout at once. :class:`RecordedRequest` *is* a ``DistillationRequest`` (``isinstance`` holds,
every field reads the same, ``to_dict``/``to_json``/pickle round-trip to the same request); only
``trajectory`` and ``request_id`` are made on first access, by whoever reads them (the trainer's
background track, ``manager.get_requests``' caller, a spill to JSON), not by the rollout loop.

>>> rec = ["You are in a corridor.", "east", 1.0, {"success": True}, "You left."]
>>> req = RecordedRequest.from_record(rec, task="leave", experience=None, condition="free",
...                                   env_id="corridor", seed=0, success=True)
>>> req.outcome, req.trajectory.steps[0].action, req.trajectory.initial_observation
(1.0, 'east', 'You are in a corridor.')
>>> DistillationRequest.from_json(req.to_json()) == req
True
"""

from __future__ import annotations

import math
import threading
import uuid
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from crl_gym.json_types import JSONDict, RequestDict, SearchCallDict, StepDict
from crl_gym.protocol import (
    Condition,
    DistillationRequest,
    ExperienceRef,
    SearchCall,
    Step,
    Trajectory,
    TurnGuidance,
    _jsonable,
)
from crl_gym.wrappers.success import DEFAULT_SUCCESS_REWARD
from crl_gym.wrappers.text_actions import NotTextError, to_text

SEARCH_INFO_KEY = "search_and_ask"
"""Info key of a ``search_and_ask`` turn (set by :class:`~crl_gym.wrappers.SearchAndAskWrapper`)."""

# One lock for all requests: materialising is rare next to stepping, and a lock per request
# would be an allocation per episode for a race that almost never happens.
_BUILD_LOCK = threading.Lock()
_FIELDS = tuple(f.name for f in fields(DistillationRequest))
_ONLY_STR = {str}  # the types seen in an all-text record


def text_record(record: list[Any]) -> str | None:
    """Make every observation and action of a flat record ``str``, in place; ``None`` when all
    are text now, else why the record is refused (the first value with no text form).

    Called once per episode, at its end: all-``str`` records (the common case) cost two
    C-level type scans; anything else goes through :func:`~crl_gym.wrappers.text_actions.to_text`.

    >>> import numpy as np
    >>> rec = [b"start", np.int64(2), 0.0, {}, "end"]
    >>> text_record(rec), rec[:2]
    (None, ['start', '2'])
    >>> text_record(["start", None, 0.0, {}, "end"])
    'the action of turn 1 is None, not text'
    """
    kinds = set(map(type, record[0::4]))
    kinds.update(map(type, record[1::4]))
    if kinds == _ONLY_STR:
        return None
    for j in range(0, len(record), 4):
        for k in (j, j + 1) if j + 1 < len(record) else (j,):
            value = record[k]
            if type(value) is str:
                continue
            try:
                record[k] = to_text(value)
            except NotTextError as exc:
                turn = k // 4
                what = (
                    f"the action of turn {turn + 1}"
                    if k % 4
                    else f"the observation after turn {turn}"
                    if turn
                    else "the first observation"
                )
                return f"{what} is {exc}"
    return None


def _turns(record: list[Any]) -> zip[tuple[Any, Any, Any, Any]]:
    """``(observation, action, reward, info)`` per turn of a flat record."""
    return zip(record[0:-1:4], record[1::4], record[2::4], record[3::4], strict=True)


def _search_call(info: object) -> tuple[bool, SearchCall | None]:
    """(is a search_and_ask turn, its call) from a turn's info."""
    search = info.get(SEARCH_INFO_KEY) if isinstance(info, dict) else None
    if search is None:
        return False, None
    call = search.get("call") if isinstance(search, dict) else None
    return True, call if isinstance(call, SearchCall) else None


def steps_and_calls(record: list[Any]) -> tuple[list[Step], list[SearchCall]]:
    """The ``Step`` objects and ``search_and_ask`` calls of a flat record."""
    steps: list[Step] = []
    calls: list[SearchCall] = []
    for obs, action, reward, info in _turns(record):
        searched, call = _search_call(info)
        if call is not None:
            calls.append(call)
        steps.append(
            Step(
                observation=obs,
                action=action,
                reward=float(reward),
                info=info,
                kind="search_and_ask" if searched else "env",
            )
        )
    return steps, calls


class RecordedRequest(DistillationRequest):
    """A :class:`~crl_gym.protocol.DistillationRequest` whose ``trajectory`` and ``request_id``
    are built on first read (thread-safe: concurrent readers get the same objects).

    Not re-decorated as a dataclass: it keeps the parent's fields, ``__init__`` (so
    ``dataclasses.replace`` and ``copy`` work) and ``repr``; assigning ``trajectory`` or
    ``request_id`` replaces the lazy value. It compares equal to a plain request with the
    same field values.
    """

    _record: list[Any] | None
    _trajectory: Trajectory | None
    _request_id: str | None

    @classmethod
    def from_record(
        cls,
        record: list[Any],
        *,
        task: str,
        experience: ExperienceRef | None,
        condition: Condition,
        env_id: str,
        seed: int | None,
        success: bool | None = None,
        meta: dict[str, Any] | None = None,
        rollout_step: int | None = None,
        turn_experience: list[TurnGuidance] | None = None,
    ) -> RecordedRequest:
        """Take ownership of ``record`` (``[obs0, a1, r1, info1, obs1, ...]``, length 4n+1).

        ``outcome`` is the sum of the rewards; ``success`` defaults to ``outcome >= 1.0``
        (:data:`~crl_gym.wrappers.success.DEFAULT_SUCCESS_REWARD`: partial credit is no success).
        The observations and actions are stored as given: run :func:`text_record` first.
        """
        if len(record) % 4 != 1:
            raise ValueError(
                "record must hold 4n+1 items (obs0, then action, reward, info, obs per turn), got "
                f"{len(record)}"
            )
        self = cls.__new__(cls)
        # sum of float()s in turn order: bit-identical to adding Step.reward one by one
        outcome = sum(map(float, record[2::4]), 0.0)
        if not math.isfinite(
            outcome
        ):  # one check per episode: the sum is finite iff every reward is
            bad = next(
                (
                    f"the reward of turn {t} is {r!r}"
                    for t, r in enumerate(map(float, record[2::4]), 1)
                    if not math.isfinite(r)
                ),
                f"the rewards sum to {outcome!r}",
            )
            raise ValueError(f"{bad}: a request's outcome must be a finite number")
        self.task = task
        self.outcome = outcome
        self.success = bool(success) if success is not None else outcome >= DEFAULT_SUCCESS_REWARD
        self.experience = experience
        self.condition = condition
        self.env_id = env_id
        self.seed = seed
        self.rollout_step = rollout_step
        self.meta = meta if meta is not None else {}
        self.turn_experience = turn_experience if turn_experience is not None else []
        self._record = record
        self._trajectory = None
        self._request_id = None
        return self

    # -- lazy fields ---------------------------------------------------------------------------
    @property
    def trajectory(self) -> Trajectory:
        traj = self._trajectory
        if traj is None:
            with _BUILD_LOCK:
                traj = self._trajectory
                if traj is None:
                    record = self._record or [""]
                    steps, calls = steps_and_calls(record)
                    traj = Trajectory(
                        steps=steps, initial_observation=record[0], search_calls=calls
                    )
                    self._trajectory, self._record = traj, None
        return traj

    @trajectory.setter
    def trajectory(self, value: Trajectory) -> None:
        with _BUILD_LOCK:
            self._trajectory, self._record = value, None

    @property
    def request_id(self) -> str:
        rid = self._request_id
        if rid is None:
            with _BUILD_LOCK:
                if self._request_id is None:
                    self._request_id = uuid.uuid4().hex
                rid = self._request_id
        return rid

    @request_id.setter
    def request_id(self, value: str) -> None:
        self._request_id = value

    @property
    def materialized(self) -> bool:
        """Whether ``trajectory`` has been built (or assigned)."""
        return self._trajectory is not None

    # -- protocol ----------------------------------------------------------------------------------
    def to_dict(self) -> RequestDict:
        """Same dict as ``DistillationRequest.to_dict``; straight from the record when the
        trajectory was never read (no ``Step`` objects are made just to be serialised)."""
        with _BUILD_LOCK:
            record = self._record if self._trajectory is None else None
        if record is None:
            return super().to_dict()
        steps: list[StepDict] = []
        calls: list[SearchCallDict] = []
        for obs, action, reward, info in _turns(record):
            searched, call = _search_call(info)
            if call is not None:
                calls.append(call.to_dict())
            steps.append(
                {
                    "observation": obs,
                    "action": action,
                    "reward": float(reward),
                    "info": _jsonable(info),
                    "kind": "search_and_ask" if searched else "env",
                }
            )
        return self._to_dict_with(
            {"steps": steps, "initial_observation": record[0], "search_calls": calls}
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DistillationRequest):
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in _FIELDS)

    __hash__ = None  # type: ignore[assignment]  # mutable, like the parent dataclass

    def __getstate__(self) -> JSONDict:
        # The record pickles as it is (cheaper than Steps); readers build on the other side.
        with _BUILD_LOCK:
            return dict(self.__dict__)

    def __setstate__(self, state: Mapping[str, object]) -> None:
        self.__dict__.update(state)
