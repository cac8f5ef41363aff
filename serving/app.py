"""The ranking API: FastAPI app factory, lifespan wiring and the endpoints.

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
``X-Driftline-Degraded: feature-store-emptied``, its feature logs withheld the same way. Bad input is a 422 with the offending field;
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

import asyncio
import contextlib
import gc
import logging
import math
import time
import uuid

import numpy as np
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import CONTENT_TYPE_LATEST

from proto import Action, ModelVersion
from serving import auth, metrics, replica_metrics
from serving.correction import correct
from serving.broker_epoch import SharedEpoch
from serving.deltas import DeltaFeed
from serving.event_clock import EventClock
from serving.feature_log import FeatureLogEncoder, FeatureLogger, FeatureLogTooLarge, features_message
from serving.feature_store import FeatureStore, FeatureStoreError, RankFeatures
from serving.fm_model import FMModel
from serving.model import ServingModel, TrainerModel, warm_up
from serving.realtime import RecentClicks
from serving.store_watch import StoreWatchLoop
from serving.request_features import (BadFeatures, Declared, check_names, dense_for, drop_unknown,
                                      logged_dense, slots_for)
from serving.responses import FastJSONResponse
from serving.shared_model import SharedFeed, SharedModel
from serving.schemas import (ActionsRequest, ActionsResponse, Health, ModelVersionOut,
                             RankRequest, RankResponse, Readiness, SampleRateOut)
from services.spool import SpoolError, SpoolFull
from services.codecs import event_time_error
from services.log import Throttled
from services.settings import Settings

log = logging.getLogger(__name__)


def model_version(model: ServingModel) -> ModelVersionOut:
    """The served version as ``/readyz`` and ``/rank`` report it (and the FeatureLog logs it).

    ``sparse_version`` is the minimum of the per-shard ``sparse_versions`` (see
    :class:`serving.versions.SparseVersions`: the version every shard has reached), read in one go
    with them, so it is the minimum of exactly the versions reported."""
    shard_count, versions = model.sparse.report()
    return ModelVersionOut(model_id=model.model_id, sparse_version=min(versions.values()),
                           dense_version=model.dense.version, shard_count=shard_count,
                           sparse_versions=versions)


class Serving:
    """Everything one serving replica holds; built by the lifespan, reachable as app.state.serving."""

    def __init__(self, settings: Settings, model: ServingModel | None = None) -> None:
        self.settings = settings
        self.options = options = settings.serving
        self.model: ServingModel
        if model is not None:
            self.model = model
        elif settings.serving_model == "fm":
            self.model = FMModel(dim=options.embedding_dim, model_id=options.model_id)
        else:
            self.model = TrainerModel(settings.serving_model)
        self.store = FeatureStore(settings.redis, options.redis_prefix, options.recent_clicks,
                                  max_connections=options.feature_store_connections,
                                  wait_s=options.feature_store_wait_s, client=settings.redis_client)
        #: warnings a request can trigger (an overload or an outage would log every request)
        self.log_limited = Throttled(log)
        self.event_clock = EventClock(options.event_clock_s)
        self.epochs = SharedEpoch(settings)
        self.feature_log = FeatureLogger(settings, self.epochs)
        self.log_encoder = FeatureLogEncoder()
        self.deltas: DeltaFeed | SharedFeed
        if isinstance(self.model, SharedModel):  # a worker of a shared serving PS: the PS feeds it
            self.deltas = SharedFeed(self.model)
        else:
            self.deltas = DeltaFeed(settings, self.model, settings.snapshot_root, options.kafka_retry_s,
                                    epochs=self.epochs)
        self.realtime = RecentClicks(settings, self.store, options.click_actions, options.realtime_group_id,
                                     retry_s=options.kafka_retry_s, epochs=self.epochs)
        self.store_watch = StoreWatchLoop(self.store, settings.var_dir / "serving" / f"features-loaded-{options.redis_prefix}",
                                          options.feature_store_check_s)

    def sample_rate(self) -> SampleRateOut:
        """The log-odds correction's rate now: the served model's rate for its slice."""
        rate, source = self.model.sample_rates.rate_for(self.model.model_id)
        return SampleRateOut(rate=rate, source=source, slice=self.model.model_id)

    def version(self) -> ModelVersionOut:
        return model_version(self.model)

    async def start(self) -> None:
        await asyncio.to_thread(self.deltas.load_snapshot)
        await asyncio.to_thread(warm_up, self.model)
        # Everything loaded so far (torch, numba, the model) lives for the whole process: move it
        # out of the collector's reach, or each full collection walks it and stalls every request.
        gc.collect()
        gc.freeze()
        await self.store_watch.check()  # an emptied store is told from the first request on
        self.store_watch.start()
        self.feature_log.start()
        self.deltas.start()
        self.realtime.start()

    async def stop(self) -> None:
        """Stop the three consumers/producers at once (each waits on the broker: one after the
        other, a loaded machine's stop outlasted the supervisor's wait), then what they share."""
        started = time.monotonic()
        await asyncio.gather(self.realtime.stop(), self.deltas.stop(), self.feature_log.stop(),
                             self.store_watch.stop())
        await self.epochs.stop()
        await self.store.close()
        log.info("serving stopped its consumers and feature log in %.1f s", time.monotonic() - started)

    def event_time(self, field: str, event_time_ms: int | None, now_ms: int, observe: bool = True) -> int:
        """The request's event time (when absent: :class:`serving.event_clock.EventClock`'s, the
        traffic's own or now); a 422 naming ``field`` when out of range. ``observe``: the time
        goes into the clock (not a score-only request's: it logs nothing)."""
        if event_time_ms is None:
            return self.event_clock.stamp(None, now_ms)
        bounds = self.settings.event_time
        error = event_time_error(event_time_ms, now_ms, bounds.max_past_s, bounds.max_future_s)
        if error is not None:
            raise HTTPException(422, f"{field}: {error}")
        if observe:
            self.event_clock.observe(event_time_ms, now_ms)
        return event_time_ms


    def log_impression(self, request_id: str, encoded: bytes, degraded: str | None) -> None:
        """Spool a /rank answer's feature log (a degraded answer's is withheld: default features
        are not what the user saw); 413 when too large, 503 when the spool is full or fails."""
        try:
            if degraded is None:
                self.feature_log.submit(request_id, encoded)
            else:  # never training data
                metrics.FEATURE_LOGS_WITHHELD.labels(degraded).inc()
        except FeatureLogTooLarge as err:
            raise HTTPException(413, str(err)) from None
        except SpoolFull as err:
            # Kafka has been away long enough to fill the spool: a 200 now would be an impression
            # nobody can join. The client retries later (or another replica takes it).
            self.log_limited.warning("%s: 503", err)
            raise HTTPException(503, f"{err}: retry later", headers={
                "Retry-After": str(max(1, math.ceil(self.options.kafka_retry_s)))}) from None
        except SpoolError as err:
            raise HTTPException(503, str(err)) from None


def check_features(declared: Declared, body: RankRequest, unknown: str = "reject",
                   featured: list[int] | None = None) -> None:
    """A 422 naming the first feature of the request the served model does not declare (unless
    ``unknown`` is "ignore": they are dropped from ``body`` and counted). ``featured``: the
    indexes of the candidates with features of their own (found here when not given)."""
    cands = body.candidates
    if featured is None:
        featured = [i for i, c in enumerate(cands) if c.features is not None]
    if unknown == "ignore":
        groups = ([body.context] if body.context is not None else []) + [cands[i].features for i in featured]
        for g in groups:
            for kind, names in (("sparse", g.sparse), ("dense", g.dense)):
                if n := drop_unknown(declared, names, dense=kind == "dense"):
                    metrics.UNKNOWN_FEATURES.labels(kind).inc(n)
    try:
        if body.context is not None:
            check_names(declared, "context.sparse", body.context.sparse)
            check_names(declared, "context.dense", body.context.dense, dense=True)
        for i in featured:
            f = cands[i].features
            check_names(declared, f"candidates[{i}].features.sparse", f.sparse)
            check_names(declared, f"candidates[{i}].features.dense", f.dense, dense=True)
    except BadFeatures as err:
        raise HTTPException(422, str(err)) from None


def request_dense(declared: Declared, body: RankRequest, feats: RankFeatures, featured: list[int],
                  degraded: bool = False
                  ) -> tuple[np.ndarray | None, dict[str, float] | None, list[dict[str, float] | None] | None]:
    """The dense input (:func:`serving.request_features.dense_for`) from the request's values over
    the store's, and what the feature log carries of them: the context's values and each
    candidate's (None: none has any); a 422 naming the first dense feature missing, unless
    ``degraded`` (the store did not answer: a missing value scores as 0, and nothing is logged)."""
    ctx = logged_dense(declared, body.context.dense if body.context is not None else None, feats.user_dense)
    own = _own(body.candidates, featured, "dense") if featured else None
    stored = feats.items_dense
    if stored is None or not declared.dense:
        cands = own
    else:
        cands = [logged_dense(declared, own[i] if own else None, d) for i, d in enumerate(stored)]
    if not declared.dense:
        return None, ctx, cands
    try:
        return dense_for(declared, ctx, cands if cands is not None else [None] * len(body.candidates),
                         0.0 if degraded else None), ctx, cands
    except BadFeatures as err:
        raise HTTPException(422, str(err)) from None


def _own(cands: list, featured: list[int], kind: str) -> list[dict | None]:
    """Each candidate's own ``features.<kind>`` (None for a candidate without features)."""
    out: list[dict | None] = [None] * len(cands)
    for i in featured:
        out[i] = getattr(cands[i].features, kind)
    return out


def create_app(settings: Settings, model: ServingModel | None = None) -> FastAPI:

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
    # every endpoint that changes state, or answers with the model's work, asks for a key
    api = APIRouter(dependencies=protected, responses=auth.RESPONSES)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        message = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', 'invalid')}" for e in errors[:5]
        )
        return JSONResponse(status_code=422, content={"message": message or "invalid request",
                                                      "detail": jsonable_encoder(errors, exclude={"input", "ctx", "url"})})

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(status_code=exc.status_code, content={"message": str(exc.detail), "detail": exc.detail},
                            headers=getattr(exc, "headers", None))

    def serving_of(request: Request) -> Serving:
        return request.app.state.serving  # type: ignore[no-any-return]

    @api.post("/rank", response_model=RankResponse, response_class=FastJSONResponse,
              summary="Rank candidate items for a user",
              responses={413: {"description": "The request's feature log would exceed the topic's message size"},
                         422: {"description": "Invalid request (empty/oversize candidates, wrong types, "
                                              "event time out of range, a feature the model does not "
                                              "declare, a dense feature it reads missing)"},
                         503: {"description": "No model loaded yet, the feature store could not answer in time, or the feature-log spool is full "
                                              "(with Retry-After)"}})
    async def rank(body: RankRequest, request: Request, response: Response) -> Response:
        s = serving_of(request)
        n = len(body.candidates)
        if n > s.options.max_candidates:
            raise HTTPException(422, f"candidates: {n} given, at most {s.options.max_candidates} allowed")
        event_time_ms = s.event_time("event_time_ms", body.event_time_ms, int(time.time() * 1000), body.log)
        declared = s.model.declared  # one declaration for the whole request
        cands = body.candidates
        featured = [i for i, c in enumerate(cands) if c.features is not None]  # usually none
        check_features(declared, body, s.options.unknown_features, featured)  # a 4xx whether or not a model is loaded
        if not s.deltas.loaded:
            raise HTTPException(503, "no model loaded yet: waiting for a snapshot or the delta topic")
        request_id = body.request_id or uuid.uuid4().hex
        degraded = "feature-store-emptied" if s.store_watch.emptied else None
        item_ids = [c.item_id for c in cands]
        try:
            feats = await s.store.fetch(body.user_id, item_ids)
        except FeatureStoreError as err:
            if not body.allow_default_features:  # overload or Redis away: an error, not a wrong answer
                metrics.FEATURE_STORE_REFUSED.inc()
                s.log_limited.warning("%s: 503", err)
                raise HTTPException(503, f"{err}: retry later", headers={"Retry-After": "1"}) from None
            s.log_limited.warning("%s; scoring with default features (asked for), not logged", err)
            degraded = "feature-store"
            feats = RankFeatures(None, [], [None] * n)
        user_known = feats.user is not None
        if not user_known:
            metrics.UNKNOWN_USERS.inc()
        dense, context_dense, logged = request_dense(declared, body, feats, featured, degraded == "feature-store")
        user_slots, item_slots, keys = slots_for(declared, body.user_id, feats.user, feats.recent_items,
                                                 feats.items, item_ids, feats.items_raw)
        if body.context is not None:
            user_slots.update(body.context.sparse)
        for i in featured:  # a new row: the stored one is shared (slots_for)
            item_slots[i] = {**item_slots[i], **cands[i].features.sparse}
            keys[i] = None  # its feature log is its own, not the stored item's
        version = s.version()  # read before scoring: the served version is at least this one
        raw = s.model.score(user_slots, item_slots, dense)
        # the rate the served parameters were trained under, for the slice this replica serves
        rate, _source = s.model.sample_rates.rate_for(s.model.model_id)
        scores = correct(raw, rate)
        order = np.argsort(-scores, kind="stable")
        metrics.CANDIDATES.observe(n)

        if body.log:
            context = features_message(user_slots, context_dense)
            mv = ModelVersion(model_id=version.model_id, sparse_version=version.sparse_version,
                              dense_version=version.dense_version)
            encoded = s.log_encoder.encode(request_id, event_time_ms, body.user_id, context, mv, item_ids, keys,
                                           item_slots, scores.tolist(), logged)
            s.log_impression(request_id, encoded, degraded)
        else:  # score only: no impression to learn from or join
            metrics.SCORE_ONLY.inc()

        # The body is built directly (response_model documents it; re-validating 1000 items is waste).
        ranked = zip(np.asarray(item_ids, np.int64)[order].tolist(), scores[order].tolist(), raw[order].tolist())
        return FastJSONResponse({
            "request_id": request_id, "user_known": user_known, "model_version": version.model_dump(),
            "items": [{"item_id": i, "score": p, "raw_score": r} for i, p, r in ranked],
        }, headers={"X-Driftline-Degraded": degraded} if degraded is not None else None)

    @api.post("/actions", response_model=ActionsResponse, status_code=202,
              summary="Record user actions (writes Action messages to the actions topic)",
              responses={422: {"description": "Invalid request (wrong types, event time out of range)"},
                         503: {"description": "Kafka unavailable"}})
    async def actions(body: ActionsRequest, request: Request) -> ActionsResponse:
        s = serving_of(request)
        now = int(time.time() * 1000)
        times = [s.event_time(f"actions[{i}].event_time_ms", a.event_time_ms, now)
                 for i, a in enumerate(body.actions)]
        producer = s.feature_log.producer  # one producer per replica
        if producer is None:
            raise HTTPException(503, "Kafka unavailable: actions cannot be written now")
        try:
            futures = []
            for a, event_time_ms in zip(body.actions, times):
                msg = Action(request_id=a.request_id, item_id=a.item_id, action_type=a.action_type,
                             event_time_ms=event_time_ms, user_id=a.user_id)
                futures.append(await asyncio.wait_for(
                    producer.send(s.settings.topics.actions, msg.SerializeToString(), key=a.request_id.encode()),
                    s.options.feature_log_send_timeout_s))
            await asyncio.wait_for(asyncio.gather(*futures), s.options.feature_log_send_timeout_s)
        except Exception as err:  # noqa: BLE001 - Kafka errors and timeouts alike
            raise HTTPException(503, f"Kafka unavailable: {type(err).__name__}: {err}"[:300]) from None
        metrics.ACTIONS_PRODUCED.inc(len(body.actions))
        return ActionsResponse(accepted=len(body.actions))

    @app.get("/healthz", response_model=Health, summary="Liveness: the process answers")
    async def healthz() -> Health:
        return Health(status="ok")

    @app.get("/readyz", response_model=Readiness, summary="Readiness: a model is loaded and not behind its deltas",
              responses={503: {"description": "Not ready", "model": Readiness}})
    async def readyz(request: Request) -> JSONResponse:
        s = serving_of(request)
        store_ok = await s.store.ping()
        behind_s = s.deltas.behind_s()
        body = Readiness(
            ready=s.deltas.loaded and behind_s <= s.options.ready_max_behind_s and not s.feature_log.disk_full(),
            model_loaded=s.deltas.loaded,
            deltas_behind_s=round(behind_s, 3), feature_store=store_ok and not s.store_watch.emptied,
            feature_store_emptied=s.store_watch.emptied,
            model_version=s.version(),
            sparse_staleness_s=s.model.sparse.staleness_s(), dense_staleness_s=s.model.dense.staleness_s(),
            feature_log_connected=s.feature_log.connected, feature_log_buffered=s.feature_log.buffered,
            feature_log_spool_bytes=s.feature_log.spool.bytes, feature_log_disk_full=s.feature_log.disk_full(),
            sample_rate=s.sample_rate(),
        )
        return JSONResponse(body.model_dump(), status_code=200 if body.ready else 503)

    @app.get("/ping", include_in_schema=False)
    async def ping() -> dict[str, str]:
        """Trivial endpoint: the bench's baseline."""
        return {"status": "ok"}

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response,
             dependencies=protected if options.protect_metrics else [])
    async def metrics_endpoint(request: Request) -> Response:
        with contextlib.suppress(AttributeError):
            serving_of(request).deltas.publish_metrics()
        return Response(replica_metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    app.include_router(api)
    if options.protect_docs:
        app.include_router(auth.protected_docs(app, protected))
    return app

