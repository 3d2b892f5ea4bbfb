"""Structured extractor answers: every sample of a random tiny model is valid under its schema, the
masks replay exactly (CISPO's ratio), a Merge decision applies to a real bank, and vLLM gets the
same schemas through its structured outputs (checked against vLLM 0.29's API with stand-ins)."""

from __future__ import annotations

import dataclasses
import json
import sys
import types
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from _trainer_fixtures import tiny_policy

from crl_gym.experience.bank import ExperienceBank
from crl_gym.experience.embedders import HashingEmbedder
from crl_gym.experience.merge import MergePrompt, merge_bank, parse_merge_decision
from crl_gym.experience.ops import ParseStats, parse_structured_ops
from crl_gym.experience.prompts import extract_refined_advice
from crl_gym.experience.schemas import (
    max_answer_chars,
    merge_schema,
    ops_schema,
    refinement_schema,
)
from crl_gym.protocol import ReturnOp
from crl_train.config import ExtractorSettings
from crl_train.extractor.model import Extractor, reasoning_end_token
from crl_train.policy.base import Generation, SamplingConfig, TokenSequence, TrainBatch
from crl_train.policy.grammar import JsonGrammar
from crl_train.policy.vllm_engine import (
    STRUCTURED_BACKEND,
    VLLMGenerator,
    engine_structured_config,
    structured_outputs_kwargs,
)

LABELS = [f"E{i}" for i in range(1, 9)] + ["M1", "M2"]
SCHEMAS = {
    "ops_free": (ops_schema(set(), max_text=40), set()),
    "ops_guided": (ops_schema({17}, max_text=40), {17}),
    "refinement": (refinement_schema(40), None),
    "merge": (merge_schema(LABELS, 40), None),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """One torch thread while this module samples: per-token Python work dominates a tiny model, and two
    threads on a busy 2-core machine spin against each other (10x slower here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def policy() -> Any:
    return tiny_policy(3, loss_scale="tokens")


def _generate(policy: Any, grammar: JsonGrammar, n: int, seed: int) -> list[Generation]:
    prompt = policy.apply_chat([{"role": "user", "content": "answer"}])
    budget = max_answer_chars(grammar.schema_dict()) + 1 + grammar.think_tokens
    return list(policy.generate([prompt] * n, budget, allowed=[grammar] * n, sampling=SamplingConfig(seed=seed)))


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_hundreds_of_random_samples_are_all_valid_under_their_schema(policy: Any, name: str) -> None:
    schema, ids = SCHEMAS[name]
    grammar = JsonGrammar.from_schema(schema)
    gens = [g for seed in range(4) for g in _generate(policy, grammar, 60, seed)]
    bound = max_answer_chars(schema)
    texts = set()
    for g in gens:
        assert g.finish_reason == "stop" and g.token_ids[-1] == policy.eos_token_ids[0]  # never cut by the budget
        value = json.loads(g.text)
        jsonschema.validate(value, schema)
        assert len(g.text) <= bound and len(g.token_ids) <= bound + 1
        texts.add(g.text)
        if name.startswith("ops"):
            ops = parse_structured_ops(g.text, allowed_update_ids=ids, max_len=40, stats=ParseStats())
            assert ops and not any(isinstance(op, ReturnOp) and op.malformed for op in ops), (g.text, ops)
        elif name == "merge":
            decision = parse_merge_decision(g.text, LABELS, max_len=40)
            assert sorted(decision.keep + decision.discard + [x for m, _ in decision.merge for x in m]) == sorted(LABELS)
        else:
            assert extract_refined_advice(g.text, "fallback", max_chars=40) == value["advice"].strip()
    assert len(gens) == 240 and len(texts) > 200  # free text under the grammar: the model writes its own


def test_recorded_masks_equal_the_replay_and_recompute_the_sampled_logprobs(policy: Any) -> None:
    """CISPO's ratio is exact: the masks training replays are the masks sampling used."""
    for schema, _ in SCHEMAS.values():
        for grammar in (JsonGrammar.from_schema(schema), JsonGrammar.from_schema(schema, think_tokens=5)):
            gens = _generate(policy, grammar, 6, seed=11)
            seqs = []
            for g in gens:
                assert policy.replay_allowed(grammar, g.token_ids) == g.allowed
                seq = TokenSequence()
                seq.append_context(g.prompt_ids)
                seq.append_generation(g)
                seqs.append(seq)
            batch = TrainBatch.from_sequences(seqs, [0.0] * len(seqs), policy.pad_token_id)
            lp = policy.logprobs(batch)
            for i, g in enumerate(gens):
                start = len(g.prompt_ids)
                assert torch.allclose(lp[i, start:start + len(g.token_ids)], torch.tensor(g.logprobs), atol=1e-4)


def test_replay_refuses_tokens_its_grammar_never_allowed(policy: Any) -> None:
    grammar = JsonGrammar.from_schema(refinement_schema(10))
    bad = policy.tokenizer.encode("ADD: x", add_special_tokens=False)
    with pytest.raises(ValueError, match="not allowed by its grammar"):
        policy.replay_allowed(grammar, bad)


def test_a_thinking_model_reasons_freely_then_answers_under_the_grammar(policy: Any) -> None:
    """A ``reasoning_end`` grammar: free tokens until that token, the schema after it."""
    end = policy.tokenizer.encode("east", add_special_tokens=False)[0]  # stands in for </think>
    grammar = JsonGrammar.from_schema(refinement_schema(20), reasoning_end=end)
    prompt = policy.apply_chat([{"role": "user", "content": "answer"}])
    engine = policy.grammar_engine
    state = engine.start(grammar)
    assert state.allowed() is None  # reasoning: unconstrained
    reasoning = policy.tokenizer.encode("west west ", add_special_tokens=False) + [end]
    for t in reasoning:
        state.advance(t)
    assert state.in_answer and state.allowed() is not None
    gens = policy.generate([prompt] * 20, 200, allowed=[grammar] * 20, sampling=SamplingConfig(seed=4))
    done = [g for g in gens if g.finish_reason == "stop" and end in g.token_ids]
    assert done, "no row reached its reasoning end within the budget"
    for g in done:
        cut = g.token_ids.index(end)
        assert g.allowed is not None and all(a is None for a in g.allowed[: cut + 1])
        answer = policy.tokenizer.decode(g.token_ids[cut + 1:], skip_special_tokens=True)
        if g.token_ids[-1] == policy.eos_token_ids[0] and g.allowed[-1] is not None:
            jsonschema.validate(json.loads(answer), refinement_schema(20))
        assert policy.replay_allowed(grammar, g.token_ids) == g.allowed


def test_reasoning_end_is_detected_only_for_thinking_templates(policy: Any) -> None:
    assert reasoning_end_token(policy) is None  # the tiny tokenizer has no </think>

    class Tok:
        chat_template = "{% if enable_thinking %}...{% endif %}"

        def get_vocab(self) -> dict[str, int]:
            return {"</think>": 9}

        def decode(self, ids: list[int]) -> str:
            return "<|im_start|>assistant\n"

    thinking = types.SimpleNamespace(tokenizer=Tok(), chat=types.SimpleNamespace(chat_kwargs={}),
                                     apply_chat=lambda messages: [1])
    assert reasoning_end_token(thinking) == 9  # a hybrid template thinks unless told not to
    thinking.chat.chat_kwargs = {"enable_thinking": False}
    assert reasoning_end_token(thinking) is None
    Tok.chat_template = "plain"
    thinking.chat.chat_kwargs = {}
    assert reasoning_end_token(thinking) is None


def test_a_merge_decision_of_the_tiny_extractor_is_applied_to_a_real_bank(policy: Any, tmp_path: Path) -> None:
    emb = HashingEmbedder(32)
    bank = ExperienceBank(tmp_path / "bank", dim=32)
    texts = [f"Entry {i}: walk east then north." for i in range(6)]
    ids = [bank.add(t, emb.encode([t])[0]) for t in texts]
    extractor = Extractor(
        policy,
        ExtractorSettings(
            max_new_tokens=48,
            max_context_tokens=1024,
            constrained=True,
            max_entry_chars=40,
        ),
    )
    torch.manual_seed(0)
    report = merge_bank(bank, emb, extractor.merge_generate, token_budget=1500, count_tokens=extractor.count_tokens,
                        order="id")
    assert report.ok and report.windows == 1 and len(report.samples) == 1, report.error
    (prompt,) = report.prompts
    assert isinstance(prompt, MergePrompt) and prompt.labels == tuple(f"E{i}" for i in range(1, 7))
    decision = parse_merge_decision(report.responses[0], list(prompt.labels), max_len=40)
    by_label = dict(zip(prompt.labels, ids, strict=True))
    gone = {by_label[x] for x in decision.discard} | {by_label[x] for m, _ in decision.merge for x in m}
    merged = [t for m, t in decision.merge if len(m) > 1 or texts[ids.index(by_label[m[0]])] != t]
    assert len(bank) == report.entries_after == len(ids) - len(gone) + len(merged)
    assert set(report.deleted) | set(report.updated) <= set(ids)
    for i in ids:
        if i not in gone:
            entry = bank.get(i)
            assert entry is not None and entry.text == texts[ids.index(i)]  # kept untouched
    for anchor, sources in report.updated.items():
        entry = bank.get(anchor)
        assert entry is not None and entry.text == decision.merge[0][1] and set(sources) <= gone
    # the window's sample carries its grammar: its masks replay for CISPO
    assert extractor.allowed_of(report.samples[0]) is not None
    bank.close()
    reopened = ExperienceBank(tmp_path / "bank", dim=32)
    assert len(reopened) == report.entries_after  # applied, not only in memory
    reopened.close()


def test_free_text_extractor_answers_are_not_constrained(policy: Any) -> None:
    extractor = Extractor(
        policy,
        ExtractorSettings(max_new_tokens=8, max_context_tokens=512, structured=False),
    )
    (s,) = extractor.merge_generate([MergePrompt("[E1] a [E2] b", ("E1", "E2"))])
    assert not extractor.grammars and not extractor.constraints and len(s.token_ids) <= 8


# ------------------------------------------------------------------------- vLLM, against its 0.29 API

# Field names copied from vllm 0.29.0's source (vllm/sampling_params.py, vllm/config/structured_outputs.py,
# vllm/entrypoints/llm.py): the stand-ins accept exactly what the real classes do, so a renamed or
# misspelt argument fails here as it would on a GPU.
SAMPLING_PARAMS_FIELDS = {
    "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k", "min_p",
    "seed", "stop", "stop_token_ids", "bad_words", "thinking_token_budget", "include_stop_str_in_output",
    "ignore_eos", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "detokenize", "skip_special_tokens",
    "spaces_between_special_tokens", "output_kind", "stream_interval", "structured_outputs", "logit_bias",
    "allowed_token_ids", "extra_args", "skip_clone", "repetition_detection", "logprob_token_ids",
    "routed_experts_prompt_start", "trace_decode_token_ids",
}
STRUCTURED_CONFIG_FIELDS = {"backend", "disable_any_whitespace", "disable_additional_properties", "reasoning_parser",
                            "reasoning_parser_plugin", "enable_in_reasoning"}
STRUCTURED_BACKENDS = {"auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer"}
LLM_ARGS = {"model", "dtype", "seed", "gpu_memory_utilization", "enforce_eager", "structured_outputs_config",
            # EngineArgs, through **kwargs
            "worker_extension_cls", "logprobs_mode", "max_model_len"}


@dataclasses.dataclass
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:  # vLLM's own check: exactly one kind of constraint
        n = sum(getattr(self, f) is not None for f in ("json", "regex", "choice", "grammar", "json_object",
                                                       "structural_tag"))
        assert n == 1, "vLLM: exactly one structured-output constraint"


class SamplingParams:
    def __init__(self, **kw: Any) -> None:
        assert set(kw) <= SAMPLING_PARAMS_FIELDS, set(kw) - SAMPLING_PARAMS_FIELDS
        self.kw = kw


def _fake_vllm(policy: Any, calls: list[Any]) -> types.ModuleType:
    """A ``vllm`` whose LLM 'generates' with the hf policy itself (under the same grammar when asked)."""

    class LLM:
        def __init__(self, **kw: Any) -> None:
            assert set(kw) <= LLM_ARGS, set(kw) - LLM_ARGS
            cfg = kw["structured_outputs_config"]
            assert set(cfg) <= STRUCTURED_CONFIG_FIELDS and cfg["backend"] in STRUCTURED_BACKENDS
            calls.append(("init", kw))

        def collective_rpc(self, method: str, args: Any) -> None:
            calls.append(("rpc", method))

        def generate(self, prompts: list[dict[str, list[int]]], sampling_params: Any, use_tqdm: bool) -> list[Any]:
            params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
            calls.append(("generate", params))
            out = []
            for p, sp in zip(prompts, params, strict=True):
                so = sp.kw.get("structured_outputs")
                allowed = None if so is None else [JsonGrammar.from_schema(so.json)]
                generator, policy.generator = policy.generator, None  # the engine's own sampling: the hf loop
                (g,) = policy.generate([p["prompt_token_ids"]], sp.kw["max_tokens"], allowed=allowed)
                policy.generator = generator
                comp = types.SimpleNamespace(token_ids=g.token_ids, text=g.text, finish_reason=g.finish_reason,
                                             logprobs=[{t: lp} for t, lp in zip(g.token_ids, g.logprobs, strict=True)])
                out.append(types.SimpleNamespace(request_id="r", outputs=[comp]))
            return out

    vllm = types.ModuleType("vllm")
    vllm.LLM = LLM  # type: ignore[attr-defined]
    vllm.SamplingParams = SamplingParams  # type: ignore[attr-defined]
    sp_mod = types.ModuleType("vllm.sampling_params")
    sp_mod.StructuredOutputsParams = StructuredOutputsParams  # type: ignore[attr-defined]
    vllm.sampling_params = sp_mod  # type: ignore[attr-defined]
    return vllm


def test_vllm_requests_carry_the_same_schema_and_its_masks_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    policy = tiny_policy(5, loss_scale="tokens")
    calls: list[Any] = []
    fake = _fake_vllm(policy, calls)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", fake.sampling_params)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    gen = VLLMGenerator("tiny", policy.tokenizer, reasoning_parser="qwen3")
    init = calls[0][1]
    assert init["structured_outputs_config"] == {"backend": "guidance", "reasoning_parser": "qwen3"}
    assert init["logprobs_mode"] == "processed_logprobs" and gen.structured_outputs and gen.reasoning_parser == "qwen3"
    policy.attach_generator(gen)
    extractor = Extractor(
        policy,
        ExtractorSettings(
            max_new_tokens=40,
            max_context_tokens=1024,
            constrained=True,
            max_entry_chars=40,
        ),
    )
    from crl_gym.protocol import DistillationRequest, Step, Trajectory

    req = DistillationRequest(task="Walk east", trajectory=Trajectory(steps=[Step("cell 0", "east", 0.0)]),
                              outcome=1.0, success=True, experience=None, condition="free")
    (sample, ops), = extractor.distill([req])
    kind, params = calls[-1]
    assert kind == "generate" and len(params) == 1
    so = params[0].kw["structured_outputs"]
    assert isinstance(so, StructuredOutputsParams) and so.json == ops_schema(set(), max_text=40)  # the same schema
    assert so.json["x-guidance"] == {"whitespace_flexible": False, "json_allowed_escapes": ""}
    assert ops and not any(isinstance(op, ReturnOp) and op.malformed for op in ops)
    jsonschema.validate(json.loads(sample.response), so.json)
    # the engine returns no masks: the policy replays them, and training recomputes the engine's log-probs
    seqs = [extractor._sequence(sample)]
    lp = policy.logprobs(TrainBatch.from_sequences(seqs, [0.0], policy.pad_token_id))
    start = len(sample.prompt_token_ids)
    assert torch.allclose(lp[0, start:start + len(sample.token_ids)], torch.tensor(sample.logprobs), atol=1e-4)
    # unconstrained rows still go as plain requests; think_tokens reasoning stays on the hf backend
    policy.generate([[1, 2, 3]], 4)
    assert calls[-1][0] == "generate" and "structured_outputs" not in calls[-1][1][0].kw
    n = len(calls)
    policy.generate([[1, 2, 3]], 80, allowed=[JsonGrammar.from_schema(refinement_schema(10), think_tokens=3)])
    assert len(calls) == n  # served by the hf loop
    with pytest.raises(ValueError, match="hf backend only"):
        gen.generate([[1]], 4, allowed=[["north"]])


def test_structured_request_kwargs_and_engine_config() -> None:
    g = JsonGrammar.from_schema(merge_schema(["E1"], 10))
    assert structured_outputs_kwargs(g) == {"json": merge_schema(["E1"], 10)}
    StructuredOutputsParams(**structured_outputs_kwargs(g))  # vLLM's constructor accepts it
    with pytest.raises(ValueError, match="think_tokens"):
        structured_outputs_kwargs(JsonGrammar.from_schema({"enum": ["a"]}, think_tokens=2))
    assert engine_structured_config(None) == {"backend": STRUCTURED_BACKEND} and STRUCTURED_BACKEND in STRUCTURED_BACKENDS


def test_the_structured_switch_is_on_by_default_documented_and_validated() -> None:
    from click.testing import CliRunner

    from crl_train.cli import train
    from crl_train.config import ConfigError, load_config

    assert load_config(None).extractor.structured is True
    out = CliRunner().invoke(train, ["--show-config"]).output
    extractor = out[out.index("\nextractor:"):]
    assert "structured: true" in extractor and "under their JSON schemas" in extractor
    with pytest.raises(ConfigError, match="extractor.constrained=true .* needs extractor.structured=true"):
        load_config(None, ["extractor.structured=false"])  # the tiny preset's extractor is constrained
    assert load_config(None, ["extractor.structured=false", "extractor.constrained=false"]).extractor.structured is False
    with pytest.raises(ConfigError, match="needs structured=true"):
        load_config(None, ["extractor.structured=false", "extractor.think_tokens=4"])
