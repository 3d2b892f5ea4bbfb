"""GRPO, the paper's baseline: no experience, one group of K normalised together."""

from __future__ import annotations

from crl_train.algorithms import AdvantageEstimator
from crl_train.config.names import MethodName
from crl_train.methods.base import MethodBase
from crl_train.service import ServiceOptions, service_options


class GRPO(MethodBase):
    """No bank is read or written; the service only counts steps."""

    name = MethodName.GRPO
    guided = False
    advantage = AdvantageEstimator.GRPO

    def service_options(self) -> ServiceOptions:
        return service_options(self.cfg, extractor=False, distill=False, train=False, refine=False)
