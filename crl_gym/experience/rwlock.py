"""A readers-writer lock that favours writers.

Many readers may hold the lock together; a writer holds it alone. As soon as a writer is
waiting, new readers wait too, so a stream of searches cannot starve the extractor's writes.
Both sides are re-entrant for the thread that holds them (a writer may also read), which
keeps helper methods composable (``apply_batch`` inside ``with bank.lock.write():``).

>>> lock = RWLock()
>>> with lock.read():
...     with lock.read():
...         pass
>>> with lock.write():
...     with lock.read():
...         lock.write_held()
True
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class RWLock:
    """Writer-preferring readers-writer lock (re-entrant per thread)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0  # threads holding a read lock (counted once per thread)
        self._writer: int | None = None  # ident of the thread holding the write lock
        self._write_depth = 0
        self._waiting_writers = 0
        self._local = threading.local()

    def _read_depth(self) -> int:
        return getattr(self._local, "depth", 0)

    def acquire_read(self) -> None:
        depth = self._read_depth()
        me = threading.get_ident()
        if depth > 0 or self._writer == me:
            # Re-entry must not wait for queued writers, or it would deadlock against them.
            self._local.depth = depth + 1
            if depth == 0:
                with self._cond:
                    self._readers += 1
            return
        with self._cond:
            while self._writer is not None or self._waiting_writers > 0:
                self._cond.wait()
            self._readers += 1
        self._local.depth = 1

    def release_read(self) -> None:
        depth = self._read_depth()
        if depth <= 0:
            raise RuntimeError("release_read() without a matching acquire_read()")
        self._local.depth = depth - 1
        if depth == 1:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    def acquire_write(self) -> None:
        me = threading.get_ident()
        with self._cond:
            if self._writer == me:
                self._write_depth += 1
                return
            if self._read_depth() > 0:
                raise RuntimeError("cannot upgrade a read lock to a write lock (deadlock)")
            self._waiting_writers += 1
            try:
                while self._writer is not None or self._readers > 0:
                    self._cond.wait()
            finally:
                self._waiting_writers -= 1
            self._writer = me
            self._write_depth = 1

    def release_write(self) -> None:
        with self._cond:
            if self._writer != threading.get_ident():
                raise RuntimeError("release_write() by a thread that does not hold the write lock")
            self._write_depth -= 1
            if self._write_depth == 0:
                self._writer = None
                self._cond.notify_all()

    def write_held(self) -> bool:
        """True when the calling thread holds the write lock."""
        return self._writer == threading.get_ident()

    @contextmanager
    def read(self) -> Iterator[None]:
        """``with lock.read():`` shared access."""
        self.acquire_read()
        try:
            yield
        finally:
            self.release_read()

    @contextmanager
    def write(self) -> Iterator[None]:
        """``with lock.write():`` exclusive access."""
        self.acquire_write()
        try:
            yield
        finally:
            self.release_write()
