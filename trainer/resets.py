"""Noticing a broker reset under the running online trainer (what it then does: :mod:`trainer.online`).

tansu's memory storage is lost with a broker restart; :class:`services.broker_reset.EpochWatch`
tells a new broker epoch with a check costing ~1 ms. The trainer checks before every offset commit
(offsets of the old epoch must never land in the new broker's group) and every
``epoch_check_interval_s`` when idle. Each check that still sees the current epoch records the
last known high watermarks and applied offsets: what a reset from then on loses is the old topic's
records between the two (:meth:`ResetWatch.lost`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from services.broker_reset import EpochWatch
from services.settings import Settings


class ResetWatch:
    """Checks :attr:`watch` (set by the trainer once started; None: an external Kafka without
    epochs, never reset) for a new broker epoch. ``position()``: ``(high watermarks, applied
    offsets)``, ``{partition: offset}`` each, as of now."""

    def __init__(self, interval_s: float, position: Callable[[], tuple[dict[int, int], dict[int, int]]]):
        self.watch: EpochWatch | None = None
        self.interval_s = interval_s
        self._position = position
        self._checked_at = 0.0  # monotonic time of the last check
        self._lock = asyncio.Lock()  # one check at a time over the watch's connection
        self.new_epoch: str | None = None  # a reset noticed and not handled yet: its new epoch
        # (high watermarks, applied offsets) when a check last saw the current epoch
        self._confirmed: tuple[dict[int, int], dict[int, int]] = ({}, {})

    async def start(self, settings: Settings) -> str | None:
        """Open :attr:`watch` and return the broker's epoch; None (no watch) for an external Kafka
        without the marker topic."""
        watch = EpochWatch(settings, "trainer")
        try:
            epoch = await watch.start()
        except Exception:  # noqa: BLE001 - an external Kafka without the marker topic
            await watch.stop()
            return None
        self.watch = watch
        return epoch

    async def stop(self) -> None:
        if self.watch is not None:
            await self.watch.stop()

    async def noticed(self) -> bool:
        """Whether the broker's data was reset (a new epoch) and the reset is not handled yet; asks
        the broker (~1 ms; while the broker is down, until it is back or ``connect_timeout_s``)."""
        if self.new_epoch is None and self.watch is not None:
            async with self._lock:
                if self.new_epoch is None:
                    self.new_epoch = await self.watch.check()
                    self._checked_at = time.monotonic()
                    if self.new_epoch is None:  # what a reset from here on would lose
                        highwater, applied = self._position()
                        self._confirmed = (dict(highwater), dict(applied))
        return self.new_epoch is not None

    async def check_when_due(self, now: float) -> bool:
        """Ask every ``interval_s`` (a busy trainer asks before each commit anyway)."""
        if self.new_epoch is None and now - self._checked_at >= self.interval_s:
            await self.noticed()
        return self.new_epoch is not None

    def lost(self) -> int:
        """The old topic's records not applied: from the last record applied to the high watermark,
        both as of the last check that saw the old epoch (later fetches may come from the new
        topics; over by what was applied after that check, a batch or two at most)."""
        highwater, applied = self._confirmed
        return sum(max(0, hw - applied[p]) for p, hw in highwater.items() if p in applied)

    def handled(self) -> None:
        """The reset was handled: watch for the next one."""
        self._confirmed = ({}, {})
        self.new_epoch = None
