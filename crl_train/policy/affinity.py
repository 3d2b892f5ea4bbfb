"""Each track on its own cores: the CPU split and pinning (``os.sched_setaffinity``).

The paper gives the actor and the extractor their own GPUs; on a CPU machine the equivalent is
their own cores. :func:`split_cpus` decides the split (a pure function): the trainer process — the
actor's primary loop, plus the background track's light bank work — gets ``actor``, the
extractor worker process gets ``extractor``. By default the cores this process may use are split
in half (the actor gets the larger half when the count is odd: it is the critical path); with a
single core, or ``pin=False``, nothing is pinned. A grpo run (no extractor) gets the actor's share.

>>> split_cpus((0, 1))
CpuSplit(actor=(0,), extractor=(1,), available=(0, 1))
>>> split_cpus((0, 1, 2, 3, 4), extractor_cpus=(4,))
CpuSplit(actor=(0, 1, 2, 3), extractor=(4,), available=(0, 1, 2, 3, 4))
>>> split_cpus((0,)).describe()
'no pinning (1 core available: (0,))'
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuSplit:
    """Cores of each track (None = not pinned)."""

    actor: tuple[int, ...] | None
    """Cores of the trainer process (primary loop; also grpo's and an in-process extractor's)."""
    extractor: tuple[int, ...] | None
    """Cores of the extractor worker process."""
    available: tuple[int, ...]
    """The cores this process could use when the split was made."""

    def describe(self) -> str:
        if self.actor is None and self.extractor is None:
            why = (
                f"{len(self.available)} core available"
                if len(self.available) < 2
                else "pinning off"
            )
            return f"no pinning ({why}: {self.available})"
        return (
            f"actor (trainer process) cores {self.actor}, extractor (worker process) cores "
            f"{self.extractor}"
        )


def available_cpus() -> tuple[int, ...]:
    """The cores this process may run on (all of ``os.cpu_count()`` where affinity
    is unsupported)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def split_cpus(
    available: Sequence[int],
    actor_cpus: Sequence[int] | None = None,
    extractor_cpus: Sequence[int] | None = None,
    *,
    pin: bool = True,
) -> CpuSplit:
    """The actor's and the extractor's cores.

    * ``pin=False`` → nothing pinned;
    * both given → used as they are (they must be available and disjoint);
    * one given → the other gets the rest of ``available`` (an error if nothing is left);
    * neither → ``available`` split in half, the actor taking ``ceil(n/2)`` (n ≥ 2), nothing pinned
      for n = 1.

    Raises:
        ValueError: a named core is not available, the two overlap, or one leaves nothing for the
            other (the message names ``experience.actor_cpus`` / ``experience.extractor_cpus``).
    """
    avail = tuple(sorted(set(available)))
    if not pin:
        return CpuSplit(None, None, avail)
    given = {"actor_cpus": actor_cpus, "extractor_cpus": extractor_cpus}
    for name, cpus in given.items():
        if cpus is not None:
            if not cpus:
                raise ValueError(
                    f"experience.{name} is empty (give core numbers, or leave it unset for the "
                    "default split)"
                )
            missing = sorted(set(cpus) - set(avail))
            if missing:
                raise ValueError(
                    f"experience.{name}: cores {missing} are not available to this process "
                    f"(available: {avail})"
                )
    if actor_cpus is not None and extractor_cpus is not None:
        both = sorted(set(actor_cpus) & set(extractor_cpus))
        if both:
            raise ValueError(
                f"experience.actor_cpus and experience.extractor_cpus share cores {both}: each "
                "track needs its own"
            )
        return CpuSplit(tuple(sorted(set(actor_cpus))), tuple(sorted(set(extractor_cpus))), avail)
    if actor_cpus is not None or extractor_cpus is not None:
        name, mine = (
            ("actor_cpus", actor_cpus)
            if actor_cpus is not None
            else ("extractor_cpus", extractor_cpus)
        )
        assert mine is not None
        rest = tuple(c for c in avail if c not in set(mine))
        if not rest:
            raise ValueError(
                f"experience.{name}={tuple(mine)} leaves no core for the other track "
                f"(available: {avail})"
            )
        own = tuple(sorted(set(mine)))
        return CpuSplit(own, rest, avail) if name == "actor_cpus" else CpuSplit(rest, own, avail)
    if len(avail) < 2:
        return CpuSplit(None, None, avail)
    half = (len(avail) + 1) // 2  # the actor is the critical path: it gets the larger half
    return CpuSplit(avail[:half], avail[half:], avail)


def pin_process(cpus: Sequence[int] | None) -> tuple[int, ...] | None:
    """Pin every thread of this process to ``cpus``; returns the calling thread's previous cores.

    Threads started later inherit the calling thread's cores. None / unsupported → nothing done,
    None returned. A thread that ends while this runs is skipped.
    """
    if cpus is None or not hasattr(os, "sched_setaffinity"):
        return None
    before = tuple(sorted(os.sched_getaffinity(0)))
    mask = set(cpus)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: the calling thread only
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, mask)
        except (ProcessLookupError, PermissionError):  # ended meanwhile / not ours to move
            pass
    os.sched_setaffinity(0, mask)  # the caller at least, whatever happened above
    return before
