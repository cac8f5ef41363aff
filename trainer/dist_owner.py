"""The owner's side of :mod:`trainer.distributed`: this rank's shard of every table serving the
lookups (step 4) and applying the gradients (step 8) of every rank's batch.

**Failures inside the owner.** No input is known to make a PS gather or update raise (ids and
gradients are checked before they are sent), but a bug or a MemoryError there must not stop the
group: a rank that raised in the middle of the step's collectives would leave the others waiting
until the collective timeout, then the launcher restarts the group, which reads the same examples
again: a crash loop.

* A **lookup** that raises is retried requester by requester; the requesters whose ids fail on
  their own read zeros and are named in the step's failure flags
  (:class:`trainer.distributed.OwnerLookupError` on those ranks), so every rank fails the step
  together, nothing is applied, and :func:`trainer.isolate.train_isolating_ranks` bisects only
  their batches down to the examples whose ids fail: dead-lettered like any failing example.
* An **update** that raises comes after every rank agreed on the step (the dense all-reduce):
  it cannot be undone on the other owners, so it is logged, counted (:attr:`Owner.failed_updates`,
  the ranks' ``failed_updates``) and skipped: that table's rows of this shard miss that one step.
  The step's examples are not dead-lettered.
"""

from __future__ import annotations

import logging

import numpy as np

from .dist_wire import starts

log = logging.getLogger(__name__)


class Owner:
    """This rank's shards (``tables``: one :class:`ps.EmbeddingTable` per table, in wire order)."""

    def __init__(self, tables: list, names: tuple, rank: int, world: int):
        self.tables, self.names, self.rank, self.world = tables, names, rank, world
        self.dims = np.array([t.dim for t in tables], np.int64)
        self.failed_updates = 0  # (table, step) updates that raised and were skipped

    def serve(self, r_ids, r_occ, rcounts, t_event: int, insert: bool):
        """Step 4, the owner's side: per table one gather of every requester's ids (in arrival
        order). Returns ``(reply, owned, served_failed)``: the rows (wire layout), per table the
        ids and their elements in the reply, and per requester whether its ids made a gather
        raise. A gather that raises is retried requester by requester, so only the ranks whose
        own ids fail are named (their rows read zeros; the step then fails on every rank, in
        :meth:`DistributedModel._learn`, and only those ranks bisect their batches); when no
        requester fails alone, all of that table's requesters are named."""
        n, T = self.world, len(self.names)
        r_tab = np.repeat(np.tile(np.arange(T), n), rcounts.reshape(-1))
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
        return reply, owned, served_failed

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


    def apply(self, owned: list, r_grads: np.ndarray, event_time: int) -> None:
        """Step 8 on this shard: every requester's gradients of a table in one optimizer step."""
        for ti, tid, elem in owned:
            try:
                self.tables[ti].apply_gradients(tid, r_grads[elem].reshape(tid.size, -1), event_time)
            except Exception as err:  # noqa: BLE001 - the step is agreed everywhere: skip, never hang
                self.failed_updates += 1
                log.error("rank %d: owner update of table %s failed, skipped (%d so far): %r",
                          self.rank, self.names[ti], self.failed_updates, err)
