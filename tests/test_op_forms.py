"""Tests of crl_gym.experience.op_forms: locating an extractor's answer and reading its two forms."""

from __future__ import annotations

import doctest

import pytest

import crl_gym.experience.op_forms as op_forms
from crl_gym.experience.op_forms import (
    Malformed,
    find_json,
    looks_like_op,
    ops_from_json,
    ops_from_lines,
)


def test_lines_continue_until_blank_line_or_next_op() -> None:
    ops = ops_from_lines("UPDATE 4: first line\nsecond line\n\nnot part of it\nADD: b")
    assert [(o["kind"], o["id"], o["text"]) for o in ops] == [
        ("update", "4", "first line\nsecond line"),
        ("add", None, "b"),
    ]


def test_prose_and_bare_keywords_are_not_ops() -> None:
    assert ops_from_lines("Add salt to taste.\nADD\nUPDATE 3") == []


def test_delete_needs_an_id_and_ends_the_op() -> None:
    ops = ops_from_lines("DELETE #12\ntrailing prose")
    assert ops == [{"kind": "delete", "text": "", "id": "12", "tags": [], "reason": ""}]


def test_json_shorthand_and_unknown_op() -> None:
    ops = ops_from_json([{"add": "tip"}, {"op": "explode"}, 3])
    assert ops[0] == {"kind": "add", "text": "tip", "id": None, "tags": [], "reason": "tip"}
    assert isinstance(ops[1], Malformed) and ops[1].reason == "unknown_op"
    assert isinstance(ops[2], Malformed) and ops[2].reason == "not_an_object"


def test_find_json_prefers_the_last_fence_then_the_last_embedded_value() -> None:
    text = 'draft ```json\n{"op": "add", "text": "a"}\n``` final ```json\n{"op": "add", "text": "b"}\n```'
    assert find_json(text, looks_like_op) == {"op": "add", "text": "b"}
    assert find_json('x {"op": "add"} y [{"op": "return"}] z', looks_like_op) == [{"op": "return"}]
    assert find_json("no json here", looks_like_op) is None


@pytest.mark.parametrize("value, expected", [
    ({"ops": []}, True), ({"op": "add"}, True), ({"update": {}}, True),
    ({"note": "x"}, False), ([1, 2], False), ("add", False),
])
def test_looks_like_op(value: object, expected: bool) -> None:
    assert looks_like_op(value) is expected


def test_docstring_examples_run() -> None:
    result = doctest.testmod(op_forms)
    assert result.attempted > 0 and result.failed == 0
