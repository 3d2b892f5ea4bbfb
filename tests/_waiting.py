"""Waiting for a running experience service's background work, read from its ``stats()``.

Light on imports on purpose: ``tests/test_ray_service.py`` must import Ray before anything loads a
bank index.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from crl_gym.experience.results import ServiceStats


class HasStats(Protocol):
    def stats(self) -> ServiceStats: ...


def settle(source: HasStats, done: Callable[[dict[str, Any]], bool], what: str, timeout: float) -> dict[str, Any]:
    """Poll ``source.stats()`` (its flat JSON form) until ``done(stats)``; those stats, or an
    ``AssertionError`` naming ``what`` with the last stats after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = source.stats().to_dict()
        if done(stats):
            return stats
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}: {source.stats()}")
