"""Waiting for a running experience service's background work, read from its ``stats()``.

Light on imports on purpose: ``tests/test_ray_service.py`` must import Ray before anything loads a
bank index.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from crl_gym.experience.results import ServiceStats


class HasStats(Protocol):
    def stats(self) -> ServiceStats: ...


def settle(source: HasStats, done: Callable[[ServiceStats], bool], what: str, timeout: float,
           poll: float = 0.2) -> ServiceStats:
    """Poll ``source.stats()`` every ``poll`` seconds until ``done(stats)``; those stats, or an
    ``AssertionError`` naming ``what`` with the last stats after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        stats = source.stats()
        if done(stats):
            return stats
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what}: {stats}")
        time.sleep(poll)
