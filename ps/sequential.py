"""Exact per-example updates for sparse linear models (logistic regression) over a packed batch.

(Over 450 lines: the linear kernels, and the parts :mod:`ps.sequential_fm` shares with them: row
resolution, the bag walk, the logistic step and the write-back.)

Mini-batch SGD gives a weight one step per batch however often the batch holds it; ml-1m users
rate in bursts, so a batch of 1024 learns much less than 1024 single steps (River's way). Here the
examples of a batch are taken in order: each is scored with the weights as its predecessors left
them (the probability is recorded *before* its update: progressive validation), then each of its
rows is stepped at once with its table's optimizer (:func:`ps.optimizers.step_elem`, the batch
path's formulas and state) and marked changed for parameter sync, as a batch update marks it.

Per example ``e``: ``logit = offset[e] + sum_slots pool(w[rows])`` (``sum``, or ``mean``: each id
weighted ``1/len(bag)``), ``p = sigmoid(logit)``, ``g = p - y``; row ``r`` of the example gets
one step with gradient ``float32(g * sum of its weights in the example)``.
Absent ids (not admitted) read 0 and are not stepped. ``offset`` holds what the kernel does not
learn (bias, dense features); the caller updates those from the returned residuals.

>>> from ps import InitializerConfig, ParameterServer, SGDConfig, TableConfig
>>> server = ParameterServer([TableConfig(name="w", dim=1, optimizer=SGDConfig(lr=0.5),
...                                       initializer=InitializerConfig(kind="zeros"))])
>>> pb = server.pack({"w": np.array([7, 7])})      # two examples, both with id 7
>>> bags = np.array([[0, 1, 2]])                    # segment 0: example 0 -> ids[0:1], 1 -> ids[1:2]
>>> p, loss, resid = train_linear_sequential(server, pb, bags, np.zeros(1, bool),
...                                          np.array([1.0, 1.0]), np.zeros(2), event_time=1)
>>> p.tolist()  # the second example already sees the first one's step: w = 0 + 0.5 * 0.5
[0.5, 0.562176525592804]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ._jit import BoolArray, F32Array, F64Array, I64Array, IntLike, U8Array, njit, prefetch
from .errors import InvalidInputError, ReadOnlyTableError
from .hashmap import GROUP, home, resolve
from .optimizers import OPT_ADAM, OPT_NONE, adam_corrections, step_elem
from .packed import segment
from .rowmarks import M_NDIRTY, M_WATERMARK, marked, reserve_dirty
from .server import PackedBatch, ParameterServer
from .sharding import shard_index

# the per-shard array lists are numba typed lists, annotated as the Sequence they are (ps.packed)


#: a server's per-table settings as the sequential kernels take them (one numba tuple):
#: ``(tab_base, tab_nshards, tab_kind, tab_hyper, tab_track)``
TableArrays = tuple[I64Array, I64Array, I64Array, F64Array, BoolArray]
#: its per-shard arrays: ``(slots, emb, state, times, flags, dirty, meta)`` lists, one entry a shard
ShardArrays = tuple[Sequence[I64Array], Sequence[F32Array], Sequence[F32Array], Sequence[I64Array],
                    Sequence[U8Array], Sequence[I64Array], Sequence[I64Array]]


def kernel_tables(server: ParameterServer) -> TableArrays:
    return server._tab_base, server._tab_nshards, server._tab_kind, server._tab_hyper, server._tab_track


@njit
def _resolve_rows(ids: I64Array, seg_off: I64Array, seg_table: I64Array, tab_base: I64Array, tab_nshards: I64Array,
                  slots_list: Sequence[I64Array], shard_of: I64Array, rows: I64Array, shard_n: I64Array) -> None:
    """Shard and row of every id (-1: absent); hash slots prefetched a group ahead."""
    hs = np.empty(GROUP, np.int64)
    for s in range(seg_table.size):
        base, ns, a, b = segment(s, seg_off, seg_table, tab_base, tab_nshards)
        for i in range(a, b):
            shard_of[i] = base + shard_index(ids[i], ns) if ns > 1 else base
            shard_n[shard_of[i]] += 1
        for sh in range(base, base + ns):  # one typed-list read per shard, not per id
            slots = slots_list[sh]
            mask = slots.shape[0] - 1
            for g in range(a, b, GROUP):
                e = min(b, g + GROUP)
                for i in range(g, e):
                    if shard_of[i] == sh:
                        h = home(ids[i], mask)
                        hs[i - g] = h
                        prefetch(slots, h)
                for i in range(g, e):
                    if shard_of[i] == sh:
                        rows[i] = resolve(slots, mask, ids[i], hs[i - g])


@njit
def _batch_rows(rows: I64Array, shard_of: I64Array, n_shards: IntLike) -> tuple[I64Array, I64Array, I64Array]:
    """Number the batch's distinct (shard, row) pairs: ``(u [n] (-1: absent), shard [U], row [U])``."""
    n = rows.size
    cap = 16
    while cap < 2 * n:
        cap *= 2
    mask = cap - 1
    tab = np.full(cap, -1, np.int64)
    u_of = np.full(n, -1, np.int64)
    ush = np.empty(n, np.int64)
    urow = np.empty(n, np.int64)
    k = 0
    for i in range(n):
        r = rows[i]
        if r < 0:
            continue
        sh = shard_of[i]
        h = ((r * n_shards + sh) * 0x9E3779B1) & mask
        while tab[h] >= 0 and (urow[tab[h]] != r or ush[tab[h]] != sh):
            h = (h + 1) & mask
        if tab[h] < 0:
            tab[h] = k
            ush[k] = sh
            urow[k] = r
            k += 1
        u_of[i] = tab[h]
    return u_of, ush[:k], urow[:k]


@njit
def prepare_batch(ids: I64Array, seg_off: I64Array, seg_table: I64Array, t: IntLike, tables: TableArrays,
                  shards: ShardArrays, shard_n: I64Array) -> tuple[I64Array, I64Array, I64Array]:
    """A sequential kernel's start: ``(shard_of, rows, tab_of_shard)``, every id's shard and row
    (``shard_n`` counts each shard's ids) and each shard's table; the watermarks and dirty queues
    of the tables the batch reads move as packed_apply_kernel moves them."""
    tab_base, tab_nshards = tables[0], tables[1]
    slots_list, dirty_list, meta_list = shards[0], shards[5], shards[6]
    n = ids.size
    shard_of = np.empty(n, np.int64)
    rows = np.empty(n, np.int64)
    _resolve_rows(ids, seg_off, seg_table, tab_base, tab_nshards, slots_list, shard_of, rows, shard_n)
    tab_of_shard = np.empty(len(meta_list), np.int64)
    for ti in range(tab_base.size):
        for sh in range(tab_base[ti], tab_base[ti] + tab_nshards[ti]):
            tab_of_shard[sh] = ti
    present = np.zeros(tab_base.size, np.bool_)
    for s in range(seg_table.size):
        present[seg_table[s]] = True
    for ti in range(tab_base.size):
        if not present[ti]:
            continue
        for sh in range(tab_base[ti], tab_base[ti] + tab_nshards[ti]):
            meta = meta_list[sh]
            if (shard_n[sh] > 0 or tab_nshards[ti] == 1) and t > meta[M_WATERMARK]:
                meta[M_WATERMARK] = t
            reserve_dirty(dirty_list[sh], meta, shard_n[sh])
    return shard_of, rows, tab_of_shard


@njit
def write_back(order: I64Array, ush: I64Array, urow: I64Array, W: F32Array, ST: F32Array, width: I64Array,
               utab: I64Array, t: IntLike, tab_track: BoolArray, shards: ShardArrays) -> None:
    """A scratch kernel's end: the rows ``order`` names (scratch numbers, in the order the examples
    first stepped them) written back, ``W[u]`` and ``ST[u, :width[u]]``, each with apply_updates'
    bookkeeping (its time, its flag, its place in the dirty queue), once per row."""
    _, emb_list, state_list, times_list, flags_list, dirty_list, meta_list = shards
    for q in range(order.size):
        u = order[q]
        sh, r = ush[u], urow[u]
        emb = emb_list[sh]
        for j in range(emb.shape[1]):
            emb[r, j] = W[u, j]
        state = state_list[sh]
        for j in range(width[u]):
            state[r, j] = ST[u, j]
        times = times_list[sh]
        if t > times[r]:
            times[r] = t
        flags = flags_list[sh]
        f, queue = marked(flags[r], tab_track[utab[u]])
        if queue:
            meta = meta_list[sh]
            dirty_list[sh][meta[M_NDIRTY]] = r
            meta[M_NDIRTY] += 1
        flags[r] = f


@njit
def bag_span(s: IntLike, e: IntLike, seg_off: I64Array, bags: I64Array, seg_mean: BoolArray) -> tuple[int, int, float]:
    """Example ``e``'s bag in segment ``s``: ``(first, end, pool weight)`` of its ids in the packed
    ids (weight ``1/len`` for a mean-pooled segment, else 1)."""
    a = seg_off[s] + bags[s, e]
    b = seg_off[s] + bags[s, e + 1]
    return a, b, (1.0 / (b - a) if seg_mean[s] and b > a else 1.0)


@njit
def seen_at(keys: I64Array, k: IntLike, key: IntLike) -> IntLike:
    """Where ``key`` stands among ``keys[:k]`` (an example's rows, first-seen order); ``k``: not there.

    >>> int(seen_at(np.array([4, 2, 9]), 3, 2)), int(seen_at(np.array([4, 2, 9]), 2, 9))
    (1, 2)
    """
    q = 0
    while q < k and keys[q] != key:
        q += 1
    return q


@njit
def first_order_sum(logit: float, e: IntLike, s_lo: IntLike, s_hi: IntLike, seg_off: I64Array, bags: I64Array,
                    seg_mean: BoolArray, u_of: I64Array, w: F32Array, eu: I64Array, ewgt: F64Array,
                    scale: F64Array, pooled: F64Array) -> tuple[float, int]:
    """``logit`` plus example ``e``'s first-order terms over segments ``s_lo..s_hi-1`` (row ``u``'s
    weight ``w[u]``, ``u_of`` each id's row, -1 absent; segment ``s``'s pooled sum times
    ``scale[s]``), each segment's pooled sum in ``pooled[e, s]``, and the rows it read with their
    summed pool weights in ``eu``, ``ewgt`` (first-seen order; unscaled: see
    :func:`train_linear_sequential`): ``(logit, how many rows)``."""
    k = 0
    for s in range(s_lo, s_hi):
        a, b, wgt = bag_span(s, e, seg_off, bags, seg_mean)
        v = 0.0
        for i in range(a, b):
            u = u_of[i]
            if u < 0:
                continue
            x = wgt * np.float64(w[u])
            v += x
            logit += scale[s] * x  # (scale 1: the same sum, in the same order, as without it)
            q = seen_at(eu, k, u)
            if q == k:
                eu[k] = u
                ewgt[k] = wgt
                k += 1
            else:
                ewgt[q] += wgt
        pooled[e, s] = v
    return logit, k


@njit
def scored(e: IntLike, logit: float, labels: F64Array, probs: F32Array, resid: F64Array) -> tuple[float, float]:
    """Example ``e`` scored: its probability and residual ``p - y`` recorded in ``probs`` and
    ``resid``; returns ``(p - y, log loss)``."""
    y = np.float64(labels[e])
    p = 1.0 / (1.0 + math.exp(-logit))
    probs[e] = p
    resid[e] = p - y
    return p - y, max(logit, 0.0) - logit * y + math.log1p(math.exp(-abs(logit)))


@njit
def sequential_linear_kernel(
        ids: I64Array, seg_off: I64Array, seg_table: I64Array, bags: I64Array, seg_mean: BoolArray, labels: F64Array,
        offset: F64Array, t: IntLike, tables: TableArrays, shards: ShardArrays, probs: F32Array, resid: F64Array,
        shard_n: I64Array, scale: F64Array, pooled: F64Array) -> float:
    """Learn ``labels.size`` examples in order (see the module docstring); returns the summed log loss.

    ``bags[s]`` are segment ``s``'s per-example offsets (relative to ``seg_off[s]``); every table
    read has dim 1. ``probs`` and ``resid`` get each example's pre-update probability and ``p - y``.

    The batch's distinct rows are copied out once into flat scratch arrays (weight and optimizer
    state, float32 as the tables hold them), the examples learn on those, and each row is written
    back, marked and queued for sync once, in the order the examples first stepped it: the
    tables end bit for bit as if every step had been written through, and a model with many
    tables pays no per-id switch between their arrays.
    """
    tab_base, tab_nshards, tab_kind, tab_hyper, tab_track = tables
    slots_list, emb_list, state_list, times_list, flags_list, dirty_list, meta_list = shards
    n = ids.size
    nseg = seg_table.size
    n_shards = len(emb_list)
    shard_of, rows, tab_of_shard = prepare_batch(ids, seg_off, seg_table, t, tables, shards, shard_n)
    u_of, ush, urow = _batch_rows(rows, shard_of, n_shards)
    nu = urow.size
    w = np.empty(nu, np.float32)
    st = np.zeros((nu, 3), np.float32)
    width = np.empty(nu, np.int64)
    ukind = np.empty(nu, np.int64)
    utab = np.empty(nu, np.int64)
    for u in range(nu):
        sh = ush[u]
        r = urow[u]
        state = state_list[sh]
        w[u] = emb_list[sh][r, 0]
        width[u] = state.shape[1]
        for j in range(width[u]):
            st[u, j] = state[r, j]
        utab[u] = tab_of_shard[sh]
        ukind[u] = tab_kind[utab[u]]
    stepped = np.zeros(nu, np.bool_)
    order = np.empty(nu, np.int64)
    n_order = 0
    # one example's rows, equal rows summed (first-seen order)
    eu = np.empty(n, np.int64)
    ewgt = np.empty(n, np.float64)
    loss = 0.0
    for e in range(labels.size):
        logit, k = first_order_sum(np.float64(offset[e]), e, 0, nseg, seg_off, bags, seg_mean, u_of, w, eu, ewgt,
                                   scale, pooled)
        g, ll = scored(e, logit, labels, probs, resid)
        loss += ll
        for q in range(k):
            u = eu[q]
            if not stepped[u]:
                stepped[u] = True
                order[n_order] = u
                n_order += 1
            kind = ukind[u]
            hyper = tab_hyper[utab[u]]
            bc1 = bc2 = 1.0
            if kind == OPT_ADAM:
                step = np.float64(st[u, 2]) + 1.0
                st[u, 2] = step
                bc1, bc2 = adam_corrections(hyper, step)
            sa: float = np.float64(st[u, 0])
            sb: float = np.float64(st[u, 1])
            nw, sa, sb = step_elem(kind, hyper, np.float64(w[u]), sa, sb,
                                   np.float64(np.float32(g * ewgt[q])), bc1, bc2)
            w[u] = nw
            st[u, 0] = sa
            st[u, 1] = sb
    write_back(order[:n_order], ush, urow, w.reshape(nu, 1), st, width, utab, t, tab_track, shards)
    return loss


@njit
def write_through_kernel(
        ids: I64Array, seg_off: I64Array, seg_table: I64Array, bags: I64Array, seg_mean: BoolArray, labels: F64Array,
        offset: F64Array, t: IntLike, tables: TableArrays, shards: ShardArrays, probs: F32Array, resid: F64Array,
        shard_n: I64Array, scale: F64Array, pooled: F64Array) -> float:
    """:func:`sequential_linear_kernel`'s results, each step written straight into the tables.

    Faster when the batch's ids all fall in one shard (one shared table, an LR's: nothing to copy
    out and no per-row numbering; 515k against 330k examples/s on ml-1m here); with many tables,
    reading another shard's arrays for almost every id costs twice the scratch kernel's time.
    """
    tab_base, tab_nshards, tab_kind, tab_hyper, tab_track = tables
    slots_list, emb_list, state_list, times_list, flags_list, dirty_list, meta_list = shards
    n = ids.size
    nseg = seg_table.size
    shard_of, rows, tab_of_shard = prepare_batch(ids, seg_off, seg_table, t, tables, shards, shard_n)
    # one example's rows, equal rows summed (first-seen order)
    ush = np.empty(n, np.int64)
    urow = np.empty(n, np.int64)
    uwgt = np.empty(n, np.float64)
    # typed-list reads cost more than the update itself: hold the current shard's arrays
    cur = tab_base[seg_table[0]] if nseg else 0
    emb = emb_list[cur]
    state = state_list[cur]
    times = times_list[cur]
    flags = flags_list[cur]
    dirty = dirty_list[cur]
    meta = meta_list[cur]
    ti = tab_of_shard[cur]
    kind = tab_kind[ti]
    hyper = tab_hyper[ti]
    track = tab_track[ti]
    loss = 0.0
    for e in range(labels.size):
        logit = np.float64(offset[e])
        k = 0
        for s in range(nseg):
            a, b, wgt = bag_span(s, e, seg_off, bags, seg_mean)
            v = 0.0
            for i in range(a, b):
                r = rows[i]
                if r < 0:
                    continue
                sh = shard_of[i]
                x = wgt * np.float64(emb_list[sh][r, 0] if sh != cur else emb[r, 0])
                v += x
                logit += scale[s] * x
                q = 0
                while q < k and (urow[q] != r or ush[q] != sh):
                    q += 1
                if q == k:
                    ush[k] = sh
                    urow[k] = r
                    uwgt[k] = wgt
                    k += 1
                else:
                    uwgt[q] += wgt
            pooled[e, s] = v
        g, ll = scored(e, logit, labels, probs, resid)
        loss += ll
        for q in range(k):
            sh = ush[q]
            r = urow[q]
            if sh != cur:
                cur = sh
                emb = emb_list[sh]
                state = state_list[sh]
                times = times_list[sh]
                flags = flags_list[sh]
                dirty = dirty_list[sh]
                meta = meta_list[sh]
                ti = tab_of_shard[sh]
                kind = tab_kind[ti]
                hyper = tab_hyper[ti]
                track = tab_track[ti]
            # apply_updates' bookkeeping and step_row for one dim-1 row, written out: a call
            # taking arrays costs several times this whole update
            if t > times[r]:
                times[r] = t
            f, queue = marked(flags[r], track)
            if queue:
                dirty[meta[M_NDIRTY]] = r
                meta[M_NDIRTY] += 1
            flags[r] = f
            width = state.shape[1]
            bc1 = bc2 = 1.0
            if kind == OPT_ADAM:
                step = np.float64(state[r, 2]) + 1.0
                state[r, 2] = step
                bc1, bc2 = adam_corrections(hyper, step)
            sa = np.float64(state[r, 0]) if width > 0 else 0.0
            sb = np.float64(state[r, 1]) if width > 1 else 0.0
            w, sa, sb = step_elem(kind, hyper, np.float64(emb[r, 0]), sa, sb,
                                  np.float64(np.float32(g * uwgt[q])), bc1, bc2)
            emb[r, 0] = w
            if width > 0:
                state[r, 0] = sa
            if width > 1:
                state[r, 1] = sb
    return loss


def train_linear_sequential(server: ParameterServer, pb: PackedBatch, bags: np.ndarray, mean: np.ndarray,
                            labels: np.ndarray, offset: np.ndarray, event_time: int, insert: bool = True,
                            scale: np.ndarray | None = None,
                            pooled: np.ndarray | None = None) -> tuple[np.ndarray, float, np.ndarray]:
    """Learn a batch of a linear model example by example: ``(probs float32, mean loss, residuals)``.

    Ids are looked up (and inserted through admission) once for the batch by the packed gather
    (``insert=False``: the caller's own gather of a batch holding these ids already did);
    ``bags`` int64 ``[n_segments, B + 1]`` are each packed segment's per-example offsets, ``mean``
    which segments mean-pool; ``offset`` float64 ``[B]`` is each example's fixed logit part.
    ``scale`` (float64 ``[n_segments]``, default ones) multiplies each segment's pooled sum in the
    logit; its rows still step on ``g`` times their pool weight, unscaled (a positive factor per
    row on the gradient: still a descent direction, and a segment whose factor is small relearns
    at its table's own rate: ``make bench-drift``). ``pooled``, if given (float64
    ``[B, n_segments]``), gets each example's pooled sums before its update (the gradient of a
    learned ``scale``).
    """
    local_shards(server)
    dims = server._dims[pb.slot_table]
    if (dims != 1).any():
        raise InvalidInputError("sequential updates are for dim-1 (linear) tables only")
    n_ex = int(labels.size)
    bags = checked_bags(pb, bags, n_ex)
    present = learning_tables(server, pb)
    t, probs, resid, shard_n = started(server, pb, n_ex, event_time, insert)
    with server._lock_all():
        slots_list, emb_list = server._lists()
        shards = {int(server._tab_base[t]) for t in pb.slot_table.tolist() if server._tab_nshards[t] == 1}
        one_shard = len(shards) == 1 and all(server._tab_nshards[t] == 1 for t in pb.slot_table.tolist())
        kernel = write_through_kernel if one_shard else sequential_linear_kernel
        loss = kernel(
            pb.ids, pb.offsets, pb.slot_table, bags, np.ascontiguousarray(mean, np.bool_),
            np.ascontiguousarray(labels, np.float64), np.ascontiguousarray(offset, np.float64), t,
            kernel_tables(server), (slots_list, emb_list, *server._row_lists), probs, resid, shard_n,
            *scaled(scale, pooled, len(pb.slots), n_ex))
        expire_touched(server, present, shard_n)
    return probs, loss / max(n_ex, 1), resid


# The Python side both sequential drivers (this module's and ps.sequential_fm's) share: the checks of
# their input, the gather that admits the batch's ids, and the TTL expiry of the shards they touched.

def local_shards(server: ParameterServer) -> None:
    if not server._local:
        raise InvalidInputError("sequential updates need local shards")


def checked_bags(pb: PackedBatch, bags: np.ndarray, n_ex: int) -> I64Array:
    """``bags`` as int64 ``[n_segments, B + 1]``, each segment's per-example offsets over its ids."""
    out: I64Array = np.ascontiguousarray(bags, np.int64).reshape(len(pb.slots), n_ex + 1)
    if ((out[:, -1] != np.diff(pb.offsets)) | (out[:, 0] != 0)).any() or (np.diff(out, axis=1) < 0).any():
        raise InvalidInputError("bags must be per-segment offsets covering each segment's ids")
    return out


def scaled(scale: np.ndarray | None, pooled: np.ndarray | None, n_seg: int, n_ex: int) -> tuple[F64Array, F64Array]:
    """The kernels' ``scale`` (ones by default) and ``pooled`` (scratch when not asked for), checked."""
    sc = np.ones(n_seg) if scale is None else np.ascontiguousarray(scale, np.float64)
    out = np.empty((n_ex, n_seg)) if pooled is None else pooled
    if sc.shape != (n_seg,) or out.shape != (n_ex, n_seg) or out.dtype != np.float64 or not out.flags.c_contiguous:
        raise InvalidInputError(f"scale must be [{n_seg}] and pooled a C-contiguous float64 [{n_ex}, {n_seg}]")
    if not np.isfinite(sc).all():
        raise InvalidInputError("scale must be finite")
    return sc, out


def learning_tables(server: ParameterServer, pb: PackedBatch) -> BoolArray:
    """Which of the server's tables the batch reads (a serving replica's, without an optimizer, refused)."""
    present = np.zeros(len(server.table_names), np.bool_)
    present[pb.slot_table] = True
    for ti in np.flatnonzero(present & (server._tab_kind == OPT_NONE)).tolist():
        raise ReadOnlyTableError(f"table {server.table_names[ti]!r} is a serving replica; it has no optimizer")
    return present


def started(server: ParameterServer, pb: PackedBatch, n_ex: int, event_time: int,
            insert: bool) -> tuple[int, F32Array, F64Array, I64Array]:
    """The batch's ids admitted (``insert``), and the kernel's outputs: ``(time, probs, residuals,
    rows touched per shard)``."""
    t = int(event_time)
    if insert:
        server.gather_packed(pb, insert=True, event_time=t)
    return t, np.empty(n_ex, np.float32), np.empty(n_ex, np.float64), np.zeros(len(server._shards), np.int64)


def expire_touched(server: ParameterServer, present: BoolArray, shard_n: I64Array) -> None:
    """The TTL sweep of every expiring shard the batch touched (call holding the server's locks)."""
    for ti, sh in server._expiring:
        if present[ti] and (shard_n[sh] or server._tab_nshards[ti] == 1):
            server._shards[sh]._expire(None, max(1024, 2 * int(shard_n[sh])))
