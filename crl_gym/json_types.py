"""Types of JSON payloads: any parsed JSON (:data:`JSONValue`), and the payloads of known shape.

The wire forms of :mod:`crl_gym.protocol` (a distillation request, its steps and search calls, an
entry reference, an extractor sample, an op) are :class:`~typing.TypedDict` s here: ``to_dict``
returns one, so a reader sees each field's type. ``from_dict`` takes :data:`JSONInput`, a decoded
object not yet checked, and checks every field it reads (``ValueError`` naming the field).

crl_gym imports nothing from crl_train, so both packages use these.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, NotRequired, TypedDict

JSONScalar = int | float | str | bool | None
"""One JSON scalar."""
JSONValue = JSONScalar | list["JSONValue"] | dict[str, "JSONValue"]
"""A value of parsed JSON (what :func:`json.loads` returns, and what :func:`json.dumps` takes)."""
JSONDict = dict[str, JSONValue]
"""A JSON object of free shape (an env's ``info``, a request's ``meta``)."""
JSONInput = Mapping[str, object]
"""A decoded JSON object before it is checked: each reader checks the fields it takes."""
EnvInfo = dict[str, Any]
"""Gymnasium's ``info`` of ``reset`` / ``step``: free-form by Gymnasium's contract (``gym.Env``
types it ``dict[str, Any]``, and an override may not narrow it); any env or wrapper may put any
object in it (a search call, a numpy scalar), so its values are arbitrary on purpose."""
EnvOptions = dict[str, Any]
"""Gymnasium's ``options`` of ``reset``: free-form by Gymnasium's contract, read by the env."""


class ExperienceRefDict(TypedDict):
    """:meth:`crl_gym.protocol.ExperienceRef.to_dict`."""

    id: int
    text: str
    version: int


class TurnGuidanceDict(TypedDict):
    """:meth:`crl_gym.protocol.TurnGuidance.to_dict`."""

    turn: int
    entry: ExperienceRefDict


class StepDict(TypedDict):
    """:meth:`crl_gym.protocol.Step.to_dict`."""

    observation: str
    action: str
    reward: float
    info: JSONValue
    kind: Literal["env", "search_and_ask"]


class SearchCallDict(TypedDict):
    """:meth:`crl_gym.protocol.SearchCall.to_dict`."""

    query: str
    answer: str
    entry: ExperienceRefDict | None
    turn: int
    refined: bool
    provenance: JSONValue


class TrajectoryDict(TypedDict):
    """:meth:`crl_gym.protocol.Trajectory.to_dict`."""

    steps: list[StepDict]
    initial_observation: str
    search_calls: list[SearchCallDict]


class RequestDict(TypedDict):
    """:meth:`crl_gym.protocol.DistillationRequest.to_dict`: the request payload of the service
    contract (``POST /submit``, a ``trajectories.jsonl`` line)."""

    task: str
    trajectory: TrajectoryDict
    outcome: float
    success: bool
    experience: ExperienceRefDict | None
    condition: str
    env_id: str
    seed: int | None
    rollout_step: int | None
    request_id: str
    meta: JSONValue
    turn_experience: NotRequired[list[TurnGuidanceDict]]
    """Only when an entry was shown before a single turn (per-turn retrieval)."""


class GrammarSpec(TypedDict):
    """The JSON grammar an extractor sample was drawn under (:attr:`ExtractorSample.grammar`)."""

    schema: str
    think_tokens: int
    reasoning_end: int | None


class SampleDict(TypedDict):
    """:meth:`crl_gym.protocol.ExtractorSample.to_dict` (an entry's provenance)."""

    prompt: str
    response: str
    logprobs: list[float]
    token_ids: list[int]
    prompt_token_ids: list[int]
    extractor_version: int
    grammar: GrammarSpec | None


class SnapshotInfoDict(TypedDict):
    """:meth:`crl_gym.experience.snapshots.SnapshotInfo.to_dict` (``POST /snapshot``)."""

    name: str
    created_at: float
    entries: int
    pending: int
    path: str


class RestoredDict(TypedDict):
    """The answer of ``POST /restore``: the snapshot restored and the one of the state before."""

    restored: str
    before: SnapshotInfoDict
    bank_size: int


class QuarantinedDict(TypedDict):
    """The answer of ``POST /quarantine``: the entries hidden (``undo``: brought back)."""

    undo: bool
    entries: list[int]
    bank_size: int


class FlushReport(TypedDict):
    """What :meth:`crl_gym.wrappers.ExperienceWrapper.flush_experience` reports (each env copy's
    entry of ``StepEnded.workers``)."""

    kept: int
    """Requests still kept by the wrapper's outbox."""
    undelivered: str | None
    """The flush error's message, or None."""


class OpDict(TypedDict):
    """:func:`crl_gym.protocol.op_to_dict`: one extractor op (``kind`` says which fields it has)."""

    kind: Literal["add", "update", "delete", "return"]
    text: NotRequired[str]
    tags: NotRequired[list[str]]
    id: NotRequired[int]
    reason: NotRequired[str]
    malformed: NotRequired[bool]


__all__ = [
    "EnvInfo",
    "EnvOptions",
    "ExperienceRefDict",
    "FlushReport",
    "GrammarSpec",
    "JSONDict",
    "JSONInput",
    "JSONScalar",
    "JSONValue",
    "OpDict",
    "QuarantinedDict",
    "RequestDict",
    "RestoredDict",
    "SampleDict",
    "SearchCallDict",
    "SnapshotInfoDict",
    "StepDict",
    "TrajectoryDict",
    "TurnGuidanceDict",
]
