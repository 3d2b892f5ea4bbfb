"""The explorer's routes: four HTML pages and the JSON (and SVG) routes they read, all
under ``/ui``.

Pages carry no bank data: each is a Jinja2 template (autoescaped) with its script, which asks
for the service's bearer token once (kept in ``sessionStorage``, i.e. for the tab only), sends it
as an ``Authorization`` header and writes every text into the page with ``textContent``. The
data routes sit behind the same dependency as the service's other routes, so a wrong token gets
a 401 and no data. Every route only reads. A strict Content-Security-Policy (scripts and styles
from this server only, images from it or blob URLs) is a second wall behind the escaping.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, FastAPI, HTTPException, Query, Request
from fastapi import Path as PathParam
from fastapi.params import Depends
from fastapi.responses import RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from crl_gym.experience.snapshots import list_snapshots
from crl_gym.explorer.episodes import EpisodeIndex
from crl_gym.explorer.plots import training_charts
from crl_gym.explorer.queries import (
    MAX_PER_PAGE,
    PREVIEW_CHARS,
    SORTS,
    PageQuery,
    entries_page,
    entry_detail,
    timeline,
)
from crl_gym.explorer.search import preview
from crl_gym.explorer.source import BankSource

HERE = Path(__file__).parent
PREFIX = "/ui"
MAX_QUERY = 2000
MAX_K = 32
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob:; connect-src "
    "'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
PAGES = ("bank", "entry", "search", "training")


def _json(payload: object) -> Response:
    body = json.dumps(payload, ensure_ascii=False, allow_nan=False).encode("utf-8", "replace")
    return Response(body, media_type="application/json", headers=_HEADERS)


def mount_explorer(
    app: FastAPI, source: BankSource, dependencies: list[Depends] | None = None
) -> None:
    """Serve the explorer of ``source`` on ``app`` at ``/ui``; ``dependencies`` guard the data
    routes (the service's bearer-token check)."""
    templates = Jinja2Templates(
        directory=str(HERE / "templates")
    )  # .html templates are autoescaped
    episodes = EpisodeIndex(source.run_dir)
    pages = APIRouter(prefix=PREFIX)
    api = APIRouter(prefix=f"{PREFIX}/api", dependencies=list(dependencies or []))

    def page(request: Request, name: str, **context: object) -> Response:
        return templates.TemplateResponse(
            request, f"{name}.html", {"page": name, "base": PREFIX, **context}, headers=_HEADERS
        )

    @pages.get("", include_in_schema=False)
    def root() -> Response:
        return RedirectResponse(f"{PREFIX}/bank")

    @pages.get("/bank", include_in_schema=False)
    def bank_page(request: Request) -> Response:
        return page(request, "bank", sorts=list(SORTS))

    @pages.get("/entry/{entry_id}", include_in_schema=False)
    def entry_page(request: Request, entry_id: int) -> Response:
        return page(request, "entry", entry_id=entry_id)

    @pages.get("/search", include_in_schema=False)
    def search_page(request: Request) -> Response:
        return page(request, "search", max_k=MAX_K)

    @pages.get("/training", include_in_schema=False)
    def training_page(request: Request) -> Response:
        return page(request, "training")

    @api.get("/summary")
    def summary() -> Response:
        n = int(source.query("SELECT count(*) FROM entries")[0][0])
        quarantined = (
            int(source.query("SELECT count(*) FROM entry_origin WHERE quarantined = 1")[0][0])
            if source.has_table("entry_origin")
            else 0
        )
        snapshots = [
            {"name": s.name, "created_at": s.created_at, "entries": s.entries}
            for s in (list_snapshots(source.bank_dir) if source.bank_dir else [])
        ]
        return _json(
            {
                "entries": n,
                "quarantined": quarantined,
                "snapshots": snapshots,
                "read_only": source.read_only,
                "embedder": source.embedder_name,
                "dim": source.dim,
                "bank_dir": str(source.bank_dir) if source.bank_dir else None,
                "run_dir": str(source.run_dir) if source.run_dir else None,
                "event_log": source.has_table("entry_events"),
                "episodes": episodes.available(),
                "search": source.searcher is not None,
            }
        )

    @api.get("/entries")
    def entries(
        sort: Annotated[str, Query(max_length=32)] = "id",
        order: Annotated[str, Query(pattern="^(asc|desc)$")] = "asc",
        page: Annotated[int, Query(ge=1, le=10**9)] = 1,
        per_page: Annotated[int, Query(ge=1, le=MAX_PER_PAGE)] = 50,
        q: Annotated[str, Query(max_length=MAX_QUERY)] = "",
        min_retrievals: Annotated[int, Query(ge=0, lt=2**63)] = 0,  # SQLite INTEGER: signed 64-bit
        step_min: Annotated[int | None, Query(ge=-(2**63), lt=2**63)] = None,
        step_max: Annotated[int | None, Query(ge=-(2**63), lt=2**63)] = None,
        credited: bool = False,
    ) -> Response:
        try:
            pq = PageQuery(
                sort, order, page, per_page, q, min_retrievals, step_min, step_max, credited
            )
        except ValueError as exc:
            raise HTTPException(422, str(exc)) from exc
        return _json(entries_page(source, pq))

    @api.get("/entries/{entry_id}")
    def entry(entry_id: Annotated[int, PathParam(ge=0, lt=2**63)]) -> Response:
        found = entry_detail(source, entry_id)
        if found is None:
            raise HTTPException(404, f"no entry {entry_id} in this bank, and none in its event log")
        found["episodes"] = episodes.for_entry(entry_id)
        return _json(found)

    @api.get("/search")
    def search(
        q: Annotated[str, Query(min_length=1, max_length=MAX_QUERY)],
        k: Annotated[int, Query(ge=1, le=MAX_K)] = 1,
    ) -> Response:
        if source.searcher is None:
            raise HTTPException(503, "this bank has no search")
        found = preview(source.searcher, q, k)
        ids = [c["id"] for c in found["candidates"]]
        if ids:
            texts = dict(
                source.query(
                    f"SELECT id, substr(text, 1, {PREVIEW_CHARS}) FROM entries "
                    f"WHERE id IN ({','.join('?' * len(ids))})",
                    ids,
                )
            )
            for c in found["candidates"]:
                c["text"] = texts.get(c["id"])
        found["query"] = q
        return _json(found)

    @api.get("/timeline")
    def training() -> Response:
        return _json(timeline(source))

    @api.get("/plots/{name}.svg")
    def plot(name: str) -> Response:
        charts = training_charts(timeline(source))
        if name not in charts:
            raise HTTPException(404, f"no chart {name!r}: one of {', '.join(charts)}")
        return Response(charts[name], media_type="image/svg+xml", headers=_HEADERS)

    app.include_router(pages)
    app.include_router(api)
    app.mount(
        f"{PREFIX}/static", StaticFiles(directory=str(HERE / "static")), name="explorer-static"
    )
