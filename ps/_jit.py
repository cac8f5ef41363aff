"""numba plumbing shared by the kernels: ``njit`` with a safe cache, and the id hashes.

Caching is on only when numba can write its cache (beside the sources, or in
``NUMBA_CACHE_DIR``); a read-only checkout still works, it just compiles each run.

>>> int(mix64(np.int64(-1))) == int(mix64(np.int64(-1)))  # any int64 is a valid id
True
"""

from __future__ import annotations

import os
import tempfile

import numba
import numpy as np


def _cache_writable() -> bool:
    target = os.environ.get("NUMBA_CACHE_DIR") or os.path.join(os.path.dirname(__file__), "__pycache__")
    try:
        os.makedirs(target, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target):
            return True
    except OSError:
        return False


CACHE = _cache_writable()


def njit(fn):
    """``numba.njit(cache=..., nogil=True)``: kernels release the GIL while they run."""
    return numba.njit(cache=CACHE, nogil=True)(fn)


_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)
_GOLD = np.uint64(0x9E3779B97F4A7C15)
_S11 = np.uint64(11)
_INV53 = 1.0 / 9007199254740992.0  # 2**-53


@njit
def mix64(key):
    """murmur3 fmix64 of an int64 (bit-reinterpreted as uint64): a bijection, so distinct ids never hash-collide in 64 bits."""
    x = np.uint64(key)
    x ^= x >> _S33
    x *= _M1
    x ^= x >> _S33
    x *= _M2
    x ^= x >> _S33
    return x


@njit
def mix64_seeded(key, seed):
    """A second, independent hash family (for shards, sketch rows and random draws)."""
    return mix64(np.int64(mix64(np.int64(np.uint64(key) ^ (np.uint64(seed) * _GOLD + _GOLD)))))


@njit
def uniform01(key, seed, counter):
    """A uniform float64 in [0, 1) that is a pure function of (key, seed, counter)."""
    h = mix64_seeded(np.int64(np.uint64(key) + np.uint64(counter) * _GOLD), seed)
    return np.float64(h >> _S11) * _INV53
