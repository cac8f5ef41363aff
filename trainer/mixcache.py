"""The MixCache (ScaleFreeCTR): an embedding block's hot rows, with their optimizer state, on the
model's device in front of the host PS (``trainer.cache_rows`` rows per table).

A step of :meth:`trainer.model.SparseModel.train_step` with the cache on:

1. the PS gathers every id on the host as it does without a cache: admission and inserts stay its own;
2. :meth:`MixCache.locate` gives each looked-up row its cache slot or -1 (a sorted key array per
   table and one ``searchsorted``: the batch's virtual ids);
3. :meth:`MixCache.assemble` builds the rows on the device: the misses copied from the host buffer
   in one transfer, the hits read from the cache;
4. after the backward pass, :meth:`MixCache.split_gradients` keeps the hits' gradients on the
   device and gives the host PS the misses' and zeros for the hits. A zero step of SGD or Adagrad
   leaves a row's values and state as they are and does the rest of the PS's bookkeeping (the
   last-update time, the change mark deltas read, the TTL watermark) exactly as an uncached step;
5. :meth:`MixCache.step` steps the hits: gradients summed per row in the batch's order
   (``index_add_``, float32, as :func:`ps.optimizers.dedupe_into` sums them) and the table's
   optimizer in float64 rounded to float32, :func:`ps.optimizers.step_elem`'s formulas: on the CPU
   the rows equal the PS's bit for bit (CUDA sums with atomics, in no fixed order);
6. :meth:`MixCache.admit`: a missed row enters once a count-min sketch has seen it in
   ``admit_after`` steps (its host row, just stepped, copied in); a full table's least recently
   used row leaves, written back first. LRU, not LFU: a row's heat in a stream moves (a user's
   session), and a frequency kept forever would hold yesterday's rows.

:meth:`MixCache.write_back` copies every row stepped since the last one to the host: before each
sparse delta, each snapshot and each read of the tables from outside the model.

Cached: the tables of the embedding block stepped by SGD or Adagrad with no TTL. Adam's per-row
step count and FTRL's recomputed weights make a zero step change a row, and TTL expiry would
remove a row the cache holds: those tables' rows go through the host as without a cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ps import EmbeddingTable, PackedBatch, SGDConfig
from ps.admission import CountMinSketch
from ps.config import AdagradConfig

from .device import Transfers
from .step_checks import NonFiniteStepError

__all__ = ["CacheStats", "Located", "MixCache", "cacheable"]


def cacheable(table: EmbeddingTable) -> bool:
    """Whether a table's rows may live in the cache (SGD or Adagrad, no TTL)."""
    cfg = table.config
    return isinstance(cfg.optimizer, SGDConfig | AdagradConfig) and cfg.ttl_seconds is None


@dataclass
class Located:
    """A block's looked-up rows: ``slot`` per row (-1: a miss), the hits' and misses' positions,
    and each segment's table and span (for admission)."""

    slot: np.ndarray
    hit: np.ndarray
    miss: np.ndarray
    segments: list[tuple[int, int, np.ndarray]]  # (cached table index, start row, ids)


class CacheStats:
    """Process-lifetime counts: rows looked up and hit, rows written back, rows admitted/evicted."""

    def __init__(self) -> None:
        self.lookups = self.hits = self.written_back = self.admitted = self.evicted = 0

    def __repr__(self) -> str:
        return f"CacheStats({vars(self)})"

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


class _CachedTable:
    """One table's part of the cache: slots ``[base, base + capacity)``, keys sorted for lookups."""

    def __init__(self, table: EmbeddingTable, base: int, capacity: int, sketch_width: int) -> None:
        self.table = table
        self.base, self.capacity = base, capacity
        opt = table.config.optimizer
        self.adagrad = isinstance(opt, AdagradConfig)
        self.lr = float(opt.lr)
        self.eps = float(opt.eps) if isinstance(opt, AdagradConfig) else 0.0
        cap = opt.max_accumulator if isinstance(opt, AdagradConfig) else None
        self.cap = float("inf") if cap is None else float(cap)
        self.width = table.config.slot_width
        self.keys = np.empty(0, np.int64)  # sorted
        self.slots = np.empty(0, np.int64)  # the slot of keys[i]
        self.free = list(range(base + capacity - 1, base - 1, -1))
        self.sketch = CountMinSketch(width=sketch_width)
        self.index = -1  # the table's index in its PS (MixCache sets it)

    def find(self, ids: np.ndarray) -> np.ndarray:
        if not self.keys.size:
            return np.full(ids.size, -1, np.int64)
        pos = np.minimum(np.searchsorted(self.keys, ids), self.keys.size - 1)
        return np.where(self.keys[pos] == ids, self.slots[pos], -1)

    def add(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Merge new ``keys`` (none cached yet) into the sorted array: O(C + n log n) at C cached
        rows, not a sort of all C every admission."""
        order = np.argsort(keys, kind="stable")
        keys, slots = keys[order], slots[order]
        # the new keys' places in the merged array: their rank among themselves plus the old keys before them
        at = np.searchsorted(self.keys, keys) + np.arange(keys.size)
        n = self.keys.size + keys.size
        old = np.ones(n, np.bool_)
        old[at] = False
        merged_keys, merged_slots = np.empty(n, np.int64), np.empty(n, np.int64)
        merged_keys[at], merged_slots[at] = keys, slots
        merged_keys[old], merged_slots[old] = self.keys, self.slots
        self.keys, self.slots = merged_keys, merged_slots

    def remove(self, slots: np.ndarray) -> None:
        keep = ~np.isin(self.slots, slots)
        self.keys, self.slots = self.keys[keep], self.slots[keep]
        self.free.extend(slots.tolist())


class MixCache:
    """The cache of one block of ``dim``-wide rows over ``tables`` (those :func:`cacheable`)."""

    def __init__(self, tables: dict[int, EmbeddingTable], dim: int, capacity: int, io: Transfers,
                 admit_after: int = 2, sketch_width: int = 1 << 16) -> None:
        if capacity < 1:
            raise ValueError(f"cache capacity must be >= 1 row per table, got {capacity}")
        self.io, self.dim, self.admit_after = io, dim, admit_after
        self.parts = {ti: _CachedTable(t, i * capacity, capacity, sketch_width)
                      for i, (ti, t) in enumerate(sorted(tables.items()))}
        for ti, part in self.parts.items():
            part.index = ti
        #: told ``(table index, ids)`` of the rows written to the host (a lookahead re-reads them)
        self.on_host_write: Callable[[int, np.ndarray], None] | None = None
        n = capacity * len(self.parts)
        width = max((p.width for p in self.parts.values()), default=0)
        self.values = torch.zeros((n, dim), dtype=torch.float32, device=io.device)
        self.state = torch.zeros((n, width), dtype=torch.float32, device=io.device)
        self.key_of = np.full(n, -1, np.int64)
        self.last_used = np.zeros(n, np.int64)
        self.dirty = np.zeros(n, np.bool_)
        self.steps = 0
        self.stats = CacheStats()

    def __len__(self) -> int:
        return int((self.key_of >= 0).sum())

    # ------------------------------------------------------------------ a step
    def locate(self, pb: PackedBatch, k0: int, k1: int) -> Located:
        """Cache slots of the rows of ``pb``'s segments ``k0..k1-1`` (the block, in packed order)."""
        return self.locate_segments([(int(pb.slot_table[k]), pb.slot_ids(k)) for k in range(k0, k1)])

    def locate_segments(self, segments: list[tuple[int, np.ndarray]], count: bool = True) -> Located:
        """Cache slots of the rows of ``segments`` (``(table index, ids)`` each, rows concatenated in
        that order; a table not cached reads -1). The 1-process block is one packed batch's
        segments; an owner of :mod:`trainer.dist` locates its served tables' ids
        (:mod:`trainer.dist.owner_cache`). ``count``: add them to :attr:`stats` (not when an
        owner locates a step's rows again for their update)."""
        slot = np.full(sum(ids.size for _, ids in segments), -1, np.int64)
        found, start = [], 0
        for ti, ids in segments:
            part = self.parts.get(ti)
            if part is not None:
                slot[start:start + ids.size] = part.find(ids)
                found.append((ti, start, ids))
            start += ids.size
        hit = np.flatnonzero(slot >= 0)
        if count:
            self.stats.lookups += slot.size
            self.stats.hits += hit.size
        return Located(slot, hit, np.flatnonzero(slot < 0), found)

    def read_hits(self, at: Located) -> np.ndarray:
        """The hit rows' values on the host ``[hits, dim]`` (an owner serves them to other ranks)."""
        return self.io.to_host(self.values[self.io.to_device(at.slot[at.hit])])

    def assemble(self, at: Located, rows: np.ndarray) -> torch.Tensor:
        """The block's rows on the device: misses from ``rows`` (host ``[n, dim]``), hits from the cache."""
        if not at.hit.size:
            return self.io.to_device(rows)
        w = torch.empty((at.slot.size, self.dim), dtype=torch.float32, device=self.io.device)
        if at.miss.size:
            w[self.io.to_device(at.miss)] = self.io.to_device(np.ascontiguousarray(rows[at.miss]))
        w[self.io.to_device(at.hit)] = self.values[self.io.to_device(at.slot[at.hit])]
        return w

    def split_gradients(self, at: Located, grad: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
        """``(host gradients [n, dim]: the misses', zeros for the hits; the hits' on the device)``.
        Raises :class:`NonFiniteStepError` before anything is applied when a hit's is not finite
        (the PS checks the misses' itself, before it writes a row)."""
        if not at.hit.size:
            return self.io.to_host(grad), grad[:0]
        hits = grad[self.io.to_device(at.hit)]
        if not bool(torch.isfinite(hits).all()):
            raise NonFiniteStepError("a cached row's gradient is not finite; nothing applied")
        host = np.zeros((at.slot.size, self.dim), np.float32)
        if at.miss.size:
            host[at.miss] = self.io.to_host(grad[self.io.to_device(at.miss)])
        return host, hits

    @torch.no_grad()
    def step(self, at: Located, hits: torch.Tensor) -> None:
        """Step the hit rows with their tables' optimizers (the PS's formulas, float64)."""
        self.steps += 1
        if not at.hit.size:
            return
        uslots, inv = np.unique(at.slot[at.hit], return_inverse=True)
        # index_add_ adds the hits in their batch order: each row's sum is the PS's, bit for bit
        g = torch.zeros((uslots.size, self.dim), dtype=torch.float32, device=self.io.device)
        g.index_add_(0, self.io.to_device(inv.astype(np.int64)), hits)
        us = self.io.to_device(uslots)
        for part in self.parts.values():
            mine = (uslots >= part.base) & (uslots < part.base + part.capacity)
            if not mine.any():
                continue
            sel = self.io.to_device(np.flatnonzero(mine))
            rows = us[sel]
            g64 = g[sel].double()
            w = self.values[rows].double()
            if part.adagrad:
                acc = (self.state[rows, :part.width].double() + g64 * g64).clamp(max=part.cap).float()
                self.values[rows] = (w - part.lr * g64 / (acc.double().sqrt() + part.eps)).float()
                self.state[rows, :part.width] = acc
            else:
                self.values[rows] = (w - part.lr * g64).float()
        self.last_used[uslots] = self.steps
        self.dirty[uslots] = True

    def admit(self, at: Located) -> None:
        """Rows missed in ``admit_after`` steps enter (from the host, after this step's update);
        a full table's least recently used rows leave for them (written back first)."""
        for ti, start, ids in at.segments:
            part = self.parts[ti]
            missed = np.unique(ids[at.slot[start:start + ids.size] < 0])
            if not missed.size:
                continue
            hot = missed[part.sketch.add(missed) >= self.admit_after]
            if not hot.size:
                continue
            hot = hot[~np.isin(hot, part.keys)]  # a key two segments share enters once
            # a row the host has not admitted (count admission) has nothing to cache yet
            hot = hot[part.table.contains(hot)]
            need = hot.size - len(part.free)
            if need > 0:
                owned = part.slots
                # rows stepped this very step stay: they are the hottest there are
                old = owned[self.last_used[owned] < self.steps]
                old = old[np.argsort(self.last_used[old], kind="stable")[:need]]
                self._evict(part, old)
                hot = hot[:len(part.free)]
            if not hot.size:
                continue
            slots = np.array([part.free.pop() for _ in range(hot.size)], np.int64)
            values, state = part.table.read_rows(hot)
            s = self.io.to_device(slots)
            self.values[s] = self.io.to_device(values)
            if part.width:
                self.state[s, :part.width] = self.io.to_device(state)
            self.key_of[slots] = hot
            self.last_used[slots] = self.steps
            part.add(hot, slots)
            self.stats.admitted += hot.size

    # ------------------------------------------------------------------ the host's copy
    def write_back(self) -> int:
        """Copy every row stepped since the last write-back to the host PS; the rows written."""
        n = 0
        for part in self.parts.values():
            slots = part.slots[self.dirty[part.slots]]
            n += self._write(part, slots)
        return n

    def _write(self, part: _CachedTable, slots: np.ndarray) -> int:
        if not slots.size:
            return 0
        s = self.io.to_device(slots)
        state = self.io.to_host(self.state[s, :part.width]) if part.width else np.zeros((slots.size, 0), np.float32)
        part.table.write_rows(self.key_of[slots], self.io.to_host(self.values[s]), state)
        if self.on_host_write is not None:
            self.on_host_write(part.index, self.key_of[slots])
        self.dirty[slots] = False
        self.stats.written_back += slots.size
        return int(slots.size)

    def _evict(self, part: _CachedTable, slots: np.ndarray) -> None:
        self._write(part, slots[self.dirty[slots]])
        part.remove(slots)
        self.key_of[slots] = -1
        self.stats.evicted += slots.size
