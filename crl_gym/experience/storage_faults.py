"""Which storage failure a write met, named for the person reading the refusal.

The bank (SQLite) and the distillation queue (its spill file) fail with an ``OSError`` or an
``sqlite3`` error; :func:`as_fault` turns either into a :class:`~crl_gym.errors.StorageFault`
whose message starts with the cause (``disk full``, ``I/O error``, ``read-only file system``) and
whose status is what the HTTP face answers (507 Insufficient Storage when space ran out).

>>> import errno
>>> fault = as_fault(OSError(errno.ENOSPC, "No space left on device"), "queueing 2 requests")
>>> fault.status, str(fault)
(507, 'disk full: queueing 2 requests failed ([Errno 28] No space left on device)')
>>> import sqlite3
>>> as_fault(sqlite3.OperationalError("database or disk is full"), "writing the bank").cause
'disk full'
>>> as_fault(ValueError("not a storage error"), "x") is None
True
"""

from __future__ import annotations

import errno
import sqlite3

from crl_gym.errors import StorageFault

_OS_CAUSES = {
    errno.ENOSPC: ("disk full", 507),
    errno.EDQUOT: ("disk quota exceeded", 507),
    errno.EFBIG: ("file size limit reached", 507),
    errno.EROFS: ("read-only file system", 503),
    errno.EIO: ("I/O error", 503),
}
# SQLite's primary result codes (the low byte of ``sqlite_errorcode``)
_SQLITE_CAUSES = {
    13: ("disk full", 507),  # SQLITE_FULL (also a file over RLIMIT_FSIZE)
    10: ("I/O error", 503),  # SQLITE_IOERR (a failed write or fsync)
    8: ("read-only file system", 503),  # SQLITE_READONLY
    14: ("cannot open a bank file", 503),  # SQLITE_CANTOPEN
}
_SQLITE_MESSAGES = (
    ("disk is full", ("disk full", 507)),
    ("disk i/o error", ("I/O error", 503)),
    ("readonly database", ("read-only file system", 503)),
)


def cause_of(exc: BaseException) -> tuple[str, int] | None:
    """``(cause, HTTP status)`` of a storage error, ``None`` for anything else."""
    if isinstance(exc, StorageFault):
        return exc.cause, exc.status
    if isinstance(exc, OSError):
        return _OS_CAUSES.get(
            exc.errno or 0, (f"storage error ({exc.strerror or type(exc).__name__})", 503)
        )
    if isinstance(exc, sqlite3.OperationalError | sqlite3.DatabaseError):
        code = getattr(exc, "sqlite_errorcode", None)
        if code is not None and (code & 0xFF) in _SQLITE_CAUSES:
            return _SQLITE_CAUSES[code & 0xFF]
        text = str(exc).lower()
        for needle, found in _SQLITE_MESSAGES:
            if needle in text:
                return found
    return None


def as_fault(exc: BaseException, doing: str) -> StorageFault | None:
    """A :class:`StorageFault` saying that ``doing`` failed and why, or ``None`` when ``exc`` is
    not a storage error (a bug, bad input: let it raise as it is)."""
    if isinstance(exc, StorageFault):
        return exc
    found = cause_of(exc)
    if found is None:
        return None
    cause, status = found
    return StorageFault(f"{cause}: {doing} failed ({exc})", cause=cause, status=status)
