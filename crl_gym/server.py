"""HTTP face of the experience service: the FastAPI app (:func:`create_app`) and
:class:`BackgroundServer`.

Envs in other processes (Gymnasium ``AsyncVectorEnv`` workers), other RL libraries or other
languages share one service through it; :class:`crl_gym.clients.RemoteClient` is the Python
client. Every route delegates to one :class:`~crl_gym.experience.service.RetrievalService` (or a
subclass such as ``crl_train.service.ExperienceService``), so local and remote behave the same.

Routes (JSON): ``POST /search {query}`` → ``{entry}``, ``POST /search_many {queries}`` →
``{entries}``, ``POST /ask {query, entry, context}`` → ``{answer, provenance}``,
``POST /submit {requests: [...]}`` → ``{accepted}``, ``POST /get_requests {max_n, timeout}`` →
``{requests}``, ``POST /end_step {step, bonus}`` → ``{step, ended, requests, credited}`` (409 for a
step already ended), ``POST /apply_ops {ops, step}`` → ``{added, added_ids, updated, deleted,
returned, malformed, repeated}`` (``write_id``: applied at most once), ``POST /snapshot {name}``,
``GET /snapshots``, ``POST /restore {name}``, ``POST /quarantine {written_by, steps, undo}``,
``GET /stats``, ``GET /health`` (``storage``: the storage fault writes meet now, if any). A write
that cannot be made durable is refused with 507 (space ran out) or 503 (an I/O error, a read-only
file system), its detail naming the cause, and applied nowhere; see docs/service.md. A malformed
body is answered 422 naming the field, a body above ``--max-body-bytes`` 413 before it is parsed
(the limits, and how the clients keep within them, are in :mod:`crl_gym.limits`); lone surrogates in
texts are replaced by U+FFFD, and a query that fails in a coalesced batch fails only its own caller.
With a token, every route but ``/health`` needs ``Authorization: Bearer <token>`` (else 401).

Start it with ``crl-experience serve --bank DIR --port 8765 [--embedder hashing:384]
[--extractor tiny|CONFIG.yaml] [--token-file FILE] [--max-body-bytes N] [--persist-interval S]``
(the command lives in :mod:`crl_gym.cli`), or on a thread of this process with
:class:`BackgroundServer`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
from collections.abc import Callable, Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Annotated, Any, Literal

import uvicorn
from anyio import to_thread
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, BeforeValidator, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Send

from crl_gym.clients import as_service
from crl_gym.errors import StorageFault
from crl_gym.experience.batching import BatchLine, answer
from crl_gym.experience.manager import ExperienceManager
from crl_gym.experience.origin import Writer, parse_steps
from crl_gym.experience.service import RetrievalService, StepOrderError
from crl_gym.explorer import mount_service_explorer
from crl_gym.json_limits import json_shape, quick_bound
from crl_gym.limits import MAX_BATCH, MAX_BODY_BYTES, MAX_TEXT
from crl_gym.protocol import DistillationRequest, ExperienceRef, _jsonable, op_from_dict

logger = logging.getLogger(__name__)

KEEP_ALIVE_S = 75
"""Idle seconds a client connection is kept (clients keep one per concurrent caller)."""
MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays / objects a body may have (the deepest route body needs about 8)."""
MAX_JSON_ITEMS = 1 << 20
"""Most JSON containers plus commas in one body (a full 4 MiB submit of episodes holds ~10^5)."""
_SCAN_IN_THREAD = 64 * 1024
"""Bodies at least this long are measured off the event loop (a 4 MiB scan takes ~0.1 s)."""
BACKLOG = 4096
"""Pending TCP connections the listening socket holds (1,024 clients may connect at once)."""
_SURROGATE = re.compile("[\ud800-\udfff]")


def clean_text(s: str) -> str:
    """``s`` with lone surrogates (valid JSON escapes, but not encodable as UTF-8) replaced
    by U+FFFD.

    Left in, they fail the embedder, the spill file or the response encoder: a 500 for one
    caller, or a failed batch for every caller sharing it."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", s)


def clean_json(value: object) -> object:
    """``value`` (parsed JSON) with :func:`clean_text` applied to every string, keys included."""
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, list):
        return [clean_json(v) for v in value]
    if isinstance(value, dict):
        return {clean_text(str(k)): clean_json(v) for k, v in value.items()}
    return value


def renderable(value: object) -> object:
    """``value`` (an error's payload) ready for a strict JSON encoder: texts cleaned, and each
    non-finite float (``inf``, ``nan``: not JSON) replaced by its name as a string."""
    if isinstance(value, float):
        return (
            value if value == value and value not in (float("inf"), float("-inf")) else repr(value)
        )
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, (list, tuple)):
        return [renderable(v) for v in value]
    if isinstance(value, dict):
        return {clean_text(str(k)): renderable(v) for k, v in value.items()}
    return value


ID = Annotated[int, Field(ge=0, lt=2**64)]
STEP_LIMIT = 2**63
"""Steps are stored as SQLite INTEGERs (signed 64-bit): a larger one is refused at the boundary."""
Clean = BeforeValidator(
    lambda v: clean_text(v) if isinstance(v, str) else v
)  # before: pydantic refuses them
Text = Annotated[str, Field(max_length=MAX_TEXT), Clean]


class SearchBody(BaseModel):
    query: Text


class SearchManyBody(BaseModel):
    queries: list[Text] = Field(max_length=MAX_BATCH)


class EntryBody(BaseModel):
    id: ID
    text: Text
    version: int = Field(default=0, ge=0)


class AskBody(BaseModel):
    query: Text
    entry: EntryBody
    context: Text = ""


class SubmitBody(BaseModel):
    requests: list[dict[str, Any]] = Field(max_length=MAX_BATCH)

    @field_validator("requests", mode="before")
    @classmethod
    def _clean(cls, v: object) -> object:
        return clean_json(v)


class GetRequestsBody(BaseModel):
    max_n: int = Field(default=16, ge=1, le=MAX_BATCH)
    timeout: float = Field(default=0.0, ge=0.0, le=60.0)


class EndStepBody(BaseModel):
    step: int = Field(ge=0, lt=STEP_LIMIT, strict=True)
    bonus: dict[Annotated[str, Clean], Annotated[float, Field(allow_inf_nan=False)]] | None = Field(
        default=None, max_length=16 * MAX_BATCH
    )


class AddOpBody(BaseModel):
    kind: Literal["add"]
    text: Annotated[str, Field(min_length=1, max_length=MAX_TEXT), Clean]
    tags: list[Annotated[str, Field(max_length=256), Clean]] = Field(
        default_factory=list, max_length=64
    )


class UpdateOpBody(BaseModel):
    kind: Literal["update"]
    id: ID
    text: Annotated[str, Field(min_length=1, max_length=MAX_TEXT), Clean]


class DeleteOpBody(BaseModel):
    kind: Literal["delete"]
    id: ID


class ReturnOpBody(BaseModel):
    kind: Literal["return"]
    reason: Annotated[str, Field(max_length=MAX_TEXT), Clean] = ""
    malformed: bool = False


OpBody = Annotated[
    AddOpBody | UpdateOpBody | DeleteOpBody | ReturnOpBody, Field(discriminator="kind")
]


WriteId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")]


class ApplyOpsBody(BaseModel):
    ops: list[OpBody] = Field(max_length=MAX_BATCH)
    step: int | None = Field(default=None, ge=0, lt=STEP_LIMIT)
    write_id: WriteId | None = None
    """The client's id of this call: a resend with the same id is answered, not applied again."""


class SnapshotBody(BaseModel):
    name: Annotated[str, Field(max_length=100)] | None = None


class RestoreBody(BaseModel):
    name: Annotated[str, Field(min_length=1, max_length=100)]


class QuarantineBody(BaseModel):
    written_by: Writer
    steps: Annotated[str, Field(max_length=64)] = ":"
    undo: bool = False


def _json(payload: object) -> Response:
    """A JSON response encoded once with the stdlib (FastAPI's own path validates and
    re-walks it)."""
    return Response(
        json.dumps(payload, ensure_ascii=False, allow_nan=False).encode(),
        media_type="application/json",
    )


class SearchCoalescer:
    """Gathers concurrent ``/search`` calls into ``service.search_many`` batches run off the loop.

    One thread hop per batch instead of one per call (and no cap of the default thread pool
    on how many searches wait at once): the calls that arrive while a batch runs form the next
    one, so 1,024 simultaneous searchers cost a few batched embedding passes, as they do in
    process through the manager's own batcher. ``search_many`` re-ranks per requester, so K
    callers with one task text still get different entries.
    """

    def __init__(
        self, service: RetrievalService, max_batch: int = 1024, max_inflight: int = 2
    ) -> None:
        self.service = service
        self.max_batch, self.max_inflight = int(max_batch), int(max_inflight)
        self._line: BatchLine[tuple[str, asyncio.Future[ExperienceRef | None]]] = BatchLine(
            self.max_batch, max_inflight=self.max_inflight
        )
        self._scheduled = False
        self._pool = ThreadPoolExecutor(
            max_workers=self.max_inflight, thread_name_prefix="crl-http-search"
        )

    async def search(self, query: str) -> ExperienceRef | None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[ExperienceRef | None] = loop.create_future()
        self._line.put((query, fut))
        if not self._scheduled and self._line.inflight < self.max_inflight:
            self._scheduled = True  # dispatch after this loop pass: calls read in it join the batch
            loop.call_soon(self._dispatch, loop)
        return await fut

    def _dispatch(self, loop: asyncio.AbstractEventLoop) -> None:
        self._scheduled = False
        while (batch := self._line.start()) is not None:
            job = self._pool.submit(self._search_batch, [q for q, _ in batch])
            job.add_done_callback(partial(self._wake, loop, batch))

    def _search_batch(self, queries: list[str]) -> list[ExperienceRef | None | BaseException]:
        """One ``search_many`` for the batch, each query alone if it fails (:func:`answer`,
        isolated), so that one bad query fails only its own caller."""
        return answer(self.service.search_many, queries, isolate=True)

    def _wake(
        self,
        loop: asyncio.AbstractEventLoop,
        batch: list[tuple[str, asyncio.Future[Any]]],
        job: Future[Any],
    ) -> None:
        loop.call_soon_threadsafe(self._done, loop, batch, job)  # runs in the search thread

    def _done(
        self,
        loop: asyncio.AbstractEventLoop,
        batch: list[tuple[str, asyncio.Future[Any]]],
        job: Future[Any],
    ) -> None:
        self._line.release()
        exc = job.exception()
        refs = job.result() if exc is None else [None] * len(batch)
        for (_, fut), ref in zip(batch, refs, strict=True):
            if fut.done():  # the caller went away
                continue
            if exc is not None:
                fut.set_exception(exc)
            elif isinstance(ref, BaseException):
                fut.set_exception(ref)
            else:
                fut.set_result(ref)
        if self._line.waiting:
            self._dispatch(loop)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def check_token(token: str) -> str:
    """``token`` if it can travel in an ``Authorization`` header, else a ``ValueError``
    saying why."""
    if not token or any(c.isspace() or not c.isprintable() or ord(c) > 126 for c in token):
        raise ValueError("the token must be non-empty printable ASCII without spaces")
    return token


def _bearer(token: str) -> Callable[[Request], Coroutine[Any, Any, None]]:
    expected = f"Bearer {check_token(token)}".encode("ascii")

    async def require_token(
        request: Request,
    ) -> None:  # async: a sync one costs a thread hop per call
        got = request.headers.get("authorization", "").encode("latin-1", "replace")
        if not secrets.compare_digest(got, expected):
            raise HTTPException(
                status_code=401,
                detail="missing or wrong bearer token (send 'Authorization: Bearer <token>')",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return require_token


class BodyLimit:
    """ASGI middleware: a request body above ``max_bytes`` is answered 413 before anything
    parses it.

    A declared ``Content-Length`` above the limit is refused at once; a chunked (or lying) body is
    counted as it streams in and refused as soon as it passes the limit, so one client cannot make
    the server buffer and parse an arbitrarily large JSON document while others wait. A complete
    body nested deeper than ``max_depth`` is answered 400, one with more than ``max_items`` JSON
    items 413, both measured on the raw bytes (:mod:`crl_gym.json_limits`) before the parser
    recurses into it.
    """

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int = MAX_BODY_BYTES,
        max_depth: int = MAX_JSON_DEPTH,
        max_items: int = MAX_JSON_ITEMS,
    ) -> None:
        self.app, self.max_bytes = app, int(max_bytes)
        self.max_depth, self.max_items = int(max_depth), int(max_items)

    async def __call__(
        self, scope: dict[str, Any], receive: Callable[[], Any], send: Callable[[Any], Any]
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                if not value.strip().isdigit():
                    await _refuse(send, 400, "bad Content-Length header")
                    return
                if int(value) > self.max_bytes:
                    await _refuse(
                        send,
                        413,
                        f"request body of {int(value)} bytes is above the limit of "
                        f"{self.max_bytes}",
                    )
                    return
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before sending its body
            body = message.get("body", b"")
            total += len(body)
            if total > self.max_bytes:
                await _refuse(
                    send, 413, f"request body is above the limit of {self.max_bytes} bytes"
                )
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        refusal = await self._shape_refusal(b"".join(chunks))
        if refusal is not None:
            await _refuse(send, *refusal)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _shape_refusal(self, body: bytes) -> tuple[int, str] | None:
        """``(status, detail)`` for a body too deep or with too many items, else ``None``."""
        openers, items = quick_bound(body)
        if openers <= self.max_depth and items <= self.max_items:
            return None  # the common case: two byte counts, no scan
        if len(body) >= _SCAN_IN_THREAD:
            depth, items = await to_thread.run_sync(json_shape, body)
        else:
            depth, items = json_shape(body)
        if depth > self.max_depth:
            return (
                400,
                f"request body: JSON nesting {depth} levels deep is above the limit of "
                f"{self.max_depth}",
            )
        if items > self.max_items:
            return 413, f"request body: {items} JSON items are above the limit of {self.max_items}"
        return None


async def _refuse(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class GuardedRoute(APIRoute):
    """A route that answers the service's own errors itself: 409 for a ``StepOrderError``, 500
    (logged) for anything else. Left to uvicorn, an exception closes the kept-alive connection,
    and the client's next call on it would fail as if the server were down."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except (StarletteHTTPException, RequestValidationError):
                raise  # HTTP answers with their own status (the body parser raises Starlette's own)
            except StepOrderError as exc:
                return JSONResponse(status_code=409, content={"detail": str(exc)})
            except (
                StorageFault
            ) as exc:  # refused and applied nowhere: the client keeps it and resends
                return JSONResponse(
                    status_code=exc.status,
                    content={"detail": str(exc)},
                    headers={"Retry-After": "5"},
                )
            except Exception as exc:  # noqa: BLE001 - reported to the client as a 5xx
                logger.exception("experience server: %s failed", request.url.path)
                return JSONResponse(
                    status_code=500, content={"detail": f"{type(exc).__name__}: {exc}"}
                )

        return guarded


def create_app(
    service: RetrievalService | ExperienceManager,
    token: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    """A FastAPI app serving ``service`` (an ``ExperienceManager`` is wrapped in a
    RetrievalService).

    With ``token``, every route except ``/health`` needs ``Authorization: Bearer <token>``.
    ``/search`` is async and coalesced (:class:`SearchCoalescer`); the other routes are sync
    (FastAPI's thread pool), so the service's locks see concurrent callers as in process.
    """
    svc = as_service(service)
    app = FastAPI(title="crl experience server", version="2")
    app.state.service = svc
    app.state.manager = svc.manager
    coalescer = SearchCoalescer(svc)
    app.state.coalescer = coalescer
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        # FastAPI's own handler echoes the input, and an input it could not encode made it a 500
        return JSONResponse(
            status_code=422, content={"detail": renderable(jsonable_encoder(exc.errors()))}
        )

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # every HTTP exception, Starlette's (404, 405, a body that cannot be read) and FastAPI's,
        # keeps its status
        return JSONResponse(
            status_code=exc.status_code,
            content={"detail": renderable(exc.detail)},
            headers=getattr(exc, "headers", None),
        )

    open_routes = APIRouter(route_class=GuardedRoute)
    router = APIRouter(
        route_class=GuardedRoute,
        dependencies=[Depends(_bearer(token))] if token is not None else [],
    )

    @open_routes.get("/health")
    def health() -> Response:
        return _json(_jsonable(svc.health().to_dict()))

    @router.get("/stats")
    def stats() -> Response:
        return _json(_jsonable(svc.stats().to_dict()))

    @router.post("/search")
    async def search(body: SearchBody) -> Response:
        ref = await coalescer.search(body.query)
        return _json({"entry": ref.to_dict() if ref is not None else None})

    @router.post("/search_many")
    def search_many(body: SearchManyBody) -> Response:
        refs = svc.search_many(body.queries)
        return _json({"entries": [r.to_dict() if r is not None else None for r in refs]})

    @router.post("/ask")
    def ask(body: AskBody) -> Response:
        entry = ExperienceRef(id=body.entry.id, text=body.entry.text, version=body.entry.version)
        answer, provenance = svc.ask(body.query, entry, body.context)
        return _json({"answer": answer, "provenance": _jsonable(provenance)})

    @router.post("/submit")
    def submit(body: SubmitBody) -> Response:
        # Parse every request before queueing any: a bad one rejects the call as a whole, so
        # the client keeps (and can retry) the batch instead of losing part of it.
        parsed = []
        for i, d in enumerate(body.requests):
            try:
                parsed.append(DistillationRequest.from_dict(d))
            except (KeyError, TypeError, ValueError) as exc:
                raise HTTPException(
                    status_code=422, detail=f"requests[{i}]: {type(exc).__name__}: {exc}"
                ) from exc
        # on disk (fsynced) before the answer, or refused with none of them queued; a request whose
        # request_id came before (a resend) is answered as accepted and not queued again
        new = svc.submit_many(parsed, durable=True)
        return _json({"accepted": len(parsed), "new": new})

    @router.post("/get_requests")
    def get_requests(body: GetRequestsBody) -> Response:
        return _json(
            {"requests": [r.to_dict() for r in svc.get_requests(body.max_n, body.timeout)]}
        )

    @router.post("/end_step")
    def end_step(body: EndStepBody) -> Response:
        return _json(_jsonable(svc.end_step(body.step, body.bonus).to_dict()))

    @router.post("/apply_ops")
    def apply_ops(body: ApplyOpsBody) -> Response:
        ops = [op_from_dict(op.model_dump()) for op in body.ops]
        try:
            result = svc.apply_ops(ops, step=body.step, write_id=body.write_id)
        except (
            ValueError
        ) as exc:  # the bank refused an op's content (a text the embedder maps to zero)
            raise HTTPException(status_code=422, detail=f"ops: {exc}") from exc
        return _json(_jsonable(result.to_dict()))

    @router.post("/snapshot")
    def snapshot(body: SnapshotBody) -> Response:
        try:
            return _json(svc.snapshot_bank(body.name).to_dict())
        except (ValueError, FileExistsError) as exc:
            raise HTTPException(
                status_code=422 if isinstance(exc, ValueError) else 409, detail=f"name: {exc}"
            ) from exc

    @router.get("/snapshots")
    def snapshots() -> Response:
        return _json({"snapshots": [s.to_dict() for s in svc.bank_snapshots()]})

    @router.post("/restore")
    def restore(body: RestoreBody) -> Response:
        try:
            before = svc.restore_bank(body.name)
        except (ValueError, FileNotFoundError) as exc:
            raise HTTPException(
                status_code=422 if isinstance(exc, ValueError) else 404, detail=f"name: {exc}"
            ) from exc
        return _json(
            {"restored": body.name, "before": before.to_dict(), "bank_size": len(svc.manager.bank)}
        )

    @router.post("/quarantine")
    def quarantine(body: QuarantineBody) -> Response:
        try:
            steps = parse_steps(body.steps)
        except ValueError as exc:
            raise HTTPException(status_code=422, detail=f"steps: {exc}") from exc
        ids = svc.quarantine(body.written_by, steps, undo=body.undo)
        return _json({"undo": body.undo, "entries": ids, "bank_size": len(svc.manager.bank)})

    app.include_router(open_routes)
    app.include_router(router)
    mount_service_explorer(app, svc, router.dependencies)  # the read-only bank explorer at /ui
    return app


class BackgroundServer:
    """A uvicorn server for a service (or a bare manager) on a daemon thread of this process.

    Lets a trainer that owns the service serve it to its ``AsyncVectorEnv`` workers (and lets
    tests run a real server). ``port=0`` picks a free port; ``url`` tells which. Stopping the
    server does not close the service: it belongs to the caller.

    >>> from crl_gym.experience.bank import ExperienceBank
    >>> from crl_gym.experience.embedders import HashingEmbedder
    >>> from crl_gym.experience.manager import ExperienceManager
    >>> from crl_gym.clients import RemoteClient
    >>> manager = ExperienceManager(ExperienceBank(None, dim=32), HashingEmbedder(32))
    >>> service = RetrievalService(manager)
    >>> with BackgroundServer(service, token="s3cret") as server:
    ...     RemoteClient(server.url, token="s3cret").end_step(0).ended
    [0]
    >>> service.close()
    """

    def __init__(
        self,
        service: RetrievalService | ExperienceManager,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        startup_timeout: float = 30.0,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        import threading
        import time

        self.app = create_app(service, token, max_body_bytes)
        config = uvicorn.Config(
            self.app,
            host=host,
            port=port,
            log_level="warning",
            lifespan="off",
            timeout_keep_alive=KEEP_ALIVE_S,
            backlog=BACKLOG,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, name="crl-experience-server", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + startup_timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self._server.should_exit = True
                raise RuntimeError(f"experience server did not start on {host}:{port}")
            time.sleep(0.01)
        bound_port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{host}:{bound_port}"

    def stop(self, timeout: float = 10.0) -> None:
        """Ask uvicorn to exit and wait for the thread."""
        self._server.should_exit = True
        self._thread.join(timeout)
        self.app.state.coalescer.close()
        self.app.state.explorer.close()

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":  # pragma: no cover - ``python -m crl_gym.server`` still runs the command
    import runpy

    runpy.run_module("crl_gym.cli", run_name="__main__", alter_sys=True)
