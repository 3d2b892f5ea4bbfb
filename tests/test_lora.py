"""LoRA (``actor.lora_rank`` / ``extractor.lora_rank``): every loss trains only the adapters, merged
weights are the adapted model's function (what a vLLM engine gets), and a checkpoint resumes the
adapters and their optimizer exactly, in the policy and through ``crl-train --resume``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _trainer_fixtures import tiny_policy
from transformers import AutoModelForCausalLM

from crl_train.algorithms import LOSSES
from crl_train.algorithms.losses import loss_scale_for
from crl_train.policy.base import SUPPORT_IDS, Generation, LossTerm, TokenSequence, TrainBatch
from crl_train.policy.checkpoint import MODEL_DIR, verify_checkpoint
from crl_train.policy.hf import HFPolicy
from crl_train.policy.lora import (
    ADAPTER_DIR,
    LoraSpec,
    adapter_state_dict,
    base_state_dict,
    merged_state_dict,
)

SPEC = LoraSpec(rank=4, alpha=8.0)


def _lora_policy(seed: int = 0) -> HFPolicy:
    policy = tiny_policy(seed)
    policy.enable_lora(SPEC)
    return policy


def _perturb_adapters(policy: HFPolicy) -> None:
    """B starts at 0 (the adapted function equals the base); give it values so the adapters matter."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def _batch(policy: HFPolicy, n: int = 4) -> TrainBatch:
    gen = torch.Generator().manual_seed(2)
    seqs = []
    vocab = len(policy.tokenizer)
    for i in range(n):
        prompt = torch.randint(5, vocab, (6 + i,), generator=gen).tolist()
        resp = torch.randint(5, vocab, (4,), generator=gen).tolist()
        s = TokenSequence()
        s.append_context(prompt)
        s.append_generation(Generation(prompt_ids=prompt, token_ids=resp, logprobs=[-3.0] * len(resp), text=""))
        seqs.append(s)
    return TrainBatch.from_sequences(seqs, [1.0, -1.0, 0.5, -0.5][:n], policy.pad_token_id,
                                     group_ids=[0] * n, condition_ids=[0, 1] * (n // 2))


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_only_the_adapters_train_and_the_base_is_untouched() -> None:
    policy = _lora_policy()
    trainable = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    base_before = {k: v.clone() for k, v in base_state_dict(policy.model).items()}
    adapters_before = {k: v.clone() for k, v in adapter_state_dict(policy.model).items()}
    batch = _batch(policy)
    batch.old_logprobs = policy.logprobs(batch)
    m = policy.train_step(batch, LOSSES.get("clip"), loss_scale="samples", clip_eps=0.2)
    assert m["skipped"] == 0.0 and policy.optimizer is not None
    assert sum(p.numel() for g in policy.optimizer.param_groups for p in g["params"]) == sum(
        p.numel() for n, p in policy.model.named_parameters() if "lora_" in n)
    assert all(torch.equal(v, base_state_dict(policy.model)[k]) for k, v in base_before.items())
    assert any(not torch.equal(v, adapter_state_dict(policy.model)[k]) for k, v in adapters_before.items())


@pytest.mark.parametrize("loss", ["clip", "cispo", "reverse_kl_sampled", "reverse_kl_topk", "self_distill_nll"])
def test_every_loss_of_the_project_trains_the_adapters(loss: str) -> None:
    """GRPO's clip, CISPO, EDGE's two reverse KLs and self-distillation, on an adapted model."""
    policy = _lora_policy()
    _perturb_adapters(policy)
    batch = _batch(policy)
    batch.old_logprobs = policy.logprobs(batch)
    if loss == "reverse_kl_sampled":
        batch.extra["teacher"] = batch.old_logprobs - 0.5
    if loss == "reverse_kl_topk":
        ids, lp = policy.support_logprobs(batch, k=5)
        batch.extra[SUPPORT_IDS] = ids
        batch.extra["teacher_support"] = lp - 0.5
    before = {k: v.clone() for k, v in adapter_state_dict(policy.model).items()}
    m = policy.train_objective([LossTerm(batch, LOSSES.get(loss), loss_scale_for(loss), {}, name=loss)])
    assert m["skipped"] == 0.0 and torch.isfinite(torch.tensor(m["loss"])) and m["grad_norm"] > 0
    assert any(not torch.equal(v, adapter_state_dict(policy.model)[k]) for k, v in before.items())


def test_merged_weights_are_the_adapted_models_function() -> None:
    policy = _lora_policy()
    _perturb_adapters(policy)
    ids = torch.randint(5, len(policy.tokenizer), (2, 12), generator=torch.Generator().manual_seed(3))
    adapted = _logits(policy.model, ids)
    plain = AutoModelForCausalLM.from_config(policy.model.config)
    plain.load_state_dict(merged_state_dict(policy.model), strict=True)
    plain.eval()
    torch.testing.assert_close(_logits(plain, ids), adapted, atol=1e-5, rtol=1e-5)
    base = AutoModelForCausalLM.from_config(policy.model.config)
    base.load_state_dict(base_state_dict(policy.model), strict=True)
    base.eval()
    assert not torch.allclose(_logits(base, ids), adapted, atol=1e-4)  # the adapters do change the function


class _Engine:
    """Stand-in for a vLLM engine (no vLLM on CPU): records what ``sync_weights`` pushes."""

    logprobs_exact = True
    structured_outputs = False

    def __init__(self) -> None:
        self.pushed: list[dict[str, torch.Tensor]] = []

    def sync_weights(self, named: Any) -> int:
        self.pushed.append({k: v.detach().clone() for k, v in named})
        return len(self.pushed[-1])

    def generate(self, prompts: Any, max_new_tokens: int, **kw: Any) -> list[Generation]:
        raise AssertionError("not called here")


def test_the_generator_gets_merged_weights_under_the_base_names_after_each_update() -> None:
    policy = _lora_policy()
    _perturb_adapters(policy)
    engine = _Engine()
    policy.attach_generator(engine)  # type: ignore[arg-type]
    names = set(AutoModelForCausalLM.from_config(policy.model.config).state_dict())
    assert set(engine.pushed[0]) == names
    for k, v in merged_state_dict(policy.model).items():
        torch.testing.assert_close(engine.pushed[0][k], v)
    batch = _batch(policy)
    batch.old_logprobs = policy.logprobs(batch)
    policy.train_step(batch, LOSSES.get("cispo"), loss_scale="tokens")
    assert len(engine.pushed) == 2
    changed = [k for k in names if not torch.equal(engine.pushed[0][k], engine.pushed[1][k])]
    assert changed and all(k.endswith("proj.weight") for k in changed)  # only adapted layers move


def test_a_lora_checkpoint_resumes_adapters_and_optimizer_exactly(tmp_path: Path) -> None:
    policy = _lora_policy()
    batch = _batch(policy)
    batch.old_logprobs = policy.logprobs(batch)
    cispo = LOSSES.get("cispo")
    policy.train_step(batch, cispo, loss_scale="tokens")
    policy.save(tmp_path / "ckpt")
    verify_checkpoint(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / ADAPTER_DIR / "adapter_model.safetensors").is_file()
    # model/ is the frozen base in the plain HF layout: any loader reads it
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt" / MODEL_DIR))
    for k, v in base_state_dict(policy.model).items():
        torch.testing.assert_close(plain.state_dict()[k], v)

    resumed = HFPolicy.from_checkpoint(tmp_path / "ckpt")
    assert resumed.step == 1 and resumed.optimizer is not None and policy.optimizer is not None
    for k, v in adapter_state_dict(policy.model).items():
        assert torch.equal(adapter_state_dict(resumed.model)[k], v)
    for a, b in zip(policy.optimizer.state_dict()["state"].values(), resumed.optimizer.state_dict()["state"].values(),
                    strict=True):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    # one more step on each: the same weights (the uninterrupted run and the resumed one agree)
    policy.train_step(batch, cispo, loss_scale="tokens")
    resumed.train_step(batch, cispo, loss_scale="tokens")
    for k, v in merged_state_dict(policy.model).items():
        torch.testing.assert_close(merged_state_dict(resumed.model)[k], v, atol=1e-6, rtol=1e-6)


def test_enable_lora_after_the_first_update_is_refused() -> None:
    policy = tiny_policy()
    batch = _batch(policy)
    batch.old_logprobs = policy.logprobs(batch)
    policy.train_step(batch, LOSSES.get("cispo"), loss_scale="tokens")
    with pytest.raises(ValueError, match="before the first train_step"):
        policy.enable_lora(SPEC)


def test_a_target_that_names_no_layer_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"lora targets \['qkv'\] name no module"):
        tiny_policy().enable_lora(LoraSpec(rank=2, targets=("qkv",)))


BIN = Path(sys.executable).parent
RUN = ["--set", "env.max_turns=3", "--set", "env.kwargs={max_turns: 3}", "--set", "env.tasks_per_step=1",
       "--set", "env.group_size=2", "--set", "train.eval_episodes=0", "--set", "algo.buffer_size=2",
       "--set", "algo.merge_every=0", "--set", "actor.lora_rank=4", "--set", "extractor.lora_rank=4",
       "--set", "actor.lr=0.01", "--set", "extractor.lr=0.01", "--no-progress"]


def _train(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([str(BIN / "crl-train"), *args], capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
def test_crl_train_with_lora_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """The tiny preset with LoRA on both models: 2 steps, then ``--resume`` to 3 (the adapters and
    optimizers of both models come back from the checkpoint)."""
    run = tmp_path / "run"
    proc = _train("--set", "train.steps=2", *RUN, "--out", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for model in ("actor", "extractor"):
        assert (run / "checkpoint" / model / ADAPTER_DIR / "adapter_model.safetensors").is_file(), model
    proc = _train("--resume", str(run), "--set", "train.steps=3", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert json.loads((run / "checkpoint" / "state.json").read_text())["step"] == 2
