"""Admission filters: which unseen ids deserve a row.

Two independent gates, both per table (:class:`ps.config.AdmissionConfig`):

* an *occurrence threshold* from a count-min sketch with conservative update and
  16-bit saturating counters (thresholds up to 65535; open-source Monolith's 4-bit
  counters stop at 15), and
* *probabilistic admission*: each occurrence of a not-yet-admitted id admits it with
  probability ``p``. Draws are a pure function of ``(seed, id, draw counter)`` so a
  replay of the same stream admits the same ids.

Only misses are counted; admitted ids never touch the sketch again. Ids that are not
admitted take no memory in the table and read as zeros.

>>> s = CountMinSketch(width=1024, depth=4, seed=1)
>>> [int(c) for c in s.add(np.array([5, 5, 9, 5], np.int64))]
[1, 2, 1, 3]
>>> int(s.estimate(np.array([5], np.int64))[0])
3
"""

from __future__ import annotations

import numpy as np

from ._jit import FloatLike, I64Array, IntLike, U16Array, mix64_seeded, njit, uniform01

MAX_COUNT = 65535


@njit
def sketch_add(sketch: U16Array, key: IntLike, seed: IntLike) -> IntLike:
    """Count one occurrence of ``key``; returns its estimated count afterwards."""
    depth, width = sketch.shape
    lo = sketch_estimate(sketch, key, seed)
    new = lo + 1 if lo < MAX_COUNT else MAX_COUNT
    # conservative update: only counters below the new estimate move, which keeps
    # overestimation far below plain count-min for skewed (Zipf) streams
    for d in range(depth):
        j = np.int64(mix64_seeded(key, seed + d) % np.uint64(width))
        if sketch[d, j] < new:
            sketch[d, j] = new
    return new


@njit
def sketch_estimate(sketch: U16Array, key: IntLike, seed: IntLike) -> IntLike:
    depth, width = sketch.shape
    lo: IntLike = MAX_COUNT
    for d in range(depth):
        c = np.int64(sketch[d, np.int64(mix64_seeded(key, seed + d) % np.uint64(width))])
        if c < lo:
            lo = c
    return lo


@njit
def admit(sketch: U16Array, seed: IntLike, min_count: IntLike, probability: FloatLike, meta: I64Array, rng_slot: IntLike,
          key: IntLike) -> bool:
    """Decide one occurrence of a missing ``key`` (counts it as a side effect)."""
    if min_count > 1:
        if sketch_add(sketch, key, seed) < min_count:
            return False
    if probability < 1.0:
        u = uniform01(key, seed ^ 0x5DEECE66D, meta[rng_slot])
        meta[rng_slot] += 1
        if u >= probability:
            return False
    return True


@njit
def _add_many(sketch: U16Array, seed: IntLike, keys: I64Array, out: I64Array) -> None:
    for i in range(keys.size):
        out[i] = sketch_add(sketch, keys[i], seed)


@njit
def _estimate_many(sketch: U16Array, seed: IntLike, keys: I64Array, out: I64Array) -> None:
    for i in range(keys.size):
        out[i] = sketch_estimate(sketch, keys[i], seed)


class CountMinSketch:
    """A standalone count-min sketch (the tables embed the same kernels)."""

    def __init__(self, width: int = 1 << 18, depth: int = 4, seed: int = 0) -> None:
        self.counts = np.zeros((depth, width), np.uint16)
        self.seed = seed

    def add(self, keys: np.ndarray) -> np.ndarray:
        """Count each key occurrence in order; returns the estimate after each."""
        out = np.empty(keys.size, np.int64)
        _add_many(self.counts, self.seed, keys, out)
        return out

    def estimate(self, keys: np.ndarray) -> np.ndarray:
        out = np.empty(keys.size, np.int64)
        _estimate_many(self.counts, self.seed, keys, out)
        return out
