"""The touched-key stream between a trainer table and its serving replicas.

A trainer table records every row it changes (inserted, updated, deleted, expired)
since the last drain; :meth:`ps.EmbeddingTable.pop_updates` yields that exact set as
:class:`SyncChunk` s of bounded size, and a replica applies them with
:meth:`ps.EmbeddingTable.apply_sync` in place, one chunk per lock hold, so lookups on
the replica keep being served between chunks. Values are read at drain time, so a
key updated many times since the last sync appears once with its latest value.

>>> from ps import EmbeddingTable, TableConfig, SGDConfig
>>> train = EmbeddingTable(TableConfig(name="t", dim=2, optimizer=SGDConfig(lr=1.0),
...                                    initializer={"kind": "zeros"}))
>>> serve = EmbeddingTable(train.config.serving())
>>> ids = np.array([1, 2], np.int64)
>>> _ = train.gather(ids, insert=True, event_time=1000)
>>> train.apply_gradients(ids, np.ones((2, 2), np.float32), event_time=2000)
2
>>> _ = train.delete(np.array([2], np.int64))
>>> for chunk in train.pop_updates(max_rows=1):
...     serve.apply_sync(chunk)
>>> serve.gather(np.array([1, 2], np.int64)).tolist(), len(serve)
([[-1.0, -1.0], [0.0, 0.0]], 1)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SyncChunk:
    """Upserts ``(keys, values, times)`` and deleted keys (``tombstones``).

    ``values`` is float32 ``[len(keys), dim]``; ``times`` the rows' last-update event
    times (int64 ms). A key never appears both as upsert and tombstone in one drain.
    """

    keys: np.ndarray
    values: np.ndarray
    times: np.ndarray
    tombstones: np.ndarray

    def __len__(self) -> int:
        return int(self.keys.size + self.tombstones.size)
