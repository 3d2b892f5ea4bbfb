"""Offline experience: a bank built once before training from ``experience.offline_source``,
then frozen."""

from __future__ import annotations

from crl_train.config import ConfigError, TrainConfig
from crl_train.config.names import MethodName
from crl_train.methods.base import MethodBase
from crl_train.service import ServiceOptions, service_options


class OfflineExp(MethodBase):
    """The service keeps its extractor (to distil an offline ``trajectories.jsonl`` once, and for
    search_and_ask), but never distils online, never trains it and never merges."""

    name = MethodName.OFFLINE_EXP

    @classmethod
    def check_config(cls, cfg: TrainConfig) -> None:
        if not cfg.experience.offline_source:
            raise ConfigError(
                "experience.offline_source must name a trajectories.jsonl or bank .jsonl for "
                "method offline_exp"
            )

    def service_options(self) -> ServiceOptions:
        return service_options(
            self.cfg, distill=False, train=False, offline_source=self.cfg.experience.offline_source
        )
