"""Extractor rewards r(m), r̄(m) and batch advantages, by hand."""

import pytest
import torch

from crl_train.algorithms import (
    GATE_SCORES,
    batch_advantages,
    entry_rewards,
    episode_rewards,
    free_baselines,
    outcome_rewards,
)


def test_outcome_rewards_pm_one() -> None:
    assert outcome_rewards(torch.tensor([True, False])).tolist() == [1.0, -1.0]


def test_entry_rewards_average_over_guided_trajectories() -> None:
    # entry 7 guided 3 episodes: +1, -1, -1 -> -1/3 ; entry 9 guided one success -> +1
    ids, rbar = entry_rewards(torch.tensor([7, 7, 9, 7]), torch.tensor([True, False, True, False]))
    assert ids.tolist() == [7, 9]
    assert rbar.tolist() == pytest.approx([-1 / 3, 1.0])


def test_gate_bonus_is_added_before_averaging() -> None:
    # r = [+1 + accept(1), -1 + refine(.5)] = [2, -.5] -> mean .75
    bonus = torch.tensor([GATE_SCORES["accept"], GATE_SCORES["refine"]])
    _, rbar = entry_rewards(torch.tensor([1, 1]), torch.tensor([True, False]), gate_bonus=bonus)
    assert rbar.tolist() == [0.75]


def test_one_function_makes_r_of_m_with_baseline_gate_and_bonus() -> None:
    # group 0: guided ✓ (entry 5), guided ✗ (entry 5), free ✓, free ✗ -> free mean 0
    # group 1: guided ✓ (entry 6), free ✗ -> free mean -1
    success = torch.tensor([True, False, True, False, True, False])
    group = torch.tensor([0, 0, 0, 0, 1, 1])
    cond = torch.tensor([0, 0, 1, 1, 0, 1])
    assert free_baselines(success, group, cond).tolist() == [0.0, 0.0, 0.0, 0.0, -1.0, -1.0]
    guided = torch.tensor([0, 1, 4])
    base = free_baselines(success, group, cond)[guided]
    gate = torch.tensor([1.0, 0.5, 0.0])  # accept, refine, reject
    bonus = torch.tensor([0.25, -0.25, 0.5])
    # r = ±1 - baseline + s_c + b: [1 - 0 + 1 + .25, -1 - 0 + .5 - .25, 1 + 1 + 0 + .5] = [2.25, -.75, 2.5]
    r = episode_rewards(success[guided], baseline=base, gate_score=gate, bonus=bonus)
    assert r.tolist() == [2.25, -0.75, 2.5]
    ids, rbar = entry_rewards(torch.tensor([5, 5, 6]), success[guided], gate, baseline=base, bonus=bonus)
    assert ids.tolist() == [5, 6] and rbar.tolist() == [0.75, 2.5]  # entry 5: (2.25 - .75) / 2
    assert episode_rewards(torch.tensor([True, False])).tolist() == [1.0, -1.0]
    with pytest.raises(ValueError, match="bonus must be"):
        episode_rewards(torch.tensor([True]), bonus=torch.zeros(2))


def test_batch_advantages_by_hand() -> None:
    # rbar [1/3, 1, -1]: mean 1/9 -> [2/9, 8/9, -10/9]; weights [1, .5, 0] -> [2/9, 4/9, 0]
    rbar = torch.tensor([1 / 3, 1.0, -1.0])
    assert batch_advantages(rbar).tolist() == pytest.approx([2 / 9, 8 / 9, -10 / 9])
    assert batch_advantages(rbar, torch.tensor([1.0, 0.5, 0.0])).tolist() == pytest.approx([2 / 9, 4 / 9, 0.0])


def test_shape_errors() -> None:
    with pytest.raises(ValueError, match="entry_ids and success"):
        entry_rewards(torch.tensor([1, 2]), torch.tensor([True]))
    with pytest.raises(ValueError, match="weights"):
        batch_advantages(torch.zeros(2), torch.zeros(3))
