"""The action slot (``experience.action_slot``): a distillation answer chooses its entry's actions among
the episode's admissible ones under the grammar. Schema, prompt, parsing, the tiny extractor on a
Recall episode (random-initialised: its choice is a draw, which the grammar keeps admissible), the
reader actor on the entry, CISPO's exact ratios on slot samples, and the config."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import torch
from _trainer_fixtures import tiny_policy

from crl_gym.envs.recall import RecallEnv
from crl_gym.experience.ops import ParseStats, parse_ops, parse_structured_ops
from crl_gym.experience.prompts import (
    build_distillation_prompt,
    distillation_instructions,
    distillation_slot_actions,
)
from crl_gym.experience.schemas import max_answer_chars, ops_schema, slot_schema
from crl_gym.protocol import (
    AddOp,
    DistillationRequest,
    ExperienceRef,
    ReturnOp,
    Step,
    Trajectory,
    UpdateOp,
)
from crl_gym.templates import (
    ACTION_SLOT_RULE,
    ACTION_SLOT_SHAPE,
    ANSWER_SHAPE,
    DISTILLATION_SLOT_TEMPLATE,
    DISTILLATION_TEMPLATE,
    GUIDED_OBSERVATION_TEMPLATE,
)
from crl_train.config import ConfigError, ExtractorSettings, load_config
from crl_train.extractor.model import BufferItem, Extractor, sample_key
from crl_train.policy.base import TrainBatch
from crl_train.policy.reader import ReaderPolicy
from crl_train.service.build import extractor_spec


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """One torch thread: per-token Python work dominates a tiny model on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _request(steps: list[Step], task: str = "Walk east", exp: ExperienceRef | None = None) -> DistillationRequest:
    outcome = sum(s.reward for s in steps)
    return DistillationRequest(task=task, trajectory=Trajectory(steps=steps), outcome=outcome, success=outcome > 0,
                               experience=exp, condition="guided" if exp else "free")


# a trajectory whose steps list admissible actions in several forms, some of them not usable
MIXED = [Step("a", "north", 0.0, {"admissible_actions": ["north", "east"]}),
         Step("b", "east", 0.0, {"admissible_actions": ("east", "south", 3, 'say "hi"')}),
         Step("c", "search_and_ask[where?]", 0.0, {"admissible_actions": ["up"]}, kind="search_and_ask"),
         Step("d", "south", 1.0, {"admissible_actions": "west"})]


# ------------------------------------------------------------------------------------ schema


def test_slot_actions_are_the_union_of_the_env_steps_in_first_seen_order() -> None:
    # a tuple counts, an int, a quoted string, a search_and_ask turn's and a bare string's do not
    assert distillation_slot_actions(_request(MIXED)) == ("north", "east", "south")
    assert distillation_slot_actions(_request([Step("a", "east", 1.0)])) == ()


def test_the_schema_has_the_slot_only_when_asked_and_given_actions() -> None:
    plain = ops_schema({7}, max_ops=2, max_text=20)
    assert ops_schema({7}, max_ops=2, max_text=20, slot_actions=["north"], slot_size=0) == plain
    assert ops_schema({7}, max_ops=2, max_text=20, slot_actions=(), slot_size=2) == plain
    assert list(plain["prefixItems"][0]["anyOf"][0]["properties"]) == ["op", "text"]

    s = ops_schema({7}, max_ops=2, max_text=20, slot_actions=["north", "east", "south"], slot_size=2)
    add, ret, update = (s["prefixItems"][0]["anyOf"][i] for i in (0, 2, 1))
    slot = {"type": "array", "items": {"enum": ["north", "east", "south"]}, "minItems": 1, "maxItems": 2}
    assert list(add["properties"]) == ["op", "actions", "text"] and add["required"] == ["op", "actions", "text"]
    assert list(update["properties"]) == ["op", "id", "actions", "text"] and update["properties"]["actions"] == slot
    assert add["properties"]["actions"] == slot and "actions" not in ret["properties"]
    assert s["items"]["anyOf"][0]["properties"]["actions"] == slot  # the later adds too

    ok = [{"op": "update", "id": 7, "actions": ["south", "north"], "text": "x"}, {"op": "add", "actions": ["east"],
                                                                                  "text": "y"}]
    jsonschema.validate(ok, s)
    for bad in ([{"op": "add", "actions": [], "text": "x"}], [{"op": "add", "actions": ["up"], "text": "x"}],
                [{"op": "add", "actions": ["east"] * 3, "text": "x"}], [{"op": "add", "text": "x"}],
                [{"op": "add", "text": "x", "actions": "east"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, s)


def test_max_answer_chars_bounds_the_slot() -> None:
    s = ops_schema(set(), max_ops=1, max_text=5, max_reason=1, slot_actions=["up", "south"], slot_size=2)
    longest = '[{"op":"add","actions":["south","south"],"text":"abcde"}]'
    assert max_answer_chars(s) == len(longest) == 57
    jsonschema.validate(json.loads(longest), s)


def test_a_slot_refuses_actions_the_grammar_cannot_write() -> None:
    for actions, size in ((["say \"hi\""], 1), ([" north"], 1), (["north", "north"], 1), ([], 1), (["north"], 9)):
        with pytest.raises(ValueError, match="slot_schema"):
            slot_schema(actions, size)
    with pytest.raises(ValueError, match="slot_size"):
        ops_schema(set(), slot_actions=["north"], slot_size=9)


# ------------------------------------------------------------------------------------ prompt


def test_the_prompt_names_the_field_only_when_the_slot_is_on() -> None:
    free = _request(MIXED, task="Task amber badger: repeat the 1 secret actions of amber badger.")
    guided = _request(MIXED[:1], task="Task bold falcon: repeat it.", exp=ExperienceRef(4, "Play east.", 0))
    off = build_distillation_prompt(free, max_entry_chars=160)
    assert '"actions"' not in off and "admissible" not in off
    assert off == build_distillation_prompt(free, max_entry_chars=160, action_slot=0)  # off: today's prompt
    on = [build_distillation_prompt(r, max_entry_chars=160, action_slot=2) for r in (free, guided)]
    head = distillation_instructions(max_entry_chars=160, action_slot=2)
    assert head.rstrip().endswith("## Task") and all(p.startswith(head) for p in on)  # one shared prefix
    assert ('shaped like [{"op":"add","actions":["the action to play"],"text":"Task name: the fact or the lesson."}]'
            in head)
    assert "\nactions: up to 2 actions to play in order, from the episode's admissible actions.\n" in head
    assert '"id":4,"actions":[...]' in on[1] and '"actions"' not in distillation_instructions(max_entry_chars=160)


def test_the_slot_template_differs_from_the_contract_only_in_its_two_lines() -> None:
    assert ANSWER_SHAPE in DISTILLATION_TEMPLATE and ACTION_SLOT_SHAPE in DISTILLATION_SLOT_TEMPLATE
    back = DISTILLATION_SLOT_TEMPLATE.replace(ACTION_SLOT_RULE + "\n", "").replace(ACTION_SLOT_SHAPE, ANSWER_SHAPE)
    assert back == DISTILLATION_TEMPLATE


# ------------------------------------------------------------------------------------ parsing


def test_an_op_with_actions_puts_them_first() -> None:
    text = '[{"op":"update","id":7,"actions":["north","south"],"text":"Task amber badger: won."},' \
           '{"op":"add","actions":["east"],"text":"When lost, go east."}]'
    assert parse_structured_ops(text, allowed_update_ids={7}, stats=ParseStats()) == [
        UpdateOp(id=7, text="Play north, then south. Task amber badger: won."),
        AddOp(text="Play east. When lost, go east.")]
    assert parse_ops(text, allowed_update_ids={7}, stats=ParseStats())[1] == AddOp(text="Play east. When lost, go east.")
    # without the field: as before
    assert parse_structured_ops('[{"op":"add","text":"Go east."}]', stats=ParseStats()) == [AddOp(text="Go east.")]


def test_the_slot_bounds_the_text_not_the_actions() -> None:
    text = '[{"op":"add","actions":["north","south"],"text":"abcde"}]'
    assert parse_structured_ops(text, max_len=5, stats=ParseStats()) == [AddOp(text="Play north, then south. abcde")]


@pytest.mark.parametrize("actions", ['"north"', "[]", "[3]", '["north", ""]', "null", "[" + ",".join(['"up"'] * 9) + "]"])
def test_malformed_actions_are_a_counted_malformed_op(actions: str) -> None:
    stats = ParseStats()
    text = f'[{{"op":"add","actions":{actions},"text":"Go."}},{{"op":"add","text":"Kept."}}]'
    ops = parse_structured_ops(text, stats=stats)
    assert ops == [ReturnOp(reason="bad_actions", malformed=True), AddOp(text="Kept.")]
    assert stats.snapshot()["malformed_by_reason"] == {"bad_actions": 1}
    assert parse_ops(text, stats=stats)[0] == ReturnOp(reason="bad_actions", malformed=True)
    assert stats.snapshot()["malformed_by_reason"] == {"bad_actions": 2}


# ------------------------------------------------------------------------------------ the tiny extractor


def _recall_requests(n: int) -> tuple[list[DistillationRequest], tuple[str, ...]]:
    """``n`` finished Recall episodes (L = 1, A = 4), each one step, played with the wrong and right actions."""
    env = RecallEnv(num_tasks=4, length=1, num_actions=4)
    reqs = []
    for seed in range(n):
        obs, info = env.reset(seed=seed)
        action = env.secret[0] if seed % 2 else "north" if env.secret[0] != "north" else "east"
        _, reward, _, _, after = env.step(action)
        reqs.append(_request([Step(obs, action, float(reward), after)], task=info["task"]))
    return reqs, tuple(info["admissible_actions"])


@pytest.fixture(scope="module")
def slot_run() -> tuple[Extractor, list[DistillationRequest], list[Any], tuple[str, ...]]:
    ext = Extractor(
        tiny_policy(1, loss_scale="tokens"),
        ExtractorSettings(
            max_new_tokens=40,
            max_context_tokens=1024,
            max_prompt_chars=600,
            constrained=True,
            max_entry_chars=32,
            action_slot=1,
            cooldown=0,
        ),
    )
    reqs, admissible = _recall_requests(6)
    no_actions = _request([Step("cell 0", "east", 1.0)])  # an env that lists no admissible actions
    return ext, [*reqs, no_actions], ext.distill([*reqs, no_actions]), admissible


def test_a_tiny_extractor_chooses_its_entry_actions_among_the_envs(slot_run: Any) -> None:
    ext, reqs, out, admissible = slot_run
    assert admissible == ("north", "east", "south", "west")
    entries = []
    for r, (s, ops) in zip(reqs[:-1], out[:-1], strict=True):
        jsonschema.validate(json.loads(s.response), ops_schema(set(), max_text=32, slot_actions=admissible, slot_size=1))
        assert not any(isinstance(op, ReturnOp) and op.malformed for op in ops)
        for op in ops:
            if isinstance(op, AddOp):
                first = op.text.split(".")[0]
                assert first.startswith("Play ") and first[5:] in admissible, op.text
                entries.append(op.text)
        assert "up to 1 actions" in s.prompt and r.task in s.prompt
    assert entries  # a random model writes adds as well as returns under this seed
    # the request without admissible actions: no slot in its prompt or its grammar, counted
    s, ops = out[-1]
    assert '"actions"' not in s.prompt and '"actions"' not in ext.grammars[sample_key(s)].schema
    assert '"actions"' in ext.grammars[sample_key(out[0][0])].schema
    assert '"actions"' not in s.response and ext.slotless_requests == 1


def test_the_reader_plays_the_slot_action(slot_run: Any) -> None:
    _, _, out, admissible = slot_run
    entry = next(op.text for _, ops in out[:-1] for op in ops if isinstance(op, AddOp))
    chosen = entry.split(".")[0][len("Play "):]
    reader = ReaderPolicy(seed=0)
    obs = GUIDED_OBSERVATION_TEMPLATE.format(experience=entry, observation="Task amber badger. Turn 1: action 1 of 1?")
    gen, = reader.generate([reader.apply_chat([{"role": "user", "content": obs}])], 16, allowed=[list(admissible)])
    assert gen.text == chosen and sum(gen.logprobs) == 0.0  # a named action: played with probability 1


def test_cispo_recomputes_the_sampled_logprobs_of_slot_samples(slot_run: Any) -> None:
    ext, _, out, _ = slot_run
    samples = [s for s, _ in out[:2]]
    assert all('"actions"' in ext.grammars[sample_key(s)].schema for s in samples)
    seqs = [ext._sequence(s) for s in samples]
    batch = TrainBatch.from_sequences(seqs, [0.0, 0.0], ext.policy.pad_token_id)
    new = ext.policy.logprobs(batch)
    for i, s in enumerate(samples):
        start = len(s.prompt_token_ids)
        assert torch.allclose(new[i, start:start + len(s.token_ids)], torch.tensor(s.logprobs), atol=1e-4)
    version = ext.version
    metrics = ext.train([BufferItem(samples[0], 1.0, None, 0), BufferItem(samples[1], 0.0, None, 0)], [0, 0],
                        [-1, -1], step=1)
    assert ext.version == version + 1 and metrics["samples"] == 2.0 and metrics["reward_mean"] == 0.5


# ------------------------------------------------------------------------------------ config and suite


def test_the_config_key_is_validated_and_reaches_the_extractor() -> None:
    assert load_config(None, []).experience.action_slot == 0
    cfg = load_config(None, ["experience.action_slot=2"])
    assert extractor_spec(cfg, None).extractor_settings.action_slot == 2
    for bad in ("-1", "9"):
        with pytest.raises(ConfigError, match=r"experience\.action_slot must be in \[0, 8\]"):
            load_config(None, [f"experience.action_slot={bad}"])
    with pytest.raises(ValueError, match="action_slot"):
        Extractor(tiny_policy(1), ExtractorSettings(action_slot=9))


def test_the_slot_suite_is_small_recall_extractor_before_its_resizing_with_the_slot_on_every_row() -> None:
    """small_recall_slot ran the earlier small_recall_extractor with the slot on; that suite now has
    the slot itself and was re-sized to learn (balanced secrets, 8 tasks a step, B_phi 8, lr 3e-4,
    T 1.0, 50 steps, and the probe's one op per answer and per-sample normaliser): the two differ in
    exactly those settings."""
    import dataclasses
    from pathlib import Path

    from crl_train.experiment.suite import cell_config, cells, load_suite

    experiments = Path(__file__).resolve().parents[1] / "experiments"
    slot, base = (load_suite(experiments / f"{n}.yaml") for n in ("small_recall_slot", "small_recall_extractor"))
    assert slot.name == "small_recall_slot" and slot.seeds == base.seeds
    assert base.rows == (*slot.rows, "static_online_named", "complementary_named")
    assert slot.reading is not None and slot.reading.endswith("docs/results/small_recall_slot/reading.md")
    text = (experiments / "small_recall_slot.yaml").read_text()
    assert "crl-experiment --suite experiments/small_recall_slot.yaml --out runs/suite_small_recall_slot" in text
    for c, b in zip(cells(slot), [b for b in cells(base) if b.method in slot.rows], strict=True):
        cfg, ref = cell_config(slot, c), cell_config(base, b)
        assert cfg.experience.action_slot == 1 and ref.experience.action_slot == 1
        assert (cfg.env.tasks_per_step, ref.env.tasks_per_step) == (2, 8)
        assert (cfg.algo.buffer_size, ref.algo.buffer_size) == (4, 8)
        assert (cfg.train.steps, ref.train.steps) == (15, 50)
        assert (cfg.experience.max_ops, ref.experience.max_ops) == (3, 1)
        assert (cfg.algo.cispo_normalisation, ref.algo.cispo_normalisation) == ("tokens", "sequences")
        assert "secret_seed" not in cfg.env.kwargs and ref.env.kwargs["secret_seed"] == 3
        resized_env = dataclasses.replace(ref.env, tasks_per_step=cfg.env.tasks_per_step,
                                          kwargs={k: v for k, v in ref.env.kwargs.items() if k != "secret_seed"})
        resized_extractor = dataclasses.replace(ref.extractor, lr=cfg.extractor.lr, temperature=cfg.extractor.temperature)
        assert (ref.extractor.lr, ref.extractor.temperature) == (3e-4, 1.0)
        assert cfg.extractor == resized_extractor and cfg.env == resized_env and cfg.method == ref.method
        assert cfg.experience == dataclasses.replace(ref.experience, max_ops=cfg.experience.max_ops)
        assert cfg.algo == dataclasses.replace(ref.algo, buffer_size=4, cispo_normalisation="tokens")
