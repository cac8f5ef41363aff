"""Free space under a service's data directory: a gauge, a warning, and a pause instead of a crash.

A service that writes what it consumes (the joiner's RocksDB state and output spool, the dumper's
Parquet, the trainer's snapshots) and finds the disk full would fail a write, exit and be
restarted into the same full disk: a crash loop that may leave half-written files. Instead each
one calls :meth:`DiskGuard.wait_for_space` before it takes its next input: while the free space
under its directory is below ``disk.pause_below_bytes`` the service stops consuming (Kafka keeps
the input: nothing is lost, the consumer lag grows), logs why once, sets
``driftline_disk_paused{service}`` to 1, and resumes by itself once space is back. Below
``disk.warn_below_bytes`` it warns (at most once a minute) ahead of the pause.
``driftline_disk_free_bytes{service}`` is the free space the service last saw.

>>> guard = DiskGuard("doctest", ".", pause_below_bytes=0, warn_below_bytes=0)
>>> guard.free_bytes() > 0
True
>>> import asyncio; asyncio.run(guard.wait_for_space())
0.0
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

from prometheus_client import Counter, Gauge

from services.log import Throttled

log = logging.getLogger(__name__)

DISK_FREE = Gauge(
    "driftline_disk_free_bytes", "Free bytes under the service's data directory, as it last looked.",
    ["service"], multiprocess_mode="livemin",
)
DISK_PAUSED = Gauge(
    "driftline_disk_paused", "1 while the service has stopped taking input: its disk is nearly full.",
    ["service"], multiprocess_mode="livemax",
)
DISK_PAUSES = Counter(
    "driftline_disk_pauses_total", "Times the service stopped taking input because its disk was nearly full.",
    ["service"],
)


class DiskGuard:
    """Pause a service's input while the disk under ``path`` is nearly full."""

    def __init__(self, service: str, path: Path | str, pause_below_bytes: int, warn_below_bytes: int,
                 check_s: float = 1.0) -> None:
        self.service, self.path = service, Path(path)
        self.pause_below_bytes, self.warn_below_bytes = pause_below_bytes, warn_below_bytes
        self.check_s = check_s
        self._warn = Throttled(log, 60.0)
        self._low = False  # (full(): the state last seen)
        DISK_PAUSED.labels(service).set(0)

    @classmethod
    def from_settings(cls, service: str, path: Path | str, settings: object) -> DiskGuard:
        d = settings.disk  # type: ignore[attr-defined]
        return cls(service, path, d.pause_below_bytes, d.warn_below_bytes, d.check_s)

    def free_bytes(self) -> int:
        """Free bytes for this process under ``path`` (its nearest existing parent)."""
        path = self.path
        while not path.exists() and path != path.parent:
            path = path.parent
        st = os.statvfs(path)
        free = st.f_bavail * st.f_frsize
        DISK_FREE.labels(self.service).set(free)
        return free

    def full(self) -> bool:
        """Whether the free space is below ``pause_below_bytes`` now, without waiting: for a
        service that cannot stop its input (serving refuses what it would spool instead). Sets
        the gauges and logs each change, like :meth:`wait_for_space`.

        >>> DiskGuard("doctest", ".", pause_below_bytes=1 << 62, warn_below_bytes=0).full()
        True
        """
        free = self.free_bytes()
        if free < self.warn_below_bytes:
            self._warn.warning("%s: %.0f MB free under %s (it refuses new work below %.0f MB)", self.service,
                               free / 1e6, self.path, self.pause_below_bytes / 1e6)
        low = free < self.pause_below_bytes
        if low != self._low:
            self._low = low
            DISK_PAUSED.labels(self.service).set(int(low))
            if low:
                DISK_PAUSES.labels(self.service).inc()
                log.error("%s: the disk under %s is nearly full (%.1f MB free, below %.0f MB): refusing new "
                          "work until space is freed", self.service, self.path, free / 1e6,
                          self.pause_below_bytes / 1e6)
            else:
                log.warning("%s: %.0f MB free under %s again: taking work again", self.service, free / 1e6, self.path)
        return low

    async def wait_for_space(self, stop: asyncio.Event | None = None) -> float:
        """Return at once when there is room; else wait until there is (or ``stop`` is set: a
        paused service still stops cleanly). The seconds paused."""
        free = self.free_bytes()
        if free < self.warn_below_bytes:
            self._warn.warning("%s: %.0f MB free under %s (the service pauses below %.0f MB)", self.service,
                               free / 1e6, self.path, self.pause_below_bytes / 1e6)
        if free >= self.pause_below_bytes:
            return 0.0
        started = time.monotonic()
        DISK_PAUSED.labels(self.service).set(1)
        DISK_PAUSES.labels(self.service).inc()
        log.error("%s: the disk under %s is nearly full (%.1f MB free, below %.0f MB): input paused "
                  "until space is freed (nothing is lost: the input waits in Kafka)", self.service,
                  self.path, free / 1e6, self.pause_below_bytes / 1e6)
        try:
            while self.free_bytes() < self.pause_below_bytes and not (stop is not None and stop.is_set()):
                await asyncio.sleep(self.check_s)
        finally:
            DISK_PAUSED.labels(self.service).set(0)
        paused = time.monotonic() - started
        log.warning("%s: %.0f MB free under %s again: input resumed after %.1f s", self.service,
                    self.free_bytes() / 1e6, self.path, paused)
        return paused
