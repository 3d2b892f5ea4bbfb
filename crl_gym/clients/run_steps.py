"""One training run's rollout steps on a service that outlives it.

A service numbers rollout steps once, in increasing order (``end_step`` of a step already ended
raises ``StepOrderError``). A trainer numbers its own steps from 0, so a second run against a
long-lived ``crl-experience serve`` would end step 0 again. :class:`RunSteps` gives each run its
own space: run step ``t`` is the service's step ``base + t``, where ``base`` is one past the last
step the service had ended when the run first used it (so a run's steps follow the previous
run's). A negative step (held-out evaluation) stays negative: the service never credits it. Runs
share a service one after the other; runs at the same time need a service each.

>>> from crl_gym.clients import LocalClient
>>> from crl_gym.experience.bank import ExperienceBank
>>> from crl_gym.experience.embedders import HashingEmbedder
>>> from crl_gym.experience.manager import ExperienceManager
>>> client = LocalClient(ExperienceManager(ExperienceBank(None, dim=16), HashingEmbedder(16)))
>>> first = RunSteps(client)
>>> [first.end_step(t).step for t in range(3)]
[0, 1, 2]
>>> second = RunSteps(client)  # a new run: its step 0 is the service's step 3
>>> second.service_step(0), second.end_step(0).step, second.service_step(-1)
(3, 3, -1)
>>> client.service.close()
"""

from __future__ import annotations

import threading

from crl_gym.clients.interface import ExperienceClient
from crl_gym.experience.results import StepEnded


class RunSteps:
    """Run step ``t`` <-> the service's step ``base + t`` (see the module docstring).

    Args:
        client: the run's client of the service.
        base: the service step of run step 0; None (default) reads it from the service at first use.
    """

    def __init__(self, client: ExperienceClient, base: int | None = None) -> None:
        if base is not None and (isinstance(base, bool) or not isinstance(base, int) or base < 0):
            raise ValueError(f"base must be an integer >= 0 or None, got {base!r}")
        self.client = client
        self._base = base
        self._lock = threading.Lock()

    @property
    def base(self) -> int:
        """The service step of this run's step 0 (read once from ``stats().last_ended_step``)."""
        if self._base is None:
            with self._lock:
                if self._base is None:
                    self._base = int(self.client.stats().last_ended_step) + 1
        return self._base

    def service_step(self, step: int) -> int:
        """The service's number of run step ``step`` (a negative one, held out, unchanged)."""
        return step if step < 0 else self.base + step

    def end_step(self, step: int, bonus: dict[str, float] | None = None) -> StepEnded:
        """``client.end_step`` of run step ``step`` (the answer's ``step`` is the
        service's number)."""
        return self.client.end_step(self.service_step(step), bonus)


__all__ = ["RunSteps"]
