"""The actor-side contract every training loop follows: our runner (``hf`` backend), OpenRLHF's
executor and TRL's trainer each call this module, so ``--method`` means the same under each.

Three rules, written once:

* **Which copies of a group are guided** (:func:`condition_of`, the episode driver's:
  :func:`crl_gym.episode.condition_of`): the first K/2 of the K copies of a task, when the method
  is guided; every copy is free otherwise.
* **What a rollout hands a method**: :class:`Outcomes`, the ``[N]`` tensors that advantages and
  train masks read (a loop without episode objects, OpenRLHF's experience maker or TRL's trainer,
  hands these), and :class:`Rollout`, the same tensors with the episodes they were computed from
  (our runner; what the methods' extra terms and entry bonuses read). Neither is ever half built.
* **What trains, with what advantage** (:func:`trained_advantages`): the method's
  ``advantages(outcomes)``, 0 where its ``train_mask(outcomes)`` is False.

>>> [condition_of(c, 4) for c in range(6)]
['guided', 'guided', 'free', 'free', 'guided', 'guided']
>>> condition_of(0, 4, guided=False)
'free'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from crl_gym.episode import condition_of
from crl_gym.protocol import CONDITIONS, FREE_CONDITION, GUIDED_CONDITION, Condition
from crl_train.algorithms.advantages import FREE, GUIDED

if TYPE_CHECKING:
    from crl_train.rollout.episode import Episode

CONDITION_IDS: dict[Condition, int] = {GUIDED_CONDITION: GUIDED, FREE_CONDITION: FREE}
"""A condition's id in a ``condition`` tensor (``crl_train.algorithms``: GUIDED 0, FREE 1)."""


def condition_ids(conditions: Sequence[str]) -> torch.Tensor:
    """``[N]`` long tensor of condition ids; an unknown condition raises ``ValueError``.

    >>> condition_ids(["guided", "free"]).tolist()
    [0, 1]
    """
    try:
        return torch.tensor([CONDITION_IDS[c] for c in conditions], dtype=torch.long)  # type: ignore[index]
    except KeyError as exc:
        raise ValueError(
            f"a condition is {' or '.join(map(repr, CONDITIONS))}, got {exc.args[0]!r}"
        ) from None


@dataclass(eq=False)
class Outcomes:
    """One rollout step's ``[N]`` tensors: what a method's advantages and train mask read.

    ``reward`` is 1.0 on success else 0.0 (the paper's R ∈ {0, 1}); ``group`` the task group,
    ``condition`` GUIDED / FREE, ``valid`` False for episodes that ended because the env raised
    (the agent's tokens were not at fault: they are never trained on and never enter a mean, a std
    or a gain). Built with four tensors of one length, or it raises ``ValueError``.
    """

    reward: torch.Tensor
    group: torch.Tensor
    condition: torch.Tensor
    valid: torch.Tensor

    def __post_init__(self) -> None:
        sizes = {
            name: tuple(getattr(self, name).shape)
            for name in ("reward", "group", "condition", "valid")
        }
        if len(set(sizes.values())) != 1 or len(next(iter(sizes.values()))) != 1:
            raise ValueError(f"a rollout's tensors are [N] each, of one N: got {sizes}")

    def __len__(self) -> int:
        return int(self.reward.numel())


@dataclass(eq=False)
class Rollout(Outcomes):
    """:class:`Outcomes` with the episodes they were computed from (one per row, in order)."""

    episodes: list[Episode]

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.episodes) != len(self):
            raise ValueError(
                f"a rollout holds one episode per row: {len(self.episodes)} episodes, "
                f"{len(self)} rows"
            )

    @classmethod
    def of(cls, episodes: list[Episode]) -> Rollout:
        return cls(
            torch.tensor([1.0 if e.success else 0.0 for e in episodes]),
            torch.tensor([e.group for e in episodes], dtype=torch.long),
            condition_ids([e.condition for e in episodes]),
            torch.tensor([not e.failed_by_error for e in episodes], dtype=torch.bool),
            episodes,
        )


class ActorSide(Protocol):
    """The part of a method (``crl_train.methods.Method``) every loop calls."""

    @property
    def guided(self) -> bool: ...

    def advantages(self, outcomes: Outcomes) -> torch.Tensor: ...

    def train_mask(self, outcomes: Outcomes) -> torch.Tensor: ...


def trained_advantages(method: ActorSide, outcomes: Outcomes) -> torch.Tensor:
    """``[N]`` float32: the method's advantages where its train mask is True, 0 elsewhere."""
    adv = method.advantages(outcomes).to(torch.float32)
    return torch.where(method.train_mask(outcomes), adv, torch.zeros_like(adv))


__all__ = [
    "CONDITION_IDS",
    "ActorSide",
    "Outcomes",
    "Rollout",
    "condition_ids",
    "condition_of",
    "trained_advantages",
]
