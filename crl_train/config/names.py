"""The names of the methods: the one list (the config validates ``method`` against it)."""

from enum import StrEnum


class MethodName(StrEnum):
    GRPO = "grpo"
    """Plain GRPO: no experience (the paper's baseline)."""
    COMPLEMENTARY = "complementary"
    """Complementary RL: split-subgroup GRPO for the actor, CISPO for the extractor."""
    STATIC_ONLINE = "static_online"
    """The bank grows online, but the extractor is never trained."""
    EXP_ONLY = "exp_only"
    """Frozen actor; only the extractor learns."""
    OFFLINE_EXP = "offline_exp"
    """A bank built once before training, then frozen."""
    EDGE = "edge"
    """EDGE: gain-gated teacher rollouts, pooled advantages, reverse-KL distillation, utility pruning."""
