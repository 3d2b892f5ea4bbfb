"""Losses are registered with their loss scale in one place: the decorator."""

from __future__ import annotations

import pytest
import torch

from crl_train.algorithms import LOSSES, PolicyLoss, loss_scale_for
from crl_train.algorithms.registry import LossRegistry


def _loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
          **context: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    return (logprobs * mask).sum(), {}


def test_a_loss_and_its_scale_are_one_registration() -> None:
    reg = LossRegistry()
    assert reg.register(PolicyLoss.CLIP, scale="samples")(_loss) is _loss
    assert reg.get("clip") is _loss and reg.scale(PolicyLoss.CLIP) == "samples"
    with pytest.raises(ValueError, match="registered twice"):
        reg.register(PolicyLoss.CLIP, scale="tokens")(_loss)
    with pytest.raises(KeyError, match="declared but not registered"):
        reg.scale("cispo")


@pytest.mark.parametrize("scale", [None, "mean"])
def test_a_loss_without_a_valid_scale_is_refused(scale: object) -> None:
    with pytest.raises(ValueError, match="registered with its loss scale"):
        LossRegistry().register(PolicyLoss.CISPO, scale=scale)  # type: ignore[arg-type]


def test_loss_scale_for_reads_the_registration() -> None:
    assert all(loss_scale_for(n) == LOSSES.scale(n) for n in LOSSES.names())
