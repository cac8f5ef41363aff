"""Many tables behind one packed lookup (PICASSO-style packing).

A model has many feature *slots* (user_id, item_id, hist_items, ...), each backed by a
table; several slots may share one table. :class:`ParameterServer` packs a batch of
all slots into one id array with per-slot offsets and resolves it in **one** numba
call over every table and shard (not one call per slot); the result is one float32
buffer with a zero-copy ``[n_slot, dim]`` view per slot.

>>> from ps import TableConfig
>>> ps_ = ParameterServer([TableConfig(name="user", dim=4), TableConfig(name="item", dim=8, shards=2)],
...                       slots={"hist_items": "item"})
>>> batch = {"user": np.array([1, 2]), "item": np.array([7]), "hist_items": np.array([7, 8, 9])}
>>> emb = ps_.gather(batch, insert=True, event_time=1_000)
>>> {k: v.shape for k, v in emb.items()}
{'user': (2, 4), 'item': (1, 8), 'hist_items': (3, 8)}
>>> bool((emb["item"][0] == emb["hist_items"][0]).all())  # same table, same row
True
>>> grads = {k: np.ones_like(v) for k, v in emb.items()}
>>> ps_.apply_gradients(batch, grads, event_time=2_000)
{'user': 2, 'item': 3}
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
from numba.typed import List

from ._jit import njit, prefetch, prefetch_row
from ._validate import as_event_time, as_grads, as_ids
from .config import TableConfig
from .errors import InvalidInputError, UnknownTableError
from .hashmap import GROUP, home, resolve
from .shard import TableShard
from .sharding import shard_index
from .table import EmbeddingTable


@njit
def packed_gather_kernel(ids, seg_off, seg_table, tab_base, tab_nshards, slots_list, emb_list,
                         out, out_off, rows, shard_of):
    """Resolve and copy every slot of a packed batch; rows[i] = -1 where absent (zeros out).

    Per (slot, shard), ids go through in groups of :data:`~ps.hashmap.GROUP`: hash and
    prefetch home slots, resolve and prefetch rows, then copy, so misses overlap.
    """
    pos = np.empty(GROUP, np.int64)
    hs = np.empty(GROUP, np.int64)
    for s in range(seg_table.size):
        t = seg_table[s]
        base = tab_base[t]
        ns = tab_nshards[t]
        a = seg_off[s]
        b = seg_off[s + 1]
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


@dataclass(frozen=True)
class PackedBatch:
    """A batch of many slots as one id array: slot ``k`` owns ``ids[offsets[k]:offsets[k+1]]``."""

    slots: tuple[str, ...]
    ids: np.ndarray
    offsets: np.ndarray
    slot_table: np.ndarray  # index into ParameterServer.table_names, per slot

    def slot_ids(self, k: int) -> np.ndarray:
        return self.ids[self.offsets[k]:self.offsets[k + 1]]


class ParameterServer:
    """Holds named :class:`EmbeddingTable` s and serves packed multi-slot batches.

    ``slots`` maps extra slot names to table names; every table is also a slot of its
    own name.
    """

    def __init__(self, tables: Sequence[TableConfig | EmbeddingTable], slots: Mapping[str, str] | None = None):
        self.tables: dict[str, EmbeddingTable] = {}
        for t in tables:
            t = t if isinstance(t, EmbeddingTable) else EmbeddingTable(t)
            if t.name in self.tables:
                raise InvalidInputError(f"duplicate table name {t.name!r}")
            self.tables[t.name] = t
        self.table_names = tuple(self.tables)
        self._tindex = {n: i for i, n in enumerate(self.table_names)}
        self.slots = {n: n for n in self.table_names}
        for slot, table in (slots or {}).items():
            if table not in self.tables:
                raise UnknownTableError(f"slot {slot!r} refers to unknown table {table!r}")
            self.slots[slot] = table
        self._shards = [s for t in self.tables.values() for s in t.shards]
        self._local = all(isinstance(s, TableShard) for s in self._shards)
        nsh = [len(t.shards) for t in self.tables.values()]
        self._tab_nshards = np.array(nsh, np.int64)
        self._tab_base = np.concatenate([[0], np.cumsum(nsh)[:-1]]).astype(np.int64)
        self._dims = np.array([t.dim for t in self.tables.values()], np.int64)
        self._cache_key = None

    def __getitem__(self, name: str) -> EmbeddingTable:
        try:
            return self.tables[name]
        except KeyError:
            raise UnknownTableError(f"unknown table {name!r}; have {sorted(self.tables)}") from None

    def __contains__(self, name: str) -> bool:
        return name in self.tables

    # ------------------------------------------------------------------ packing
    def pack(self, batch: Mapping[str, np.ndarray] | PackedBatch) -> PackedBatch:
        """Concatenate a ``{slot: ids}`` batch (validates every slot first)."""
        if isinstance(batch, PackedBatch):
            return batch
        names, arrays, tabs = [], [], []
        for slot, ids in batch.items():
            if slot not in self.slots:
                raise UnknownTableError(f"unknown slot/table {slot!r}; have {sorted(self.slots)}")
            names.append(slot)
            arrays.append(as_ids(ids))
            tabs.append(self._tindex[self.slots[slot]])
        offsets = np.zeros(len(arrays) + 1, np.int64)
        np.cumsum([a.size for a in arrays], out=offsets[1:])
        ids = np.concatenate(arrays) if arrays else np.empty(0, np.int64)
        return PackedBatch(tuple(names), ids, offsets, np.array(tabs, np.int64))

    def _lists(self):
        key = tuple(s.version for s in self._shards)
        if key != self._cache_key:
            self._slots_list = List([s._slots for s in self._shards])
            self._emb_list = List([s._emb for s in self._shards])
            self._cache_key = key
        return self._slots_list, self._emb_list

    # ------------------------------------------------------------------ reads
    def gather(self, batch: Mapping[str, np.ndarray] | PackedBatch, *, insert: bool = False,
               event_time=None) -> dict[str, np.ndarray]:
        """``{slot: float32 [n, dim]}`` for a multi-slot batch, resolved in one packed call.

        With ``insert=True`` (training) new ids go through admission at ``event_time``
        (an int, or one int per id in packed order). Absent ids read as zeros.
        """
        pb = self.pack(batch)
        t = as_event_time(event_time, pb.ids.size) if insert else None
        seg_dims = self._dims[pb.slot_table]
        sizes = np.diff(pb.offsets) * seg_dims
        out_off = np.zeros(len(pb.slots) + 1, np.int64)
        np.cumsum(sizes, out=out_off[1:])
        out = np.empty(int(out_off[-1]), np.float32)
        if not self._local:  # remote shards: fall back to per-table calls
            return self._gather_per_table(pb, out, out_off, insert, t)
        with contextlib.ExitStack() as stack:
            for s in self._shards:
                stack.enter_context(s.lock)
            slots_list, emb_list = self._lists()
            rows = np.empty(pb.ids.size, np.int64)
            shard_of = np.empty(pb.ids.size, np.int64)
            packed_gather_kernel(pb.ids, pb.offsets, pb.slot_table, self._tab_base, self._tab_nshards,
                                 slots_list, emb_list, out, out_off, rows, shard_of)
            if insert:
                self._insert_missing(pb, rows, out, out_off, t)
        return self._views(pb, out, out_off, seg_dims)

    def _insert_missing(self, pb, rows, out, out_off, t):
        miss = rows < 0
        if not miss.any():
            return
        per_table: dict[int, list] = {}
        for k in range(len(pb.slots)):
            a, b = pb.offsets[k], pb.offsets[k + 1]
            pos = a + np.flatnonzero(miss[a:b])
            if pos.size:
                per_table.setdefault(int(pb.slot_table[k]), []).append((k, pos))
        for ti, parts in per_table.items():
            table = self.tables[self.table_names[ti]]
            pos = np.concatenate([p for _, p in parts])
            vals = table.gather(pb.ids[pos], insert=True,
                                event_time=t[pos] if t.size > 1 else int(t[0]))
            dim = table.dim
            i = 0
            for k, p in parts:
                view = out[out_off[k]:out_off[k + 1]].reshape(-1, dim)
                view[p - pb.offsets[k]] = vals[i:i + p.size]
                i += p.size

    def _gather_per_table(self, pb, out, out_off, insert, t):
        for k in range(len(pb.slots)):
            table = self.tables[self.table_names[pb.slot_table[k]]]
            a, b = pb.offsets[k], pb.offsets[k + 1]
            st = None if t is None else (t[a:b] if t.size > 1 else int(t[0]))
            out[out_off[k]:out_off[k + 1]] = table.gather(pb.ids[a:b], insert=insert, event_time=st).reshape(-1)
        return self._views(pb, out, out_off, self._dims[pb.slot_table])

    @staticmethod
    def _views(pb, out, out_off, seg_dims):
        return {name: out[out_off[k]:out_off[k + 1]].reshape(-1, int(seg_dims[k]))
                for k, name in enumerate(pb.slots)}

    # ------------------------------------------------------------------ writes
    def apply_gradients(self, batch: Mapping[str, np.ndarray] | PackedBatch,
                        grads: Mapping[str, np.ndarray], event_time) -> dict[str, int]:
        """Apply per-slot gradients; slots sharing a table are summed per id in one update.

        All slots are validated before any table changes. Returns rows updated per table.
        """
        pb = self.pack(batch)
        t = as_event_time(event_time, pb.ids.size)
        if set(grads) != set(pb.slots):
            raise InvalidInputError(f"gradients given for {sorted(grads)}, batch has slots {sorted(pb.slots)}")
        per_table: dict[int, list] = {}
        for k, slot in enumerate(pb.slots):
            ti = int(pb.slot_table[k])
            g = as_grads(grads[slot], int(pb.offsets[k + 1] - pb.offsets[k]), int(self._dims[ti]))
            per_table.setdefault(ti, []).append((k, g))
        done = {}
        for ti, parts in per_table.items():
            ids = np.concatenate([pb.slot_ids(k) for k, _ in parts])
            g = np.concatenate([g for _, g in parts]) if len(parts) > 1 else parts[0][1]
            if t.size > 1:
                tt = np.concatenate([t[pb.offsets[k]:pb.offsets[k + 1]] for k, _ in parts])
            else:
                tt = int(t[0])
            name = self.table_names[ti]
            done[name] = self.tables[name].apply_gradients(ids, g, tt)
        return done

    def expire(self, now: int | None = None, max_scan: int | None = None) -> dict[str, int]:
        return {n: t.expire(now, max_scan) for n, t in self.tables.items()}

    def memory_bytes(self) -> int:
        return sum(t.memory_bytes() for t in self.tables.values())

    # ------------------------------------------------------------------ snapshots
    def save(self, root, incremental: bool = False) -> list:
        """Snapshot every shard of every table into ``root`` (see :mod:`ps.snapshot`)."""
        from .snapshot import save_table
        return [p for t in self.tables.values() for p in save_table(t, root, incremental)]

    @classmethod
    def restore(cls, root, tables: Sequence[TableConfig | str], slots: Mapping[str, str] | None = None
                ) -> "ParameterServer":
        """Rebuild from the newest snapshot chains in ``root``; all verified before returning."""
        from .snapshot import restore_table
        return cls([restore_table(root, t) for t in tables], slots)
