"""HTTP front of an ``ExperienceManager`` (FastAPI), and the ``crl-experience`` command.

Envs in other processes (Gymnasium ``AsyncVectorEnv`` workers), other RL libraries or other
languages share one bank through it; :class:`crl_gym.clients.RemoteClient` is the Python client.
Every route delegates to :class:`crl_gym.clients.LocalClient`, so local and remote behave the same.

Routes (JSON): ``POST /search {query}`` → ``{entry}``, ``POST /search_many {queries}`` →
``{entries}``, ``POST /ask {query, entry, context}`` → ``{answer, provenance}``,
``POST /submit {requests: [...]}`` → ``{accepted}``, ``POST /get_requests {max_n, timeout}`` →
``{requests}``, ``GET /stats``, ``GET /health``. A malformed body is answered 422 naming the field.

Start it with ``crl-experience serve --bank DIR --port 8765 [--embedder hashing:384]``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import click
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

from crl_gym.clients import LocalClient
from crl_gym.protocol import DistillationRequest, ExperienceRef

logger = logging.getLogger(__name__)

MAX_BATCH = 4096
"""Most queries / requests accepted in one call (bounded memory per request)."""


class SearchBody(BaseModel):
    query: str


class SearchManyBody(BaseModel):
    queries: list[str] = Field(max_length=MAX_BATCH)


class EntryBody(BaseModel):
    id: int = Field(ge=0, lt=2**64)
    text: str
    version: int = 0


class AskBody(BaseModel):
    query: str
    entry: EntryBody
    context: str = ""


class SubmitBody(BaseModel):
    requests: list[dict[str, Any]] = Field(max_length=MAX_BATCH)


class GetRequestsBody(BaseModel):
    max_n: int = Field(default=16, ge=1, le=MAX_BATCH)
    timeout: float = Field(default=0.0, ge=0.0, le=60.0)


def create_app(manager: Any) -> FastAPI:
    """A FastAPI app serving ``manager``. Routes are sync (FastAPI runs them in its thread
    pool), so the manager's own batching and reader/writer lock see concurrent callers."""
    client = LocalClient(manager)
    app = FastAPI(title="crl experience server", version="1")
    app.state.manager = manager

    @app.get("/health")
    def health() -> dict[str, Any]:
        return client.health()

    @app.get("/stats")
    def stats() -> dict[str, Any]:
        return _jsonable_stats(client.stats())

    @app.post("/search")
    def search(body: SearchBody) -> dict[str, Any]:
        ref = client.search(body.query)
        return {"entry": ref.to_dict() if ref is not None else None}

    @app.post("/search_many")
    def search_many(body: SearchManyBody) -> dict[str, Any]:
        refs = client.search_many(body.queries)
        return {"entries": [r.to_dict() if r is not None else None for r in refs]}

    @app.post("/ask")
    def ask(body: AskBody) -> dict[str, Any]:
        entry = ExperienceRef(id=body.entry.id, text=body.entry.text, version=body.entry.version)
        answer, provenance = client.ask(body.query, entry, body.context)
        return {"answer": answer, "provenance": provenance}

    @app.post("/submit")
    def submit(body: SubmitBody) -> dict[str, Any]:
        # Parse every request before queueing any: a bad one rejects the call as a whole, so
        # the client keeps (and can retry) the batch instead of losing part of it.
        parsed = []
        for i, d in enumerate(body.requests):
            try:
                parsed.append(DistillationRequest.from_dict(d))
            except (KeyError, TypeError, ValueError) as exc:
                raise HTTPException(status_code=422, detail=f"requests[{i}]: {type(exc).__name__}: {exc}") from exc
        for req in parsed:
            client.submit(req)
        return {"accepted": len(parsed)}

    @app.post("/get_requests")
    def get_requests(body: GetRequestsBody) -> dict[str, Any]:
        return {"requests": [r.to_dict() for r in client.get_requests(body.max_n, body.timeout)]}

    return app


def _jsonable_stats(stats: dict[str, Any]) -> dict[str, Any]:
    from crl_gym.protocol import _jsonable

    return dict(_jsonable(stats))


class BackgroundServer:
    """A uvicorn server for ``manager`` on a daemon thread of this process.

    Lets a trainer that owns the manager serve it to its ``AsyncVectorEnv`` workers (and lets
    tests run a real server). ``port=0`` picks a free port; ``url`` tells which.

    >>> from crl_gym.experience.bank import ExperienceBank
    >>> from crl_gym.experience.embedders import HashingEmbedder
    >>> from crl_gym.experience.manager import ExperienceManager
    >>> from crl_gym.clients import RemoteClient
    >>> manager = ExperienceManager(ExperienceBank(None, dim=32), HashingEmbedder(32))
    >>> with BackgroundServer(manager) as server:
    ...     RemoteClient(server.url).health()["status"]
    'ok'
    >>> manager.close()
    """

    def __init__(self, manager: Any, host: str = "127.0.0.1", port: int = 0, startup_timeout: float = 30.0) -> None:
        import threading
        import time

        import uvicorn

        config = uvicorn.Config(create_app(manager), host=host, port=port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="crl-experience-server", daemon=True)
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

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def build_manager(bank_dir: str | Path, embedder: str | None) -> Any:
    """Open (or create) the bank in ``bank_dir`` and an ``ExperienceManager`` over it."""
    from crl_gym.experience.bank import ExperienceBank
    from crl_gym.experience.embedders import load_embedder
    from crl_gym.experience.manager import ExperienceManager

    emb = load_embedder(embedder)
    bank = ExperienceBank(Path(bank_dir), dim=emb.dim)
    return ExperienceManager(bank, emb)


@click.group()
def cli() -> None:
    """Experience bank tools."""


@cli.command()
@click.option("--bank", "bank_dir", required=True, type=click.Path(file_okay=False), help="Bank directory (created if missing).")
@click.option("--port", default=8765, show_default=True, type=click.IntRange(0, 65535), help="TCP port.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind (0.0.0.0 for all).")
@click.option("--embedder", default=None, help="'default' (bundled MiniLM), 'hashing:DIM', or a sentence-transformers id/path.")
@click.option("--log-level", default="info", show_default=True, type=click.Choice(["debug", "info", "warning", "error"]))
def serve(bank_dir: str, port: int, host: str, embedder: str | None, log_level: str) -> None:
    """Serve the experience bank in BANK over HTTP for RemoteClient."""
    import uvicorn

    try:
        manager = build_manager(bank_dir, embedder)
    except ValueError as exc:  # e.g. the bank was made with another embedding dim
        raise click.ClickException(str(exc)) from exc
    click.echo(f"crl-experience: serving {bank_dir} on http://{host}:{port}", err=True)
    try:
        uvicorn.run(create_app(manager), host=host, port=port, log_level=log_level)
    finally:
        manager.close()
        manager.bank.close()


if __name__ == "__main__":  # pragma: no cover
    cli()
