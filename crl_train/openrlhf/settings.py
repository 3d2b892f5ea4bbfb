"""What the processes OpenRLHF starts need to know about our run, carried in one
environment variable.

OpenRLHF builds ``AgentExecutor()`` with no arguments inside every vLLM engine actor, and the
trainer actors from its own parser's arguments: neither can be handed our config. The launcher
puts it in ``CRL_OPENRLHF_SETTINGS`` (JSON) in the Ray job's ``runtime_env``, so every process of
the job, on every node, reads the same settings without a shared filesystem.

>>> from crl_train.config import load_config
>>> s = ClusterSettings.of(load_config(None), service_name="svc", namespace="crl",
...                        run_dir="/runs/x")
>>> ClusterSettings.from_json(s.to_json()).train_config().env.group_size
4
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from crl_train.config import TrainConfig, config_from_dict, config_to_dict

SETTINGS_ENV = "CRL_OPENRLHF_SETTINGS"
"""Environment variable holding :class:`ClusterSettings` as JSON."""


class SettingsMissing(RuntimeError):
    """``CRL_OPENRLHF_SETTINGS`` is not set: this process was not started by
    ``crl-train --backend openrlhf``."""


@dataclass(frozen=True)
class ClusterSettings:
    """The run as the executor, the advantage mixin and the trainer subclasses see it."""

    config: dict[str, Any]
    """The crl-train config (``config_to_dict``), validated again on read."""
    service_name: str
    """Name of the experience service's detached actor."""
    namespace: str
    """Its Ray namespace."""
    run_dir: str
    """The run directory on the head node (the service's bank and checkpoints live under it)."""
    env_threads: int = 128
    """Threads per engine process that step the envs."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else a later version adds (ignored when unknown)."""

    @classmethod
    def of(
        cls,
        cfg: TrainConfig,
        *,
        service_name: str,
        namespace: str,
        run_dir: str,
        env_threads: int = 128,
        **extra: object,
    ) -> ClusterSettings:
        return cls(
            config_to_dict(cfg),
            service_name,
            namespace,
            str(run_dir),
            int(env_threads),
            dict(extra),
        )

    def train_config(self) -> TrainConfig:
        return config_from_dict(dict(self.config))

    def to_json(self) -> str:
        return json.dumps(
            {
                "config": self.config,
                "service_name": self.service_name,
                "namespace": self.namespace,
                "run_dir": self.run_dir,
                "env_threads": self.env_threads,
                "extra": self.extra,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> ClusterSettings:
        try:
            d = json.loads(text)
            return cls(
                dict(d["config"]),
                str(d["service_name"]),
                str(d["namespace"]),
                str(d["run_dir"]),
                int(d.get("env_threads", 128)),
                dict(d.get("extra") or {}),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"{SETTINGS_ENV} is not valid settings JSON ({type(exc).__name__}: {exc})"
            ) from None


def load_settings(environ: Mapping[str, str] | None = None) -> ClusterSettings:
    """The settings of this process's run; :class:`SettingsMissing` when there are none."""
    env = os.environ if environ is None else environ
    text = env.get(SETTINGS_ENV)
    if not text:
        raise SettingsMissing(
            f"{SETTINGS_ENV} is not set: start the run with `crl-train --backend openrlhf "
            "--config FILE`, which puts it in every Ray process's environment"
        )
    return ClusterSettings.from_json(text)


__all__ = ["SETTINGS_ENV", "ClusterSettings", "SettingsMissing", "load_settings"]
