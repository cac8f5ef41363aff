"""How far this replica's clock is from the feature store's: the event times serving stamps come from it.

A request or action without ``event_time_ms`` is stamped with the replica's wall clock (once no
replay's event times are fresh: :mod:`serving.event_clock`), and the joiner's watermarks follow
the newest event times of every replica. A replica whose clock runs S seconds fast therefore
closes every other replica's join windows S seconds early: their clicks that come later than
``joiner.window_seconds`` + lateness - S after their impression are learned as negatives. Measured
on the pure join (two replicas, every click 20 s after its impression, the defaults): 600 s fast,
nothing lost; 1,800 s fast, 357 of the other replica's 360 clicked impressions emitted as
negatives; 3,600 s fast, its impressions refused as too late (lost, counted). A replica whose clock
runs slow has its own impressions refused the same way. Nothing in the data tells a skewed clock
from a burst of traffic, so serving measures it: every ``serving.feature_store_check_s`` it reads
Redis's ``TIME`` (the one clock every replica shares) and exports its own clock minus Redis's,
corrected by half the round trip, as ``driftline_serving_clock_offset_seconds``; the status page
names a replica whose offset is a minute or more, and serving logs a warning once it is.

>>> offset_s(local_before=100.0, server=160.5, local_after=101.0)   # 60 s slow
-60.0
>>> offset_s(local_before=1000.2, server=100.0, local_after=1000.2)  # 900 s fast
900.2
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from serving import metrics
from serving.background import BackgroundLoop
from serving.feature_store import FeatureStore, FeatureStoreError

__all__ = ["WARN_AT_S", "ClockOffsetLoop", "offset_s"]

log = logging.getLogger(__name__)

#: an offset this large is worth a warning (and the status page's line): a minute of event time
#: moves the joiner's watermarks past its idle advance's margin (60 s)
WARN_AT_S = 60.0


def offset_s(local_before: float, server: float, local_after: float) -> float:
    """The local clock minus the server's, the server's reading taken halfway through the round trip."""
    return round((local_before + local_after) / 2 - server, 3)


class ClockOffsetLoop(BackgroundLoop):
    """Reads Redis's clock every ``interval_s`` for the app's lifetime (Redis unreachable: no reading)."""

    task_name = "clock-offset"

    def __init__(self, store: FeatureStore, interval_s: float, clock: Callable[[], float] = time.time) -> None:
        self.store, self.interval_s, self.clock = store, interval_s, clock
        self.offset: float | None = None
        self._warned = False

    async def check(self) -> None:
        """One reading of the offset."""
        before = self.clock()
        try:
            server = await self.store.server_time()
        except FeatureStoreError:
            return
        self.offset = offset_s(before, server, self.clock())
        metrics.CLOCK_OFFSET.set(self.offset)
        if abs(self.offset) >= WARN_AT_S and not self._warned:
            self._warned = True
            log.warning("this replica's clock is %.0f s %s the feature store's (Redis TIME): the event times it "
                        "stamps %s; set the clocks right (NTP)", abs(self.offset),
                        "ahead of" if self.offset > 0 else "behind",
                        "close the other replicas' join windows that much early (their later clicks are learned as "
                        "negatives)" if self.offset > 0 else "make its own impressions late for the join")
        elif abs(self.offset) < WARN_AT_S:
            self._warned = False

    async def _consume(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.interval_s)
