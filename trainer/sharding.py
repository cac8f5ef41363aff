"""Which rank owns an id: the one sharding function of distributed training.

Every place that names a shard (the distributed step's owner routing, and later snapshots,
deltas and serving) must agree, so it is one function, and it is the PS's own shard hash
(:func:`ps.sharding.shard_index`, seeded independently of the in-shard index hash). Rank ``r`` of
``n`` therefore owns exactly the ids that shard ``r`` of a ``TableConfig(shards=n)`` table holds:
a rank's rows can be written and read as that shard's snapshot files.

Because it is the same hash, a rank's *local* table must not be sharded again with a modulus that
shares a factor with ``n`` (rank 0 of 2 only holds ids with an even hash: a 2-shard local table
would leave its shard 1 empty); :mod:`trainer.distributed` keeps one local shard per table.

>>> ids = np.arange(-4, 6, dtype=np.int64)
>>> own = shard_of(ids, 3)
>>> own.dtype, bool(((own >= 0) & (own < 3)).all())
(dtype('int64'), True)
>>> from ps import ShardRouter
>>> bool((own == ShardRouter(3).shard_of(ids)).all())   # the PS's shard of a 3-shard table
True
>>> shard_of(ids, 1).tolist() == [0] * 10
True
"""

from __future__ import annotations

import numpy as np

from ps import ShardRouter


def shard_of(ids: np.ndarray, n: int) -> np.ndarray:
    """The owner (``0 <= owner < n``) of each int64 id, as int64 (stable across processes and runs)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    ids = np.ascontiguousarray(ids, np.int64)
    if n == 1:
        return np.zeros(ids.size, np.int64)
    return ShardRouter(n).shard_of(ids)
