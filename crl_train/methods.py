"""Training methods: which parts train and how advantages are computed.

>>> get_method("static_online").train_extractor, get_method("static_online").train_actor
(False, True)
>>> sorted(m.value for m in METHODS.names())
['complementary', 'edge', 'exp_only', 'grpo', 'offline_exp', 'static_online']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from crl_train.algorithms.registry import AdvantageEstimator, Registry


class MethodName(StrEnum):
    GRPO = "grpo"
    COMPLEMENTARY = "complementary"
    STATIC_ONLINE = "static_online"
    EXP_ONLY = "exp_only"
    OFFLINE_EXP = "offline_exp"
    EDGE = "edge"


@dataclass(frozen=True)
class MethodSpec:
    """What a method does in the loop."""

    name: str
    uses_experience: bool
    """Half of each group is guided by a retrieved entry."""
    train_actor: bool
    """The actor is updated (False: frozen actor, ``exp_only``)."""
    distill_online: bool
    """The extractor distils finished episodes into the bank during training."""
    train_extractor: bool
    """The extractor is updated with CISPO."""
    advantage: AdvantageEstimator
    edge: bool = False
    """EDGE gate / EMA utility / pruning."""
    offline_bank: bool = False
    """The bank is built once before training from ``experience.offline_source`` and frozen."""


METHODS: Registry[MethodName, Callable[[], MethodSpec]] = Registry(MethodName, "method")


@METHODS.register(MethodName.GRPO)
def _grpo() -> MethodSpec:
    return MethodSpec("grpo", False, True, False, False, AdvantageEstimator.GRPO)


@METHODS.register(MethodName.COMPLEMENTARY)
def _complementary() -> MethodSpec:
    return MethodSpec("complementary", True, True, True, True, AdvantageEstimator.SPLIT_SUBGROUP)


@METHODS.register(MethodName.STATIC_ONLINE)
def _static_online() -> MethodSpec:
    return MethodSpec("static_online", True, True, True, False, AdvantageEstimator.SPLIT_SUBGROUP)


@METHODS.register(MethodName.EXP_ONLY)
def _exp_only() -> MethodSpec:
    return MethodSpec("exp_only", True, False, True, True, AdvantageEstimator.SPLIT_SUBGROUP)


@METHODS.register(MethodName.OFFLINE_EXP)
def _offline_exp() -> MethodSpec:
    return MethodSpec("offline_exp", True, True, False, False, AdvantageEstimator.SPLIT_SUBGROUP, offline_bank=True)


@METHODS.register(MethodName.EDGE)
def _edge() -> MethodSpec:
    return MethodSpec("edge", True, True, True, False, AdvantageEstimator.EDGE_POOLED, edge=True)


def get_method(name: str) -> MethodSpec:
    """The spec of ``name``; unknown names raise ``KeyError`` listing the accepted ones."""
    return METHODS.get(name)()
