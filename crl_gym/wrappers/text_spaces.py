"""What a wrapped env must offer (text spaces), and the space a guided observation lives in.

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

import inspect
import string

from gymnasium import spaces

from crl_gym.wrappers.text_actions import TextFitter

WRAPPER_CHARSET: frozenset[str] = frozenset(string.printable)
"""Characters the wrappers' own text (an entry, a template) may always use in a widened space."""

DEFAULT_MAX_ENTRY_CHARS = 2000
"""Longest entry a guided observation shows (the extractor's entries are at most this long too)."""

NOT_TEXT_SPACES: tuple[type[spaces.Space], ...] = (
    spaces.Box,
    spaces.Discrete,
    spaces.MultiDiscrete,
    spaces.MultiBinary,
    spaces.Dict,
    spaces.Tuple,
    spaces.Sequence,
    spaces.Graph,
    spaces.OneOf,
)
"""Gymnasium spaces whose elements are never ``str``: a wrapper refuses an env that declares one."""

OWN_ENV_DOC = "docs/wrappers.md, section 'Your own env'"


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


def require_text_spaces(env: object, wrapper: str) -> None:
    """Refuse an env whose observation or action space is one of :data:`NOT_TEXT_SPACES`, with a
    ``TypeError`` that says which adapter to write (a space of another class, e.g. a user's own
    whose elements are ``str``, is taken on trust)."""
    for what in ("observation", "action"):
        space = getattr(env, f"{what}_space", None)
        if isinstance(space, NOT_TEXT_SPACES):
            name = getattr(getattr(env, "unwrapped", env), "__class__", type(env)).__name__
            raise TypeError(
                f"{wrapper} needs text {what}s, but {name}.{what}_space is {space!r}. Write a "
                f"small gymnasium.Env adapter around it whose {what}s are str: observation_space = "
                "action_space = crl_gym.envs.base.text_space() (or subclass "
                f"crl_gym.envs.base.TextEnv), turning each {what} into text (see {OWN_ENV_DOC})"
            )


def gem_adaptable(env: object) -> bool:
    """Whether :class:`crl_gym.envs.gem_adapter.GEMEnv` can drive ``env``: ``reset(seed=...)``
    needs no other argument and ``step(action)`` takes one (GEMEnv calls exactly these)."""
    return _callable_with(getattr(env, "reset", None), keywords=("seed",)) and _callable_with(
        getattr(env, "step", None), positional=1
    )


def _callable_with(fn: object, *, positional: int = 0, keywords: tuple[str, ...] = ()) -> bool:
    if not callable(fn):
        return False
    try:
        sig = inspect.signature(fn)
    except (
        TypeError,
        ValueError,
    ):  # a builtin without a signature: give it the benefit of the doubt
        return True
    params = list(sig.parameters.values())
    if any(p.kind is p.VAR_KEYWORD for p in params):
        accepts_keywords = True
    else:
        names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        accepts_keywords = all(k in names for k in keywords)
    try:
        sig.bind(*([None] * positional), **dict.fromkeys(keywords))
    except TypeError:
        return False
    return accepts_keywords
