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


def test_trainer_batch_holds_out_the_last_examples_of_the_parquet_dumps(tmp_path, capsys):
    """``trainer batch --test-fraction`` on a project's Parquet examples (not only MovieLens): it
    trains on the first rows in the dumps' hourly order and scores the rest (AUC, log loss, mean
    score against the click rate); 0 trains on all; a fraction outside [0, 1) is one line."""
    import json

    import pytest

    from trainer.__main__ import main

    examples = MovieLensData(limit=2000).examples()
    for hour, part in enumerate((examples[:1200], examples[1200:])):
        c = example_batch.decode(example_batch.encode(example_batch.from_examples(part)))
        folder = tmp_path / "examples" / "dt=2000-01-01" / f"hour={hour:02d}"
        folder.mkdir(parents=True)
        pq.write_table(dumper.flatten(c, ["click"]), folder / "part-0000000001-0000.parquet")

    def passes(fraction: str) -> dict:
        assert main(["batch", "--examples-dir", str(tmp_path / "examples"), "--model", "lr", "--batch-size", "256",
                     "--test-fraction", fraction, "--quiet"]) == 0
        return next(json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"pass"'))

    held = passes("0.25")
    assert held["examples"] == 1500 and held["test_examples"] == 500, held
    assert 0.5 < held["test_auc"] < 1 and 0 < held["test_log_loss"] < 1, held
    assert 0 < held["test_mean_score"] < 1 and 0 < held["test_click_rate"] < 1, held
    everything = passes("0")
    assert everything["examples"] == 2000 and "test_auc" not in everything, everything
    with pytest.raises(SystemExit, match="--test-fraction 1.0 is not in"):
        main(["batch", "--examples-dir", str(tmp_path / "examples"), "--test-fraction", "1"])
