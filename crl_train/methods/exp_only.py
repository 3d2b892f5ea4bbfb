"""Experience only: the actor is frozen; only the extractor (and so the bank) improves."""

from __future__ import annotations

from crl_train.config.names import MethodName
from crl_train.methods.base import MethodBase


class ExpOnly(MethodBase):
    name = MethodName.EXP_ONLY
    trains_actor = False
