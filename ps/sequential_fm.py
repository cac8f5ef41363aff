"""Exact per-example updates of a DeepFM's embedding rows together with its first-order rows.

:mod:`ps.sequential` steps the first-order weights example by example; here the embedding rows
of the FM and MLP fields do too. The examples of a packed batch are taken in order; for example
``e`` with fields ``f = 1..F`` (each pooled from fresh rows: ``sum``, or ``mean`` weighting each
id ``1/len(bag)``):

    logit = offset[e] + sum_lin pool(w) + FM(x_1..x_F),   FM = 0.5 * (|S|^2 - sum_f |x_f|^2),  S = sum_f x_f

``offset`` holds what the kernel does not learn (bias, dense weights, the MLP of the batch-start
rows). ``p = sigmoid(logit)`` is recorded before the update (progressive validation), ``g = p - y``:

* every first-order row takes one step with ``float32(g * its pooled weight)``;
* every embedding row of field ``f`` (pool weight ``c``) one step with
  ``float32(g * c * (S - x_f + J[e, f]))``, where ``J[e, f]`` is the MLP's gradient with respect
  to field ``f``'s input, taken at the batch's start (``jac``): the FM part is exact per example,
  the MLP part is the batch-start MLP's slope at this example. A row in several fields sums.

At batch size 1 that is one plain DeepFM step's gradient for every row. Each row takes its
table's own optimizer (SGD or Adagrad: state as wide as the row), is copied out once, learns on
the copy and is written back, marked and queued for sync once, in the order the examples first
stepped it, as :func:`ps.sequential.train_linear_sequential` does.

>>> from ps import AdagradConfig, InitializerConfig, ParameterServer, SGDConfig, TableConfig
>>> server = ParameterServer([
...     TableConfig(name="v", dim=2, optimizer=SGDConfig(lr=1.0), initializer=InitializerConfig(kind="zeros")),
...     TableConfig(name="w", dim=1, optimizer=SGDConfig(lr=1.0), initializer=InitializerConfig(kind="zeros"))],
...     {"a": "v", "b": "v", "wa": "w"})
>>> pb = server.pack({"a": np.array([1, 1]), "b": np.array([2, 2]), "wa": np.array([1, 1])})
>>> bags = np.array([[0, 1, 2]] * 3)                 # 2 examples: one id per field in each
>>> jac = np.zeros((2, 2, 2)); jac[:, :, 0] = 1.0    # the MLP's slope: 1 along dim 0
>>> p, loss, resid = train_fm_sequential(server, pb, 2, bags, np.zeros(3, bool), np.array([1.0, 1.0]),
...                                      np.zeros(2), jac, event_time=1)
>>> [round(float(x), 4) for x in p]   # the 2nd sees the 1st's steps: FM 0.25 + first order 0.5
[0.5, 0.6792]
>>> # row 1 of v: +0.5 * (S - x + J) = 0.5 * 1, then +(1 - 0.6792) * ([1, 0] - [0.5, 0] + [1, 0])
>>> [round(float(x), 4) for x in server.tables["v"].gather(np.array([1]))[0]]
[0.9812, 0.0]
"""

from __future__ import annotations

import numpy as np

from ._jit import BoolArray, F32Array, F64Array, I64Array, IntLike, njit
from .errors import InvalidInputError
from .optimizers import OPT_ADAGRAD, OPT_SGD, adagrad_elem, step_elem
from .sequential import (
    ShardArrays,
    TableArrays,
    _batch_rows,
    bag_span,
    checked_bags,
    expire_touched,
    first_order_sum,
    kernel_tables,
    learning_tables,
    local_shards,
    prepare_batch,
    scaled,
    scored,
    seen_at,
    started,
    write_back,
)
from .server import PackedBatch, ParameterServer

__all__ = ["train_fm_sequential"]

#: the optimizers whose state is one value per weight (what the kernel's scratch holds)
KERNEL_OPTIMIZERS = (OPT_SGD, OPT_ADAGRAD)


@njit
def _pooled(f: IntLike, e: IntLike, seg_off: I64Array, bags: I64Array, seg_mean: BoolArray, u_of: I64Array, W: F32Array,
            D: IntLike, x: F64Array) -> None:
    """Field ``f`` of example ``e`` pooled from the scratch rows into ``x[f]``."""
    for j in range(D):
        x[f, j] = 0.0
    a, b, wgt = bag_span(f, e, seg_off, bags, seg_mean)
    for i in range(a, b):
        u = u_of[i]
        if u >= 0:
            for j in range(D):
                x[f, j] += wgt * np.float64(W[u, j])


@njit
def sequential_fm_kernel(
        ids: I64Array, seg_off: I64Array, seg_table: I64Array, n_emb: IntLike, bags: I64Array, seg_mean: BoolArray,
        labels: F64Array, offset: F64Array, jac: F32Array, t: IntLike, tables: TableArrays, shards: ShardArrays,
        probs: F32Array, resid: F64Array, shard_n: I64Array, scale: F64Array, pooled: F64Array) -> float:
    """Learn ``labels.size`` examples in order (see the module docstring); returns the summed log
    loss and fills ``probs`` (pre-update) and ``resid`` (``p - y``). Segments ``0..n_emb-1`` are
    the embedding fields (one dim), the rest first-order fields (dim 1)."""
    tab_base, tab_nshards, tab_kind, tab_hyper, tab_track = tables
    slots_list, emb_list, state_list, times_list, flags_list, dirty_list, meta_list = shards
    n = ids.size
    nseg = seg_table.size
    shard_of, rows, tab_of_shard = prepare_batch(ids, seg_off, seg_table, t, tables, shards, shard_n)
    n_shards = len(emb_list)
    u_of, ush, urow = _batch_rows(rows, shard_of, n_shards)
    nu = urow.size
    D = emb_list[tab_base[seg_table[0]]].shape[1] if n_emb > 0 else 1
    F = n_emb
    # the batch's distinct rows: weights and optimizer state (one value per weight), float32
    W = np.zeros((nu, D), np.float32)
    ST = np.zeros((nu, D), np.float32)
    udim = np.empty(nu, np.int64)
    uwidth = np.empty(nu, np.int64)
    utab = np.empty(nu, np.int64)
    for u in range(nu):
        sh, r = ush[u], urow[u]
        emb = emb_list[sh]  # one typed-list read per row: such a read costs more than a weight's copy
        state = state_list[sh]
        udim[u] = emb.shape[1]
        uwidth[u] = state.shape[1]
        for j in range(udim[u]):
            W[u, j] = emb[r, j]
        for j in range(uwidth[u]):
            ST[u, j] = state[r, j]
        utab[u] = tab_of_shard[sh]
    stepped = np.zeros(nu, np.bool_)
    order = np.empty(nu, np.int64)
    n_order = 0
    # one example's rows, equal rows summed (first-seen order): first-order weights, embedding
    # gradient directions
    lu = np.empty(n, np.int64)
    lwgt = np.empty(n, np.float64)
    vu = np.empty(n, np.int64)
    vg = np.zeros((n, D), np.float64)
    x = np.zeros((max(F, 1), D), np.float64)
    S = np.zeros(D, np.float64)
    loss = 0.0
    for e in range(labels.size):
        logit: float = np.float64(offset[e])
        sq = 0.0
        for j in range(D):
            S[j] = 0.0
        for f in range(F):
            _pooled(f, e, seg_off, bags, seg_mean, u_of, W, D, x)
            for j in range(D):
                S[j] += x[f, j]
                sq += x[f, j] * x[f, j]
        ss = 0.0
        for j in range(D):
            ss += S[j] * S[j]
        logit += 0.5 * (ss - sq)
        logit, k = first_order_sum(logit, e, F, nseg, seg_off, bags, seg_mean, u_of, W[:, 0], lu, lwgt,
                                   scale, pooled)
        g, ll = scored(e, logit, labels, probs, resid)
        loss += ll
        # the embedding rows' directions, from the values this example was scored with
        m = 0
        for f in range(F):
            a, b, wgt = bag_span(f, e, seg_off, bags, seg_mean)
            for i in range(a, b):
                u = u_of[i]
                if u < 0:
                    continue
                q = seen_at(vu, m, u)
                if q == m:
                    vu[m] = u
                    for j in range(D):
                        vg[m, j] = 0.0
                    m += 1
                for j in range(D):
                    vg[q, j] += wgt * (S[j] - x[f, j] + np.float64(jac[e, f, j]))
        for q in range(k + m):
            u = lu[q] if q < k else vu[q - k]
            if not stepped[u]:
                stepped[u] = True
                order[n_order] = u
                n_order += 1
            kind = tab_kind[utab[u]]
            hyper = tab_hyper[utab[u]]
            if q < k:  # a first-order row: one weight
                nw, sa, _ = step_elem(kind, hyper, np.float64(W[u, 0]), np.float64(ST[u, 0]), 0.0,
                                      np.float64(np.float32(g * lwgt[q])), 1.0, 1.0)
                W[u, 0] = nw
                ST[u, 0] = sa
                continue
            qk = q - k
            if kind == OPT_ADAGRAD:
                lr, eps, cap = hyper[0], hyper[2], hyper[3]  # read before the loop: it then compiles to vector instructions
                for j in range(D):
                    nw, sa = adagrad_elem(lr, eps, cap, np.float64(W[u, j]), np.float64(ST[u, j]),
                                          np.float64(np.float32(g * vg[qk, j])))
                    W[u, j] = nw
                    ST[u, j] = sa
            else:
                for j in range(D):
                    nw, _, _ = step_elem(kind, hyper, np.float64(W[u, j]), 0.0, 0.0,
                                         np.float64(np.float32(g * vg[qk, j])), 1.0, 1.0)
                    W[u, j] = nw
    write_back(order[:n_order], ush, urow, W, ST, uwidth, utab, t, tab_track, shards)
    return loss


def train_fm_sequential(server: ParameterServer, pb: PackedBatch, n_emb: int, bags: np.ndarray, mean: np.ndarray,
                        labels: np.ndarray, offset: np.ndarray, jac: np.ndarray, event_time: int,
                        insert: bool = True, scale: np.ndarray | None = None,
                        pooled: np.ndarray | None = None) -> tuple[np.ndarray, float, np.ndarray]:
    """Learn a batch of a DeepFM's sparse rows example by example: ``(probs float32, mean loss,
    residuals float64)``.

    ``pb``'s first ``n_emb`` segments are the embedding fields (tables of one dim), the rest the
    first-order fields (dim 1); ``bags`` int64 ``[n_segments, B + 1]`` are each segment's
    per-example offsets, ``mean`` which segments mean-pool; ``offset`` float64 ``[B]`` each
    example's fixed logit; ``jac`` float32 ``[B, n_emb, dim]`` the MLP's input gradient per example (as torch computes it).
    Ids are inserted (through admission) once by a packed gather first, unless ``insert=False``
    (the caller's gather of these ids already did). Every table read must be SGD or Adagrad.
    ``scale`` and ``pooled``: the first-order segments' factors and pooled sums, as
    :func:`ps.sequential.train_linear_sequential` takes them (the embedding segments' are unused).
    """
    local_shards(server)
    n_seg, n_ex = len(pb.slots), int(labels.size)
    dims = server._dims[pb.slot_table]
    if not 0 < n_emb <= n_seg or len(set(dims[:n_emb].tolist())) != 1 or (dims[n_emb:] != 1).any():
        raise InvalidInputError("the first n_emb segments must be embedding fields of one dim, the rest dim 1")
    bags = checked_bags(pb, bags, n_ex)
    jac = np.ascontiguousarray(jac, np.float32)
    if jac.shape != (n_ex, n_emb, int(dims[0])):
        raise InvalidInputError(f"jac must be [B, n_emb, dim] = {(n_ex, n_emb, int(dims[0]))}, got {jac.shape}")
    present = learning_tables(server, pb)
    for ti in np.flatnonzero(present).tolist():
        if int(server._tab_kind[ti]) not in KERNEL_OPTIMIZERS:
            raise InvalidInputError(f"table {server.table_names[ti]!r}: sequential embeddings need SGD or Adagrad")
    t, probs, resid, shard_n = started(server, pb, n_ex, event_time, insert)
    with server._lock_all():
        slots_list, emb_list = server._lists()
        loss = sequential_fm_kernel(
            pb.ids, pb.offsets, pb.slot_table, n_emb, bags, np.ascontiguousarray(mean, np.bool_),
            np.ascontiguousarray(labels, np.float64), np.ascontiguousarray(offset, np.float64), jac, t,
            kernel_tables(server), (slots_list, emb_list, *server._row_lists), probs, resid, shard_n,
            *scaled(scale, pooled, n_seg, n_ex))
        expire_touched(server, present, shard_n)
    return probs, loss / max(n_ex, 1), resid
