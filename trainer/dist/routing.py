"""The id bookkeeping of one distributed lookup (:mod:`trainer.dist.model`, steps 1 and 4-5):
which unique ``(table, id)`` pairs go to which owner, in what order, and where each returned
row lands in the packed buffer. Pure numpy, no collectives.

**Wire**, per example with U unique ids per example sent off-rank (about (N-1)/N of them):
``8 U`` (ids) + ``4 U d`` (rows) + ``4 U d`` (gradients) bytes through ``all_to_all``, ``d`` being
the row width (DeepFM here: 16 for a field, 1 for its first-order weight, so ``8 + 4*17*2`` per
(field, id) pair), plus ``8 (T + 3) N`` header bytes per step and the dense head's gradients
(``4 P`` bytes per step, all-reduced, P parameters) independent of the batch size.
:attr:`trainer.dist.model.DistributedModel.alltoall_bytes` counts what left this rank
(``allreduce_bytes``: the dense part).

>>> import numpy as np
>>> ids, tab = np.array([7, 3, 7, 3]), np.array([0, 0, 0, 1])   # id 7 twice in table 0
>>> p = plan(ids, tab, np.array([1, 0, 1, 0]), n_owners=2, n_tables=2)
>>> p.u_ids.tolist(), p.u_tab.tolist(), p.counts.tolist()          # owner 0 first, then owner 1
([3, 3, 7], [0, 1, 0], [[1, 1], [1, 0]])
>>> p.inv.tolist(), p.occ.tolist()                                  # packed position -> unique pair
([2, 0, 2, 1], [1, 1, 2])
>>> dims = np.array([2, 1])                                         # table 0: 2 floats, table 1: 1
>>> m = packed_rows(dims, p.u_tab, p.inv, tab)   # unique rows (3, 3, 7: at 0-1, 2, 3-4) -> packed
>>> m.take(np.arange(5, dtype=np.float32), m.size).tolist()
[3.0, 4.0, 0.0, 1.0, 3.0, 4.0, 2.0]
>>> m.sum_back(np.ones(7, np.float32), 5).tolist()                 # id 7's row summed twice
[1.0, 1.0, 1.0, 2.0, 2.0]

The loops are numba kernels: a packed buffer has ~10^5 floats per 1024 examples, and numpy's
element-wise index (an ``arange`` and two ``repeat`` calls of that size, then a gather and a
``bincount``) cost a rank ~1 ms a step that a row-wise copy does in a tenth of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from ps._jit import mix64, njit


def starts(lengths: np.ndarray) -> np.ndarray:
    """Exclusive prefix sums: where each of ``lengths``' pieces starts (empty in, empty out)."""
    return (np.cumsum(lengths) - lengths).astype(np.int64)


def wire_tables(rcounts: np.ndarray) -> np.ndarray:
    """Each received id's table in the wire layout: per requester, per table, ``rcounts[src, t]`` ids.

    >>> wire_tables(np.array([[2, 0, 1], [0, 1, 1]])).tolist()
    [0, 0, 2, 1, 2]
    """
    n, t = rcounts.shape
    return np.repeat(np.tile(np.arange(t), n), rcounts.reshape(-1))


@dataclass
class Plan:
    """A batch's unique ``(table, id)`` pairs in wire order (owner, table, id)."""

    u_ids: np.ndarray    # int64, the unique ids in wire order
    u_tab: np.ndarray    # their tables
    occ: np.ndarray      # int64 per unique pair: packed positions holding it (what count admission counts)
    inv: np.ndarray      # packed position -> index of its unique pair
    counts: np.ndarray   # int64 [owners, tables]: unique ids to each owner, per table


_TABLE_SALT = np.int64(-4417276706812531889)  # 0xC2B2AE3D27D4EB4F: spreads a table's ids apart


@njit
def _dedup(ids, tab):
    """Each position's unique ``(tab, id)`` pair (first-seen order) by open addressing."""
    n = ids.size
    cap = 16
    while cap < 2 * n:
        cap *= 2
    slots = np.full(cap, -1, np.int64)
    uix = np.empty(n, np.int64)
    first = np.empty(n, np.int64)     # unique pair -> a position holding it
    u = 0
    for i in range(n):
        x, t = ids[i], tab[i]
        h = np.int64(mix64(x ^ (t * _TABLE_SALT)) & np.uint64(cap - 1))
        while True:
            j = slots[h]
            if j < 0:
                slots[h] = u
                first[u] = i
                uix[i] = u
                u += 1
                break
            if ids[first[j]] == x and tab[first[j]] == t:
                uix[i] = j
                break
            h = (h + 1) & (cap - 1)
    return uix, first[:u]


@njit
def _wire_order(u_ids, u_group, n_groups):
    """The unique pairs sorted by ``(group, id)``: a sort by id, then a stable counting sort by
    the small group key. Returns ``(order, rank of each pair, pairs per group)``."""
    by_id = np.argsort(u_ids)  # no two pairs of one group share an id: any sort is stable enough
    per = np.zeros(n_groups, np.int64)
    for k in range(u_ids.size):
        per[u_group[k]] += 1
    at = np.empty(n_groups, np.int64)
    c = 0
    for g in range(n_groups):
        at[g] = c
        c += per[g]
    order = np.empty(u_ids.size, np.int64)
    rank = np.empty(u_ids.size, np.int64)
    for k in range(u_ids.size):
        j = by_id[k]
        g = u_group[j]
        order[at[g]] = j
        rank[j] = at[g]
        at[g] += 1
    return order, rank, per


def plan(ids: np.ndarray, tab: np.ndarray, owner: np.ndarray, n_owners: int, n_tables: int) -> Plan:
    """Deduplicate ``(tab, ids)`` and sort by ``(owner, table, id)``: that order is the wire order,
    so no per-id table tag is sent (the header's counts say where each table's ids start)."""
    ids, tab, owner = (np.ascontiguousarray(a, np.int64) for a in (ids, tab, owner))
    uix, first = _dedup(ids, tab)
    order, rank, per = _wire_order(ids[first], owner[first] * n_tables + tab[first], n_owners * n_tables)
    inv = rank[uix]
    occ = np.bincount(inv, minlength=first.size)
    pos = first[order]
    return Plan(ids[pos], tab[pos], occ, inv, per.reshape(n_owners, n_tables))


@njit
def _take(a, src, dst, dim, out):
    for i in range(src.size):
        s, d, n = src[i], dst[i], dim[i]
        # the default embedding width (trainer.config): a constant trip count the compiler
        # vectorizes; other widths take the plain loop
        if n == 16:
            for k in range(16):
                out[d + k] = a[s + k]
        else:
            for k in range(n):
                out[d + k] = a[s + k]


@njit
def _sum_back(a, src, dst, dim, n):
    acc = np.zeros(n, np.float64)  # float64 accumulation, in position order (as a bincount)
    for i in range(src.size):
        s, d, n = src[i], dst[i], dim[i]
        if n == 16:
            for k in range(16):
                acc[s + k] += a[d + k]
        else:
            for k in range(n):
                acc[s + k] += a[d + k]
    return acc.astype(np.float32)


@dataclass
class RowMap:
    """Rows of varying width moved between two flat float buffers: row ``i`` is ``dim[i]``
    floats at ``src[i]`` in the source and at ``dst[i]`` in the destination (``size`` floats)."""

    src: np.ndarray
    dst: np.ndarray
    dim: np.ndarray
    size: int

    def take(self, a: np.ndarray, size: int) -> np.ndarray:
        """The destination buffer (``size`` floats) filled from the source ``a``."""
        out = np.empty(size, a.dtype)
        _take(a, self.src, self.dst, self.dim, out)
        return out

    def put(self, a: np.ndarray, size: int) -> np.ndarray:
        """The reverse of :meth:`take`: a source-shaped buffer (``size`` floats) filled from
        ``a`` (destination-shaped); a source row several rows map from gets one of them."""
        out = np.empty(size, a.dtype)
        _take(a, self.dst, self.src, self.dim, out)
        return out

    def sum_back(self, a: np.ndarray, size: int) -> np.ndarray:
        """Per source float, the sum of every destination float mapped from it (float32 out)."""
        return _sum_back(np.ascontiguousarray(a, np.float32), self.src, self.dst, self.dim, size)


def packed_rows(dims: np.ndarray, u_tab: np.ndarray, inv: np.ndarray, tab: np.ndarray) -> RowMap:
    """The unique rows (concatenated, ``dims[u_tab]`` floats each) -> the packed buffer
    (``dims[tab]`` floats per position): ``buf = map.take(rows, map.size)``; the backward sums a
    row's gradients with :meth:`RowMap.sum_back` (built once per batch)."""
    p_dim = dims[tab]
    return RowMap(starts(dims[u_tab])[inv], starts(p_dim), p_dim, int(p_dim.sum()))


@dataclass
class Lookup:
    """One batch's looked-up rows and what its gradient step needs (:mod:`trainer.dist.model`'s steps)."""

    batch: object                 # trainer.batch.SparseBatch (completed)
    pb: object                    # ps.PackedBatch (salted ids, packed)
    buf: np.ndarray               # float32, the packed layout: the forward's input
    rows_map: RowMap              # unique rows (what we received) -> packed positions
    n_rows: int                   # float32 values of the unique rows (what we received)
    row_splits: list[int]         # values per owner (received rows; sent gradients)
    back_splits: list[int]        # values per requester (sent rows; received gradients)
    owned: object                 # trainer.dist.owner.Owned: what the update applies to
    global_size: int
    event_time: int
    comm_s: float
    error: Exception | None = None   # this rank's batch failed before its ids were sent
    any_failed: bool = False         # some rank's did (from the header)
    served_failed: np.ndarray | None = None  # per requester: its ids made this owner's gather raise
    lin: object = None                       # sequential training: the first-order ids (ps.PackedBatch) for rank 0
    sizes: list | None = None                # every rank's batch size (from the header)
    lin_ids: list | None = None              # every rank's count of first-order ids
    new_tasks: np.ndarray | None = None      # model.meta: this rank's task ids the owners started (trainer.dist.meta)
