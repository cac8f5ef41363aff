"""One broker-epoch watch per serving replica, shared by its Kafka readers and its shipper.

The feature-log shipper, the delta reader and the real-time reader each need to know when the
broker's data was reset (tansu memory storage; see ``services.tansu_quirks``), each acting on it
in its own time. One :class:`~services.broker_reset.EpochWatch` serves them all, so a reset is
counted once for the replica (``driftline_broker_resets_total{service="serving"}``): a reader
asks :meth:`SharedEpoch.current` and compares the answer with the epoch it last acted on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from aiokafka.errors import KafkaError

from services.broker_reset import EpochWatch
from services.kafka import BrokerUnavailable
from services.settings import Settings
from serving.background import raise_if_cancelled

log = logging.getLogger(__name__)


class SharedEpoch:
    """The broker's current epoch, checked at most once per ``max_age_s`` for all callers."""

    def __init__(self, settings: Settings, service: str = "serving") -> None:
        self.settings = settings
        self.watch = EpochWatch(settings, service)
        self._lock = asyncio.Lock()
        self._started = False
        self._checked = 0.0

    async def current(self, max_age_s: float = 1.0) -> str | None:
        """The broker's epoch as of at most ``max_age_s`` ago (0: ask now); None until the broker
        has been reachable once. While it is unreachable the last known epoch is returned."""
        async with self._lock:
            now = time.monotonic()
            if not self._started:
                try:
                    await asyncio.wait_for(self.watch.start(), self.settings.kafka.connect_timeout_s)
                except (TimeoutError, KafkaError, OSError, BrokerUnavailable) as err:
                    log.debug("broker epoch not known yet: %r", err)
                    with contextlib.suppress(Exception):
                        await self.watch.stop()
                    self.watch.epoch = None
                    raise_if_cancelled()
                    return None
                self._started = True
                self._checked = now
            elif now - self._checked >= max_age_s:
                await self.watch.check()  # returns None on errors, a lost cancellation among them
                raise_if_cancelled()
                self._checked = now
            return self.watch.epoch

    async def stop(self) -> None:
        await self.watch.stop()
