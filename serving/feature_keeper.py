"""Keep the feature store loaded: ``driftline features load ... --watch``.

A load is a one-off, and a Redis can lose what was loaded into it: restarted without persistence
(or on a new volume), its append-only file cut at damage (:func:`driftline.embedded.repair_redis_aof`),
flushed, or its keys evicted. Serving notices (the load's marker is gone, :mod:`serving.store_watch`)
and marks its answers degraded and withholds their feature logs, so no wrong features reach
training; but nothing brought the features back, and the model stopped learning from traffic until
someone ran the load again. With ``--watch`` the load command stays: it reads the marker every
``serving.feature_store_check_s`` (the interval serving reads it at) and runs the same load again
whenever the marker is gone and Redis answers, its start included (so it starts after a one-shot
load without loading twice). Redis unreachable is no verdict: the next read decides.

A load that fails (Redis went away during it, a features file now unreadable) is logged and counted,
and tried again later (waiting twice as long after each failure, up to a minute): the watch never
exits on it (a crash-looping keeper would load no sooner). Counted in ``driftline_serving_feature_loads_total{reason}`` (``absent`` at its start, ``lost``
after a read that saw them) and ``driftline_serving_feature_load_failures_total``; the gauge
``driftline_serving_features_loaded`` is 1 while the marker is there.

>>> import asyncio
>>> class Store:  # the marker is gone after the second read, and Redis is down at the fourth
...     reads = iter(["7 keys", "7 keys", None, FeatureStoreError("down"), "7 keys"])
...     async def get_marker(self, name):
...         read = next(self.reads)
...         if isinstance(read, Exception):
...             raise read
...         return read
>>> async def load():
...     return 7, 0.01
>>> keeper = FeatureKeeper(Store(), load, interval_s=0)
>>> [asyncio.run(keeper.check()) for _ in range(5)]
[None, None, 'lost', None, None]
>>> keeper.loads
{'absent': 0, 'lost': 1}
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from serving import metrics
from serving.feature_store import LOADED_MARKER, FeatureStoreError

log = logging.getLogger(__name__)

#: the longest wait between tries of a load that keeps failing
MAX_RETRY_S = 60.0
#: a features load: (keys written, seconds)
Load = Callable[[], Awaitable[tuple[int, float]]]


class MarkerReader(Protocol):
    async def get_marker(self, name: str) -> str | None: ...


class FeatureKeeper:
    """Runs ``load`` whenever the store's load marker is gone (see the module's docstring)."""

    def __init__(self, store: MarkerReader, load: Load, interval_s: float) -> None:
        self.store = store
        self.load = load
        self.interval_s = interval_s
        self.seen = False  # (a read found the marker: a later absence is a loss)
        self.loads = {"absent": 0, "lost": 0}
        self.failures = 0

    async def check(self) -> str | None:
        """One read of the marker, and a load if it is gone; the load's reason, or None."""
        try:
            marker = await self.store.get_marker(LOADED_MARKER)
        except FeatureStoreError as err:
            log.debug("the feature store does not answer (%s): no verdict", err)
            return None
        if marker is not None:
            self.seen = True
            metrics.FEATURES_LOADED.set(1)
            return None
        metrics.FEATURES_LOADED.set(0)
        reason = "lost" if self.seen else "absent"
        if reason == "lost":
            log.warning("the feature store lost the features loaded into it (its load marker is gone: Redis "
                        "restarted without them, or was flushed): loading them again")
        else:
            log.info("the feature store holds no loaded features: loading them")
        try:
            n, seconds = await self.load()
        except (FeatureStoreError, ValueError, OSError) as err:
            self.failures += 1
            metrics.FEATURE_LOAD_FAILURES.inc()
            log.error("loading the features failed (%s): trying again later", err)
            return None
        self.loads[reason] += 1
        self.seen = True
        metrics.FEATURE_LOADS.labels(reason).inc()
        metrics.FEATURES_LOADED.set(1)
        log.info("loaded %d feature keys in %.2f s", n, seconds)
        return reason

    async def run(self, stop: asyncio.Event) -> None:
        """Check every ``interval_s`` until ``stop`` is set; after failed loads, less often (doubling
        up to :data:`MAX_RETRY_S`: a features file that stays broken is not re-read every second)."""
        wait = self.interval_s
        while not stop.is_set():
            failures = self.failures
            await self.check()
            wait = min(max(wait, self.interval_s) * 2, MAX_RETRY_S) if self.failures > failures else self.interval_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)
