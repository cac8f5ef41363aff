"""What one serving replica holds (:class:`Serving`: the model, its delta feed, the feature store,
the feature log, the real-time clicks), built by the app's lifespan and handed to every endpoint by
:func:`serving_of` (``Depends(serving_of)``)."""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import time

from fastapi import HTTPException, Request

from services.codecs import event_time_error
from services.log import Throttled
from services.settings import Settings
from services.spool import SpoolError, SpoolFull
from serving import metrics
from serving.broker_epoch import SharedEpoch
from serving.clock_offset import ClockOffsetLoop
from serving.deltas import DeltaFeed
from serving.event_clock import EventClock
from serving.feature_log import FeatureLogEncoder, FeatureLogger, FeatureLogTooLarge
from serving.feature_store import FeatureStore
from serving.fm_model import FMModel
from serving.model import ServingModel, TrainerModel, warm_up
from serving.realtime import RecentClicks
from serving.schemas import ModelVersionOut, SampleRateOut
from serving.shared_model import SharedFeed, SharedModel
from serving.store_watch import StoreWatchLoop

__all__ = ["Serving", "model_version", "serving_of"]

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
        self.clock_offset = ClockOffsetLoop(self.store, options.feature_store_check_s)

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
        self.clock_offset.start()
        self.feature_log.start()
        self.deltas.start()
        self.realtime.start()

    async def stop(self) -> None:
        """Stop the three consumers/producers at once (each waits on the broker: one after the
        other, a loaded machine's stop outlasted the supervisor's wait), then what they share."""
        started = time.monotonic()
        await asyncio.gather(self.realtime.stop(), self.deltas.stop(), self.feature_log.stop(),
                             self.store_watch.stop(), self.clock_offset.stop())
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


async def serving_of(request: Request) -> Serving:
    """The replica answering ``request`` (a dependency: ``Depends(serving_of)``; async, so FastAPI
    calls it inline rather than in its thread pool)."""
    return request.app.state.serving  # type: ignore[no-any-return]
