"""``trainer.debug_slow_rank = "RANK:FACTOR"``: a straggler on purpose, **a test knob** (tests and
benchmarks of ``trainer.dist_mode = "gba"``, bench/bench_gba.py): that rank sleeps ``(FACTOR - 1)``
x its own step time after each step, so it takes FACTOR x as long as it would. Not for
production: it only slows a rank down.

>>> parse_slow_rank("1:4")
(1, 4.0)
>>> parse_slow_rank("") is None
True
>>> parse_slow_rank("one:4")
Traceback (most recent call last):
...
trainer.dist.straggler.SlowRankError: debug_slow_rank must be "RANK:FACTOR" (RANK >= 0, FACTOR >= 1), got 'one:4'
>>> Straggler(1.0).after(0.5)   # no straggler: no sleep
0.0
>>> round(Straggler(3.0).after(0.001), 6)   # slept 2 x the step
0.002
"""

from __future__ import annotations

import time

__all__ = ["SlowRankError", "Straggler", "parse_slow_rank"]


class SlowRankError(ValueError):
    """A ``debug_slow_rank`` that is not ``"RANK:FACTOR"``."""


def parse_slow_rank(spec: str) -> tuple[int, float] | None:
    """``(rank, factor)`` of ``"RANK:FACTOR"``; None for ``""`` (no straggler)."""
    if not spec:
        return None
    try:
        rank_s, factor_s = spec.split(":")
        rank, factor = int(rank_s), float(factor_s)
    except ValueError:
        rank, factor = -1, 0.0
    if rank < 0 or not factor >= 1.0:
        raise SlowRankError(f'debug_slow_rank must be "RANK:FACTOR" (RANK >= 0, FACTOR >= 1), got {spec!r}')
    return rank, factor


class Straggler:
    """Sleeps ``(factor - 1)`` x a step's seconds after it (factor 1: never)."""

    def __init__(self, factor: float = 1.0):
        self.factor = factor

    @classmethod
    def for_rank(cls, spec: str, rank: int) -> Straggler:
        """The straggler ``spec`` makes of ``rank`` (factor 1 for every other rank)."""
        parsed = parse_slow_rank(spec)
        return cls(parsed[1] if parsed is not None and parsed[0] == rank else 1.0)

    def after(self, step_s: float) -> float:
        """Sleep after a step of ``step_s`` seconds; returns the seconds slept."""
        pause = (self.factor - 1.0) * step_s
        if pause > 0:
            time.sleep(pause)
        return max(pause, 0.0)
