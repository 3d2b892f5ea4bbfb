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
from crl_train.methods.base import (
    GATE_FIELDS,
    SELF_DISTILL_FIELDS,
    ActorTerm,
    Method,
    MethodBase,
    Rollout,
)
from crl_train.methods.complementary import Complementary
from crl_train.methods.edge import EDGE_FIELDS, Edge
from crl_train.methods.exp_only import ExpOnly
from crl_train.methods.grpo import GRPO
from crl_train.methods.offline_exp import OfflineExp
from crl_train.methods.static_online import StaticOnline

METHODS: Registry[MethodName, type[MethodBase]] = Registry(MethodName, "method")
for _cls in (GRPO, Complementary, StaticOnline, ExpOnly, OfflineExp, Edge):
    METHODS.register(_cls.name)(_cls)


def declared_metric_fields() -> tuple[str, ...]:
    """Every metrics-row key some method may add: the union of the registered methods'
    ``declared_fields``, in registration order (a method's new key is declared in its own module).

    >>> "edge_gain_mean" in declared_metric_fields() and "gate_judged" in declared_metric_fields()
    True
    """
    keys = (k for name in METHODS.names() for k in METHODS.get(name).declared_fields)
    return tuple(dict.fromkeys(keys))


def make_method(cfg: TrainConfig) -> Method:
    """The method ``cfg.method`` names, built for ``cfg`` (:class:`~crl_train.config.ConfigError`
    when ``cfg`` lacks what it needs); unknown names raise ``KeyError`` listing the
    accepted ones."""
    method: Method = METHODS.get(cfg.method)(cfg)
    return method


def check_method_config(cfg: TrainConfig) -> None:
    """What :func:`make_method` checks, without making the method (a config loaded for
    later use)."""
    METHODS.get(cfg.method).check_config(cfg)


__all__ = [
    "EDGE_FIELDS",
    "GATE_FIELDS",
    "METHODS",
    "SELF_DISTILL_FIELDS",
    "ActorTerm",
    "Method",
    "MethodBase",
    "MethodName",
    "Rollout",
    "check_method_config",
    "declared_metric_fields",
    "make_method",
]
