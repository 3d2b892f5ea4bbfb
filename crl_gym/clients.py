"""Clients of the experience service: in-process (:class:`LocalClient`) or over HTTP (:class:`RemoteClient`).

Both implement :class:`ExperienceClient`, the whole interface of
:class:`~crl_gym.experience.service.RetrievalService`, and behave identically (the same tests run
against both): ``search`` / ``search_many`` return :class:`~crl_gym.protocol.ExperienceRef` (or
``None`` when the bank has nothing), ``ask`` has the extractor refine an entry for the agent's own
query (the raw entry when no extractor is attached), ``submit`` hands a finished episode's
:class:`~crl_gym.protocol.DistillationRequest` to the service without waiting for the extractor
(:class:`RemoteClient` not even for the HTTP round trip: it buffers, and a sender thread
delivers), ``flush`` waits until every request submitted before it reached the service,
``end_step`` flushes, then closes a rollout step (:class:`~crl_gym.experience.service.StepOrderError`
for a step ended twice or out of order, on both faces), ``apply_ops`` writes Add / Update / Delete
ops, ``stats`` / ``health`` report.

>>> from crl_gym.experience.bank import ExperienceBank
>>> from crl_gym.experience.embedders import HashingEmbedder
>>> from crl_gym.experience.manager import ExperienceManager
>>> from crl_gym.protocol import AddOp
>>> client = LocalClient(ExperienceManager(ExperienceBank(None, dim=64), HashingEmbedder(64)))
>>> client.apply_ops([AddOp("Walk east until the stairs.")])["added"]
1
>>> client.search("reach the stairs").text
'Walk east until the stairs.'
>>> client.end_step(0)["ended"]
[0]
>>> client.service.close()
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable
from urllib.parse import urlsplit

from crl_gym.experience.service import (
    ASK_FALLBACKS as ASK_FALLBACKS,  # re-exported: the wrappers' callers read it here
)
from crl_gym.experience.service import StepOrderError
from crl_gym.experience.service import ask_manager as ask_manager
from crl_gym.protocol import DistillationRequest, ExperienceOp, ExperienceRef, op_to_dict

if TYPE_CHECKING:
    from crl_gym.experience.manager import ExperienceManager
    from crl_gym.experience.service import RetrievalService

logger = logging.getLogger(__name__)

TOKEN_ENV = "CRL_EXPERIENCE_TOKEN"
"""Environment variable holding the bearer token of ``crl-experience serve`` (both sides read it)."""


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


@runtime_checkable
class ExperienceClient(Protocol):
    """What the wrappers and trainers need from the experience service (every face has all of it)."""

    def search(self, query: str) -> ExperienceRef | None:
        """The best (diversified) entry for ``query``, or ``None`` when the bank is empty."""
        ...

    def search_many(self, queries: list[str]) -> list[ExperienceRef | None]:
        """One :meth:`search` per query, batched (one embedding pass)."""
        ...

    def ask(self, query: str, entry: ExperienceRef, context: str) -> tuple[str, dict[str, Any] | None]:
        """Refine ``entry`` for the agent's ``query`` in ``context``: ``(answer, provenance)``.

        ``provenance`` is the extractor sample (``ExtractorSample.to_dict()``) that produced the
        answer, or ``None`` when no extractor is attached (then ``answer`` is the entry's text).
        """
        ...

    def submit(self, request: DistillationRequest) -> None:
        """Queue a finished episode for distillation; never waits for the extractor."""
        ...

    def flush(self, timeout: float | None = None) -> None:
        """Return once every request submitted before the call has reached the service."""
        ...

    def get_requests(self, max_n: int, timeout: float = 0.0) -> list[DistillationRequest]:
        """Take up to ``max_n`` queued requests (a trainer that distils on its own)."""
        ...

    def end_step(self, step: int, bonus: dict[str, float] | None = None) -> dict[str, Any]:
        """Flush, then close rollout ``step`` (and earlier open ones): ``{step, ended, requests, credited}``.

        Raises :class:`~crl_gym.experience.service.StepOrderError` for a step already ended.
        """
        ...

    def apply_ops(self, ops: list[ExperienceOp], *, step: int | None = None) -> dict[str, Any]:
        """Apply Add / Update / Delete / Return ops: ``{added, added_ids, updated, deleted, returned, malformed}``."""
        ...

    def stats(self) -> dict[str, Any]:
        """``bank_size``, ``queue_depth``, the extractor's counters and the manager's (``manager``)."""
        ...

    def health(self) -> dict[str, Any]:
        """``{"status": "ok", "pending": n, "extractor": ...}`` (cheap; no token needed over HTTP)."""
        ...

    def close(self) -> None:
        """Release what the client itself holds (never the service it was given)."""
        ...


def as_service(target: Any) -> RetrievalService:
    """``target`` itself when it is a service; a bare ``ExperienceManager`` wrapped in a
    :class:`~crl_gym.experience.service.RetrievalService` (old callers pass a manager)."""
    from crl_gym.experience.manager import ExperienceManager
    from crl_gym.experience.service import RetrievalService

    if isinstance(target, RetrievalService):
        return target
    if isinstance(target, ExperienceManager):
        return RetrievalService(target)
    raise TypeError(f"expected a RetrievalService or an ExperienceManager, got {type(target).__name__}")


def check_step(step: object) -> int:
    """``step`` as a rollout step (int >= 0), else the service's own :class:`StepOrderError`."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise StepOrderError(f"end_step: step must be an int >= 0, got {step!r}")
    return step


class LocalClient:
    """An :class:`ExperienceClient` over an in-process service (everything delegates to it).

    Args:
        target: a :class:`~crl_gym.experience.service.RetrievalService` (or subclass, e.g.
            ``crl_train.service.ExperienceService``), or an ``ExperienceManager``, which is
            wrapped in a ``RetrievalService`` of its own. :meth:`close` closes neither: they
            belong to the caller.
    """

    def __init__(self, target: RetrievalService | ExperienceManager) -> None:
        self.service = as_service(target)

    @property
    def manager(self) -> ExperienceManager:
        """The service's manager (older callers reach the bank through it)."""
        return self.service.manager

    def search(self, query: str) -> ExperienceRef | None:
        return self.service.search(query)

    def search_many(self, queries: list[str]) -> list[ExperienceRef | None]:
        return self.service.search_many(list(queries))

    def ask(self, query: str, entry: ExperienceRef, context: str) -> tuple[str, dict[str, Any] | None]:
        return self.service.ask(query, entry, context)

    def submit(self, request: DistillationRequest) -> None:
        self.service.submit(request)

    def flush(self, timeout: float | None = None) -> None:
        """Nothing to wait for: :meth:`submit` hands each request to the service before it returns."""

    def get_requests(self, max_n: int, timeout: float = 0.0) -> list[DistillationRequest]:
        return self.service.get_requests(max_n, timeout)

    def end_step(self, step: int, bonus: dict[str, float] | None = None) -> dict[str, Any]:
        return self.service.end_step(check_step(step), bonus)

    def apply_ops(self, ops: Sequence[ExperienceOp], *, step: int | None = None) -> dict[str, Any]:
        return self.service.apply_ops(list(ops), step=step)

    def stats(self) -> dict[str, Any]:
        return dict(self.service.stats())

    def health(self) -> dict[str, Any]:
        return dict(self.service.health())

    def close(self) -> None:
        """Nothing to release: the service (and its manager) belong to the caller."""


class _Slot:
    """One caller's place in a :class:`Combiner` batch."""

    __slots__ = ("item", "result", "error", "batch", "wake")

    def __init__(self, item: Any) -> None:
        self.item = item
        self.result: Any = None
        self.error: BaseException | None = None
        self.batch: list[_Slot] | None = None
        self.wake = threading.Lock()
        self.wake.acquire()  # released once: by the leader that answered it, or to make it lead


class Combiner:
    """Concurrent calls from this process's threads ride one HTTP request (flat combining).

    A caller that finds fewer than ``max_inflight`` batches on the wire sends its own call at
    once; the others queue, and whoever finishes a batch hands the queue (up to ``max_batch``
    calls) to its oldest caller, which sends it as one request. One thread alone pays one round
    trip, as without it; 1,024 env threads that search together cost a handful of
    requests instead of 1,024 (each of which would cost the server and this process far more
    than its share of a batch). ``send(items) -> results`` does one request; a result that is an
    exception is raised to its caller, and when ``send`` raises, every caller of the batch gets it.
    """

    def __init__(self, send: Callable[[list[Any]], list[Any]], max_batch: int = 1024, max_inflight: int = 2) -> None:
        self._send = send
        self.max_batch, self.max_inflight = int(max_batch), int(max_inflight)
        self._lock = threading.Lock()
        self._waiting: deque[_Slot] = deque()
        self._inflight = 0

    def __call__(self, item: Any) -> Any:
        slot = _Slot(item)
        with self._lock:
            self._waiting.append(slot)
            if self._inflight < self.max_inflight:
                self._inflight += 1
                slot.batch = self._take()
        if slot.batch is None:
            slot.wake.acquire()  # answered, or handed a batch to send (which holds this slot first)
        if slot.batch is not None:
            batch, slot.batch = slot.batch, None
            self._run(batch, slot)
        if slot.error is not None:
            raise slot.error
        return slot.result

    def _take(self) -> list[_Slot]:
        return [self._waiting.popleft() for _ in range(min(len(self._waiting), self.max_batch))]

    def _run(self, batch: list[_Slot], own: _Slot) -> None:
        try:
            results = self._send([s.item for s in batch])
            for s, r in zip(batch, results, strict=True):
                if isinstance(r, BaseException):
                    s.error = r
                else:
                    s.result = r
        except BaseException as exc:  # noqa: BLE001 - handed to every caller of the batch
            for s in batch:
                s.error = exc
        with self._lock:
            nxt = self._take() if self._waiting else None
            if nxt is None:
                self._inflight -= 1
        if nxt is not None:
            nxt[0].batch = nxt
            nxt[0].wake.release()
        for s in batch:
            if s is not own:
                s.wake.release()


SUBMIT_BUFFER = 65_536
"""Default most requests a :class:`RemoteClient` holds undelivered in one process (``max_buffered``);
``submit`` blocks while that many wait (backpressure: it never drops one)."""
SUBMIT_BATCH = 256
"""Most requests the sender puts in one ``POST /submit`` (~0.4 MB of 8-turn episodes)."""
SUBMIT_BATCH_CHARS = 1 << 20
"""Most characters of encoded requests in one ``POST /submit``: even all-4-byte UTF-8 stays under
the server's default body limit of 4 MiB (a bigger body would be refused unread)."""
SENDER_IDLE_S = 5.0
"""Seconds the sender thread waits for work before it ends (the next ``submit`` starts another)."""
_BAD_INDEX = re.compile(r"^requests\[(\d+)\]")


class _Rejected(ValueError):
    """A 4xx answer other than 401 / 409: the request itself is at fault (resending it fails again)."""

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


def _append(path: Path, data: bytes) -> None:
    """Append ``data`` to ``path`` in one locked write, fsynced (other processes may share the file)."""
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
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


class _Outbox:
    """The submit buffer of one :class:`RemoteClient` in one process, and the thread that empties it.

    ``put`` appends under a lock and returns: the actor never waits for encoding or HTTP. The
    sender thread (started by a ``put`` that finds none, ended after :data:`SENDER_IDLE_S` without
    work) takes up to :data:`SUBMIT_BATCH` requests at a time, oldest first, and encodes them
    while a poster thread of its own POSTs the batch before (one batch on the wire at a time, so
    this process's encoding overlaps the server's parsing and the order is kept). Every request
    taken ends *resolved*, in FIFO order: delivered, rejected (a 4xx: logged, dropped) or spilled
    (the server stayed unreachable). So ``flush`` waits for a count, not for each request, and the
    failures it must report are the ones collected meanwhile.
    """

    def __init__(self, client: RemoteClient) -> None:
        self.client = client
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the sender waits here for requests
        self._room = threading.Condition(self._lock)  # submitters wait here while the buffer is full
        self._done = threading.Condition(self._lock)  # flushers wait here for requests to resolve
        self._buf: deque[DistillationRequest] = deque()
        self._inflight: deque[list[DistillationRequest]] = deque()  # batches taken, not yet resolved
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
        wire: tuple[list[DistillationRequest], threading.Thread | None] | None = None  # the batch being POSTed
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

    def _post_in_thread(self, encoded: list[tuple[DistillationRequest, str]]) -> threading.Thread | None:
        """Send ``encoded`` from a poster thread (``None``: sent here, no thread could start)."""
        poster = threading.Thread(target=self._send, args=(encoded,), name="crl-submit-post", daemon=True)
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
        """Each request as its JSON text; one that cannot be encoded is rejected here."""
        out = []
        for req in batch:
            try:
                out.append((req, json.dumps(req.to_dict(), ensure_ascii=False)))
            except Exception as exc:  # noqa: BLE001 - this request's fault: it alone is dropped
                self._reject(req, f"it cannot be encoded ({type(exc).__name__}: {exc})")
        return out

    def _send(self, encoded: list[tuple[DistillationRequest, str]]) -> None:
        """Deliver ``encoded`` in bodies of at most :data:`SUBMIT_BATCH_CHARS`, in order."""
        try:
            chunk: list[tuple[DistillationRequest, str]] = []
            size = 0
            for item in encoded:
                if chunk and size + len(item[1]) > SUBMIT_BATCH_CHARS:
                    self._deliver(chunk)
                    chunk, size = [], 0
                chunk.append(item)
                size += len(item[1]) + 1
            if chunk:
                self._deliver(chunk)
        except Exception as exc:  # noqa: BLE001 - a bug here must not lose the batch: spill it
            logger.exception("%s: sending a batch of %d submitted requests failed; spilling it", self.client.url, len(encoded))
            self._undeliverable(encoded, exc)

    def _deliver(self, chunk: list[tuple[DistillationRequest, str]]) -> None:
        """POST ``chunk`` as one ``/submit``. The server refuses a batch as a whole when one
        request is malformed (naming it: ``requests[i]``), so a refused batch is split around that
        one (or in halves when it names none, e.g. a 413) until only the bad ones are left."""
        try:
            self._post(('{"requests":[' + ",".join(e for _, e in chunk) + "]}").encode())
        except _Rejected as exc:
            if len(chunk) == 1:
                self._reject(chunk[0][0], exc.detail)
                return
            found = _BAD_INDEX.match(exc.detail)
            i = int(found.group(1)) if found else -1
            parts = [chunk[:i], chunk[i:i + 1], chunk[i + 1:]] if 0 <= i < len(chunk) else [
                chunk[:len(chunk) // 2], chunk[len(chunk) // 2:]]
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
                client._call("POST", "/submit", body=body)
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
        logger.error("%s: submitted request %s was rejected as malformed and is dropped, not retried "
                     "(rejected so far: %d): %s", self.client.url, request.request_id, rejected, why)

    def _undeliverable(self, chunk: list[tuple[DistillationRequest, str]], exc: BaseException) -> None:
        """Append ``chunk`` to the spill file and note the failure for the next flush."""
        if not chunk:
            return
        path = self.client.spill_file
        n = len(chunk)
        try:
            _append(path, "".join(e + "\n" for _, e in chunk).encode())
        except OSError as err:
            with self._lock:
                self.failures += n
                self.lost += n
                self._unreported.append((n, ExperienceUnavailable(f"{exc}; and writing {path} failed: {err}")))
            logger.error("%s: %d submitted requests could not be delivered (%s) nor written to %s (%s); lost: %s",
                         self.client.url, n, exc, path, err, [r.request_id for r, _ in chunk])
            return
        with self._lock:
            self.failures += n
            self.spilled += n
            self._unreported.append((n, exc))
            spilled = self.spilled
        logger.error("%s: %d submitted requests could not be delivered (%s: %s); appended to %s "
                     "(spilled so far: %d)", self.client.url, n, type(exc).__name__, exc, path, spilled)

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
                        f"flush: {target - self._resolved} submitted requests not yet delivered to {self.client.url} "
                        f"after {timeout} s; they stay buffered (delivered later, or spilled to {self.client.spill_file})")
                self._done.wait(1.0 if left is None else min(left, 1.0))
            unreported, self._unreported = self._unreported, []
        if unreported:
            raise self._error(unreported)

    def _error(self, unreported: list[tuple[int, BaseException]]) -> ExperienceUnavailable | ExperienceAuthError:
        count = sum(n for n, _ in unreported)
        last = unreported[-1][1]
        path = self.client.spill_file
        message = (f"{count} submitted request(s) did not reach {self.client.url} ({type(last).__name__}: {last}); "
                   f"they were appended to {path} (JSONL, one DistillationRequest.to_dict() per line: submit them "
                   f"again once the server takes them)")
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
            self._undeliverable(self._encode(left), ExperienceUnavailable("the process exited first"))


_OUTBOXES: weakref.WeakSet[_Outbox] = weakref.WeakSet()
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


class RemoteClient:
    """An :class:`ExperienceClient` over HTTP to ``crl-experience serve`` (see :mod:`crl_gym.server`).

    Args:
        url: ``http://host:port`` of the server.
        timeout: seconds per call (``get_requests`` adds its own wait).
        token: bearer token; ``None`` reads :data:`TOKEN_ENV` (``CRL_EXPERIENCE_TOKEN``).
        max_buffered: most submitted requests held undelivered in this process; :meth:`submit`
            blocks while that many wait (backpressure, never a drop).
        spill_path: JSONL file the requests that cannot be delivered are appended to; ``None``:
            :func:`default_spill_path` (one file per process, under ``~/.cache/complementary-rl/unsent``).
        retries / retry_backoff_s: how often a ``POST /submit`` is retried while the server is
            unavailable (transport error, 5xx), waiting ``retry_backoff_s`` × 2^k between tries.

    **Submit does not wait for the server.** :meth:`submit` checks its argument, puts the request
    (not yet encoded) in this process's buffer and returns; a sender thread encodes the buffered
    requests and sends them, oldest first, in batches of up to :data:`SUBMIT_BATCH` per
    ``POST /submit``. Once ``submit`` has returned, the request reaches the server (at least
    once: a batch whose answer is lost is sent again) or is appended to :attr:`spill_file`:
    when the server stays unreachable through the retries, when it answers 401 (then
    :class:`ExperienceAuthError`), or when the process exits with it still buffered. A request
    the server refuses as malformed (another 4xx) is logged, counted in :attr:`rejected` and
    dropped; it never holds up those behind it. :meth:`flush` waits until every request
    submitted before it is resolved and raises :class:`SubmitUndelivered` (or
    :class:`ExperienceAuthError`) naming the spill file, once, if any could not be delivered;
    :meth:`end_step` flushes first, so the server has the step's requests before it closes the
    step; :meth:`close` flushes (logging, not raising, what was spilled), then stops the sender.
    Nothing else flushes: call :meth:`flush` before ``stats`` / ``health`` / ``get_requests``
    must see this process's own submits. As with :class:`LocalClient`, a request must not be
    changed after it was submitted.
    Counters: :attr:`delivered`, :attr:`rejected`, :attr:`submit_failures` (could not be
    delivered) = :attr:`spilled` + :attr:`lost` (the spill file could not be written either).

    Picklable, token and options included (the HTTP connection pool, the submit buffer and its
    thread are made lazily in each process), so an env factory that captures it can be sent to
    ``AsyncVectorEnv`` workers. One client is safe to share between threads: its pool keeps a
    kept-alive connection per concurrent caller, and concurrent ``search`` calls ride one
    request (:class:`Combiner`). Transport failures and 5xx raise :class:`ExperienceUnavailable`
    (the wrappers catch it and run the episode free); a 4xx is a :class:`ValueError` with the
    server's message, 401 an :class:`ExperienceAuthError`, 409 (a step ended twice) a
    ``StepOrderError``.
    """

    def __init__(self, url: str, timeout: float = 10.0, token: str | None = None, *,
                 max_buffered: int = SUBMIT_BUFFER, spill_path: str | Path | None = None,
                 retries: int = 5, retry_backoff_s: float = 0.25) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {url!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if max_buffered < 1:
            raise ValueError(f"max_buffered must be >= 1, got {max_buffered}")
        if retries < 0 or retry_backoff_s < 0:
            raise ValueError(f"retries and retry_backoff_s must be >= 0, got {retries} and {retry_backoff_s}")
        self.url = url.rstrip("/")
        self.timeout = float(timeout)
        self.token = token if token is not None else (os.environ.get(TOKEN_ENV) or None)
        self.max_buffered = int(max_buffered)
        self.spill_path = Path(spill_path) if spill_path is not None else None
        self.retries, self.retry_backoff_s = int(retries), float(retry_backoff_s)
        self._http: Any = None
        self._pid = -1
        self._lock = threading.Lock()
        self.malformed_requests = 0
        """Requests ``get_requests`` received but could not parse (skipped and logged)."""
        self._make_per_process()

    def _make_per_process(self) -> None:
        # 512 searches per batch (bench/service.py): a cold storm's embedding passes stay short
        # enough that early callers are answered early.
        self._search = Combiner(self._send_searches, max_batch=512, max_inflight=2)
        self._box = _Outbox(self)

    def _here(self) -> tuple[Combiner, _Outbox]:
        """The search combiner and the submit buffer of this process (a forked child must not
        inherit a parent's queues, requests the parent will send itself, or its held locks)."""
        if self._box.pid != os.getpid():
            with self._lock:
                if self._box.pid != os.getpid():
                    self._make_per_process()
        return self._search, self._box

    # The httpx client, the combiner and the outbox hold sockets, locks and a thread: rebuild
    # them after pickling (and after forking).
    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "timeout": self.timeout, "token": self.token, "max_buffered": self.max_buffered,
                "spill_path": self.spill_path, "retries": self.retries, "retry_backoff_s": self.retry_backoff_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # "" keeps __init__ from reading the environment: the pickled token (or None) is the one.
        self.__init__(state["url"], state["timeout"], "", max_buffered=state.get("max_buffered", SUBMIT_BUFFER),  # type: ignore[misc]
                      spill_path=state.get("spill_path"), retries=state.get("retries", 5),
                      retry_backoff_s=state.get("retry_backoff_s", 0.25))
        self.token = state.get("token")

    def __repr__(self) -> str:  # never print the token
        return f"RemoteClient({self.url!r}, timeout={self.timeout}, token={'***' if self.token else None})"

    @property
    def spill_file(self) -> Path:
        """Where this process appends the requests it could not deliver (``spill_path`` or the default)."""
        return self.spill_path if self.spill_path is not None else default_spill_path(self.url)

    @property
    def buffered(self) -> int:
        """Requests submitted in this process and not yet resolved (delivered, rejected or spilled)."""
        return self._here()[1].buffered

    @property
    def delivered(self) -> int:
        """Submitted requests the server accepted (this process)."""
        return self._here()[1].delivered

    @property
    def rejected(self) -> int:
        """Submitted requests the server refused as malformed (4xx), or that could not be encoded: dropped."""
        return self._here()[1].rejected

    @property
    def submit_failures(self) -> int:
        """Submitted requests that could not be delivered (server down after the retries, 401, exit)."""
        return self._here()[1].failures

    @property
    def spilled(self) -> int:
        """Of :attr:`submit_failures`, those appended to :attr:`spill_file`."""
        return self._here()[1].spilled

    @property
    def lost(self) -> int:
        """Of :attr:`submit_failures`, those the spill file could not take either (logged by id)."""
        return self._here()[1].lost

    def _client(self) -> Any:
        if self._http is None or self._pid != os.getpid():
            with self._lock:
                if self._http is None or self._pid != os.getpid():
                    import httpx

                    headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
                    # Keep a connection alive per concurrent caller: reconnecting costs more than a call.
                    limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024, keepalive_expiry=60.0)
                    self._http = httpx.Client(base_url=self.url, timeout=self.timeout, headers=headers, limits=limits)
                    self._pid = os.getpid()
        return self._http

    def _call(self, method: str, path: str, payload: Any = None, extra_wait: float = 0.0, body: bytes | None = None) -> Any:
        import httpx

        content = body if body is not None else None if payload is None else json.dumps(payload, ensure_ascii=False).encode()
        headers = None if content is None else {"Content-Type": "application/json"}
        try:
            resp = self._client().request(method, path, content=content, headers=headers, timeout=self.timeout + extra_wait)
        except httpx.HTTPError as exc:
            raise ExperienceUnavailable(f"experience server {self.url}{path} unreachable: {type(exc).__name__}: {exc}") from exc
        status = resp.status_code
        if status < 400:
            return resp.json()
        if status >= 500:
            raise ExperienceUnavailable(f"experience server {self.url}{path} failed ({status}): {resp.text[:500]}")
        detail = _detail(resp)
        if status == 401:
            need = "a wrong token was sent" if self.token else f"no token was sent (set {TOKEN_ENV} or pass token=)"
            raise ExperienceAuthError(f"experience server {self.url}{path} refused the call (401): {need}; server said: {detail}")
        if status == 409:
            raise StepOrderError(detail)
        # A 4xx is our bug or bad input, not an outage: say which field the server rejected.
        raise _Rejected(f"experience server {self.url}{path} rejected the request ({status}): {detail}", detail)

    def _send_searches(self, queries: list[str]) -> list[ExperienceRef | None]:
        if len(queries) == 1:  # /search: the server coalesces it with other processes' searches
            return [ExperienceRef.from_dict(self._call("POST", "/search", {"query": queries[0]})["entry"])]
        return self._search_many(queries)

    def _search_many(self, queries: list[str]) -> list[ExperienceRef | None]:
        out = self._call("POST", "/search_many", {"queries": queries})["entries"]
        return [ExperienceRef.from_dict(d) for d in out]

    def search(self, query: str) -> ExperienceRef | None:
        result: ExperienceRef | None = self._here()[0](str(query))
        return result

    def search_many(self, queries: list[str]) -> list[ExperienceRef | None]:
        if not queries:
            return []
        return self._search_many([str(q) for q in queries])

    def ask(self, query: str, entry: ExperienceRef, context: str) -> tuple[str, dict[str, Any] | None]:
        out = self._call("POST", "/ask", {"query": query, "entry": entry.to_dict(), "context": context})
        return str(out["answer"]), out.get("provenance")

    def submit(self, request: DistillationRequest) -> None:
        """Buffer ``request`` for the sender thread and return (see the class docstring); blocks
        only while :attr:`max_buffered` requests wait."""
        if not isinstance(request, DistillationRequest):
            raise TypeError(f"submit expects a DistillationRequest, got {type(request).__name__}")
        # Fix the id now (a RecordedRequest makes its uuid on first read): a copy taken before the
        # sender encodes it, e.g. the one an AsyncVectorEnv worker pickles to the trainer, must
        # carry the id the server gets (credit bonuses are keyed by it).
        _ = request.request_id
        self._here()[1].put(request)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every request submitted (in this process) before the call is delivered,
        rejected or spilled. Raises :class:`SubmitUndelivered` naming the spill file
        (:class:`ExperienceAuthError` after a 401) when some could not be delivered since the last
        report, and :class:`TimeoutError` when ``timeout`` s pass first (nothing is dropped then:
        the requests stay buffered). Without a timeout it returns within the retries' schedule."""
        self._here()[1].flush(timeout)

    def get_requests(self, max_n: int, timeout: float = 0.0) -> list[DistillationRequest]:
        """Take up to ``max_n`` queued requests. One that does not parse (a server of another
        version, a damaged spill line) is skipped, counted in ``malformed_requests`` and logged:
        raising would drop the good ones that came with it, already taken off the queue."""
        out = self._call("POST", "/get_requests", {"max_n": max_n, "timeout": timeout}, extra_wait=timeout)
        got = []
        for i, d in enumerate(out.get("requests") or []):
            try:
                got.append(DistillationRequest.from_dict(d))
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                self.malformed_requests += 1
                logger.error("%s: skipping malformed request %d of %d (%s: %s): %.200r",
                             self.url, i, len(out["requests"]), type(exc).__name__, exc, d)
        return got

    def end_step(self, step: int, bonus: dict[str, float] | None = None) -> dict[str, Any]:
        """:meth:`flush`, then close the step: the server counts and credits the step's requests
        only once it has them. A flush error is raised before the step is closed (it stays open:
        call ``end_step`` again to close it without the spilled requests)."""
        body = {"step": check_step(step), "bonus": None if bonus is None else {str(k): float(v) for k, v in bonus.items()}}
        self.flush()
        return dict(self._call("POST", "/end_step", body))

    def apply_ops(self, ops: Sequence[ExperienceOp], *, step: int | None = None) -> dict[str, Any]:
        return dict(self._call("POST", "/apply_ops", {"ops": [op_to_dict(op) for op in ops], "step": step}))

    def stats(self) -> dict[str, Any]:
        return dict(self._call("GET", "/stats"))

    def health(self) -> dict[str, Any]:
        return dict(self._call("GET", "/health"))

    def close(self) -> None:
        """Flush, stop the sender thread and close the connection pool. What could not be
        delivered is logged (it is in the spill file), not raised: call :meth:`flush` first to
        get the error. The client may be used again (all of it restarts lazily)."""
        box = self._box
        if box.pid == os.getpid():
            try:
                box.flush()
            except (ExperienceUnavailable, ValueError) as exc:  # ExperienceAuthError is a ValueError
                logger.error("%s: close: %s", self.url, exc)
            box.stop(self.timeout)
        if self._http is not None and self._pid == os.getpid():
            self._http.close()
        self._http = None


def _detail(resp: Any) -> str:
    """The server's error message: FastAPI's ``detail`` (a string, or pydantic's error list)."""
    try:
        detail = resp.json().get("detail")
    except (ValueError, AttributeError):
        return str(resp.text[:500])
    if isinstance(detail, str):
        return detail
    return json.dumps(detail, ensure_ascii=False)[:1000]
