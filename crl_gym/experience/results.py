"""What the experience service answers, typed: :class:`StepEnded` (``end_step``),
:class:`OpsApplied` (``apply_ops``), :class:`ServiceStats` (``stats``) and
:class:`Health` (``health``).

Every face returns these objects (in process, HTTP, Ray). ``to_dict()`` is the JSON form the HTTP
server sends and the Ray actor hands back; ``from_dict(d)`` parses it on the client side and raises
``ValueError`` naming the field for an answer it cannot read (a server of another version).

>>> StepEnded(step=3, ended=[2, 3], requests=5, credited=4).to_dict()
{'step': 3, 'ended': [2, 3], 'requests': 5, 'credited': 4}
>>> StepEnded.from_dict({'step': 3, 'ended': [3], 'requests': 0, 'credited': 0}).ended
[3]
>>> s = ServiceStats(bank_size=2, queue_depth=0, last_ended_step=-1, counters={"pruned": 1})
>>> s.get("bank_size"), s.get("pruned"), s.get("unknown"), s.get("unknown", 0)
(2, 1, None, 0)

Each also has the read-only mapping face of its JSON form, so code written against the dict
answers of earlier releases keeps working (the attributes are the typed way):

>>> s["queue_depth"], "pruned" in s, Health(pending=3)["pending"]
(0, True, 3)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Literal, TypeVar, get_args

from crl_gym.json_types import FlushReport
from crl_gym.json_types import JSONValue as JSONValue  # its old home

ExtractorStatus = Literal["alive", "gone"]
"""The extractor's process as the service sees it (``None`` in an answer: no extractor attached)."""

Figure = int | float | str | bool | None
"""One value of :attr:`ServiceStats.counters` (a count, a mean, the last error's text)."""


T = TypeVar("T")


def _read(
    d: Mapping[str, object],
    key: str,
    kind: type[T] | tuple[type, ...],
    what: str,
    *,
    optional: bool = False,
) -> T:
    """``d[key]`` checked to be of ``kind`` (``None`` allowed when ``optional``)."""
    if key not in d:
        if optional:
            return None  # type: ignore[return-value]
        raise ValueError(f"{what}: the answer has no {key!r}")
    value = d[key]
    if value is None and optional:
        return None  # type: ignore[return-value]
    if isinstance(value, bool) and kind in (int, float) or not isinstance(value, kind):
        raise ValueError(
            f"{what}: {key!r} must be {getattr(kind, '__name__', kind)}, got {value!r}"
        )
    return value  # type: ignore[return-value]


def _ints(d: Mapping[str, object], key: str, what: str) -> list[int]:
    value = _read(d, key, list, what)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{what}: {key!r} must be a list of ints, got {value!r}")
    return list(value)


def _object(value: object, what: str) -> Mapping[str, object]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _status(value: object, what: str) -> ExtractorStatus | None:
    if value is None or value in get_args(ExtractorStatus):
        return value  # type: ignore[return-value]
    raise ValueError(
        f"{what}: 'extractor' must be one of {get_args(ExtractorStatus)} or null, got {value!r}"
    )


class MappingFace:
    """The read-only mapping face of a typed answer: its JSON form (:meth:`to_dict`) by key."""

    def to_dict(self) -> dict[str, JSONValue]:
        raise NotImplementedError

    def __getitem__(self, key: str) -> JSONValue:
        return self.to_dict()[key]

    def get(self, key: str, default: JSONValue = None) -> JSONValue:
        """``self[key]``, ``default`` when the answer has no such key."""
        return self.to_dict().get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self.to_dict()

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())

    def keys(self) -> list[str]:
        return list(self.to_dict())

    def items(self) -> list[tuple[str, JSONValue]]:
        return list(self.to_dict().items())

    def values(self) -> list[JSONValue]:
        return list(self.to_dict().values())


@dataclass(frozen=True)
class StepEnded(MappingFace):
    """``end_step(t)``: the steps it closed (``t`` and any earlier one still open), the requests
    they held and the credits the service made for them (0 without an extractor)."""

    step: int
    ended: list[int]
    requests: int
    credited: int
    workers: list[FlushReport] | None = None
    """Each env copy's flush report (``{"kept", "undelivered"}``) when the step was ended by
    :func:`crl_gym.wrappers.vector.end_step`; ``None`` otherwise."""

    def to_dict(self) -> dict[str, JSONValue]:
        out: dict[str, JSONValue] = {
            "step": self.step,
            "ended": list(self.ended),
            "requests": self.requests,
            "credited": self.credited,
        }
        if self.workers is not None:
            out["workers"] = [
                {"kept": w["kept"], "undelivered": w["undelivered"]} for w in self.workers
            ]
        return out

    @classmethod
    def from_dict(cls, d: object) -> StepEnded:
        what = "end_step"
        m = _object(d, what)
        return cls(
            step=_read(m, "step", int, what),
            ended=_ints(m, "ended", what),
            requests=_read(m, "requests", int, what),
            credited=_read(m, "credited", int, what),
        )


@dataclass(frozen=True)
class OpsApplied(MappingFace):
    """``apply_ops(ops)``: how many entries were added (and their ids), updated and deleted, the
    Return ops (no action) and the malformed ones."""

    added: int
    added_ids: list[int]
    updated: int
    deleted: int
    returned: int
    malformed: int
    repeated: bool = False
    """The call's write id had been applied already: this is that call's answer, nothing was
    applied again."""

    def to_dict(self) -> dict[str, JSONValue]:
        return {
            "added": self.added,
            "added_ids": list(self.added_ids),
            "updated": self.updated,
            "deleted": self.deleted,
            "returned": self.returned,
            "malformed": self.malformed,
            "repeated": self.repeated,
        }

    @classmethod
    def from_dict(cls, d: object) -> OpsApplied:
        what = "apply_ops"
        m = _object(d, what)
        return cls(
            added=_read(m, "added", int, what),
            added_ids=_ints(m, "added_ids", what),
            updated=_read(m, "updated", int, what),
            deleted=_read(m, "deleted", int, what),
            returned=_read(m, "returned", int, what),
            malformed=_read(m, "malformed", int, what),
            repeated=bool(m.get("repeated", False)),
        )


@dataclass(frozen=True)
class Health(MappingFace):
    """``health()``: cheap (no token needed over HTTP): ``status`` is ``"ok"`` whenever the
    service answers."""

    pending: int
    """Requests queued for distillation."""
    extractor: ExtractorStatus | None = None
    status: Literal["ok"] = "ok"
    storage: str | None = None
    """The storage fault writes meet now (``"disk full: …"``): they are refused until it clears;
    reads go on. ``None``: the last write to disk succeeded."""

    def to_dict(self) -> dict[str, JSONValue]:
        return {
            "status": self.status,
            "pending": self.pending,
            "extractor": self.extractor,
            "storage": self.storage,
        }

    @classmethod
    def from_dict(cls, d: object) -> Health:
        what = "health"
        m = _object(d, what)
        if m.get("status") != "ok":
            raise ValueError(f"{what}: 'status' must be 'ok', got {m.get('status')!r}")
        storage = m.get("storage")
        return cls(
            pending=_read(m, "pending", int, what),
            extractor=_status(m.get("extractor"), what),
            storage=None if storage is None else str(storage),
        )


STATS_FIELDS: tuple[str, ...] = (
    "bank_size",
    "queue_depth",
    "last_ended_step",
    "late_requests",
    "held_out_requests",
    "open_requests",
    "submitted",
    "steps_ended",
    "ops_applied",
    "extractor",
    "distilled",
    "credited",
    "extractor_updates",
    "merges",
)
"""The figures of :class:`ServiceStats` that are attributes (the rest are in its ``counters``)."""


@dataclass(frozen=True)
class ServiceStats(MappingFace):
    """``stats()``: the figures every service has as attributes; the others (with an extractor, the
    service's ``credits`` and ``pruned``; the extractor
    track's: ``distill_batches``, ``errors``, ``last_error``, …; ``extractor_loss``,
    ``extractor_reward``, ``buffer_size`` with an extractor) in :attr:`counters`, and the manager's
    own report in :attr:`manager`. :meth:`get` reads any of them by its JSON name (how a metrics
    column names the figure it shows); the JSON form is flat, as the names say."""

    bank_size: int
    queue_depth: int
    last_ended_step: int
    late_requests: int = 0
    """Requests that arrived after their step had ended (never credited)."""
    held_out_requests: int = 0
    open_requests: int = 0
    """Requests of steps not yet ended."""
    submitted: int = 0
    steps_ended: int = 0
    ops_applied: int = 0
    """``apply_ops`` calls from outside the service."""
    extractor: ExtractorStatus | None = None
    distilled: int = 0
    credited: int = 0
    extractor_updates: int = 0
    merges: int = 0
    counters: Mapping[str, Figure] = field(default_factory=dict)
    manager: Mapping[str, JSONValue] = field(default_factory=dict)

    @property
    def last_error(self) -> str:
        """The extractor track's last failure (type and message); empty when none."""
        value = self.counters.get("last_error")
        return value if isinstance(value, str) else ""

    # a figure, never the nested ``manager`` report (``stats["manager"]`` reads that): narrower than
    # the face's get
    def get(self, key: str, default: Figure = None) -> Figure:  # type: ignore[override]
        """The figure named ``key`` in the JSON form (``default`` when this service has no
        such figure)."""
        if key in STATS_FIELDS:
            value: Figure = getattr(self, key)
            return value
        return self.counters.get(key, default)

    def to_dict(self) -> dict[str, JSONValue]:
        out: dict[str, JSONValue] = {"manager": dict(self.manager)}
        out.update({k: getattr(self, k) for k in STATS_FIELDS})
        out.update(self.counters)
        return out

    @classmethod
    def from_dict(cls, d: object) -> ServiceStats:
        what = "stats"
        m = dict(_object(d, what))
        manager = _object(m.pop("manager", {}), f"{what}.manager")
        kw: dict[str, int] = {}
        for f in fields(cls):
            if f.name in STATS_FIELDS and f.name != "extractor" and f.name in m:
                kw[f.name] = _read(m, f.name, int, what)
        for key in ("bank_size", "queue_depth", "last_ended_step"):
            if key not in kw:
                raise ValueError(f"{what}: the answer has no {key!r}")
        status = _status(m.get("extractor"), what)
        counters: dict[str, Figure] = {}
        for k, v in m.items():
            if k in STATS_FIELDS:
                continue
            if not isinstance(v, (int, float, str, bool)) and v is not None:
                raise ValueError(
                    f"{what}: {k!r} must be a number, a text or null, got {type(v).__name__}"
                )
            counters[k] = v
        return cls(extractor=status, counters=counters, manager=dict(manager), **kw)  # type: ignore[arg-type]
