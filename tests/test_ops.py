"""Tests of crl_gym.experience.ops: the extractor-output parser."""

from __future__ import annotations

import json
import logging
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crl_gym.experience.ops import (
    DEFAULT_MAX_LEN,
    ParseStats,
    find_json,
    parse_ops,
    strip_think,
)
from crl_gym.protocol import AddOp, DeleteOp, ExperienceOp, ReturnOp, UpdateOp


def parse(text: object, **kw: object) -> list[ExperienceOp]:
    kw.setdefault("stats", ParseStats())
    return parse_ops(text, **kw)  # type: ignore[arg-type]


def malformed(reason: str) -> list[ExperienceOp]:
    return [ReturnOp(reason=reason, malformed=True)]


# ---------------------------------------------------------------------------------- JSON form


def test_single_json_object() -> None:
    out = parse('{"op": "add", "text": "  Pick up the key first.  ", "tags": ["keyroom"]}')
    assert out == [AddOp(text="Pick up the key first.", tags=("keyroom",))]


def test_json_list_with_all_kinds() -> None:
    text = json.dumps([
        {"op": "add", "text": "a"},
        {"op": "update", "id": 7, "text": "b"},
        {"op": "return", "reason": "nothing else"},
    ])
    assert parse(text, allowed_update_ids={7}) == [
        AddOp("a"), UpdateOp(7, "b"), ReturnOp(reason="nothing else")
    ]


def test_json_in_fence_after_think_last_fence_wins() -> None:
    text = (
        "<think>I could write ```json\n{\"op\": \"add\", \"text\": \"draft\"}\n``` but no"
        "</think>\nFirst idea:\n```json\n{\"op\": \"add\", \"text\": \"old\"}\n```\n"
        "Final:\n```json\n[{\"op\": \"add\", \"text\": \"final\"}]\n```"
    )
    assert parse(text) == [AddOp("final")]


def test_json_embedded_in_prose() -> None:
    text = 'Sure. My decision is {"op": "update", "text": "Go around the lava."} as asked.'
    assert parse(text, allowed_update_ids={3}) == [UpdateOp(3, "Go around the lava.")]


def test_json_variants_wrapper_shorthand_and_synonyms() -> None:
    assert parse('{"ops": [{"action": "ADD", "content": "c", "tags": "t"}]}') == [
        AddOp("c", ("t",))
    ]
    assert parse('[{"add": "x"}, {"update": {"id": "#5", "text": "y"}}, {"return": "r"}]') == [
        AddOp("x"), UpdateOp(5, "y"), ReturnOp("r")
    ]
    assert parse('{"type": "noop"}') == [ReturnOp("")]


def test_update_without_id_targets_the_retrieved_entry() -> None:
    assert parse('{"op": "update", "text": "t"}', retrieved_id=11) == [UpdateOp(11, "t")]
    assert parse('{"op": "update", "text": "t"}') == malformed("update_without_target")
    # the only allowed id is the retrieved one by default
    assert parse("UPDATE: t", allowed_update_ids=[4]) == [UpdateOp(4, "t")]


# ------------------------------------------------------------------------------ plain lines


def test_plain_lines() -> None:
    text = (
        "After thinking about it:\n"
        "- ADD [minihack, keys]: Pick up the key\n  before the door.\n\n"
        "Some prose that is not part of the entry.\n"
        "2. **UPDATE 12:** Use the wand on the lava.\n"
        "UPDATE #13 - second form\n"
        "RETURN: nothing else\n"
    )
    assert parse(text) == [
        AddOp("Pick up the key\nbefore the door.", ("minihack", "keys")),
        UpdateOp(12, "Use the wand on the lava."),
        UpdateOp(13, "second form"),
        ReturnOp("nothing else"),
    ]


def test_plain_bare_return_and_update_colon() -> None:
    assert parse("RETURN") == [ReturnOp("")]
    assert parse("update: rewrite it", retrieved_id=9) == [UpdateOp(9, "rewrite it")]
    assert parse("UPDATE [9]: bracketed") == [UpdateOp(9, "bracketed")]


def test_prose_is_not_an_op() -> None:
    assert parse("I would add salt. Return to the start. Update 5 apples.") == malformed(
        "no_op_found"
    )


def test_json_inside_line_text_falls_back_to_lines() -> None:
    # the JSON object is not a valid op, the ADD line is
    assert parse('ADD: send {"type": "x"} to the server') == [
        AddOp('send {"type": "x"} to the server')
    ]


# ------------------------------------------------------------------------------ think blocks


def test_strip_think_variants() -> None:
    assert strip_think("<think>a</think>b") == ("b", True)
    assert strip_think("reasoning only closed</think>RETURN") == ("RETURN", True)
    assert strip_think("<THINK>x</THINK>y") == ("y", True)
    assert strip_think("plain") == ("plain", True)
    assert strip_think("<think>never closed ADD: draft") == ("", False)
    assert strip_think("ADD: before <think>cut") == ("ADD: before ", True)


def test_op_inside_think_is_ignored() -> None:
    assert parse("<think>maybe ADD: a draft</think>RETURN") == [ReturnOp("")]
    assert parse("<think>maybe ADD: a draft, then I ran out of tok") == malformed(
        "unclosed_think"
    )


# ---------------------------------------------------------------------------- malformed cases


@pytest.mark.parametrize(
    ("text", "kw", "reason"),
    [
        ("", {}, "empty_output"),
        ("   \n", {}, "empty_output"),
        ("<think>x</think>   ", {}, "empty_answer"),
        ("garbage ### !!", {}, "no_op_found"),
        ('{"op": "frobnicate", "text": "x"}', {}, "unknown_op"),
        ('{"op": "add", "text": "   "}', {}, "empty_text"),
        ('{"op": "add"}', {}, "empty_text"),
        ('{"op": "add", "text": 5}', {}, "empty_text"),
        ("ADD:", {}, "empty_text"),
        ('{"op": "update", "id": 9, "text": "x"}', {"allowed_update_ids": {7}}, "update_id_not_allowed"),
        ("UPDATE 9: x", {"allowed_update_ids": set()}, "update_id_not_allowed"),
        ('{"op": "update", "id": -1, "text": "x"}', {}, "bad_id"),
        ('{"op": "update", "id": 18446744073709551616, "text": "x"}', {}, "bad_id"),
        ('{"op": "update", "id": true, "text": "x"}', {}, "bad_id"),
        ('{"op": "update", "id": 1.5, "text": "x"}', {}, "bad_id"),
        ("DELETE 5", {}, "delete_not_allowed"),
        ('{"op": "add", "text": "' + "x" * (DEFAULT_MAX_LEN + 1) + '"}', {}, "text_too_long"),
        ("ADD: " + "y" * 11, {"max_len": 10}, "text_too_long"),
    ],
)
def test_malformed_outputs(text: str, kw: dict, reason: str) -> None:
    assert parse(text, **kw) == malformed(reason)


def test_non_string_input() -> None:
    for value in (None, 3, b"ADD: x", ["ADD: x"]):
        assert parse(value) == malformed("not_text")


def test_ops_past_max_ops_are_one_counted_return_and_the_rest_are_kept() -> None:
    # before: the 17th op made the whole answer one malformed Return (16 good ops lost)
    text = json.dumps([{"op": "add", "text": str(i)} for i in range(17)])
    assert parse(text) == [*(AddOp(str(i)) for i in range(16)), *malformed("too_many_ops")]


def test_mixed_list_keeps_valid_ops() -> None:
    text = json.dumps([{"op": "add", "text": "ok"}, {"op": "add", "text": ""}, 7])
    assert parse(text) == [AddOp("ok"), *malformed("empty_text"), *malformed("not_an_object")]


def test_duplicate_target_is_malformed() -> None:
    text = "UPDATE 3: a\nUPDATE 3: b"
    assert parse(text) == [UpdateOp(3, "a"), *malformed("duplicate_target")]


def test_delete_allowed_for_merge() -> None:
    assert parse("DELETE 5", allow_delete=True) == [DeleteOp(5)]
    assert parse('{"op": "delete", "id": 5}', allow_delete=True, allowed_update_ids={4}) == (
        malformed("delete_id_not_allowed")
    )


def test_tags_are_cleaned() -> None:
    out = parse(json.dumps({"op": "add", "text": "t", "tags": [" a ", "", 3]}))
    assert out == [AddOp("t", ("a", "3"))]


def test_find_json_prefers_fence_then_whole_then_last_embedded() -> None:
    def is_dict(v: object) -> bool:
        return isinstance(v, dict)

    assert find_json('{"a": 1} ```json\n{"b": 2}\n```', is_dict) == {"b": 2}
    assert find_json('{"a": {"b": 1}}', is_dict) == {"a": {"b": 1}}
    assert find_json("x {bad} y {\"c\": 3} z", is_dict) == {"c": 3}
    assert find_json("nothing", is_dict) is None


# ---------------------------------------------------------------------------- stats & logging


def test_stats_count_ops_and_reasons() -> None:
    s = ParseStats()
    parse_ops("ADD: a", stats=s)
    parse_ops("RETURN", stats=s)
    parse_ops("junk", stats=s)
    parse_ops("more junk", stats=s)
    parse_ops('{"op": "zap"}', stats=s)
    snap = s.snapshot()
    # 5 outputs; ops: 1 add + 1 plain return + 3 malformed returns = 4 returns
    assert snap == {
        "outputs": 5,
        "ops_by_kind": {"add": 1, "return": 4},
        "malformed": 3,
        "malformed_by_reason": {"no_op_found": 2, "unknown_op": 1},
    }
    assert s.malformed == 3
    s.reset()
    assert s.snapshot()["outputs"] == 0


def test_stats_are_thread_safe() -> None:
    s = ParseStats()
    texts = ["ADD: a", "junk", "RETURN", '[{"op": "add", "text": "x"}, {"op": "add", "text": "y"}]']

    def work() -> None:
        for _ in range(200):
            for t in texts:
                parse_ops(t, stats=s)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = s.snapshot()
    # 4 threads x 200 rounds x 4 texts = 3200 outputs; adds: (1 + 2) x 800 = 2400
    assert snap["outputs"] == 3200
    assert snap["ops_by_kind"] == {"add": 2400, "return": 1600}
    assert snap["malformed_by_reason"] == {"no_op_found": 800}


def test_default_stats_is_process_wide() -> None:
    from crl_gym.experience.ops import PARSE_STATS

    before = PARSE_STATS.snapshot()["outputs"]
    parse_ops("RETURN")
    assert PARSE_STATS.snapshot()["outputs"] == before + 1


def test_malformed_is_logged_once_as_warning(caplog: pytest.LogCaptureFixture) -> None:
    s = ParseStats()
    with caplog.at_level(logging.DEBUG, logger="crl_gym.experience.ops"):
        parse_ops("junk one", stats=s)
        parse_ops("junk two", stats=s)
    recs = [r for r in caplog.records if "malformed extractor output" in r.getMessage()]
    assert [r.levelno for r in recs] == [logging.WARNING, logging.DEBUG]
    assert "no_op_found" in recs[0].getMessage() and "junk one" in recs[0].getMessage()


# -------------------------------------------------------------------------------- properties

_ALLOWED = frozenset({1, 2, 3})


def _check_invariants(ops: list[ExperienceOp], max_len: int = DEFAULT_MAX_LEN) -> None:
    assert ops, "parse_ops must return at least one op"
    for op in ops:
        assert isinstance(op, AddOp | UpdateOp | ReturnOp)  # no DeleteOp without allow_delete
        if isinstance(op, AddOp | UpdateOp):
            assert op.text and op.text == op.text.strip() and len(op.text) <= max_len
        if isinstance(op, UpdateOp):
            assert op.id in _ALLOWED


_SETTINGS = settings(max_examples=300, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
_ROUND_TRIP = settings(max_examples=120, deadline=None,
                       suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@_SETTINGS
@given(st.text())
def test_property_random_text_never_raises(text: str) -> None:
    _check_invariants(parse(text, allowed_update_ids=_ALLOWED))


_keywords = st.sampled_from([
    "ADD", "UPDATE", "RETURN", "DELETE", "add", ":", "[", "]", "{", "}", "```json\n", "```",
    "<think>", "</think>", "\n", " ", '"op"', '"text"', '"id"', '"update"', '"add"', "1", "2",
    "99", "#", "-", "**", ",",
])
_jsonish_text = st.lists(st.one_of(_keywords, st.text(max_size=5)), max_size=40).map("".join)

_json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 2**65), st.floats(),
                          st.text(max_size=20), st.sampled_from(["add", "update", "return"]))
_json_values = st.recursive(
    _json_scalars,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.dictionaries(st.sampled_from(["op", "kind", "text", "id", "tags", "reason", "ops",
                                         "add", "update", "content", "x"]), kids, max_size=4),
    ),
    max_leaves=12,
)


@_SETTINGS
@given(_jsonish_text)
def test_property_jsonish_text_never_raises(text: str) -> None:
    _check_invariants(parse(text, allowed_update_ids=_ALLOWED))


@_SETTINGS
@given(_json_values, st.sampled_from(["{}", "```json\n{}\n```", "Answer: {} done", "</think>{}"]))
def test_property_random_json_values_never_raise(value: object, frame: str) -> None:
    text = frame.replace("{}", json.dumps(value))
    _check_invariants(parse(text, allowed_update_ids=_ALLOWED))


_entry_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs", "Cc", "Zl", "Zp")), min_size=1, max_size=60
).map(str.strip).filter(bool)
_valid_ops = st.lists(
    st.one_of(
        st.builds(AddOp, text=_entry_text),
        st.builds(UpdateOp, id=st.sampled_from(sorted(_ALLOWED)), text=_entry_text),
        st.builds(ReturnOp, reason=st.just("")),
    ),
    min_size=1, max_size=5,
).filter(lambda ops: len({o.id for o in ops if isinstance(o, UpdateOp)})
         == sum(isinstance(o, UpdateOp) for o in ops))


@_ROUND_TRIP
@given(_valid_ops)
def test_property_json_round_trip(ops: list[ExperienceOp]) -> None:
    payload = [
        {"op": "add", "text": o.text} if isinstance(o, AddOp)
        else {"op": "update", "id": o.id, "text": o.text} if isinstance(o, UpdateOp)
        else {"op": "return"}
        for o in ops
    ]
    text = "<think>reasoning {about} it</think>\n```json\n" + json.dumps(payload) + "\n```"
    assert parse(text, allowed_update_ids=_ALLOWED) == ops


_line_text = st.text(alphabet="abcdefghij klmnop,.;'", min_size=1, max_size=40).map(
    str.strip).filter(bool)


@_ROUND_TRIP
@given(st.lists(st.one_of(st.builds(AddOp, text=_line_text),
                          st.builds(UpdateOp, id=st.just(2), text=_line_text)),
                min_size=1, max_size=4)
       .filter(lambda ops: sum(isinstance(o, UpdateOp) for o in ops) <= 1))
def test_property_line_round_trip(ops: list[ExperienceOp]) -> None:
    lines = [f"ADD: {o.text}" if isinstance(o, AddOp) else f"UPDATE {o.id}: {o.text}"
             for o in ops]
    assert parse("\n".join(lines), allowed_update_ids=_ALLOWED) == ops


@pytest.mark.parametrize(
    "text",
    ["```" * 20000, "```\n" * 20000, "[" * 50000, "{" * 50000, '{"a": "' + "x{" * 20000,
     "ADD\n" * 20000, " " * 50000 + "x"],
    ids=["ticks", "fences", "brackets", "braces", "open-string", "bare-keywords", "spaces"],
)
def test_pathological_inputs_are_malformed_not_stuck(text: str) -> None:
    # Regression: a greedy fence regex once made the first case quadratic (13 s at 60 kB).
    assert parse(text) == malformed("no_op_found")


def test_docstring_examples_run() -> None:
    import doctest

    import crl_gym.experience.ops as module

    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


# ------------------------------------------------------------------ text the bank can store


def test_unencodable_characters_are_cleaned_before_the_bank_and_the_batch_survives() -> None:
    """A JSON escape of a lone surrogate used to reach the bank as is: UTF-8 cannot encode it, so the
    bank's write raised and every op of the answer was lost with it."""
    from _trainer_fixtures import manager

    from crl_gym.experience.ops import clean_text

    text = json.dumps([{"op": "add", "text": "Walk east."}, {"op": "add", "text": "Go \ud800north\u0000 now."},
                       {"op": "add", "text": "\udfff\u0001"}])
    ops = parse(text)
    assert ops == [AddOp("Walk east."), AddOp("Go north now."), *malformed("empty_text")]
    mgr = manager()
    res = mgr.apply_ops(ops)
    assert len(res.added) == 2 and sorted(e.text for e in mgr.bank) == ["Go north now.", "Walk east."]
    mgr.close()
    assert clean_text("a\tb\nc\rd\x7f\x85e") == "a\tb\ncde"
    # reasons and tags are cleaned too
    (op,) = parse(json.dumps({"op": "return", "reason": "dup\ud83d"}))
    assert op == ReturnOp(reason="dup")
    (add,) = parse(json.dumps({"op": "add", "text": "t", "tags": ["k\ud800ey", "\u0000"]}))
    assert add == AddOp("t", ("key",))


def test_a_merged_text_is_cleaned_too() -> None:
    from crl_gym.experience.merge import parse_merge_decision

    d = parse_merge_decision(json.dumps({"E1": "merge", "E2": "merge", "merged": "Go\ud800 east."}), ["E1", "E2"])
    assert d.merge == [(["E1", "E2"], "Go east.")]
