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


# Invalid episodes (the env raised) are left out of Δe, of the mean/std, and of the train mask.
# group 0: teachers [1, 0·], students [0, 1]   (· = invalid, reward 0 never read)
#   Δe = 1 − (0 + 1)/2 = 0.5 > 0: open. Pooled over the valid [1, 0, 1]: mean 2/3, std √2/3
#   -> [1/√2 = .7071, 0 (invalid), −√2 = −1.4142, .7071]
#   (counting the invalid teacher: Δe = .5 − .5 = 0, gate closed: the teachers would be dropped)
# group 1: teachers [0, 1], students [1, 0·]
#   Δe = .5 − 1 = −.5: closed. Teachers masked -> 0; students alone: the one valid [1] has no
#   spread -> 0 (counting the invalid one: Δe = 0, students [1, 0] -> [1, −1])
RV = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0])
GV = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
CV = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1])
VV = torch.tensor([True, False, True, True, True, True, True, False])


def test_marginal_gain_leaves_invalid_episodes_out() -> None:
    assert marginal_gain(RV, GV, CV, valid=VV).tolist() == [0.5, -0.5]
    assert marginal_gain(RV, GV, CV).tolist() == [0.0, 0.0]  # what the invalid ones did before
    # all teachers of group 1 invalid: no gain can be measured -> NaN, and the gate stays closed
    # (group 0 all valid: .5 − .5 = 0)
    none_guided = torch.tensor([True, True, True, True, False, False, True, True])
    gain = marginal_gain(RV, GV, CV, valid=none_guided)
    assert gain[0].item() == 0.0 and torch.isnan(gain[1])
    assert gain_gate(gain, threshold=-1.0).tolist() == [True, False]
    assert edge_train_mask(RV, GV, CV, valid=none_guided, threshold=-1.0).tolist() == [True] * 4 + [False, False, True, True]


def test_edge_pooled_and_train_mask_leave_invalid_episodes_out_by_hand() -> None:
    a = edge_pooled_advantages(RV, GV, CV, valid=VV, eps=0.0)
    h = 1 / 2**0.5
    assert torch.allclose(a, torch.tensor([h, 0.0, -(2**0.5), h, 0.0, 0.0, 0.0, 0.0]), atol=1e-6)
    assert edge_train_mask(RV, GV, CV, valid=VV).tolist() == [True, False, True, True, False, False, True, False]
    # without the mask: both gates closed (Δe = 0), teachers out, students GRPO among themselves
    assert edge_pooled_advantages(RV, GV, CV, eps=0.0).tolist() == [0.0, 0.0, -1.0, 1.0, 0.0, 0.0, 1.0, -1.0]
    # a gate that opens only because of a NaN reward on an invalid episode cannot happen
    nan_r = RV.clone()
    nan_r[1] = float("nan")
    assert torch.equal(edge_pooled_advantages(nan_r, GV, CV, valid=VV, eps=0.0), a)


def test_module_doctests() -> None:
    import doctest

    from crl_train.algorithms import edge

    assert doctest.testmod(edge).failed == 0
