"""The training methods, one module each, registered by name.

>>> sorted(m.value for m in METHODS.names())
['complementary', 'edge', 'exp_only', 'grpo', 'offline_exp', 'static_online']
>>> from crl_train.config import load_config
>>> m = make_method(load_config(None, ["method=static_online"]))
>>> m.guided, m.trains_actor, m.service_options().train
(True, True, False)
"""

from __future__ import annotations

from crl_train.algorithms.registry import Registry
from crl_train.config import TrainConfig
from crl_train.config.names import MethodName
from crl_train.methods.base import ActorTerm, Method, MethodBase, Rollout
from crl_train.methods.complementary import Complementary
from crl_train.methods.edge import Edge
from crl_train.methods.exp_only import ExpOnly
from crl_train.methods.grpo import GRPO
from crl_train.methods.offline_exp import OfflineExp
from crl_train.methods.static_online import StaticOnline

METHODS: Registry[MethodName, type[MethodBase]] = Registry(MethodName, "method")
for _cls in (GRPO, Complementary, StaticOnline, ExpOnly, OfflineExp, Edge):
    METHODS.register(_cls.name)(_cls)


def make_method(cfg: TrainConfig) -> Method:
    """The method ``cfg.method`` names, built for ``cfg``; unknown names raise ``KeyError`` listing the accepted ones."""
    method: Method = METHODS.get(cfg.method)(cfg)
    return method


__all__ = ["METHODS", "ActorTerm", "Method", "MethodBase", "MethodName", "Rollout", "make_method"]
