"""The HTTP client: :class:`RemoteClient` to ``crl-experience serve`` (:mod:`crl_gym.server`)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

from crl_gym.clients.combiner import Combiner
from crl_gym.clients.deprecated import submit_count_property
from crl_gym.clients.interface import TOKEN_ENV, check_step
from crl_gym.errors import ExperienceAuthError, ExperienceUnavailable, StorageFault
from crl_gym.experience.results import Health, OpsApplied, ServiceStats, StepEnded
from crl_gym.experience.service import StepOrderError
from crl_gym.json_types import JSONInput, QuarantinedDict, RestoredDict, SnapshotInfoDict
from crl_gym.limits import MAX_BATCH, MAX_BODY_BYTES, MAX_QUERY_CHARS, MAX_TEXT, check_request_size
from crl_gym.outbox import SUBMIT_BUFFER, Rejected, SubmitCounts, SubmitOutbox, default_spill_path
from crl_gym.protocol import DistillationRequest, ExperienceOp, ExperienceRef, op_to_dict

if TYPE_CHECKING:
    import httpx

logger = logging.getLogger(__name__)


class RemoteClientState(TypedDict):
    """What a pickled :class:`RemoteClient` keeps (its sockets, locks and threads are rebuilt);
    the keyword fields may be missing from a client pickled by an older version."""

    url: str
    timeout: float
    token: str | None
    max_buffered: NotRequired[int]
    spill_path: NotRequired[Path | None]
    retries: NotRequired[int]
    retry_backoff_s: NotRequired[float]
    max_query_chars: NotRequired[int]
    max_request_bytes: NotRequired[int]


class RemoteClient:
    """An :class:`ExperienceClient` over HTTP to ``crl-experience serve`` (see
    :mod:`crl_gym.server`).

    Args:
        url: ``http://host:port`` of the server.
        timeout: seconds per call (``get_requests`` adds its own wait).
        token: bearer token; ``None`` reads :data:`TOKEN_ENV` (``CRL_EXPERIENCE_TOKEN``).
        max_buffered: most submitted requests held undelivered in this process; :meth:`submit`
            blocks while that many wait (backpressure, never a drop).
        spill_path: JSONL file the requests that cannot be delivered are appended to; ``None``:
            :func:`~crl_gym.outbox.default_spill_path` (one file per process, under
            ``~/.cache/complementary-rl/unsent``).
        retries / retry_backoff_s: how often a ``POST /submit`` is retried while the server is
            unavailable (transport error, 5xx), waiting ``retry_backoff_s`` × 2^k between tries.
        max_query_chars: queries are shortened to this many characters before they are sent (the
            server's manager shortens them to its own ``max_query_chars`` too: keep both equal).
        max_request_bytes: the server's ``--max-body-bytes``: ``submit`` refuses a request whose
            text is larger (:class:`RequestTooLarge`), and the sender spills one that encodes
            larger. See :mod:`crl_gym.limits`.

    **Submit does not wait for the server.** :meth:`submit` checks its argument, puts the request
    (not yet encoded) in this process's buffer and returns; a sender thread encodes the buffered
    requests and sends them, oldest first, in batches of up to :data:`~crl_gym.outbox.SUBMIT_BATCH`
    per ``POST /submit``. Once ``submit`` has returned, the request reaches the server (at least
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
    :attr:`submit_counts` says what became of this process's submits: delivered, rejected,
    failures (could not be delivered) = spilled + lost (the spill file could not take them either).

    Picklable, token and options included (the HTTP connection pool, the submit buffer and its
    thread are made lazily in each process), so an env factory that captures it can be sent to
    ``AsyncVectorEnv`` workers. One client is safe to share between threads: its pool keeps a
    kept-alive connection per concurrent caller, and concurrent ``search`` calls ride one
    request (:class:`Combiner`). Transport failures and 5xx raise :class:`ExperienceUnavailable`
    (the wrappers catch it and run the episode free); a 4xx is a :class:`ValueError` with the
    server's message, 401 an :class:`ExperienceAuthError`, 409 (a step ended twice) a
    ``StepOrderError``.
    """

    def __init__(
        self,
        url: str,
        timeout: float = 10.0,
        token: str | None = None,
        *,
        max_buffered: int = SUBMIT_BUFFER,
        spill_path: str | Path | None = None,
        retries: int = 5,
        retry_backoff_s: float = 0.25,
        max_query_chars: int = MAX_QUERY_CHARS,
        max_request_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {url!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if max_buffered < 1:
            raise ValueError(f"max_buffered must be >= 1, got {max_buffered}")
        if retries < 0 or retry_backoff_s < 0:
            raise ValueError(
                f"retries and retry_backoff_s must be >= 0, got {retries} and {retry_backoff_s}"
            )
        self.url = url.rstrip("/")
        self.timeout = float(timeout)
        self.token = token if token is not None else (os.environ.get(TOKEN_ENV) or None)
        self.max_buffered = int(max_buffered)
        self.spill_path = Path(spill_path) if spill_path is not None else None
        self.retries, self.retry_backoff_s = int(retries), float(retry_backoff_s)
        if max_query_chars < 1 or max_request_bytes < 1:
            raise ValueError(
                f"max_query_chars and max_request_bytes must be >= 1, got {max_query_chars} and "
                f"{max_request_bytes}"
            )
        self.max_query_chars, self.max_request_bytes = int(max_query_chars), int(max_request_bytes)
        self._http: httpx.Client | None = None
        self._pid = -1
        self._lock = threading.Lock()
        self.malformed_requests = 0
        """Requests ``get_requests`` received but could not parse (skipped and logged)."""
        self._make_per_process()

    def _make_per_process(self) -> None:
        # 512 searches per batch (bench/service.py): a cold storm's embedding passes stay short
        # enough that early callers are answered early.
        self._search = Combiner(self._send_searches, max_batch=512, max_inflight=2)
        self._box = SubmitOutbox(self)

    def _here(self) -> tuple[Combiner[str, ExperienceRef | None], SubmitOutbox]:
        """The search combiner and the submit buffer of this process (a forked child must not
        inherit a parent's queues, requests the parent will send itself, or its held locks)."""
        if self._box.pid != os.getpid():
            with self._lock:
                if self._box.pid != os.getpid():
                    self._make_per_process()
        return self._search, self._box

    # The httpx client, the combiner and the outbox hold sockets, locks and a thread: rebuild
    # them after pickling (and after forking).
    def __getstate__(self) -> RemoteClientState:
        return {
            "url": self.url,
            "timeout": self.timeout,
            "token": self.token,
            "max_buffered": self.max_buffered,
            "spill_path": self.spill_path,
            "retries": self.retries,
            "retry_backoff_s": self.retry_backoff_s,
            "max_query_chars": self.max_query_chars,
            "max_request_bytes": self.max_request_bytes,
        }

    def __setstate__(self, state: RemoteClientState) -> None:
        # "" keeps __init__ from reading the environment: the pickled token (or None) is the one.
        self.__init__(  # type: ignore[misc]
            state["url"],
            state["timeout"],
            "",
            max_buffered=state.get("max_buffered", SUBMIT_BUFFER),
            spill_path=state.get("spill_path"),
            retries=state.get("retries", 5),
            retry_backoff_s=state.get("retry_backoff_s", 0.25),
            max_query_chars=state.get("max_query_chars", MAX_QUERY_CHARS),
            max_request_bytes=state.get("max_request_bytes", MAX_BODY_BYTES),
        )
        self.token = state.get("token")

    def __repr__(self) -> str:  # never print the token
        return (
            f"RemoteClient({self.url!r}, timeout={self.timeout}, "
            f"token={'***' if self.token else None})"
        )

    @property
    def spill_file(self) -> Path:
        """Where this process appends the requests it could not deliver (``spill_path`` or
        the default)."""
        return self.spill_path if self.spill_path is not None else default_spill_path(self.url)

    @property
    def submit_counts(self) -> SubmitCounts:
        """What became of the requests submitted in this process: buffered, delivered, rejected,
        failures = spilled + lost (:class:`~crl_gym.outbox.SubmitCounts`), read at one instant."""
        return self._here()[1].counts()

    def _client(self) -> httpx.Client:
        if self._http is None or self._pid != os.getpid():
            with self._lock:
                if self._http is None or self._pid != os.getpid():
                    import httpx

                    headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
                    # Keep a connection alive per concurrent caller: reconnecting costs more than
                    # a call.
                    limits = httpx.Limits(
                        max_connections=None, max_keepalive_connections=1024, keepalive_expiry=60.0
                    )
                    self._http = httpx.Client(
                        base_url=self.url, timeout=self.timeout, headers=headers, limits=limits
                    )
                    self._pid = os.getpid()
        return self._http

    def post_encoded(self, path: str, body: bytes) -> Any:
        """One ``POST`` of an already JSON-encoded body (the outbox's batches, encoded once so a
        spill writes the same bytes), without retries; the server's answer, or the
        client's errors."""
        return self._call("POST", path, body=body)

    def _call(
        self,
        method: str,
        path: str,
        payload: object = None,
        extra_wait: float = 0.0,
        body: bytes | None = None,
    ) -> Any:
        import httpx

        content = (
            body
            if body is not None
            else None
            if payload is None
            else json.dumps(payload, ensure_ascii=False).encode()
        )
        headers = None if content is None else {"Content-Type": "application/json"}
        try:
            resp = self._client().request(
                method, path, content=content, headers=headers, timeout=self.timeout + extra_wait
            )
        except httpx.HTTPError as exc:
            raise ExperienceUnavailable(
                f"experience server {self.url}{path} unreachable: {type(exc).__name__}: {exc}"
            ) from exc
        status = resp.status_code
        if status < 400:
            return resp.json()
        if (
            status in (503, 507) and "Retry-After" in resp.headers
        ):  # a write refused for a storage fault
            raise StorageFault(
                f"experience server {self.url}{path} refused the write ({status}): {_detail(resp)}",
                cause=_detail(resp).partition(":")[0],
                status=status,
            )
        if status >= 500:
            raise ExperienceUnavailable(
                f"experience server {self.url}{path} failed ({status}): {resp.text[:500]}"
            )
        detail = _detail(resp)
        if status == 401:
            need = (
                "a wrong token was sent"
                if self.token
                else f"no token was sent (set {TOKEN_ENV} or pass token=)"
            )
            raise ExperienceAuthError(
                f"experience server {self.url}{path} refused the call (401): {need}; server "
                f"said: {detail}"
            )
        if status == 409:
            raise StepOrderError(detail)
        # A 4xx is our bug or bad input, not an outage: say which field the server rejected.
        raise Rejected(
            f"experience server {self.url}{path} rejected the request ({status}): {detail}", detail
        )

    def _send_searches(self, queries: list[str]) -> list[ExperienceRef | None]:
        if len(queries) == 1:  # /search: the server coalesces it with other processes' searches
            return [
                ExperienceRef.from_dict(
                    self._call("POST", "/search", {"query": queries[0]})["entry"]
                )
            ]
        return self._search_many(queries)

    def _search_many(self, queries: list[str]) -> list[ExperienceRef | None]:
        # calls of at most MAX_BATCH queries (and ~1 M characters): the server refuses larger ones
        per_call = max(1, min(MAX_BATCH, (1 << 20) // self.max_query_chars))
        refs: list[ExperienceRef | None] = []
        for i in range(0, len(queries), per_call):
            out = self._call("POST", "/search_many", {"queries": queries[i : i + per_call]})[
                "entries"
            ]
            refs += [ExperienceRef.from_dict(d) for d in out]
        return refs

    def search(self, query: str) -> ExperienceRef | None:
        result: ExperienceRef | None = self._here()[0](str(query)[: self.max_query_chars])
        return result

    def search_many(self, queries: list[str]) -> list[ExperienceRef | None]:
        if not queries:
            return []
        return self._search_many([str(q)[: self.max_query_chars] for q in queries])

    def ask(self, query: str, entry: ExperienceRef, context: str) -> tuple[str, JSONInput | None]:
        body = {
            "query": str(query)[:MAX_TEXT],
            "entry": entry.to_dict(),
            "context": str(context)[:MAX_TEXT],
        }
        out = self._call("POST", "/ask", body)
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
        check_request_size(
            request, self.max_request_bytes
        )  # it could never be delivered: say so now
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
        out = self._call(
            "POST", "/get_requests", {"max_n": max_n, "timeout": timeout}, extra_wait=timeout
        )
        got = []
        for i, d in enumerate(out.get("requests") or []):
            try:
                got.append(DistillationRequest.from_dict(d))
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                self.malformed_requests += 1
                logger.error(
                    "%s: skipping malformed request %d of %d (%s: %s): %.200r",
                    self.url,
                    i,
                    len(out["requests"]),
                    type(exc).__name__,
                    exc,
                    d,
                )
        return got

    def end_step(self, step: int, bonus: dict[str, float] | None = None) -> StepEnded:
        """:meth:`flush`, then close the step: the server counts and credits the step's requests
        only once it has them. A flush error is raised before the step is closed (it stays open:
        call ``end_step`` again to close it without the spilled requests). Only this process's
        buffer is flushed: over ``AsyncVectorEnv`` workers, each with its own copy of the client,
        use :func:`crl_gym.wrappers.vector.end_step` (it flushes every worker, then calls this)."""
        body = {
            "step": check_step(step),
            "bonus": None if bonus is None else {str(k): float(v) for k, v in bonus.items()},
        }
        self.flush()
        return StepEnded.from_dict(self._call("POST", "/end_step", body))

    def apply_ops(self, ops: Sequence[ExperienceOp], *, step: int | None = None) -> OpsApplied:
        """Apply ``ops`` on the server, as one write with an id of its own: a call the server could
        not take (unreachable, a 5xx, a full disk) is sent again with the same id, up to ``retries``
        times, so it lands once whether or not an earlier try did (``repeated`` in the answer says
        that an earlier try had). Raises :class:`ExperienceUnavailable` (:class:`StorageFault` for
        a storage fault) once the retries are used up."""
        body = {"ops": [op_to_dict(op) for op in ops], "step": step, "write_id": uuid.uuid4().hex}
        for attempt in range(self.retries + 1):
            try:
                return OpsApplied.from_dict(self._call("POST", "/apply_ops", body))
            except ExperienceUnavailable:
                if attempt == self.retries:
                    raise
                time.sleep(min(self.retry_backoff_s * 2**attempt, 5.0))
        raise AssertionError("unreachable")

    # -- bank administration (see docs/service.md) ---------------------------------------------
    def snapshot_bank(self, name: str | None = None) -> SnapshotInfoDict:
        """Snapshot the server's bank as ``name`` (default: the time); returns the
        snapshot's description."""
        out: SnapshotInfoDict = self._call("POST", "/snapshot", {"name": name})
        return out

    def bank_snapshots(self) -> list[SnapshotInfoDict]:
        """The server's bank snapshots, newest first."""
        return list(self._call("GET", "/snapshots")["snapshots"])

    def restore_bank(self, name: str) -> RestoredDict:
        """Make the server's bank the snapshot ``name`` (the state before is kept as a snapshot)."""
        out: RestoredDict = self._call("POST", "/restore", {"name": name})
        return out

    def quarantine(
        self, written_by: str, steps: str = ":", *, undo: bool = False
    ) -> QuarantinedDict:
        """Hide (``undo``: bring back) what ``written_by`` wrote at steps ``"A:B"`` on
        the server."""
        out: QuarantinedDict = self._call(
            "POST", "/quarantine", {"written_by": written_by, "steps": steps, "undo": undo}
        )
        return out

    def stats(self) -> ServiceStats:
        return ServiceStats.from_dict(self._call("GET", "/stats"))

    def health(self) -> Health:
        return Health.from_dict(self._call("GET", "/health"))

    def close(self) -> None:
        """Flush, stop the sender thread and close the connection pool. What could not be
        delivered is logged (it is in the spill file), not raised: call :meth:`flush` first to
        get the error. The client may be used again (all of it restarts lazily)."""
        box = self._box
        if box.pid == os.getpid():
            try:
                box.flush()
            except (
                ExperienceUnavailable,
                ValueError,
            ) as exc:  # ExperienceAuthError is a ValueError
                logger.error("%s: close: %s", self.url, exc)
            box.stop(self.timeout)
        if self._http is not None and self._pid == os.getpid():
            self._http.close()
        self._http = None

    # the counters of earlier releases (DeprecationWarning): read submit_counts instead
    buffered = submit_count_property("buffered")
    delivered = submit_count_property("delivered")
    rejected = submit_count_property("rejected")
    submit_failures = submit_count_property("submit_failures")
    spilled = submit_count_property("spilled")
    lost = submit_count_property("lost")


def _detail(resp: httpx.Response) -> str:
    """The server's error message: FastAPI's ``detail`` (a string, or pydantic's error list)."""
    try:
        detail = resp.json().get("detail")
    except (ValueError, AttributeError):
        return str(resp.text[:500])
    if isinstance(detail, str):
        return detail
    return json.dumps(detail, ensure_ascii=False)[:1000]


__all__ = ["RemoteClient"]
