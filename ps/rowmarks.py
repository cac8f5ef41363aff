"""Per-row flag bits, ``meta`` slots and the change-marking kernel (see :mod:`ps.rows`)."""

from __future__ import annotations

from ._jit import BoolLike, I64Array, IntLike, U8Array, njit

LIVE, DEAD, SYNC, SNAP = 1, 2, 4, 8
M_SIZE, M_HIGH, M_NFREE, M_NDIRTY, M_DHEAD, M_RNG, M_CURSOR, M_WATERMARK = range(8)


@njit
def marked(f: IntLike, track: BoolLike) -> tuple[IntLike, bool]:
    """``(new flags, whether to queue the row for sync)`` of a row with flags ``f`` that changed.

    Scalars only: per-row kernels call it in their hot loop, where a call taking arrays costs
    more than a dim-1 update."""
    f |= SNAP
    if track and not (f & SYNC):
        return f | SYNC, True
    return f, False


@njit
def mark_changed(r: IntLike, flags: U8Array, dirty: I64Array, meta: I64Array, track: BoolLike) -> None:
    f, queue = marked(flags[r], track)
    if queue:
        dirty[meta[M_NDIRTY]] = r
        meta[M_NDIRTY] += 1
    flags[r] = f


@njit
def reserve_dirty(dirty: I64Array, meta: I64Array, pushes: IntLike) -> None:
    """Make room for ``pushes`` appends to a shard's dirty list by dropping its drained head.

    Each row is queued at most once, so after compaction a batch's rows always fit."""
    if meta[M_NDIRTY] + pushes > dirty.size:
        h0 = meta[M_DHEAD]
        nd = meta[M_NDIRTY]
        if h0:
            for q in range(nd - h0):
                dirty[q] = dirty[h0 + q]
            meta[M_DHEAD] = 0
            meta[M_NDIRTY] = nd - h0
