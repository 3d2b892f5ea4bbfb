"""A bank directory's files and who may open them: the one-writer lock and the embedder the bank was
built with.

``DIR/bank.lock`` is held with ``flock(LOCK_EX)`` by the one open
:class:`~crl_gym.experience.bank.ExperienceBank` of a directory (:func:`lock_directory`); the
database records the embedder its vectors come from, and :func:`check_embedder` refuses another one,
naming both.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from pathlib import Path
from typing import IO

from crl_gym.experience.store import BankCorruptError, SQLiteStore

log = logging.getLogger(__name__)

DB_FILE = "bank.sqlite"
LOCK_FILE = "bank.lock"
"""Held with ``flock(LOCK_EX)`` by the one open bank of a directory; holds that process's PID."""


class BankLockedError(RuntimeError):
    """The bank directory is already open (in this process or another): one writer per bank."""


class BankEmbedderError(ValueError):
    """The bank was built with another embedder (name or dimension) than the one it is
    opened with."""


def same_embedder(a: str, b: str) -> bool:
    """Whether two embedder names denote one model: equal, or equal after the last ``/`` (a hub id
    ``org/name`` and a local copy of it in a directory ``name``).

    >>> (same_embedder("sentence-transformers/all-MiniLM-L6-v2", "all-MiniLM-L6-v2"),
    ...  same_embedder("hashing:64", "hashing:32"))
    (True, False)
    """
    return a == b or a.rstrip("/").rsplit("/", 1)[-1] == b.rstrip("/").rsplit("/", 1)[-1]


def lock_directory(path: Path) -> IO[str]:
    """Take the directory's exclusive lock without waiting; the open lock file holds it."""
    f = open(path / LOCK_FILE, "a+", encoding="ascii")  # noqa: SIM115 - held until close()
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        try:
            f.seek(0)
            holder = f.read().strip() or "?"
        finally:
            f.close()
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise
        raise BankLockedError(
            f"bank {path} is locked by PID {holder}; only one ExperienceBank may have a bank "
            "directory open at a time: close the other one (bank.close(), or stop that process), "
            "or open a copy of the directory"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")  # who holds it, for the next opener's message
    f.flush()
    return f


def unlock_directory(f: IO[str]) -> None:
    """Release the lock explicitly, so a forked child that inherited the file does not keep it."""
    try:
        f.seek(0)
        f.truncate()
        f.flush()
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
    finally:
        f.close()


def check_embedder(store: SQLiteStore, dim: int, embedder_name: str | None) -> str | None:
    """Record the embedder in a new bank's ``store``; refuse another one than an existing bank's,
    naming both. Returns the bank's embedder name (the stored one when the caller names none)."""
    stored_dim, stored_name = store.get_meta("dim"), store.get_meta("embedder")
    meta: dict[str, object] = {}
    if stored_dim is None:
        meta.update({"dim": dim, "next_id": 1, "generation": 0})
    else:
        try:
            built_dim = int(stored_dim)
        except ValueError:
            raise BankCorruptError(
                f"{store.file}: meta.dim is {stored_dim!r}, not a dimension"
            ) from None
        name_mismatch = (
            stored_name is not None
            and embedder_name is not None
            and not same_embedder(stored_name, embedder_name)
        )
        if built_dim != dim or name_mismatch:
            built = f"embedding dim {built_dim}" + (
                f" (embedder {stored_name!r})" if stored_name else ""
            )
            asked = f"dim {dim}" + (f" (embedder {embedder_name!r})" if embedder_name else "")
            raise BankEmbedderError(
                f"{store.file}: bank was created with {built}, but {asked} was requested; vectors "
                "of different embedders are not comparable: open it with the embedder it was "
                "built with, or export it (export_jsonl) and re-embed the texts into a new bank"
            )
    if embedder_name is not None and stored_name is None:
        if stored_dim is not None and store.get_meta("next_id") not in (None, "1"):
            log.warning(
                "%s: the bank does not say which embedder built it; recording %r (dim %d)",
                store.file,
                embedder_name,
                dim,
            )
        meta["embedder"] = embedder_name
    if meta:
        store.commit([], [], meta)
    return stored_name if embedder_name is None else embedder_name
