"""``KeepingClient``: the outbox of a client whose ``submit`` can fail (a ``LocalClient`` of a
service that is down, a Ray actor client): a request it could not take is kept, never lost.

What is kept goes to ``spill_path`` (JSONL, one ``to_dict()`` per line: a durable file a later run
imports) when one is set, else into memory (at most ``max_unsent``; older ones then survive only in
the episode's ``info``). Requests kept in memory are retried, oldest first, before the next
submit and by :meth:`KeepingClient.retry_unsent`. A request the client rejects as malformed
(:data:`MALFORMED_ERRORS`) is dropped and counted, never retried: a retry would fail the same way
and hold up every request behind it. (A ``RemoteClient`` has its own outbox, which retries and
spills in a sender thread: its ``submit`` only buffers.)

This is the one place of ``crl_gym`` outside the ``RemoteClient`` that retries, buffers or spills
a request; ``ExperienceWrapper`` hands its requests here and reads what happened.

>>> class Down:
...     def submit(self, request): raise ConnectionError("service down")
>>> from crl_gym.protocol import DistillationRequest, Trajectory
>>> keeping = KeepingClient(Down())
>>> offered = keeping.offer(DistillationRequest("t", Trajectory(), 0.0, False, None))
>>> offered.kept, offered.outages, len(keeping.unsent)
(True, ('submit failed: ConnectionError: service down',), 1)
"""

from __future__ import annotations

import json
import logging
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from crl_gym import spill
from crl_gym.errors import ProcessBoundaryError
from crl_gym.protocol import DistillationRequest

logger = logging.getLogger(__name__)

MALFORMED_ERRORS: tuple[type[BaseException], ...] = (TypeError, ValueError, RecursionError)
"""What a client raises for a request it cannot take as it is (it fails to serialise, the server
answers 4xx): logged, counted and dropped, because a retry would fail the same way and hold up
every request queued behind it. Anything else (``ExperienceUnavailable``, a transport error) is an
outage: the request is kept and retried. So is a ``PermissionError`` (``ExperienceAuthError``,
also a ``ValueError``): a wrong token is the client's fault, not the request's, and the request
must survive until it is fixed."""

DEFAULT_MAX_UNSENT = 10_000


class Submitter(Protocol):
    """What a :class:`KeepingClient` needs of the client it keeps for."""

    def submit(self, request: DistillationRequest) -> None: ...


C = TypeVar("C", bound=Submitter)


def reraise_misuse(exc: BaseException) -> None:
    """Raise ``exc`` when it is a :class:`ProcessBoundaryError` (a ``LocalClient`` in a worker
    process): running on free would hide a setup that never reaches the service."""
    if isinstance(exc, ProcessBoundaryError):
        raise exc


def malformed(exc: BaseException) -> bool:
    """Whether ``exc`` from ``client.submit`` rejects the request itself (:data:`MALFORMED_ERRORS`).
    A client used across a process boundary is neither: it is raised (:func:`reraise_misuse`)."""
    reraise_misuse(exc)
    return isinstance(exc, MALFORMED_ERRORS) and not isinstance(exc, PermissionError)


@dataclass(frozen=True)
class Offered:
    """What became of the requests one call handled: ``sent`` (the offered one reached the
    client), ``kept`` (it is kept for a retry), and each failure met on the way, older kept
    requests' included: ``outages`` (kept, retried later) and ``rejections`` (dropped)."""

    sent: bool = False
    kept: bool = False
    outages: tuple[str, ...] = ()
    rejections: tuple[str, ...] = ()
    still_unsent: int = 0


class KeepingClient(Generic[C]):
    """Submits through ``client`` and keeps what it could not take (module docstring).

    Give one to :class:`~crl_gym.wrappers.ExperienceWrapper` as its client to choose where the
    wrapper's undelivered requests go (``ExperienceWrapper(env, KeepingClient(client,
    spill_path=...))``); the wrapper searches through ``client`` and submits through this.

    Args:
        client: anything with ``submit(request)`` (an :class:`~crl_gym.clients.ExperienceClient`).
        spill_path: JSONL file where kept requests are appended; None keeps them in memory.
        max_unsent: most requests kept in memory.
    """

    def __init__(
        self,
        client: C,
        *,
        spill_path: str | Path | None = None,
        max_unsent: int = DEFAULT_MAX_UNSENT,
    ) -> None:
        if max_unsent < 1:
            raise ValueError(f"max_unsent must be >= 1, got {max_unsent}")
        self.client = client
        self.spill_path = Path(spill_path) if spill_path is not None else None
        self.max_unsent = max_unsent
        self.unsent: deque[DistillationRequest] = deque()
        self.submitted = 0
        """Requests the client took (kept ones included once they went)."""

    def submit(self, request: DistillationRequest) -> None:
        """:meth:`offer`, for a caller that only needs the client's face."""
        self.offer(request)

    def offer(self, request: DistillationRequest) -> Offered:
        """Submit ``request`` after any older unsent ones, in order; keep it when the client is
        down."""
        outages: list[str] = []
        rejections: list[str] = []
        if self.unsent and self._retry(outages, rejections) > 0:
            kept = self._keep(request, rejections)  # still down: do not try again right away
            return Offered(
                kept=kept,
                outages=tuple(outages),
                rejections=tuple(rejections),
                still_unsent=len(self.unsent),
            )
        try:
            self.client.submit(request)
        except Exception as exc:  # noqa: BLE001 - keep the request, never lose the episode
            if malformed(exc):
                rejections.append(
                    f"submit of request {request.request_id} was rejected "
                    f"({type(exc).__name__}: {exc})"
                )
                return Offered(
                    outages=tuple(outages),
                    rejections=tuple(rejections),
                    still_unsent=len(self.unsent),
                )
            outages.append(f"submit failed: {type(exc).__name__}: {exc}")
            kept = self._keep(request, rejections)
            return Offered(
                kept=kept,
                outages=tuple(outages),
                rejections=tuple(rejections),
                still_unsent=len(self.unsent),
            )
        self.submitted += 1
        return Offered(sent=True, outages=tuple(outages), rejections=tuple(rejections))

    def retry(self) -> Offered:
        """Submit the requests kept in memory, oldest first (a malformed one is dropped and the
        next one tried: it must not hold up the requests queued behind it)."""
        outages: list[str] = []
        rejections: list[str] = []
        still = self._retry(outages, rejections)
        return Offered(outages=tuple(outages), rejections=tuple(rejections), still_unsent=still)

    def retry_unsent(self) -> int:
        """:meth:`retry`, logged; returns how many requests are still unsent."""
        done = self.retry()
        for message in (*done.outages, *done.rejections):
            logger.warning("experience: %s", message)
        return done.still_unsent

    # ------------------------------------------------------------------ internals
    def _retry(self, outages: list[str], rejections: list[str]) -> int:
        while self.unsent:
            request = self.unsent[0]
            try:
                self.client.submit(request)
            except Exception as exc:  # noqa: BLE001
                if not malformed(exc):
                    outages.append(f"submit failed: {type(exc).__name__}: {exc}")
                    break
                self.unsent.popleft()
                rejections.append(
                    f"submit of kept request {request.request_id} was rejected "
                    f"({type(exc).__name__}: {exc})"
                )
                continue
            self.unsent.popleft()
            self.submitted += 1
        return len(self.unsent)

    def _keep(self, request: DistillationRequest, rejections: list[str]) -> bool:
        """Keep ``request`` (spill file, else memory); False when it cannot even be spilled."""
        if self.spill_path is not None:
            try:
                line = json.dumps(request.to_dict(), ensure_ascii=False)
            except MALFORMED_ERRORS as exc:
                rejections.append(
                    f"request {request.request_id} cannot be spilled ({type(exc).__name__}: {exc})"
                )
                return False
            try:
                spill.append(self.spill_path, [line])
                return True
            except OSError as exc:
                logger.error(
                    "experience: cannot spill request %s to %s (%s); keeping it in memory",
                    request.request_id,
                    self.spill_path,
                    exc,
                )
        self.unsent.append(request)
        if len(self.unsent) > self.max_unsent:
            dropped = self.unsent.popleft()
            logger.error(
                "experience: more than %d unsent requests; request %s survives only in "
                "info['distillation_request']",
                self.max_unsent,
                dropped.request_id,
            )
        return True


__all__ = [
    "DEFAULT_MAX_UNSENT",
    "MALFORMED_ERRORS",
    "KeepingClient",
    "Offered",
    "malformed",
    "reraise_misuse",
]
