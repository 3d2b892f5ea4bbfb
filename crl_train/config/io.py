"""Config I/O that knows nothing about the trainer's fields: YAML reading, ``--set`` overrides,
type checking of values against dataclass annotations, and the way back to plain dicts.

:mod:`crl_train.config` defines the dataclasses and builds them with these helpers.

>>> parse_override("train.steps=3")
('train.steps', 3)
>>> data = {}
>>> set_path(data, "a.b", [1, 2]); data
{'a': {'b': [1, 2]}}
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

_EXPONENT_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")
"""``1e-6``, ``5E+3``: floats that YAML 1.1 loaders return as strings."""


class ConfigError(ValueError):
    """A config key or value is not accepted; the message names the key."""


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it in the field's Python type."""
    origin = typing.get_origin(tp)
    bad = ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
        raise bad
    if tp is type(None):
        if value is None:
            return None
        raise bad
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise bad
    if origin is tuple:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise bad
        (elem,) = typing.get_args(tp)[:1]
        return tuple(_coerce(v, elem, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise bad
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise bad
        return build_dataclass(tp, value, key)  # type: ignore[arg-type]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()):
            return float(value)  # YAML 1.1 reads ``1e-6`` (no dot) as a string
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    raise ConfigError(f"{key}: unsupported field type {tp!r}")


def build_dataclass(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise ConfigError(f"unknown key {full!r}; accepted keys: {', '.join(sorted(names))}")
        kwargs[key] = _coerce(value, hints[key], full)
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        if prefix and not str(exc).startswith(prefix):
            raise ConfigError(f"{prefix}: {exc}") from None
        raise
    except (ValueError, TypeError) as exc:  # ManagerConfig and other foreign validators
        raise ConfigError(f"{prefix or 'config'}: {exc}") from None


def set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: {p!r} is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``"a.b=c"`` → ``("a.b", yaml.safe_load("c"))``."""
    if "=" not in text:
        raise ConfigError(f"--set expects key=value, got {text!r}")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"--set expects key=value, got {text!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {key}: cannot parse value {raw!r}: {exc}") from None
    return key, value


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: invalid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping")
    return data


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """A plain, YAML-safe dict (tuples become lists)."""

    def plain(v: Any) -> Any:
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, list):
            return [plain(x) for x in v]
        return v

    out: dict[str, Any] = plain(dataclasses.asdict(cfg))
    return out
