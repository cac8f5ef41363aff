"""Row-lifecycle kernels: allocate, insert (with admission + init), delete, expire, drain.

A shard keeps its rows in plain arrays indexed by row number (``emb``, optimizer
``state``, ``row_keys``, ``times``, ``flags``) next to the hash index. Per-row flags:

* ``LIVE``  the row is mapped by the index;
* ``DEAD``  deleted/expired, kept only until the touched-key stream reports its tombstone;
* ``SYNC``  queued in the ``dirty`` list (changed since the last drain);
* ``SNAP``  changed since the last snapshot.

A row is queued at most once (``SYNC`` guards the append), and a dead row is only
reused after it has been drained, so the dirty list never needs more entries than
the table has rows and no change can be lost. Scalar bookkeeping lives in ``meta``
(int64[8]) so kernels can update it in place.
"""

from __future__ import annotations

import numpy as np

from ._jit import BoolLike, F32Array, F64Array, FloatLike, I64Array, IntLike, U8Array, U16Array, njit, prefetch_row
from .admission import admit
from .hashmap import GROUP, probe, remove
from .initializers import init_row
from .optimizers import init_state
from .rowmarks import (
    DEAD,
    LIVE,
    M_CURSOR,
    M_DHEAD,
    M_HIGH,
    M_NDIRTY,
    M_NFREE,
    M_RNG,
    M_SIZE,
    M_WATERMARK,
    SNAP,
    SYNC,
    mark_changed,
)

__all__ = ["DEAD", "LIVE", "M_CURSOR", "M_DHEAD", "M_HIGH", "M_NDIRTY", "M_NFREE", "M_RNG", "M_SIZE", "M_WATERMARK",
           "META_FIELDS", "SNAP", "SYNC", "alloc_row", "delete_kernel", "expire_kernel", "gather_rows_kernel",
           "insert_kernel", "mark_changed", "pop_kernel", "rebuild_index", "release_row", "upsert_kernel"]

META_FIELDS = ("size", "high", "nfree", "ndirty", "dhead", "rng", "cursor", "watermark")


@njit
def alloc_row(meta: I64Array, free: I64Array) -> np.int64:
    if meta[M_NFREE] > 0:
        meta[M_NFREE] -= 1
        reused: np.int64 = free[meta[M_NFREE]]
        return reused
    r: np.int64 = meta[M_HIGH]
    meta[M_HIGH] += 1
    return r


@njit
def release_row(r: IntLike, flags: U8Array, dirty: I64Array, free: I64Array, meta: I64Array, track: BoolLike) -> None:
    """The row left the index: keep it as a pending tombstone, or free it at once."""
    if track:
        f = (flags[r] & ~(LIVE | SNAP)) | DEAD
        if not (f & SYNC):
            f |= SYNC
            dirty[meta[M_NDIRTY]] = r
            meta[M_NDIRTY] += 1
        flags[r] = f
    else:
        flags[r] = 0
        free[meta[M_NFREE]] = r
        meta[M_NFREE] += 1


@njit
def insert_kernel(slots: I64Array, mask: IntLike, keys: I64Array, out: I64Array, emb: F32Array, state: F32Array,
                  row_keys: I64Array, times: I64Array, flags: U8Array, free: I64Array, dirty: I64Array, meta: I64Array,
                  tarr: I64Array, track: BoolLike, init_kind: IntLike, init_scale: FloatLike, init_seed: IntLike,
                  opt_kind: IntLike, hyper: F64Array, sketch: U16Array, adm_seed: IntLike, min_count: IntLike,
                  probability: FloatLike) -> None:
    """Resolve ``keys``; admit and initialise the missing ones. ``out`` gets row or -1."""
    has_state = state.shape[1] > 0
    for i in range(keys.size):
        key = keys[i]
        h = probe(slots, mask, key)
        if slots[h, 1] >= 0:
            out[i] = slots[h, 1]
            continue
        if not admit(sketch, adm_seed, min_count, probability, meta, M_RNG, key):
            out[i] = -1
            continue
        r = alloc_row(meta, free)
        slots[h, 0] = key
        slots[h, 1] = r
        meta[M_SIZE] += 1
        row_keys[r] = key
        times[r] = tarr[i] if tarr.size > 1 else tarr[0]
        flags[r] = LIVE
        mark_changed(r, flags, dirty, meta, track)
        init_row(emb[r], key, init_kind, init_scale, init_seed)
        if has_state:
            init_state(emb[r], state[r], opt_kind, hyper)
        out[i] = r


@njit
def gather_rows_kernel(rows: I64Array, emb: F32Array, out: F32Array) -> int:
    """``out[i] = emb[rows[i]]`` (zeros where ``rows[i] < 0``); returns how many were < 0.

    Rows are prefetched :data:`~ps.hashmap.GROUP` ahead so that many misses overlap.
    """
    dim = emb.shape[1]
    n = rows.size
    missing = 0
    for i in range(min(n, GROUP)):
        prefetch_row(emb, rows[i])
    for i in range(n):
        if i + GROUP < n:
            prefetch_row(emb, rows[i + GROUP])
        r = rows[i]
        if r >= 0:
            for j in range(dim):
                out[i, j] = emb[r, j]
        else:
            missing += 1
            for j in range(dim):
                out[i, j] = 0.0
    return missing


@njit
def upsert_kernel(slots: I64Array, mask: IntLike, keys: I64Array, values: F32Array, vtimes: I64Array, emb: F32Array,
                  row_keys: I64Array, times: I64Array, flags: U8Array, free: I64Array, dirty: I64Array, meta: I64Array,
                  track: BoolLike) -> None:
    """Replica side: write rows as given (insert when absent)."""
    dim = emb.shape[1]
    for i in range(keys.size):
        key = keys[i]
        h = probe(slots, mask, key)
        r = slots[h, 1]
        if r < 0:
            r = alloc_row(meta, free)
            slots[h, 0] = key
            slots[h, 1] = r
            meta[M_SIZE] += 1
            row_keys[r] = key
            flags[r] = LIVE
        for j in range(dim):
            emb[r, j] = values[i, j]
        times[r] = vtimes[i] if vtimes.size > 1 else vtimes[0]
        mark_changed(r, flags, dirty, meta, track)


@njit
def delete_kernel(slots: I64Array, mask: IntLike, keys: I64Array, flags: U8Array, dirty: I64Array, free: I64Array,
                  meta: I64Array, track: BoolLike) -> int:
    n = 0
    for i in range(keys.size):
        r = remove(slots, mask, keys[i])
        if r >= 0:
            meta[M_SIZE] -= 1
            release_row(r, flags, dirty, free, meta, track)
            n += 1
    return n


@njit
def expire_kernel(slots: I64Array, mask: IntLike, row_keys: I64Array, times: I64Array, flags: U8Array, dirty: I64Array,
                  free: I64Array, meta: I64Array, track: BoolLike, cutoff: IntLike, budget: IntLike) -> int:
    """Evict live rows last updated before ``cutoff``, scanning at most ``budget`` rows.

    A cursor remembers where the scan stopped, so repeated calls sweep the whole table
    with bounded work (and lock hold time) per call.
    """
    high = meta[M_HIGH]
    if high == 0:
        return 0
    c = meta[M_CURSOR] % high
    evicted = 0
    for _ in range(min(budget, high)):
        if (flags[c] & LIVE) and times[c] < cutoff:
            remove(slots, mask, row_keys[c])
            meta[M_SIZE] -= 1
            release_row(c, flags, dirty, free, meta, track)
            evicted += 1
        c += 1
        if c == high:
            c = 0
    meta[M_CURSOR] = c
    return evicted


@njit
def pop_kernel(slots: I64Array, mask: IntLike, row_keys: I64Array, flags: U8Array, dirty: I64Array, free: I64Array,
               meta: I64Array, max_items: IntLike, up_rows: I64Array, tomb_keys: I64Array) -> tuple[int, int]:
    """Drain up to ``max_items`` queued rows into upserts (live) and tombstones (dead).

    A dead row whose key is live again (re-inserted since) yields no tombstone: the new
    row is queued too and carries the key's final state, so chunk order cannot matter.
    """
    h = meta[M_DHEAD]
    end = min(meta[M_NDIRTY], h + max_items)
    nu = 0
    nt = 0
    for p in range(h, end):
        r = dirty[p]
        f = flags[r] & ~SYNC
        if f & LIVE:
            up_rows[nu] = r
            nu += 1
            flags[r] = f
        elif f & DEAD:
            key = row_keys[r]
            if slots[probe(slots, mask, key), 1] < 0:
                tomb_keys[nt] = key
                nt += 1
            flags[r] = 0
            free[meta[M_NFREE]] = r
            meta[M_NFREE] += 1
        else:
            flags[r] = f
    meta[M_DHEAD] = end
    if end == meta[M_NDIRTY]:
        meta[M_DHEAD] = 0
        meta[M_NDIRTY] = 0
    return nu, nt


@njit
def rebuild_index(slots: I64Array, mask: IntLike, row_keys: I64Array, flags: U8Array, high: IntLike) -> int:
    n = 0
    for r in range(high):
        if flags[r] & LIVE:
            h = probe(slots, mask, row_keys[r])
            slots[h, 0] = row_keys[r]
            slots[h, 1] = r
            n += 1
    return n
