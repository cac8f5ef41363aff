"""Row selection over :class:`services.example_batch.ExampleColumns` (a helper beside
``services.example_batch``, which is a fixed contract): the examples a consumer refuses are
dead-lettered as a batch of just those examples.

>>> import numpy as np
>>> from services.example_batch import ExampleColumns, decode, encode
>>> c = ExampleColumns(["a", "b"], ["r", "r"], np.array([1, 2]), np.zeros(2), np.array([5, 6]),
...                    np.ones(2, np.float32), ["m", "m"], sparse={"s": (np.array([7, 8, 9]), np.array([0, 1, 3]))})
>>> t = decode(encode(take(decode(encode(c)), np.array([1]))))
>>> list(t.example_ids), t.sparse["s"][0].tolist(), t.sparse["s"][1].tolist()
(['b'], [8, 9], [0, 2])
"""

from __future__ import annotations

import numpy as np

from services.example_batch import ExampleColumns


def take(c: ExampleColumns, rows: np.ndarray) -> ExampleColumns:
    """The examples ``rows`` (int indices) of a batch, as a batch of their own."""
    rows = np.asarray(rows, np.int64)
    idx = rows.tolist()
    sparse = {}
    for s, (ids, o) in c.sparse.items():
        lens = o[rows + 1] - o[rows]
        no = np.zeros(rows.size + 1, np.int64)
        np.cumsum(lens, out=no[1:])
        sparse[s] = ids[np.repeat(o[rows] - no[:-1], lens) + np.arange(no[-1], dtype=np.int64)], no
    return ExampleColumns([c.example_ids[i] for i in idx], [c.request_ids[i] for i in idx], c.item_id[rows],
                          c.user_id[rows], c.event_time_ms[rows], c.sample_rate[rows],
                          [c.model_ids[i] for i in idx], labels={k: v[rows] for k, v in c.labels.items()},
                          sparse=sparse, dense={k: v[rows] for k, v in c.dense.items()},
                          id_hash=None if c.id_hash is None else c.id_hash[rows])
