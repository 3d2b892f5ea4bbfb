"""Spill files: distillation requests kept on disk, one JSON line each, for whoever owns the file.

Three owners keep requests they cannot hand on yet: the distillation queue beyond its memory
(:mod:`crl_gym.experience.distill_queue`), a :class:`~crl_gym.clients.RemoteClient`'s sender for
what the server would not take (:mod:`crl_gym.outbox`), and the
:class:`~crl_gym.wrappers.experience.ExperienceWrapper` for what its client refused during an
outage. Each owns one file; this module owns how such a file is written and read:

* :func:`append` adds lines in one locked, fsynced write, so lines of concurrent writers never
  mix and a line that was reported written survives a power loss;
* :class:`SpillOffset` records how much of a file its reader has consumed, tagged with the
  file's inode: a rewrite (:func:`rewrite`: temp file, then ``os.replace``) gives the file a new
  inode, so an offset left by a crash between the swap and its own update names the old file and
  is ignored (the new file is read from its start);
* :func:`read` reads lines from an offset; lines that do not parse go to :func:`rejected_path`
  (:func:`set_aside`), and a line a crash left without its newline is closed first
  (:func:`terminate_partial_line`) so that it is rejected on its own.

>>> import json, tempfile
>>> tmp = tempfile.TemporaryDirectory()
>>> path = Path(tmp.name) / "pending.jsonl"
>>> append(path, ['{"a": 1}', "{broken", '{"a": 2}'])
>>> got, end, bad = read(path, 0, 10, json.loads)
>>> [v for v, _ in got], [line for _, line, _ in bad], rejected_path(path).name
([{'a': 1}, {'a': 2}], [b'{broken\\n'], 'pending.rejected.jsonl')
>>> tmp.cleanup()
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

PARSE_ERRORS = (ValueError, KeyError, TypeError)
"""What a parser of one spill line may raise for a line that is not a request."""


def append(path: Path, lines: Iterable[str]) -> None:
    """Append ``lines`` (newlines added) to ``path`` in one locked write, fsynced; creates the
    file and its directory. Other processes may append to the same file at the same time."""
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    if not data:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX)
        except ImportError:  # not POSIX: O_APPEND alone
            pass
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def rejected_path(path: Path) -> Path:
    """Where unparseable lines of ``path`` go: ``pending.jsonl`` → ``pending.rejected.jsonl``."""
    stem = path.name[: -len(".jsonl")] if path.name.endswith(".jsonl") else path.name
    return path.with_name(stem + ".rejected.jsonl")


def set_aside(path: Path, lines: list[bytes]) -> None:
    """Append unreadable ``lines`` of ``path`` to its :func:`rejected_path`."""
    if lines:
        with open(rejected_path(path), "ab") as f:
            f.writelines(lines)


def terminate_partial_line(path: Path) -> None:
    """Close a last line that a crash left without its newline, so it is read (and rejected) on
    its own instead of being glued to the next line."""
    if path.exists() and path.stat().st_size > 0:
        with open(path, "rb+") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")


def rewrite(path: Path, chunks: Iterable[bytes], *, fsync: bool) -> None:
    """Atomically make ``path`` the concatenation of ``chunks`` (temp file, then ``os.replace``):
    the file gets a new inode, which voids any offset recorded for the old one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def read(
    path: Path, pos: int, n: int, parse: Callable[[str], T]
) -> tuple[list[tuple[T, int]], int, list[tuple[int, bytes, Exception]]]:
    """Up to ``n`` parsed lines of ``path`` from byte ``pos``.

    Returns ``([(value, end of its line)], the position read to, [(at, line, error)] of the lines
    that did not parse)``. Blank lines are skipped; a last line without its newline is being
    written and is left for the next read.
    """
    got: list[tuple[T, int]] = []
    bad: list[tuple[int, bytes, Exception]] = []
    with open(path, "rb") as f:
        f.seek(pos)
        while len(got) < n:
            line = f.readline()
            if not line or not line.endswith(b"\n"):
                break
            at, pos = pos, f.tell()
            if not line.strip():
                continue
            try:
                got.append((parse(line.decode("utf-8")), pos))
            except PARSE_ERRORS as exc:  # UnicodeDecodeError is a ValueError
                bad.append((at, line, exc))
    return got, pos, bad


def count_lines(path: Path, pos: int) -> int:
    """Non-blank lines of ``path`` after byte ``pos``."""
    with open(path, "rb") as f:
        f.seek(pos)
        return sum(1 for line in f if line.strip())


class SpillOffset:
    """The consumed prefix of one spill file, in ``<name>.offset`` as ``<inode> <byte offset>``
    (itself swapped in atomically, so a crash leaves the old value or the new one)."""

    def __init__(self, spill_path: Path) -> None:
        self.spill_path = spill_path
        self.path = spill_path.with_name(spill_path.name + ".offset")

    def load(self) -> int:
        """The position recorded for this very file (same inode), else 0; creates an empty spill
        file when there is none, and records the position it returns."""
        if not self.spill_path.exists():
            self.spill_path.touch()
        st = self.spill_path.stat()
        try:
            fields = self.path.read_text().split()
            if len(fields) == 1:  # written by an older version: no inode, trusted as it was then
                pos = int(fields[0])
            else:
                inode, pos = int(fields[0]), int(fields[1])
                if inode != st.st_ino:  # left by a crash right after a rewrite: names the old file
                    pos = 0
        except (OSError, ValueError, IndexError):
            pos = 0
        pos = pos if 0 <= pos <= st.st_size else 0
        self.store(pos)
        return pos

    def store(self, pos: int) -> None:
        """Record ``pos`` for the spill file as it is now (its current inode)."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(f"{os.stat(self.spill_path).st_ino} {int(pos)}")
        os.replace(tmp, self.path)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
