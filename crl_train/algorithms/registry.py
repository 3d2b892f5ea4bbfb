"""Decorator registries keyed by ``str`` Enums (verl ``core_algos`` style).

>>> from crl_train.algorithms.registry import ADVANTAGES, AdvantageEstimator
>>> sorted(e.value for e in ADVANTAGES.names())
['edge_pooled', 'grpo', 'split_subgroup']
>>> from crl_train.algorithms.registry import LOSSES
>>> sorted(e.value for e in LOSSES.names())
['cispo', 'cispo_sequences', 'clip', 'reverse_kl_sampled', 'reverse_kl_topk', 'self_distill_nll']
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum, StrEnum
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Enum)
F = TypeVar("F", bound=Callable[..., Any])


class AdvantageEstimator(StrEnum):
    """How trajectory rewards become advantages."""

    GRPO = "grpo"
    """One group of K: Â = (r − mean) / (std + ε)."""
    SPLIT_SUBGROUP = "split_subgroup"
    """Complementary RL Eq. 5: normalise inside each (group, condition) subgroup."""
    EDGE_POOLED = "edge_pooled"
    """EDGE: pooled over teacher + student when the gain gate is open, else student-only GRPO."""


class PolicyLoss(StrEnum):
    """Losses over per-token log-probs, all called as
    ``loss_fn(logprobs, old_logprobs, advantages, mask, **kw) -> (loss, metrics)``
    (see :mod:`crl_train.algorithms.losses`)."""

    CLIP = "clip"
    """PPO/GRPO clipped surrogate (actor)."""
    CISPO = "cispo"
    """Clipped IS-weight policy optimisation (extractor, Eq. 3)."""
    CISPO_SEQUENCES = "cispo_sequences"
    """CISPO with each sample's tokens averaged first, then the samples (an option; Eq. 3 is ``cispo``)."""
    REVERSE_KL_SAMPLED = "reverse_kl_sampled"
    """EDGE reverse-KL distillation, sampled-token estimator (needs only per-token log-probs)."""
    REVERSE_KL_TOPK = "reverse_kl_topk"
    """EDGE reverse-KL distillation over the student's top-k tokens (log-probs of a per-position support)."""
    SELF_DISTILL_NLL = "self_distill_nll"
    """Next-token NLL on winning guided trajectories with the experience stripped."""


class Registry(Generic[K, F]):
    """A name → function table whose keys are members of one ``str`` Enum."""

    def __init__(self, keys: type[K], what: str) -> None:
        self._keys = keys
        self._what = what
        self._table: dict[K, F] = {}

    def register(self, name: K) -> Callable[[F], F]:
        """Decorator: ``@REG.register(Key.X)`` adds the function under ``Key.X``."""

        def deco(fn: F) -> F:
            if name in self._table:
                raise ValueError(f"{self._what} {name.value!r} registered twice")
            self._table[name] = fn
            return fn

        return deco

    def get(self, name: K | str) -> F:
        """The function registered under ``name`` (an Enum member or its string value)."""
        try:
            key = self._keys(name)
        except ValueError:
            accepted = ", ".join(k.value for k in self._keys)
            raise KeyError(f"unknown {self._what} {name!r}; accepted: {accepted}") from None
        if key not in self._table:
            raise KeyError(f"{self._what} {key.value!r} is declared but not registered")
        return self._table[key]

    def names(self) -> list[K]:
        return list(self._table)


ADVANTAGES: Registry[AdvantageEstimator, Callable[..., Any]] = Registry(AdvantageEstimator, "advantage estimator")
LOSSES: Registry[PolicyLoss, Callable[..., Any]] = Registry(PolicyLoss, "policy loss")
