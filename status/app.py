"""The live status page: a small FastAPI app that scrapes the stack and draws its key charts.

Endpoints:

- ``GET /``: the page (plain HTML + JS, uPlot vendored under ``/static``; works offline). It polls
  ``/api/series`` every scrape interval and redraws.
- ``GET /api/series[?since=<unix s>]``: per-target badges, what is wrong now (``problems``, see
  :mod:`status.problems`), the time axis ``t`` (unix seconds) and one column per key series (see
  :mod:`status.series`); ``null`` is a gap.
- ``GET /metrics``: the page's own scrape counters (``driftline_status_*``).
- ``GET /healthz``: ``{"ok": true}``.

Run: ``python -m status [--port 8500] [--target name=url ...]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Query
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST

from services.settings import Settings, get_settings
from status.metrics import StatusMetrics
from status.options import StatusSettings, Target, parse_target, resolve_targets, status_settings, with_serving_key
from status.scrape import Scraper

STATIC = Path(__file__).parent / "static"


def create_app(settings: Settings, targets: Sequence[Target] | None = None,
               opts: StatusSettings | None = None) -> FastAPI:
    """The status app; ``targets`` default to the configured ones (``status.targets``)."""
    opts = opts if opts is not None else status_settings(settings)
    targets = with_serving_key(list(targets) if targets is not None else resolve_targets(opts), settings)
    metrics = StatusMetrics()
    scraper = Scraper(targets, opts, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(scraper.run(), name="status-scraper")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    app = FastAPI(title="driftline status", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.scraper = scraper
    app.state.metrics = metrics
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/api/series")
    async def series(since: float | None = Query(None, description="only points after this unix time")) -> JSONResponse:
        return JSONResponse(scraper.snapshot(since), headers={"Cache-Control": "no-store"})

    @app.get("/metrics", include_in_schema=False)
    async def own_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True}

    return app


def main(argv: Sequence[str] | None = None, default_targets: Sequence[Target] = ()) -> int:
    """``python -m status``; ``default_targets``: scraped when neither ``--target`` nor
    ``status.targets`` names any (``driftline status`` gives the stack's services)."""
    from services.log import setup_logging
    from services.ports import Listen, check_ports_free
    from services.uvicorn_server import serve

    settings = get_settings()
    opts = status_settings(settings)
    parser = argparse.ArgumentParser(prog="python -m status", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default=opts.host)
    parser.add_argument("--port", type=int, default=opts.port)
    parser.add_argument("--interval", type=float, default=opts.scrape_interval_s, help="seconds between scrapes")
    parser.add_argument("--target", action="append", default=None, metavar="[NAME=]URL",
                        help="a /metrics URL to scrape (repeatable); default: status.targets, else (driftline "
                             "status) every service of `make up`")
    args = parser.parse_args(argv)
    setup_logging("status", settings.log_level)
    # (validated as the environment's settings are: a flag is an edge too)
    opts = settings.updated(status={"host": args.host, "port": args.port, "scrape_interval_s": args.interval}).status
    targets = [parse_target(t) for t in args.target] if args.target else resolve_targets(opts, default_targets)
    if not targets:
        parser.error("no /metrics to scrape: give --target [NAME=]URL or set status.targets")
    check_ports_free([Listen(opts.host, opts.port, "the status page", "status.port")])
    app = create_app(settings, targets, opts)
    return 0 if serve(app, opts.host, opts.port, settings.log_level) else 3
