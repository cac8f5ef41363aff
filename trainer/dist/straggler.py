"""``trainer.debug_slow_rank = "RANK:FACTOR"`` or ``"RANK:FACTOR:FROM-UNTIL"``: a straggler on
purpose, **a test knob** (tests and benchmarks of ``trainer.dist_mode = "gba"`` and ``"auto"``,
bench/bench_gba.py, the online ranks of :mod:`trainer.dist.rank_trainer`): that rank sleeps
``(FACTOR - 1)`` x its own step's work after each step, so it takes FACTOR x as long as it would.
With ``FROM-UNTIL`` only that rank's steps ``FROM`` to ``UNTIL - 1`` (counted from 0 in this
process) are slowed: a straggler that comes and goes (``dist_mode = "auto"`` switches to gba and
back, tests/trainer/distributed/test_mode_switch.py). Steps, not seconds: what a rank does at its
k-th step does not depend on how loaded the machine is. Not for production: it only slows a rank.

>>> parse_slow_rank("1:4")
SlowRankSpec(rank=1, factor=4.0, start=0, until=None)
>>> parse_slow_rank("0:3:10-40")
SlowRankSpec(rank=0, factor=3.0, start=10, until=40)
>>> parse_slow_rank("") is None
True
>>> parse_slow_rank("one:4")
Traceback (most recent call last):
...
trainer.dist.straggler.SlowRankError: debug_slow_rank must be "RANK:FACTOR" or "RANK:FACTOR:FROM-UNTIL" (RANK >= 0, FACTOR >= 1, FROM <= UNTIL), got 'one:4'
>>> parse_slow_rank("1:2:9-3")
Traceback (most recent call last):
...
trainer.dist.straggler.SlowRankError: debug_slow_rank must be "RANK:FACTOR" or "RANK:FACTOR:FROM-UNTIL" (RANK >= 0, FACTOR >= 1, FROM <= UNTIL), got '1:2:9-3'
>>> Straggler(1.0).after(0.5)   # no straggler: no sleep
0.0
>>> round(Straggler(3.0).after(0.001), 6)   # slept 2 x the step
0.002
>>> s = Straggler(3.0, start=1, until=2)    # only its step 1 is slowed
>>> s.after(0.001), round(s.after(0.001), 6), s.after(0.001)
(0.0, 0.002, 0.0)
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

log = logging.getLogger(__name__)

__all__ = ["SlowRankError", "SlowRankSpec", "Straggler", "parse_slow_rank"]


class SlowRankError(ValueError):
    """A ``debug_slow_rank`` that is not ``"RANK:FACTOR"`` or ``"RANK:FACTOR:FROM-UNTIL"``."""


class SlowRankSpec(NamedTuple):
    """A parsed ``debug_slow_rank``: ``until`` None slows every step from ``start`` on."""

    rank: int
    factor: float
    start: int = 0
    until: int | None = None


def parse_slow_rank(spec: str) -> SlowRankSpec | None:
    """The :class:`SlowRankSpec` of ``spec``; None for ``""`` (no straggler)."""
    if not spec:
        return None
    try:
        rank_s, factor_s, *window = spec.split(":")
        start, until = (int(x) for x in window[0].split("-")) if window else (0, None)
        if len(window) > 1:
            raise ValueError(spec)
        got = SlowRankSpec(int(rank_s), float(factor_s), start, until)
    except ValueError:
        got = SlowRankSpec(-1, 0.0)
    if got.rank < 0 or not got.factor >= 1.0 or got.start < 0 or (got.until is not None and got.until < got.start):
        raise SlowRankError('debug_slow_rank must be "RANK:FACTOR" or "RANK:FACTOR:FROM-UNTIL" '
                            f"(RANK >= 0, FACTOR >= 1, FROM <= UNTIL), got {spec!r}")
    return got


class Straggler:
    """Sleeps ``(factor - 1)`` x a step's seconds after it (factor 1: never); with ``start`` /
    ``until`` only after its steps ``start`` .. ``until - 1`` (every call of :meth:`after` is a step)."""

    def __init__(self, factor: float = 1.0, start: int = 0, until: int | None = None):
        self.factor, self.start, self.until = factor, start, until
        self.steps = 0

    @classmethod
    def for_rank(cls, spec: str, rank: int) -> Straggler:
        """The straggler ``spec`` makes of ``rank`` (factor 1 for every other rank)."""
        parsed = parse_slow_rank(spec)
        if parsed is None or parsed.rank != rank:
            return cls()
        return cls(parsed.factor, parsed.start, parsed.until)

    def after(self, step_s: float) -> float:
        """Sleep after a step of ``step_s`` seconds; returns the seconds slept."""
        k, self.steps = self.steps, self.steps + 1
        if k < self.start or (self.until is not None and k >= self.until):
            return 0.0
        pause = (self.factor - 1.0) * step_s
        if pause > 0:
            time.sleep(pause)
        if self.until is not None and k == self.until - 1 and self.factor > 1.0:
            log.info("debug_slow_rank: the slowed steps are over (step %d)", k)
        return max(pause, 0.0)
