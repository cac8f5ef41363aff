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

A stack that never loads features (every request brings its own) never sees the marker and is
never called emptied. The embedded Redis of ``driftline up`` persists with an append-only file,
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
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from serving import metrics
from serving.background import BackgroundLoop
from serving.feature_store import LOADED_MARKER, FeatureStore, FeatureStoreError

log = logging.getLogger(__name__)


class StoreWatch:
    """The emptied-or-not decision from successive reads of the load marker (None: absent)."""

    def __init__(self, seen_file: Path | None) -> None:
        self.seen_file = seen_file
        self.seen = seen_file is not None and seen_file.exists()
        self.emptied = False

    def observe(self, marker: str | None) -> bool:
        """Note one read of the marker; True when the emptied state changed."""
        if marker is not None and not self.seen:
            self.seen = True
            if self.seen_file is not None:
                self.seen_file.parent.mkdir(parents=True, exist_ok=True)
                self.seen_file.touch()
        emptied = marker is None and self.seen
        changed = emptied != self.emptied
        self.emptied = emptied
        return changed


class StoreWatchLoop(BackgroundLoop):
    """Reads the load marker every ``interval_s`` for the app's lifetime."""

    task_name = "feature-store-watch"

    def __init__(self, store: FeatureStore, seen_file: Path | None, interval_s: float) -> None:
        self.store = store
        self.watch = StoreWatch(seen_file)
        self.interval_s = interval_s
        metrics.FEATURE_STORE_EMPTIED.set(0)

    @property
    def emptied(self) -> bool:
        return self.watch.emptied

    async def check(self) -> None:
        """One read of the marker (Redis unreachable: no verdict)."""
        try:
            marker = await self.store.get_marker(LOADED_MARKER)
        except FeatureStoreError:
            return
        if self.watch.observe(marker):
            metrics.FEATURE_STORE_EMPTIED.set(int(self.watch.emptied))
            if self.watch.emptied:
                log.warning("the feature store lost its features (the marker %s is gone: Redis restarted "
                            "without persistence, or was flushed); /rank answers are marked degraded and "
                            "their feature logs withheld until features are loaded again "
                            "(driftline features load); recent-click history is lost",
                            self.store.marker_key(LOADED_MARKER))
            else:
                log.info("the feature store holds loaded features again (marker %s)", marker)

    async def _consume(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.interval_s)
