"""Split a table's ids over N shards by a hash of the id, and put the pieces back.

The shard hash is independent of the in-shard index hash (different seed), so every
shard's index still sees well-spread keys. Routing only needs ``num_shards``, so a
client can route to shards living in other processes.

>>> r = ShardRouter(3)
>>> ids = np.arange(10, dtype=np.int64)
>>> parts = r.split(ids)
>>> sorted(int(i) for p in parts for i in ids[p])  == list(range(10))
True
>>> bool((r.shard_of(ids[parts[1]]) == 1).all())
True
"""

from __future__ import annotations

import numpy as np

from ._jit import I64Array, IntLike, mix64_seeded, njit

SHARD_SEED = 0x5EED5A4D


@njit
def shard_index(key: IntLike, num_shards: IntLike) -> np.int64:
    return np.int64((mix64_seeded(key, SHARD_SEED) >> np.uint64(16)) % np.uint64(num_shards))


@njit
def _shard_of(ids: I64Array, num_shards: IntLike, out: I64Array) -> None:
    for i in range(ids.size):
        out[i] = shard_index(ids[i], num_shards)


@njit
def _split(shard: I64Array, num_shards: IntLike, counts: I64Array, order: I64Array) -> None:
    # counting sort: stable, O(n), positions of each shard's ids contiguous in `order`
    for i in range(shard.size):
        counts[shard[i] + 1] += 1
    for s in range(num_shards):
        counts[s + 1] += counts[s]
    fill = counts[:-1].copy()
    for i in range(shard.size):
        s = shard[i]
        order[fill[s]] = i
        fill[s] += 1


class ShardRouter:
    """Maps ids to shard numbers and splits batches per shard (order preserved)."""

    def __init__(self, num_shards: int) -> None:
        if num_shards < 1:
            raise ValueError("num_shards must be >= 1")
        self.num_shards = num_shards

    def shard_of(self, ids: np.ndarray) -> np.ndarray:
        out = np.empty(ids.size, np.int64)
        _shard_of(ids, self.num_shards, out)
        return out

    def split(self, ids: np.ndarray) -> list[np.ndarray]:
        """For each shard, the positions in ``ids`` it owns (ascending)."""
        if self.num_shards == 1:
            return [np.arange(ids.size)]
        counts = np.zeros(self.num_shards + 1, np.int64)
        order = np.empty(ids.size, np.int64)
        _split(self.shard_of(ids), self.num_shards, counts, order)
        return [order[counts[s]:counts[s + 1]] for s in range(self.num_shards)]
