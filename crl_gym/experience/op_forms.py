"""The two surface forms of an extractor's answer: JSON and plain op lines.

:mod:`crl_gym.experience.ops` validates what these helpers find; here the answer is only located
(:func:`strip_think`, :func:`find_json`) and normalised to raw op dicts
``{"kind", "text", "id", "tags", "reason"}`` (:func:`ops_from_json`, :func:`ops_from_lines`).
Nothing is checked against ids, lengths or limits at this stage.

>>> [(op["kind"], op["text"], op["tags"]) for op in ops_from_lines("ADD [keys]: Grab the key.\\nRETURN")]
[('add', 'Grab the key.', ['keys']), ('return', '', [])]
>>> ops_from_json({"ops": [{"op": "update", "id": 3, "content": "x"}]})
[{'kind': 'update', 'text': 'x', 'id': 3, 'tags': [], 'reason': ''}]
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

MAX_JSON_STARTS = 400
"""Cap on embedded-JSON decode attempts, so brace-heavy prose stays linear-ish."""

OP_KEYS = ("op", "operation", "action", "kind", "type")
TEXT_KEYS = ("text", "content", "experience", "entry")
LIST_KEYS = ("ops", "operations", "actions")
OP_NAMES = {"add": "add", "update": "update", "return": "return", "delete": "delete",
            "none": "return", "noop": "return", "no_op": "return", "skip": "return"}


class Malformed(Exception):
    """One op (or the whole output) could not be understood; ``reason`` is the counted label."""

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

# Linear time: the info string is one optional word, and the blanks after it are only tried after
# a word, so no two blank runs compete for the same characters (``[ \t]*(word)*[ \t]*`` made a
# run of blanks quadratic, a greedy ``[^\n]*`` made runs of backticks quadratic).
_FENCE = re.compile(r"```[ \t]*(?:([A-Za-z0-9_+-]+)[ \t]*)?\r?\n(.*?)```", re.DOTALL)


def looks_like_op(value: Any) -> bool:
    if isinstance(value, dict):
        if any(k in value for k in LIST_KEYS) and isinstance(
            next(value[k] for k in LIST_KEYS if k in value), list
        ):
            return True
        if any(isinstance(value.get(k), str) for k in OP_KEYS):
            return True
        # single-key shorthand {"add": "text"} / {"update": {...}} / {"return": ...}
        return len(value) == 1 and str(next(iter(value))).lower() in OP_NAMES
    if isinstance(value, list):
        return any(isinstance(v, dict) and looks_like_op(v) for v in value)
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
        pass  # not JSON as a whole: look for JSON embedded in prose below
    decoder = json.JSONDecoder()
    found: Any = None
    pos, attempts = 0, 0
    while attempts < MAX_JSON_STARTS:
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
    for key in OP_KEYS:
        if isinstance(d.get(key), str):
            name = d[key].strip().lower()
            if name in OP_NAMES:
                return OP_NAMES[name]
            raise Malformed("unknown_op")
    if len(d) == 1:
        key = str(next(iter(d))).lower()
        if key in OP_NAMES:
            return OP_NAMES[key]
    raise Malformed("unknown_op")


def _text_of(d: dict[str, Any]) -> Any:
    for key in TEXT_KEYS:
        if key in d:
            return d[key]
    return None


def ops_from_json(value: Any) -> list[dict[str, Any] | Malformed]:
    """Normalise a JSON value to raw op dicts: ``{"kind", "text", "id", "tags", "reason"}``."""
    if isinstance(value, dict):
        for key in LIST_KEYS:
            if isinstance(value.get(key), list):
                return ops_from_json(value[key])
        items: list[Any] = [value]
    else:
        items = list(value)
    out: list[dict[str, Any] | Malformed] = []
    for item in items:
        if not isinstance(item, dict):
            out.append(Malformed("not_an_object"))
            continue
        try:
            kind = _op_name(item)
        except Malformed as err:
            out.append(err)
            continue
        body: Any = item
        if len(item) == 1 and str(next(iter(item))).lower() in OP_NAMES:
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


def ops_from_lines(text: str) -> list[dict[str, Any]]:
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
