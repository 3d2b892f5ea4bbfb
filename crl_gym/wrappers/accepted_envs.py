"""What the wrappers accept: a ``gymnasium.Env`` whose observations and actions are text.

Anything else is refused when the wrapper is built, with a ``TypeError`` that names the adapter to
write or to use (a GEM-style env, an old ``gym`` env, TextWorld, a vector env), so a user learns at
once, not at the first episode, what to change (``docs/wrappers.md``, "Your own env").

>>> from gymnasium import spaces
>>> from crl_gym.wrappers.examples import CorridorEnv
>>> require_gym_env(CorridorEnv(length=1), "ExperienceWrapper")  # a text env: accepted
>>> class Pixels(CorridorEnv):
...     def __init__(self) -> None:
...         super().__init__(length=1)
...         self.observation_space = spaces.Box(0, 1, (2,))
>>> require_text_spaces(Pixels(), "ExperienceWrapper")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
TypeError: ExperienceWrapper needs text observations, but Pixels.observation_space is Box(...
"""

from __future__ import annotations

import inspect

import gymnasium as gym
from gymnasium import spaces

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


def require_gym_env(env: object, wrapper: str) -> None:
    """Refuse anything but a ``gymnasium.Env`` with a ``TypeError`` that names the adapter to use
    (gymnasium's own check is an ``assert`` that names none, and vanishes under ``python -O``)."""
    if isinstance(env, gym.Env):
        return
    kind = type(env)
    name = f"{kind.__module__}.{kind.__qualname__}"
    root = (kind.__module__ or "").split(".")[0]
    gem = "crl_gym.envs.gem_adapter.GEMEnv(env=obj)"
    if isinstance(env, str):
        hint = f"make the env first: {wrapper}(crl_gym.envs.make({env!r}), client)"
    elif isinstance(env, gym.vector.VectorEnv):
        hint = "wrap each copy inside the vector env (in its env_fns), not the vector env itself"
    elif root == "textworld":
        hint = (
            "build it from its game files instead: "
            "crl_gym.envs.textworld_env.TextWorldEnv(game_files) or "
            "crl_gym.envs.make('crl/TextWorld-v0', game_files=...)"
        )
    elif root == "gem":
        hint = f"adapt it with {gem}, or make it by id: crl_gym.envs.make('crl/GEM-v0', env_id=...)"
    elif root == "gym":
        hint = (
            f"it is an env of the old 'gym' package: convert it with shimmy "
            f"(gymnasium.make('GymV26Environment-v0', env=obj)), or adapt it with {gem}"
        )
    elif gem_adaptable(env):
        hint = (
            "if its reset(seed=...) returns (obs, info) and step(action) returns (obs, reward, "
            f"terminated, truncated, info) with text, adapt it with {gem}; otherwise write a small "
            f"gymnasium.Env adapter ({OWN_ENV_DOC})"
        )
    else:
        hint = (
            "write a small gymnasium.Env adapter with text observations and actions around it "
            f"({OWN_ENV_DOC})"
        )
    raise TypeError(f"{wrapper} wraps a gymnasium.Env, got {name}; {hint}")


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
