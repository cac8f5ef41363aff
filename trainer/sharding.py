"""Which rank owns an id: the one sharding function of distributed training.

Every place that names a shard (the distributed step's owner routing, and later snapshots,
deltas and serving) must agree, so it is one function, and it is the PS's own shard hash
(:func:`ps.sharding.shard_index`, seeded independently of the in-shard index hash). Rank ``r`` of
``n`` therefore owns exactly the ids that shard ``r`` of a ``TableConfig(shards=n)`` table holds:
a rank's rows can be written and read as that shard's snapshot files.

Because it is the same hash, a rank's *local* table must not be sharded again with a modulus that
shares a factor with ``n`` (rank 0 of 2 only holds ids with an even hash: a 2-shard local table
would leave its shard 1 empty); :mod:`trainer.dist.model` keeps one local shard per table.

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


def whole_tables(cfg) -> frozenset[str]:
    """Tables of ``cfg`` (a :class:`trainer.config.ModelConfig`) that live whole on rank 0 of an
    N-rank run instead of split by :func:`shard_of`: the tables of a ``sequential`` model's
    example-by-example pass, which reads every row of an example at once
    (:mod:`trainer.dist.sequential`): its first-order tables, and with ``sequential_embeddings``
    its embedding tables too.

    >>> from trainer.config import deepfm_config
    >>> sorted(whole_tables(deepfm_config(slots=("user_id", "item_id"), sequential_embeddings=False)))
    ['item_id_w', 'user_id_w']
    >>> len(whole_tables(deepfm_config(slots=("user_id", "item_id"))))
    4
    >>> whole_tables(deepfm_config(sequential=False))
    frozenset()
    """
    if not cfg.sequential:
        return frozenset()
    if cfg.sequential_embeddings:
        return frozenset(cfg.linear.values()) | frozenset(cfg.slots.values())
    return frozenset(cfg.linear.values()) - frozenset(cfg.slots.values())


def owners(ids: np.ndarray, n: int, whole: np.ndarray | None = None) -> np.ndarray:
    """:func:`shard_of`, except that ids at the positions ``whole`` selects (bool, per id: a
    table of :func:`whole_tables`) belong to rank 0."""
    own = shard_of(ids, n)
    if whole is not None:
        own[whole] = 0
    return own
