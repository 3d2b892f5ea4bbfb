"""Small text helpers shared by the wrappers: template checks, fitting text into a space.

>>> check_template("Tip: {experience}\\n{observation}", "template", ("experience", "observation"))
'Tip: {experience}\\n{observation}'
>>> check_template("Tip: {tip}", "template", ("experience", "observation"))
Traceback (most recent call last):
...
ValueError: template uses unknown field(s) {tip}; allowed: {experience}, {observation}
>>> from gymnasium import spaces
>>> fit_to_space("café", spaces.Text(max_length=10, charset="abcdef?"))
'caf?'
"""

from __future__ import annotations

import re
import string
from typing import Generic, TypeVar

from gymnasium import spaces


def check_template(
    template: str, name: str, allowed: tuple[str, ...], required: tuple[str, ...] = ()
) -> str:
    """Validate a ``str.format`` template up front, so a bad one fails at construction, naming
    the argument, rather than with a ``KeyError`` in the middle of a rollout."""
    if not isinstance(template, str):
        raise TypeError(f"{name} must be a str, got {type(template).__name__}")
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
    except ValueError as exc:
        raise ValueError(
            f"{name} is not a valid format string ({exc}); write literal braces as {{{{ }}}}"
        ) from exc
    unknown = fields - set(allowed)
    if unknown:
        listing = ", ".join("{" + f + "}" for f in sorted(unknown))
        ok = ", ".join("{" + f + "}" for f in allowed)
        raise ValueError(f"{name} uses unknown field(s) {listing}; allowed: {ok}")
    missing = [f for f in required if f not in fields]
    if missing:
        raise ValueError(f"{name} must contain " + ", ".join("{" + f + "}" for f in missing))
    return template


def fit_to_space(text: str, space: object) -> str:
    """Make ``text`` a member of ``space`` when it is a ``gymnasium.spaces.Text``: characters
    outside its charset become ``?`` and the text is cut to ``max_length``. Other spaces get
    ``text`` unchanged. Used only on text the wrappers write (experience, answers), never on
    the env's own observations. A wrapper that fits text at every reset should hold a
    :class:`TextFitter` instead (this builds one per call)."""
    return TextFitter(space)(text)


class TextFitter:
    """:func:`fit_to_space` for one space, with its checks compiled once.

    The charset test is one regex scan (C speed): a Python loop over a 400-character guided
    observation costs ~20 µs, most of a wrapper's per-episode budget.

    >>> from gymnasium import spaces
    >>> fit = TextFitter(spaces.Text(max_length=6, charset="abc?"))
    >>> fit("abcabcabc"), fit("axb")
    ('abcabc', 'a?b')
    >>> TextFitter(None)("anything")
    'anything'
    """

    __slots__ = ("_bad", "_charset", "_max_length", "_replacement")

    def __init__(self, space: object) -> None:
        self._bad: re.Pattern[str] | None = None
        self._max_length: int | None = None
        self._charset: frozenset[str] = frozenset()
        self._replacement = ""
        if isinstance(space, spaces.Text):
            self._charset = frozenset(space.character_set)
            self._max_length = int(space.max_length)
            self._replacement = "?" if "?" in self._charset else ""
            chars = "".join(sorted(self._charset))
            self._bad = re.compile(f"[^{re.escape(chars)}]") if chars else re.compile(r"[\s\S]")

    def __call__(self, text: str) -> str:
        if self._bad is None:
            return text
        if self._bad.search(text) is not None:
            text = self._bad.sub(self._replacement, text)
        return text[: self._max_length]


def as_text(action: object) -> str | None:
    """The action as ``str`` if it is text (``str`` or ``numpy.str_``), else ``None``."""
    return str(action) if isinstance(action, str) else None


class NotTextError(TypeError):
    """A value a distillation request must record as text (an action, an observation) is not
    text and has no lossless text form; the message names its type."""


def to_text(value: object) -> str:
    """``value`` as the text a distillation request records.

    ``str`` (and subclasses such as ``numpy.str_``) as plain ``str``; ``bytes``-like as UTF-8
    with undecodable bytes replaced (U+FFFD); Python numbers, numpy scalars and 0-d arrays as
    the ``str`` of their Python value. ``None``, arrays of one or more dimensions and other
    objects raise :class:`NotTextError`: their ``str`` would be a repr, not what the agent saw
    or did.

    >>> import numpy as np
    >>> (to_text(np.str_("east")), to_text(b"caf\\xc3\\xa9 \\xff"), to_text(np.int64(3)),
    ...  to_text(np.array(2.5)))
    ('east', 'café \\ufffd', '3', '2.5')
    >>> try:
    ...     to_text(np.zeros((2, 3)))
    ... except NotTextError as exc:
    ...     print(exc)
    a numpy.ndarray of shape (2, 3), not text
    """
    if isinstance(value, str):
        return value if type(value) is str else str.__str__(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, (bool, int, float)):
        return str(value)
    # numpy scalars and 0-d arrays (or tensors): their one Python value; duck-typed, so this
    # module does not import numpy
    item_of = getattr(value, "item", None)
    if getattr(value, "ndim", None) == 0 and callable(item_of):
        item = item_of()
        if isinstance(item, (str, bytes, bool, int, float)):
            return to_text(item)
    raise NotTextError(_describe(value) + ", not text")


def _describe(value: object) -> str:
    """``None`` / ``a numpy.ndarray of shape (2, 3)`` / ``a mymod.Action``: what a refusal names."""
    if value is None:
        return "None"
    cls = type(value)
    name = (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    )
    article = "an" if name[0].lower() in "aeiou" else "a"
    shape = getattr(value, "shape", None)
    return (
        f"{article} {name} of shape {tuple(shape)}"
        if isinstance(shape, tuple)
        else f"{article} {name}"
    )


T = TypeVar("T")


class Shared(Generic[T]):
    """Holds an object that must be shared, not copied, when Gymnasium deep-copies a wrapper's
    recorded constructor arguments (``env.spec``): an experience client is a handle to one
    bank, and may hold locks or sockets that cannot be copied.

    >>> import copy, threading
    >>> lock = threading.Lock()
    >>> copy.deepcopy(Shared(lock)).obj is lock
    True
    """

    __slots__ = ("obj",)

    def __init__(self, obj: T) -> None:
        self.obj = obj

    def __deepcopy__(self, memo: dict[int, object]) -> Shared[T]:
        return self

    def __repr__(self) -> str:
        return f"Shared({self.obj!r})"


def unshare(obj: T | Shared[T]) -> T:
    """``obj.obj`` for a :class:`Shared`, else ``obj`` (wrappers accept both)."""
    return obj.obj if isinstance(obj, Shared) else obj
