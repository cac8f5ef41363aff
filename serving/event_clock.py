"""The event time serving stamps on a request that carries none.

A request without ``event_time_ms`` used to get the wall clock. In a stack whose traffic carries
event times far from it (a replay of old data, a backfill, a client's own clock), one such
request moved a joiner partition's watermark years ahead and closed every window on it: the
examples of the real traffic became late or orphaned, and the loop stopped learning. So serving
keeps the newest event time a request of this process carried, and stamps a request without one
with it while it is recent (seen within ``fresh_s`` of wall time); with no such traffic the wall
clock it is. A stamped request can then move no watermark past what the traffic itself did.

>>> clock = EventClock(fresh_s=300.0)
>>> clock.stamp(None, now_ms=1_000_000)           # no traffic with event times: now
1000000
>>> clock.observe(946_684_800_000, now_ms=1_000_000)  # a replay of the year 2000
>>> clock.stamp(None, now_ms=1_100_000)           # 100 s later: the replay's time
946684800000
>>> clock.stamp(None, now_ms=1_400_001)           # the replay stopped 400 s ago: now again
1400001
"""

from __future__ import annotations

__all__ = ["EventClock"]


class EventClock:
    """The newest event time requests carried, and when (wall ms) it was last moved or confirmed."""

    def __init__(self, fresh_s: float) -> None:
        self.fresh_ms = fresh_s * 1000.0
        self.newest_ms: int | None = None
        self._seen_at_ms = 0

    def observe(self, event_time_ms: int, now_ms: int) -> None:
        if self.newest_ms is None or event_time_ms >= self.newest_ms or now_ms - self._seen_at_ms > self.fresh_ms:
            self.newest_ms = event_time_ms
        self._seen_at_ms = now_ms

    def stamp(self, event_time_ms: int | None, now_ms: int) -> int:
        """``event_time_ms`` when given, else the traffic's newest event time while fresh, else now."""
        if event_time_ms is not None:
            return event_time_ms
        if self.newest_ms is not None and now_ms - self._seen_at_ms <= self.fresh_ms:
            return self.newest_ms
        return now_ms
