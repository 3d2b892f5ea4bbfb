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


# ------------------------------------------------------------------ linear time on adversarial input

N = 200_000  # MAX_INPUT_CHARS: the most any reader looks at
ADVERSARIAL = {
    # a fence opener followed by a long run of blanks: "```[ \t]*(word)*[ \t]*" backtracked over it
    # quadratically (minutes at this size) before the fence regex was rewritten
    "fence_blanks": "```" + " " * (N - 4) + "x",
    "fence_mixed_blanks": "```" + " \t" * (N // 2 - 2) + "x",
    "fence_word_blanks": "```" + " " * (N // 2) + "json" + " " * (N // 2 - 10) + "x",
    "many_fences": "```\n" * (N // 4),
    "backticks": "`" * N,
    "line_blanks": "ADD" + " " * (N - 4) + "x",
    "line_id_blanks": "UPDATE id" + " " * (N - 12) + "=x",
    "bullets": "- " * (N // 2),
    "digits": "1" * (N - 1) + "x",
    "open_arrays": ("[" + "1," * 249) * (N // 500),
    "open_objects": '{"op":' * (N // 6),
    "think_tags": "<think>" * (N // 7),
    "fence_then_blanks_end": "```" + "\n" * (N - 4) + "x",
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_every_reader_is_fast_on_adversarial_output_of_the_maximum_size(name: str) -> None:
    import time

    from crl_gym.experience.merge import MergeOutputError, parse_merge_decision
    from crl_gym.experience.ops import ParseStats, parse_ops, parse_structured_ops
    from crl_gym.experience.prompts import extract_refined_advice

    text = ADVERSARIAL[name]
    assert len(text) <= N
    readers = {
        "parse_ops": lambda: parse_ops(text, stats=ParseStats()),
        "parse_structured_ops": lambda: parse_structured_ops(text, stats=ParseStats()),
        "extract_refined_advice": lambda: extract_refined_advice(text, "m"),
        "find_json": lambda: find_json(text, looks_like_op),
        "ops_from_lines": lambda: ops_from_lines(text),
    }

    def merge() -> None:
        try:
            parse_merge_decision(text, ["E1", "E2"])
        except MergeOutputError:
            pass

    readers["parse_merge_decision"] = merge
    for reader, call in readers.items():
        t0 = time.perf_counter()
        call()
        took = time.perf_counter() - t0
        assert took < 1.0, f"{reader} took {took:.2f} s on {name!r} ({len(text)} chars)"
