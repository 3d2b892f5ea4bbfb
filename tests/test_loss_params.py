"""Each loss is registered once with its scale and the dataclass of its hyper-parameters; a term
carries typed parameters, checked against the loss they are for."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from crl_train.algorithms import LOSSES, CispoParams, ClipParams, CoefParams, LossParams, PolicyLoss
from crl_train.algorithms.registry import LossRegistry
from crl_train.methods.base import ActorTerm
from crl_train.policy.base import LossTerm, TokenSequence, TrainBatch


def _batch() -> TrainBatch:
    seq = TokenSequence(input_ids=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1], old_logprobs=[0.0, 0.0, -0.5, -0.7])
    return TrainBatch.from_sequences([seq], [1.0], 0)


def test_every_loss_has_its_params_class() -> None:
    assert {n.value: LOSSES.params_type(n).__name__ for n in LOSSES.names()} == {
        "clip": "ClipParams", "cispo": "CispoParams", "cispo_sequences": "CispoParams",
        "reverse_kl_topk": "CoefParams", "reverse_kl_sampled": "CoefParams", "self_distill_nll": "CoefParams"}
    assert ClipParams(0.3, "sequence").kwargs() == {"clip_eps": 0.3, "ratio_level": "sequence"}
    assert CispoParams().kwargs() == {"eps_low": 0.1, "eps_high": 0.1} and LossParams().kwargs() == {}


def test_a_term_takes_only_the_params_of_its_loss() -> None:
    batch = _batch()
    term = ActorTerm(batch, PolicyLoss.SELF_DISTILL_NLL, CoefParams(0.5))
    assert term.params.kwargs() == {"coef": 0.5}
    with pytest.raises(TypeError, match="'self_distill_nll' takes CoefParams, got ClipParams"):
        ActorTerm(batch, PolicyLoss.SELF_DISTILL_NLL, ClipParams())
    with pytest.raises(TypeError, match="'clip' takes ClipParams"):
        LossTerm.registered(batch, PolicyLoss.CLIP, CoefParams())
    lt = LossTerm.registered(batch, PolicyLoss.CLIP, ClipParams(0.1), "rl")
    assert lt.loss_fn is LOSSES.get("clip") and lt.loss_scale == "none" and lt.kwargs == {"clip_eps": 0.1, "ratio_level": "token"}
    # the kwargs are the loss's own keywords: the loss runs with them
    lp = torch.tensor([[0.0, -0.4, -0.6]])
    loss, _ = lt.loss_fn(lp, lp.detach(), torch.tensor([1.0]), torch.tensor([[0.0, 1.0, 1.0]]), **lt.kwargs)
    assert torch.isfinite(loss)


def test_adding_a_loss_is_one_registration() -> None:
    reg = LossRegistry()

    @dataclass(frozen=True)
    class Scaled(LossParams):
        factor: float = 2.0

    @reg.register(PolicyLoss.CLIP, scale="tokens", params=Scaled)
    def scaled(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
               *, factor: float = 2.0, **context: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        return factor * (logprobs * mask).sum(), {}

    assert reg.get("clip") is scaled and reg.scale("clip") == "tokens" and reg.params_type("clip") is Scaled
    with pytest.raises(TypeError, match="LossParams subclass"):
        LossRegistry().register(PolicyLoss.CLIP, scale="tokens", params=dict)  # type: ignore[arg-type]
