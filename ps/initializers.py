"""Row initializers: zeros, uniform, normal, each a pure function of ``(seed, id, column)``.

Because no RNG state is consumed, a row's initial value does not depend on insertion
order, sharding or which process inserts it.

>>> a = init_rows(np.array([3, 4], np.int64), 4, INIT_UNIFORM, 0.5, 42)
>>> b = init_rows(np.array([4], np.int64), 4, INIT_UNIFORM, 0.5, 42)
>>> bool((a[1] == b[0]).all()), bool((abs(a) <= 0.5).all()), a.dtype
(True, True, dtype('float32'))
"""

from __future__ import annotations

import math

import numpy as np

from ._jit import F32Array, FloatLike, I64Array, IntLike, njit, uniform01

INIT_ZEROS, INIT_UNIFORM, INIT_NORMAL = 0, 1, 2
KINDS = {"zeros": INIT_ZEROS, "uniform": INIT_UNIFORM, "normal": INIT_NORMAL}


@njit
def init_row(out_row: F32Array, key: IntLike, kind: IntLike, scale: FloatLike, seed: IntLike) -> None:
    """Fill ``out_row`` (float32[dim]) with the initial weights of ``key``."""
    dim = out_row.size
    if kind == INIT_ZEROS:
        out_row[:] = 0.0
    elif kind == INIT_UNIFORM:
        for j in range(dim):
            out_row[j] = np.float32((2.0 * uniform01(key, seed, j) - 1.0) * scale)
    else:
        for j in range(dim):
            # Box-Muller on two draws; 1-u keeps log() away from 0
            u1 = 1.0 - uniform01(key, seed, 2 * j)
            u2 = uniform01(key, seed, 2 * j + 1)
            out_row[j] = np.float32(math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2) * scale)


@njit
def _init_many(keys: I64Array, out: F32Array, kind: IntLike, scale: FloatLike, seed: IntLike) -> None:
    for i in range(keys.size):
        init_row(out[i], keys[i], kind, scale, seed)


def init_rows(keys: np.ndarray, dim: int, kind: int, scale: float, seed: int) -> np.ndarray:
    """The initial rows of ``keys`` as float32 ``[len(keys), dim]``."""
    out = np.empty((keys.size, dim), np.float32)
    _init_many(keys, out, kind, float(scale), seed)
    return out
