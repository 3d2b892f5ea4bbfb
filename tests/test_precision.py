"""CPU mixed precision (``crl_train.policy.precision``, ``HFPolicy.set_compute_dtype``, ``dtype: auto``).

bfloat16 compute keeps what is trained (LoRA adapters, or every weight) and AdamW's state in float32,
and stores the frozen base in bf16. Sampling decodes token by token on cached keys/values and
training runs whole sequences; bf16 rounds the two apart, so a 16-bit policy says its sampled
log-probs are inexact and π_old is recomputed through the training forward
(``recompute_old_logprobs``, as the trainer and the extractor do): CISPO's first, on-policy epoch
then sees ρ ≈ 1. Bound on the bf16 log-ratio: max |log ρ| < 0.1 means no on-policy token falls
outside CISPO's default clip range [0.9, 1.1] (|log 0.9| = 0.105); the mean stays a tenth of that.
float32's bound is float rounding.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from test_prefix_sharing import _llama_policy, _prompts  # noqa: E402

from crl_train.algorithms import LOSSES  # noqa: E402
from crl_train.config import ExtractorSettings, ModelConfig  # noqa: E402
from crl_train.policy import checkpoint as checkpoint_mod  # noqa: E402
from crl_train.policy.base import Generation, TokenSequence, TrainBatch, recompute_old_logprobs  # noqa: E402
from crl_train.policy.factory import build_policy, model_dtype  # noqa: E402
from crl_train.policy.hf import HFPolicy, resolve_dtype  # noqa: E402
from crl_train.policy.lora import LoraSpec  # noqa: E402
from crl_train.policy.precision import cpu_bf16_supported  # noqa: E402

BOUNDS = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (0.01, 0.1)}
"""dtype -> (bound on mean |log ρ|, bound on max |log ρ|) of the first, on-policy CISPO epoch."""


def test_auto_follows_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpoint_mod, "cpu_bf16_supported", lambda: True)
    assert resolve_dtype("auto", "cpu") == torch.bfloat16
    monkeypatch.setattr(checkpoint_mod, "cpu_bf16_supported", lambda: False)
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda:0") == torch.bfloat16 and resolve_dtype("float32", "cpu") == torch.float32
    # the tiny model stays float32 under auto; a real model follows the CPU; a named dtype is kept
    assert model_dtype(ModelConfig(model="tiny")) == "float32"
    assert model_dtype(ModelConfig(model="smollm2-135m")) == "auto"
    assert model_dtype(ModelConfig(model="tiny", dtype="bfloat16")) == "bfloat16"


def test_cpu_flags_are_read() -> None:
    flags = Path("/proc/cpuinfo").read_text(encoding="utf-8") if Path("/proc/cpuinfo").exists() else ""
    if flags:
        assert cpu_bf16_supported() == any(f" {f}" in flags for f in ("amx_bf16", "avx512_bf16"))


def _sampled_batch(policy: HFPolicy, prompts: list[list[int]], new_tokens: int, advantages: list[float]) -> TrainBatch:
    """One sampled answer per prompt, as a batch with its sampling-time log-probs as π_old."""
    seqs = []
    for p, g in zip(prompts, policy.generate(prompts, new_tokens), strict=True):
        s = TokenSequence()
        s.append_context(p)
        s.append_generation(g)
        seqs.append(s)
    return TrainBatch.from_sequences(seqs, advantages, policy.pad_token_id)


def _on_policy_log_ratios(policy: HFPolicy, new_tokens: int = 24) -> torch.Tensor:
    """|log ρ| of every trained token of one CISPO step right after sampling (the same weights)."""
    prompts = _prompts(policy) * 2
    batch = _sampled_batch(policy, prompts, new_tokens, [1.0, -1.0] * (len(prompts) // 2))
    assert recompute_old_logprobs(policy, batch) == (policy.autocast_dtype is not None)
    seen: list[torch.Tensor] = []
    cispo = LOSSES.get("cispo")

    def recording(lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, **kw: object
                  ) -> tuple[torch.Tensor, dict[str, float]]:
        seen.append((lp.detach() - old)[mask.bool()].abs())
        return cispo(lp, old, adv, mask, **kw)

    metrics = policy.train_step(batch, recording, loss_scale="tokens")
    assert metrics["skipped"] == 0.0
    return torch.cat(seen)


def _lora_llama(dtype: torch.dtype) -> HFPolicy:
    policy = _llama_policy()
    policy.set_compute_dtype(dtype)
    policy.enable_lora(LoraSpec(8, 16.0))
    with torch.no_grad():  # adapters that change the function (B = 0 would leave it the base's)
        gen = torch.Generator().manual_seed(1)
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return policy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_lora_first_cispo_epoch_is_on_policy(dtype: torch.dtype) -> None:
    policy = _lora_llama(dtype)
    trained = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
    ratios = _on_policy_log_ratios(policy)
    mean_bound, max_bound = BOUNDS[dtype]
    assert ratios.numel() > 50
    assert float(ratios.mean()) < mean_bound and float(ratios.max()) < max_bound, (float(ratios.mean()), float(ratios.max()))
    frozen = {p.dtype for p in policy.model.parameters() if not p.requires_grad}
    assert frozen == {dtype}  # the base is stored in the compute dtype
    assert {p.dtype for p in policy.model.parameters() if p.requires_grad} == {torch.float32}
    assert policy.optimizer is not None
    states = [v for s in policy.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    assert states and {v.dtype for v in states} == {torch.float32}
    changed = [n for n, p in policy.model.named_parameters() if p.requires_grad and not torch.equal(p, trained[n])]
    assert changed  # the adapters learned


def test_full_weights_train_in_float32_under_bf16_compute() -> None:
    """The actor without LoRA: every weight trains, so every weight stays float32 (autocast casts per forward)."""
    policy = build_policy(ModelConfig(model="tiny", tiny_vocab_size=300, dtype="bfloat16", lr=1e-3),
                          ["Task amber falcon: east west north south"], loss_scale="tokens", seed=0, checkpoint=None)
    assert isinstance(policy, HFPolicy) and policy.autocast_dtype == torch.bfloat16
    ratios = _on_policy_log_ratios(policy, new_tokens=12)
    assert float(ratios.mean()) < BOUNDS[torch.bfloat16][0] and float(ratios.max()) < BOUNDS[torch.bfloat16][1]
    assert {p.dtype for p in policy.model.parameters()} == {torch.float32}


def test_checkpoint_round_trip_keeps_the_split(tmp_path: Path) -> None:
    policy = _lora_llama(torch.bfloat16)
    _on_policy_log_ratios(policy, new_tokens=6)
    policy.save(tmp_path / "ck")
    loaded = HFPolicy.from_checkpoint(tmp_path / "ck", dtype="bfloat16")
    assert loaded.autocast_dtype == torch.bfloat16
    assert {p.dtype for p in loaded.model.parameters() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in loaded.model.parameters() if not p.requires_grad} == {torch.bfloat16}
    for (n, a), (m, b) in zip(policy.model.state_dict().items(), loaded.model.state_dict().items(), strict=True):
        assert n == m and torch.equal(a, b), n
    full = HFPolicy.from_checkpoint(tmp_path / "ck", dtype="float32")
    assert full.autocast_dtype is None and {p.dtype for p in full.model.parameters()} == {torch.float32}


def test_a_checkpoint_resumes_in_the_dtype_it_computed_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A float32 run resumed on a CPU where ``auto`` means bf16 goes on in float32 (its numbers stay
    the interrupted run's); an explicit dtype still wins."""
    policy = _lora_llama(torch.float32)
    _on_policy_log_ratios(policy, new_tokens=4)
    policy.save(tmp_path / "ck")
    monkeypatch.setattr(checkpoint_mod, "cpu_bf16_supported", lambda: True)
    assert resolve_dtype("auto", "cpu") == torch.bfloat16
    assert HFPolicy.from_checkpoint(tmp_path / "ck").autocast_dtype is None
    assert HFPolicy.from_checkpoint(tmp_path / "ck", dtype="auto").autocast_dtype == torch.bfloat16
    built = build_policy(ModelConfig(model="tiny", dtype="auto"), None, loss_scale="tokens", seed=0, checkpoint=tmp_path / "ck")
    assert isinstance(built, HFPolicy) and built.autocast_dtype is None


def test_sixteen_bit_sampling_is_recomputed_and_float32_is_not() -> None:
    """The sampled log-probs of a bf16 policy are replaced by the training forward's; a float32
    policy's are already those (within rounding) and are kept."""
    for dtype, exact in ((torch.float32, True), (torch.bfloat16, False)):
        policy = _lora_llama(dtype)
        assert policy.sampled_logprobs_exact is exact
        prompts = _prompts(policy)
        batch = _sampled_batch(policy, prompts, 6, [0.0] * len(prompts))
        sampled = batch.old_logprobs.clone()
        assert recompute_old_logprobs(policy, batch) is not exact
        mask = batch.loss_mask.bool()
        assert torch.equal(batch.old_logprobs[mask], (policy.logprobs(batch) if not exact else sampled)[mask])
        assert torch.allclose(batch.old_logprobs[mask], sampled[mask], atol=1e-4 if exact else 0.5)


def _smollm2(dtype: str) -> HFPolicy:
    from crl_train.policy.base import SamplingConfig
    from crl_train.policy.packaged import resolve_model

    policy = HFPolicy.from_pretrained(resolve_model("smollm2-135m"), dtype=dtype,
                                      sampling=SamplingConfig(temperature=0.7, seed=0))
    policy.enable_lora(LoraSpec(16, 32.0))
    return policy


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
        not cpu_bf16_supported(), reason="this CPU has no bf16 matrix units (emulated bf16 is ~70x slower here)")),
], ids=["float32", "bfloat16"])
def test_smollm2_first_cispo_epoch_is_on_policy(dtype: torch.dtype) -> None:
    policy = _smollm2(str(dtype).removeprefix("torch."))
    ratios = _on_policy_log_ratios(policy, new_tokens=16)
    mean_bound, max_bound = BOUNDS[dtype]
    assert float(ratios.mean()) < mean_bound and float(ratios.max()) < max_bound, (float(ratios.mean()), float(ratios.max()))


def test_the_extractor_records_pi_old_as_training_computes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """An extractor whose policy samples inexact log-probs records the training forward's at
    sampling time, under the weights that sampled (CISPO's ratio is against those). The tiny model's
    bf16 sampling happens to round like its training here; an AMX CPU's does not, so the sampler's
    log-probs are shifted by hand to stand in for that."""
    from crl_train.extractor.model import Extractor
    from crl_train.policy.tiny import build_tiny_policy

    policy = build_tiny_policy(["Task amber falcon: east west north south"], vocab_size=300, seed=0)
    sample = policy.generate

    def shifted(*args: object, **kwargs: object) -> list[Generation]:
        gens = sample(*args, **kwargs)  # type: ignore[arg-type]
        for g in gens:
            g.logprobs = [x - 0.05 for x in g.logprobs]
        return gens

    monkeypatch.setattr(policy, "generate", shifted)
    ext = Extractor(
        policy,
        ExtractorSettings(max_new_tokens=6, max_context_tokens=256, structured=False),
    )
    for exact in (True, False):
        monkeypatch.setattr(HFPolicy, "sampled_logprobs_exact", property(lambda self, e=exact: e))
        samples = ext.generate(["Task amber falcon:", "Task amber falcon: east west"], None)
        batch = TrainBatch.from_sequences([ext._sequence(s) for s in samples], [0.0, 0.0], policy.pad_token_id)
        trained = policy.logprobs(batch)
        for i, s in enumerate(samples):
            start = len(s.prompt_token_ids)
            want = trained[i, start : start + len(s.token_ids)]
            got = torch.tensor(s.logprobs)
            assert torch.allclose(got, want if not exact else want - 0.05, atol=1e-4), (exact, got, want)
