"""Turn an experience extractor's raw text into bank operations (Add / Update / Return).

The extractor (a thinking model) reasons first and then answers. ``parse_ops`` finds the answer
and accepts two forms:

* JSON: one op object or a list of them, bare, inside a ```json fence, or embedded in prose::

      [{"op": "add", "text": "Pick up the key before walking to the door.", "tags": ["keyroom"]},
       {"op": "update", "id": 17, "text": "..."},
       {"op": "return", "reason": "nothing new"}]

  ``{"ops": [...]}`` is accepted as a wrapper; ``operation`` / ``action`` / ``kind`` / ``type``
  name the op and ``content`` / ``experience`` / ``entry`` may hold the text. An update without
  ``id`` means the retrieved entry.
* Plain lines: ``ADD: text``, ``ADD [tag1, tag2]: text``, ``UPDATE 17: text``, ``UPDATE: text``
  (the retrieved entry), ``RETURN`` or ``RETURN: reason``. A text continues on the following
  lines until a blank line or the next op line.

Anything malformed becomes ``ReturnOp(reason=..., malformed=True)``: the reason is counted in a
:class:`ParseStats` and logged. ``parse_ops`` never raises. Finding the answer and reading its two
forms is :mod:`crl_gym.experience.op_forms`; this module validates the ops and counts failures.

**The action slot** (``experience.action_slot``): an add or update may carry ``"actions"``, a list
of the actions to play; its entry is then :func:`slot_text` — ``Play north, then south. <text>`` —
so a reader of the entry meets the chosen actions first. An ``actions`` value that is not a list of
1 … :data:`~crl_gym.experience.schemas.MAX_ACTION_SLOT` plain strings is a counted malformed op
(``bad_actions``); without the field an op reads as before.

Those forms are for unconstrained text (an API model, a user's own extractor). An answer written
under the grammar of :func:`crl_gym.experience.schemas.ops_schema` is read by
:func:`parse_structured_ops`: the JSON list and nothing else, no fallback form, the same
validation and the same counters (a malformed one — cut by the token budget, say — still counts).

Hardening, for any text: each op is validated on its own (a bad op becomes one counted Return and
never drops the other ops of its answer; ops past ``max_ops`` are dropped as one counted Return);
texts are cleaned of what the bank cannot store (:func:`clean_text`: lone surrogates from JSON
escapes, control characters); every regular expression applied to the output runs in linear time
and only the last :data:`MAX_INPUT_CHARS` characters are read.

>>> parse_ops('<think>the key was the trick</think>ADD: Grab the key first.')
[AddOp(text='Grab the key first.', tags=(), kind='add')]
>>> parse_ops('UPDATE: Go round the lava.', allowed_update_ids={7})
[UpdateOp(id=7, text='Go round the lava.', kind='update')]
>>> parse_ops('```json\\n{"op": "update", "id": 9, "text": "x"}\\n```', allowed_update_ids={7})
[ReturnOp(reason='update_id_not_allowed', malformed=True, kind='return')]
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import Counter
from collections.abc import Collection, Iterable

from crl_gym.experience.op_forms import (
    Malformed,
    find_json,
    looks_like_op,
    ops_from_json,
    ops_from_lines,
    strip_think,
)
from crl_gym.experience.schemas import MAX_ACTION_SLOT, MAX_SLOT_ACTION_CHARS

# find_json and strip_think are re-exported: callers import them from here.
from crl_gym.json_types import JSONDict
from crl_gym.protocol import AddOp, DeleteOp, ExperienceOp, ReturnOp, UpdateOp

logger = logging.getLogger(__name__)

UINT64_MAX = 2**64 - 1
DEFAULT_MAX_LEN = 2000
"""Longest accepted entry text (characters): longer ones are runaway generations, not advice."""
MAX_INPUT_CHARS = 200_000
"""Only the last this-many characters of an output are parsed (the answer comes last)."""

__all__ = [
    "DEFAULT_MAX_LEN",
    "MAX_INPUT_CHARS",
    "PARSE_STATS",
    "ParseStats",
    "clean_text",
    "find_json",
    "parse_ops",
    "parse_structured_ops",
    "slot_text",
    "strip_think",
]

_UNSTORABLE = re.compile("[\\ud800-\\udfff\\x00-\\x08\\x0b-\\x1f\\x7f-\\x9f]")
_ID = re.compile(r"#?\d{1,20}")


def clean_text(text: str) -> str:
    """``text`` without what cannot be stored or shown: lone surrogates (a JSON ``\\ud800`` escape
    decodes to one, and UTF-8 cannot encode it, so the bank's write would fail with the whole
    batch), NUL and the other control characters but newline and tab. Linear time.

    >>> clean_text("go\\ud800 east\\x00\\n")
    'go east\\n'
    """
    return _UNSTORABLE.sub("", text)


class ParseStats:
    """Thread-safe counters of parsed outputs, ops by kind and malformed outputs by reason.

    >>> s = ParseStats(); _ = parse_ops("RETURN", stats=s); _ = parse_ops("???", stats=s)
    >>> s.snapshot()["malformed_by_reason"]
    {'no_op_found': 1}
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outputs = 0
        self._ops: Counter[str] = Counter()
        self._reasons: Counter[str] = Counter()

    def record(self, ops: Iterable[ExperienceOp]) -> set[str]:
        """Count one parsed output; returns the malformed reasons seen for the first time."""
        new: set[str] = set()
        with self._lock:
            self._outputs += 1
            for op in ops:
                self._ops[op.kind] += 1
                if isinstance(op, ReturnOp) and op.malformed:
                    if self._reasons[op.reason] == 0:
                        new.add(op.reason)
                    self._reasons[op.reason] += 1
        return new

    @property
    def malformed(self) -> int:
        with self._lock:
            return sum(self._reasons.values())

    def snapshot(self) -> JSONDict:
        """Plain-dict copy: ``outputs``, ``ops_by_kind``, ``malformed``, ``malformed_by_reason``."""
        with self._lock:
            return {
                "outputs": self._outputs,
                "ops_by_kind": dict(self._ops),
                "malformed": sum(self._reasons.values()),
                "malformed_by_reason": dict(self._reasons),
            }

    def reset(self) -> None:
        with self._lock:
            self._outputs = 0
            self._ops.clear()
            self._reasons.clear()


PARSE_STATS = ParseStats()
"""Process-wide counters used when ``parse_ops`` gets no ``stats``."""


# --------------------------------------------------------------------------------------------
# Validation and the public entry point
# --------------------------------------------------------------------------------------------


def slot_text(actions: Iterable[str], text: str) -> str:
    """An entry of the action slot: the chosen actions first, in order, then the text.

    >>> slot_text(["north", "south"], "Task amber badger: the secret.")
    'Play north, then south. Task amber badger: the secret.'
    """
    return f"Play {', then '.join(actions)}. {text}"


def _slot_actions(value: object) -> list[str]:
    """The ``actions`` of a slot op: 1 … MAX_ACTION_SLOT non-empty plain strings, else
    ``bad_actions``."""
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_ACTION_SLOT:
        raise Malformed("bad_actions")
    out = [clean_text(a).strip() if isinstance(a, str) else "" for a in value]
    if not all(0 < len(a) <= MAX_SLOT_ACTION_CHARS for a in out):
        raise Malformed("bad_actions")
    return out


def _parse_id(value: object) -> int:
    if isinstance(value, bool):
        raise Malformed("bad_id")
    if isinstance(value, str) and _ID.fullmatch(value.strip()):
        value = int(value.strip().lstrip("#"))
    if not isinstance(value, int) or not 0 <= value <= UINT64_MAX:
        raise Malformed("bad_id")
    return value


def _finish(
    raw: JSONDict,
    *,
    allowed: Collection[int] | None,
    retrieved_id: int | None,
    allow_delete: bool,
    max_len: int,
) -> ExperienceOp:
    kind = raw["kind"]
    if kind == "return":
        reason = raw.get("reason")
        return ReturnOp(reason=clean_text(reason).strip()[:200] if isinstance(reason, str) else "")
    if kind == "delete":
        if not allow_delete:
            raise Malformed("delete_not_allowed")
        entry_id = _parse_id(raw.get("id"))
        if allowed is not None and entry_id not in allowed:
            raise Malformed("delete_id_not_allowed")
        return DeleteOp(id=entry_id)
    text = raw.get("text")
    text = clean_text(text).strip() if isinstance(text, str) else ""
    if not text:
        raise Malformed("empty_text")
    if len(text) > max_len:
        raise Malformed("text_too_long")
    if "actions" in raw:  # the action slot: max_len bounds the text, the actions come on top
        text = slot_text(_slot_actions(raw["actions"]), text)
    if kind == "add":
        raw_tags = raw.get("tags", ())
        tags = tuple(
            t
            for t in (
                clean_text(str(x)).strip()[:64]
                for x in (raw_tags if isinstance(raw_tags, list | tuple) else ())
            )
            if t
        )
        return AddOp(text=text, tags=tags[:16])
    raw_id = raw.get("id")
    if raw_id is None or (isinstance(raw_id, str) and not raw_id.strip()):
        if retrieved_id is None:
            raise Malformed("update_without_target")
        entry_id = retrieved_id
    else:
        entry_id = _parse_id(raw_id)
    if allowed is not None and entry_id not in allowed:
        raise Malformed("update_id_not_allowed")
    return UpdateOp(id=entry_id, text=text)


def _parse(
    text: object,
    *,
    allowed: Collection[int] | None,
    retrieved_id: int | None,
    allow_delete: bool,
    max_len: int,
    max_ops: int,
) -> list[ExperienceOp]:
    if not isinstance(text, str):
        raise Malformed("not_text")
    if not text.strip():
        raise Malformed("empty_output")
    answer, ok = strip_think(text[-MAX_INPUT_CHARS:])
    if not ok:
        raise Malformed("unclosed_think")
    if not answer.strip():
        raise Malformed("empty_answer")
    value = find_json(answer, looks_like_op)
    raws: list[JSONDict | Malformed] = [] if value is None else ops_from_json(value)
    if all(isinstance(r, Malformed) for r in raws):
        # e.g. "ADD: send {"type": "x"}": the JSON was part of a line-form text, not the answer
        raws = list(ops_from_lines(answer)) or raws
    if not raws:
        raise Malformed("no_op_found")
    return _validate(
        raws,
        allowed=allowed,
        retrieved_id=retrieved_id,
        allow_delete=allow_delete,
        max_len=max_len,
        max_ops=max_ops,
    )


def _validate(
    raws: list[JSONDict | Malformed],
    *,
    allowed: Collection[int] | None,
    retrieved_id: int | None,
    allow_delete: bool,
    max_len: int,
    max_ops: int,
) -> list[ExperienceOp]:
    """Each raw op on its own: a bad one is one counted Return, never the loss of the others."""
    ops: list[ExperienceOp] = []
    updated: set[int] = set()
    for raw in raws[:max_ops]:
        try:
            if isinstance(raw, Malformed):
                raise raw
            op = _finish(
                raw,
                allowed=allowed,
                retrieved_id=retrieved_id,
                allow_delete=allow_delete,
                max_len=max_len,
            )
            if isinstance(op, UpdateOp | DeleteOp):
                if op.id in updated:  # two edits of one entry in one answer: ambiguous
                    raise Malformed("duplicate_target")
                updated.add(op.id)
            ops.append(op)
        except Malformed as err:
            ops.append(ReturnOp(reason=err.reason, malformed=True))
        except Exception as err:  # noqa: BLE001 - a validator bug costs this op only
            logger.exception("parse_ops: internal error on one op")
            ops.append(ReturnOp(reason=f"parser_error:{type(err).__name__}", malformed=True))
    if len(raws) > max_ops:  # the ops past the limit, as one counted Return
        ops.append(ReturnOp(reason="too_many_ops", malformed=True))
    return ops


def _structured(
    text: object, *, allowed: Collection[int] | None, max_len: int, max_ops: int
) -> list[ExperienceOp]:
    if not isinstance(text, str):
        raise Malformed("not_text")
    if not text.strip():
        raise Malformed("empty_output")  # e.g. cut by the token budget (the generator blanks it)
    answer, ok = strip_think(text[-MAX_INPUT_CHARS:])
    if not ok:
        raise Malformed("unclosed_think")
    try:
        value = json.loads(answer)
    except (ValueError, RecursionError) as err:
        raise Malformed("not_the_schema") from err
    if not isinstance(value, list) or not value:
        raise Malformed("not_the_schema")
    raws: list[JSONDict | Malformed] = []
    for item in value:
        kind = item.get("op") if isinstance(item, dict) else None
        if kind not in ("add", "update", "return"):
            raws.append(Malformed("not_the_schema"))
            continue
        raws.append(
            {
                "kind": kind,
                "text": item.get("text"),
                "id": item.get("id"),
                "tags": [],
                "reason": item.get("reason", ""),
                **({"actions": item["actions"]} if "actions" in item else {}),
            }
        )
    return _validate(
        raws,
        allowed=allowed,
        retrieved_id=None,
        allow_delete=False,
        max_len=max_len,
        max_ops=max_ops,
    )


def parse_ops(
    text: str,
    *,
    allowed_update_ids: Collection[int] | None = None,
    retrieved_id: int | None = None,
    allow_delete: bool = False,
    max_len: int = DEFAULT_MAX_LEN,
    max_ops: int = 16,
    stats: ParseStats | None = None,
) -> list[ExperienceOp]:
    """Parse an extractor output into ops; never raises.

    Args:
        text: the raw generation (reasoning included).
        allowed_update_ids: ids an Update may target (the retrieved entry ``m`` for a guided
            episode, the empty set for a free one); ``None`` accepts any id.
        retrieved_id: the entry an Update without an id means; defaults to the only element of
            ``allowed_update_ids`` when it has exactly one.
        allow_delete: accept Delete ops (Merge only; per-episode distillation never deletes).
        max_len: longest accepted entry text, in characters.
        max_ops: most ops read from one answer; the first ``max_ops`` are kept and those past it
            are dropped as one counted ``ReturnOp(reason="too_many_ops", malformed=True)``.
        stats: counters to update (default: the process-wide :data:`PARSE_STATS`).

    Returns:
        The ops in answer order. Each malformed op is replaced by
        ``ReturnOp(reason, malformed=True)``; an unparsable answer gives exactly one of those.

    >>> parse_ops("ADD: a\\nADD: b\\nADD: c", max_ops=2,
    ...           stats=ParseStats())  # doctest: +NORMALIZE_WHITESPACE
    [AddOp(text='a', tags=(), kind='add'), AddOp(text='b', tags=(), kind='add'),
     ReturnOp(reason='too_many_ops', malformed=True, kind='return')]
    """
    allowed = None if allowed_update_ids is None else frozenset(allowed_update_ids)
    if retrieved_id is None and allowed is not None and len(allowed) == 1:
        retrieved_id = next(iter(allowed))
    try:
        ops = _parse(
            text,
            allowed=allowed,
            retrieved_id=retrieved_id,
            allow_delete=allow_delete,
            max_len=max_len,
            max_ops=max_ops,
        )
    except Malformed as err:
        ops = [ReturnOp(reason=err.reason, malformed=True)]
    except Exception as err:  # a parser bug must not take the trainer down: count it instead
        logger.exception("parse_ops: internal error")
        ops = [ReturnOp(reason=f"parser_error:{type(err).__name__}", malformed=True)]
    return _count(ops, text, stats)


def parse_structured_ops(
    text: str,
    *,
    allowed_update_ids: Collection[int] | None = None,
    max_len: int = DEFAULT_MAX_LEN,
    max_ops: int = 16,
    stats: ParseStats | None = None,
) -> list[ExperienceOp]:
    """Read an answer generated under :func:`~crl_gym.experience.schemas.ops_schema`; never raises.

    Only the schema's form is read (after a thinking model's reasoning): a compact JSON list of
    ``{"op": "add", "text"}`` / ``{"op": "update", "id", "text"}`` / ``{"op": "return",
    "reason"}``, an add or update with ``"actions"`` before its text under an action slot. The
    grammar makes every such answer valid; the validation is still the one of :func:`parse_ops`, so
    an answer that is not (cut short, or from a model run without the grammar) is a counted
    malformed Return.

    >>> parse_structured_ops('[{"op":"update","id":7,"text":"Go round."}]', allowed_update_ids={7})
    [UpdateOp(id=7, text='Go round.', kind='update')]
    >>> parse_structured_ops('ADD: Go round.', stats=ParseStats())
    [ReturnOp(reason='not_the_schema', malformed=True, kind='return')]
    >>> parse_structured_ops('[{"op":"add","actions":["east"],"text":"Go round."}]',
    ...                      stats=ParseStats())
    [AddOp(text='Play east. Go round.', tags=(), kind='add')]
    """
    allowed = None if allowed_update_ids is None else frozenset(allowed_update_ids)
    try:
        ops = _structured(text, allowed=allowed, max_len=max_len, max_ops=max_ops)
    except Malformed as err:
        ops = [ReturnOp(reason=err.reason, malformed=True)]
    except Exception as err:  # noqa: BLE001 - a parser bug must not take the trainer down
        logger.exception("parse_structured_ops: internal error")
        ops = [ReturnOp(reason=f"parser_error:{type(err).__name__}", malformed=True)]
    return _count(ops, text, stats)


def _count(ops: list[ExperienceOp], text: object, stats: ParseStats | None) -> list[ExperienceOp]:
    counters = stats if stats is not None else PARSE_STATS
    first_seen = counters.record(ops)
    for op in ops:
        if isinstance(op, ReturnOp) and op.malformed:
            # The first occurrence of a reason is a warning; repeats go to debug so a young
            # extractor that is malformed half the time does not flood the log.
            level = logging.WARNING if op.reason in first_seen else logging.DEBUG
            excerpt = text[-160:] if isinstance(text, str) else repr(type(text))
            logger.log(level, "malformed extractor output (%s): %r", op.reason, excerpt)
    return ops
