"""Whether the feature store still holds the features loaded into it.

A Redis that restarts without persistence (or is flushed) comes back empty: every ``/rank`` would
still answer 200, with ``user_known: false`` and default features, and its feature log would turn
ids-only impressions into training data. Every load (``driftline features load``, through
:meth:`serving.feature_store.FeatureStore.put`) writes the marker ``P:meta:features-loaded`` beside
the features, and this watch reads it every ``serving.feature_store_check_s``:

* marker present: the store is whole; the watch remembers that features were loaded (a file under
  ``<var_dir>/serving``, so a replica started after the loss knows it too);
* marker gone after a load was seen: the store was **emptied**. ``/rank`` answers are marked
  ``X-Driftline-Degraded: feature-store-emptied``, their feature logs are withheld (never training
  data), ``/readyz`` says ``feature_store: false`` and ``feature_store_emptied: true``, the gauge
  ``driftline_serving_feature_store_emptied`` is 1 and a warning is logged, until features are
  loaded again (the next load writes the marker);
* Redis unreachable: nothing changes here (``/rank`` is a 503 then, :mod:`serving.app`). In a
  Redis Cluster the marker is on one master: while that master is down the marker cannot be read
  and the store is not called emptied (``/readyz`` says ``feature_store: false``: a master does
  not answer); its replica holds the marker after a failover.

A Redis that may evict any key (``maxmemory`` with an ``allkeys-*`` policy: Redis as a cache) loses
features one key at a time, and an evicted user or item would score and train as an unknown one
without a word. The watch also reads Redis's ``INFO`` (its policy, and ``evicted_keys``, which every
load records in its marker):

* such a policy is logged once as a warning (set ``maxmemory-policy noeviction``, or a
  ``volatile-*`` one: features have no TTL);
* once Redis **evicted** keys since the load, answers are marked ``X-Driftline-Degraded:
  feature-store-evicted`` and their feature logs withheld, ``/readyz`` says ``feature_store: false``
  and ``feature_store_evicted: true``, the gauge ``driftline_serving_feature_store_evicted`` is 1
  and an error names the fix, until the next load (after the fix; a load that does not fit
  evicts again and stays marked). A login whose ACL denies ``INFO`` gets no verdict.

A stack that never loads features (every request brings its own) never sees the marker and is
never called emptied or evicted. The embedded Redis of ``driftline up`` persists with an append-only file,
so its own restart loses at most the last second's writes (``tests/test_embedded_redis.py``).

>>> w = StoreWatch(None)
>>> w.observe(None), w.emptied
(False, False)
>>> w.observe("12"), w.emptied
(False, False)
>>> w.observe(None), w.emptied
(True, True)
>>> w.observe("7"), w.emptied
(True, False)
>>> import dataclasses
>>> lru = Evictions("allkeys-lru", 1 << 20, 4, "r1")
>>> w.observe("7 keys at 1; evicted 4 on r1", lru), w.evicted
(False, False)
>>> w.observe("7 keys at 1; evicted 4 on r1", dataclasses.replace(lru, evicted=9)), w.evicted
(True, True)
>>> w.observe("7 keys at 2; evicted 9 on r1", dataclasses.replace(lru, evicted=9)), w.evicted  # (loaded again)
(True, False)
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from serving import metrics
from serving.background import BackgroundLoop
from serving.feature_store import LOADED_MARKER, FeatureStore, FeatureStoreError
from serving.redis_state import Evictions

log = logging.getLogger(__name__)


class StoreWatch:
    """The emptied-or-not and evicted-or-not decisions from successive reads of the load marker
    (None: absent) and of Redis's evictions (None: not known now, the verdict stays)."""

    def __init__(self, seen_file: Path | None) -> None:
        self.seen_file = seen_file
        self.seen = seen_file is not None and seen_file.exists()
        self.emptied = False
        self.evicted = False
        #: the first evictions read under a marker that does not record them: (marker, count)
        self._first: tuple[str, int] | None = None

    def observe(self, marker: str | None, evictions: Evictions | None = None) -> bool:
        """Note one read of the marker (and of the evictions); True when a state changed."""
        if marker is not None and not self.seen:
            self.seen = True
            if self.seen_file is not None:
                self.seen_file.parent.mkdir(parents=True, exist_ok=True)
                self.seen_file.touch()
        emptied = marker is None and self.seen
        if evictions is None:  # (not known now: as before)
            evicted = self.evicted and marker is not None
        else:
            evicted = marker is not None and evictions.may_evict_features \
                and self._evicted_since_load(marker, evictions) > 0
        changed = (emptied, evicted) != (self.emptied, self.evicted)
        self.emptied, self.evicted = emptied, evicted
        return changed

    def _evicted_since_load(self, marker: str, evictions: Evictions) -> int:
        since = Evictions.since(marker, evictions)
        if since is not None:
            return since
        if self._first is None or self._first[0] != marker:  # (counted from this watch's first read)
            self._first = (marker, evictions.evicted)
        return evictions.evicted - self._first[1]


class StoreWatchLoop(BackgroundLoop):
    """Reads the load marker every ``interval_s`` for the app's lifetime."""

    task_name = "feature-store-watch"

    def __init__(self, store: FeatureStore, seen_file: Path | None, interval_s: float) -> None:
        self.store = store
        self.watch = StoreWatch(seen_file)
        self.interval_s = interval_s
        self._warned = False  # (an evicting policy: said once)
        metrics.FEATURE_STORE_EMPTIED.set(0)
        metrics.FEATURE_STORE_EVICTED.set(0)

    @property
    def emptied(self) -> bool:
        return self.watch.emptied

    @property
    def evicted(self) -> bool:
        return self.watch.evicted

    async def check(self) -> None:
        """One read of the marker and of Redis's evictions (Redis unreachable: no verdict)."""
        try:
            marker = await self.store.get_marker(LOADED_MARKER)
        except FeatureStoreError:
            return
        evictions = None  # (no load's marker: nothing evictions could take from it, no INFO read)
        if marker is not None:
            try:
                evictions = await self.store.evictions()
            except FeatureStoreError:  # (a Cluster's master down: its marker may still be read)
                pass
        if evictions is not None and evictions.may_evict_features and not self._warned:
            self._warned = True
            log.warning("Redis may evict any key, features included (maxmemory-policy %s, maxmemory %d): set "
                        "maxmemory-policy noeviction (or volatile-*: features have no TTL), or serving marks its "
                        "answers degraded once it does", evictions.policy, evictions.maxmemory)
        was = self.watch.emptied, self.watch.evicted
        if not self.watch.observe(marker, evictions):
            return
        metrics.FEATURE_STORE_EMPTIED.set(int(self.watch.emptied))
        metrics.FEATURE_STORE_EVICTED.set(int(self.watch.evicted))
        if self.watch.emptied and not was[0]:
            log.warning("the feature store lost its features (the marker %s is gone: Redis restarted "
                        "without persistence, or was flushed); /rank answers are marked degraded and "
                        "their feature logs withheld until features are loaded again "
                        "(driftline features load); recent-click history is lost",
                        self.store.marker_key(LOADED_MARKER))
        if self.watch.evicted and not was[1]:
            assert evictions is not None
            log.error("Redis evicted keys since the features were loaded (maxmemory-policy %s, maxmemory %d, "
                      "evicted_keys %d): users and items may have lost their features; /rank answers are marked "
                      "degraded and their feature logs withheld until features are loaded again. Set "
                      "maxmemory-policy noeviction (or volatile-*), or give Redis more memory, then load them",
                      evictions.policy, evictions.maxmemory, evictions.evicted)
        if not any((self.watch.emptied, self.watch.evicted)) and any(was):
            log.info("the feature store holds loaded features again (marker %s)", marker)

    async def _consume(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.interval_s)
