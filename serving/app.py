"""The ranking API (the app: :func:`create_app`; its endpoints: :mod:`serving.api`).

Unknown users are **scored with default features** (cold start is normal traffic, not an error):
the response says ``user_known: false`` and ``driftline_serving_unknown_users_total`` counts them.
Unknown items likewise get only their ``item_id`` slot, and ids the PS has not admitted read as
the table default. Serving adds and logs only the features the served model declares
(:mod:`serving.request_features`): a request naming another is a 422 that names it. If the
feature store cannot answer in time (Redis away, or every pooled connection busy past
``serving.feature_store_wait_s`` under overload), ``/rank`` is a 503 with ``Retry-After``: an
answer scored on default features would be a wrong one. A request with ``allow_default_features``
gets that answer instead, with the ``X-Driftline-Degraded: feature-store`` header, and its feature
log is not written (those features are not what the user saw: not training data). A store that
lost its loaded features (:mod:`serving.store_watch`) answers 200 marked
``X-Driftline-Degraded: feature-store-emptied`` (``feature-store-evicted``: Redis evicted keys since
the load), its feature logs withheld the same way. Bad input is a 422 with the offending field;
an event time outside ``[now - event_time.max_past_s, now + event_time.max_future_s]`` is bad input.
When ``serving.api_keys`` (or ``serving.api_keys_file``) is set, ``/rank`` and ``/actions`` ask
for a key (:mod:`serving.auth`: 401 without one, 403 with a wrong one); ``/healthz`` and
``/readyz`` never do.

A 200 from ``/rank`` means its feature log is in the local spool and survives a ``kill -9``
(:mod:`serving.feature_log`); a request whose feature log is larger than the topic takes is a
413, and when the spool is full (Kafka down for long) ``/rank`` answers 503 with ``Retry-After``:
a 200 it could not keep would be a lost impression. A 202 from ``/actions`` means Kafka
acknowledged the actions; when it cannot, the answer is a 503.

Where a ``/rank`` spends its time, stage by stage, and what made each stage cheaper: the
profile in ``bench/profile_rank.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.settings import Settings
from serving import auth, metrics
from serving.api import actions, probes, rank
from serving.model import ServingModel
from serving.replica import Serving

__all__ = ["create_app"]


def create_app(settings: Settings, model: ServingModel | None = None) -> FastAPI:
    """The app of one replica: its lifespan builds :class:`serving.replica.Serving` (reached by the
    endpoints of :mod:`serving.api` as ``app.state.serving``); ``model`` replaces the one
    ``settings`` name (tests, benches)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        serving = Serving(settings, model)
        app.state.serving = serving
        await serving.start()
        try:
            yield
        finally:
            await serving.stop()

    options = settings.serving
    keys = auth.ApiKeys(options)
    protected = [Depends(keys)]
    # the docs FastAPI adds itself cannot take a dependency: protected, they are added below instead
    docs_urls = dict(docs_url=None, redoc_url=None, openapi_url=None) if options.protect_docs else {}
    app = FastAPI(
        title="driftline serving",
        version="1",
        description=__doc__,
        lifespan=lifespan,
        **docs_urls,
    )
    app.state.api_keys = keys
    app.add_middleware(metrics.RequestMetrics)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    # every endpoint that changes state, or answers with the model's work, asks for a key
    for router in (rank.router, actions.router):
        app.include_router(router, dependencies=protected, responses=auth.RESPONSES)
    app.include_router(probes.router)
    app.include_router(probes.exposition, dependencies=protected if options.protect_metrics else [])
    if options.protect_docs:
        app.include_router(auth.protected_docs(app, protected))
    return app


async def _invalid(request: Request, exc: Exception) -> JSONResponse:
    """A 422 whose ``message`` names the first invalid fields (FastAPI's own says only "detail")."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', 'invalid')}" for e in errors[:5])
    return JSONResponse(status_code=422, content={"message": message or "invalid request",
                                                  "detail": jsonable_encoder(errors, exclude={"input", "ctx", "url"})})


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """Every error answer carries ``message`` as the 422s do."""
    assert isinstance(exc, StarletteHTTPException)
    return JSONResponse(status_code=exc.status_code, content={"message": str(exc.detail), "detail": exc.detail},
                        headers=getattr(exc, "headers", None))
