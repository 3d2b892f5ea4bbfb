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
handing a request out and recording it: it may then be delivered twice, never zero times). Lines
that do not parse are moved to ``<name>.rejected.jsonl`` next to the spill file, counted and logged.
The file itself (appends, the offset, rewrites, reading back) is :mod:`crl_gym.spill`'s, as for
every spill file.

>>> from crl_gym.protocol import DistillationRequest, Trajectory
>>> q = DistillQueue(maxsize=1, spill_path=None)
>>> for t in ("a", "b", "c"):
...     q.put(DistillationRequest(t, Trajectory(), 0.0, False, None))
>>> [r.task for r in q.get(10)], q.spilled_total
(['a', 'b', 'c'], 2)
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
import weakref
from collections import deque
from pathlib import Path

from crl_gym import spill
from crl_gym.protocol import DistillationRequest
from crl_gym.spill import rejected_path

log = logging.getLogger(__name__)

__all__ = ["DistillQueue", "rejected_path"]


TEMP_PREFIX = "crl_pending_"
"""Temp spills are ``<temp dir>/crl_pending_<pid>_<random>.jsonl``: the pid names their owner."""


def _remove_temp(path: Path) -> None:
    """Remove a temp spill file and its offset (the queue was garbage-collected or closed)."""
    for p in (path, path.with_name(path.name + ".offset"), rejected_path(path)):
        p.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def sweep_temp_spills(directory: Path) -> int:
    """Remove the temp spills in ``directory`` whose process is gone (a SIGKILL skips the owner's
    own cleanup, and no one can reopen them); returns how many."""
    gone = 0
    for path in directory.glob(f"{TEMP_PREFIX}*_*.jsonl"):
        pid = path.name[len(TEMP_PREFIX) :].split("_", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            _remove_temp(path)
            gone += 1
    return gone


class DistillQueue:
    """Memory-bounded FIFO with an on-disk overflow (``spill_path=None``: a temp file, removed
    when the queue is closed or collected: nothing can reopen it)."""

    def __init__(self, maxsize: int, spill_path: str | Path | None) -> None:
        self.maxsize = int(maxsize)
        if spill_path is None:
            try:
                sweep_temp_spills(Path(tempfile.gettempdir()))
            except OSError:  # a temp dir we cannot list: leftovers stay, the queue works
                log.warning("could not sweep leftover temp spills", exc_info=True)
            fd, name = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{os.getpid()}_", suffix=".jsonl")
            os.close(fd)
            spill_path, self._temp = Path(name), True
            self._cleanup: weakref.finalize[[Path], DistillQueue] | None = weakref.finalize(
                self, _remove_temp, Path(name)
            )
        else:
            self._temp, self._cleanup = False, None
        self.spill_path = Path(spill_path)
        self.rejected_path = rejected_path(self.spill_path)
        self._offset = spill.SpillOffset(self.spill_path)
        self._mem: deque[DistillationRequest] = deque()
        self._pos: deque[int | None] = (
            deque()
        )  # per memory item: end of its spill line, None if never spilled
        self._unacked = 0  # memory items read from the spill and not handed out yet
        self._cond = threading.Condition()
        self.spilled_total = 0
        self.bad_lines = 0  # unreadable spill lines (moved to ``rejected_path``, logged, counted)
        self.changes = 0
        """Puts since the queue was opened: a checkpointing timer persists only when it moved."""
        spill.terminate_partial_line(self.spill_path)
        self._read_pos = self._offset.load()
        self._spilled = spill.count_lines(self.spill_path, self._read_pos)
        # The queue's own appends are buffered and flushed, not fsynced one by one: a put must stay
        # cheap, and persist() / close() fsync what they leave behind.
        self._writer = open(self.spill_path, "a", encoding="utf-8")  # noqa: SIM115

    def _replace_with(
        self, rest: bytes, *, fsync: bool, first: list[DistillationRequest] | None = None
    ) -> None:
        """Atomically make the spill file ``first + rest``, read from its start: the new inode
        voids the old offset even if a crash comes before the offset is rewritten."""
        spill.rewrite(
            self.spill_path,
            [*((r.to_json() + "\n").encode("utf-8") for r in first or ()), rest],
            fsync=fsync,
        )
        self._offset.store(0)

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

    def put_many(self, requests: list[DistillationRequest], *, durable: bool = False) -> None:
        """Enqueue ``requests`` in order. ``durable``: all of them are first appended to the spill
        file in one fsynced write, so a kill right after the call loses none; when that write fails
        (a full disk) the file is cut back, nothing is queued, and the ``OSError`` is raised.
        The ones memory has room for are also kept there, as read ahead of the file."""
        if not durable:
            for request in requests:
                self.put(request)
            return
        lines = [(r.to_json() + "\n").encode("utf-8") for r in requests]
        if not lines:
            return
        with self._cond:
            if self._writer.closed:
                raise ValueError(f"{self.spill_path}: the queue is closed")
            self._writer.flush()
            fd = self._writer.fileno()
            start = os.fstat(fd).st_size
            try:
                view = memoryview(b"".join(lines))
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            except OSError:
                try:
                    os.ftruncate(fd, start)  # no partial line for a later append to glue onto
                except OSError:
                    log.exception("%s: cutting back a failed append failed", self.spill_path)
                raise
            end = start
            for request, line in zip(requests, lines, strict=True):
                end += len(line)
                if (
                    self._spilled == 0
                    and len(self._mem) < self.maxsize
                    and self._read_pos == end - len(line)
                ):
                    self._mem.append(
                        request
                    )  # read ahead at once: its offset moves when it is handed out
                    self._pos.append(end)
                    self._unacked += 1
                    self._read_pos = end
                else:
                    self._spilled += 1
                    self.spilled_total += 1
            self.changes += 1
            self._cond.notify_all()

    def pending_ids(self) -> list[str]:
        """The ``request_id`` of every request waiting (in memory and in the unread spill), oldest
        first: a restarted service knows them as submitted, so a resend is not queued twice."""
        with self._cond:
            self._writer.flush()
            ids = [r.request_id for r in self._mem]
            with open(self.spill_path, "rb") as f:
                f.seek(self._read_pos)
                for line in f:
                    try:
                        rid = json.loads(line).get("request_id")
                    except (ValueError, AttributeError):
                        continue  # a damaged line: the reader sets it aside when it gets there
                    if isinstance(rid, str):
                        ids.append(rid)
            return ids

    def _refill(self, n: int) -> None:
        """Move up to ``n`` spilled requests into memory (caller holds the condition)."""
        if self._spilled == 0 or n <= 0:
            return
        got, self._read_pos, bad = spill.read(
            self.spill_path, self._read_pos, n, DistillationRequest.from_json
        )
        for request, end in got:
            self._mem.append(request)
            self._pos.append(end)
        self._spilled -= len(got) + len(bad)
        self._unacked += len(got)
        for at, _, exc in bad:
            self.bad_lines += 1
            log.error(
                "%s: unreadable request at byte %d moved to %s: %s",
                self.spill_path,
                at,
                self.rejected_path.name,
                exc,
            )
        # before the offset moves past them: a crash may copy one twice, never lose it
        spill.set_aside(self.spill_path, [line for _, line, _ in bad])
        if self._spilled <= 0 and self._unacked == 0:
            self._reset_file()

    def _ack(self, pos: int) -> None:
        """Record that everything before ``pos`` in the spill was handed out."""
        try:
            self._offset.store(pos)
            if self._spilled <= 0 and self._unacked == 0:
                # after the offset: a crash before the swap delivers nothing twice
                self._reset_file()
        except (
            OSError
        ):  # the requests are handed out all the same: a restart may deliver them twice
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
            if (
                len(self._mem) > self._unacked
            ):  # read-ahead ones are on disk already, behind the offset
                self._rewrite_memory_in_front(fsync=True)
                self._writer = open(self.spill_path, "a", encoding="utf-8")  # noqa: SIM115
            else:
                os.fsync(self._writer.fileno())
            return self._spilled + self._unacked

    def snapshot(self, target: Path) -> int:
        """Write every pending request, oldest first, to ``target`` (fsynced, replacing it), the
        queue unchanged; returns how many. What a checkpoint keeps of the queue
        (:meth:`restore`)."""
        with self._cond:
            if self._writer.closed:
                raise ValueError(f"{self.spill_path}: the queue is closed")
            self._writer.flush()
            with open(self.spill_path, "rb") as f:
                f.seek(self._read_pos)
                rest = f.read()
            # memory holds the oldest (never spilled, or read ahead from before _read_pos); the file
            # the rest
            head = [(r.to_json() + "\n").encode("utf-8") for r in self._mem]
            spill.rewrite(Path(target), [*head, rest], fsync=True)
            return len(self._mem) + self._spilled

    def restore(self, source: Path) -> int:
        """Make the pending requests those :meth:`snapshot` wrote to ``source`` (the current ones
        are dropped); returns how many. The spill is rewritten atomically, so a kill midway leaves
        the old queue or the restored one."""
        with self._cond:
            if self._writer.closed:
                raise ValueError(f"{self.spill_path}: the queue is closed")
            self._writer.close()
            self._replace_with(Path(source).read_bytes(), fsync=True)
            self._mem.clear()
            self._pos.clear()
            self._unacked = 0
            self._read_pos = 0
            self._spilled = spill.count_lines(self.spill_path, 0)
            self._writer = open(self.spill_path, "a", encoding="utf-8")  # noqa: SIM115
            self.changes += 1
            self._cond.notify_all()
            return self._spilled

    def _rewrite_memory_in_front(self, *, fsync: bool) -> None:
        """Atomically replace the spill with the in-memory requests, then its unread rest (the
        caller holds ``_cond``; the writer is closed here and the memory part moves to disk)."""
        with open(self.spill_path, "rb") as f:
            f.seek(self._read_pos)
            rest = f.read()
        self._writer.close()
        self._replace_with(rest, fsync=fsync, first=list(self._mem))
        self._spilled += len(
            self._mem
        )  # read-ahead ones were counted out when read: back on disk now
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
            if self._temp:  # no one can reopen a temp spill: what it holds goes with the queue
                self._writer.close()
                if self._cleanup is not None:
                    self._cleanup()
                return
            if len(self._mem) > self._unacked:
                self._rewrite_memory_in_front(fsync=True)
            else:
                os.fsync(self._writer.fileno())
                self._writer.close()
