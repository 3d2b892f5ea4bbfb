"""Training-count-aware advantage weights for the extractor (paper, Appendix B).

w(m) = 0 if t − t_last(m) < δ, else (1 + c_train(m))^(−α).

t_last = −1 means the entry was never trained on (then the cooldown never applies).
The counts come from the bank: the trainer calls ``bank.record_training(ids, step)`` after
every extractor update, so c_train really grows (the reference code never recorded it).

>>> import torch
>>> training_count_weights(torch.tensor([0, 3, 1]), torch.tensor([-1, 2, 9]), step=10,
...                        cooldown=2, alpha=0.5).tolist()
[1.0, 0.5, 0.0]
"""

from __future__ import annotations

import torch


def training_count_weights(
    train_count: torch.Tensor,
    last_trained_step: torch.Tensor,
    step: int,
    *,
    cooldown: int,
    alpha: float,
) -> torch.Tensor:
    """Per-entry weights.

    Args:
        train_count: ``[M]`` long, c_train(m).
        last_trained_step: ``[M]`` long, t_last(m) (−1 = never).
        step: current extractor training step t.
        cooldown: δ ≥ 0 (0 disables the cooldown).
        alpha: α ≥ 0 (0 disables the decay).
    Returns:
        ``[M]`` float32 weights in [0, 1].
    """
    if cooldown < 0 or alpha < 0:
        raise ValueError(f"cooldown and alpha must be >= 0, got cooldown={cooldown}, alpha={alpha}")
    if train_count.shape != last_trained_step.shape:
        raise ValueError("train_count and last_trained_step must have the same [M] shape")
    decay = (1.0 + train_count.to(torch.float32)).pow(-alpha)
    cooling = (last_trained_step >= 0) & ((step - last_trained_step) < cooldown)
    return torch.where(cooling, torch.zeros_like(decay), decay)
