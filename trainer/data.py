"""Training data: MovieLens ratings as vectorized batches, Parquet example dumps, Example protos.

Per-user and per-item slot ids are precomputed once into arrays indexed by user/item id (CSR for
multi-valued slots), so a batch of ratings becomes a :class:`SparseBatch` with numpy fancy
indexing only.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from movielens.data import load
from movielens.features import ITEM_CONTENT, MovieLensFeatures
from proto import Example

from .batch import SparseBatch


@dataclass
class _CSR:
    offsets: np.ndarray  # [max_key + 2]
    ids: np.ndarray

    @staticmethod
    def build(keyed: dict[int, list[int]]) -> _CSR:
        n = max(keyed) + 1 if keyed else 1
        lens = np.zeros(n, np.int64)
        for k, v in keyed.items():
            lens[k] = len(v)
        offs = np.zeros(n + 1, np.int64)
        np.cumsum(lens, out=offs[1:])
        ids = np.zeros(int(offs[-1]), np.int64)
        for k, v in keyed.items():
            ids[offs[k]:offs[k + 1]] = v
        return _CSR(offs, ids)

    def take(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        lens = self.offsets[keys + 1] - self.offsets[keys]
        no = np.zeros(keys.size + 1, np.int64)
        np.cumsum(lens, out=no[1:])
        starts = np.repeat(self.offsets[keys] - no[:-1], lens)
        return self.ids[starts + np.arange(no[-1], dtype=np.int64)], no


class MovieLensData:
    """ml-1m (or ml-100k) ratings + features, ready to cut into batches."""

    def __init__(self, dataset: str = "ml-1m", data_dir: Path = Path("var/data"), limit: int | None = None,
                 offset: int = 0, content: bool = False):
        """``content``: batches carry each item's content tokens too (the slot
        :data:`movielens.features.ITEM_CONTENT`, a content encoder's input)."""
        ml = load(dataset, data_dir)
        ratings = ml.ratings.slice(offset, limit) if (limit is not None or offset) else ml.ratings
        self.features = MovieLensFeatures(ml.users, ml.items)
        self.user_id = ratings["user_id"].to_numpy().astype(np.int64)
        self.item_id = ratings["item_id"].to_numpy().astype(np.int64)
        self.time_ms = ratings["timestamp"].to_numpy().astype(np.int64) * 1000
        self.label = ratings["label"].to_numpy().astype(np.float32)
        self.offset = offset
        self._csr: dict[str, tuple[str, _CSR]] = {}
        users = {u: self.features.user_slots(u) for u in self.features.user_ids}
        items = {i: self.features.item_slots(i) for i in self.features.item_ids}
        for slot in ("user_id", "gender", "age", "occupation", "zip"):
            self._csr[slot] = ("user", _CSR.build({u: d.get(slot, []) for u, d in users.items()}))
        for slot in ("item_id", "genres", "year"):
            self._csr[slot] = ("item", _CSR.build({i: d.get(slot, []) for i, d in items.items()}))
        if content:
            self._csr[ITEM_CONTENT] = ("item", _CSR.build({i: self.features.item_content(i) for i in items}))

    def __len__(self) -> int:
        return self.user_id.size

    def batch(self, rows: np.ndarray) -> SparseBatch:
        u, i = self.user_id[rows], self.item_id[rows]
        ids, offs = {}, {}
        for slot, (side, csr) in self._csr.items():
            ids[slot], offs[slot] = csr.take(u if side == "user" else i)
        eids = None
        return SparseBatch(int(rows.size), ids, offs, self.label[rows], self.time_ms[rows],
                           np.ones(rows.size, np.float32), None, eids)

    def batches(self, batch_size: int, rows: np.ndarray | None = None) -> Iterator[SparseBatch]:
        rows = np.arange(len(self)) if rows is None else rows
        for a in range(0, rows.size, batch_size):
            yield self.batch(rows[a:a + batch_size])

    def split(self, test_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
        """Time split: the last ``test_fraction`` of ratings (in time order) are the test set."""
        n = len(self)
        cut = int(n * (1 - test_fraction))
        return np.arange(cut), np.arange(cut, n)

    def examples(self, rows: np.ndarray | None = None, model_id: str = "replay") -> list[Example]:
        """Example protos (example_id = request_id/item_id, request_id = user@time)."""
        rows = np.arange(len(self)) if rows is None else rows
        out = []
        for r in rows.tolist():
            u, i, t = int(self.user_id[r]), int(self.item_id[r]), int(self.time_ms[r])
            rid = f"{u}@{t}"
            e = Example(example_id=f"{rid}/{i}", request_id=rid, item_id=i, user_id=u,
                        event_time_ms=t, sample_rate=1.0, model_id=model_id)
            e.labels["click"] = float(self.label[r])
            for slot, ids in self.features.user_slots(u).items():
                e.features.sparse[slot].ids.extend(ids)
            for slot, ids in self.features.item_slots(i).items():
                e.features.sparse[slot].ids.extend(ids)
            out.append(e)
        return out


def parquet_files(root: Path = Path("var/examples")) -> list[Path]:
    """The joiner dumper's files ``dt=*/hour=*/*.parquet`` in partition order."""
    return sorted(Path(root).glob("dt=*/hour=*/*.parquet"))


def parquet_batches(files: list[Path], batch_size: int, slots: list[str], label: str = "click",
                    dense_features: list[str] | tuple = ()) -> Iterator[SparseBatch]:
    """Batches from the dumper's Parquet files (schema in :mod:`joiner.dumper`'s docstring), each
    read as :func:`arrow_batch` reads a table."""
    for f in files:
        for rb in pq.ParquetFile(f).iter_batches(batch_size=batch_size):
            yield arrow_batch(pa.Table.from_batches([rb]), slots, label, dense_features)


def arrow_batch(t: pa.Table, slots: list[str], label: str = "click",
                dense_features: list[str] | tuple = ()) -> SparseBatch:
    """One batch from a table of dumped examples: ``sparse_<slot>`` list<int64> per slot (missing
    column or null: empty bags), ``label_<label>`` (null: NaN), ``event_time_ms``, ``sample_rate``
    (missing: 1.0), ``dense_<name>`` (missing or null: NaN), ``model_id`` (each example's slice;
    missing: slices unknown).

    >>> t = pa.table({"sparse_a": [[1, 2], None], "label_click": [1.0, None], "event_time_ms": [5, 6]})
    >>> b = arrow_batch(t, ["a", "b"])
    >>> b.ids["a"].tolist(), b.offsets["a"].tolist(), b.offsets["b"].tolist(), b.labels.tolist()
    ([1, 2], [0, 2, 2], [0, 0, 0], [1.0, nan])
    """
    import pyarrow.compute as pc

    from services.example_batch import slice_codes

    n = t.num_rows
    names = set(t.column_names)
    ids, offs = {}, {}
    for s in slots:
        o = np.zeros(n + 1, np.int64)
        if f"sparse_{s}" in names:
            col = t[f"sparse_{s}"].combine_chunks()
            np.cumsum(pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False), out=o[1:])
            ids[s] = pc.list_flatten(col).to_numpy(zero_copy_only=False).astype(np.int64)
        else:
            ids[s] = np.zeros(0, np.int64)
        offs[s] = o

    def floats(name: str, default: float) -> np.ndarray:
        if name not in names:
            return np.full(n, default, np.float32)
        return pc.fill_null(t[name], default).to_numpy().astype(np.float32)

    et = t["event_time_ms"].to_numpy().astype(np.int64) if "event_time_ms" in names else np.zeros(n, np.int64)
    dense = (np.stack([floats(f"dense_{d}", np.nan) for d in dense_features], 1) if dense_features else None)
    slice_names, slice_ids = slice_codes([t["model_id"]]) if "model_id" in names else ((), None)
    return SparseBatch(n, ids, offs, floats(f"label_{label}", np.nan), et, floats("sample_rate", 1.0), dense,
                       slice_ids=slice_ids, slice_names=slice_names)


def parquet_rows(files: list[Path]) -> int:
    """The examples in ``files`` (from their footers: nothing is read)."""
    return sum(pq.ParquetFile(f).metadata.num_rows for f in files)


def rows_of(batches: Iterable[SparseBatch], start: int, stop: int | None = None) -> Iterator[SparseBatch]:
    """The examples ``[start, stop)`` of a stream of batches, cut where the range cuts a batch.

    >>> b = SparseBatch.from_slot_dicts([{"a": [i]} for i in range(5)], slots=["a"])
    >>> [x.ids["a"].tolist() for x in rows_of([b, b], 3, 7)]
    [[3, 4], [0, 1]]
    """
    pos = 0
    for b in batches:
        lo, hi = max(start - pos, 0), b.size if stop is None else min(stop - pos, b.size)
        pos += b.size
        if lo < hi:
            yield b if (lo, hi) == (0, b.size) else b.select(np.arange(lo, hi))
        if stop is not None and pos >= stop:
            return


def example_records(examples: list[Example], partitions: list[int], chunk: int = 1000) -> list[tuple[int, bytes]]:
    """``(partition, value)`` records of the examples topic for ``examples``: grouped by the
    partition a record keyed by ``str(user_id)`` goes to (aiokafka's ``DefaultPartitioner``, as
    when each example was one record), in order, ``chunk`` examples per example batch
    (:func:`services.example_batch.encode`)."""
    from aiokafka.partitioner import DefaultPartitioner

    from services import example_batch

    pick = DefaultPartitioner()
    groups: dict[int, list[Example]] = {}
    for e in examples:
        groups.setdefault(pick(str(e.user_id).encode(), partitions, partitions), []).append(e)
    return [(part, example_batch.encode(example_batch.from_examples(group[a:a + chunk])))
            for part, group in sorted(groups.items()) for a in range(0, len(group), chunk)]


async def produce_examples(settings, examples: list[Example], topic: str | None = None, chunk: int = 1000) -> int:
    """Write Examples to the examples topic as example batches (:func:`example_records`), each
    record sent to its partition (test and bench helper). Returns the number of records."""
    import asyncio

    from services.kafka import create_topics, producer, start_client

    topic = topic or settings.topics.examples
    await create_topics(settings, {topic: settings.topics.partitions})
    p = producer(settings)
    await start_client(p, settings)
    try:
        records = example_records(examples, sorted(await p.partitions_for(topic)), chunk)
        futs = [await p.send(topic, value, partition=part) for part, value in records]
        await asyncio.gather(*futs)
        return len(futs)
    finally:
        await p.stop()
