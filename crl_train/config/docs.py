"""The config key reference, derived from the config dataclasses themselves (one source of
help text).

Every config field carries its documentation as an attribute docstring (TRL style)::

    steps: int = 40
    \"\"\"Actor steps (rollout → advantages → update).\"\"\"

Python keeps no attribute docstrings at run time, so they are read from the class source with
:mod:`ast` (``inspect.getsource``). The sections are found by walking the dataclasses reachable
from the top-level :class:`~crl_train.config.TrainConfig`, wherever they are defined (``config.py``,
a split-off module, or ``crl_gym.experience.config`` for ``manager``). Defaults are read from a
default-constructed top-level config, so ``actor.constrained`` shows the actor's default (True),
not :class:`ModelConfig`'s class default.

Two consumers: :func:`config_reference` (one :class:`ConfigKey` per ``section.key``) and
:func:`render_config_yaml` (``crl-train --show-config``: the resolved config as YAML, each field's
doc as a comment above it; the text loads back to the same config).

>>> ref = {k.key: k for k in config_reference()}
>>> ref["train.steps"].type, ref["train.steps"].default, ref["train.steps"].doc
('int', 40, 'Actor steps (rollout → advantages → update).')
>>> ref["actor.constrained"].default, ref["extractor.constrained"].default
(True, False)
>>> from crl_train.config import config_from_dict
>>> import yaml
>>> cfg = TrainConfig()
>>> config_from_dict(yaml.safe_load(render_config_yaml(cfg))) == cfg
True
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import logging
import textwrap
import types
import typing
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Literal, Union

import yaml

from crl_train.config import TrainConfig

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

log = logging.getLogger(__name__)

COMMENT_WIDTH = 96
"""Comment lines of ``--show-config`` are wrapped at this many characters (indent included)."""


@dataclass(frozen=True)
class ConfigKey:
    """One config key of the reference."""

    key: str
    """Dotted path, e.g. ``train.steps`` (``method`` for a top-level field)."""
    type: str
    """The annotation in words: ``int``, ``list of str``, ``one of 'token', 'sequence'``,
    ``bool or null``."""
    default: object
    """Value in a default-constructed top-level config (YAML-ready: tuples as lists)."""
    doc: str
    """The field's attribute docstring, whitespace-normalised; empty when the field has none."""
    section: bool = False
    """True for a field that is itself a dataclass (its keys follow under ``key.``)."""


# ----------------------------------------------------------------------------- docstrings


@functools.cache
def _own_field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` for the annotated assignments written in ``cls``'s own body."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError) as exc:  # defined in a REPL / exec: nothing to read
        log.warning(
            "no source for %s (%s): its fields have no documentation", cls.__qualname__, exc
        )
        return {}
    tree = ast.parse(source)
    node = next(
        (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls.__name__), None
    )
    if node is None:
        return {}
    docs: dict[str, str] = {}
    body = node.body
    for stmt, nxt in zip(body, [*body[1:], None], strict=True):
        # a string expression right after `name: type = ...` documents `name`
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs


def field_docs(cls: type) -> dict[str, str]:
    """``{field name: doc}`` of dataclass ``cls``, bases included (a subclass's doc wins).

    >>> doc = field_docs(TrainConfig)["method"]
    >>> doc.startswith("One of grpo, complementary, static_online, exp_only")
    True
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_own_field_docs(klass))
    return {f.name: docs.get(f.name, "") for f in dataclasses.fields(cls)}


# ----------------------------------------------------------------------------- types


def type_name(tp: object) -> str:
    """An annotation in words (the vocabulary of the config errors).

    >>> type_name(tuple[str, ...]), type_name(int | None), type_name(Literal["a", "b"])
    ('list of str', 'int or null', "one of 'a', 'b'")
    """
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if origin in (tuple, list):
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict:
        return "mapping"
    if dataclasses.is_dataclass(tp):
        return "section"
    if isinstance(tp, type) and issubclass(tp, Enum):
        return "one of " + ", ".join(repr(m.value) for m in tp)
    return getattr(tp, "__name__", str(tp))


def _section_class(tp: object) -> type | None:
    """The dataclass inside annotation ``tp`` (``X`` or ``X | None``), else None."""
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return tp
    if typing.get_origin(tp) in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            found = _section_class(arg)
            if found is not None:
                return found
    return None


def _plain(value: object) -> object:
    """YAML-safe form of a config value (tuples → lists, dataclasses → dicts)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, Enum):
        return value.value
    return value


def _default_instance(cls: type) -> object:
    try:
        return cls()
    except Exception as exc:  # noqa: BLE001 - a class without full defaults: fall back per field
        log.warning(
            "%s() cannot be built with its defaults (%s): class defaults are shown",
            cls.__qualname__,
            exc,
        )
        return None


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


# ----------------------------------------------------------------------------- reference


def config_reference(cls: type = TrainConfig) -> list[ConfigKey]:
    """Every key reachable from the top-level config class, in declaration order, sections first."""
    out: list[ConfigKey] = []
    _walk(cls, _default_instance(cls), "", out)
    return out


def _walk(cls: type, default: object, prefix: str, out: list[ConfigKey]) -> None:
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        value = getattr(default, f.name) if default is not None else _field_default(f)
        sub = _section_class(hints[f.name])
        if sub is not None and (value is None or dataclasses.is_dataclass(value)):
            out.append(ConfigKey(key, "section", None, docs[f.name], section=True))
            _walk(sub, value, key + ".", out)
        else:
            out.append(ConfigKey(key, type_name(hints[f.name]), _plain(value), docs[f.name]))


def undocumented_keys(cls: type = TrainConfig) -> list[str]:
    """Keys whose field has no docstring (the test keeps this empty)."""
    return [k.key for k in config_reference(cls) if not k.doc]


# ----------------------------------------------------------------------------- YAML with comments


def _flow(value: object) -> str:
    """``value`` as one line of flow YAML (``[a, b]``, ``{k: 1}``, ``null``, ``'quoted: text'``)."""
    text = yaml.safe_dump(value, default_flow_style=True, allow_unicode=True, width=10**6)
    lines = text.splitlines()
    if lines and lines[-1] == "...":  # the document-end marker pyyaml adds after a bare scalar
        lines = lines[:-1]
    if len(lines) != 1:  # a string with line breaks: double quotes keep it on one line (\n escapes)
        text = yaml.safe_dump(
            value, default_flow_style=True, default_style='"', allow_unicode=True, width=10**6
        )
        # width=10**6: the emitter does not fold, so this is one line (plus the end marker)
        return next(line for line in text.splitlines() if line != "...")
    return lines[0]


def _comment(text: str, indent: str) -> list[str]:
    width = max(40, COMMENT_WIDTH - len(indent) - 2)
    return [f"{indent}# {line}" for line in textwrap.wrap(text, width)] if text else []


def render_config_yaml(cfg: DataclassInstance, header: str | None = None) -> str:
    """``cfg`` as YAML, every field preceded by comments: its doc, then ``type: …; default: …``.

    ``yaml.safe_load`` of the text gives the plain dict of ``cfg`` (comments are ignored), so
    the output can be saved and passed back with ``--config``.
    """
    lines: list[str] = [f"# {h}" if h else "#" for h in header.splitlines()] if header else []
    cls = type(cfg)
    defaults = {k.key: k for k in config_reference(cls)}
    _render(cfg, "", 0, defaults, lines)
    return "\n".join(lines) + "\n"


def _render(
    obj: DataclassInstance, prefix: str, depth: int, ref: dict[str, ConfigKey], lines: list[str]
) -> None:
    indent = "  " * depth
    for f in dataclasses.fields(obj):
        key = f"{prefix}{f.name}"
        value = getattr(obj, f.name)
        info = ref.get(key)
        doc = info.doc if info is not None else ""
        if depth == 0 and lines:
            lines.append("")
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            lines += _comment(doc, indent)
            lines.append(f"{indent}{f.name}:")
            _render(value, key + ".", depth + 1, ref, lines)
            continue
        plain = _plain(value)
        lines += _comment(doc, indent)
        if info is not None:
            lines.append(f"{indent}# type: {info.type}; default: {_flow(info.default)}")
        lines.append(f"{indent}{f.name}: {_flow(plain)}")


__all__ = [
    "ConfigKey",
    "config_reference",
    "field_docs",
    "render_config_yaml",
    "type_name",
    "undocumented_keys",
]
