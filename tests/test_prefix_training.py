"""Training that runs a micro-batch's shared prompt prefix once (``crl_train.policy.shared_forward``).

The gradient must be today's (every row in full) within float rounding, with LoRA adapters (which
change the prefix's keys/values, so its gradient matters) and with full weights, and must not depend
on how the batch is split into micro-batches. The spy on the model's forward makes sure the prefix
really ran once at batch 1, so the comparison is not of one path with itself.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from test_prefix_sharing import INSTRUCTIONS, SUFFIXES, _llama_policy  # noqa: E402

from crl_train.algorithms import LOSSES  # noqa: E402
from crl_train.policy.base import Generation, SamplingConfig, TokenSequence, TrainBatch  # noqa: E402
from crl_train.policy.hf import SHARE_PREFIX_TOKENS, HFPolicy  # noqa: E402
from crl_train.policy.lora import LoraSpec  # noqa: E402
from crl_train.policy.shared_forward import common_prefix_len, trained_offset  # noqa: E402


def test_offset_and_prefix_by_hand() -> None:
    assert trained_offset(torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 0, 1]])) == 2
    assert trained_offset(torch.tensor([[0, 1, 1]])) == 0
    assert trained_offset(torch.zeros((2, 4))) == 0  # nothing trained
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 9], [5, 6, 7, 1]])
    assert common_prefix_len(ids, cap=4) == 2 and common_prefix_len(ids, cap=1) == 1
    assert common_prefix_len(ids[[0, 2]], cap=4) == 3 and common_prefix_len(ids, cap=0) == 0


def _batch(policy: HFPolicy, n: int, new_tokens: int = 12) -> TrainBatch:
    """``n`` sampled answers to prompts that share the instructions (suffixes of different lengths,
    so the rows' prompt and answer lengths differ), with signed advantages."""
    prompts = [policy.apply_chat([{"role": "user", "content": INSTRUCTIONS + SUFFIXES[i % len(SUFFIXES)]}])
               for i in range(n)]
    gens: list[Generation] = policy.generate(prompts, new_tokens)
    seqs = []
    for p, g in zip(prompts, gens, strict=True):
        s = TokenSequence()
        s.append_context(p)
        s.append_generation(g)
        seqs.append(s)
    adv = [((-1.0) ** i) * (1.0 + 0.25 * i) for i in range(n)]
    return TrainBatch.from_sequences(seqs, adv, policy.pad_token_id)


class _Shapes:
    """The ``input_ids`` shapes the model is called with inside the block."""

    def __init__(self, policy: HFPolicy) -> None:
        self.policy, self.shapes = policy, []
        self._forward = policy.model.forward

    def __enter__(self) -> _Shapes:
        @functools.wraps(self._forward)
        def spy(*a: Any, **kw: Any) -> Any:
            self.shapes.append(tuple(kw["input_ids"].shape))
            return self._forward(*a, **kw)
        self.policy.model.forward = spy  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self.policy.model.forward = self._forward  # type: ignore[method-assign]


def _grads(policy: HFPolicy, batch: TrainBatch, *, share: int, micro: int) -> tuple[dict[str, torch.Tensor], list[Any]]:
    policy.share_prefix, policy.optim = share, dataclasses.replace(policy.optim, micro_batch_size=micro)
    policy.model.zero_grad(set_to_none=True)
    with _Shapes(policy) as spy:
        ok, _, _ = policy.accumulate_gradients(batch, LOSSES.get("cispo"), loss_scale="tokens")
    assert ok
    grads = {n: p.grad.detach().clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    policy.model.zero_grad(set_to_none=True)
    return grads, spy.shapes


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float) -> None:
    assert a.keys() == b.keys() and a
    for n in a:
        scale = float(a[n].abs().max())
        assert scale > 0, n
        assert float((a[n] - b[n]).abs().max()) <= rtol * scale, (n, float((a[n] - b[n]).abs().max()), scale)


def _check(policy: HFPolicy, n: int, rtol: float) -> None:
    batch = _batch(policy, n)
    prompt_len = int(batch.loss_mask[0].nonzero()[0])
    full, shapes_full = _grads(policy, batch, share=0, micro=n)
    shared, shapes_shared = _grads(policy, batch, share=SHARE_PREFIX_TOKENS, micro=n)
    assert shapes_full == [(n, batch.input_ids.shape[1])]
    prefix = shapes_shared[0]
    assert prefix[0] == 1 and SHARE_PREFIX_TOKENS <= prefix[1] < prompt_len  # the prefix once, at batch 1
    assert shapes_shared[1] == (n, batch.input_ids.shape[1] - prefix[1])  # then only the suffixes
    _assert_close(full, shared, rtol)
    split, shapes_split = _grads(policy, batch, share=SHARE_PREFIX_TOKENS, micro=n // 2)
    assert [s[0] for s in shapes_split] == [1, n // 2, 1, n // 2]  # two micro-batches, each with its prefix pass
    _assert_close(full, split, rtol)
    policy.share_prefix = SHARE_PREFIX_TOKENS


def _adapted(policy: HFPolicy, rank: int) -> HFPolicy:
    policy.enable_lora(LoraSpec(rank, 2.0 * rank))
    with torch.no_grad():  # B = 0 would make the adapters' gradient to A vanish
        gen = torch.Generator().manual_seed(2)
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return policy


def test_tiny_lora_gradient_equals_the_full_forward() -> None:
    _check(_adapted(_llama_policy(), 8), 8, rtol=1e-4)


def test_tiny_full_weights_gradient_equals_the_full_forward() -> None:
    _check(_llama_policy(), 6, rtol=1e-4)


def test_edge_support_term_with_a_shared_prefix() -> None:
    """EDGE's top-k support log-probs come from the same shortened logits: the same gradient."""
    from crl_train.policy.base import SUPPORT_IDS

    policy = _llama_policy()
    batch = _batch(policy, 4)
    ids, _ = policy.support_logprobs(batch, k=4)
    batch.extra[SUPPORT_IDS] = ids
    batch.extra["teacher_support"] = torch.log_softmax(torch.randn(ids.shape, generator=torch.Generator().manual_seed(0)), -1)
    loss = LOSSES.get("reverse_kl_topk")
    out = []
    for share in (0, SHARE_PREFIX_TOKENS):
        policy.share_prefix = share
        policy.model.zero_grad(set_to_none=True)
        assert policy.accumulate_gradients(batch, loss, loss_scale="tokens")[0]
        out.append({n: p.grad.detach().clone() for n, p in policy.model.named_parameters() if p.grad is not None})
    _assert_close(out[0], out[1], rtol=1e-4)


@pytest.mark.slow
def test_smollm2_lora_gradient_equals_the_full_forward() -> None:
    from crl_train.policy.packaged import resolve_model

    policy = HFPolicy.from_pretrained(resolve_model("smollm2-135m"), dtype="float32",
                                      sampling=SamplingConfig(temperature=0.7, seed=0))
    _check(_adapted(policy, 4), 4, rtol=1e-3)
