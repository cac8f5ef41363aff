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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from ._jit import typed_list
from ._validate import as_event_time, as_grads, as_ids
from .config import TableConfig
from .errors import InvalidGradientError, InvalidInputError, NonFiniteGradientError, ReadOnlyTableError, UnknownTableError
from .optimizers import OPT_NONE
from .packed import all_finite, packed_apply_kernel, packed_gather_kernel
from .shard import TableShard
from .table import EmbeddingTable

if TYPE_CHECKING:
    import os
    from pathlib import Path


@dataclass(frozen=True)
class PackedBatch:
    """A batch of many slots as one id array: slot ``k`` owns ``ids[offsets[k]:offsets[k+1]]``."""

    slots: tuple[str, ...]
    ids: np.ndarray
    offsets: np.ndarray
    slot_table: np.ndarray  # index into ParameterServer.table_names, per slot

    def slot_ids(self, k: int) -> np.ndarray:
        return self.ids[self.offsets[k]:self.offsets[k + 1]]

    def segments(self, a: int, b: int) -> PackedBatch:
        """Slots ``a:b`` alone, as a packed batch of their own (views, no copy).

        >>> pb = PackedBatch(("x", "y", "z"), np.array([5, 6, 7, 8]), np.array([0, 1, 3, 4]), np.array([0, 1, 1]))
        >>> yz = pb.segments(1, 3); yz.slots, yz.ids.tolist(), yz.offsets.tolist()
        (('y', 'z'), [6, 7, 8], [0, 2, 3])
        """
        o = self.offsets
        return PackedBatch(self.slots[a:b], self.ids[o[a]:o[b]], o[a:b + 1] - o[a], self.slot_table[a:b])


class ParameterServer:
    """Holds named :class:`EmbeddingTable` s and serves packed multi-slot batches.

    ``slots`` maps extra slot names to table names; every table is also a slot of its
    own name.
    """

    # the shards' arrays as numba typed lists, rebuilt by _lists when a shard reallocates
    _slots_list: Sequence[np.ndarray]
    _emb_list: Sequence[np.ndarray]
    #: state, times, flags, dirty, meta
    _row_lists: tuple[Sequence[np.ndarray], Sequence[np.ndarray], Sequence[np.ndarray], Sequence[np.ndarray],
                      Sequence[np.ndarray]]

    def __init__(self, tables: Sequence[TableConfig | EmbeddingTable], slots: Mapping[str, str] | None = None) -> None:
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
        self._cache_key: tuple[int, ...] | None = None
        if self._local:  # per-table optimizer settings, as arrays for packed_apply_kernel
            first = [t.shards[0] for t in self.tables.values()]
            self._tab_kind = np.array([s._opt_kind for s in first], np.int64)
            self._tab_hyper = np.array([s._hyper for s in first], np.float64).reshape(len(first), -1)
            self._tab_track = np.array([s._track for s in first], np.bool_)
            #: (table index, global shard number) of shards that expire on every update
            self._expiring = [(ti, int(self._tab_base[ti]) + j) for ti, t in enumerate(self.tables.values())
                              if t.config.ttl_ms is not None and t.config.expire_on_update
                              for j in range(len(t.shards))]

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

    def _lists(self) -> tuple[Sequence[np.ndarray], Sequence[np.ndarray]]:
        key = tuple(s.version for s in self._shards)
        if key != self._cache_key:
            self._slots_list = typed_list([s._slots for s in self._shards])
            self._emb_list = typed_list([s._emb for s in self._shards])
            self._row_lists = tuple(typed_list([getattr(s, a) for s in self._shards])
                                    for a in ("_state", "_times", "_flags", "_dirty", "meta"))
            self._cache_key = key
        return self._slots_list, self._emb_list

    def _lock_all(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for s in self._shards:
            stack.enter_context(s.lock)
        return stack

    # ------------------------------------------------------------------ reads
    def gather(self, batch: Mapping[str, np.ndarray] | PackedBatch, *, insert: bool = False,
               event_time: npt.ArrayLike | None = None) -> dict[str, np.ndarray]:
        """``{slot: float32 [n, dim]}`` for a multi-slot batch, resolved in one packed call.

        With ``insert=True`` (training) new ids go through admission at ``event_time``
        (an int, or one int per id in packed order). Absent ids read as zeros.
        """
        pb = self.pack(batch)
        out, out_off = self._gather_flat(pb, insert, event_time)
        return self._views(pb, out, out_off, self._dims[pb.slot_table])

    def gather_packed(self, batch: Mapping[str, np.ndarray] | PackedBatch, *, insert: bool = False,
                      event_time: npt.ArrayLike | None = None, found: np.ndarray | None = None) -> np.ndarray:
        """:meth:`gather` as the one float32 buffer behind its views: slot ``k``'s ``[n_k, dim]``
        rows back to back in packed order (the layout :meth:`apply_packed_gradients` takes).
        ``found``: a bool array, one per packed id, set to whether the id had a row before this
        call (local tables only; a lookahead re-reads the ids that had none)."""
        return self._gather_flat(self.pack(batch), insert, event_time, found)[0]

    def _gather_flat(self, pb: PackedBatch, insert: bool, event_time: npt.ArrayLike | None,
                     found: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        t = as_event_time(event_time, pb.ids.size) if insert else None
        out_off = self._out_offsets(pb)
        out = np.empty(int(out_off[-1]), np.float32)
        if not self._local:  # remote shards: fall back to per-table calls
            if found is not None:
                raise InvalidInputError("gather_packed(found=...) needs local tables")
            self._gather_per_table(pb, out, out_off, insert, t)
            return out, out_off
        with self._lock_all():
            slots_list, emb_list = self._lists()
            rows = np.empty(pb.ids.size, np.int64)
            shard_of = np.empty(pb.ids.size, np.int64)
            packed_gather_kernel(pb.ids, pb.offsets, pb.slot_table, self._tab_base, self._tab_nshards,
                                 slots_list, emb_list, out, out_off, rows, shard_of)
            if found is not None:
                np.greater_equal(rows, 0, out=found)
            if t is not None:  # insert
                self._insert_missing(pb, rows, out, out_off, t)
        return out, out_off

    def _insert_missing(self, pb: PackedBatch, rows: np.ndarray, out: np.ndarray, out_off: np.ndarray,
                        t: np.ndarray) -> None:
        miss = rows < 0
        if not miss.any():
            return
        per_table: dict[int, list[tuple[int, np.ndarray]]] = {}
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

    def _gather_per_table(self, pb: PackedBatch, out: np.ndarray, out_off: np.ndarray, insert: bool,
                          t: np.ndarray | None) -> None:
        for k in range(len(pb.slots)):
            table = self.tables[self.table_names[pb.slot_table[k]]]
            a, b = pb.offsets[k], pb.offsets[k + 1]
            st = None if t is None else (t[a:b] if t.size > 1 else int(t[0]))
            out[out_off[k]:out_off[k + 1]] = table.gather(pb.ids[a:b], insert=insert, event_time=st).reshape(-1)

    @staticmethod
    def _views(pb: PackedBatch, out: np.ndarray, out_off: np.ndarray, seg_dims: np.ndarray) -> dict[str, np.ndarray]:
        return {name: out[out_off[k]:out_off[k + 1]].reshape(-1, int(seg_dims[k]))
                for k, name in enumerate(pb.slots)}

    # ------------------------------------------------------------------ writes
    def apply_gradients(self, batch: Mapping[str, np.ndarray] | PackedBatch,
                        grads: Mapping[str, np.ndarray], event_time: npt.ArrayLike) -> dict[str, int]:
        """Apply per-slot gradients; slots sharing a table are summed per id in one update.

        All slots are validated before any table changes. Returns rows updated per table.
        """
        pb = self.pack(batch)
        t = as_event_time(event_time, pb.ids.size)
        if set(grads) != set(pb.slots):
            raise InvalidInputError(f"gradients given for {sorted(grads)}, batch has slots {sorted(pb.slots)}")
        if not self._local:
            return self._apply_per_table(pb, grads, t)
        parts = [as_grads(grads[slot], int(pb.offsets[k + 1] - pb.offsets[k]), int(self._dims[pb.slot_table[k]]),
                          check_finite=False).reshape(-1) for k, slot in enumerate(pb.slots)]
        flat = np.concatenate(parts) if parts else np.empty(0, np.float32)
        return self._apply_packed(pb, flat, t)

    def apply_packed_gradients(self, batch: Mapping[str, np.ndarray] | PackedBatch, grads: np.ndarray,
                               event_time: npt.ArrayLike) -> dict[str, int]:
        """:meth:`apply_gradients` with every slot's gradients in **one** 1-D buffer, laid out as
        :meth:`gather` lays out its result (slot ``k``'s ``[n_k, dim]`` rows back to back, in
        packed order): one validation and one numba call for all tables and shards."""
        pb = self.pack(batch)
        t = as_event_time(event_time, pb.ids.size)
        g = np.asarray(grads)
        total = int((np.diff(pb.offsets) * self._dims[pb.slot_table]).sum())
        if g.dtype.kind != "f":
            raise InvalidGradientError(f"gradients must be floating point, got dtype {g.dtype}")
        if g.ndim != 1 or g.size != total:
            raise InvalidGradientError(f"packed gradients must be 1-D with {total} values, got shape {g.shape}")
        with np.errstate(over="ignore"):
            g = np.ascontiguousarray(g, dtype=np.float32)
        if not self._local:
            out_off = self._out_offsets(pb)
            return self._apply_per_table(pb, {s: g[out_off[k]:out_off[k + 1]].reshape(-1, int(self._dims[pb.slot_table[k]]))
                                              for k, s in enumerate(pb.slots)}, t)
        return self._apply_packed(pb, g, t)

    def _out_offsets(self, pb: PackedBatch) -> np.ndarray:
        out_off = np.zeros(len(pb.slots) + 1, np.int64)
        np.cumsum(np.diff(pb.offsets) * self._dims[pb.slot_table], out=out_off[1:])
        return out_off

    def _apply_packed(self, pb: PackedBatch, g: np.ndarray, t: np.ndarray) -> dict[str, int]:
        """One kernel for every table and shard; ``g`` is float32, C-contiguous, the packed layout."""
        if not all_finite(g):
            bad = sum(int((~np.isfinite(g[a:b].reshape(-1, int(self._dims[pb.slot_table[k]])))).any(axis=1).sum())
                      for k, (a, b) in enumerate(zip(self._out_offsets(pb)[:-1], self._out_offsets(pb)[1:], strict=True)))
            raise NonFiniteGradientError(f"{bad} gradient row(s) contain NaN or Inf; nothing applied")
        present = np.zeros(len(self.table_names), np.bool_)
        present[pb.slot_table] = True
        for ti in np.flatnonzero(present & (self._tab_kind == OPT_NONE)).tolist():
            raise ReadOnlyTableError(f"table {self.table_names[ti]!r} is a serving replica; it has no optimizer")
        shard_n = np.zeros(len(self._shards), np.int64)
        shard_k = np.zeros(len(self._shards), np.int64)
        with self._lock_all():
            slots_list, emb_list = self._lists()
            packed_apply_kernel(pb.ids, pb.offsets, pb.slot_table, g, self._out_offsets(pb), t,
                                self._tab_base, self._tab_nshards, self._dims, self._tab_kind, self._tab_hyper,
                                self._tab_track, present, slots_list, emb_list, *self._row_lists, shard_n, shard_k)
            for ti, sh in self._expiring:
                if present[ti] and (shard_n[sh] or self._tab_nshards[ti] == 1):
                    self._shards[sh]._expire(None, max(1024, 2 * int(shard_n[sh])))
        done: dict[str, int] = {}
        for ti in np.flatnonzero(present).tolist():
            b = int(self._tab_base[ti])
            done[self.table_names[ti]] = int(shard_k[b:b + int(self._tab_nshards[ti])].sum())
        return done

    def _apply_per_table(self, pb: PackedBatch, grads: Mapping[str, np.ndarray], t: np.ndarray) -> dict[str, int]:
        """Remote shards: one call per table (validating every slot first)."""
        per_table: dict[int, list[tuple[int, np.ndarray]]] = {}
        for k, slot in enumerate(pb.slots):
            ti = int(pb.slot_table[k])
            g = as_grads(grads[slot], int(pb.offsets[k + 1] - pb.offsets[k]), int(self._dims[ti]))
            per_table.setdefault(ti, []).append((k, g))
        done: dict[str, int] = {}
        for ti, parts in per_table.items():
            ids = np.concatenate([pb.slot_ids(k) for k, _ in parts])
            g = np.concatenate([g for _, g in parts]) if len(parts) > 1 else parts[0][1]
            tt: np.ndarray | int
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
    def save(self, root: str | os.PathLike[str], incremental: bool = False) -> list[Path]:
        """Snapshot every shard of every table into ``root`` (see :mod:`ps.snapshot`)."""
        from .snapshot import save_table
        return [p for t in self.tables.values() for p in save_table(t, root, incremental)]

    @classmethod
    def restore(cls, root: str | os.PathLike[str], tables: Sequence[TableConfig | str],
                slots: Mapping[str, str] | None = None) -> ParameterServer:
        """Rebuild from the newest snapshot chains in ``root``; all verified before returning."""
        from .snapshot import restore_table
        return cls([restore_table(root, t) for t in tables], slots)
