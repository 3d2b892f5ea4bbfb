"""Split-subgroup and GRPO advantages, and the Eq. 5 weights, against hand-worked numbers."""

import doctest
import inspect
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


# Episode 3 of the group raised: rewards [1, 0, 1, ·] with · never read (NaN here).
# mean over [1, 0, 1] = 2/3; population var = ((1/3)² + (2/3)² + (1/3)²) / 3 = 2/9, std = √2/3
# advantages: (1/3)/(√2/3) = 1/√2 = 0.7071068, (−2/3)/(√2/3) = −√2 = −1.4142136; invalid → 0
HALF = 1 / math.sqrt(2)
VALID4 = torch.tensor([True, True, True, False])


def test_grpo_leaves_invalid_episodes_out_by_hand() -> None:
    r = torch.tensor([1.0, 0.0, 1.0, float("nan")])
    a = grpo_advantages(r, torch.zeros(4, dtype=torch.long), valid=VALID4, eps=0.0)
    assert torch.allclose(a, torch.tensor([HALF, -math.sqrt(2), HALF, 0.0]), atol=1e-6)
    # unbiased: var = (2/3) / 2 = 1/3, std = 0.5773503 -> (1/3)/0.57735 = 0.5773503, −1.1547005
    u = grpo_advantages(r, torch.zeros(4, dtype=torch.long), valid=VALID4, eps=0.0, unbiased=True)
    assert torch.allclose(u, torch.tensor([0.5773503, -1.1547005, 0.5773503, 0.0]), atol=1e-6)
    # what the invalid episode's reward 0 did before: mean .5 over all 4 -> [1, −1, 1, −1]
    old = grpo_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.zeros(4, dtype=torch.long), eps=0.0)
    assert old.tolist() == [1.0, -1.0, 1.0, -1.0]
    all_valid = grpo_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.zeros(4, dtype=torch.long),
                                valid=torch.ones(4, dtype=torch.bool), eps=0.0)
    assert all_valid.tolist() == old.tolist()


def test_split_subgroup_leaves_invalid_episodes_out_by_hand() -> None:
    # guided [1, 0, 1, 0], episode 3 invalid -> [.7071, −1.4142, .7071, 0] (as above)
    # free [1, 1, 0, 0], episode 4 (reward 1) invalid -> valid [1, 0, 0]: mean 1/3, std √2/3
    #   -> [0, (2/3)/(√2/3) = √2, −(1/3)/(√2/3) = −.7071, −.7071]
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    g = torch.zeros(8, dtype=torch.long)
    c = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    v = torch.tensor([True, True, True, False, False, True, True, True])
    a = split_subgroup_advantages(r, g, c, valid=v, eps=0.0)
    s2 = math.sqrt(2)
    assert torch.allclose(a, torch.tensor([HALF, -s2, HALF, 0.0, 0.0, s2, -HALF, -HALF]), atol=1e-6)
    # one valid episode left in a subgroup: no spread -> 0; no valid one: 0 (no NaN)
    lone = split_subgroup_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.zeros(4, dtype=torch.long),
                                     torch.tensor([0, 0, 1, 1]), valid=torch.tensor([True, False, False, False]))
    assert lone.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_every_estimator_takes_the_shared_signature_with_valid() -> None:
    # one call shape for all of ADVANTAGES: (rewards, group_index, condition, *, valid, eps, unbiased)
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    g = torch.zeros(8, dtype=torch.long)
    c = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    v = torch.tensor([True, True, True, False, True, True, True, True])
    for name in ADVANTAGES.names():
        fn = ADVANTAGES.get(name)
        params = inspect.signature(fn).parameters
        assert list(params)[:3] == ["rewards", "group_index", "condition"]
        assert all(params[k].kind is inspect.Parameter.KEYWORD_ONLY for k in ("valid", "eps", "unbiased"))
        a = fn(r, g, c, valid=v, eps=1e-6, unbiased=False)
        assert a.shape == (8,) and a[3].item() == 0.0 and bool(torch.isfinite(a).all())
        with pytest.raises(ValueError, match="valid must be"):
            fn(r, g, c, valid=torch.ones(3, dtype=torch.bool))


def test_module_doctests() -> None:
    from crl_train.algorithms import advantages

    assert doctest.testmod(advantages).failed == 0
