"""Event-time watermarks that one far-off event cannot move: the (k+1)-th largest time seen.

A watermark that is the *maximum* event time seen jumps for good on a single far-future record
(a client clock set to 2100, a request without ``event_time_ms`` stamped with the wall clock in a
replay of old data), and then every later record is judged against it: every window closes,
every action is late or an orphan. Here the watermark is the (k+1)-th largest *distinct* event
time seen, so up to ``k`` outliers (distinct times; a re-sent outlier counts once) cannot move
it; ``k`` is ``joiner.watermark_outliers``.

It is still a pure function of the records seen, in order, so a replay of the same records
gives the same watermarks (the joiner's determinism rests on that). The price: on a stream
without outliers the watermark trails the newest event by ``k`` distinct times, so windows close
``k`` events later than with the maximum (on a sparse partition that can be a long wall-clock
time; ``idle_advance_seconds`` covers idle action partitions). The state is the ``k + 1``
largest times (a short sorted list) and the watermark value, which only rises: :meth:`raise_to`
(idle advance) lifts it without adding an event time.

>>> w = Watermark(k=2)
>>> for t in (10, 20, 30):
...     w.observe(t)
>>> w.value
10
>>> w.observe(10**15)  # one far-future outlier: no effect
>>> w.value
20
>>> w.observe(40); w.value
30
>>> w.observe(40); w.value  # a repeated time is one time
30
>>> Watermark.decode(w.encode(), k=2) == w
True
"""

from __future__ import annotations

import bisect
import struct

NO_WATERMARK = -(1 << 62)
_Q = struct.Struct("<q")


class Watermark:
    """The (k+1)-th largest distinct event time observed (or the raised value, if higher)."""

    __slots__ = ("k", "top", "value")

    def __init__(self, k: int, value: int = NO_WATERMARK, top: list[int] | None = None) -> None:
        if k < 0:
            raise ValueError(f"watermark outliers must be >= 0, not {k}")
        self.k = k
        self.top: list[int] = sorted(top or [])[-(k + 1):]  # ascending, at most k + 1 distinct times
        self.value = value

    def observe(self, t: int) -> None:
        """Account for one event at time ``t``."""
        top = self.top
        if len(top) > self.k:
            if t <= top[0]:
                return  # older than the k + 1 newest
            if t > top[-1]:
                top.append(t)  # the common case of a stream in order: a new newest
            else:
                i = bisect.bisect_left(top, t)
                if top[i] == t:
                    return
                top.insert(i, t)
            del top[0]
            if top[0] > self.value:
                self.value = top[0]
            return
        i = bisect.bisect_left(top, t)
        if i < len(top) and top[i] == t:
            return
        top.insert(i, t)
        if len(top) > self.k and top[0] > self.value:
            self.value = top[0]

    def raise_to(self, t: int) -> bool:
        """Lift the watermark to ``t`` if that is higher (idle advance); True if it moved."""
        if t <= self.value:
            return False
        self.value = t
        return True

    def encode(self) -> bytes:
        """``value`` then the top times, little-endian int64s."""
        return struct.pack(f"<{1 + len(self.top)}q", self.value, *self.top)

    @classmethod
    def decode(cls, raw: bytes | None, k: int, legacy_value: int = NO_WATERMARK) -> Watermark:
        """From :meth:`encode`'s bytes; ``None`` gives a watermark at ``legacy_value`` with no
        times seen (a store from before this rule kept only the value)."""
        if raw is None:
            return cls(k, legacy_value)
        values = struct.unpack(f"<{len(raw) // 8}q", raw)
        return cls(k, values[0], list(values[1:]))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Watermark) and (self.k, self.top, self.value) == (other.k, other.top, other.value)

    def __repr__(self) -> str:
        return f"Watermark(k={self.k}, value={self.value}, top={self.top})"
