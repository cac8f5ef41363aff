"""The owner's side of :mod:`trainer.dist.model`: this rank's shard of every table serving the
lookups (step 4) and applying the gradients (step 8) of every rank's batch.

**Failures inside the owner.** No input is known to make a PS gather or update raise (ids and
gradients are checked before they are sent), but a bug or a MemoryError there must not stop the
group: a rank that raised in the middle of the step's collectives would leave the others waiting
until the collective timeout, then the launcher restarts the group, which reads the same examples
again: a crash loop.

* A **lookup** that raises is retried requester by requester; the requesters whose ids fail on
  their own read zeros and are named in the step's failure flags
  (:class:`trainer.dist.model.OwnerLookupError` on those ranks), so every rank fails the step
  together, nothing is applied, and :func:`trainer.isolate.train_isolating_ranks` bisects only
  their batches down to the examples whose ids fail: dead-lettered like any failing example.
* An **update** that raises comes after every rank agreed on the step (the dense all-reduce):
  it cannot be undone on the other owners, so it is logged, counted (:attr:`Owner.failed_updates`,
  the ranks' ``failed_updates``) and skipped: that table's rows of this shard miss that one step.
  The step's examples are not dead-lettered.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from ps import PackedBatch, ParameterServer

from .owner_cache import OwnerCache, packed_segments
from .routing import RowMap, starts

log = logging.getLogger(__name__)


@dataclass
class Owned:
    """Which rows one step's lookup served, for that step's update (:meth:`Owner.apply`): the
    packed batch of every table (one PS call) and how its rows map to the wire's, or, after
    the per-table path, ``per_table``: ``[(table index, ids, elements in the reply)]``."""

    packed: PackedBatch | None = None
    rows: RowMap | None = None          # the packed rows -> the wire's
    per_table: list | None = None


class Owner:
    """This rank's shards (``tables``: one :class:`ps.EmbeddingTable` per table, in wire order;
    ``ps``: a :class:`ps.ParameterServer` over them whose ``table_names`` are ``names``; ``cache``:
    the shard's hot rows on the device, :mod:`trainer.dist.owner_cache`)."""

    def __init__(self, tables: list, names: tuple, rank: int, world: int, ps: ParameterServer | None = None,
                 cache: OwnerCache | None = None):
        self.tables, self.names, self.rank, self.world, self.ps = tables, names, rank, world, ps
        self.cache = cache
        self.dims = np.array([t.dim for t in tables], np.int64)
        self.failed_updates = 0  # (table, step) updates that raised and were skipped

    def serve(self, r_ids, r_occ, rcounts, r_tab, t_event: int, insert: bool):
        """Step 4, the owner's side: every requester's ids (in arrival order) looked up, in one
        packed PS call for all tables (:meth:`ps.ParameterServer.gather_packed`: what the
        1-process model calls) when no admission counts occurrences. Returns ``(reply, owned,
        served_failed)``: the rows (wire layout), an :class:`Owned`, and per requester whether
        its ids made a gather raise. A packed gather that raises is done again table by table
        and a table's gather that raises requester by requester, so only the ranks whose own
        ids fail are named (their rows read zeros; the step then fails on every rank, in
        :meth:`DistributedModel._learn`, and only those ranks bisect their batches); when no
        requester fails alone, all of that table's requesters are named."""
        if r_occ is None and self.ps is not None:
            try:
                return self._serve_packed(r_ids, rcounts, r_tab, t_event, insert)
            except Exception as err:  # noqa: BLE001 - found table by table below
                log.error("rank %d: owner's packed lookup failed: %r; retrying table by table", self.rank, err)
        return self._serve_tables(r_ids, r_occ, rcounts, r_tab, t_event, insert)

    def _serve_packed(self, r_ids, rcounts, r_tab, t_event: int, insert: bool):
        n, T = self.world, len(self.names)
        # wire order (requester, table) -> table-major; small ints sort stably by radix
        perm = np.argsort(r_tab.astype(np.int16) if T < 2 ** 15 else r_tab, kind="stable")
        per_table = rcounts.sum(0)
        present = np.flatnonzero(per_table)
        offsets = np.zeros(present.size + 1, np.int64)
        np.cumsum(per_table[present], out=offsets[1:])
        pb = PackedBatch(tuple(self.names[t] for t in present.tolist()), r_ids[perm], offsets, present)
        buf = self.ps.gather_packed(pb, insert=insert, event_time=t_event)
        if self.cache is not None:  # the rows the cache holds are newer than the host's
            self.cache.serve(packed_segments(pb, self.dims), buf)
        pos = np.empty(perm.size, np.int64)            # wire position -> its table-major position
        pos[perm] = np.arange(perm.size)
        w_dim = self.dims[r_tab]
        rows = RowMap(starts(self.dims[r_tab[perm]])[pos], starts(w_dim), w_dim, int(w_dim.sum()))
        return rows.take(buf, rows.size), Owned(packed=pb, rows=rows), np.zeros(n, bool)

    def _serve_tables(self, r_ids, r_occ, rcounts, r_tab, t_event: int, insert: bool):
        n, T = self.world, len(self.names)
        r_src = np.repeat(np.repeat(np.arange(n), T), rcounts.reshape(-1))
        r_dim = self.dims[r_tab]
        r_start = starts(r_dim)
        reply = np.zeros(int(r_dim.sum()), np.float32)
        owned, served_failed = [], np.zeros(n, bool)
        for ti in np.unique(r_tab).tolist():
            sel = np.flatnonzero(r_tab == ti)
            d = int(self.dims[ti])
            elem = (r_start[sel][:, None] + np.arange(d)).reshape(-1)
            tid = r_ids[sel]
            occ = r_occ[sel] if r_occ is not None else None
            try:
                reply[elem] = self._gather(ti, tid, occ, t_event, insert).reshape(-1)
            except Exception as err:  # noqa: BLE001 - named to the requesters, isolated in lockstep
                log.error("rank %d: owner lookup of table %s failed: %r; retrying requester by requester",
                          self.rank, self.names[ti], err)
                alone = self._serve_each(ti, sel, r_src[sel], tid, occ, t_event, insert, reply, r_start)
                served_failed |= alone if alone.any() else np.isin(np.arange(n), r_src[sel])
            owned.append((ti, tid, elem))
        if self.cache is not None:
            self.cache.serve(owned, reply)
        return reply, Owned(per_table=owned), served_failed

    def _serve_each(self, ti, sel, src, tid, occ, t_event, insert, reply, r_start) -> np.ndarray:
        """A failed gather of table ``ti`` again, one requester at a time: which fail alone."""
        failed, d = np.zeros(self.world, bool), int(self.dims[ti])
        for r in np.unique(src).tolist():
            mine = src == r
            try:
                vals = self._gather(ti, tid[mine], None if occ is None else occ[mine], t_event, insert)
            except Exception:  # noqa: BLE001 - this requester's ids fail on their own
                failed[r] = True
                continue
            reply[(r_start[sel[mine]][:, None] + np.arange(d)).reshape(-1)] = vals.reshape(-1)
        return failed

    def _gather(self, ti: int, tid: np.ndarray, occ, t_event: int, insert: bool) -> np.ndarray:
        if not insert:  # scoring: absent ids read zeros, nothing is admitted
            return self.tables[ti].gather(tid)
        if occ is not None:  # the sketch counts every occurrence, as in the 1-process batch
            # the row as it is after the batch's occurrences (an id admitted by its 2nd
            # occurrence reads its row everywhere; the 1-process PS gives its 1st occurrence
            # zeros: a difference only in the batch that admits an id)
            return self.tables[ti].gather(np.repeat(tid, occ), insert=True, event_time=t_event)[starts(occ) + occ - 1]
        return self.tables[ti].gather(tid, insert=True, event_time=t_event)


    def apply(self, owned: Owned, r_grads: np.ndarray, event_time: int) -> None:
        """Step 8 on this shard: every requester's gradients of a table in one optimizer step
        (of every table in one packed PS call, after a packed lookup); the cached rows' on the
        device (:mod:`trainer.dist.owner_cache`: the host steps zeros for them)."""
        if owned.packed is not None:
            g = owned.rows.put(r_grads, owned.rows.size)  # the same float count on both sides
            segments = packed_segments(owned.packed, self.dims) if self.cache is not None else None
            taken = self.cache.take(segments, g) if self.cache is not None else None
            try:
                self.ps.apply_packed_gradients(owned.packed, g, event_time)
            except Exception as err:  # noqa: BLE001 - validation raises before any row changes
                log.error("rank %d: owner's packed update failed: %r; applying table by table", self.rank, err)
                self._apply_tables(segments or packed_segments(owned.packed, self.dims), g, event_time)
        else:
            taken = self.cache.take(owned.per_table, r_grads) if self.cache is not None else None
            self._apply_tables(owned.per_table, r_grads, event_time)
        if taken is not None:  # after the host's update: admission copies the host's rows
            self.cache.finish(taken)

    def _apply_tables(self, per_table, r_grads: np.ndarray, event_time: int) -> None:
        for ti, tid, elem in per_table:
            try:
                self.tables[ti].apply_gradients(tid, r_grads[elem].reshape(tid.size, -1), event_time)
            except Exception as err:  # noqa: BLE001 - the step is agreed everywhere: skip, never hang
                self.failed_updates += 1
                log.error("rank %d: owner update of table %s failed, skipped (%d so far): %r",
                          self.rank, self.names[ti], self.failed_updates, err)
