"""Tests of crl_gym.experience.op_forms: locating an extractor's answer and reading its two forms."""

from __future__ import annotations

import doctest
import gc
import json
import time
from collections.abc import Callable

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


def adversarial(name: str, n: int) -> str:
    """Input ``name`` of about ``n`` characters: each is quadratic for some plausible reader."""
    make = {
        # a fence opener then a long run of blanks: "```[ \t]*(word)*[ \t]*" backtracked over it
        "fence_blanks": lambda: "```" + " " * (n - 4) + "x",
        "fence_mixed_blanks": lambda: "```" + " \t" * (n // 2 - 2) + "x",
        "fence_word_blanks": lambda: "```" + " " * (n // 2) + "json" + " " * (n // 2 - 10) + "x",
        "many_fences": lambda: "```\n" * (n // 4),
        "backticks": lambda: "`" * n,
        "line_blanks": lambda: "ADD" + " " * (n - 4) + "x",
        "line_id_blanks": lambda: "UPDATE id" + " " * (n - 12) + "=x",
        "bullets": lambda: "- " * (n // 2),
        "digits": lambda: "1" * (n - 1) + "x",
        # decoding at each opener scanned to the end of the unterminated nesting each time
        "open_arrays": lambda: ("[" + "1," * 249) * (n // 500),
        "open_objects": lambda: '{"op":' * (n // 6),
        "think_tags": lambda: "<think>" * (n // 7),
        "fence_then_blanks_end": lambda: "```" + "\n" * (n - 4) + "x",
        # the same nesting closed but invalid: every level fails at the same late position
        "closed_failing_arrays": lambda: ("[" + "1," * 249) * (n // 502) + "x" + "]" * (n // 502),
        "deep_balanced": lambda: "[" * (n // 2) + "]" * (n // 2),
        "empty_pairs": lambda: "[]" * (n // 2),
        "nested_objects": lambda: '{"a":' * (n // 6) + "1" + "}" * (n // 6),
        "open_strings": lambda: '["' * (n // 2),
        "escaped_quotes": lambda: '["' + '[1 \\"' * ((n - 4) // 5) + '"x',
        "quoted_prose": lambda: '[ "a" x ' * (n // 8),
    }
    return make[name]()


NAMES = ("fence_blanks", "fence_mixed_blanks", "fence_word_blanks", "many_fences", "backticks", "line_blanks",
         "line_id_blanks", "bullets", "digits", "open_arrays", "open_objects", "think_tags", "fence_then_blanks_end",
         "closed_failing_arrays", "deep_balanced", "empty_pairs", "nested_objects", "open_strings", "escaped_quotes",
         "quoted_prose")


def readers(text: str) -> dict[str, Callable[[], object]]:
    from crl_gym.experience.merge import MergeOutputError, parse_merge_decision
    from crl_gym.experience.ops import ParseStats, parse_ops, parse_structured_ops
    from crl_gym.experience.prompts import extract_refined_advice

    def merge() -> None:
        try:
            parse_merge_decision(text, ["E1", "E2"])
        except MergeOutputError:
            pass

    return {
        "parse_ops": lambda: parse_ops(text, stats=ParseStats()),
        "parse_structured_ops": lambda: parse_structured_ops(text, stats=ParseStats()),
        "extract_refined_advice": lambda: extract_refined_advice(text, "m"),
        "find_json": lambda: find_json(text, looks_like_op),
        "ops_from_lines": lambda: ops_from_lines(text),
        "parse_merge_decision": merge,
    }


class CountingDecoder:
    """Wraps the embedded-JSON decoder and counts the characters each call looked at."""

    def __init__(self) -> None:
        self.inner = json.JSONDecoder()
        self.calls = 0
        self.chars = 0

    def raw_decode(self, s: str, idx: int = 0) -> tuple[object, int]:
        self.calls += 1
        try:
            value, end = self.inner.raw_decode(s, idx)
        except json.JSONDecodeError as err:
            self.chars += err.pos - idx + 1
            raise
        self.chars += end - idx
        return value, end


@pytest.mark.parametrize("name", NAMES)
def test_embedded_json_decodes_each_character_a_bounded_number_of_times(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Work counted, not timed: decoding at every opener read ~N²/1000 characters on open_arrays."""
    counter = CountingDecoder()
    monkeypatch.setattr(op_forms, "_DECODER", counter)
    text = adversarial(name, N)
    find_json(text, looks_like_op)
    assert counter.chars <= 3 * len(text) + 100, f"{counter.chars} characters decoded in {counter.calls} calls"


def test_embedded_json_still_found_after_prose_that_looks_like_json() -> None:
    answer = '{"op": "add", "text": "use [x"}'
    for prose in ("see [note] then ", "Options [a, b, \"c and then ", '["c and then ', "[1, x, ", "{{{{ [[[[ ", '"a ] b" '):
        assert find_json(prose + answer + " done.", looks_like_op) == json.loads(answer), prose
    assert find_json('[{"op": "add", "text": "a"} oops', looks_like_op) == {"op": "add", "text": "a"}
    # an accepted value hides its inner values; an unaccepted one is looked into
    assert find_json('{"ops": [{"op": "add", "text": "a"}]} {"note": {"op": "return"}}', looks_like_op) == {
        "op": "return"}
    deep = "[" * (op_forms.MAX_JSON_DEPTH + 5) + '{"op": "return"}' + "]" * (op_forms.MAX_JSON_DEPTH + 5)
    assert find_json("x " + deep, looks_like_op) == [{"op": "return"}]


def best_time(call: Callable[[], object], repeats: int) -> float:
    """Least CPU time of this process over ``repeats`` calls.

    CPU time, not wall time, so that other processes on a shared machine do not count; the
    collector is off while timing, because a full collection walks every object of the test
    process (torch included), a cost that has nothing to do with the input.
    """
    best = float("inf")
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            t0 = time.process_time()
            call()
            best = min(best, time.process_time() - t0)
    finally:
        gc.enable()
    return best


# Below this the N/4 time is timer and call overhead, not reading: the ratio would measure noise.
NOISE_FLOOR_S = 2e-4


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", NAMES)
def test_every_reader_is_linear_on_adversarial_output_of_the_maximum_size(name: str) -> None:
    """Time at N against time at N/4 in the same run: ~4x for a linear reader, ~16x for a quadratic one.

    Best of several timings, interleaved, so a busy machine slows both sizes alike; a reader over
    the bound is measured twice more before the test fails.
    """
    big, small = adversarial(name, N), adversarial(name, N // 4)
    assert len(big) <= N
    big_readers, small_readers = readers(big), readers(small)
    for reader in big_readers:
        ratio = 0.0
        for _ in range(3):
            t_small = max(best_time(small_readers[reader], 2), NOISE_FLOOR_S)
            t_big = best_time(big_readers[reader], 2)
            ratio = t_big / t_small
            if ratio < 8.0:
                break
        assert ratio < 8.0, f"{reader} on {name!r}: {t_big:.4f} s at {len(big)} chars, {t_small:.4f} s at {len(small)}"
