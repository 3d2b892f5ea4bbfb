"""Closing a rollout step over a vector env whose copies submit from their own processes.

Each ``AsyncVectorEnv`` worker holds its own :class:`~crl_gym.clients.RemoteClient`, whose
``submit`` only buffers: a request may still be on its way when the driver calls
``client.end_step(t)``, and a request that arrives after its step ended is late, never credited.
:func:`end_step` is the barrier: it has every copy flush (``flush_experience`` of each copy's
:class:`~crl_gym.wrappers.ExperienceWrapper`, run inside the worker) and only then closes the step.

>>> from crl_gym.clients import LocalClient
>>> from crl_gym.experience.bank import ExperienceBank
>>> from crl_gym.experience.embedders import HashingEmbedder
>>> from crl_gym.experience.manager import ExperienceManager
>>> from crl_gym.wrappers import ExperienceWrapper
>>> from crl_gym.wrappers.examples import CorridorEnv
>>> from gymnasium.vector import SyncVectorEnv
>>> client = LocalClient(ExperienceManager(ExperienceBank(None, dim=32), HashingEmbedder(32)))
>>> envs = SyncVectorEnv([lambda: ExperienceWrapper(CorridorEnv(length=1), client)] * 2)
>>> _ = envs.reset(seed=0, options={"rollout_step": 0}); _ = envs.step(["east", "east"])
>>> end_step(envs, client, 0).requests
2
>>> client.service.close()
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import gymnasium as gym

from crl_gym.clients import ExperienceClient
from crl_gym.experience.results import StepEnded
from crl_gym.json_types import FlushReport


@runtime_checkable
class CallsEachCopy(Protocol):
    """A vector env that runs a method of every copy (Gymnasium's ``SyncVectorEnv`` and
    ``AsyncVectorEnv``)."""

    def call(self, name: str, *args: object, **kwargs: object) -> tuple[Any, ...]: ...


def flush_workers(
    envs: CallsEachCopy | Iterable[gym.Env], timeout: float | None = None
) -> list[FlushReport]:
    """Run ``flush_experience(timeout)`` in every copy (in its own process for an
    ``AsyncVectorEnv``); one ``{"kept", "undelivered"}`` report per copy."""
    if isinstance(envs, CallsEachCopy):
        return list(envs.call("flush_experience", timeout))
    return [env.get_wrapper_attr("flush_experience")(timeout) for env in envs]


def end_step(
    envs: CallsEachCopy | Iterable[gym.Env],
    client: ExperienceClient,
    step: int,
    bonus: dict[str, float] | None = None,
    timeout: float | None = None,
) -> StepEnded:
    """:func:`flush_workers`, then ``client.end_step(step, bonus)``; the answer gains ``workers``
    (the per-copy reports). A copy that reports undelivered requests (they are in its client's
    spill file) does not stop the step from closing: the answer says so, and it is logged."""
    reports = flush_workers(envs, timeout)
    return dataclasses.replace(client.end_step(step, bonus), workers=reports)
