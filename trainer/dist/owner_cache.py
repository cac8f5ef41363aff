"""The MixCache (:mod:`trainer.mixcache`) on N ranks: each **owner** caches its own shard's hot rows
(with their optimizer state) on its device, in front of its host shard.

**Owner-side, not requester-side.** The PS design gives every row one owner, the only process that
writes it (:mod:`trainer.dist.owner`): the owner sums every requester's gradient of a row and steps
it once. A cache on that side keeps this: one writer per row, no copy of a row anywhere that could
go stale, no invalidation protocol, and the write-back before a delta or a snapshot is each
rank's own, of its own shard (each rank publishes and snapshots its shard). A requester-side cache
would hold copies of rows that other ranks update every step: to stay exact it would need the
owner's fresh values back each step anyway (what the lookup already sends), and two ranks caching
one row would both step it. The rows themselves still cross between ranks as host memory (gloo);
what the owner's cache takes off the host is the hot rows' optimizer step and their state.

Per step, on the owner (the 1-process cache's steps, :mod:`trainer.mixcache`, over the owner's
packed batch: every requester's ids, table by table):

1. *serve* (step 4 of :mod:`trainer.dist.model`): the host shard gathers every id as without a
   cache (admission, inserts, times stay the PS's); the rows the cache holds are then overwritten
   with the cache's values (one device-to-host copy of the hits) before the reply is sent;
2. *update* (step 8): the step's ids are located again (in ``hybrid`` a later lookup may have run
   and a row been admitted or evicted since step 1; located now, a row is stepped where its newest
   value is), the hits' gradients go to the device (one copy) and the host shard steps zeros for
   them: a zero SGD or Adagrad step leaves a row as it is and does the PS's bookkeeping (time,
   change mark); then :meth:`MixCache.step` steps the hits with the PS's formulas (float32 sums in
   the packed order, the PS's order: on the CPU bit for bit the host's result) and
   :meth:`MixCache.admit` admits and evicts (written back first).

:meth:`trainer.dist.model.DistributedModel.flush` writes every stepped row back to the host shard:
before each sparse publication and each snapshot (the online ranks flush there), so deltas and
snapshots, and a resharding restore reading them, see the host shard alone.
"""

from __future__ import annotations

import numpy as np
import torch

from ps import PackedBatch

from ..mixcache import Located, MixCache

__all__ = ["OwnerCache", "packed_segments"]


def packed_segments(pb: PackedBatch, dims: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """``(table index, ids, their float positions)`` of each segment of ``pb`` in the packed buffer
    (:meth:`ps.ParameterServer.gather_packed`'s layout: the segments' rows back to back)."""
    out, at = [], 0
    for k in range(len(pb.slots)):
        ti, ids = int(pb.slot_table[k]), pb.slot_ids(k)
        n = ids.size * int(dims[ti])
        out.append((ti, ids, np.arange(at, at + n, dtype=np.int64)))
        at += n
    return out


class OwnerCache:
    """One owner's :class:`MixCache` (the module docstring); ``segments``: ``(table index, ids,
    float positions of their rows in a flat buffer)``, as :func:`packed_segments` or the owner's
    per-table path give them."""

    def __init__(self, cache: MixCache) -> None:
        self.cache = cache

    def _locate(self, segments, count: bool) -> tuple[Located, np.ndarray]:
        """The cached tables' rows located, and their float positions ``[rows, dim]``."""
        mine = [(ti, ids, e) for ti, ids, e in segments if ti in self.cache.parts and ids.size]
        at = self.cache.locate_segments([(ti, ids) for ti, ids, _ in mine], count)
        pos = (np.concatenate([e.reshape(-1, self.cache.dim) for _, _, e in mine]) if mine
               else np.zeros((0, self.cache.dim), np.int64))
        return at, pos

    def serve(self, segments, flat: np.ndarray) -> None:
        """Step 1: the hits' values written into ``flat`` (the rows about to be sent)."""
        at, pos = self._locate(segments, True)
        if at.hit.size:
            flat[pos[at.hit]] = self.cache.read_hits(at)

    def take(self, segments, flat: np.ndarray) -> tuple[Located, torch.Tensor]:
        """Step 2, before the host's update: the hits' gradients on the device, zeros left for
        them in ``flat`` (the gradients the host shard then applies)."""
        at, pos = self._locate(segments, False)
        idx = pos[at.hit]
        hits = self.cache.io.to_device(np.ascontiguousarray(flat[idx]))
        flat[idx] = 0.0
        return at, hits

    def finish(self, taken: tuple[Located, torch.Tensor]) -> None:
        """Step 2, after the host's update: the hits stepped, rows admitted (from the host, just
        stepped) and evicted."""
        at, hits = taken
        self.cache.step(at, hits)
        self.cache.admit(at)

    def write_back(self) -> int:
        return self.cache.write_back()
