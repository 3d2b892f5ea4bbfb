"""Split-subgroup and GRPO advantages, and the Eq. 5 weights, against hand-worked numbers."""

import math

import pytest
import torch

from crl_train.algorithms import (
    ADVANTAGES,
    AdvantageEstimator,
    grpo_advantages,
    sequence_weights,
    split_subgroup_advantages,
)


def test_grpo_population_std_by_hand() -> None:
    # r = [1, 0, 0, 0]: mean 0.25, deviations [0.75, -0.25, -0.25, -0.25]
    # population var = (0.5625 + 3 * 0.0625) / 4 = 0.1875, std = 0.4330127
    # advantages = [0.75 / 0.4330127, -0.25 / 0.4330127] = [1.7320508, -0.5773503]
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    a = grpo_advantages(r, torch.zeros(4, dtype=torch.long), eps=0.0)
    assert torch.allclose(a, torch.tensor([1.7320508, -0.5773503, -0.5773503, -0.5773503]), atol=1e-6)


def test_grpo_unbiased_std_by_hand() -> None:
    # unbiased var = 0.75 / 3 = 0.25, std = 0.5 -> [1.5, -0.5, -0.5, -0.5]
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    a = grpo_advantages(r, torch.zeros(4, dtype=torch.long), eps=0.0, unbiased=True)
    assert torch.allclose(a, torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-6)


def test_grpo_groups_do_not_mix_and_zero_spread_is_zero() -> None:
    # group 0: [1, 1] zero spread -> 0; group 1: [1, 0] mean .5 std .5 -> [1, -1]
    r = torch.tensor([1.0, 1.0, 1.0, 0.0])
    g = torch.tensor([0, 0, 1, 1])
    a = grpo_advantages(r, g, eps=0.0)
    assert a.tolist() == [0.0, 0.0, 1.0, -1.0]


def test_split_subgroup_differs_from_pooled() -> None:
    # one group, guided [1, 1, 1, 0], free [0, 0, 0, 0]
    # guided: mean .75, pop std sqrt(3*.0625+.5625)/2 = .4330127 -> [.57735, .57735, .57735, -1.7320508]
    # free: zero spread -> all 0  (pooled GRPO would give the free ones -0.7746: mean .375, std .4841)
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    g = torch.zeros(8, dtype=torch.long)
    c = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    a = split_subgroup_advantages(r, g, c, eps=0.0)
    want = [0.5773503, 0.5773503, 0.5773503, -1.7320508, 0.0, 0.0, 0.0, 0.0]
    assert torch.allclose(a, torch.tensor(want), atol=1e-6)
    pooled = grpo_advantages(r, g, eps=0.0)
    # pooled: mean 3/8 = .375, var = 3/8 - (3/8)^2 = .234375, std .4841229; free -> -.375/.4841229
    assert pooled[4].item() == pytest.approx(-0.7745967, abs=1e-6)


def test_split_subgroup_eps_in_denominator() -> None:
    # free [1, 0]: mean .5, std .5, eps .5 -> .5 / (.5 + .5) = .5
    r = torch.tensor([1.0, 0.0])
    a = split_subgroup_advantages(r, torch.zeros(2, dtype=torch.long), torch.tensor([1, 1]), eps=0.5)
    assert a.tolist() == [0.5, -0.5]


def test_singleton_subgroup_gets_zero() -> None:
    r = torch.tensor([1.0, 0.0, 1.0])
    a = split_subgroup_advantages(r, torch.zeros(3, dtype=torch.long), torch.tensor([0, 1, 1]))
    assert a[0].item() == 0.0


def test_bad_condition_and_shapes_raise() -> None:
    with pytest.raises(ValueError, match="condition values"):
        split_subgroup_advantages(torch.ones(2), torch.zeros(2, dtype=torch.long), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match=r"\[N\]"):
        grpo_advantages(torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.long))


def test_sequence_weights_eq5_by_hand() -> None:
    # G = 2 groups. group 0: 1 guided, 3 free (C=2) -> guided 1/(2*2*1)=1/4, free 1/(2*2*3)=1/12
    # group 1: 3 free only (C=1) -> 1/(2*1*3) = 1/6.   total = 1/4 + 3/12 + 3/6 = 1
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    c = torch.tensor([0, 1, 1, 1, 1, 1, 1])
    w = sequence_weights(g, c)
    want = [1 / 4, 1 / 12, 1 / 12, 1 / 12, 1 / 6, 1 / 6, 1 / 6]
    assert torch.allclose(w, torch.tensor(want))
    assert math.isclose(float(w.sum()), 1.0, rel_tol=1e-6)
    # GRPO (no condition): 1 / (G * K_g) = 1/(2*4) and 1/(2*3)
    assert torch.allclose(sequence_weights(g), torch.tensor([1 / 8] * 4 + [1 / 6] * 3))


def test_registry_lookup_and_error() -> None:
    assert ADVANTAGES.get("split_subgroup") is split_subgroup_advantages
    assert ADVANTAGES.get(AdvantageEstimator.GRPO) is grpo_advantages
    with pytest.raises(KeyError, match="accepted: grpo, split_subgroup, edge_pooled"):
        ADVANTAGES.get("nope")
