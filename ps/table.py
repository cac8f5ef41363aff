"""The user-facing embedding table: a router over its shards.

:class:`EmbeddingTable` has the same methods as a :class:`ps.shard.TableShard` but takes
ids of any shard: it validates the whole batch first (so a bad batch changes no
shard), splits it with :class:`ps.sharding.ShardRouter`, calls each shard and puts
results back in input order. Shards only need the public :class:`TableShard` methods,
so remote shard proxies can stand in for local ones.

>>> from ps import TableConfig, AdagradConfig
>>> t = EmbeddingTable(TableConfig(name="user", dim=4, shards=2, optimizer=AdagradConfig(lr=0.1)))
>>> ids = np.array([3, 1, 4, 1, 5], np.int64)
>>> emb = t.gather(ids, insert=True, event_time=1_700_000_000_000)
>>> emb.shape, emb.dtype, len(t)
((5, 4), dtype('float32'), 4)
>>> t.apply_gradients(ids, np.full((5, 4), 0.5, np.float32), event_time=1_700_000_000_500)
4
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import numpy.typing as npt

from ._validate import as_event_time, as_grads, as_ids, as_values
from .config import TableConfig
from .errors import InvalidInputError
from .shard import TableShard
from .sharding import ShardRouter
from .sync import SyncChunk


class EmbeddingTable:
    """A (possibly sharded) collisionless embedding table; see the module docstring."""

    def __init__(self, config: TableConfig, shards: Sequence[TableShard] | None = None) -> None:
        self.config = config
        self.shards = list(shards) if shards is not None else [TableShard(config, i) for i in range(config.shards)]
        if len(self.shards) != config.shards:
            raise InvalidInputError(f"{config.name}: expected {config.shards} shards, got {len(self.shards)}")
        self.router = ShardRouter(config.shards)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def dim(self) -> int:
        return self.config.dim

    def __len__(self) -> int:
        return sum(len(s) for s in self.shards)

    def memory_bytes(self) -> int:
        return sum(s.memory_bytes() for s in self.shards)

    @property
    def admitted(self) -> int:
        """Ids admitted (rows created by training inserts) since this process built the shards."""
        return sum(getattr(s, "admitted", 0) for s in self.shards)

    @property
    def evicted(self) -> int:
        """Rows removed by TTL expiry since this process built the shards."""
        return sum(getattr(s, "evicted", 0) for s in self.shards)

    def _event_time(self, event_time: npt.ArrayLike | None, n: int) -> np.ndarray:
        return as_event_time(event_time, n)

    # ------------------------------------------------------------------ reads / writes
    def contains(self, ids: npt.ArrayLike) -> np.ndarray:
        """Boolean mask: which ids have a row."""
        ids = as_ids(ids)
        if len(self.shards) == 1:
            return self.shards[0].lookup(ids) >= 0
        out = np.empty(ids.size, bool)
        for s, pos in zip(self.shards, self.router.split(ids), strict=True):
            out[pos] = s.lookup(ids[pos]) >= 0
        return out

    def gather(self, ids: npt.ArrayLike, *, insert: bool = False, event_time: npt.ArrayLike | None = None,
               out: np.ndarray | None = None) -> np.ndarray:
        """float32 ``[n, dim]`` embeddings (zeros where absent); ``torch.from_numpy`` shares it.

        ``insert=True`` (training forward) admits/initialises new ids at ``event_time``.
        """
        ids = as_ids(ids)
        t = as_event_time(event_time, ids.size) if insert else None
        if len(self.shards) == 1:
            return self.shards[0].gather(ids, insert=insert, event_time=t if t is None or t.size > 1 else int(t[0]), out=out)
        if out is None:
            out = np.empty((ids.size, self.dim), np.float32)
        elif out.dtype != np.float32 or out.shape != (ids.size, self.dim):
            raise InvalidInputError(f"out must be float32 {(ids.size, self.dim)}")
        for s, pos in zip(self.shards, self.router.split(ids), strict=True):
            if pos.size:
                st = None if t is None else (t[pos] if t.size > 1 else int(t[0]))
                out[pos] = s.gather(ids[pos], insert=insert, event_time=st)
        return out

    def apply_gradients(self, ids: npt.ArrayLike, grads: npt.ArrayLike, event_time: npt.ArrayLike) -> int:
        """Sum gradients per unique id and step each existing row; returns rows updated."""
        ids = as_ids(ids)
        g = as_grads(grads, ids.size, self.dim)
        t = as_event_time(event_time, ids.size)
        if len(self.shards) == 1:
            return self.shards[0].apply_gradients(ids, g, t if t.size > 1 else int(t[0]))
        n = 0
        for s, pos in zip(self.shards, self.router.split(ids), strict=True):
            if pos.size:
                n += s.apply_gradients(ids[pos], g[pos], t[pos] if t.size > 1 else int(t[0]))
        return n

    def delete(self, ids: npt.ArrayLike) -> int:
        ids = as_ids(ids)
        return sum(s.delete(ids[pos]) for s, pos in zip(self.shards, self.router.split(ids), strict=True) if pos.size)

    def expire(self, now: int | None = None, max_scan: int | None = None) -> int:
        """Bounded TTL sweep on every shard (see :meth:`TableShard.expire`)."""
        return sum(s.expire(now, max_scan) for s in self.shards)

    # ------------------------------------------------------------------ sync
    @property
    def pending_updates(self) -> int:
        return sum(s.pending_updates for s in self.shards)

    def pop_updates(self, max_rows: int = 65536) -> Iterator[SyncChunk]:
        """Drain the touched-key stream shard by shard, chunks of at most ``max_rows``."""
        for s in self.shards:
            yield from s.pop_updates(max_rows)

    def apply_sync(self, chunk: SyncChunk) -> None:
        """Apply a chunk from the trainer's stream (replica side), split per shard."""
        keys = as_ids(chunk.keys)
        vals = as_values(chunk.values, keys.size, self.dim)
        times = as_event_time(chunk.times, keys.size) if keys.size else np.zeros(0, np.int64)
        tomb = as_ids(chunk.tombstones)
        if len(self.shards) == 1:
            self.shards[0].apply_sync(SyncChunk(keys, vals, times, tomb))
            return
        kp, tp = self.router.split(keys), self.router.split(tomb)
        for s, a, b in zip(self.shards, kp, tp, strict=True):
            if a.size or b.size:
                s.apply_sync(SyncChunk(keys[a], vals[a], times[a], tomb[b]))

    def load_rows(self, keys: npt.ArrayLike, values: npt.ArrayLike, state: npt.ArrayLike, times: npt.ArrayLike) -> None:
        """Insert rows with their optimizer state, split per shard (:meth:`TableShard.load_rows`)."""
        keys = as_ids(keys)
        values = as_values(values, keys.size, self.dim)
        state = np.asarray(state, np.float32).reshape(keys.size, -1)
        times = np.asarray(times, np.int64).reshape(keys.size)
        for s, pos in zip(self.shards, self.router.split(keys), strict=True):
            if pos.size:
                s.load_rows(keys[pos], values[pos], state[pos], times[pos])

    def read_rows(self, ids: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """``(values, optimizer_state)`` of rows that exist, split per shard (:meth:`TableShard.read_rows`)."""
        ids = as_ids(ids)
        if len(self.shards) == 1:
            return self.shards[0].read_rows(ids)
        values = np.empty((ids.size, self.dim), np.float32)
        state = np.empty((ids.size, self.config.slot_width), np.float32)
        for s, pos in zip(self.shards, self.router.split(ids), strict=True):
            if pos.size:
                values[pos], state[pos] = s.read_rows(ids[pos])
        return values, state

    def write_rows(self, ids: npt.ArrayLike, values: npt.ArrayLike, state: npt.ArrayLike) -> None:
        """Overwrite values and optimizer state of rows that exist, nothing else
        (:meth:`TableShard.write_rows`).

        >>> from ps import TableConfig
        >>> t = EmbeddingTable(TableConfig(name="t", dim=2))
        >>> _ = t.gather([7], insert=True, event_time=1)
        >>> t.write_rows([7], [[1.0, 2.0]], t.read_rows([7])[1])
        >>> t.read_rows([7])[0].tolist(), t.pending_updates
        ([[1.0, 2.0]], 1)
        """
        ids = as_ids(ids)
        values = as_values(values, ids.size, self.dim)
        state = np.asarray(state, np.float32).reshape(ids.size, -1)
        if len(self.shards) == 1:
            self.shards[0].write_rows(ids, values, state)
            return
        for s, pos in zip(self.shards, self.router.split(ids), strict=True):
            if pos.size:
                s.write_rows(ids[pos], values[pos], state[pos])

    def items(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(keys, values, optimizer_state, times)`` of all rows sorted by key."""
        parts = [s.items() for s in self.shards]
        if len(parts) == 1:
            return parts[0]
        cat = [np.concatenate([p[i] for p in parts]) for i in range(4)]
        o = np.argsort(cat[0], kind="stable")
        keys, values, state, times = (c[o] for c in cat)
        return keys, values, state, times

    def __repr__(self) -> str:
        return f"EmbeddingTable({self.name!r}, dim={self.dim}, shards={len(self.shards)}, keys={len(self)})"
