"""Sparse optimizers whose state lives beside each row: SGD, Adagrad, Adam, FTRL.

A batch's gradients are first summed per unique row (:func:`dedupe`), then one
update is applied per row, so an id seen k times in a batch gets one step with the
sum of its k gradients (what a dense framework would compute for an embedding bag).
Math is done in float64 and stored as float32.

>>> rows = np.array([2, 0, 2], np.int64)
>>> grads = np.array([[1.0], [2.0], [3.0]], np.float32)
>>> k, urows, ugrads, _ = dedupe(rows, grads, np.zeros(1, np.int64))
>>> urows[:k].tolist(), ugrads[:k, 0].tolist()
([2, 0], [4.0, 2.0])
"""

from __future__ import annotations

import math

import numpy as np

from ._jit import BoolLike, F32Array, F64Array, I64Array, IntLike, U8Array, njit, prefetch, prefetch_row
from .config import AdagradConfig, AdamConfig, FtrlConfig, SGDConfig, TableConfig
from .rowmarks import mark_changed

OPT_NONE, OPT_SGD, OPT_ADAGRAD, OPT_ADAM, OPT_FTRL = -1, 0, 1, 2, 3


def encode(cfg: TableConfig) -> tuple[int, np.ndarray]:
    """(kernel code, float64 hyper-parameters) of a table's optimizer."""
    o = cfg.optimizer
    if o is None:
        return OPT_NONE, np.zeros(8)
    if isinstance(o, SGDConfig):
        h = [o.lr]
        code = OPT_SGD
    elif isinstance(o, AdagradConfig):
        cap = math.inf if o.max_accumulator is None else o.max_accumulator
        h, code = [o.lr, o.initial_accumulator_value, o.eps, cap], OPT_ADAGRAD
    elif isinstance(o, AdamConfig):
        h, code = [o.lr, o.beta1, o.beta2, o.eps], OPT_ADAM
    elif isinstance(o, FtrlConfig):
        h, code = [o.lr, o.beta, o.l1, o.l2, o.initial_accumulator_value], OPT_FTRL
    else:  # pragma: no cover - the config union is closed
        raise TypeError(o)
    return code, np.array(h + [0.0] * (8 - len(h)))


@njit
def init_state(w: F32Array, s: F32Array, kind: IntLike, hyper: F64Array) -> None:
    """Initial optimizer state ``s`` of a new row whose weights are ``w``."""
    dim = w.size
    if kind == OPT_ADAGRAD:
        s[:] = hyper[1]
    elif kind == OPT_ADAM:
        s[:] = 0.0
    elif kind == OPT_FTRL:
        alpha, beta, l1, l2, n0 = hyper[0], hyper[1], hyper[2], hyper[3], hyper[4]
        denom = (beta + math.sqrt(np.float64(np.float32(n0)))) / alpha + l2
        for j in range(dim):
            wj = np.float64(w[j])
            # choose z so the closed-form FTRL weight reproduces the initializer's w
            sign = 1.0 if wj > 0 else (-1.0 if wj < 0 else 0.0)
            s[j] = -(wj * denom + sign * l1)
            s[dim + j] = n0


#: rows ahead whose cache lines :func:`apply_updates` prefetches
AHEAD = 16
#: ids per prefetch group in :func:`dedupe`
DEDUPE_GROUP = 64


@njit
def dedupe_capacity(n: IntLike) -> int:
    """Slots of :func:`dedupe_into`'s scratch table for a batch of ``n`` ids (load <= 0.5)."""
    cap = 16
    while cap < 2 * n:
        cap *= 2
    return cap


@njit
def dedupe(rows: I64Array, grads: F32Array, times: I64Array) -> tuple[int, I64Array, F32Array, I64Array]:
    """Sum gradients of equal rows (rows < 0 are skipped); keeps first-seen order.

    Returns ``(k, urows, ugrads, utimes)``, valid in ``[:k]``; ``utimes`` is the latest
    event time among a row's occurrences (``times`` has one entry per row or just one).
    """
    n = rows.size
    tab = np.empty((dedupe_capacity(n), 2), np.int64)
    urows = np.empty(n, np.int64)
    ugrads = np.empty((n, grads.shape[1]), np.float32)
    utimes = np.empty(n, np.int64)
    k = dedupe_into(rows, grads, times, tab, urows, ugrads, utimes)
    return k, urows, ugrads, utimes


@njit
def clear_slots(tab: I64Array) -> int:
    """Mark every slot of a dedupe table (``int64[cap, 2]``: row, position) empty; return its mask."""
    for h in range(tab.shape[0]):
        tab[h, 0] = -1
    return int(tab.shape[0]) - 1


@njit
def prefetch_homes(rows: I64Array, b: IntLike, e: IntLike, hs: I64Array, tab: I64Array, mask: IntLike) -> None:
    """Hash ``rows[b:e]`` into ``hs[:e - b]`` and prefetch their home slots: a group's misses overlap."""
    for i in range(b, e):
        h = (rows[i] * 0x9E3779B1) & mask
        hs[i - b] = h
        prefetch(tab, h)


@njit
def find_slot(tab: I64Array, h: IntLike, r: IntLike, mask: IntLike) -> IntLike:
    """Row ``r``'s slot in a dedupe table, probed from its home ``h``: where it is, or the empty one it takes."""
    while tab[h, 0] >= 0 and tab[h, 0] != r:
        h = (h + 1) & mask
    return h


@njit
def dedupe_into(rows: I64Array, grads: F32Array, times: I64Array, tab: I64Array, urows: I64Array, ugrads: F32Array,
                utimes: I64Array) -> int:
    """:func:`dedupe` into caller-given buffers; ``tab`` is ``int64[cap, 2]``, cap a power of two > n.

    ``tab`` holds (row, position) pairs so a probe touches one cache line; its home
    slots are prefetched a group at a time. Sums are float32, accumulated from 0.0 in
    batch order (``0.0 + g`` first, so the result is bit-identical to summing into zeros).
    """
    n = rows.size
    dim = grads.shape[1]
    mask = clear_slots(tab)
    hs = np.empty(DEDUPE_GROUP, np.int64)
    k = 0
    for b in range(0, n, DEDUPE_GROUP):
        e = min(n, b + DEDUPE_GROUP)
        prefetch_homes(rows, b, e, hs, tab, mask)
        for i in range(b, e):
            r = rows[i]
            if r < 0:
                continue
            t = times[i] if times.size > 1 else times[0]
            h = find_slot(tab, hs[i - b], r, mask)
            if tab[h, 0] < 0:
                tab[h, 0] = r
                tab[h, 1] = k
                urows[k] = r
                utimes[k] = t
                for j in range(dim):
                    ugrads[k, j] = np.float32(0.0) + grads[i, j]
                k += 1
            else:
                p = tab[h, 1]
                if t > utimes[p]:
                    utimes[p] = t
                for j in range(dim):
                    ugrads[p, j] += grads[i, j]
    return k


@njit
def apply_updates(kind: IntLike, hyper: F64Array, emb: F32Array, state: F32Array, urows: I64Array, ugrads: F32Array, k: IntLike,
                  utimes: I64Array, times: I64Array, flags: U8Array, dirty: I64Array, meta: I64Array, track: BoolLike) -> None:
    """One optimizer step on rows ``urows[:k]`` with summed gradients ``ugrads[:k]``.

    Also records each update (last-update time, change marks) in the same pass, while
    the row's cache lines are being touched anyway.
    """
    dim = emb.shape[1]
    width = state.shape[1]
    for u in range(k):
        if u + AHEAD < k:  # the rows' lines are random misses: start them early
            ra = urows[u + AHEAD]
            prefetch_row(emb, ra)
            prefetch(times, ra)
            prefetch(flags, ra)
            if width > 0:
                prefetch_row(state, ra)
        r = urows[u]
        if utimes[u] > times[r]:
            times[r] = utimes[u]
        mark_changed(r, flags, dirty, meta, track)
        # one loop per kind, each passing step_elem a constant kind: its dispatch folds away
        if kind == OPT_SGD:
            for j in range(dim):
                emb[r, j] = step_elem(OPT_SGD, hyper, np.float64(emb[r, j]), 0.0, 0.0,
                                      np.float64(ugrads[u, j]), 1.0, 1.0)[0]
        elif kind == OPT_ADAGRAD:
            for j in range(dim):
                w, a, _ = step_elem(OPT_ADAGRAD, hyper, np.float64(emb[r, j]), np.float64(state[r, j]), 0.0,
                                    np.float64(ugrads[u, j]), 1.0, 1.0)
                emb[r, j] = w
                state[r, j] = a
        elif kind == OPT_ADAM:  # state [m_0..m_dim-1, v_0..v_dim-1, step]
            step = np.float64(state[r, 2 * dim]) + 1.0
            state[r, 2 * dim] = step
            bc1, bc2 = adam_corrections(hyper, step)
            for j in range(dim):
                w, a, b = step_elem(OPT_ADAM, hyper, np.float64(emb[r, j]), np.float64(state[r, j]),
                                    np.float64(state[r, dim + j]), np.float64(ugrads[u, j]), bc1, bc2)
                emb[r, j] = w
                state[r, j] = a
                state[r, dim + j] = b
        elif kind == OPT_FTRL:  # state [z_0..z_dim-1, n_0..n_dim-1]
            for j in range(dim):
                w, a, b = step_elem(OPT_FTRL, hyper, np.float64(emb[r, j]), np.float64(state[r, j]),
                                    np.float64(state[r, dim + j]), np.float64(ugrads[u, j]), 1.0, 1.0)
                emb[r, j] = w
                state[r, j] = a
                state[r, dim + j] = b


@njit
def adagrad_elem(lr: float, eps: float, cap: float, w: float, a: float, g: float) -> tuple[np.float64, np.float64]:
    """:func:`step_elem`'s Adagrad step, ``(w, accumulator)``, the accumulator at most ``cap``
    (:class:`ps.AdagradConfig`'s ``max_accumulator``; ``inf``: none): a loop over a row's weights
    that reads ``lr``, ``eps`` and ``cap`` once, outside it, compiles to vector instructions."""
    acc = np.float32(min(a + g * g, cap))
    return np.float64(np.float32(w - lr * g / (math.sqrt(np.float64(acc)) + eps))), np.float64(acc)


@njit
def step_elem(kind: IntLike, hyper: F64Array, w: float, a: float, b: float, g: float, bc1: float,
              bc2: float) -> tuple[float, float, float]:
    """One optimizer step of one weight: ``(w, a, b)`` after gradient ``g``, all float64.

    ``a``, ``b`` are the weight's state (Adagrad: accumulator; Adam: m, v; FTRL: z, n; unused
    ones pass through), ``bc1``, ``bc2`` Adam's bias corrections for the row's step. The one
    place the update formulas live (:func:`apply_updates` and :mod:`ps.sequential` both step through it);
    scalars only, so the hot loops pay no per-call array overhead. Storing a result into a
    float32 array rounds it as the formulas intend.
    """
    lr = hyper[0]
    if kind == OPT_SGD:
        return np.float64(np.float32(w - lr * g)), a, b
    if kind == OPT_ADAGRAD:
        w, a = adagrad_elem(lr, hyper[2], hyper[3], w, a, g)
        return w, a, b
    if kind == OPT_ADAM:
        b1, b2, eps = hyper[1], hyper[2], hyper[3]
        m = np.float32(b1 * a + (1.0 - b1) * g)
        v = np.float32(b2 * b + (1.0 - b2) * g * g)
        return (np.float64(np.float32(w - (lr / bc1) * m / (math.sqrt(np.float64(v)) / bc2 + eps))),
                np.float64(m), np.float64(v))
    if kind == OPT_FTRL:
        beta, l1, l2 = hyper[1], hyper[2], hyper[3]
        n_new = b + g * g
        sigma = (math.sqrt(n_new) - math.sqrt(b)) / lr
        z = a + g - sigma * w
        if abs(z) <= l1:
            return 0.0, z, n_new
        sign = 1.0 if z > 0 else -1.0
        return np.float64(np.float32(-(z - sign * l1) / ((beta + math.sqrt(n_new)) / lr + l2))), z, n_new
    return w, a, b


@njit
def adam_corrections(hyper: F64Array, step: float) -> tuple[float, float]:
    """Adam's bias corrections ``(1 - beta1**step, sqrt(1 - beta2**step))``."""
    return 1.0 - hyper[1] ** step, math.sqrt(1.0 - hyper[2] ** step)
