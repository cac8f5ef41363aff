"""numba plumbing shared by the kernels: ``njit`` with a safe cache (:mod:`ps._kernel_cache`),
and the id hashes.

>>> int(mix64(np.int64(-1))) == int(mix64(np.int64(-1)))  # any int64 is a valid id
True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar, cast

import numba
import numpy as np
import numpy.typing as npt
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic
from numba.typed import List

from ._kernel_cache import CACHE, cached

if TYPE_CHECKING:
    from numba.core.dispatcher import Dispatcher
    from numba.core.typing.templates import Signature

# Annotations of the kernels' arguments. numba ignores them (it compiles for the types of the
# values passed); they let mypy check the callers. Scalars come as Python or numpy numbers.
I64Array: TypeAlias = npt.NDArray[np.int64]
F32Array: TypeAlias = npt.NDArray[np.float32]
F64Array: TypeAlias = npt.NDArray[np.float64]
U8Array: TypeAlias = npt.NDArray[np.uint8]
U16Array: TypeAlias = npt.NDArray[np.uint16]
BoolArray: TypeAlias = npt.NDArray[np.bool_]
IntLike: TypeAlias = int | np.integer[Any]
FloatLike: TypeAlias = float | np.floating[Any]
BoolLike: TypeAlias = bool | np.bool_

_F = TypeVar("_F", bound=Callable[..., Any])


def njit(fn: _F) -> Dispatcher[_F]:
    """``numba.njit(cache=..., nogil=True, error_model="numpy")``: kernels release the GIL while they run.

    Bounds checks stay numba's default (off; ``NUMBA_BOUNDSCHECK=1`` turns them on to debug).
    No ``fastmath``: optimizer arithmetic must stay bit-exact IEEE. Division is IEEE's too
    (``error_model="numpy"``: a zero divisor gives inf or nan, no ZeroDivisionError): Python's check
    before every division kept LLVM from vectorizing the optimizers' loops (an Adagrad row's
    sqrt and division, 8 weights per instruction with it), and no kernel divides by a value that
    may be zero without testing it first.
    """
    kernel = numba.njit(cache=CACHE, nogil=True, error_model="numpy")(fn)
    return cached(kernel) if CACHE else kernel


@njit
def _list_of(first: np.ndarray) -> List[np.ndarray]:
    out = List()
    out.append(first)
    return out


@njit
def _append(items: List[np.ndarray], a: np.ndarray) -> None:
    items.append(a)


def typed_list(arrays: Sequence[np.ndarray]) -> List[np.ndarray]:
    """``numba.typed.List(arrays)`` (non-empty, one array type), built by cached kernels.

    The typed list's own methods are compiled in every process that first builds a list of an
    element type, never cached (~0.3 s a type; the PS's seven lists cost a trainer ~3 s at each
    start); these two are compiled once per element type and cached like every kernel.

    >>> xs = typed_list([np.zeros(2, np.int64), np.ones(3, np.int64)])
    >>> [x.tolist() for x in xs]
    [[0, 0], [1, 1, 1]]
    """
    out = _list_of(arrays[0])
    for a in arrays[1:]:
        _append(out, a)
    return out


#: bytes; rows of 64-byte multiples then never straddle two cache lines
ALIGN = 64


def aligned_zeros(shape: IntLike | tuple[IntLike, ...], dtype: npt.DTypeLike, align: int = ALIGN) -> np.ndarray:
    """``np.zeros`` whose data starts on an ``align``-byte boundary.

    numpy's large allocations start 16 bytes past a page boundary, so a 64-byte
    embedding row would touch two cache lines on every read; aligned, it touches one.
    """
    dims = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
    dt = np.dtype(dtype)
    nbytes = int(np.prod(dims, dtype=np.int64)) * dt.itemsize
    buf = np.zeros(nbytes + align, np.uint8)
    off = (-buf.ctypes.data) % align
    out: np.ndarray = buf[off:off + nbytes].view(dt).reshape(dims)
    return out


#: numba's lowering context (``numba.core.base.BaseContext``) is not annotated: ``Any``
_Codegen: TypeAlias = Callable[[Any, ir.IRBuilder, "Signature", list[ir.Value]], ir.Value]


@intrinsic
def _prefetch(typingctx: object, arr: types.Type, idx: types.Type) -> tuple[Signature, _Codegen] | None:
    """``prefetch(a, i)``: hint the CPU to load the cache line holding ``a[i]`` (``a[i, 0]`` for 2-D).

    Pure hint (LLVM ``llvm.prefetch``, read, keep in all cache levels): never faults and
    has no effect on results, so an out-of-range ``i`` is harmless. Kernels issue it a
    few dozen ids ahead so that many independent cache misses are in flight at once.
    """
    if not isinstance(arr, types.Array) or not isinstance(idx, types.Integer):
        return None
    sig = types.void(arr, idx)

    def codegen(context: Any, builder: ir.IRBuilder, signature: Signature, args: list[ir.Value]) -> ir.Value:
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


#: numba's stubs type an intrinsic's call with its typing function's arguments, ``typingctx``
#: first (numba supplies it); in a kernel it is called with the rest, as this says.
prefetch = cast("Callable[[np.ndarray, IntLike], None]", _prefetch)


_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)
_GOLD = np.uint64(0x9E3779B97F4A7C15)
_S11 = np.uint64(11)
_INV53 = 1.0 / 9007199254740992.0  # 2**-53


@njit
def mix64(key: IntLike) -> np.uint64:
    """murmur3 fmix64 of an int64 (bit-reinterpreted as uint64): a bijection, so distinct ids never hash-collide in 64 bits."""
    x = np.uint64(key)
    x ^= x >> _S33
    x *= _M1
    x ^= x >> _S33
    x *= _M2
    x ^= x >> _S33
    return x


@njit
def mix64_seeded(key: IntLike, seed: IntLike) -> np.uint64:
    """A second, independent hash family (for shards, sketch rows and random draws)."""
    return mix64(np.int64(mix64(np.int64(np.uint64(key) ^ (np.uint64(seed) * _GOLD + _GOLD)))))


@njit
def uniform01(key: IntLike, seed: IntLike, counter: IntLike) -> np.float64:
    """A uniform float64 in [0, 1) that is a pure function of (key, seed, counter)."""
    h = mix64_seeded(np.int64(np.uint64(key) + np.uint64(counter) * _GOLD), seed)
    return np.float64(h >> _S11) * _INV53


@numba.njit(cache=CACHE, nogil=True, inline="always")
def prefetch_row(a: np.ndarray, r: IntLike) -> None:
    """Prefetch every cache line of row ``r`` of a 2-D float32/int32 array (any ``r``: a hint)."""
    row = a[r]
    n = a.shape[1]
    for j in range(0, n, 16):
        prefetch(row, j)
    if n % 16:
        prefetch(row, n - 1)
