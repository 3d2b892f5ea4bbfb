"""FIFO queue of distillation requests that never blocks the submitter and never drops one.

Requests live in memory up to ``maxsize``; beyond that they are appended to a JSONL spill file
(one ``DistillationRequest.to_json()`` per line) and read back, in order, once the memory part
has drained. Once anything is spilled, later requests go to the file too, so FIFO order holds.
``close()`` (and ``persist()``, a checkpoint) writes what is still in memory to the front of the
spill file, so a restart picks up every request. The file's consumed prefix is recorded in a
small ``<name>.offset`` file (``<inode> <byte offset>``, itself swapped in atomically), written
when a request read from the file is handed out: read-ahead ones still in memory stay behind the
offset, so a crash cannot lose them. A rewrite (temp file, then ``os.replace``) gives the spill a
new inode, so an offset left by a crash between the swap and its own update names the old file
and is ignored (the new file is read from its start): the two cannot disagree, and a crash at
any point neither skips a request nor hands out a consumed one again (at-least-once only between
handing a request out and recording it: it may then be delivered twice, never zero times). Lines that do not parse are moved to
``<name>.rejected.jsonl`` next to the spill file, counted and logged.

>>> from crl_gym.protocol import DistillationRequest, Trajectory
>>> q = DistillQueue(maxsize=1, spill_path=None)
>>> for t in ("a", "b", "c"):
...     q.put(DistillationRequest(t, Trajectory(), 0.0, False, None))
>>> [r.task for r in q.get(10)], q.spilled_total
(['a', 'b', 'c'], 2)
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

from crl_gym.protocol import DistillationRequest

log = logging.getLogger(__name__)


def rejected_path(spill_path: Path) -> Path:
    """Where unparseable spill lines go: ``pending.jsonl`` → ``pending.rejected.jsonl``."""
    stem = spill_path.name[: -len(".jsonl")] if spill_path.name.endswith(".jsonl") else spill_path.name
    return spill_path.with_name(stem + ".rejected.jsonl")


class DistillQueue:
    """Memory-bounded FIFO with an on-disk overflow (``spill_path=None``: a temp file)."""

    def __init__(self, maxsize: int, spill_path: str | Path | None) -> None:
        self.maxsize = int(maxsize)
        if spill_path is None:
            fd, name = tempfile.mkstemp(prefix="crl_pending_", suffix=".jsonl")
            os.close(fd)
            spill_path, self._temp = Path(name), True
        else:
            self._temp = False
        self.spill_path = Path(spill_path)
        self.rejected_path = rejected_path(self.spill_path)
        self._offset_path = self.spill_path.with_name(self.spill_path.name + ".offset")
        self._mem: deque[DistillationRequest] = deque()
        self._pos: deque[int | None] = deque()  # per memory item: end of its spill line, None if never spilled
        self._unacked = 0  # memory items read from the spill and not handed out yet
        self._cond = threading.Condition()
        self.spilled_total = 0
        self.bad_lines = 0  # unreadable spill lines (moved to ``rejected_path``, logged, counted)
        self.changes = 0
        """Puts since the queue was opened: a checkpointing timer persists only when it moved."""
        self._terminate_partial_line()
        self._read_pos = self._open_offset()
        self._spilled = self._count_spilled()
        self._writer = open(self.spill_path, "a", encoding="utf-8")  # noqa: SIM115

    def _terminate_partial_line(self) -> None:
        # A crash mid-write leaves a line without its newline; close it so it is read (and
        # rejected) on its own instead of being glued to the next request.
        if self.spill_path.exists() and self.spill_path.stat().st_size > 0:
            with open(self.spill_path, "rb+") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")

    def _open_offset(self) -> int:
        """The read position recorded for this very file (same inode), else its start."""
        if not self.spill_path.exists():
            self.spill_path.touch()
        st = self.spill_path.stat()
        try:
            fields = self._offset_path.read_text().split()
            if len(fields) == 1:  # written by an older version: no inode, trusted as it was then
                pos = int(fields[0])
            else:
                inode, pos = int(fields[0]), int(fields[1])
                if inode != st.st_ino:  # left by a crash right after a rewrite: names the old file
                    pos = 0
        except (OSError, ValueError, IndexError):
            pos = 0
        pos = pos if 0 <= pos <= st.st_size else 0
        self._write_offset(pos)
        return pos

    def _write_offset(self, pos: int) -> None:
        """Record ``pos`` for the current spill file (atomically: a crash leaves the old or the new)."""
        tmp = self._offset_path.with_name(self._offset_path.name + ".tmp")
        tmp.write_text(f"{os.stat(self.spill_path).st_ino} {int(pos)}")
        os.replace(tmp, self._offset_path)

    def _replace_with(self, rest: bytes, *, fsync: bool, first: list[DistillationRequest] | None = None) -> None:
        """Atomically make the spill file ``first + rest``, read from its start: the new inode
        voids the old offset even if a crash comes before the offset is rewritten."""
        tmp = self.spill_path.with_name(self.spill_path.name + ".tmp")
        with open(tmp, "wb") as f:
            for r in first or ():
                f.write((r.to_json() + "\n").encode("utf-8"))
            f.write(rest)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, self.spill_path)
        self._write_offset(0)

    def _count_spilled(self) -> int:
        with open(self.spill_path, "rb") as f:
            f.seek(self._read_pos)
            return sum(1 for line in f if line.strip())

    def put(self, request: DistillationRequest) -> None:
        """Enqueue; O(1) in memory, one buffered line write when spilling. Never blocks long."""
        with self._cond:
            if self._spilled == 0 and len(self._mem) < self.maxsize:
                self._mem.append(request)
                self._pos.append(None)
            else:
                self._writer.write(request.to_json() + "\n")
                self._writer.flush()
                self._spilled += 1
                self.spilled_total += 1
            self.changes += 1
            self._cond.notify()

    def _refill(self, n: int) -> None:
        """Move up to ``n`` spilled requests into memory (caller holds the condition)."""
        if self._spilled == 0 or n <= 0:
            return
        rejected: list[bytes] = []
        with open(self.spill_path, "rb") as f:
            f.seek(self._read_pos)
            while n > 0:
                line = f.readline()
                if not line:
                    break
                if not line.endswith(b"\n"):
                    break  # a partially written last line: leave it for the next read
                at, self._read_pos = self._read_pos, f.tell()
                if not line.strip():
                    continue
                self._spilled -= 1
                try:
                    self._mem.append(DistillationRequest.from_json(line.decode("utf-8")))
                    self._pos.append(self._read_pos)
                    self._unacked += 1
                    n -= 1
                except (ValueError, KeyError, TypeError) as exc:
                    self.bad_lines += 1
                    rejected.append(line)
                    log.error("%s: unreadable request at byte %d moved to %s: %s",
                              self.spill_path, at, self.rejected_path.name, exc)
        if rejected:  # before the offset moves past them: a crash may copy one twice, never lose it
            with open(self.rejected_path, "ab") as r:
                r.writelines(rejected)
        if self._spilled <= 0 and self._unacked == 0:
            self._reset_file()

    def _ack(self, pos: int) -> None:
        """Record that everything before ``pos`` in the spill was handed out."""
        try:
            self._write_offset(pos)
            if self._spilled <= 0 and self._unacked == 0:
                self._reset_file()  # after the offset: a crash before the swap delivers nothing twice
        except OSError:  # the requests are handed out all the same: a restart may deliver them twice
            log.exception("%s: recording the read position failed", self.spill_path)
            if self._writer.closed:
                self._writer = open(self.spill_path, "a", encoding="utf-8")  # noqa: SIM115

    def _reset_file(self) -> None:
        """Fully drained: start a fresh file (atomically: header and emptiness arrive together)."""
        self._spilled = 0
        self._writer.close()
        self._replace_with(b"", fsync=False)
        self._writer = open(self.spill_path, "a", encoding="utf-8")  # noqa: SIM115
        self._read_pos = 0

    def get(self, max_n: int, timeout: float = 0.0) -> list[DistillationRequest]:
        """Up to ``max_n`` oldest requests; waits up to ``timeout`` s for the first one."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            while not self._mem and self._spilled == 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._cond.wait(left)
            if len(self._mem) < max_n:
                self._refill(max(max_n - len(self._mem), self.maxsize - len(self._mem)))
            out, acked = [], None
            for _ in range(min(max_n, len(self._mem))):
                out.append(self._mem.popleft())
                pos = self._pos.popleft()
                if pos is not None:
                    acked = pos
                    self._unacked -= 1
            if acked is not None:
                self._ack(acked)
            return out

    def __len__(self) -> int:
        with self._cond:
            return len(self._mem) + self._spilled

    def persist(self) -> int:
        """Move the in-memory part to the front of the unread spill and fsync it (a checkpoint:
        a hard kill after this loses no request queued before it). Returns the requests on disk.
        The queue stays open; later ``get`` calls read them back in the same order."""
        with self._cond:
            if self._writer.closed:
                return 0
            self._writer.flush()
            if len(self._mem) > self._unacked:  # read-ahead ones are on disk already, behind the offset
                self._rewrite_memory_in_front(fsync=True)
                self._writer = open(self.spill_path, "a", encoding="utf-8")  # noqa: SIM115
            else:
                os.fsync(self._writer.fileno())
            return self._spilled + self._unacked

    def _rewrite_memory_in_front(self, *, fsync: bool) -> None:
        """Atomically replace the spill with the in-memory requests, then its unread rest (the
        caller holds ``_cond``; the writer is closed here and the memory part moves to disk)."""
        with open(self.spill_path, "rb") as f:
            f.seek(self._read_pos)
            rest = f.read()
        self._writer.close()
        self._replace_with(rest, fsync=fsync, first=list(self._mem))
        self._spilled += len(self._mem)  # read-ahead ones were counted out when read: back on disk now
        self._mem.clear()
        self._pos.clear()
        self._unacked = 0
        self._read_pos = 0

    def close(self) -> None:
        """Persist the in-memory part in front of the unread spill, then release the file."""
        with self._cond:
            if self._writer.closed:
                return
            self._writer.flush()
            if self._temp and not self._mem and self._spilled == 0:
                self._writer.close()
                self.spill_path.unlink(missing_ok=True)
                self._offset_path.unlink(missing_ok=True)
                return
            if len(self._mem) > self._unacked:
                self._rewrite_memory_in_front(fsync=True)
            else:
                os.fsync(self._writer.fileno())
                self._writer.close()
