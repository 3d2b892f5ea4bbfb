"""Messages that cross the boundary between environments, the experience manager and the trainer.

Plain dataclasses with a JSON round-trip (``to_dict`` / ``from_dict``), so the same objects
travel in-process, over HTTP (``crl_gym.server``) and into spill files on disk.

>>> req = DistillationRequest(task="reach the stairs", trajectory=Trajectory(
...     steps=[Step(observation="You see a room.", action="north", reward=0.0)]),
...     outcome=1.0, success=True, experience=None, condition="free")
>>> DistillationRequest.from_json(req.to_json()) == req
True
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Condition = Literal["guided", "free"]
CONDITIONS: tuple[str, ...] = ("guided", "free")


def _jsonable(value: Any) -> Any:
    """Best-effort conversion of info values (numpy scalars, arrays, sets) to JSON types."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return value.tolist()
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)


@dataclass(frozen=True)
class ExperienceRef:
    """What an episode saw of a bank entry: enough to credit the entry later."""

    id: int
    """The entry's uint64 id in the bank."""
    text: str
    """The entry's text as shown to the actor."""
    version: int = 0
    """The entry's version counter when it was retrieved."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> ExperienceRef | None:
        if d is None:
            return None
        return cls(id=int(d["id"]), text=str(d["text"]), version=int(d.get("version", 0)))


@dataclass
class Step:
    """One turn of an episode: what the agent saw, what it did, what came back."""

    observation: str
    """The observation the action was taken on."""
    action: str
    """The agent's raw action text."""
    reward: float = 0.0
    """Reward returned by the env for this action (0 for a search_and_ask turn)."""
    info: dict[str, Any] = field(default_factory=dict)
    """The env's info dict after the action (kept as a reference while recording)."""
    kind: Literal["env", "search_and_ask"] = "env"
    """``search_and_ask`` when the wrapper intercepted the action and the env was not stepped."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "observation": self.observation,
            "action": self.action,
            "reward": float(self.reward),
            "info": _jsonable(self.info),
            "kind": self.kind,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Step:
        return cls(
            observation=str(d["observation"]),
            action=str(d["action"]),
            reward=float(d.get("reward", 0.0)),
            info=dict(d.get("info") or {}),
            kind=d.get("kind", "env"),
        )


@dataclass
class SearchCall:
    """One ``search_and_ask`` call: the actor's query, the entry found and the answer given."""

    query: str
    answer: str
    entry: ExperienceRef | None = None
    turn: int = 0
    refined: bool = False
    """True when an extractor rewrote the entry for the query (then the answer is credited)."""
    provenance: dict[str, Any] | None = None
    """Extractor sample that produced the refinement: prompt, response, logprobs, version."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "query": self.query,
            "answer": self.answer,
            "entry": self.entry.to_dict() if self.entry else None,
            "turn": self.turn,
            "refined": self.refined,
            "provenance": _jsonable(self.provenance),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SearchCall:
        return cls(
            query=str(d["query"]),
            answer=str(d["answer"]),
            entry=ExperienceRef.from_dict(d.get("entry")),
            turn=int(d.get("turn", 0)),
            refined=bool(d.get("refined", False)),
            provenance=d.get("provenance"),
        )


@dataclass
class Trajectory:
    """The recorded steps of one episode, plus the first observation."""

    steps: list[Step] = field(default_factory=list)
    initial_observation: str = ""
    search_calls: list[SearchCall] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def num_actions(self) -> int:
        """Env actions taken (search_and_ask turns excluded)."""
        return sum(1 for s in self.steps if s.kind == "env")

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": [s.to_dict() for s in self.steps],
            "initial_observation": self.initial_observation,
            "search_calls": [c.to_dict() for c in self.search_calls],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        return cls(
            steps=[Step.from_dict(s) for s in d.get("steps", [])],
            initial_observation=str(d.get("initial_observation", "")),
            search_calls=[SearchCall.from_dict(c) for c in d.get("search_calls", [])],
        )


@dataclass
class DistillationRequest:
    """R = (τ, g, o, m): what the extractor needs to distil one finished episode."""

    task: str
    """Task description g (``info["task"]`` or the first observation)."""
    trajectory: Trajectory
    """Interaction trace τ."""
    outcome: float
    """Episode return o."""
    success: bool
    """Whether the episode counts as a success (r(m) = +1 else −1)."""
    experience: ExperienceRef | None
    """Entry m the episode was guided by (None for a free episode)."""
    condition: Condition = "free"
    """``guided`` or ``free``: the subgroup of the rollout group."""
    env_id: str = ""
    seed: int | None = None
    rollout_step: int | None = None
    """Actor step during which the episode ran (set by the trainer; used to credit entries)."""
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.condition not in CONDITIONS:
            raise ValueError(f"condition must be one of {CONDITIONS}, got {self.condition!r}")

    def to_dict(self) -> dict[str, Any]:
        return self._to_dict_with(self.trajectory.to_dict())

    def _to_dict_with(self, trajectory: dict[str, Any]) -> dict[str, Any]:
        """The JSON dict of this request around an already serialised ``trajectory``."""
        return {
            "task": self.task,
            "trajectory": trajectory,
            "outcome": float(self.outcome),
            "success": bool(self.success),
            "experience": self.experience.to_dict() if self.experience else None,
            "condition": self.condition,
            "env_id": self.env_id,
            "seed": self.seed,
            "rollout_step": self.rollout_step,
            "request_id": self.request_id,
            "meta": _jsonable(self.meta),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DistillationRequest:
        return cls(
            task=str(d["task"]),
            trajectory=Trajectory.from_dict(d["trajectory"]),
            outcome=float(d["outcome"]),
            success=bool(d["success"]),
            experience=ExperienceRef.from_dict(d.get("experience")),
            condition=d.get("condition", "free"),
            env_id=str(d.get("env_id", "")),
            seed=d.get("seed"),
            rollout_step=d.get("rollout_step"),
            request_id=str(d.get("request_id") or uuid.uuid4().hex),
            meta=dict(d.get("meta") or {}),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_json(cls, s: str) -> DistillationRequest:
        return cls.from_dict(json.loads(s))


# ---------------------------------------------------------------------------------------------
# Operations issued by the experience extractor.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AddOp:
    """Add a newly synthesised entry."""

    text: str
    tags: tuple[str, ...] = ()
    kind: Literal["add"] = "add"


@dataclass(frozen=True)
class UpdateOp:
    """Replace the text of entry ``id`` (new version; the old text goes to history)."""

    id: int
    text: str
    kind: Literal["update"] = "update"


@dataclass(frozen=True)
class DeleteOp:
    """Remove entry ``id`` (issued by Merge, never by per-episode distillation)."""

    id: int
    kind: Literal["delete"] = "delete"


@dataclass(frozen=True)
class ReturnOp:
    """No action. ``malformed`` marks a fallback from an unparsable extractor output."""

    reason: str = ""
    malformed: bool = False
    kind: Literal["return"] = "return"


ExperienceOp = AddOp | UpdateOp | DeleteOp | ReturnOp


def op_to_dict(op: ExperienceOp) -> dict[str, Any]:
    d = asdict(op)
    if "tags" in d:
        d["tags"] = list(d["tags"])
    return d


def op_from_dict(d: dict[str, Any]) -> ExperienceOp:
    kind = d.get("kind")
    if kind == "add":
        return AddOp(text=str(d["text"]), tags=tuple(d.get("tags", ())))
    if kind == "update":
        return UpdateOp(id=int(d["id"]), text=str(d["text"]))
    if kind == "delete":
        return DeleteOp(id=int(d["id"]))
    if kind == "return":
        return ReturnOp(reason=str(d.get("reason", "")), malformed=bool(d.get("malformed", False)))
    raise ValueError(f"unknown op kind {kind!r}; expected add, update, delete or return")


@dataclass
class ExtractorSample:
    """Provenance of one extractor generation: what CISPO needs to train on it later."""

    prompt: str
    response: str
    logprobs: list[float] = field(default_factory=list)
    """Per-token log-probs of ``response`` under the extractor that generated it."""
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    extractor_version: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> ExtractorSample | None:
        if not d:
            return None
        return cls(
            prompt=str(d.get("prompt", "")),
            response=str(d.get("response", "")),
            logprobs=[float(x) for x in d.get("logprobs", [])],
            token_ids=[int(x) for x in d.get("token_ids", [])],
            prompt_token_ids=[int(x) for x in d.get("prompt_token_ids", [])],
            extractor_version=int(d.get("extractor_version", 0)),
        )
