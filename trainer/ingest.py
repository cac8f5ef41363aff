"""The online trainer's checks of decoded example batches, vectorized over a batch.

An ``examples`` record is one :mod:`services.example_batch` batch. ``example_batch.decode``
validates the format (schema, offsets, nulls, ``event_time_ms > 0``, ``sample_rate`` in (0, 1],
no infinite label or dense value): a record it refuses is dead-lettered whole. An example that
decodes can still be one the trainer must not learn; :func:`refusals` finds those, per example,
so the rest of their record is trained on:

* ``unknown_slot``: a non-empty bag in a ``sparse.<slot>`` column the model does not know;
* ``bad_label``: the model's label missing (no column, or NaN) or outside [0, 1] (not a log-loss
  target: 1e38 made the loss -1e35);
* ``wrong_dim``: one of the model's dense features missing (NaN), or a value for a dense feature
  the model does not have;
* ``event_time``: further ahead of the wall clock than ``event_time.max_future_s`` (it would move
  the trainer's event-time clock for good: snapshots are due by event time, TTL tables expire
  rows against it).

>>> import numpy as np
>>> from services.example_batch import ExampleColumns
>>> c = ExampleColumns(["a", "b", "c"], ["r"] * 3, np.arange(3), np.zeros(3), np.array([1, 2, 10**15]),
...                    np.ones(3, np.float32), ["m"] * 3, labels={"click": np.array([1, np.nan, 0], np.float32)},
...                    sparse={"odd": (np.array([5]), np.array([0, 0, 0, 1]))})
>>> codes = refusals(c, {"genre"}, "click", [], now_ms=1000, max_future_ms=0)
>>> [KINDS[k] if k else None for k in codes]
[None, 'bad_label', 'unknown_slot']
>>> take(c, np.array([2])).example_ids, take(c, np.array([2])).sparse["odd"][1].tolist()
(['c'], [0, 1])
"""

from __future__ import annotations

import numpy as np

from services.codecs import event_time_error
from services.example_batch import ExampleColumns
from services.example_batch import take

__all__ = ["KINDS", "detail", "refusals", "take"]

#: refusal codes (0: learnable), in the order they are checked (an example gets the first that applies)
KINDS = (None, "unknown_slot", "bad_label", "wrong_dim", "event_time")


def refusals(c: ExampleColumns, known_slots: set[str], label: str, dense_features: list[str], *,
             now_ms: int, max_future_ms: int) -> np.ndarray:
    """int8 ``[n]``: 0 for a learnable example, else its index in :data:`KINDS`."""
    n = c.size
    bad = [np.zeros(n, np.bool_) for _ in KINDS]
    for s, (_, offs) in c.sparse.items():
        if s not in known_slots:
            bad[1] |= np.diff(offs) > 0
    lab = c.labels.get(label)
    bad[2] = np.ones(n, np.bool_) if lab is None else ~((lab >= 0) & (lab <= 1))  # NaN fails too
    for d, v in c.dense.items():
        if d not in dense_features:
            bad[3] |= ~np.isnan(v)
    for d in dense_features:
        v = c.dense.get(d)
        bad[3] |= True if v is None else np.isnan(v)
    bad[4] = c.event_time_ms > now_ms + max_future_ms
    codes = np.zeros(n, np.int8)
    for k in range(len(KINDS) - 1, 0, -1):  # the first kind that applies wins
        codes[bad[k]] = k
    return codes


def detail(c: ExampleColumns, row: int, kind: str, known_slots: set[str], label: str, dense_features: list[str], *,
           now_ms: int, max_future_ms: int) -> str:
    """Why example ``row`` got refusal ``kind`` (for the dead letter)."""
    if kind == "unknown_slot":
        return str(sorted(s for s, (_, o) in c.sparse.items() if s not in known_slots and o[row + 1] > o[row]))
    if kind == "bad_label":
        v = c.labels.get(label)
        return f"{label!r} missing" if v is None or np.isnan(v[row]) else f"{label!r} = {float(v[row])!r} is outside [0, 1]"
    if kind == "wrong_dim":
        present = sorted(d for d, v in c.dense.items() if not np.isnan(v[row]))
        return f"dense features {present} != {list(dense_features)}"
    return event_time_error(int(c.event_time_ms[row]), now_ms, float("inf"), max_future_ms / 1000) or kind
