"""The id bookkeeping of one distributed lookup (:mod:`trainer.distributed`, steps 1 and 4-5):
which unique ``(table, id)`` pairs go to which owner, in what order, and where each returned
row lands in the packed buffer. Pure numpy, no collectives.

**Wire**, per example with U unique ids per example sent off-rank (about (N-1)/N of them):
``8 U`` (ids) + ``4 U d`` (rows) + ``4 U d`` (gradients) bytes through ``all_to_all``, ``d`` being
the row width (DeepFM here: 16 for a field, 1 for its first-order weight, so ``8 + 4*17*2`` per
(field, id) pair), plus ``8 (T + 3) N`` header bytes per step and the dense head's gradients
(``4 P`` bytes per step, all-reduced, P parameters) independent of the batch size.
:attr:`trainer.distributed.DistributedModel.alltoall_bytes` counts what left this rank
(``allreduce_bytes``: the dense part).

>>> import numpy as np
>>> ids, tab = np.array([7, 3, 7, 3]), np.array([0, 0, 0, 1])   # id 7 twice in table 0
>>> p = plan(ids, tab, np.array([1, 0, 1, 0]), n_owners=2, n_tables=2)
>>> p.u_ids.tolist(), p.u_tab.tolist(), p.counts.tolist()          # owner 0 first, then owner 1
([3, 3, 7], [0, 1, 0], [[1, 1], [1, 0]])
>>> p.inv.tolist(), p.occurrences().tolist()                        # packed position -> unique pair
([2, 0, 2, 1], [1, 1, 2])
>>> packed_index(np.array([2, 1]), p.u_tab, p.inv, tab).tolist()    # dims 2 and 1: rows 0-1, 2, 3-4
[3, 4, 0, 1, 3, 4, 2]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def starts(lengths: np.ndarray) -> np.ndarray:
    """Exclusive prefix sums: where each of ``lengths``' pieces starts (empty in, empty out)."""
    return (np.cumsum(lengths) - lengths).astype(np.int64)


@dataclass
class Plan:
    """A batch's unique ``(table, id)`` pairs in wire order (owner, table, id)."""

    u_ids: np.ndarray    # int64, the unique ids in wire order
    u_tab: np.ndarray    # their tables
    first: np.ndarray    # bool per sorted position: the first occurrence of its pair
    inv: np.ndarray      # packed position -> index of its unique pair
    counts: np.ndarray   # int64 [owners, tables]: unique ids to each owner, per table

    def occurrences(self) -> np.ndarray:
        """How many packed positions hold each unique pair (what count admission counts)."""
        return np.diff(np.flatnonzero(np.append(self.first, True)))


def plan(ids: np.ndarray, tab: np.ndarray, owner: np.ndarray, n_owners: int, n_tables: int) -> Plan:
    """Deduplicate ``(tab, ids)`` and sort by ``(owner, table, id)``: that order is the wire order,
    so no per-id table tag is sent (the header's counts say where each table's ids start)."""
    # one int64 sort by id, then a stable sort by the small (owner, table) key: numpy sorts
    # small ints stably by radix, ~4x faster than lexsort over three keys (same order)
    by_id = np.argsort(ids)
    group = owner[by_id] * n_tables + tab[by_id]
    order = by_id[np.argsort(group.astype(np.int16) if n_owners * n_tables < 2 ** 15 else group, kind="stable")]
    s_ids, s_tab = ids[order], tab[order]
    first = np.ones(ids.size, bool)
    first[1:] = (s_ids[1:] != s_ids[:-1]) | (s_tab[1:] != s_tab[:-1])
    inv = np.empty(ids.size, np.int64)
    inv[order] = np.cumsum(first) - 1
    u_own = owner[order][first]
    counts = np.bincount(u_own * n_tables + s_tab[first], minlength=n_owners * n_tables).reshape(n_owners, n_tables)
    return Plan(s_ids[first], s_tab[first], first, inv, counts)


def packed_index(dims: np.ndarray, u_tab: np.ndarray, inv: np.ndarray, tab: np.ndarray) -> np.ndarray:
    """Element-wise index from the unique rows (concatenated, ``dims[u_tab]`` floats each) to the
    packed buffer (``dims[tab]`` floats per position): ``buf = rows[index]``; the backward sums a
    row's gradients with the same index (built once per batch)."""
    u_dim = dims[u_tab]
    p_dim = dims[tab]
    within = np.arange(int(p_dim.sum()), dtype=np.int64) - np.repeat(starts(p_dim), p_dim)
    return np.repeat(starts(u_dim)[inv], p_dim) + within


@dataclass
class Lookup:
    """One batch's looked-up rows and what its gradient step needs (:mod:`trainer.distributed`'s steps)."""

    batch: object                 # trainer.batch.SparseBatch (completed)
    pb: object                    # ps.PackedBatch (salted ids, packed)
    buf: np.ndarray               # float32, the packed layout: the forward's input
    src_elem: np.ndarray          # buf[i] = rows[src_elem[i]]: unique rows -> packed positions
    n_rows: int                   # float32 values of the unique rows (what we received)
    row_splits: list[int]         # values per owner (received rows; sent gradients)
    back_splits: list[int]        # values per requester (sent rows; received gradients)
    owned: object                 # trainer.dist_owner.Owned: what the update applies to
    global_size: int
    event_time: int
    comm_s: float
    error: Exception | None = None   # this rank's batch failed before its ids were sent
    any_failed: bool = False         # some rank's did (from the header)
    served_failed: np.ndarray | None = None  # per requester: its ids made this owner's gather raise
