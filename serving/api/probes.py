"""What monitors and orchestrators read: ``/healthz`` (liveness), ``/readyz`` (a model loaded and
not behind its deltas, the feature store and the feature log usable), ``/ping`` (the benches'
floor) and, on a router of its own (the app decides whether it asks for a key), ``/metrics``."""

from __future__ import annotations

import contextlib

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from serving import replica_metrics
from serving.replica import Serving, serving_of
from serving.schemas import Health, Readiness

__all__ = ["exposition", "router"]

router = APIRouter()
exposition = APIRouter()


@router.get("/healthz", response_model=Health, summary="Liveness: the process answers")
async def healthz() -> Health:
    return Health(status="ok")


@router.get("/readyz", response_model=Readiness, summary="Readiness: a model is loaded and not behind its deltas",
            responses={503: {"description": "Not ready", "model": Readiness}})
async def readyz(s: Serving = Depends(serving_of)) -> JSONResponse:
    store_ok = await s.store.ping()
    behind_s = s.deltas.behind_s()
    body = Readiness(
        ready=s.deltas.loaded and behind_s <= s.options.ready_max_behind_s and not s.feature_log.disk_full(),
        model_loaded=s.deltas.loaded,
        deltas_behind_s=round(behind_s, 3),
        feature_store=store_ok and not s.store_watch.emptied and not s.store_watch.evicted,
        feature_store_emptied=s.store_watch.emptied, feature_store_evicted=s.store_watch.evicted,
        model_version=s.version(),
        sparse_staleness_s=s.model.sparse.staleness_s(), dense_staleness_s=s.model.dense.staleness_s(),
        feature_log_connected=s.feature_log.connected, feature_log_buffered=s.feature_log.buffered,
        feature_log_spool_bytes=s.feature_log.spool.bytes, feature_log_disk_full=s.feature_log.disk_full(),
        sample_rate=s.sample_rate(),
    )
    return JSONResponse(body.model_dump(), status_code=200 if body.ready else 503)


@router.get("/ping", include_in_schema=False)
async def ping() -> dict[str, str]:
    """Trivial endpoint: the bench's baseline."""
    return {"status": "ok"}


@exposition.get("/metrics", summary="Prometheus metrics", response_class=Response)
async def metrics_endpoint(request: Request) -> Response:
    # before the lifespan built the replica (or after a failed start) the process's metrics still answer
    with contextlib.suppress(AttributeError):
        request.app.state.serving.deltas.publish_metrics()
    return Response(replica_metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
