"""Embedding tables in shared memory: one writer (the serving PS), many reading worker processes.

Why: every uvicorn worker holding its own copy of every table (and consuming ``param-deltas``
itself) makes memory grow with the worker count. Here the serving PS process owns the tables and
places the two arrays a lookup needs, the hash index ``slots`` (``int64 [n, 2]``: key, row) and the
rows ``emb`` (``float32 [cap, dim]``), in memory-mapped files under ``ps_dir`` (tmpfs by default:
no disk write-back). Workers map them read-only and gather rows straight from them: no copy of the
table, no IPC per request. The PS's other row arrays (keys, times, flags, free list) stay private.

Layout of ``ps_dir``:

* ``control``: an ``int64`` header, one entry per (table, shard) ``[seq, gen, nslots, cap]``, and
  a JSON state blob (model config, tables, served versions, sample rates, dense generation)
  guarded by its own sequence counter;
* ``<table>-<shard>-<gen>.rows``: ``slots`` then ``emb`` of one generation of one shard;
* ``dense-<gen>.pt``: the dense head's state_dict (written whole, then renamed: atomic).

Consistency (issue #17 item 2): a **seqlock per shard**. The writer makes the shard's ``seq`` odd,
applies a delta chunk in place, and makes it even again; a reader notes ``seq``, gathers, and
keeps the result only if ``seq`` was even and is unchanged, retrying otherwise. So a request never
sees a half-written row, and readers never block the writer (the writer is the one process
that must not fall behind the topic). A seqlock beats double buffering here because it needs no
second copy of a table (the point of the exercise) and beats versioned row slots because a delta
chunk also changes the hash index, which a per-row version does not cover. Retries are rare: a
chunk holds ``seq`` odd for a few ms, a gather takes microseconds.

A shard that grows (more rows, or an index rehash) is published as a new generation file: the
writer copies its arrays there, moves its own views to it, and bumps ``gen`` under the seqlock;
readers follow ``gen`` and remap. Old files are unlinked; a reader that still maps one keeps a
valid (stale) mapping until it moves on, and its seqlock check fails, so it retries on the new one.

A torn read can make the reader's kernel see a row number beyond its mapping (the writer grew the
rows and wrote the index before the new generation was published): the kernel bounds-checks every
row and probe, reports the read as torn, and the seqlock retry does the rest. On x86 (TSO) loads
are not reordered with other loads, so reading ``seq`` before and after the copy is enough.

Dense parameters are small and replaced whole: a new ``dense-<gen>.pt`` per dense version. A
worker loads it into a new head and swaps one reference; a request takes the head once, so it
never mixes two dense versions.
"""

from __future__ import annotations

import json
import mmap
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from ps import EmbeddingTable, TableShard
from ps._jit import njit
from ps.hashmap import home

#: int64 words before the shard entries: magic, state seq, state length, writer pid
_HEADER = 8
_MAGIC = 0x44524946544C4E45  # "DRIFTLNE"
#: int64 words per shard entry: seq, gen, nslots, cap
_ENTRY = 4


class SharedTablesError(RuntimeError):
    """The shared tables cannot be used (no PS has published them yet, or a layout mismatch)."""


class NotPublished(SharedTablesError):
    """No serving PS has published tables under this directory (yet)."""


@njit
def shared_gather_kernel(slots, emb, ids, out):
    """Rows of ``ids`` into ``out`` (zeros where absent); False when the read is torn.

    Like :func:`ps.hashmap.lookup_kernel` + row copy, but safe on arrays a writer changes
    concurrently: probing is bounded by the index size and every row number is checked against
    the mapped rows (a torn read may see either out of range)."""
    n_slots = slots.shape[0]
    mask = n_slots - 1
    cap = emb.shape[0]
    dim = emb.shape[1]
    for i in range(ids.size):
        key = ids[i]
        h = home(key, mask)
        r = np.int64(-1)
        for _ in range(n_slots):
            rr = slots[h, 1]
            if rr < 0:
                break
            if slots[h, 0] == key:
                r = rr
                break
            h = (h + 1) & mask
        if r >= cap:
            return False
        if r >= 0:
            for j in range(dim):
                out[i, j] = emb[r, j]
        else:
            for j in range(dim):
                out[i, j] = 0.0
    return True


def _map(path: Path, size: int, write: bool) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR if write else os.O_RDONLY)
    try:
        return mmap.mmap(fd, size, prot=mmap.PROT_READ | (mmap.PROT_WRITE if write else 0))
    finally:
        os.close(fd)


def _rows_views(buf: mmap.mmap | memoryview, nslots: int, cap: int, dim: int,
                write: bool) -> tuple[np.ndarray, np.ndarray]:
    slots = np.frombuffer(buf, np.int64, nslots * 2, 0).reshape(nslots, 2)
    emb = np.frombuffer(buf, np.float32, cap * dim, nslots * 16).reshape(cap, dim)
    if not write:
        slots.flags.writeable = False
        emb.flags.writeable = False
    return slots, emb


def _rows_file(root: Path, table: str, shard: int, gen: int) -> Path:
    return root / f"{table}-{shard}-{gen}.rows"


class Control:
    """The ``control`` file: shard entries and the JSON state, each behind a sequence counter."""

    def __init__(self, root: Path, max_shards: int, state_bytes: int, write: bool) -> None:
        self.path = root / "control"
        self.max_shards = max_shards
        self.state_off = (_HEADER + _ENTRY * max_shards) * 8
        self.size = self.state_off + state_bytes
        if write:
            tmp = self.path.with_name("control.tmp")
            with open(tmp, "wb") as f:
                f.truncate(self.size)
            self._mm = _map(tmp, self.size, True)
            self.words = np.frombuffer(self._mm, np.int64, _HEADER + _ENTRY * max_shards)
            self.words[0] = _MAGIC
            self.words[3] = os.getpid()
            tmp.rename(self.path)
        else:
            try:
                size = self.path.stat().st_size
                self._mm = _map(self.path, size, False)
            except FileNotFoundError:
                raise NotPublished(f"no serving PS has published tables in {root}") from None
            if size != self.size:
                raise SharedTablesError(f"{self.path}: {size} bytes, expected {self.size} (another layout)")
            self.words = np.frombuffer(self._mm, np.int64, _HEADER + _ENTRY * max_shards)
            if int(self.words[0]) != _MAGIC:
                raise SharedTablesError(f"{self.path} is not a driftline control file")

    def entry(self, i: int) -> np.ndarray:
        """``[seq, gen, nslots, cap]`` of shard entry ``i`` (a view)."""
        b = _HEADER + _ENTRY * i
        return self.words[b:b + _ENTRY]

    @property
    def state_seq(self) -> int:
        return int(self.words[1])

    def write_state(self, state: Mapping[str, Any]) -> None:
        raw = json.dumps(state, separators=(",", ":")).encode()
        if len(raw) > self.size - self.state_off:
            raise SharedTablesError(f"state of {len(raw)} bytes does not fit {self.size - self.state_off}")
        self.words[1] += 1  # odd: being written
        self._mm[self.state_off:self.state_off + len(raw)] = raw
        self.words[2] = len(raw)
        self.words[1] += 1

    def read_state(self) -> tuple[int, dict[str, Any]]:
        """``(seq, state)`` of one consistent moment (retries while the writer writes)."""
        while True:
            s1 = int(self.words[1])
            if s1 & 1 or s1 == 0:
                if s1 == 0:
                    raise NotPublished(f"{self.path}: no state published yet")
                time.sleep(0)
                continue
            n = int(self.words[2])
            raw = bytes(self._mm[self.state_off:self.state_off + n])
            if int(self.words[1]) == s1:
                return s1, json.loads(raw)


class TablePublisher:
    """The writer side, in the serving PS: puts its tables' ``slots``/``emb`` in shared memory.

    ``adopt(tables)`` publishes a (new) set of tables; ``writing(table)`` wraps every in-place
    change of one table (the seqlock); afterwards any shard whose arrays were reallocated by
    growth is republished as a new generation.
    """

    def __init__(self, root: Path, max_shards: int, state_bytes: int) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        for old in root.glob("*.rows"):
            old.unlink()
        self.control = Control(root, max_shards, state_bytes, write=True)
        self.tables: dict[str, EmbeddingTable] = {}
        #: table -> first shard entry index
        self.entries: dict[str, int] = {}
        self._gen = 0
        #: (table, shard) -> (path, mmap, slots view, emb view) published now
        self._published: dict[tuple[str, int], tuple[Path, mmap.mmap, np.ndarray, np.ndarray]] = {}

    def adopt(self, tables: Mapping[str, EmbeddingTable]) -> None:
        """Publish ``tables`` (a bootstrap's fresh tables replace the old ones in place of them)."""
        n = sum(len(t.shards) for t in tables.values())
        if n > self.control.max_shards:
            raise SharedTablesError(f"{n} shards, the control file has room for {self.control.max_shards}")
        entries, i = {}, 0
        for name, t in tables.items():
            if not all(isinstance(s, TableShard) for s in t.shards):
                raise SharedTablesError(f"table {name!r}: only local shards can be shared")
            entries[name] = i
            i += len(t.shards)
        old = self._published
        self._published = {}
        self.tables, self.entries = dict(tables), entries
        for name in tables:
            with self.writing(name):
                pass  # publishes every shard as a new generation
        for path, *_ in old.values():
            path.unlink(missing_ok=True)

    def layout(self) -> list[list[Any]]:
        """``[[table, first entry, shards, dim], ...]`` for the state."""
        return [[n, self.entries[n], len(t.shards), t.dim] for n, t in self.tables.items()]

    @contextmanager
    def writing(self, table: str) -> Iterator[None]:
        """Hold ``table``'s shards' seqlocks odd while the body changes it in place."""
        t = self.tables.get(table)
        if t is None:
            yield
            return
        base = self.entries[table]
        entries = [self.control.entry(base + i) for i in range(len(t.shards))]
        for e in entries:
            e[0] += 1
        try:
            yield
        finally:
            for i, (shard, e) in enumerate(zip(t.shards, entries)):
                self._publish_if_moved(table, i, shard, e)
                e[0] += 1

    def _publish_if_moved(self, table: str, i: int, shard: TableShard, entry: np.ndarray) -> None:
        cur = self._published.get((table, i))
        if cur is not None and shard._slots is cur[2] and shard._emb is cur[3]:
            return
        self._gen += 1
        nslots, cap, dim = shard._slots.shape[0], shard._emb.shape[0], shard.dim
        path = _rows_file(self.root, table, i, self._gen)
        size = nslots * 16 + cap * dim * 4
        with open(path, "wb") as f:
            f.truncate(max(size, 1))
        mm = _map(path, max(size, 1), True)
        slots, emb = _rows_views(mm, nslots, cap, dim, write=True)
        slots[:] = shard._slots
        emb[:] = shard._emb
        shard._slots, shard._emb = slots, emb  # the shard's kernels now write the shared arrays
        shard.version += 1  # array caches (ps.server) must rebuild
        self._published[(table, i)] = (path, mm, slots, emb)
        entry[1], entry[2], entry[3] = self._gen, nslots, cap
        if cur is not None:
            cur[0].unlink(missing_ok=True)  # readers mapping it keep a valid, stale mapping

    def table_bytes(self) -> int:
        """Bytes of shared rows and index (what every worker maps)."""
        return sum(s.nbytes + e.nbytes for _p, _m, s, e in self._published.values())


class SharedShard:
    """A read-only shard of a table published by a :class:`TablePublisher` (reader side).

    Has the read methods of :class:`ps.TableShard` that serving uses, so an
    :class:`ps.EmbeddingTable` over these scores with the trainer's own lookup and pooling."""

    def __init__(self, root: Path, control: Control, entry: int, table: str, shard: int, dim: int) -> None:
        self.root, self.control, self.table, self.shard_index, self.dim = root, control, table, shard, dim
        self.entry = control.entry(entry)
        self.gen = -1
        self._slots = np.full((8, 2), -1, np.int64)
        self._emb = np.zeros((0, dim), np.float32)
        self._mm: mmap.mmap | None = None
        #: reads retried because the writer changed the shard meanwhile
        self.retries = 0
        #: the PS replaced this table (a snapshot reload): the mapping is frozen, no seqlock
        self.orphaned = False

    def __len__(self) -> int:
        return int((self._slots[:, 1] >= 0).sum())

    def memory_bytes(self) -> int:
        return 0  # shared: the PS's

    def _follow(self, s1: int) -> bool:
        """Map the generation the entry names, if it moved; False when the entry changed meanwhile.

        ``gen``, ``nslots`` and ``cap`` are read between two equal even ``seq`` s: they describe
        one generation (mapping a file with another's sizes would make wrong-shaped views that
        later reads, passing the seqlock, would trust)."""
        e = self.entry
        gen = int(e[1])
        if gen == self.gen or self.orphaned:
            return True
        nslots, cap = int(e[2]), int(e[3])
        if int(e[0]) != s1:
            return False
        if self._attach(gen, nslots, cap):
            return True
        if int(e[0]) == s1 and int(e[1]) == gen:
            # The entry is stable and names a generation this shard has no file of: the PS
            # published a new set of tables (a snapshot reload) and the entry is another's now.
            # This shard's last mapping is never written again: read it, frozen, until the
            # request that holds it is done (the next request uses the new tables).
            self.orphaned = True
            return True
        return False

    def _attach(self, gen: int, nslots: int, cap: int) -> bool:
        path = _rows_file(self.root, self.table, self.shard_index, gen)
        try:
            mm = _map(path, max(nslots * 16 + cap * self.dim * 4, 1), False)
        except (FileNotFoundError, ValueError):
            return False  # replaced meanwhile: the seqlock check retries
        self._slots, self._emb = _rows_views(mm, nslots, cap, self.dim, write=False)
        self._mm, self.gen = mm, gen
        return True

    def gather(self, ids, *, insert: bool = False, event_time=None, out: np.ndarray | None = None) -> np.ndarray:
        if insert:
            raise SharedTablesError(f"table {self.table!r} is a shared serving replica: read only")
        ids = np.ascontiguousarray(ids, np.int64)
        if out is None:
            out = np.empty((ids.size, self.dim), np.float32)
        e = self.entry
        if self.orphaned:
            if not shared_gather_kernel(self._slots, self._emb, ids, out):
                raise SharedTablesError(f"table {self.table!r}: a frozen generation reads out of range")
            return out
        spins = 0
        while True:
            s1 = int(e[0])
            if not s1 & 1:
                if self._follow(s1) and shared_gather_kernel(self._slots, self._emb, ids, out) and int(e[0]) == s1:
                    return out
            self.retries += 1
            spins += 1
            # the writer holds the seqlock for one chunk (ms): yield the core it needs
            time.sleep(0 if spins < 8 else 0.0002)

    def lookup(self, ids) -> np.ndarray:
        raise SharedTablesError("lookup is not served by shared tables; use gather")

    def items(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Live ``(keys, values, state, times)`` sorted by key, read consistently (for tests)."""
        while True:
            s1 = int(self.entry[0])
            if not self.orphaned and (s1 & 1 or not self._follow(s1)):
                time.sleep(0.0002)
                continue
            live = self._slots[:, 1] >= 0
            keys, rows = self._slots[live, 0].copy(), self._slots[live, 1].copy()
            if (int(self.entry[0]) != s1 and not self.orphaned) or (rows.size and int(rows.max()) >= self._emb.shape[0]):
                continue
            values = self._emb[rows].copy()
            if int(self.entry[0]) != s1 and not self.orphaned:
                continue
            o = np.argsort(keys, kind="stable")
            return keys[o], values[o], np.zeros((keys.size, 0), np.float32), np.zeros(keys.size, np.int64)


def attach_tables(root: Path, control: Control, state: Mapping[str, Any],
                  configs: Mapping[str, Any]) -> dict[str, EmbeddingTable]:
    """Reader :class:`ps.EmbeddingTable` s over the published tables of ``state``'s layout;
    ``configs``: table name -> its :class:`ps.TableConfig` (serving)."""
    tables = {}
    for name, first, nshards, dim in state["tables"]:
        cfg = configs[name]
        if cfg.shards != nshards or cfg.dim != dim:
            raise SharedTablesError(f"table {name!r}: published {nshards} shards dim {dim}, "
                                    f"config {cfg.shards} shards dim {cfg.dim}")
        shards = [SharedShard(root, control, first + i, name, i, dim) for i in range(nshards)]
        tables[name] = EmbeddingTable(cfg, shards)  # type: ignore[arg-type]
    return tables
