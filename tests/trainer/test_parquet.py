"""Batch training reads what the dumper writes: ``trainer.data.parquet_batches`` over Parquet made
by ``joiner.dumper.flatten`` from a decoded example batch gives the batch the online trainer builds
from the same record (``example_batch.to_sparse_batch_arrays``)."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq

from joiner import dumper
from services import example_batch
from trainer.batch import SparseBatch
from trainer.data import MovieLensData, parquet_batches


def test_parquet_batches_read_the_dumpers_files(tmp_path):
    examples = MovieLensData(limit=300).examples()
    for i, e in enumerate(examples):
        e.features.dense["x"] = float(i)
    del examples[7].features.dense["x"]  # absent: NaN
    c = example_batch.decode(example_batch.encode(example_batch.from_examples(examples)))
    slots = ["user_id", "item_id", "genres", "not_in_the_data"]
    pq.write_table(dumper.flatten(c, ["click", "like"]), tmp_path / "part-0000000001-0000.parquet")
    want = SparseBatch(**{k: v for k, v in example_batch.to_sparse_batch_arrays([c], slots, "click", ["x"]).items()
                          if k != "meta"})
    got = list(parquet_batches([tmp_path / "part-0000000001-0000.parquet"], 1000, slots, "click", ["x"]))
    assert len(got) == 1 and got[0].size == want.size == 300
    b = got[0]
    for s in slots:
        assert np.array_equal(b.ids[s], want.ids[s]) and np.array_equal(b.offsets[s], want.offsets[s]), s
    assert np.array_equal(b.labels, want.labels) and np.array_equal(b.event_time_ms, want.event_time_ms)
    assert np.array_equal(b.sample_rate, want.sample_rate)
    assert np.array_equal(b.dense, want.dense, equal_nan=True) and np.isnan(b.dense[7, 0])
