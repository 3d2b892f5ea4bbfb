"""FIFO queue of distillation requests that never blocks the submitter and never drops one.

Requests live in memory up to ``maxsize``; beyond that they are appended to a JSONL spill file
(one ``DistillationRequest.to_json()`` per line) and read back, in order, once the memory part
has drained. Once anything is spilled, later requests go to the file too, so FIFO order holds.
``close()`` writes what is still in memory to the front of the spill file, so a restart picks up
every request; the file's consumed prefix is tracked by a small offset file (at-least-once: a
crash between reading and recording the offset may deliver a request twice, never zero times).

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
        self._offset_path = self.spill_path.with_name(self.spill_path.name + ".offset")
        self._mem: deque[DistillationRequest] = deque()
        self._cond = threading.Condition()
        self.spilled_total = 0
        self.bad_lines = 0  # unreadable spill lines (logged, counted, skipped)
        self._terminate_partial_line()
        self._read_pos = self._load_offset()
        self._spilled = self._count_spilled()
        self._writer = open(self.spill_path, "a", encoding="utf-8")  # noqa: SIM115

    def _terminate_partial_line(self) -> None:
        # A crash mid-write leaves a line without its newline; close it so it is read (and
        # counted as bad) on its own instead of being glued to the next request.
        if self.spill_path.exists() and self.spill_path.stat().st_size > 0:
            with open(self.spill_path, "rb+") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    f.write(b"\n")

    def _load_offset(self) -> int:
        try:
            pos = int(self._offset_path.read_text().strip() or 0)
        except (OSError, ValueError):
            return 0
        size = self.spill_path.stat().st_size if self.spill_path.exists() else 0
        return pos if 0 <= pos <= size else 0

    def _count_spilled(self) -> int:
        if not self.spill_path.exists():
            return 0
        with open(self.spill_path, "rb") as f:
            f.seek(self._read_pos)
            return sum(1 for line in f if line.strip())

    def put(self, request: DistillationRequest) -> None:
        """Enqueue; O(1) in memory, one buffered line write when spilling. Never blocks long."""
        with self._cond:
            if self._spilled == 0 and len(self._mem) < self.maxsize:
                self._mem.append(request)
            else:
                self._writer.write(request.to_json() + "\n")
                self._writer.flush()
                self._spilled += 1
                self.spilled_total += 1
            self._cond.notify()

    def _refill(self, n: int) -> None:
        """Move up to ``n`` spilled requests into memory (caller holds the condition)."""
        if self._spilled == 0 or n <= 0:
            return
        with open(self.spill_path, "rb") as f:
            f.seek(self._read_pos)
            while n > 0:
                line = f.readline()
                if not line:
                    break
                if not line.endswith(b"\n"):
                    break  # a partially written last line: leave it for the next read
                self._read_pos = f.tell()
                if not line.strip():
                    continue
                self._spilled -= 1
                try:
                    self._mem.append(DistillationRequest.from_json(line.decode("utf-8")))
                    n -= 1
                except (ValueError, KeyError, TypeError) as exc:
                    self.bad_lines += 1
                    log.error("%s: skipping unreadable request at byte %d: %s",
                              self.spill_path, self._read_pos, exc)
        if self._spilled <= 0:  # fully drained: start a fresh file
            self._spilled = 0
            self._writer.seek(0)
            self._writer.truncate()
            self._read_pos = 0
        self._offset_path.write_text(str(self._read_pos))

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
            return [self._mem.popleft() for _ in range(min(max_n, len(self._mem)))]

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
            if self._mem:
                tmp = self._write_memory_before_unread(fsync=True)
                self._writer.close()
                os.replace(tmp, self.spill_path)
                self._writer = open(self.spill_path, "a", encoding="utf-8")  # noqa: SIM115
                self._spilled += len(self._mem)
                self._mem.clear()
                self._read_pos = 0
                self._offset_path.write_text("0")
            else:
                os.fsync(self._writer.fileno())
            return self._spilled

    def _write_memory_before_unread(self, *, fsync: bool) -> Path:
        """Write the in-memory requests, then the unread rest of the spill, to a temp file.

        The caller holds ``_cond`` and swaps the temp file in with ``os.replace``."""
        rest = b""
        if self.spill_path.exists():
            with open(self.spill_path, "rb") as f:
                f.seek(self._read_pos)
                rest = f.read()
        tmp = self.spill_path.with_name(self.spill_path.name + ".tmp")
        with open(tmp, "wb") as f:
            for r in self._mem:
                f.write((r.to_json() + "\n").encode("utf-8"))
            f.write(rest)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        return tmp

    def close(self) -> None:
        """Persist the in-memory part in front of the unread spill, then release the file."""
        with self._cond:
            if self._writer.closed:
                return
            self._writer.close()
            if self._temp and not self._mem and self._spilled == 0:
                self.spill_path.unlink(missing_ok=True)
                self._offset_path.unlink(missing_ok=True)
                return
            tmp = self._write_memory_before_unread(fsync=False)
            os.replace(tmp, self.spill_path)
            self._offset_path.unlink(missing_ok=True)
            self._mem.clear()
