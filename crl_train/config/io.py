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
import difflib
import logging
import math
import re
import types
import typing
from collections.abc import Iterable
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Union

import yaml

from crl_gym.json_types import JSONDict

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

log = logging.getLogger(__name__)

_EXPONENT_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+")
"""``1e-6``, ``5E+3``: floats that YAML 1.1 loaders return as strings."""


class ConfigError(ValueError):
    """A config key or value is not accepted; the message names the key."""


class _NotFinite(ConfigError):
    """A float value that is NaN or infinite (kept through a union: ``float | None`` names it)."""


def _type_name(tp: object) -> str:
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
    if isinstance(tp, type) and issubclass(tp, Enum):
        return "one of " + ", ".join(repr(m.value) for m in tp)
    return getattr(tp, "__name__", str(tp))


def _coerce(value: object, tp: object, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it in the field's Python type."""
    origin = typing.get_origin(tp)
    bad = ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    if tp is Any:
        return _finite_inside(value, key)
    if origin in (Union, types.UnionType):
        not_finite: _NotFinite | None = None
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key)
            except _NotFinite as exc:
                not_finite = exc
            except ConfigError:
                continue
        raise not_finite or bad
    if tp is type(None):
        if value is None:
            return None
        raise bad
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise bad
    if isinstance(tp, type) and issubclass(tp, Enum):
        return enum_member(tp, value, key)
    if origin is tuple:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise bad
        (elem,) = typing.get_args(tp)[:1]
        return tuple(_coerce(v, elem, f"{key}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise bad
        return _finite_inside(dict(value), key)
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
            number = float(value)
        elif isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()):
            number = float(value)  # YAML 1.1 reads ``1e-6`` (no dot) as a string
        else:
            raise bad
        return _finite(number, value, key)
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    raise ConfigError(f"{key}: unsupported field type {tp!r}")


E = typing.TypeVar("E", bound=Enum)


def enum_member(enum: type[E], value: object, key: str) -> E:
    """The member of ``enum`` whose value is ``value`` (or ``value`` itself), else
    :class:`ConfigError` naming the accepted values."""
    try:
        return enum(value)
    except ValueError:
        accepted = ", ".join(str(m.value) for m in enum)
        raise ConfigError(
            f"{key}: unknown {key.rsplit('.', 1)[-1]} {value!r}; accepted: {accepted}"
        ) from None


def _finite(number: float, value: object, key: str) -> float:
    """A float field's value, refused when NaN or ±inf (YAML's ``.nan``/``.inf``, or ``1e999``): a
    NaN learning rate or clip range trains nothing and says nothing, so it never enters a config."""
    if not math.isfinite(number):
        raise _NotFinite(f"{key}: expected a finite number, got {value!r}")
    return number


def _finite_inside(value: object, key: str) -> object:
    """``value`` (a free-form mapping such as ``env.kwargs``) with every float inside it finite."""
    if isinstance(value, float):
        return _finite(value, value, key)
    if isinstance(value, dict):
        for k, v in value.items():
            _finite_inside(v, f"{key}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _finite_inside(v, f"{key}[{i}]")
    return value


_warned: set[str] = set()
"""Old keys whose deprecation was logged (once per process each)."""


def _renamed(cls: type) -> dict[str, str]:
    """``cls.RENAMED``: old key → its dotted place now (a section's field), for configs written
    before the sections; empty for classes without one."""
    renamed: dict[str, str] = getattr(cls, "RENAMED", {})
    return renamed


def _move_renamed(
    cls: type, data: dict[str, Any], prefix: str
) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """``data`` with its old keys moved to their sections, each value checked under the old key's
    name (so an error names what the user wrote), and the old keys used per section. A mapping under
    a key that is a section now (``gate: {enabled: true}``) is the new layout, not an old key."""
    renamed = _renamed(cls)
    out = {k: v for k, v in data.items() if k not in renamed or isinstance(v, dict)}
    used: dict[str, list[str]] = {}
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        if key not in renamed or isinstance(value, dict):
            continue
        old = f"{prefix}.{key}" if prefix else str(key)
        section, name = renamed[key].split(".", 1)
        new = f"{prefix}.{renamed[key]}" if prefix else renamed[key]
        target = typing.get_type_hints(hints[section])[name]
        value = _coerce(value, target, old)
        node = out.get(section)
        if node is None or not isinstance(node, dict):
            node = out[section] = {}
        if name in node:
            raise ConfigError(
                f"{old} and {new} are both given: keep {new} (the old key is deprecated)"
            )
        node[name] = value
        used.setdefault(section, []).append(old)
        if old not in _warned:
            _warned.add(old)
            log.warning(
                "config key %s is deprecated: it is %s now (the old name still works)", old, new
            )
    return out, used


def renamed_attribute(obj: object, name: str) -> Any:
    """An old attribute name of a config (``cfg.algo.edge_lambda``) read through its section
    (``cfg.algo.edge.kl_weight``); ``AttributeError`` for any other missing name."""
    path = _renamed(type(obj)).get(name)
    if path is None:
        raise AttributeError(f"{type(obj).__name__!r} object has no attribute {name!r}")
    value = obj
    for part in path.split("."):
        value = getattr(value, part)
    return value


def unknown_key_message(full: str, names: Iterable[str]) -> str:
    """The error of an unknown key ``full`` (dotted) among the accepted ``names`` of its section:
    the close match, when one is (:func:`difflib.get_close_matches`), then every accepted key.

    >>> unknown_key_message("train.stepz", ["steps", "log_every"])
    "unknown key 'train.stepz' (did you mean 'train.steps'?); accepted keys: log_every, steps"
    """
    prefix, _, key = full.rpartition(".")
    close = difflib.get_close_matches(key, list(names), n=1)
    hint = f" (did you mean {(f'{prefix}.' if prefix else '') + close[0]!r}?)" if close else ""
    return f"unknown key {full!r}{hint}; accepted keys: {', '.join(sorted(names))}"


def build_dataclass(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """``cls(**data)`` with every value checked against its field's annotation (floats finite);
    an unknown key, a wrong type or a failing ``__post_init__`` raises :class:`ConfigError` naming
    the key. Old keys of ``cls.RENAMED`` are accepted, moved to their sections, with a
    deprecation warning."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    data, used = _move_renamed(cls, data, prefix)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise ConfigError(unknown_key_message(full, names))
        try:
            kwargs[key] = _coerce(value, hints[key], full)
        except ConfigError as exc:
            if key not in used:
                raise
            raise type(exc)(
                f"{exc} (set through the deprecated key {', '.join(used[key])})"
            ) from None
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        if prefix and not str(exc).startswith(prefix):
            raise ConfigError(f"{prefix}: {exc}") from None
        raise
    except (ValueError, TypeError) as exc:  # ManagerConfig and other foreign validators
        raise ConfigError(f"{prefix or 'config'}: {exc}") from None


def _choices(tp: object) -> tuple[Any, ...] | None:
    """The values a ``Literal`` annotation (or ``Literal | None``) allows; None for any
    other type."""
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    if typing.get_origin(tp) in (Union, types.UnionType):
        found = [c for a in typing.get_args(tp) if (c := _choices(a)) is not None]
        if found:
            return (*found[0], *(None for a in typing.get_args(tp) if a is type(None)))
    return None


def check_choices(obj: DataclassInstance, prefix: str = "") -> None:
    """Every ``Literal`` field of dataclass ``obj`` holds one of its values: the one check of every
    choice, read from the type hints (a ``__post_init__`` calls it), so a choice is stated once, in
    its annotation. A bad value raises :class:`ConfigError` naming the field and the
    accepted values.

    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class C:
    ...     mode: Literal["a", "b"] = "a"
    ...     def __post_init__(self) -> None:
    ...         check_choices(self, "c")
    >>> C("z")
    Traceback (most recent call last):
    ...
    crl_train.config.io.ConfigError: c.mode: expected one of 'a', 'b', got 'z'
    """
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        allowed = _choices(hints[f.name])
        value = getattr(obj, f.name)
        if allowed is not None and value not in allowed:
            key = f"{prefix}.{f.name}" if prefix else f.name
            raise ConfigError(
                f"{key}: expected one of {', '.join(repr(a) for a in allowed)}, got {value!r}"
            )


def set_path(data: dict[str, Any], dotted: str, value: object) -> None:
    parts = dotted.split(".")
    node = data
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: {p!r} is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, object]:
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


def read_yaml(path: str | Path) -> JSONDict:
    """The mapping in a YAML file; a missing, unreadable, non-UTF-8 or non-mapping file raises
    :class:`ConfigError` naming it (never a bare ``UnicodeDecodeError`` traceback)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        line = p.read_bytes()[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"{p}: not UTF-8 text (byte {exc.start}, line {line}: "
            f"{exc.object[exc.start : exc.start + 1]!r}); save the file as UTF-8"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read the config file ({exc.strerror or exc})") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: invalid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping")
    return data


def config_to_dict(cfg: DataclassInstance) -> JSONDict:
    """A plain, YAML-safe dict (tuples become lists)."""

    def plain(v: object) -> Any:
        if isinstance(v, Enum):
            return v.value
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, list):
            return [plain(x) for x in v]
        return v

    out: dict[str, Any] = plain(dataclasses.asdict(cfg))
    return out
