"""Errors of the experience clients (:mod:`crl_gym.clients`, re-exported there)."""

from __future__ import annotations

from pathlib import Path


class ExperienceUnavailable(RuntimeError):
    """The experience service could not be reached or failed; callers run without it."""


class ExperienceAuthError(PermissionError, ValueError):
    """The server refused the call (401): no token was sent, or not the server's token.

    A :class:`ValueError` too (like every 4xx), so callers that catch bad input also catch it,
    and not an :class:`ExperienceUnavailable`: running on without the bank would hide the mistake.
    """


class SubmitUndelivered(ExperienceUnavailable):
    """Requests :meth:`RemoteClient.submit` had accepted did not reach the server after the
    retries; they are appended to :attr:`spill_path` (JSONL, one ``to_dict()`` per line), not lost.

    Raised once, by the next :meth:`RemoteClient.flush` (or ``end_step``), so that a step is not
    closed on the server without them unnoticed.
    """

    def __init__(self, message: str, *, spill_path: Path, count: int) -> None:
        super().__init__(message)
        self.spill_path = spill_path
        self.count = count


class ProcessBoundaryError(RuntimeError):
    """An in-process client (:class:`~crl_gym.clients.LocalClient`) was used from another process
    than the one that made it (a forked or spawned worker, e.g. of ``AsyncVectorEnv``): its service
    lives in the parent, so nothing would reach it. The wrappers raise it instead of
    running free."""


class RequestTooLarge(ValueError):
    """A distillation request larger than the server's body limit: refused at ``submit``
    (it can never be delivered as it is; a ``ValueError``, so the wrappers count it as rejected)."""


class StorageFault(ExperienceUnavailable):
    """A write the service could not make durable (a full disk, an I/O error, a read-only file
    system): refused, and applied nowhere, memory included. The message names the cause
    (``"disk full: …"``); :attr:`status` is the HTTP status it is answered with (507 when space
    ran out, 503 otherwise). An outage: the caller keeps the write and sends it again later,
    with the same id (:mod:`crl_gym.experience.write_ids`), so it lands once.
    """

    def __init__(self, message: str, *, cause: str = "storage error", status: int = 503) -> None:
        super().__init__(message)
        self.cause = cause
        self.status = status
