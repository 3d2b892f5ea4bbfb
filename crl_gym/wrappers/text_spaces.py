"""The space a guided observation lives in, and how an entry is fitted into it.

A wrapper never changes the env's own observation text: a guided episode's first observation is
``template.format(experience=entry, observation=obs)`` with ``obs`` exactly as the env gave it,
so the guided and the free half of a group read the same task. Only the wrapper's own text (the
entry) is fitted, and the wrapper's observation space is the env's ``Text`` space widened to hold
it (:func:`guided_space`): the env's charset plus printable ASCII plus the template's characters,
and ``max_length`` plus room for the template and an entry of ``max_entry_chars``.

>>> from gymnasium import spaces
>>> env_space = spaces.Text(max_length=20, charset="abc ")
>>> space = guided_space(env_space, "Tip: {experience}\\n{observation}", max_entry_chars=10)
>>> space.max_length, "T" in space.character_set, "é" in space.character_set
(36, True, False)
>>> EntryFitter(space, 10)("Go → east, then north")
'Go ? east,'
"""

from __future__ import annotations

import string

from gymnasium import spaces

from crl_gym.wrappers.text_actions import TextFitter

WRAPPER_CHARSET: frozenset[str] = frozenset(string.printable)
"""Characters the wrappers' own text (an entry, a template) may always use in a widened space."""

DEFAULT_MAX_ENTRY_CHARS = 2000
"""Longest entry a guided observation shows (the extractor's entries are at most this long too)."""


def guided_space(space: object, template: str, max_entry_chars: int) -> object:
    """The observation space of a guided episode: ``space`` itself when it is not a ``Text``; else
    a ``Text`` that holds the env's observation (any member of ``space``) with an entry of up to
    ``max_entry_chars`` characters (fitted with :class:`EntryFitter`) through ``template``."""
    if not isinstance(space, spaces.Text):
        return space
    literal = template.replace("{experience}", "").replace("{observation}", "")
    # "{{" in a template is one "{" once formatted: counting the raw text over-counts, never under
    extra = len(literal) + template.count("{experience}") * max_entry_chars
    extra_obs = (template.count("{observation}") - 1) * int(space.max_length)
    charset = frozenset(space.character_set) | WRAPPER_CHARSET | frozenset(literal)
    return spaces.Text(
        max_length=int(space.max_length) + extra + extra_obs,
        min_length=space.min_length,
        charset=charset,
    )


class EntryFitter:
    """An entry's text fitted to a widened space: characters outside its charset become ``?``
    and the text is cut to ``max_entry_chars`` (the env's observation is never passed here)."""

    __slots__ = ("_fit", "_max")

    def __init__(self, space: object, max_entry_chars: int) -> None:
        self._fit = TextFitter(space)
        self._max = int(max_entry_chars)

    def __call__(self, text: str) -> str:
        return self._fit(text[: self._max])
