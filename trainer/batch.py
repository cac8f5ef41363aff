"""A batch of examples as flat ids + offsets per slot (embedding-bag layout).

>>> b = SparseBatch.from_slot_dicts([{"a": [1, 2], "b": [7]}, {"a": [3]}], slots=["a", "b"])
>>> b.size, b.ids["a"].tolist(), b.offsets["a"].tolist(), b.offsets["b"].tolist()
(2, [1, 2, 3], [0, 2, 3], [0, 1, 1])
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from proto import Example
from services.example_batch import take_lists


@dataclass
class SparseBatch:
    """``ids[slot]`` int64 flat, ``offsets[slot]`` int64 ``[size + 1]`` (bag i is
    ``ids[offsets[i]:offsets[i+1]]``). ``dense`` float32 ``[size, n_dense]`` or None."""

    size: int
    ids: dict[str, np.ndarray]
    offsets: dict[str, np.ndarray]
    labels: np.ndarray | None = None          # float32 [size]
    event_time_ms: np.ndarray | None = None   # int64 [size]
    sample_rate: np.ndarray | None = None     # float32 [size]
    dense: np.ndarray | None = None
    example_ids: list[str] | None = None
    meta: dict = field(default_factory=dict)
    #: each example's slice (the serving model_id that served its impression; the joiner's unit of
    #: negative sampling) as an index into ``slice_names``: int32 [size], or None when unknown.
    #: What :class:`trainer.sample_rates.SampleRateTracker` groups the sample rates by.
    slice_ids: np.ndarray | None = None
    slice_names: tuple[str, ...] = ()

    @property
    def max_event_time(self) -> int:
        if self.event_time_ms is None or self.event_time_ms.size == 0:
            return 0
        return int(self.event_time_ms.max())

    def bag(self, slot: str) -> tuple[np.ndarray, np.ndarray]:
        return self.ids[slot], self.offsets[slot]

    def select(self, rows: np.ndarray) -> SparseBatch:
        """The sub-batch of ``rows`` (int indices), vectorized."""
        rows = np.asarray(rows, np.int64)
        ids, offs = {}, {}
        for s in self.ids:
            ids[s], offs[s] = take_lists(self.ids[s], self.offsets[s], rows)

        def pick(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[rows]

        return SparseBatch(int(rows.size), ids, offs, pick(self.labels), pick(self.event_time_ms),
                           pick(self.sample_rate), pick(self.dense),
                           None if self.example_ids is None else [self.example_ids[i] for i in rows],
                           slice_ids=pick(self.slice_ids), slice_names=self.slice_names)

    @staticmethod
    def from_slot_dicts(rows: Sequence[dict[str, Sequence[int]]], dense: np.ndarray | None = None, *,
                        slots: Iterable[str] | None = None, labels=None, event_time_ms=None,
                        sample_rate=None) -> SparseBatch:
        """From plain dicts ``slot -> ids`` (what the feature store holds). Missing slots are empty bags."""
        slots = sorted({s for r in rows for s in r}) if slots is None else list(slots)
        n = len(rows)
        ids, offs = {}, {}
        for s in slots:
            bags = [r.get(s, ()) for r in rows]
            lens = np.fromiter(map(len, bags), np.int64, n)
            o = np.zeros(n + 1, np.int64)
            np.cumsum(lens, out=o[1:])
            ids[s] = np.fromiter(chain.from_iterable(bags), np.int64, int(o[-1]))
            offs[s] = o
        return SparseBatch(n, ids, offs, _opt(labels, np.float32), _opt(event_time_ms, np.int64),
                           _opt(sample_rate, np.float32),
                           None if dense is None else np.ascontiguousarray(dense, np.float32))

    @staticmethod
    def from_examples(examples: Sequence[Example], slots: Iterable[str] | None = None, label: str = "click",
                      dense_features: Sequence[str] = ()) -> SparseBatch:
        """From Example protos. Missing labels read as NaN, missing dense features as NaN."""
        n = len(examples)
        feats = [e.features.sparse for e in examples]
        if slots is None:
            slots = sorted({s for f in feats for s in f})
        ids, offs = {}, {}
        empty = ()
        for s in slots:
            bags = [f[s].ids if s in f else empty for f in feats]
            lens = np.fromiter(map(len, bags), np.int64, n)
            o = np.zeros(n + 1, np.int64)
            np.cumsum(lens, out=o[1:])
            ids[s] = np.fromiter(chain.from_iterable(bags), np.int64, int(o[-1]))
            offs[s] = o
        labels = np.fromiter((e.labels.get(label, math.nan) for e in examples), np.float32, n)
        t = np.fromiter((e.event_time_ms for e in examples), np.int64, n)
        rate = np.fromiter((e.sample_rate or 1.0 for e in examples), np.float32, n)
        dense = None
        if dense_features:
            dense = np.array([[e.features.dense.get(d, math.nan) for d in dense_features] for e in examples],
                             np.float32).reshape(n, len(dense_features))
        names: dict[str, int] = {}
        slice_ids = np.fromiter((names.setdefault(e.model_id, len(names)) for e in examples), np.int32, n)
        return SparseBatch(n, ids, offs, labels, t, rate, dense, [e.example_id for e in examples],
                           slice_ids=slice_ids, slice_names=tuple(names))


def _opt(a, dtype):
    return None if a is None else np.ascontiguousarray(a, dtype)


def concat_batches(batches: Sequence[SparseBatch]) -> SparseBatch:
    """``batches`` one after another, as one batch (their slots, labels, times, rates and dense
    features; every batch has the same slots and the same optional arrays). Slice names are the
    first batch's, so the batches should share them (sub-batches of one stream do).

    >>> a = SparseBatch(2, {"s": np.array([1, 2, 3])}, {"s": np.array([0, 1, 3])}, np.array([1, 0], np.float32))
    >>> b = concat_batches([a, a.select(np.array([1]))])
    >>> b.size, b.ids["s"].tolist(), b.offsets["s"].tolist(), b.labels.tolist()
    (3, [1, 2, 3, 2, 3], [0, 1, 3, 5], [1.0, 0.0, 0.0])
    """
    first = batches[0]
    ids, offs = {}, {}
    for s in first.ids:
        ids[s] = np.concatenate([b.ids[s] for b in batches])
        lens = np.concatenate([np.diff(b.offsets[s]) for b in batches])
        offs[s] = np.zeros(lens.size + 1, np.int64)
        np.cumsum(lens, out=offs[s][1:])

    def cat(name: str) -> np.ndarray | None:
        parts = [getattr(b, name) for b in batches]
        return None if parts[0] is None else np.concatenate(parts)

    example_ids = None if first.example_ids is None else [e for b in batches for e in (b.example_ids or [])]
    return SparseBatch(sum(b.size for b in batches), ids, offs, cat("labels"), cat("event_time_ms"),
                       cat("sample_rate"), cat("dense"), example_ids, slice_ids=cat("slice_ids"),
                       slice_names=first.slice_names)
