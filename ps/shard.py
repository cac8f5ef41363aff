"""One shard of an embedding table: hash index + row storage + optimizer + admission + expiry.

A :class:`TableShard` owns a disjoint subset of a table's ids (see :mod:`ps.sharding`)
and everything about them, so it can live in its own process and write its own
snapshot files. Every public method validates its input *before* touching state, and
holds the shard's lock while it runs (kernels release the GIL; bounded batch sizes
bound how long others wait).

Rows are never moved by growth: the index is rehashed, and row arrays are reallocated
bigger with rows keeping their numbers. Ids that are not (yet) admitted have no row
and read as **zeros** (not the initializer: an id must not look trained before it is).

>>> from ps.config import TableConfig, SGDConfig, InitializerConfig
>>> s = TableShard(TableConfig(name="t", dim=2, optimizer=SGDConfig(lr=0.5),
...                            initializer=InitializerConfig(kind="zeros")))
>>> s.lookup_or_insert(np.array([10, 20, 10]), event_time=5).tolist()
[0, 1, 0]
>>> s.apply_gradients(np.array([10, 10]), np.ones((2, 2), np.float32), event_time=6)
1
>>> s.gather(np.array([10, 99])).tolist()
[[-1.0, -1.0], [0.0, 0.0]]
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from . import rows as R
from ._jit import aligned_zeros
from ._validate import as_event_time, as_grads, as_ids, as_values
from .config import TableConfig
from .errors import InvalidIdsError, InvalidInputError, ReadOnlyTableError
from .hashmap import MAX_LOAD, empty_slots, grow, lookup_kernel
from .initializers import KINDS
from .optimizers import OPT_NONE, apply_updates, dedupe, encode
from .sync import SyncChunk

if TYPE_CHECKING:
    from pathlib import Path

INT64_MIN = np.iinfo(np.int64).min


class TableShard:
    """Shard ``shard_index`` of ``config`` (``config.shards`` shards in total)."""

    # row storage, (re)allocated by _resize_rows
    _emb: np.ndarray
    _state: np.ndarray
    _row_keys: np.ndarray
    _times: np.ndarray
    _flags: np.ndarray
    _free: np.ndarray
    _dirty: np.ndarray
    #: ``(snapshot directory, seq)`` of this shard's last snapshot, set by :mod:`ps.snapshot`
    _snap_parent: tuple[Path, int]

    def __init__(self, config: TableConfig, shard_index: int = 0, capacity: int | None = None) -> None:
        if not 0 <= shard_index < config.shards:
            raise InvalidInputError(f"shard_index {shard_index} not in [0, {config.shards})")
        self.config = config
        self.shard_index = shard_index
        self.dim = config.dim
        self.lock = threading.RLock()
        #: bumped whenever an array is reallocated (packed lookups cache array lists)
        self.version = 0
        self._opt_kind, self._hyper = encode(config)
        self._width = config.slot_width
        self._init = (KINDS[config.initializer.kind], float(config.initializer.scale),
                      config.initializer.seed)
        self._track = config.track_updates
        #: process-lifetime counters (not in snapshots): ids admitted (rows created by training
        #: inserts; replica upserts do not count) and rows removed by TTL expiry
        self.admitted = 0
        self.evicted = 0
        adm = config.admission
        self._sketch = (np.zeros((adm.sketch_depth, adm.sketch_width), np.uint16)
                        if adm.min_count > 1 else np.zeros((1, 1), np.uint16))
        self.meta = np.zeros(8, np.int64)
        self.meta[R.M_WATERMARK] = INT64_MIN
        cap = capacity if capacity is not None else -(-config.initial_capacity // config.shards)
        cap = max(16, cap)
        self._slots = empty_slots(cap)
        self._rows_cap = 0
        self._resize_rows(cap)

    # ------------------------------------------------------------------ storage
    def _resize_rows(self, cap: int) -> None:
        high = int(self.meta[R.M_HIGH])

        def grown(old: np.ndarray | None, shape: int | tuple[int, int], dtype: npt.DTypeLike) -> np.ndarray:
            # 64-byte aligned: a dim-16 float32 row is then exactly one cache line
            new = aligned_zeros(shape, dtype)
            if old is not None:
                new[:high] = old[:high]
            return new

        def g(name: str) -> np.ndarray | None:
            return getattr(self, name, None)
        self._emb = grown(g("_emb"), (cap, self.dim), np.float32)
        self._state = grown(g("_state"), (cap, self._width), np.float32)
        self._row_keys = grown(g("_row_keys"), cap, np.int64)
        self._times = grown(g("_times"), cap, np.int64)
        self._flags = grown(g("_flags"), cap, np.uint8)
        free = np.zeros(cap, np.int64)
        dirty = np.zeros(cap, np.int64)
        if self._rows_cap:
            free[: self.meta[R.M_NFREE]] = self._free[: self.meta[R.M_NFREE]]
            self._compact_dirty()
            dirty[: self.meta[R.M_NDIRTY]] = self._dirty[: self.meta[R.M_NDIRTY]]
        self._free, self._dirty = free, dirty
        self._rows_cap = cap
        self.version += 1

    def _compact_dirty(self) -> None:
        h, n = int(self.meta[R.M_DHEAD]), int(self.meta[R.M_NDIRTY])
        if h:
            self._dirty[: n - h] = self._dirty[h:n]
            self.meta[R.M_DHEAD], self.meta[R.M_NDIRTY] = 0, n - h

    def _reserve(self, new_rows: int, pushes: int) -> None:
        """Room for ``new_rows`` more rows/keys and ``pushes`` dirty-list appends."""
        m = self.meta
        need = int(m[R.M_HIGH]) + max(0, new_rows - int(m[R.M_NFREE]))
        if need > self._rows_cap:
            self._resize_rows(max(need, self._rows_cap + self._rows_cap // 2))
        if int(m[R.M_SIZE]) + new_rows > self._slots.shape[0] * MAX_LOAD:
            self._slots = grow(self._slots, int(m[R.M_SIZE]) + new_rows)
            self.version += 1
        if int(m[R.M_NDIRTY]) + pushes > self._rows_cap:
            # each row is queued at most once, so after compaction everything fits
            self._compact_dirty()

    @property
    def _mask(self) -> int:
        return int(self._slots.shape[0]) - 1

    def __len__(self) -> int:
        return int(self.meta[R.M_SIZE])

    @property
    def watermark(self) -> int | None:
        """Largest event time (ms) this shard has been given, ``None`` before any."""
        w = int(self.meta[R.M_WATERMARK])
        return None if w == INT64_MIN else w

    def memory_bytes(self) -> int:
        """Bytes held by the index, rows, optimizer state and bookkeeping arrays."""
        return sum(a.nbytes for a in (self._slots, self._emb, self._state, self._row_keys,
                                      self._times, self._flags, self._free, self._dirty,
                                      self._sketch, self.meta))

    def _see_time(self, t: np.ndarray) -> None:
        mx = int(t.max()) if t.size else INT64_MIN
        if mx > self.meta[R.M_WATERMARK]:
            self.meta[R.M_WATERMARK] = mx

    # ------------------------------------------------------------------ reads
    def lookup(self, ids: npt.ArrayLike) -> np.ndarray:
        """Row number of each id, -1 where absent."""
        ids = as_ids(ids)
        with self.lock:
            return self._lookup(ids)

    def _lookup(self, ids: np.ndarray) -> np.ndarray:
        out = np.empty(ids.size, np.int64)
        lookup_kernel(self._slots, self._mask, ids, out)
        return out

    def gather(self, ids: npt.ArrayLike, *, insert: bool = False, event_time: npt.ArrayLike | None = None,
               out: np.ndarray | None = None) -> np.ndarray:
        """Embeddings of ``ids`` as float32 ``[n, dim]`` (zeros for absent/unadmitted ids).

        ``insert=True`` (training forward pass) first runs admission and creates rows for
        admitted new ids at ``event_time``. ``out`` may be a preallocated C-contiguous
        float32 buffer (e.g. shared with a torch tensor).
        """
        ids = as_ids(ids)
        t = as_event_time(event_time, ids.size) if insert else None
        out = self._out(out, ids.size)
        with self.lock:
            return self._gather(ids, out, t)

    def _out(self, out: np.ndarray | None, n: int) -> np.ndarray:
        if out is None:
            return np.empty((n, self.dim), np.float32)
        if out.dtype != np.float32 or out.shape != (n, self.dim) or not out.flags.c_contiguous:
            raise InvalidInputError(f"out must be C-contiguous float32 {(n, self.dim)}")
        return out

    def _gather(self, ids: np.ndarray, out: np.ndarray, t: np.ndarray | None = None) -> np.ndarray:
        # Two prefetching passes (batched probes, then row copy with rows prefetched a
        # group ahead) measured faster than one fused pass of groups. With insert=True
        # only the ids that missed take the insert path.
        if t is not None:
            self._check_writable()
        rows = self._lookup(ids)
        missing = R.gather_rows_kernel(rows, self._emb, out)
        if missing and t is not None:
            miss = np.flatnonzero(rows < 0)
            new = self._insert_missing(ids, t, miss)
            if (new >= 0).any():  # not-admitted ids stay zeros
                vals = np.empty((miss.size, self.dim), np.float32)
                R.gather_rows_kernel(new, self._emb, vals)
                out[miss] = vals
        return out

    # ------------------------------------------------------------------ writes
    def lookup_or_insert(self, ids: npt.ArrayLike, event_time: npt.ArrayLike) -> np.ndarray:
        """Rows of ``ids``, admitting and initialising new ids; -1 where not admitted."""
        ids = as_ids(ids)
        t = as_event_time(event_time, ids.size)
        with self.lock:
            return self._lookup_or_insert(ids, t)

    def _check_writable(self) -> None:
        if self._opt_kind == OPT_NONE:
            raise ReadOnlyTableError(f"table {self.config.name!r} is a serving replica; it only takes apply_sync")

    def _lookup_or_insert(self, ids: np.ndarray, t: np.ndarray) -> np.ndarray:
        self._check_writable()
        rows = self._lookup(ids)
        miss = np.flatnonzero(rows < 0)
        if miss.size:
            rows[miss] = self._insert_missing(ids, t, miss)
        return rows

    def _insert_missing(self, ids: np.ndarray, t: np.ndarray, miss: np.ndarray) -> np.ndarray:
        """Admit/initialise ``ids[miss]`` (all absent); their rows, -1 where not admitted."""
        self._see_time(t)
        mk, mt = ids[miss], (t[miss] if t.size > 1 else t)
        self._reserve(miss.size, miss.size)
        out = np.empty(miss.size, np.int64)
        adm = self.config.admission
        before = int(self.meta[R.M_SIZE])
        R.insert_kernel(self._slots, self._mask, mk, out, self._emb, self._state, self._row_keys,
                        self._times, self._flags, self._free, self._dirty, self.meta, mt,
                        self._track, *self._init, self._opt_kind, self._hyper, self._sketch,
                        adm.seed, adm.min_count, adm.probability)
        self.admitted += int(self.meta[R.M_SIZE]) - before  # inserting only adds rows
        return out

    def apply_gradients(self, ids: npt.ArrayLike, grads: npt.ArrayLike, event_time: npt.ArrayLike) -> int:
        """Sum ``grads`` per unique id and take one optimizer step on each existing row.

        Ids without a row (never inserted, or not admitted) are ignored: call
        ``gather(..., insert=True)`` in the forward pass. Returns rows updated.
        """
        ids = as_ids(ids)
        g = as_grads(grads, ids.size, self.dim)
        t = as_event_time(event_time, ids.size)
        with self.lock:
            return self._apply_gradients(ids, g, t)

    def _apply_gradients(self, ids: np.ndarray, g: np.ndarray, t: np.ndarray) -> int:
        if self._opt_kind == OPT_NONE:
            raise ReadOnlyTableError(f"table {self.config.name!r} is a serving replica; it has no optimizer")
        self._see_time(t)
        rows = self._lookup(ids)
        k, urows, ugrads, utimes = dedupe(rows, g, t)  # per-call buffers: no memset, no resident scratch
        self._reserve(0, k)
        apply_updates(self._opt_kind, self._hyper, self._emb, self._state, urows, ugrads, k,
                      utimes, self._times, self._flags, self._dirty, self.meta, self._track)
        if self.config.ttl_ms is not None and self.config.expire_on_update:
            self._expire(None, max(1024, 2 * ids.size))
        return int(k)

    def delete(self, ids: npt.ArrayLike) -> int:
        """Remove ``ids`` (absent ones are ignored); returns how many were removed."""
        ids = as_ids(ids)
        with self.lock:
            return self._delete(ids)

    def _delete(self, ids: np.ndarray) -> int:
        self._reserve(0, ids.size)
        return int(R.delete_kernel(self._slots, self._mask, ids, self._flags, self._dirty,
                                   self._free, self.meta, self._track))

    def expire(self, now: int | None = None, max_scan: int | None = None) -> int:
        """Evict rows whose last update is older than ``now - ttl`` (event time, ms).

        ``now`` defaults to the largest event time seen. Scans at most ``max_scan``
        rows from where the previous call stopped (``None``: one full pass).
        Returns the number of rows evicted. A table without TTL never evicts.
        """
        if now is not None:
            now = int(as_event_time(now, 1)[0])
        with self.lock:
            return self._expire(now, max_scan)

    def _expire(self, now: int | None, max_scan: int | None) -> int:
        ttl = self.config.ttl_ms
        now = self.watermark if now is None else now
        if ttl is None or now is None:
            return 0
        budget = int(self.meta[R.M_HIGH]) if max_scan is None else int(max_scan)
        self._reserve(0, budget)
        cutoff = max(now - ttl, INT64_MIN)
        n = int(R.expire_kernel(self._slots, self._mask, self._row_keys, self._times, self._flags,
                                self._dirty, self._free, self.meta, self._track, cutoff, budget))
        self.evicted += n
        return n

    # ------------------------------------------------------------------ sync
    @property
    def pending_updates(self) -> int:
        """Rows queued in the touched-key stream."""
        return int(self.meta[R.M_NDIRTY] - self.meta[R.M_DHEAD])

    def pop_chunk(self, max_rows: int = 65536) -> SyncChunk:
        """Drain up to ``max_rows`` queued changes (empty chunk when none)."""
        if max_rows < 1:
            raise InvalidInputError("max_rows must be >= 1")
        with self.lock:
            n = min(max_rows, self.pending_updates)
            up = np.empty(n, np.int64)
            tomb = np.empty(n, np.int64)
            nu, nt = R.pop_kernel(self._slots, self._mask, self._row_keys, self._flags, self._dirty,
                                  self._free, self.meta, n, up, tomb)
            up = up[:nu]
            return SyncChunk(self._row_keys[up], self._emb[up], self._times[up], tomb[:nt].copy())

    def pop_updates(self, max_rows: int = 65536) -> Iterator[SyncChunk]:
        """Yield the changes queued when called, in chunks of at most ``max_rows``.

        Changes made while iterating are queued for the next call.
        """
        left = self.pending_updates
        while left > 0:
            c = self.pop_chunk(min(max_rows, left))
            left -= max(1, min(max_rows, left))
            if len(c):
                yield c

    def apply_sync(self, chunk: SyncChunk) -> None:
        """Replica side: upsert ``chunk``'s rows and drop its tombstones, atomically per chunk."""
        keys = as_ids(chunk.keys)
        vals = as_values(chunk.values, keys.size, self.dim)
        times = as_event_time(chunk.times, keys.size) if keys.size else np.zeros(1, np.int64)
        tomb = as_ids(chunk.tombstones)
        with self.lock:
            self._apply_sync(keys, vals, times, tomb)

    def _apply_sync(self, keys: np.ndarray, vals: np.ndarray, times: np.ndarray, tomb: np.ndarray) -> None:
        if tomb.size:
            self._delete(tomb)
        if keys.size:
            self._see_time(times)
            self._reserve(keys.size, keys.size)
            R.upsert_kernel(self._slots, self._mask, keys, vals, times, self._emb, self._row_keys,
                            self._times, self._flags, self._free, self._dirty, self.meta, self._track)

    def load_rows(self, keys: npt.ArrayLike, values: npt.ArrayLike, state: npt.ArrayLike, times: npt.ArrayLike) -> None:
        """Insert rows with their optimizer state (resharding a snapshot: rows move to the shard
        that owns them now, keeping what training learned about them). Not news for replicas: the
        rows are not put on the touched-key stream, so call it on a table being built: it drains
        that stream. A key present already is overwritten."""
        keys = as_ids(keys)
        vals = as_values(values, keys.size, self.dim)
        times = as_event_time(times, keys.size) if keys.size else np.zeros(1, np.int64)
        state = np.asarray(state, np.float32).reshape(keys.size, -1)
        if state.shape[1] != self._state.shape[1]:
            raise InvalidInputError(f"{self.config.name}: optimizer state width {state.shape[1]}, "
                                    f"the table's is {self._state.shape[1]}")
        if not keys.size:
            return
        with self.lock:
            self._apply_sync(keys, vals, times, np.zeros(0, np.int64))
            self._state[self._lookup(keys)] = state
            for _ in self.pop_updates(1 << 30):
                pass

    def read_rows(self, ids: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """``(values, optimizer_state)`` of rows that exist (copies); an absent id raises."""
        ids = as_ids(ids)
        with self.lock:
            rows = self._present(ids)
            return self._emb[rows], self._state[rows]

    def write_rows(self, ids: npt.ArrayLike, values: npt.ArrayLike, state: npt.ArrayLike) -> None:
        """Overwrite the values and optimizer state of rows that exist, and nothing else: no time,
        no change mark, no admission. For a cache that steps rows elsewhere while the table keeps
        their bookkeeping (``trainer.mixcache``); an absent id raises before anything is written."""
        ids = as_ids(ids)
        vals = as_values(values, ids.size, self.dim)
        st = np.asarray(state, np.float32).reshape(ids.size, -1)
        if st.shape[1] != self._state.shape[1]:
            raise InvalidInputError(f"{self.config.name}: optimizer state width {st.shape[1]}, "
                                    f"the table's is {self._state.shape[1]}")
        with self.lock:
            rows = self._present(ids)
            self._emb[rows] = vals
            self._state[rows] = st

    def _present(self, ids: np.ndarray) -> np.ndarray:
        rows = self._lookup(ids)
        if ids.size and int(rows.min()) < 0:
            raise InvalidIdsError(f"{self.config.name}: {int((rows < 0).sum())} of {ids.size} ids have no row")
        return rows

    # ------------------------------------------------------------------ inspection
    def items(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(keys, values, optimizer_state, times)`` of all live rows, sorted by key (copies)."""
        with self.lock:
            high = int(self.meta[R.M_HIGH])
            rows = np.flatnonzero(self._flags[:high] & R.LIVE)
            rows = rows[np.argsort(self._row_keys[rows], kind="stable")]
            return (self._row_keys[rows], self._emb[rows], self._state[rows], self._times[rows])

    def __repr__(self) -> str:
        return (f"TableShard({self.config.name!r}, shard={self.shard_index}/{self.config.shards}, "
                f"keys={len(self)}, dim={self.dim})")
