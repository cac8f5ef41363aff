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
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic


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
    """``numba.njit(cache=..., nogil=True, error_model="numpy")``: kernels release the GIL while they run.

    Bounds checks stay numba's default (off; ``NUMBA_BOUNDSCHECK=1`` turns them on to debug).
    No ``fastmath``: optimizer arithmetic must stay bit-exact IEEE. Division is IEEE's too
    (``error_model="numpy"``: a zero divisor gives inf or nan, no ZeroDivisionError): Python's check
    before every division kept LLVM from vectorizing the optimizers' loops (an Adagrad row's
    sqrt and division, 8 weights per instruction with it), and no kernel divides by a value that
    may be zero without testing it first.
    """
    return numba.njit(cache=CACHE, nogil=True, error_model="numpy")(fn)


#: bytes; rows of 64-byte multiples then never straddle two cache lines
ALIGN = 64


def aligned_zeros(shape, dtype, align: int = ALIGN) -> np.ndarray:
    """``np.zeros`` whose data starts on an ``align``-byte boundary.

    numpy's large allocations start 16 bytes past a page boundary, so a 64-byte
    embedding row would touch two cache lines on every read; aligned, it touches one.
    """
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    buf = np.zeros(nbytes + align, np.uint8)
    off = (-buf.ctypes.data) % align
    return buf[off:off + nbytes].view(dt).reshape(shape)


@intrinsic
def prefetch(typingctx, arr, idx):
    """``prefetch(a, i)``: hint the CPU to load the cache line holding ``a[i]`` (``a[i, 0]`` for 2-D).

    Pure hint (LLVM ``llvm.prefetch``, read, keep in all cache levels): never faults and
    has no effect on results, so an out-of-range ``i`` is harmless. Kernels issue it a
    few dozen ids ahead so that many independent cache misses are in flight at once.
    """
    if not isinstance(arr, types.Array) or not isinstance(idx, types.Integer):
        return None
    sig = types.void(arr, idx)

    def codegen(context, builder, signature, args):
        aryty, idxty = signature.args
        ary = context.make_array(aryty)(context, builder, args[0])
        i = context.cast(builder, args[1], idxty, types.intp)
        zero = context.get_constant(types.intp, 0)
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [i] + [zero] * (aryty.ndim - 1),
                                       wraparound=False)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


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


@numba.njit(cache=CACHE, nogil=True, inline="always")
def prefetch_row(a, r):
    """Prefetch every cache line of row ``r`` of a 2-D float32/int32 array (any ``r``: a hint)."""
    row = a[r]
    n = a.shape[1]
    for j in range(0, n, 16):
        prefetch(row, j)
    if n % 16:
        prefetch(row, n - 1)
