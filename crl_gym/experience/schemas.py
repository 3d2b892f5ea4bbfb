"""The extractor's answer formats, one JSON Schema per task, defined once beside the prompts.

Both generation backends constrain the extractor with these schemas (``hf``: llguidance on the
sampling loop, ``crl_train.policy.grammar``; ``vllm``: the engine's structured outputs), and the
readers of :mod:`crl_gym.experience.ops` and :mod:`crl_gym.experience.merge` check the same
rules when the text comes from an unconstrained model. Each schema is *always applicable*: what
the grammar lets a model write, the reader turns into ops or a merge decision without a failure.

* :func:`ops_schema` — distillation: a JSON list of 1 … ``max_ops`` ops, ``add`` / ``update`` /
  ``return``. An update may only be the first op and only target the ids given (the retrieved
  entry), so one answer never edits an entry twice. With an **action slot** (``slot_actions``,
  ``slot_size`` N > 0: ``experience.action_slot``) each add and update first chooses 1 … N
  ``"actions"`` among the episode's admissible actions (an ``enum``), then writes its text.
* :func:`refinement_schema` — ``search_and_ask``: ``{"advice": "..."}``.
* :func:`merge_schema` — one Merge window: an object with one key per window label, in window
  order (so every label is decided exactly once, by construction), valued ``keep``, ``merge`` or
  ``discard``, and the ``merged`` text last: every entry marked ``merge`` is replaced by that one
  text (a single ``merge`` rewrites that entry; with none, the text is ignored).

**Bounded, plain text.** Free-text fields are printable ASCII without ``"`` or ``\\`` (so no JSON
escapes), start with a visible character and have a maximum length. Every valid answer is then at
most :func:`max_answer_chars` characters long, and since a token spells at least one character, a
token budget of that size can never cut an answer: a grammar-constrained answer is never
malformed. The ``x-guidance`` block (compact JSON, no escapes) is read by llguidance, the engine
of both backends (vLLM runs with its ``guidance`` backend).

>>> import json
>>> s = ops_schema({7}, max_ops=2, max_text=40)
>>> json.dumps(s["prefixItems"][0]["anyOf"][1]["properties"]["id"])
'{"const": 7}'
>>> max_answer_chars(refinement_schema(10))
23
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Literal

from crl_gym.json_types import JSONDict, JSONValue

TEXT_CHARS = r"[ !#-\[\]-~]"
"""One character of a free-text field: printable ASCII except ``"`` and ``\\`` (no escapes)."""
FIRST_CHAR = r"[!#-\[\]-~]"
"""The first character: visible (a text is never empty or blank)."""
GUIDANCE_OPTIONS: JSONDict = {"whitespace_flexible": False, "json_allowed_escapes": ""}
"""llguidance's JSON options, carried inside each schema so both backends compile the
same grammar."""
MERGE_ACTIONS = ("keep", "merge", "discard")
"""What a Merge answer says of each entry of its window."""
LABEL = re.compile(r"[EM][0-9]{1,6}")
"""A window label as the merge prompt writes it (``E3`` a bank entry, ``M2`` an earlier
merge result)."""
MAX_OPS = 3
"""Ops in one distillation answer (the prompt's ``{max_ops}``)."""
MAX_REASON_CHARS = 60
"""Longest ``return`` reason."""
MAX_ACTION_SLOT = 8
"""Most actions one slot may hold (``experience.action_slot``'s upper bound)."""
MAX_SLOT_ACTIONS = 128
"""Most distinct actions a slot's ``enum`` lists (the first seen are kept): a bound on
the grammar."""
MAX_SLOT_ACTION_CHARS = 100
"""Longest action a slot lists; a longer one (a free-text command) is left out of the ``enum``."""
_SLOT_ACTION = re.compile(f"{FIRST_CHAR}{TEXT_CHARS}{{0,{MAX_SLOT_ACTION_CHARS - 1}}}")


def text_schema(max_chars: int) -> JSONDict:
    """A bounded plain-text string (see the module docstring)."""
    if max_chars < 1:
        raise ValueError(f"text_schema: max_chars must be >= 1, got {max_chars}")
    return {
        "type": "string",
        "pattern": f"^{FIRST_CHAR}{TEXT_CHARS}{{0,{max_chars - 1}}}$",
        "maxLength": max_chars,
    }


def _op(kind: str, **fields: JSONValue) -> JSONDict:
    props: JSONDict = {"op": {"const": kind}, **fields}
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


def slot_action(value: object) -> bool:
    """Whether ``value`` can be one of a slot's actions: a string the grammar writes without escapes
    (printable ASCII, no ``"`` or ``\\``, a visible first character), at most
    :data:`MAX_SLOT_ACTION_CHARS` long.

    >>> slot_action("north"), slot_action(' north'), slot_action(3)
    (True, False, False)
    """
    return isinstance(value, str) and _SLOT_ACTION.fullmatch(value) is not None


def slot_schema(actions: Sequence[str], size: int) -> JSONDict:
    """The ``"actions"`` field of an action slot: 1 … ``size`` items, each one of ``actions``.

    >>> slot_schema(["north", "east"], 2)
    {'type': 'array', 'items': {'enum': ['north', 'east']}, 'minItems': 1, 'maxItems': 2}
    """
    if not 1 <= size <= MAX_ACTION_SLOT:
        raise ValueError(f"slot_schema: size must be in [1, {MAX_ACTION_SLOT}], got {size}")
    actions = list(actions)
    bad = [a for a in actions if not slot_action(a)]
    if not actions or bad or len(set(actions)) != len(actions) or len(actions) > MAX_SLOT_ACTIONS:
        raise ValueError(
            f"slot_schema: actions must be 1 to {MAX_SLOT_ACTIONS} distinct plain strings "
            f"(printable ASCII, no quotes or backslashes, at most {MAX_SLOT_ACTION_CHARS} "
            f"characters), got {actions!r}"
        )
    enum: list[JSONValue] = list(actions)
    return {"type": "array", "items": {"enum": enum}, "minItems": 1, "maxItems": size}


def ops_schema(
    update_ids: Collection[int],
    *,
    max_ops: int = MAX_OPS,
    max_text: int = 2000,
    max_reason: int = MAX_REASON_CHARS,
    slot_actions: Sequence[str] = (),
    slot_size: int = 0,
) -> JSONDict:
    """The distillation answer: 1 … ``max_ops`` ops; an update (of one of ``update_ids``)
    only first.

    With ``slot_size`` N > 0 and some ``slot_actions``, every add and update has a required
    ``"actions"`` field before its ``"text"`` (:func:`slot_schema`); without actions (an env that
    lists none) the schema has no slot.

    >>> s = ops_schema(set(), max_ops=1, max_text=8, max_reason=1, slot_actions=["north", "east"],
    ...                slot_size=1)
    >>> list(s["prefixItems"][0]["anyOf"][0]["properties"])
    ['op', 'actions', 'text']
    >>> max_answer_chars(s) == len('[{"op":"add","actions":["north"],"text":"abcdefgh"}]')
    True
    """
    if max_ops < 1:
        raise ValueError(f"ops_schema: max_ops must be >= 1, got {max_ops}")
    if not 0 <= slot_size <= MAX_ACTION_SLOT:
        raise ValueError(
            f"ops_schema: slot_size must be in [0, {MAX_ACTION_SLOT}], got {slot_size}"
        )
    slot: JSONDict = (
        {"actions": slot_schema(slot_actions, slot_size)} if slot_size and slot_actions else {}
    )
    add = _op("add", **slot, text=text_schema(max_text))
    ret = _op("return", reason=text_schema(max_reason))
    ids = sorted({int(i) for i in update_ids})
    first: list[JSONValue] = [add, ret]
    if ids:
        values: list[JSONValue] = list(ids)
        target: JSONDict = {"const": ids[0]} if len(ids) == 1 else {"enum": values}
        first.insert(1, _op("update", id=target, **slot, text=text_schema(max_text)))
    schema: JSONDict = {
        "type": "array",
        "prefixItems": [{"anyOf": first}],
        "minItems": 1,
        "maxItems": max_ops,
    }
    schema["items"] = {"anyOf": [add, ret]} if max_ops > 1 else False
    return {**schema, "x-guidance": dict(GUIDANCE_OPTIONS)}


def refinement_schema(max_text: int = 1500) -> JSONDict:
    """The ``search_and_ask`` answer: ``{"advice": "..."}``."""
    return {
        "type": "object",
        "properties": {"advice": text_schema(max_text)},
        "required": ["advice"],
        "additionalProperties": False,
        "x-guidance": dict(GUIDANCE_OPTIONS),
    }


def merge_schema(labels: Sequence[str], max_text: int = 2000) -> JSONDict:
    """One Merge window's answer over ``labels``: each decided once, in window order,
    then ``merged``."""
    labels = list(labels)
    if len(set(labels)) != len(labels) or not all(
        isinstance(x, str) and LABEL.fullmatch(x) for x in labels
    ):
        raise ValueError(
            f"merge_schema: labels must be distinct window labels like 'E3', got {labels!r}"
        )
    props: JSONDict = {x: {"enum": list(MERGE_ACTIONS)} for x in labels}
    props["merged"] = text_schema(max_text)
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
        "x-guidance": dict(GUIDANCE_OPTIONS),
    }


# ------------------------------------------------------------------------------------ bounds


def _max_len(s: Mapping[str, Any] | Literal[False]) -> int:
    """Longest compact JSON text valid under ``s`` (the subset of JSON Schema this
    module writes)."""
    if s is False:
        return 0
    if "const" in s:
        return len(json.dumps(s["const"]))
    if "enum" in s:
        return max(len(json.dumps(v)) for v in s["enum"])
    if "anyOf" in s:
        return max(_max_len(x) for x in s["anyOf"])
    kind = s.get("type")
    if kind == "string":
        return int(s["maxLength"]) + 2  # no escapes: one character each, plus the quotes
    if kind == "object":
        props = s["properties"]
        body = sum(len(json.dumps(k)) + 1 + _max_len(v) for k, v in props.items())
        return 2 + body + max(0, len(props) - 1)  # braces, "key":value pairs, commas
    if kind == "array":
        prefix = [_max_len(x) for x in s.get("prefixItems", [])]
        rest = _max_len(s.get("items", False))
        n = int(s["maxItems"])
        items = prefix[:n] + [rest] * max(0, n - len(prefix))
        return 2 + sum(items) + max(0, n - 1)
    raise ValueError(f"max_answer_chars: unsupported schema part {s!r}")


def max_answer_chars(schema: JSONDict) -> int:
    """Length bound of any answer valid under ``schema``; it is also a token bound (a token is at
    least one character), so a budget this large never cuts a constrained answer.

    >>> max_answer_chars(merge_schema(["E1", "E2"], max_text=5))
    48
    >>> len('{"E1":"discard","E2":"discard","merged":"abcde"}')
    48
    """
    return _max_len(schema)


# ------------------------------------------------------------------------------------ examples


def example_answers(n_labels: int = 40, max_ids: int = 32) -> list[str]:
    """One answer of each shape, for the tiny preset's tokenizer corpus: BPE then gives the JSON
    skeletons the schemas force few tokens, as a real tokenizer does."""
    texts = ["When the goal is visible, walk straight to it.", "Nothing new here."]
    out = [
        json.dumps([{"op": "add", "text": texts[0]}], separators=(",", ":")),
        json.dumps([{"op": "return", "reason": texts[1]}], separators=(",", ":")),
        json.dumps({"advice": texts[0]}, separators=(",", ":")),
    ]
    out += [
        json.dumps(
            [{"op": "update", "id": i, "text": texts[0]}, {"op": "add", "text": texts[1]}],
            separators=(",", ":"),
        )
        for i in range(1, max_ids + 1)
    ]
    labels = [f"{p}{i}" for i in range(1, n_labels + 1) for p in ("E", "M")]
    for s in range(0, len(labels), 4):
        chunk = labels[s : s + 4]
        obj: dict[str, str] = {x: MERGE_ACTIONS[i % 3] for i, x in enumerate(chunk)}
        out.append(json.dumps({**obj, "merged": texts[0]}, separators=(",", ":")))
    return out


__all__ = [
    "FIRST_CHAR",
    "GUIDANCE_OPTIONS",
    "LABEL",
    "MAX_ACTION_SLOT",
    "MAX_OPS",
    "MAX_REASON_CHARS",
    "MAX_SLOT_ACTIONS",
    "MAX_SLOT_ACTION_CHARS",
    "MERGE_ACTIONS",
    "TEXT_CHARS",
    "example_answers",
    "max_answer_chars",
    "merge_schema",
    "ops_schema",
    "refinement_schema",
    "slot_action",
    "slot_schema",
    "text_schema",
]
