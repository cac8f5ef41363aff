"""The packed kernels behind :class:`ps.server.ParameterServer` (PICASSO-style packing): one numba
call resolves, reads or updates the ids of every slot of a batch, over every table and shard."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._jit import BoolArray, F32Array, F64Array, I64Array, IntLike, U8Array, njit, prefetch, prefetch_row
from .hashmap import GROUP, home, resolve
from .optimizers import DEDUPE_GROUP, apply_updates, clear_slots, dedupe_capacity, find_slot, prefetch_homes
from .rowmarks import M_WATERMARK, reserve_dirty
from .sharding import shard_index

__all__ = ["all_finite", "packed_apply_kernel", "packed_dedupe", "packed_gather_kernel", "segment"]

# The per-shard array lists the kernels take are numba typed lists (``numba.typed.List``, a
# MutableSequence; numba leaves it untyped): annotated as the Sequence they are.


@njit
def segment(s: int, seg_off: I64Array, seg_table: I64Array, tab_base: I64Array,
            tab_nshards: I64Array) -> tuple[int, int, int, int]:
    """Segment ``s`` of a packed batch: its table's first shard and shard count, its ids' span."""
    t = seg_table[s]
    return tab_base[t], tab_nshards[t], seg_off[s], seg_off[s + 1]


@njit
def packed_gather_kernel(ids: I64Array, seg_off: I64Array, seg_table: I64Array, tab_base: I64Array,
                         tab_nshards: I64Array, slots_list: Sequence[I64Array], emb_list: Sequence[F32Array],
                         out: F32Array, out_off: I64Array, rows: I64Array, shard_of: I64Array) -> None:
    """Resolve and copy every slot of a packed batch; rows[i] = -1 where absent (zeros out).

    Per (slot, shard), ids go through in groups of :data:`~ps.hashmap.GROUP`: hash and
    prefetch home slots, resolve and prefetch rows, then copy, so misses overlap.
    """
    pos = np.empty(GROUP, np.int64)
    hs = np.empty(GROUP, np.int64)
    for s in range(seg_table.size):
        base, ns, a, b = segment(s, seg_off, seg_table, tab_base, tab_nshards)
        if ns > 1:
            for i in range(a, b):
                shard_of[i] = base + shard_index(ids[i], ns)
        else:
            for i in range(a, b):
                shard_of[i] = base
        for sh in range(base, base + ns):
            slots = slots_list[sh]
            emb = emb_list[sh]
            mask = slots.shape[0] - 1
            dim = emb.shape[1]
            i = a
            while i < b:
                m = 0
                while i < b and m < GROUP:
                    if shard_of[i] == sh:
                        pos[m] = i
                        h = home(ids[i], mask)
                        hs[m] = h
                        prefetch(slots, h)
                        m += 1
                    i += 1
                for q in range(m):
                    p = pos[q]
                    r = resolve(slots, mask, ids[p], hs[q])
                    rows[p] = r
                    prefetch_row(emb, r)
                for q in range(m):
                    p = pos[q]
                    r = rows[p]
                    o = out_off[s] + (p - a) * dim
                    if r >= 0:
                        for j in range(dim):
                            out[o + j] = emb[r, j]
                    else:
                        for j in range(dim):
                            out[o + j] = 0.0


@njit
def packed_dedupe(ids_rows: I64Array, pos: I64Array, gst: I64Array, m: IntLike, dim: IntLike, grads: F32Array,
                  tarr: I64Array) -> tuple[int, I64Array, F32Array, I64Array]:
    """:func:`ps.optimizers.dedupe_into` over rows ``ids_rows[:m]`` whose gradients start at
    ``grads[gst[q]]`` (the packed buffer, no per-slot copies) and whose times are ``tarr[pos[q]]``
    (or ``tarr[0]``). Same order, same float32 sums: bit-identical to the per-table path."""
    tab = np.empty((dedupe_capacity(m), 2), np.int64)
    mask = clear_slots(tab)
    urows = np.empty(m, np.int64)
    ugrads = np.empty((m, dim), np.float32)
    utimes = np.empty(m, np.int64)
    one_time = tarr.size == 1
    hs = np.empty(DEDUPE_GROUP, np.int64)
    k = 0
    for b in range(0, m, DEDUPE_GROUP):
        e = min(m, b + DEDUPE_GROUP)
        prefetch_homes(ids_rows, b, e, hs, tab, mask)
        for q in range(b, e):
            r = ids_rows[q]
            if r < 0:
                continue
            t = tarr[0] if one_time else tarr[pos[q]]
            h = find_slot(tab, hs[q - b], r, mask)
            g0 = gst[q]
            if tab[h, 0] < 0:
                tab[h, 0] = r
                tab[h, 1] = k
                urows[k] = r
                utimes[k] = t
                for j in range(dim):
                    ugrads[k, j] = np.float32(0.0) + grads[g0 + j]
                k += 1
            else:
                p = tab[h, 1]
                if t > utimes[p]:
                    utimes[p] = t
                for j in range(dim):
                    ugrads[p, j] += grads[g0 + j]
    return k, urows, ugrads, utimes


@njit
def packed_apply_kernel(ids: I64Array, seg_off: I64Array, seg_table: I64Array, grads: F32Array, grad_off: I64Array,
                        tarr: I64Array, tab_base: I64Array, tab_nshards: I64Array, tab_dim: I64Array,
                        tab_kind: I64Array, tab_hyper: F64Array, tab_track: BoolArray, tab_present: BoolArray,
                        slots_list: Sequence[I64Array], emb_list: Sequence[F32Array], state_list: Sequence[F32Array],
                        times_list: Sequence[I64Array], flags_list: Sequence[U8Array], dirty_list: Sequence[I64Array],
                        meta_list: Sequence[I64Array], shard_n: I64Array, shard_k: I64Array) -> None:
    """One optimizer step on every table of a packed batch, from one packed gradient buffer.

    Per (table, shard), in batch order: the ids' rows are resolved (prefetched a group ahead),
    gradients of equal rows summed (slots sharing a table are summed together) and each row
    stepped, exactly as :meth:`ps.shard.TableShard.apply_gradients` does per call; ``shard_n``
    and ``shard_k`` get each shard's ids and updated rows."""
    n = ids.size
    nseg = seg_table.size
    shard_of = np.empty(n, np.int64)
    for s in range(nseg):
        t = seg_table[s]
        base = tab_base[t]
        ns = tab_nshards[t]
        for i in range(seg_off[s], seg_off[s + 1]):
            shard_of[i] = base + shard_index(ids[i], ns) if ns > 1 else base
    pos = np.empty(n, np.int64)
    gst = np.empty(n, np.int64)
    rows = np.empty(n, np.int64)
    hs = np.empty(GROUP, np.int64)
    one_time = tarr.size == 1
    for t in range(tab_base.size):
        if not tab_present[t]:
            continue
        dim = tab_dim[t]
        base = tab_base[t]
        ns = tab_nshards[t]
        for sh in range(base, base + ns):
            m = 0
            for s in range(nseg):
                if seg_table[s] != t:
                    continue
                a = seg_off[s]
                for i in range(a, seg_off[s + 1]):
                    if shard_of[i] == sh:
                        pos[m] = i
                        gst[m] = grad_off[s] + (i - a) * dim
                        m += 1
            shard_n[sh] = m
            shard_k[sh] = 0
            meta = meta_list[sh]
            # the watermark moves as the per-shard calls moved it (a single-shard table is
            # called even with no ids of its own in the batch)
            if one_time:
                if (m > 0 or ns == 1) and tarr[0] > meta[M_WATERMARK]:
                    meta[M_WATERMARK] = tarr[0]
            else:
                for q in range(m):
                    if tarr[pos[q]] > meta[M_WATERMARK]:
                        meta[M_WATERMARK] = tarr[pos[q]]
            if m == 0:
                continue
            slots = slots_list[sh]
            mask = slots.shape[0] - 1
            for b in range(0, m, GROUP):
                e = min(m, b + GROUP)
                for q in range(b, e):
                    h = home(ids[pos[q]], mask)
                    hs[q - b] = h
                    prefetch(slots, h)
                for q in range(b, e):
                    rows[q] = resolve(slots, mask, ids[pos[q]], hs[q - b])
            k, urows, ugrads, utimes = packed_dedupe(rows, pos, gst, m, dim, grads, tarr)
            dirty = dirty_list[sh]
            reserve_dirty(dirty, meta, k)
            apply_updates(tab_kind[t], tab_hyper[t], emb_list[sh], state_list[sh], urows, ugrads, k,
                          utimes, times_list[sh], flags_list[sh], dirty, meta, tab_track[t])
            shard_k[sh] = k


@njit
def all_finite(g: F32Array) -> bool:
    """Whether every value of the 1-D float32 ``g`` is finite (one pass, no temporaries)."""
    for i in range(g.size):
        if not np.isfinite(g[i]):
            return False
    return True
