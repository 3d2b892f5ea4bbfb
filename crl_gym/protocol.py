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
import math
import uuid
from dataclasses import dataclass, field
from typing import Any, Final, Literal, SupportsFloat, SupportsIndex, get_args

from crl_gym.json_types import (
    EnvInfo,
    ExperienceRefDict,
    GrammarSpec,
    JSONInput,
    JSONValue,
    OpDict,
    RequestDict,
    SampleDict,
    SearchCallDict,
    StepDict,
    TrajectoryDict,
    TurnGuidanceDict,
)

Condition = Literal["guided", "free"]
"""How an episode ran: with a retrieved entry in its context (guided) or without (free)."""
GUIDED_CONDITION: Final[Condition] = "guided"
FREE_CONDITION: Final[Condition] = "free"
CONDITIONS: tuple[Condition, ...] = get_args(Condition)
STEP_KINDS: tuple[str, ...] = ("env", "search_and_ask")
UINT64_MAX = 2**64 - 1


# ---------------------------------------------------------------------------------------------
# Field checks. Every message names the field, so a bad request from another process (HTTP, a
# spill file) says what is wrong with it. They run at the boundaries only (``from_dict``, the
# construction of a request, an entry reference or an extractor sample), never per env step.
# ---------------------------------------------------------------------------------------------


def finite_float(value: object, what: str) -> float:
    """``value`` as a finite ``float``; NaN, ±inf, text and ``None`` raise ``ValueError``
    naming ``what``.

    Text is refused although ``float("1.5")`` would read it: ``float("nan")`` reads too.

    >>> finite_float(1, "outcome")
    1.0
    >>> finite_float(float("nan"), "outcome")
    Traceback (most recent call last):
    ...
    ValueError: outcome must be a finite number, got nan
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, (SupportsFloat, SupportsIndex)):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a finite number, got {value!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"{what} must be a finite number, got {x!r}")
    return x


def check_int(value: object, what: str, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an ``int`` (numpy integers too; bools, floats and text refused), in
    ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    i = int(value.__index__())
    if (low is not None and i < low) or (high is not None and i > high):
        bound = (
            f"in [{low}, {high}]"
            if low is not None and high is not None
            else f">= {low}"
            if low is not None
            else f"<= {high}"
        )
        raise ValueError(f"{what} must be {bound}, got {i}")
    return i


def check_flag(value: object, what: str) -> bool:
    """``value`` as a ``bool``: ``True``/``False``, 0/1 or a numpy bool; anything else
    is refused."""
    if isinstance(value, bool):
        return value
    if getattr(getattr(value, "dtype", None), "kind", None) == "b" or (
        not isinstance(value, float) and hasattr(value, "__index__") and value in (0, 1)
    ):
        return bool(value)
    raise ValueError(f"{what} must be true or false, got {value!r}")


def check_str(value: object, what: str) -> str:
    """``value`` if it is a ``str``; ``None``, numbers and other objects are refused."""
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, got {type(value).__name__} {value!r:.80}")
    return value


def _mapping(d: object, what: str) -> JSONInput:
    if not isinstance(d, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(d).__name__}")
    return d


def _list(value: object, what: str) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{what} must be a list, got {type(value).__name__}")
    return list(value)


def _required(d: JSONInput, key: str, what: str) -> object:
    if key not in d:
        raise ValueError(f"{what}.{key} is missing" if what else f"{key} is missing")
    return d[key]


def _grammar(value: object, what: str) -> GrammarSpec | None:
    """An :class:`ExtractorSample`'s ``grammar`` (None, or ``schema`` text with its
    reasoning rule)."""
    if value is None:
        return None
    d = _mapping(value, what)
    end = d.get("reasoning_end")
    return {
        "schema": check_str(d.get("schema"), _named(what, "schema")),
        "think_tokens": check_int(d.get("think_tokens", 0), _named(what, "think_tokens"), low=0),
        "reasoning_end": None
        if end is None
        else check_int(end, _named(what, "reasoning_end"), low=0),
    }


def _named(what: str, key: str) -> str:
    return f"{what}.{key}" if what else key


def _jsonable(value: object) -> JSONValue:
    """Best-effort conversion of info values (numpy scalars, arrays, sets) to JSON types."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        listed: JSONValue = value.tolist()
        return listed
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

    def __post_init__(self) -> None:
        # isinstance first: the common, valid reference costs three type checks
        if not (type(self.id) is int and 0 <= self.id <= UINT64_MAX):
            object.__setattr__(
                self, "id", check_int(self.id, "experience.id", low=0, high=UINT64_MAX)
            )
        if type(self.text) is not str:
            check_str(self.text, "experience.text")
        if not (type(self.version) is int and self.version >= 0):
            object.__setattr__(
                self, "version", check_int(self.version, "experience.version", low=0)
            )

    def to_dict(self) -> ExperienceRefDict:
        return {"id": self.id, "text": self.text, "version": self.version}

    @classmethod
    def from_dict(cls, d: object, what: str = "experience") -> ExperienceRef | None:
        """Inverse of :meth:`to_dict` (``None`` stays ``None``); a bad field raises
        ``ValueError`` naming it."""
        if d is None:
            return None
        d = _mapping(d, what)
        return cls(
            id=check_int(_required(d, "id", what), f"{what}.id", low=0, high=UINT64_MAX),
            text=check_str(_required(d, "text", what), f"{what}.text"),
            version=check_int(d.get("version", 0), f"{what}.version", low=0),
        )


@dataclass(frozen=True)
class TurnGuidance:
    """An entry shown to the actor before one turn (per-turn retrieval), for the entry's credit."""

    turn: int
    """Env steps taken before the observation the entry was shown with (0: the first one)."""
    entry: ExperienceRef

    def to_dict(self) -> TurnGuidanceDict:
        return {"turn": self.turn, "entry": self.entry.to_dict()}

    @classmethod
    def from_dict(cls, d: object, what: str = "turn_experience") -> TurnGuidance:
        """Inverse of :meth:`to_dict`; a bad field raises ``ValueError`` naming it."""
        d = _mapping(d, what)
        entry = ExperienceRef.from_dict(
            _mapping(_required(d, "entry", what), f"{what}.entry"), f"{what}.entry"
        )
        assert entry is not None
        return cls(turn=check_int(_required(d, "turn", what), f"{what}.turn", low=0), entry=entry)


@dataclass
class Step:
    """One turn of an episode: what the agent saw, what it did, what came back."""

    observation: str
    """The observation the action was taken on."""
    action: str
    """The agent's raw action text."""
    reward: float = 0.0
    """Reward returned by the env for this action (0 for a search_and_ask turn)."""
    info: EnvInfo = field(default_factory=dict)
    """The env's info dict after the action (kept as a reference while recording)."""
    kind: Literal["env", "search_and_ask"] = "env"
    """``search_and_ask`` when the wrapper intercepted the action and the env was not stepped."""

    def to_dict(self) -> StepDict:
        return {
            "observation": self.observation,
            "action": self.action,
            "reward": float(self.reward),
            "info": _jsonable(self.info),
            "kind": self.kind,
        }

    @classmethod
    def from_dict(cls, d: object, what: str = "step") -> Step:
        """Inverse of :meth:`to_dict`; a bad field raises ``ValueError`` naming it
        (``steps[3].reward``).

        Construction is not checked (the rollout loop builds one per turn); the request's
        ``outcome``, their sum, is, at the episode's end.
        """
        d = _mapping(d, what)
        kind = d.get("kind", "env")
        if kind not in STEP_KINDS:
            raise ValueError(f"{what}.kind must be one of {STEP_KINDS}, got {kind!r}")
        info = d.get("info") or {}
        return cls(
            observation=check_str(_required(d, "observation", what), f"{what}.observation"),
            action=check_str(_required(d, "action", what), f"{what}.action"),
            reward=finite_float(d.get("reward", 0.0), f"{what}.reward"),
            info=dict(_mapping(info, f"{what}.info")),
            kind="search_and_ask" if kind == "search_and_ask" else "env",
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
    provenance: JSONInput | None = None
    """Extractor sample that produced the refinement: prompt, response, logprobs, version (its
    :class:`~crl_gym.json_types.SampleDict` form, checked by :meth:`ExtractorSample.from_dict`)."""

    def to_dict(self) -> SearchCallDict:
        return {
            "query": self.query,
            "answer": self.answer,
            "entry": self.entry.to_dict() if self.entry else None,
            "turn": self.turn,
            "refined": self.refined,
            "provenance": _jsonable(self.provenance),
        }

    @classmethod
    def from_dict(cls, d: object, what: str = "search_call") -> SearchCall:
        """Inverse of :meth:`to_dict`; a bad field (a NaN log-prob of the provenance too)
        names itself."""
        d = _mapping(d, what)
        provenance = d.get("provenance")
        if provenance is not None:
            # the refinement's sample is trained on (CISPO) when the call is credited: check it now
            provenance = dict(_mapping(provenance, f"{what}.provenance"))
            ExtractorSample.from_dict(provenance, f"{what}.provenance")
        return cls(
            query=check_str(_required(d, "query", what), f"{what}.query"),
            answer=check_str(_required(d, "answer", what), f"{what}.answer"),
            entry=ExperienceRef.from_dict(d.get("entry"), f"{what}.entry"),
            turn=check_int(d.get("turn", 0), f"{what}.turn", low=0),
            refined=check_flag(d.get("refined", False), f"{what}.refined"),
            provenance=provenance,
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

    def to_dict(self) -> TrajectoryDict:
        return {
            "steps": [s.to_dict() for s in self.steps],
            "initial_observation": self.initial_observation,
            "search_calls": [c.to_dict() for c in self.search_calls],
        }

    @classmethod
    def from_dict(cls, d: object, what: str = "trajectory") -> Trajectory:
        """Inverse of :meth:`to_dict`; a bad step or call names its index
        (``trajectory.steps[2].reward``)."""
        d = _mapping(d, what)
        steps = _list(d.get("steps", []), f"{what}.steps")
        calls = _list(d.get("search_calls", []), f"{what}.search_calls")
        return cls(
            steps=[Step.from_dict(s, f"{what}.steps[{i}]") for i, s in enumerate(steps)],
            initial_observation=check_str(
                d.get("initial_observation", ""), f"{what}.initial_observation"
            ),
            search_calls=[
                SearchCall.from_dict(c, f"{what}.search_calls[{i}]") for i, c in enumerate(calls)
            ],
        )


GROUP_COPY = "group_copy"
"""``DistillationRequest.meta`` key: the episode's place in its rollout group (0 .. group size
− 1)."""
GROUP_SIZE = "group_size"
"""``DistillationRequest.meta`` key: the size of its rollout group. With :data:`GROUP_COPY`, what a
per-group distillation rule needs (``experience.distill_per_group``); a loop that omits them gets
the per-request rule."""


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
    condition: Condition = FREE_CONDITION
    """``guided`` or ``free``: the subgroup of the rollout group."""
    env_id: str = ""
    seed: int | None = None
    rollout_step: int | None = None
    """Actor step during which the episode ran (set by the trainer; used to credit entries)."""
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    meta: dict[str, Any] = field(default_factory=dict)
    turn_experience: list[TurnGuidance] = field(default_factory=list)
    """Entries shown before single turns (per-turn retrieval), besides ``experience``; each entry
    is credited once per episode, however many turns it guided (:func:`guiding_entries`)."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Refuse a request that must never reach the extractor: a non-finite ``outcome`` (a NaN
        reward makes it NaN), a wrong type, an unknown condition. ``ValueError`` names the field.

        Run at construction (and by ``from_record`` at each episode's end), not per step.
        """
        if self.condition not in CONDITIONS:
            raise ValueError(f"condition must be one of {CONDITIONS}, got {self.condition!r}")
        if not (type(self.outcome) is float and math.isfinite(self.outcome)):
            self.outcome = finite_float(self.outcome, "outcome")
        if type(self.success) is not bool:
            self.success = check_flag(self.success, "success")
        check_str(self.task, "task")
        check_str(self.env_id, "env_id")
        if self.experience is not None and not isinstance(self.experience, ExperienceRef):
            raise ValueError(
                f"experience must be an ExperienceRef or None, got {type(self.experience).__name__}"
            )
        if self.seed is not None and type(self.seed) is not int:
            self.seed = check_int(self.seed, "seed")
        if self.rollout_step is not None and type(self.rollout_step) is not int:
            self.rollout_step = check_int(self.rollout_step, "rollout_step")
        if not isinstance(self.meta, dict):
            raise ValueError(f"meta must be a mapping, got {type(self.meta).__name__}")
        if self.turn_experience and not all(
            isinstance(g, TurnGuidance) for g in self.turn_experience
        ):
            raise ValueError("turn_experience must be a list of TurnGuidance")

    def to_dict(self) -> RequestDict:
        return self._to_dict_with(self.trajectory.to_dict())

    def _to_dict_with(self, trajectory: TrajectoryDict) -> RequestDict:
        """The JSON dict of this request around an already serialised ``trajectory``."""
        out: RequestDict = {
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
        if (
            self.turn_experience
        ):  # only then: the requests of episode-level retrieval keep their form
            out["turn_experience"] = [g.to_dict() for g in self.turn_experience]
        return out

    @classmethod
    def from_dict(cls, d: JSONInput) -> DistillationRequest:
        """Inverse of :meth:`to_dict`. A missing, malformed or non-finite field raises
        ``ValueError`` naming it (``outcome``, ``trajectory.steps[3].reward``,
        ``experience.id``)."""
        d = _mapping(d, "request")
        seed, step, rid = d.get("seed"), d.get("rollout_step"), d.get("request_id")
        condition = d.get("condition", FREE_CONDITION)
        if condition not in CONDITIONS:
            raise ValueError(f"condition must be one of {CONDITIONS}, got {condition!r}")
        return cls(
            task=check_str(_required(d, "task", ""), "task"),
            trajectory=Trajectory.from_dict(_required(d, "trajectory", "")),
            outcome=finite_float(_required(d, "outcome", ""), "outcome"),
            success=check_flag(_required(d, "success", ""), "success"),
            experience=ExperienceRef.from_dict(d.get("experience")),
            condition="guided" if condition == "guided" else "free",
            env_id=check_str(d.get("env_id", ""), "env_id"),
            seed=None if seed is None else check_int(seed, "seed"),
            rollout_step=None if step is None else check_int(step, "rollout_step"),
            request_id=check_str(rid, "request_id") if rid else uuid.uuid4().hex,
            meta=dict(_mapping(d.get("meta") or {}, "meta")),
            turn_experience=[
                TurnGuidance.from_dict(g, f"turn_experience[{i}]")
                for i, g in enumerate(_list(d.get("turn_experience") or [], "turn_experience"))
            ],
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_json(cls, s: str) -> DistillationRequest:
        return cls.from_dict(json.loads(s))


def guiding_entries(request: DistillationRequest) -> list[ExperienceRef]:
    """Every distinct entry that guided the episode, each once: its episode entry, then the entries
    of its turns in turn order (an entry shown at many turns, or at the start and at a turn, counts
    once: an entry is credited once per episode it guided)."""
    out: dict[int, ExperienceRef] = {}
    if request.experience is not None:
        out[request.experience.id] = request.experience
    for g in request.turn_experience:
        out.setdefault(g.entry.id, g.entry)
    return list(out.values())


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


def op_to_dict(op: ExperienceOp) -> OpDict:
    if isinstance(op, AddOp):
        return {"text": op.text, "tags": list(op.tags), "kind": op.kind}
    if isinstance(op, UpdateOp):
        return {"id": op.id, "text": op.text, "kind": op.kind}
    if isinstance(op, DeleteOp):
        return {"id": op.id, "kind": op.kind}
    return {"reason": op.reason, "malformed": op.malformed, "kind": op.kind}


def _op_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    return int(value)


def op_from_dict(d: JSONInput) -> ExperienceOp:
    """Inverse of :func:`op_to_dict`; an unknown ``kind`` raises ``ValueError``."""
    kind = d.get("kind")
    if kind == "add":
        tags = _list(d.get("tags", ()), "tags")
        return AddOp(text=str(d["text"]), tags=tuple(str(t) for t in tags))
    if kind == "update":
        return UpdateOp(id=_op_int(d["id"], "id"), text=str(d["text"]))
    if kind == "delete":
        return DeleteOp(id=_op_int(d["id"], "id"))
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
    grammar: GrammarSpec | None = None
    """The JSON grammar ``response`` was drawn under (``schema`` as JSON text, ``think_tokens``,
    ``reasoning_end``): its masks are replayed when CISPO trains on the sample, in whatever process
    and after whatever restart. None: drawn without one."""

    def __post_init__(self) -> None:
        # CISPO's ratio is exp(new - old): one NaN or inf log-prob would poison a whole update
        if not all(map(math.isfinite, self.logprobs)):
            bad = next(i for i, x in enumerate(self.logprobs) if not math.isfinite(x))
            raise ValueError(f"logprobs[{bad}] must be a finite number, got {self.logprobs[bad]!r}")
        if self.token_ids and self.logprobs and len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"logprobs has {len(self.logprobs)} values for {len(self.token_ids)} token_ids"
            )

    def to_dict(self) -> SampleDict:
        return {
            "prompt": self.prompt,
            "response": self.response,
            "logprobs": list(self.logprobs),
            "token_ids": list(self.token_ids),
            "prompt_token_ids": list(self.prompt_token_ids),
            "extractor_version": self.extractor_version,
            "grammar": None if self.grammar is None else GrammarSpec(**self.grammar),
        }

    @classmethod
    def from_dict(cls, d: JSONInput | None, what: str = "provenance") -> ExtractorSample | None:
        """Inverse of :meth:`to_dict` (empty or ``None`` → ``None``); a bad field raises
        ``ValueError`` naming it (``provenance.logprobs[4]``)."""
        if not d:
            return None
        d = _mapping(d, what)
        return cls(
            prompt=check_str(d.get("prompt", ""), _named(what, "prompt")),
            response=check_str(d.get("response", ""), _named(what, "response")),
            logprobs=[
                finite_float(x, f"{_named(what, 'logprobs')}[{i}]")
                for i, x in enumerate(_list(d.get("logprobs", []), _named(what, "logprobs")))
            ],
            token_ids=[
                check_int(x, f"{_named(what, 'token_ids')}[{i}]", low=0)
                for i, x in enumerate(_list(d.get("token_ids", []), _named(what, "token_ids")))
            ],
            prompt_token_ids=[
                check_int(x, f"{_named(what, 'prompt_token_ids')}[{i}]", low=0)
                for i, x in enumerate(
                    _list(d.get("prompt_token_ids", []), _named(what, "prompt_token_ids"))
                )
            ],
            extractor_version=check_int(
                d.get("extractor_version", 0), _named(what, "extractor_version"), low=0
            ),
            grammar=_grammar(d.get("grammar"), _named(what, "grammar")),
        )
