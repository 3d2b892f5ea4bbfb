"""Client attributes of earlier releases, kept working with a ``DeprecationWarning``.

``RemoteClient`` counted its submits in six properties (``buffered``, ``delivered``, ``rejected``,
``submit_failures``, ``spilled``, ``lost``); they are now read together, at one instant, from
``RemoteClient.submit_counts`` (:class:`~crl_gym.outbox.SubmitCounts`). Each old name still
answers, warning once per call site which field replaces it.
"""

from __future__ import annotations

import warnings
from typing import Protocol

from crl_gym.outbox import SubmitCounts

SUBMIT_COUNT_FIELDS = {
    "buffered": "buffered",
    "delivered": "delivered",
    "rejected": "rejected",
    "submit_failures": "failures",
    "spilled": "spilled",
    "lost": "lost",
}
"""Old ``RemoteClient`` property -> its field of ``submit_counts``."""


class CountsSubmits(Protocol):
    """A client that reports what became of its submits (``RemoteClient``)."""

    @property
    def submit_counts(self) -> SubmitCounts: ...


def submit_count_property(old: str) -> property:
    """A read-only property ``old`` that warns and reads ``self.submit_counts.<field>``."""
    new = SUBMIT_COUNT_FIELDS[old]

    def read(self: CountsSubmits) -> int:
        warnings.warn(
            f"RemoteClient.{old} is deprecated: read RemoteClient.submit_counts.{new} "
            "(all the counts at one instant)",
            DeprecationWarning,
            stacklevel=2,
        )
        return int(getattr(self.submit_counts, new))

    return property(read, doc=f"Deprecated: ``submit_counts.{new}``.")


__all__ = ["SUBMIT_COUNT_FIELDS", "CountsSubmits", "submit_count_property"]
