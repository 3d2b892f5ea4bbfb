"""``bench/small.py``'s arithmetic: the FLOP count its rates divide and the verdict over its targets."""

from __future__ import annotations

from typing import Any

import pytest
from _bench import load_bench


@pytest.fixture(scope="module")
def small() -> Any:
    return load_bench("small")


def test_forward_flops_by_hand(small: Any) -> None:
    from crl_train.policy.tiny import build_tiny_policy

    policy = small.HFPolicy  # the class the bench times
    tiny = build_tiny_policy(["go north", "go south"], vocab_size=300, hidden=32, layers=2, heads=2, kv_heads=1,
                             intermediate=64)
    assert isinstance(tiny, policy)
    cfg = tiny.model.config
    n_body, nbytes = small._body_params(tiny)
    emb = cfg.vocab_size * 32
    # tied: the embedding matrix is the vocabulary projection, read once per step, not multiplied per token
    assert n_body == sum(p.numel() for p in tiny.model.parameters()) - emb
    assert nbytes == 4 * sum(p.numel() for p in tiny.model.parameters())
    # 10 tokens after 5 cached: 2 per weight per token; attention 2 products x 2 FLOPs x layers x d x
    # each token's keys (5 cached + its causal half); 3 rows of logits
    want = 2 * n_body * 10 + 4 * 2 * 32 * 10 * (5 + 11 / 2) + 2 * 32 * cfg.vocab_size * 3
    assert small.forward_flops(tiny, 10, 5, 3) == pytest.approx(want)


def _out(speedup: float, train: float, decode: float, constrained: float | None) -> dict[str, Any]:
    out: dict[str, Any] = {"precision": {"extractor_sample_speedup": speedup,
                                         "default": {"train_over_matmul": train, "decode_b1_over_floor": decode}}}
    if constrained is not None:
        out["generation"] = {"b8": {"constrained_over_free": constrained}}
    return out


def test_verdict_over_the_targets(small: Any) -> None:
    out = _out(4.2, 0.45, 1.8, None)
    assert small._verdict(out) is True
    assert out["meets_each_target"] == {"extractor_sample_speedup": True, "train_over_matmul": True,
                                        "decode_b1_over_floor": True, "constrained_over_free_b8": None}
    out = _out(1.6, 0.45, 4.1, 1.0)
    assert small._verdict(out) is False
    assert out["meets_each_target"]["extractor_sample_speedup"] is False
    assert out["meets_each_target"]["decode_b1_over_floor"] is False
    assert out["meets_each_target"]["constrained_over_free_b8"] is True
    assert small._verdict({}) is None  # nothing measured, no verdict
