"""The entry contract of the distillation prompt: what an entry may record, stated before anything
that varies between requests, short, and bounded by the same numbers as the answer's schema."""

from __future__ import annotations

import json
import os
import re

import jsonschema
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from crl_gym.envs.recall import RecallEnv  # noqa: E402
from crl_gym.experience.ops import DEFAULT_MAX_LEN, ParseStats, parse_structured_ops  # noqa: E402
from crl_gym.experience.prompts import (  # noqa: E402
    build_distillation_prompt,
    build_reflection_prompt,
    distillation_instructions,
    fill,
)
from crl_gym.experience.schemas import MAX_OPS, ops_schema  # noqa: E402
from crl_gym.protocol import AddOp, DistillationRequest, ExperienceRef, Step, Trajectory  # noqa: E402
from crl_gym.templates import DISTILLATION_TEMPLATE, ENTRY_CONTRACT  # noqa: E402


def _recall_requests() -> list[DistillationRequest]:
    """Two Recall episodes that differ in every variable part: task, outcome, entry given, trajectory."""
    env = RecallEnv(num_tasks=16, length=2, num_actions=4)
    out = []
    for seed, ok in ((3, True), (8, False)):
        obs, _ = env.reset(seed=seed)
        actions = list(env.secret) if ok else [next(a for a in env._admissible if a != env.secret[0])]
        steps = []
        for a in actions:
            nxt, r, *_ = env.step(a)
            steps.append(Step(obs, a, r))
            obs = nxt
        given = None if ok else ExperienceRef(17, "Task bold heron: north, then east.", 2)
        out.append(DistillationRequest(env.task, Trajectory(steps), float(ok), ok, given,
                                       condition="guided" if given else "free", env_id="crl/Recall-v0", seed=seed))
    return out


def test_the_prompt_holds_the_contract_for_recurring_tasks_and_for_lessons() -> None:
    contract = fill(ENTRY_CONTRACT, max_entry_chars=160)
    assert "a fact about one task, for when it comes again" in contract
    assert "the task's name and what won or lost it, such as the winning actions in order" in contract
    assert "a lesson for other tasks too" in contract
    for r in _recall_requests():
        p = build_distillation_prompt(r, 1500, max_entry_chars=160)
        assert contract in p
        # the rules that forbade Recall's only useful entry are gone
        assert "never copy the trajectory" not in p and "one-off details" not in p
    # EDGE's reflection writes entries under the same contract
    fail, win = _recall_requests()[1], _recall_requests()[0]
    assert contract in build_reflection_prompt("amber", [fail], [win], max_entry_chars=160)


def test_fixed_text_precedes_every_variable_part() -> None:
    a, b = _recall_requests()
    pa, pb = (build_distillation_prompt(r, 1500, max_entry_chars=160) for r in (a, b))
    head = distillation_instructions(max_entry_chars=160)
    shared = os.path.commonprefix([pa, pb])
    assert shared.startswith(head) and len(shared) >= len(head)  # the whole instruction text is common
    for r, p in ((a, pa), (b, pb)):
        for part in (r.task, "SUCCESS" if r.success else "FAILURE", r.trajectory.steps[0].action):
            assert p.index(part) >= len(head), part
    # the guided episode's update rule and entry are variable: after the instructions, never in them
    assert pb.index('{"op":"update","id":17') > len(head) and pb.index("Task bold heron") > len(head)
    assert "update" not in head and '"op":"update"' not in pa
    # the instructions are everything before the first placeholder of an episode's part
    first = min(DISTILLATION_TEMPLATE.index(k) for k in ("{task}", "{outcome}", "{experience}", "{trajectory}"))
    assert head == fill(DISTILLATION_TEMPLATE[:first], max_ops=MAX_OPS, max_entry_chars=160)


def test_the_common_token_prefix_of_two_chat_prompts_covers_the_instructions() -> None:
    # what a batched generation encodes once: the chat-rendered prompts' common token prefix
    from crl_train.policy.chat import ChatFormatter
    from crl_train.policy.tiny import train_tiny_tokenizer

    prompts = [build_distillation_prompt(r, 1500, max_entry_chars=160) for r in _recall_requests()]
    chat = ChatFormatter(train_tiny_tokenizer(prompts, vocab_size=600))
    ids = [chat.prompt_ids([{"role": "user", "content": p}]) for p in prompts]
    common = next((i for i, (x, y) in enumerate(zip(*ids, strict=False)) if x != y), min(map(len, ids)))
    shared_text = chat.tokenizer.decode(ids[0][:common])
    assert distillation_instructions(max_entry_chars=160) in shared_text


def test_the_instructions_are_short() -> None:
    # 162 SmolLM2 tokens at max_entry_chars=160 (docs/experience.md); the previous prompt's fixed
    # text was 1,465 characters (381 tokens for a free episode, 421 for a guided one)
    for chars in (64, 160, DEFAULT_MAX_LEN):
        assert len(distillation_instructions(max_entry_chars=chars)) <= 700
    assert len(DISTILLATION_TEMPLATE) <= 800


@pytest.mark.parametrize("max_entry_chars", [64, 160, DEFAULT_MAX_LEN])
def test_the_schema_enforces_the_bounds_the_prompt_states(max_entry_chars: int) -> None:
    head = distillation_instructions(max_entry_chars=max_entry_chars)
    assert f"at most {max_entry_chars} characters" in head and f"1 to {MAX_OPS} operations" in head
    schema = ops_schema(set(), max_ops=MAX_OPS, max_text=max_entry_chars)
    jsonschema.validate([{"op": "add", "text": "x" * max_entry_chars}], schema)
    for bad in ([{"op": "add", "text": "x" * (max_entry_chars + 1)}],
                [{"op": "add", "text": 'the "quoted" word'}],
                [{"op": "add", "text": "a"}] * (MAX_OPS + 1)):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    # the shapes the prompt shows fit the smallest bound too
    for body in re.findall(r"\[\{.*?\}\]", head):
        jsonschema.validate(json.loads(body), schema)
    # an entry the contract asks for on Recall: the task's name and its winning actions
    entry = '[{"op":"add","text":"bold falcon: the winning actions are north, then east."}]'
    assert parse_structured_ops(entry, allowed_update_ids=set(), max_len=max_entry_chars, stats=ParseStats()) == [
        AddOp("bold falcon: the winning actions are north, then east.")]


def test_the_extractor_states_its_own_schema_bound(tmp_path: object) -> None:
    from crl_train.config import ModelConfig
    from crl_train.extractor.worker import TINY_ENTRY_CHARS, ExtractorSpec, build_extractor

    r = _recall_requests()[0]
    texts = (build_distillation_prompt(r, 1500), r.task, "north east south west")
    ext = build_extractor(ExtractorSpec(ModelConfig(model="tiny", max_new_tokens=8), texts=texts))
    try:
        (sample, _), = ext.distill([r])
    finally:
        ext.close()
    assert sample.prompt == build_distillation_prompt(r, ext.max_prompt_chars, max_entry_chars=TINY_ENTRY_CHARS)
    assert f"at most {TINY_ENTRY_CHARS} characters" in sample.prompt
