"""The experience bank explorer: web pages to read a bank next to its training signal.

``crl-experience serve`` serves them at ``/ui`` beside its other routes (:func:`mount_explorer`,
called by :func:`crl_gym.server.create_app`); ``crl-experience ui --bank DIR`` serves them alone,
read-only, for a bank or run directory (:func:`explorer_app`). docs/explorer.md describes the
pages and their JSON routes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.params import Depends

from crl_gym.explorer.routes import PREFIX, mount_explorer
from crl_gym.explorer.source import BankSource, find_bank

if TYPE_CHECKING:
    from crl_gym.experience.service import RetrievalService


def mount_service_explorer(
    app: FastAPI, service: RetrievalService, dependencies: list[Depends] | None = None
) -> None:
    """The explorer of a running service's bank on its app (closed with the app's service)."""
    source = BankSource.live(service)
    app.state.explorer = source
    mount_explorer(app, source, dependencies)


def explorer_app(source: BankSource, dependencies: list[Depends] | None = None) -> FastAPI:
    """An app serving only the explorer of ``source`` (and ``/health``): no route writes."""
    app = FastAPI(
        title="crl experience bank explorer", docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.explorer = source

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "read_only": source.read_only}

    mount_explorer(app, source, dependencies)
    return app


__all__ = [
    "PREFIX",
    "BankSource",
    "explorer_app",
    "find_bank",
    "mount_explorer",
    "mount_service_explorer",
]
