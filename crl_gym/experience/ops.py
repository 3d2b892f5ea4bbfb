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
:class:`ParseStats` and logged. ``parse_ops`` never raises.

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
from collections.abc import Callable, Collection, Iterable
from typing import Any

from crl_gym.protocol import AddOp, DeleteOp, ExperienceOp, ReturnOp, UpdateOp

logger = logging.getLogger(__name__)

UINT64_MAX = 2**64 - 1
DEFAULT_MAX_LEN = 2000
"""Longest accepted entry text (characters): longer ones are runaway generations, not advice."""
MAX_INPUT_CHARS = 200_000
"""Only the last this-many characters of an output are parsed (the answer comes last)."""
_MAX_JSON_STARTS = 400
"""Cap on embedded-JSON decode attempts, so brace-heavy prose stays linear-ish."""

_OP_KEYS = ("op", "operation", "action", "kind", "type")
_TEXT_KEYS = ("text", "content", "experience", "entry")
_LIST_KEYS = ("ops", "operations", "actions")
_OP_NAMES = {"add": "add", "update": "update", "return": "return", "delete": "delete",
             "none": "return", "noop": "return", "no_op": "return", "skip": "return"}


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

    def snapshot(self) -> dict[str, Any]:
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


class _Malformed(Exception):
    """Internal: one op (or the whole output) could not be understood."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def strip_think(text: str) -> tuple[str, bool]:
    """Drop the reasoning preamble; returns ``(answer, ok)``.

    Qwen3-Thinking chat templates put ``<think>`` in the prompt, so outputs often carry only the
    closing tag: everything up to the last ``</think>`` is reasoning. An opened but never closed
    block means the generation was cut off while thinking: its text is not an answer (an op
    mentioned mid-thought is a draft), so only what precedes ``<think>`` is kept and ``ok`` is
    False when that is empty.

    >>> strip_think("<think>hmm</think> ADD: x")
    (' ADD: x', True)
    >>> strip_think("hmm, the template opened it</think>RETURN")
    ('RETURN', True)
    >>> strip_think("<think>ran out of tok")
    ('', False)
    """
    low = text.lower()
    close = low.rfind("</think>")
    if close >= 0:
        return text[close + len("</think>"):], True
    opened = low.find("<think>")
    if opened >= 0:
        head = text[:opened]
        return head, bool(head.strip())
    return text, True


# --------------------------------------------------------------------------------------------
# JSON form
# --------------------------------------------------------------------------------------------

# Info string limited to one word: a greedy "[^\n]*" here made runs of backticks quadratic.
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\r?\n(.*?)```", re.DOTALL)


def _looks_like_op(value: Any) -> bool:
    if isinstance(value, dict):
        if any(k in value for k in _LIST_KEYS) and isinstance(
            next(value[k] for k in _LIST_KEYS if k in value), list
        ):
            return True
        if any(isinstance(value.get(k), str) for k in _OP_KEYS):
            return True
        # single-key shorthand {"add": "text"} / {"update": {...}} / {"return": ...}
        return len(value) == 1 and str(next(iter(value))).lower() in _OP_NAMES
    if isinstance(value, list):
        return any(isinstance(v, dict) and _looks_like_op(v) for v in value)
    return False


def find_json(text: str, accept: Callable[[Any], bool]) -> Any | None:
    """The answer's JSON value that ``accept`` likes, or None.

    Looks in ```fenced blocks first (the last one wins), then at the whole text, then at JSON
    embedded in prose (decoded at each ``{`` / ``[``; the last accepted value wins because
    models restate their final answer at the end).

    >>> find_json('so: {"a": 1} and then {"a": 2}.', lambda v: isinstance(v, dict))
    {'a': 2}
    """
    for m in reversed(list(_FENCE.finditer(text))):
        try:
            value = json.loads(m.group(2))
        except (ValueError, RecursionError):
            continue
        if accept(value):
            return value
    try:
        value = json.loads(text.strip())
        if accept(value):
            return value
    except (ValueError, RecursionError):
        pass
    decoder = json.JSONDecoder()
    found: Any = None
    pos, attempts = 0, 0
    while attempts < _MAX_JSON_STARTS:
        starts = [i for i in (text.find("{", pos), text.find("[", pos)) if i >= 0]
        if not starts:
            break
        start = min(starts)
        attempts += 1
        try:
            value, end = decoder.raw_decode(text, start)
        except (ValueError, RecursionError):
            pos = start + 1
            continue
        if accept(value):
            found, pos = value, end  # skip the decoded span: its inner objects are parts of it
        else:
            pos = start + 1
    return found


def _op_name(d: dict[str, Any]) -> str:
    for key in _OP_KEYS:
        if isinstance(d.get(key), str):
            name = d[key].strip().lower()
            if name in _OP_NAMES:
                return _OP_NAMES[name]
            raise _Malformed("unknown_op")
    if len(d) == 1:
        key = str(next(iter(d))).lower()
        if key in _OP_NAMES:
            return _OP_NAMES[key]
    raise _Malformed("unknown_op")


def _parse_id(value: Any) -> int:
    if isinstance(value, bool):
        raise _Malformed("bad_id")
    if isinstance(value, str) and re.fullmatch(r"\s*#?\d{1,20}\s*", value):
        value = int(value.strip().lstrip("#"))
    if not isinstance(value, int) or not 0 <= value <= UINT64_MAX:
        raise _Malformed("bad_id")
    return value


def _text_of(d: dict[str, Any]) -> Any:
    for key in _TEXT_KEYS:
        if key in d:
            return d[key]
    return None


def _ops_from_json(value: Any) -> list[dict[str, Any] | _Malformed]:
    """Normalise a JSON value to raw op dicts: ``{"kind", "text", "id", "tags", "reason"}``."""
    if isinstance(value, dict):
        for key in _LIST_KEYS:
            if isinstance(value.get(key), list):
                return _ops_from_json(value[key])
        items: list[Any] = [value]
    else:
        items = list(value)
    out: list[dict[str, Any] | _Malformed] = []
    for item in items:
        if not isinstance(item, dict):
            out.append(_Malformed("not_an_object"))
            continue
        try:
            kind = _op_name(item)
        except _Malformed as err:
            out.append(err)
            continue
        body: Any = item
        if len(item) == 1 and str(next(iter(item))).lower() in _OP_NAMES:
            inner = next(iter(item.values()))  # shorthand {"add": "text"} or {"update": {...}}
            body = inner if isinstance(inner, dict) else {"text": inner, "reason": inner}
        raw_tags = body.get("tags", ())
        tags = raw_tags if isinstance(raw_tags, list) else [raw_tags] if raw_tags else []
        out.append({
            "kind": kind,
            "text": _text_of(body),
            "id": body.get("id", body.get("entry_id")),
            "tags": tags,
            "reason": body.get("reason", ""),
        })
    return out


# --------------------------------------------------------------------------------------------
# Plain-line form
# --------------------------------------------------------------------------------------------

_LINE = re.compile(
    r"""^\s*(?:[-*]\s+|\d+[.)]\s+)?(?:\*\*|__)?            # optional bullet / bold
        (?P<kind>ADD|UPDATE|RETURN|DELETE)(?:\*\*|__)?
        (?:\s*(?:\[(?P<bracket>[^\]\n]*)\]|(?:\#|id\s*=\s*)?(?P<id>\d{1,20})))?
        \s*(?:(?P<colon>[:\-\u2014])\s*(?P<text>.*))?$""",
    re.IGNORECASE | re.VERBOSE,
)


def _ops_from_lines(text: str) -> list[dict[str, Any]]:
    ops: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for line in text.splitlines():
        m = _LINE.match(line)
        kind = m.group("kind").lower() if m else ""
        has_colon = bool(m and m.group("colon"))
        # Prose such as "Add salt" never matches (the regex needs the line to end or a colon
        # after the keyword); a bare "ADD" / "UPDATE 3" without a colon is not an op either.
        is_op = m is not None and (
            kind == "return" or has_colon or (kind == "delete" and m.group("id") is not None)
        )
        if m is None or not is_op:
            if m is not None or not line.strip():
                current = None
            elif current is not None:
                current["text"] = f"{current['text']}\n{line.strip()}".strip()
            continue
        rest = (m.group("text") or "").strip().lstrip("*_").strip()
        bracket = m.group("bracket")
        raw_id: Any = m.group("id")
        tags: list[str] = []
        if bracket is not None:
            if kind == "add":
                tags = [t.strip() for t in bracket.split(",") if t.strip()]
            else:
                raw_id = bracket.strip()
        current = {"kind": kind, "text": rest, "id": raw_id, "tags": tags, "reason": rest}
        ops.append(current)
        if kind in ("return", "delete"):
            current = None
    return ops


# --------------------------------------------------------------------------------------------
# Validation and the public entry point
# --------------------------------------------------------------------------------------------


def _finish(
    raw: dict[str, Any],
    *,
    allowed: Collection[int] | None,
    retrieved_id: int | None,
    allow_delete: bool,
    max_len: int,
) -> ExperienceOp:
    kind = raw["kind"]
    if kind == "return":
        reason = raw.get("reason")
        return ReturnOp(reason=reason.strip()[:200] if isinstance(reason, str) else "")
    if kind == "delete":
        if not allow_delete:
            raise _Malformed("delete_not_allowed")
        entry_id = _parse_id(raw.get("id"))
        if allowed is not None and entry_id not in allowed:
            raise _Malformed("delete_id_not_allowed")
        return DeleteOp(id=entry_id)
    text = raw.get("text")
    if not isinstance(text, str) or not text.strip():
        raise _Malformed("empty_text")
    text = text.strip()
    if len(text) > max_len:
        raise _Malformed("text_too_long")
    if kind == "add":
        tags = tuple(str(t).strip()[:64] for t in raw.get("tags", ()) if str(t).strip())
        return AddOp(text=text, tags=tags[:16])
    raw_id = raw.get("id")
    if raw_id is None or (isinstance(raw_id, str) and not raw_id.strip()):
        if retrieved_id is None:
            raise _Malformed("update_without_target")
        entry_id = retrieved_id
    else:
        entry_id = _parse_id(raw_id)
    if allowed is not None and entry_id not in allowed:
        raise _Malformed("update_id_not_allowed")
    return UpdateOp(id=entry_id, text=text)


def _parse(
    text: Any,
    *,
    allowed: Collection[int] | None,
    retrieved_id: int | None,
    allow_delete: bool,
    max_len: int,
    max_ops: int,
) -> list[ExperienceOp]:
    if not isinstance(text, str):
        raise _Malformed("not_text")
    if not text.strip():
        raise _Malformed("empty_output")
    answer, ok = strip_think(text[-MAX_INPUT_CHARS:])
    if not ok:
        raise _Malformed("unclosed_think")
    if not answer.strip():
        raise _Malformed("empty_answer")
    value = find_json(answer, _looks_like_op)
    raws: list[dict[str, Any] | _Malformed] = [] if value is None else _ops_from_json(value)
    if all(isinstance(r, _Malformed) for r in raws):
        # e.g. "ADD: send {"type": "x"}": the JSON was part of a line-form text, not the answer
        raws = list(_ops_from_lines(answer)) or raws
    if not raws:
        raise _Malformed("no_op_found")
    if len(raws) > max_ops:
        raise _Malformed("too_many_ops")
    ops: list[ExperienceOp] = []
    updated: set[int] = set()
    for raw in raws:
        try:
            if isinstance(raw, _Malformed):
                raise raw
            op = _finish(raw, allowed=allowed, retrieved_id=retrieved_id,
                         allow_delete=allow_delete, max_len=max_len)
            if isinstance(op, UpdateOp | DeleteOp):
                if op.id in updated:  # two edits of one entry in one answer: ambiguous
                    raise _Malformed("duplicate_target")
                updated.add(op.id)
            ops.append(op)
        except _Malformed as err:
            ops.append(ReturnOp(reason=err.reason, malformed=True))
    return ops


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
        max_ops: more ops than this in one answer makes the whole answer malformed.
        stats: counters to update (default: the process-wide :data:`PARSE_STATS`).

    Returns:
        The ops in answer order. Each malformed op is replaced by
        ``ReturnOp(reason, malformed=True)``; an unparsable answer gives exactly one of those.
    """
    allowed = None if allowed_update_ids is None else frozenset(allowed_update_ids)
    if retrieved_id is None and allowed is not None and len(allowed) == 1:
        retrieved_id = next(iter(allowed))
    try:
        ops = _parse(text, allowed=allowed, retrieved_id=retrieved_id,
                     allow_delete=allow_delete, max_len=max_len, max_ops=max_ops)
    except _Malformed as err:
        ops = [ReturnOp(reason=err.reason, malformed=True)]
    except Exception as err:  # a parser bug must not take the trainer down: count it instead
        logger.exception("parse_ops: internal error")
        ops = [ReturnOp(reason=f"parser_error:{type(err).__name__}", malformed=True)]
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
