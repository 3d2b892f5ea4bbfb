"""Trainer configuration: frozen dataclasses with a docstring per field, loaded from YAML.

``load_config(path, overrides)`` reads a YAML file (or the packaged tiny preset when ``path`` is
None), applies ``--set a.b=c`` overrides (the value is parsed as YAML: ``3``, ``true``,
``[a, b]``) and validates everything before anything starts. An unknown key or a wrong type
raises :class:`ConfigError` naming the key, its close match when there is one, and the accepted
keys or type.

>>> cfg = load_config(None, ["train.steps=3", "method=grpo"])
>>> cfg.train.steps, cfg.method.value
(3, 'grpo')
>>> load_config(None, ["train.stepz=3"])  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
crl_train.config.io.ConfigError: unknown key 'train.stepz' (did you mean 'train.steps'?); ...
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from crl_train.config.algo import AlgoConfig, EdgeConfig, GateConfig, PerplexityConfig
from crl_train.config.env import EnvConfig
from crl_train.config.experience import ExperienceConfig
from crl_train.config.extractor import ExtractorSettings
from crl_train.config.io import (
    ConfigError,
    build_dataclass,
    config_to_dict,
    parse_override,
    read_yaml,
    set_path,
)
from crl_train.config.model import ModelConfig
from crl_train.config.names import MethodName
from crl_train.config.run import RunConfig, TrainConfig

METHOD_NAMES: tuple[str, ...] = tuple(m.value for m in MethodName)
PACKAGED_CONFIGS = Path(__file__).parent.parent / "configs"


# ------------------------------------------------------------------------------------ loading


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    """Validate a nested dict into a :class:`TrainConfig`."""
    if not isinstance(data, dict):
        raise ConfigError(f"a config must be a mapping at the top level, got {type(data).__name__}")
    result: TrainConfig = build_dataclass(TrainConfig, data)
    return result


def preset_path(path: str | Path | None) -> Path:
    """``path``, or the packaged preset it names (``small`` → ``crl_train/configs/small.yaml``) when
    no such file exists; None: the tiny preset."""
    if path is None:
        return PACKAGED_CONFIGS / "tiny.yaml"
    p = Path(path)
    packaged = PACKAGED_CONFIGS / f"{p.name}.yaml"
    if not p.exists() and p.suffix == "" and p.name == str(path) and packaged.is_file():
        return packaged
    return p


def load_config(
    path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()
) -> TrainConfig:
    """YAML file or packaged preset name (default: the packaged ``tiny.yaml``) + ``key=value``
    overrides → TrainConfig."""
    data = read_yaml(preset_path(path))
    for text in overrides:
        key, value = parse_override(text)
        set_path(data, key, value)
    return config_from_dict(data)


def dump_config(cfg: TrainConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), encoding="utf-8")


__all__ = [
    "ConfigError",
    "EnvConfig",
    "ModelConfig",
    "AlgoConfig",
    "EdgeConfig",
    "GateConfig",
    "PerplexityConfig",
    "ExperienceConfig",
    "ExtractorSettings",
    "RunConfig",
    "TrainConfig",
    "METHOD_NAMES",
    "PACKAGED_CONFIGS",
    "preset_path",
    "config_from_dict",
    "config_to_dict",
    "dump_config",
    "load_config",
    "parse_override",
    "read_yaml",
]
