"""Deterministic negative sampling: the same example id and seed always give the same decision.

>>> keep("r1/5", 0.25, seed=7) == keep("r1/5", 0.25, seed=7)
True
>>> keep("r1/5", 1.0, seed=7)
True
"""

from __future__ import annotations

import functools
import hashlib

_SCALE = float(1 << 64)


@functools.lru_cache(maxsize=16)
def _keyed(seed: int) -> hashlib._Hash:
    return hashlib.blake2b(digest_size=8, key=seed.to_bytes(8, "little", signed=True))


def uniform(example_id: str | bytes, seed: int) -> float:
    """A number in [0, 1) fixed by (example_id, seed): blake2b, so it is the same on every
    machine and Python version (unlike ``hash()``)."""
    data = example_id.encode() if isinstance(example_id, str) else example_id
    h = _keyed(seed).copy()  # the keyed state, without re-keying per call
    h.update(data)
    return int.from_bytes(h.digest(), "little") / _SCALE


def keep(example_id: str | bytes, rate: float, seed: int) -> bool:
    """Keep a negative with probability ``rate``."""
    return rate >= 1.0 or uniform(example_id, seed) < rate
