"""Static online experience: the bank grows from the actor's episodes, the extractor
never learns."""

from __future__ import annotations

from crl_train.config.names import MethodName
from crl_train.methods.base import MethodBase
from crl_train.service import ServiceOptions, service_options


class StaticOnline(MethodBase):
    name = MethodName.STATIC_ONLINE

    def service_options(self) -> ServiceOptions:
        return service_options(self.cfg, train=False)
