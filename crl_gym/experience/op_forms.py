"""The two surface forms of an extractor's answer: JSON and plain op lines.

:mod:`crl_gym.experience.ops` validates what these helpers find; here the answer is only located
(:func:`strip_think`, :func:`find_json`) and normalised to raw op dicts
``{"kind", "text", "id", "tags", "reason"}`` (:func:`ops_from_json`, :func:`ops_from_lines`).
Nothing is checked against ids, lengths or limits at this stage.

>>> ops = ops_from_lines("ADD [keys]: Grab the key.\\nRETURN")
>>> [(op["kind"], op["text"], op["tags"]) for op in ops]
[('add', 'Grab the key.', ['keys']), ('return', '', [])]
>>> ops_from_json({"ops": [{"op": "update", "id": 3, "content": "x"}]})
[{'kind': 'update', 'text': 'x', 'id': 3, 'tags': [], 'reason': ''}]
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from crl_gym.json_types import JSONDict, JSONValue

MAX_JSON_DEPTH = 64
"""Deepest embedded JSON value decoded as a whole (an op answer nests 3 deep); deeper spans are
only looked into, which keeps the decoder far from Python's recursion limit."""

OP_KEYS = ("op", "operation", "action", "kind", "type")
TEXT_KEYS = ("text", "content", "experience", "entry")
LIST_KEYS = ("ops", "operations", "actions")
OP_NAMES = {
    "add": "add",
    "update": "update",
    "return": "return",
    "delete": "delete",
    "none": "return",
    "noop": "return",
    "no_op": "return",
    "skip": "return",
}


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
        return text[close + len("</think>") :], True
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


def looks_like_op(value: object) -> bool:
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
    embedded in prose (the last accepted value wins because models restate their final answer at
    the end; an accepted value's inner values are parts of it, not candidates of their own).
    Linear time: embedded candidates come from one scan (:func:`_candidates`) and each character
    is decoded a bounded number of times (:func:`_embedded`).

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
    return _embedded(text, _candidates(text), accept)


# --------------------------------------------------------------------------------------------
# Embedded JSON: one scan for balanced candidates, then bounded decoding
# --------------------------------------------------------------------------------------------

_DECODER = json.JSONDecoder()
_STRUCTURAL = re.compile(r'[\[\]{}"]')
_STRING_BODY = re.compile(r'(?:[^"\\\x00-\x1f]|\\.)*')  # what JSON allows between the quotes
_AFTER_STRING = re.compile(
    r"[ \t\n\r]*[,:\]}]"
)  # in JSON a string is always followed by one of these
_AFTER_OPEN = {
    "{": re.compile(r'[ \t\n\r]*["}]'),
    "[": re.compile(r'[ \t\n\r]*[\[{"\-0-9tfnNI\]]'),
}
_OPENER_OF = {"}": "{", "]": "["}


class _Spans:
    """Bracket spans ``text[start:end]`` balanced outside JSON strings, in text order (pre-order).

    Flat lists of ints rather than one object per span: a text of 100,000 ``[]`` pairs would
    otherwise make as many tracked objects, and the garbage collector's passes over them cost
    more than the scan. ``end`` is -1 for an opener that was abandoned (never a candidate);
    ``height`` is the nesting depth of the span (1 for one without inner spans).
    """

    __slots__ = ("end", "height", "start")

    def __init__(self) -> None:
        self.start: list[int] = []
        self.end: list[int] = []
        self.height: list[int] = []


def _candidates(text: str) -> _Spans:
    """Every balanced span of ``text``; one pass.

    Only brackets and quotes are visited (the regex skips prose). Inside an open bracket a quote
    starts a JSON string; what no JSON value can hold (an opener not followed by a value, a string
    with a control character or followed by something else than ``, : ] }``, a closer of the
    wrong kind) abandons the open brackets, whose finished inner spans stay candidates. A string
    found not to be one was a quote in prose: its body is scanned again as prose, without strings
    (so each character is looked at twice at most), because a model's JSON may follow it there.
    """
    spans = _Spans()
    starts, ends, heights = spans.start, spans.end, spans.height
    open_: list[int] = []  # indices of the open spans, outermost first
    openers: list[str] = []
    search, string_body, after_string = _STRUCTURAL.search, _STRING_BODY.match, _AFTER_STRING.match
    pos, no_strings_before, n = 0, 0, len(text)
    while (m := search(text, pos)) is not None:
        i = m.start()
        c = text[i]
        pos = i + 1
        if c == '"':
            if not open_ or i < no_strings_before:
                continue
            end = string_body(text, pos).end()  # type: ignore[union-attr]  # it matches the empty string
            if end < n and text[end] == '"' and after_string(text, end + 1):
                pos = end + 1
            else:
                open_.clear()  # abandoned: their ends stay -1
                openers.clear()
                no_strings_before = end
        elif c == "{" or c == "[":
            if _AFTER_OPEN[c].match(text, pos):
                open_.append(len(starts))
                openers.append(c)
                starts.append(i)
                ends.append(-1)
                heights.append(1)
        elif open_:
            if openers[-1] != _OPENER_OF[c]:
                open_.clear()
                openers.clear()
                continue
            k = open_.pop()
            openers.pop()
            ends[k] = pos
            if open_ and heights[open_[-1]] <= heights[k]:
                heights[open_[-1]] = heights[k] + 1
    return spans


def _embedded(text: str, spans: _Spans, accept: Callable[[Any], bool]) -> Any | None:
    """The last accepted value among the candidate spans, in text order.

    A span is decoded once; when it decodes, its inner values are looked at in the decoded value,
    not decoded again. When it fails at position ``p``, an inner span holding ``p`` fails there
    too (a JSON value parses the same inside its parent as alone), so it is not decoded: only its
    own inner spans are. Spans deeper than :data:`MAX_JSON_DEPTH` are only looked into. So each
    character is decoded about twice at most.
    """
    found: object = None
    decoded_until = 0
    # the enclosing spans that were not decoded: (end, where it failed, or -1 when not known)
    outer: list[tuple[int, int]] = []
    for start, end, height in zip(spans.start, spans.end, spans.height, strict=True):
        if end < 0 or start < decoded_until:
            continue  # abandoned, or part of a value already decoded
        while outer and outer[-1][0] <= start:
            outer.pop()
        failed_at = outer[-1][1] if outer else -1
        if start < failed_at < end:
            outer.append((end, failed_at))
            continue
        if height > MAX_JSON_DEPTH:
            outer.append((end, -1))
            continue
        try:
            value, decoded_end = _DECODER.raw_decode(text, start)
        except json.JSONDecodeError as err:
            outer.append((end, err.pos))
        except (ValueError, RecursionError):
            outer.append((end, -1))
        else:
            found = _last_accepted(value, accept, found)
            decoded_until = decoded_end
    return found


def _last_accepted(value: object, accept: Callable[[Any], bool], found: object) -> object:
    """``value`` if accepted, else the last accepted object or list inside it (pre-order),
    else ``found``."""
    if not isinstance(value, dict | list):
        return found
    if accept(value):
        return value
    for inner in value.values() if isinstance(value, dict) else value:
        found = _last_accepted(inner, accept, found)
    return found


def _op_name(d: JSONDict) -> str:
    for key in OP_KEYS:
        value = d.get(key)
        if isinstance(value, str):
            name = value.strip().lower()
            if name in OP_NAMES:
                return OP_NAMES[name]
            raise Malformed("unknown_op")
    if len(d) == 1:
        key = str(next(iter(d))).lower()
        if key in OP_NAMES:
            return OP_NAMES[key]
    raise Malformed("unknown_op")


def _text_of(d: JSONDict) -> Any:
    for key in TEXT_KEYS:
        if key in d:
            return d[key]
    return None


def ops_from_json(value: Any) -> list[JSONDict | Malformed]:
    """Normalise a JSON value to raw op dicts: ``{"kind", "text", "id", "tags", "reason"}``."""
    if isinstance(value, dict):
        for key in LIST_KEYS:
            if isinstance(value.get(key), list):
                return ops_from_json(value[key])
        items: list[Any] = [value]
    else:
        items = list(value)
    out: list[JSONDict | Malformed] = []
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
        out.append(
            {
                "kind": kind,
                "text": _text_of(body),
                "id": body.get("id", body.get("entry_id")),
                "tags": tags,
                "reason": body.get("reason", ""),
                **(
                    {"actions": body["actions"]} if "actions" in body else {}
                ),  # the action slot (ops.slot_text)
            }
        )
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


def ops_from_lines(text: str) -> list[JSONDict]:
    ops: list[JSONDict] = []
    current: JSONDict | None = None
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
        raw_id: str | None = m.group("id")
        tags: list[JSONValue] = []
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
