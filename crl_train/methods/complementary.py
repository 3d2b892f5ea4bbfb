"""Complementary RL: split-subgroup GRPO for the actor; the extractor distils and learns
with CISPO."""

from __future__ import annotations

from crl_train.config.names import MethodName
from crl_train.methods.base import MethodBase


class Complementary(MethodBase):
    """The defaults of :class:`MethodBase` are this method: guided halves, split-subgroup
    advantages, and a service that distils, credits and trains the extractor."""

    name = MethodName.COMPLEMENTARY
