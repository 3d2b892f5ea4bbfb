"""EDGE marginal gain, gate, pooled advantages, EMA utility and pruning, by hand."""

import pytest
import torch

from crl_train.algorithms import (
    ADVANTAGES,
    edge_pooled_advantages,
    edge_train_mask,
    ema_utility,
    gain_gate,
    marginal_gain,
    prune_mask,
)

# group 0: teacher [1, 1], student [0, 0]  -> gain 1 - 0 = 1 (gate open)
# group 1: teacher [0, 0], student [1, 0]  -> gain 0 - .5 = -.5 (gate closed)
R = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0])
G = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
C = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1])


def test_marginal_gain_and_gate() -> None:
    gain = marginal_gain(R, G, C)
    assert gain.tolist() == [1.0, -0.5]
    assert gain_gate(gain).tolist() == [True, False]
    assert gain_gate(gain, threshold=1.0).tolist() == [False, False]


def test_pooled_advantages_by_hand() -> None:
    # group 0 open: pooled over [1,1,0,0], mean .5, std .5 -> [1, 1, -1, -1]
    # group 1 closed: teachers -> 0 (masked); students [1, 0] mean .5 std .5 -> [1, -1]
    a = edge_pooled_advantages(R, G, C, eps=0.0)
    assert a.tolist() == [1.0, 1.0, -1.0, -1.0, 0.0, 0.0, 1.0, -1.0]
    assert edge_train_mask(R, G, C).tolist() == [True, True, True, True, False, False, True, True]
    assert ADVANTAGES.get("edge_pooled") is edge_pooled_advantages


def test_missing_condition_raises() -> None:
    with pytest.raises(ValueError, match="lack condition"):
        marginal_gain(torch.ones(2), torch.zeros(2, dtype=torch.long), torch.tensor([1, 1]))


def test_ema_and_prune_by_hand() -> None:
    # u = .9 * .5 + .1 * (-.5) = .4 ; u = .9 * 0 + .1 * (-2) = -.2
    u = ema_utility(torch.tensor([0.5, 0.0]), torch.tensor([-0.5, -2.0]), momentum=0.9)
    assert u.tolist() == pytest.approx([0.4, -0.2])
    assert prune_mask(u, threshold=-0.1).tolist() == [False, True]
    with pytest.raises(ValueError, match="momentum"):
        ema_utility(u, u, momentum=1.5)
