"""Env ids: any Gymnasium id, as ``crl-train``, ``crl-eval`` and the integrations take it.

An id is found, in this order, among the ``crl/`` ids (:data:`crl_gym.envs.registry.ENVS`), the
ids already in ``gymnasium.registry``, Gymnasium's own ``"module:EnvId-v0"`` form (the module is
imported first, so its ``gymnasium.register`` call runs, as ``gymnasium.make`` does) and the ids
that installed packages register through the entry-point group :data:`ENTRY_POINT_GROUP`. An id
found nowhere raises :class:`UnknownEnvError`, which says how to register one.

>>> resolve("crl/Recall-v0")
'crl/Recall-v0'
>>> resolve("NoSuchEnv-v0")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
crl_gym.envs.ids.UnknownEnvError: unknown environment 'NoSuchEnv-v0'. ...
"""

from __future__ import annotations

import importlib
import logging
from importlib.metadata import entry_points

import gymnasium as gym

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "crl_gym.envs"
"""Entry-point group of packages that register env ids. Each entry point names a module (importing
it registers its ids with ``gymnasium.register``) or a callable (called once, with no arguments)."""

HOW_TO_REGISTER = (
    "To use an env of your own: call gymnasium.register('MyEnv-v0', entry_point='mymodule:MyEnv') "
    "in a module on PYTHONPATH and pass the id as 'mymodule:MyEnv-v0' (the module is imported "
    f"first), or declare an entry point in the group {ENTRY_POINT_GROUP!r} of your package "
    "(docs/wrappers.md, 'Train on your own env')."
)

_loaded: dict[str, str | None] = {}
"""Entry point name -> None when it loaded, else why it did not (each is loaded once
per process)."""


class UnknownEnvError(gym.error.UnregisteredEnv):
    """An env id that no registry knows; the message lists the ``crl/`` ids and how to
    register one."""


def load_entry_points() -> dict[str, str | None]:
    """Load every entry point of :data:`ENTRY_POINT_GROUP` not loaded yet; what each gave
    (None, or why it failed: logged once, and named by a later :class:`UnknownEnvError`)."""
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _loaded:
            continue
        try:
            target = ep.load()
            if callable(target):
                target()
            _loaded[ep.name] = None
        except Exception as exc:  # noqa: BLE001 - one broken package must not hide the others' ids
            _loaded[ep.name] = f"{type(exc).__name__}: {exc}"
            log.warning(
                "entry point %r (%s) of group %r failed to load, its env ids are missing: %s",
                ep.name,
                ep.value,
                ENTRY_POINT_GROUP,
                _loaded[ep.name],
            )
    return dict(_loaded)


def _registered(env_id: str) -> bool:
    try:
        gym.spec(env_id)
    except gym.error.Error:
        return False
    return True


def resolve(env_id: str) -> str:
    """Make sure ``env_id`` is registered with Gymnasium (importing what registers it) and
    return it.

    Raises :class:`UnknownEnvError` (a ``gymnasium.error.UnregisteredEnv``) when nothing registers
    it, and ``ModuleNotFoundError`` naming the id when its ``module:`` part cannot be imported.
    """
    from crl_gym.envs.registry import ENVS, register_all

    if not isinstance(env_id, str) or not env_id.strip():
        raise UnknownEnvError(
            f"an env id must be a non-empty string, got {env_id!r}. {HOW_TO_REGISTER}"
        )
    register_all()
    if env_id in ENVS:
        return env_id
    module, sep, name = env_id.partition(":")
    if sep:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(
                f"env id {env_id!r}: its module {module!r} cannot be imported ({exc}); put the "
                "directory that holds it on PYTHONPATH (or install its package)",
                name=exc.name,
            ) from exc
        if _registered(name):
            return env_id
        raise UnknownEnvError(
            f"env id {env_id!r}: importing {module!r} did not register {name!r}. {HOW_TO_REGISTER}"
        )
    if _registered(env_id):
        return env_id
    failed = {k: v for k, v in load_entry_points().items() if v is not None}
    if _registered(env_id):
        return env_id
    known = ", ".join(sorted(ENVS))
    broken = "".join(f" Entry point {k!r} failed to load: {v}." for k, v in failed.items())
    raise UnknownEnvError(
        f"unknown environment {env_id!r}. Known crl environments: {known}.{broken} "
        f"{HOW_TO_REGISTER}"
    )


__all__ = ["ENTRY_POINT_GROUP", "UnknownEnvError", "load_entry_points", "resolve"]
