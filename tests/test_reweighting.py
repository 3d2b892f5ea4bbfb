"""Training-count-aware weights w(m), by hand."""

import pytest
import torch

from crl_train.algorithms import training_count_weights


def test_weights_by_hand() -> None:
    # step 10, delta 2, alpha .5
    # never trained (c=0, last=-1): (1+0)^-.5 = 1
    # c=3, last=2 (10-2=8 >= 2): (1+3)^-.5 = .5
    # c=1, last=9 (10-9=1 < 2): cooldown -> 0
    # c=8, last=8 (10-8=2, not < 2): (1+8)^-.5 = 1/3
    w = training_count_weights(torch.tensor([0, 3, 1, 8]), torch.tensor([-1, 2, 9, 8]), 10, cooldown=2, alpha=0.5)
    assert w.tolist() == pytest.approx([1.0, 0.5, 0.0, 1 / 3])


def test_alpha_zero_and_cooldown_zero() -> None:
    w = training_count_weights(torch.tensor([5, 2]), torch.tensor([10, 3]), 10, cooldown=0, alpha=0.0)
    assert w.tolist() == [1.0, 1.0]
    # alpha 1, c=3 -> 1/4
    w = training_count_weights(torch.tensor([3]), torch.tensor([0]), 10, cooldown=1, alpha=1.0)
    assert w.tolist() == [0.25]


def test_negative_params_raise() -> None:
    with pytest.raises(ValueError, match="cooldown"):
        training_count_weights(torch.tensor([0]), torch.tensor([-1]), 0, cooldown=-1, alpha=0.0)
