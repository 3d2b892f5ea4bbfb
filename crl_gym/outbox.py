"""The submit buffer of a :class:`~crl_gym.clients.RemoteClient`: accepted requests, delivered
in order.

``RemoteClient.submit`` puts a request in this process's :class:`SubmitOutbox` and returns; a
sender thread encodes and POSTs batches, retries while the server is unavailable, splits a batch
the server refuses around the bad request, and appends what it cannot deliver to a spill file
(:func:`default_spill_path`, written by :func:`crl_gym.spill.append`). At process exit what is
left is delivered or spilled.
"""

from __future__ import annotations

import json
import logging
import multiprocessing.util
import os
import re
import tempfile
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

from crl_gym import spill
from crl_gym.errors import (
    ExperienceAuthError,
    ExperienceUnavailable,
    RequestTooLarge,
    SubmitUndelivered,
)
from crl_gym.protocol import DistillationRequest

logger = logging.getLogger(__name__)


class OutboxClient(Protocol):
    """What the outbox reads of the client it sends for (``crl_gym.clients.RemoteClient``): its
    limits, its retry settings, its spill file and one POST of an encoded body."""

    url: str
    timeout: float
    max_buffered: int
    max_request_bytes: int
    retries: int
    retry_backoff_s: float

    @property
    def spill_file(self) -> Path: ...

    def post_encoded(self, path: str, body: bytes) -> object: ...


SUBMIT_BUFFER = 65_536
"""Default most requests a :class:`RemoteClient` holds undelivered in one process
(``max_buffered``); ``submit`` blocks while that many wait (backpressure: it never drops one)."""
SUBMIT_BATCH = 256
"""Most requests the sender puts in one ``POST /submit`` (~0.4 MB of 8-turn episodes)."""
SUBMIT_BATCH_CHARS = 1 << 20
"""Most characters of encoded requests in one ``POST /submit``: even all-4-byte UTF-8 stays under
the server's default body limit of 4 MiB (a bigger body would be refused unread)."""
_ENVELOPE_BYTES = 64
"""Bytes of the ``{"requests":[...]}`` body around one request, with room to spare."""
SENDER_IDLE_S = 5.0
"""Seconds the sender thread waits for work before it ends (the next ``submit`` starts another)."""
_BAD_INDEX = re.compile(r"^requests\[(\d+)\]")


class Rejected(ValueError):
    """A 4xx answer other than 401 / 409: the request itself is at fault (resending it
    fails again)."""

    def __init__(self, message: str, detail: str) -> None:
        super().__init__(message)
        self.detail = detail


def default_spill_path(url: str) -> Path:
    """Where a :class:`RemoteClient` of this process appends the requests it could not deliver to
    ``url``: ``$XDG_CACHE_HOME`` (else ``~/.cache``, else the temp dir) ``/complementary-rl/unsent/
    requests-<host>-<port>-<pid>.jsonl``; one file per process, so concurrent writers never mix."""
    parts = urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        port = 0
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", parts.hostname or "server")
    cache = os.environ.get("XDG_CACHE_HOME")
    if cache:
        root = Path(cache)
    else:
        try:
            root = Path.home() / ".cache"
        except RuntimeError:  # no home directory to be found
            root = Path(tempfile.gettempdir())
    return root / "complementary-rl" / "unsent" / f"requests-{host}-{port}-{os.getpid()}.jsonl"


@dataclass(frozen=True)
class SubmitCounts:
    """What became of the requests one process submitted through a client, at one instant.

    ``failures`` (could not be delivered: the server down after the retries, a 401, the process
    exiting) = ``spilled`` (appended to the spill file) + ``lost`` (the spill file could not take
    them either; each logged by id).
    """

    buffered: int
    """Submitted and not yet resolved (delivered, rejected or spilled)."""
    delivered: int
    """Accepted by the server."""
    rejected: int
    """Refused by the server as malformed (a 4xx), or not encodable: logged and dropped."""
    failures: int
    spilled: int
    lost: int


class SubmitOutbox:
    """The submit buffer of one :class:`RemoteClient` in one process, and the thread that
    empties it.

    ``put`` appends under a lock and returns: the actor never waits for encoding or HTTP. The
    sender thread (started by a ``put`` that finds none, ended after :data:`SENDER_IDLE_S` without
    work) takes up to :data:`SUBMIT_BATCH` requests at a time, oldest first, and encodes them
    while a poster thread of its own POSTs the batch before (one batch on the wire at a time, so
    this process's encoding overlaps the server's parsing and the order is kept). Every request
    taken ends *resolved*, in FIFO order: delivered, rejected (a 4xx: logged, dropped) or spilled
    (the server stayed unreachable). So ``flush`` waits for a count, not for each request, and the
    failures it must report are the ones collected meanwhile.
    """

    def counts(self) -> SubmitCounts:
        """What became of this process's submitted requests, read at one instant."""
        with self._lock:
            return SubmitCounts(
                self.buffered, self.delivered, self.rejected, self.failures, self.spilled, self.lost
            )

    def __init__(self, client: OutboxClient) -> None:
        self.client = client
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the sender waits here for requests
        self._room = threading.Condition(
            self._lock
        )  # submitters wait here while the buffer is full
        self._done = threading.Condition(self._lock)  # flushers wait here for requests to resolve
        self._buf: deque[DistillationRequest] = deque()
        self._inflight: deque[list[DistillationRequest]] = (
            deque()
        )  # batches taken, not yet resolved
        self._accepted = 0
        self._resolved = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._down = False  # the last batch exhausted its retries: try each next batch once
        self._unreported: list[tuple[int, BaseException]] = []
        self.delivered = self.rejected = self.spilled = self.failures = self.lost = 0
        _OUTBOXES.add(self)
        _hook_exit()

    @property
    def buffered(self) -> int:
        """Requests accepted and not yet resolved (buffered or on the wire)."""
        return self._accepted - self._resolved

    def put(self, request: DistillationRequest) -> None:
        with self._lock:
            while len(self._buf) >= self.client.max_buffered:
                self._start_sender()
                self._room.wait()
            self._start_sender()  # before taking it: a thread that cannot start must not strand it
            self._buf.append(request)
            self._accepted += 1
            self._work.notify()

    def _start_sender(self) -> None:
        """Start the sender if there is none (the lock is held)."""
        if self._thread is None:
            self._stopping = False
            thread = threading.Thread(target=self._run, name="crl-submit-sender", daemon=True)
            thread.start()
            self._thread = thread

    def _run(self) -> None:
        wire: tuple[list[DistillationRequest], threading.Thread | None] | None = (
            None  # the batch being POSTed
        )
        while True:
            with self._lock:
                while not self._buf and wire is None:
                    if self._stopping or (not self._work.wait(SENDER_IDLE_S) and not self._buf):
                        if self._thread is threading.current_thread():
                            self._thread = None
                        self._done.notify_all()
                        return
                batch = [self._buf.popleft() for _ in range(min(len(self._buf), SUBMIT_BATCH))]
                if batch:
                    self._inflight.append(batch)
                    self._room.notify_all()
            if not batch:  # nothing new to encode: see the one on the wire through
                assert wire is not None
                self._resolve(*wire)
                wire = None
                continue
            encoded = self._encode(batch)  # while the batch before is on the wire
            if wire is not None:
                self._resolve(*wire)
            wire = (batch, self._post_in_thread(encoded))

    def _post_in_thread(
        self, encoded: list[tuple[DistillationRequest, str]]
    ) -> threading.Thread | None:
        """Send ``encoded`` from a poster thread (``None``: sent here, no thread could start)."""
        poster = threading.Thread(
            target=self._send, args=(encoded,), name="crl-submit-post", daemon=True
        )
        try:
            poster.start()
        except RuntimeError:  # e.g. no new threads at interpreter shutdown
            self._send(encoded)
            return None
        return poster

    def _resolve(self, batch: list[DistillationRequest], poster: threading.Thread | None) -> None:
        if poster is not None:
            poster.join()
        with self._lock:
            self._inflight.popleft()
            self._resolved += len(batch)
            self._done.notify_all()

    def _encode(self, batch: list[DistillationRequest]) -> list[tuple[DistillationRequest, str]]:
        """Each request as its JSON text; one that cannot be encoded is rejected here, one that
        encodes above the server's body limit is spilled (it is whole: only the server is
        too small)."""
        out = []
        limit = self.client.max_request_bytes - _ENVELOPE_BYTES
        for req in batch:
            try:
                text = json.dumps(req.to_dict(), ensure_ascii=False)
            except Exception as exc:  # noqa: BLE001 - this request's fault: it alone is dropped
                self._reject(req, f"it cannot be encoded ({type(exc).__name__}: {exc})")
                continue
            if (
                len(text) > limit // 4
                and (size := len(text.encode("utf-8", "surrogatepass"))) > limit
            ):
                self._undeliverable(
                    [(req, text)],
                    RequestTooLarge(
                        f"request {req.request_id} encodes to {size} bytes, above the body limit "
                        f"of {self.client.max_request_bytes} bytes (the server's --max-body-bytes)"
                    ),
                )
                continue
            out.append((req, text))
        return out

    def _send(self, encoded: list[tuple[DistillationRequest, str]]) -> None:
        """Deliver ``encoded`` in bodies of at most :data:`SUBMIT_BATCH_CHARS`, in order."""
        try:
            chunk: list[tuple[DistillationRequest, str]] = []
            size = 0
            cap = min(
                SUBMIT_BATCH_CHARS, self.client.max_request_bytes // 4
            )  # 4 bytes per char at most
            for item in encoded:
                if chunk and size + len(item[1]) > cap:
                    self._deliver(chunk)
                    chunk, size = [], 0
                chunk.append(item)
                size += len(item[1]) + 1
            if chunk:
                self._deliver(chunk)
        except Exception as exc:  # noqa: BLE001 - a bug here must not lose the batch: spill it
            logger.exception(
                "%s: sending a batch of %d submitted requests failed; spilling it",
                self.client.url,
                len(encoded),
            )
            self._undeliverable(encoded, exc)

    def _deliver(self, chunk: list[tuple[DistillationRequest, str]]) -> None:
        """POST ``chunk`` as one ``/submit``. The server refuses a batch as a whole when one
        request is malformed (naming it: ``requests[i]``), so a refused batch is split around that
        one (or in halves when it names none, e.g. a 413) until only the bad ones are left."""
        try:
            self._post(('{"requests":[' + ",".join(e for _, e in chunk) + "]}").encode())
        except Rejected as exc:
            if len(chunk) == 1:
                self._reject(chunk[0][0], exc.detail)
                return
            found = _BAD_INDEX.match(exc.detail)
            i = int(found.group(1)) if found else -1
            parts = (
                [chunk[:i], chunk[i : i + 1], chunk[i + 1 :]]
                if 0 <= i < len(chunk)
                else [chunk[: len(chunk) // 2], chunk[len(chunk) // 2 :]]
            )
            for part in parts:
                if part:
                    self._deliver(part)
        except (ExperienceUnavailable, ValueError) as exc:  # down after the retries, 401, 409
            self._undeliverable(chunk, exc)
        else:
            with self._lock:
                self.delivered += len(chunk)

    def _post(self, body: bytes) -> None:
        """One ``POST /submit``, retried with exponential backoff while the server is unavailable
        (transport error or 5xx); once a batch has used up its retries, later ones get one try
        each until one goes through, so a long outage spills at once instead of stalling."""
        client = self.client
        attempts = 1 if self._down else 1 + client.retries
        for attempt in range(attempts):
            try:
                client.post_encoded("/submit", body)
            except ExperienceUnavailable:
                if attempt + 1 == attempts:
                    self._down = True
                    raise
                time.sleep(min(client.retry_backoff_s * 2**attempt, 5.0))
            else:
                self._down = False
                return

    def _reject(self, request: DistillationRequest, why: str) -> None:
        with self._lock:
            self.rejected += 1
            rejected = self.rejected
        logger.error(
            "%s: submitted request %s was rejected as malformed and is dropped, not retried "
            "(rejected so far: %d): %s",
            self.client.url,
            request.request_id,
            rejected,
            why,
        )

    def _undeliverable(
        self, chunk: list[tuple[DistillationRequest, str]], exc: BaseException
    ) -> None:
        """Append ``chunk`` to the spill file and note the failure for the next flush."""
        if not chunk:
            return
        path = self.client.spill_file
        n = len(chunk)
        try:
            spill.append(path, [e for _, e in chunk])
        except OSError as err:
            with self._lock:
                self.failures += n
                self.lost += n
                self._unreported.append(
                    (n, ExperienceUnavailable(f"{exc}; and writing {path} failed: {err}"))
                )
            logger.error(
                "%s: %d submitted requests could not be delivered (%s) nor written to %s (%s); "
                "lost: %s",
                self.client.url,
                n,
                exc,
                path,
                err,
                [r.request_id for r, _ in chunk],
            )
            return
        with self._lock:
            self.failures += n
            self.spilled += n
            self._unreported.append((n, exc))
            spilled = self.spilled
        logger.error(
            "%s: %d submitted requests could not be delivered (%s: %s); appended to %s "
            "(spilled so far: %d)",
            self.client.url,
            n,
            type(exc).__name__,
            exc,
            path,
            spilled,
        )

    def flush(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            target = self._accepted
            while self._resolved < target:
                if self._buf and (self._thread is None or not self._thread.is_alive()):
                    self._thread = None  # defensive: a sender that died must not hang the flush
                    self._start_sender()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(
                        f"flush: {target - self._resolved} submitted requests not yet delivered to "
                        f"{self.client.url} after {timeout} s; they stay buffered (delivered "
                        f"later, or spilled to {self.client.spill_file})"
                    )
                self._done.wait(1.0 if left is None else min(left, 1.0))
            unreported, self._unreported = self._unreported, []
        if unreported:
            raise self._error(unreported)

    def _error(
        self, unreported: list[tuple[int, BaseException]]
    ) -> ExperienceUnavailable | ExperienceAuthError:
        count = sum(n for n, _ in unreported)
        last = unreported[-1][1]
        path = self.client.spill_file
        message = (
            f"{count} submitted request(s) did not reach {self.client.url} ({type(last).__name__}: "
            f"{last}); they were appended to {path} (JSONL, one DistillationRequest.to_dict() per "
            "line: submit them again once the server takes them)"
        )
        if self.lost:
            message += f"; {self.lost} could not be written there either and are lost"
        if any(isinstance(e, ExperienceAuthError) for _, e in unreported):
            return ExperienceAuthError(message)
        return SubmitUndelivered(message, spill_path=path, count=count)

    def stop(self, timeout: float | None = None) -> None:
        """Let the sender end once the buffer is empty, and wait for it."""
        with self._lock:
            self._stopping = True
            self._work.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def drain_at_exit(self) -> None:
        """At interpreter (or ``multiprocessing`` worker) exit: deliver what is still buffered,
        waiting up to the client's timeout, then spill whatever is left, the batch on the wire
        included (it may reach the server twice: at least once, never lost)."""
        if self.pid != os.getpid() or self.buffered == 0:
            return
        try:
            self.flush(self.client.timeout)
        except Exception:  # noqa: BLE001 - failures were logged when they were spilled
            pass
        with self._lock:
            self._stopping = True
            left = [*(r for batch in self._inflight for r in batch), *self._buf]
            self._resolved += len(self._buf)
            self._buf.clear()
        if left:
            self._undeliverable(
                self._encode(left), ExperienceUnavailable("the process exited first")
            )


_OUTBOXES: weakref.WeakSet[SubmitOutbox] = weakref.WeakSet()
_HOOKED_PID = -1


def _hook_exit() -> None:
    """Drain this process's outboxes at its exit. ``multiprocessing``'s finalizers run both at
    interpreter exit (through ``atexit``) and when a ``multiprocessing`` worker ends, where
    ``atexit`` does not run (forked workers leave through ``os._exit``); a worker clears the
    finalizers it inherited, so each process registers its own."""
    global _HOOKED_PID
    if _HOOKED_PID != os.getpid():
        _HOOKED_PID = os.getpid()
        multiprocessing.util.Finalize(None, _drain_all_at_exit, exitpriority=100)


def _drain_all_at_exit() -> None:
    for box in list(_OUTBOXES):
        try:
            box.drain_at_exit()
        except Exception:  # noqa: BLE001 - exiting: report and go on with the others
            logger.exception("draining the submit buffer of %s at exit failed", box.client.url)
