"""Tests of crl_gym.experience.prompts: every prompt is safe with any text and matches its parser."""

from __future__ import annotations

import json
import re

import jsonschema
from hypothesis import given, settings
from hypothesis import strategies as st

from crl_gym.experience.merge import parse_merge_decision
from crl_gym.experience.ops import ParseStats, find_json, parse_ops, parse_structured_ops
from crl_gym.experience.prompts import (
    DISTILLATION_TEMPLATE,
    MERGE_TEMPLATE,
    MergeItem,
    build_distillation_prompt,
    build_merge_prompt,
    build_refinement_prompt,
    distillation_update_ids,
    extract_refined_advice,
    fill,
    render_experience,
    render_merge_item,
    render_search_answer,
    render_trajectory,
    truncate_middle,
)
from crl_gym.experience.schemas import merge_schema, ops_schema
from crl_gym.protocol import (
    AddOp,
    DistillationRequest,
    ExperienceRef,
    ReturnOp,
    Step,
    Trajectory,
    UpdateOp,
)

BRACES = "{task} {0} {} {{x}} } { {experience!r} %s $name"


def request(n_steps: int = 3, *, guided: bool = True, text: str = "x") -> DistillationRequest:
    steps = [Step(observation=f"obs {i} {text}", action=f"act {i} {text}", reward=0.0)
             for i in range(n_steps)]
    if steps:
        steps[-1].reward = 1.0
    return DistillationRequest(
        task=f"Reach the stairs {text}",
        trajectory=Trajectory(steps=steps),
        outcome=1.0,
        success=True,
        experience=ExperienceRef(id=42, text=f"Head for > {text}", version=3) if guided else None,
        condition="guided" if guided else "free",
    )


# ------------------------------------------------------------------------------------ helpers


def test_fill_is_single_pass_and_brace_safe() -> None:
    assert fill("{a}-{b}", a="{b}", b="1") == "{b}-1"  # substituted text is not rescanned
    assert fill("{a} {unknown} {\"json\": 1}", a=BRACES) == BRACES + ' {unknown} {"json": 1}'


def test_truncate_middle_arithmetic() -> None:
    # 10 chars into 7: marker " … " is 3 chars, 4 remain -> head 2, tail 2
    assert truncate_middle("abcdefghij", 7) == "ab … ij"
    # 8 chars: 5 remain -> head 3, tail 2
    assert truncate_middle("abcdefghij", 8) == "abc … ij"
    assert truncate_middle("short", 10) == "short"
    assert truncate_middle("abcdef", 2) == "ab"
    assert truncate_middle("abc", 0) == ""


def test_render_trajectory_elides_the_middle() -> None:
    steps = [Step(observation=f"o{i:02d}", action=f"a{i:02d}") for i in range(20)]
    full = render_trajectory(Trajectory(steps=steps))
    line = "[1] observation: o00\n    action: a00"
    assert full.splitlines()[:2] == line.splitlines()
    # each step renders to 2 lines; one step with index < 10 is 36 chars, >= 10 is 37 chars
    assert len(render_trajectory(Trajectory(steps=steps[:1]))) == 36
    short = render_trajectory(Trajectory(steps=steps), max_chars=300)
    # head = steps 1-2 (36 + 1 newline each = 74); budget = 300 - 74 - 40 = 186
    # tail steps cost 38 each (37 + newline): 186 // 38 = 4 steps -> 20 - 2 - 4 = 14 omitted
    assert "… (14 turns omitted) …" in short
    assert "[2] observation: o01" in short and "[3] " not in short
    assert "[17] observation: o16" in short and "[20] observation: o19" in short
    assert len(short) <= 300


def test_render_trajectory_search_and_ask_and_long_observation() -> None:
    t = Trajectory(steps=[
        Step(observation="x" * 1000, action="north"),
        Step(observation="Go east.", action="search_and_ask[where?]", kind="search_and_ask"),
    ])
    text = render_trajectory(t, max_obs_chars=50)
    assert "x" * 24 + " … " + "x" * 23 in text  # 50 = 24 + 3 + 23
    assert "[2] asked for advice: search_and_ask[where?]\n    advice received: Go east." in text
    assert render_trajectory(Trajectory()) == "(the episode ended before the actor acted)"


# ------------------------------------------------------------------------------- distillation


def test_distillation_prompt_guided() -> None:
    p = build_distillation_prompt(request())
    assert "Reach the stairs x" in p
    assert "SUCCESS: episode return +1 after 3 actions." in p
    assert "Entry id 42 (version 3):\nHead for > x" in p
    assert '{"op":"update","id":42,"text":"..."}' in p and "only be the first operation" in p
    assert "[3] observation: obs 2 x\n    action: act 2 x (reward +1)" in p
    assert not re.search(r"\{[a-z_]+\}", p), "an unfilled placeholder is left"
    assert distillation_update_ids(request()) == {42}


def test_distillation_prompt_free_has_no_update() -> None:
    r = request(guided=False)
    r.success, r.outcome = False, 0.0
    p = build_distillation_prompt(r)
    assert '"op": "update"' not in p and "nothing to update" in p
    assert "FAILURE: episode return +0 after 3 actions." in p
    assert distillation_update_ids(r) == frozenset()


def test_distillation_prompt_is_brace_safe() -> None:
    r = request(text=BRACES)
    r.meta = {"x": BRACES}
    p = build_distillation_prompt(r)
    assert f"Reach the stairs {BRACES}" in p and f"Head for > {BRACES}" in p
    assert f"act 0 {BRACES}" in p


def test_distillation_prompt_respects_max_chars() -> None:
    r = request(n_steps=500, text="y" * 300)
    p = build_distillation_prompt(r, max_chars=8000)
    assert len(p) <= 8000
    assert "turns omitted" in p and "[500] observation" in p  # the end is always kept


def test_distillation_example_answer_parses_to_an_add() -> None:
    # The example in the prompt must be valid input of parse_ops and of the schema (format, grammar
    # and parser agree).
    # The examples show an answer's shape (an add, a return), not a lesson a model could echo.
    examples = re.findall(r"\[\{.*?\}\]", DISTILLATION_TEMPLATE)
    assert len(examples) == 2
    for body, kind in zip(examples, (AddOp, ReturnOp), strict=True):
        ops = parse_ops("<think>ok</think>" + body, allowed_update_ids=set(), stats=ParseStats())
        assert len(ops) == 1 and isinstance(ops[0], kind)
        jsonschema.validate(json.loads(body), ops_schema(set()))
        assert parse_structured_ops(body, allowed_update_ids=set(), stats=ParseStats()) == ops


def test_distillation_answer_in_documented_format_round_trips() -> None:
    r = request()
    answer = ('<think>the advice was right</think>\n```json\n'
              '[{"op": "update", "id": 42, "text": "Head for > directly."}]\n```')
    ops = parse_ops(answer, allowed_update_ids=distillation_update_ids(r), stats=ParseStats())
    assert ops == [UpdateOp(42, "Head for > directly.")]


# --------------------------------------------------------------------------------- refinement


def test_refinement_prompt_contents_and_context_tail() -> None:
    ctx = "turn 1 early\n" + "z" * 10000 + "\nturn 9: stuck at the river"
    p = build_refinement_prompt("how do I cross the river?", ExperienceRef(1, "Use a boat."),
                                ctx, max_chars=3000)
    assert "how do I cross the river?" in p and "Use a boat." in p
    assert '{"advice":"..."}' in p and p.rstrip().endswith("give the best general advice\nyou can.")
    assert "turn 9: stuck at the river" in p and "turn 1 early" not in p
    assert len(p) <= 3000


@settings(max_examples=200, deadline=None)
@given(st.text(), st.text(), st.text())
def test_refinement_prompt_never_raises_on_any_text(q: str, m: str, ctx: str) -> None:
    p = build_refinement_prompt(q, ExperienceRef(3, m), ctx)
    assert q.strip()[:50] in p


def test_refinement_prompt_braces() -> None:
    p = build_refinement_prompt(BRACES, BRACES, BRACES)
    assert p.count(BRACES) == 3


def test_extract_refined_advice() -> None:
    assert extract_refined_advice("<think>..</think>\nAdvice: go east.", "m") == "go east."
    assert extract_refined_advice("```\nCross at the bridge.\n```", "m") == "Cross at the bridge."
    assert extract_refined_advice("<think>cut", "fallback") == "fallback"
    assert extract_refined_advice("</think>  ", "fallback") == "fallback"
    assert extract_refined_advice(None, "fallback") == "fallback"  # type: ignore[arg-type]
    assert len(extract_refined_advice("w" * 5000, "m", max_chars=100)) == 100


# ------------------------------------------------------------------------------ actor-facing


def test_render_experience_and_search_answer() -> None:
    text = render_experience(BRACES, "You see {a} room.")
    assert text.endswith(f"{BRACES}\n\nYou see {{a}} room.")
    assert render_search_answer("where {x}?", " Go left. ") == 'Advice for "where {x}?":\nGo left.'
    assert "No stored experience matches" in render_search_answer("q", None)
    assert "No stored experience matches" in render_search_answer("q", "  ")


# ------------------------------------------------------------------------------------ merge


def test_merge_prompt_lists_items_with_meta() -> None:
    items = [MergeItem("E1", "Use keys {k}.", ("keyroom",), 3), MergeItem("M2", "Avoid lava.")]
    p = build_merge_prompt(items)
    assert "[E1] (tags: keyroom; retrieved 3x) Use keys {k}.\n[M2] Avoid lava." in p
    assert render_merge_item(items[1]) == "[M2] Avoid lava."


def test_merge_example_answer_matches_the_parser_and_the_schema() -> None:
    block = MERGE_TEMPLATE[MERGE_TEMPLATE.index("```json"):]
    obj = find_json(block, lambda v: isinstance(v, dict))
    assert obj is not None and set(obj) == {"E1", "E2", "E3", "E4", "merged"}
    jsonschema.validate(obj, merge_schema(["E1", "E2", "E3", "E4"]))
    d = parse_merge_decision(block, ["E1", "E2", "E3", "E4"])
    assert d.keep == ["E1"] and d.discard == ["E4"] and d.merge[0][0] == ["E2", "E3"]


def test_docstring_examples_run() -> None:
    import doctest

    import crl_gym.experience.prompts as module

    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
