"""Tempered log-probs, top-p filtering, sampling and chunked selective log-probs, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from crl_train.policy.sampling import (
    sample_tokens,
    selective_logprobs,
    tempered_logprobs,
    top_p_filter,
)


def test_tempered_logprobs_by_hand() -> None:
    # logits (0, ln 3), T = 1: p = (1/4, 3/4). T = 0.5: logits/T = (0, 2 ln 3) -> p = (1/10, 9/10).
    logits = torch.tensor([[0.0, math.log(3.0)]])
    assert tempered_logprobs(logits, 1.0).exp().tolist()[0] == pytest.approx([0.25, 0.75])
    assert tempered_logprobs(logits, 0.5).exp().tolist()[0] == pytest.approx([0.1, 0.9])
    # A mask that allows only token 1 makes it certain: log-prob 0.
    assert tempered_logprobs(logits, 0.5, [(1,)])[0, 1].item() == pytest.approx(0.0)


def test_top_p_filter_by_hand() -> None:
    lp = torch.log(torch.tensor([[0.1, 0.6, 0.3]]))
    # Sorted: 0.6, 0.3, 0.1. Mass before each: 0, 0.6, 0.9. top_p = 0.6 keeps only 0.6 (0.6 >= 0.6 drops 0.3).
    assert (top_p_filter(lp, 0.6).exp()[0] > 0).tolist() == [False, True, False]
    # top_p = 0.8: 0.6 < 0.8 keeps 0.3; 0.9 >= 0.8 drops 0.1.
    assert (top_p_filter(lp, 0.8).exp()[0] > 0).tolist() == [False, True, True]
    assert torch.equal(top_p_filter(lp, 1.0), lp)


def test_sample_tokens_greedy_and_seeded() -> None:
    lp = torch.log(torch.tensor([[0.2, 0.8], [0.9, 0.1]]))
    assert sample_tokens(lp, greedy=True).tolist() == [1, 0]
    a = sample_tokens(lp.repeat(50, 1), generator=torch.Generator().manual_seed(3))
    b = sample_tokens(lp.repeat(50, 1), generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    # top_p tiny -> always the arg-max.
    assert sample_tokens(lp.repeat(20, 1), top_p=1e-6).tolist() == [1, 0] * 20


def test_selective_logprobs_matches_full_softmax_across_chunks() -> None:
    torch.manual_seed(0)
    logits = torch.randn(7, 5)
    targets = torch.randint(0, 5, (7,))
    cons = {2: (targets[2].item(), (targets[2].item() + 1) % 5)}
    got = selective_logprobs(logits, targets, 0.7, cons, chunk=3)
    full = torch.log_softmax(logits / 0.7, -1).gather(-1, targets[:, None]).squeeze(-1)
    rows = [i for i in range(7) if i != 2]
    assert torch.allclose(got[rows], full[rows], atol=1e-6)
    # Row 2 renormalised over its two allowed tokens.
    two = logits[2, list(cons[2])] / 0.7
    assert got[2].item() == pytest.approx((two[0] - torch.logsumexp(two, 0)).item(), abs=1e-6)
