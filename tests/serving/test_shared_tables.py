"""Shared-memory tables (serving/shared_tables.py): readers in other processes never see a torn
row while a writer applies chunks in place, grows the rows and rehashes the index."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import numpy as np

from ps import EmbeddingTable, SyncChunk, TableConfig
from serving.shared_tables import Control, TablePublisher, attach_tables

DIM = 8
MAX_SHARDS, STATE = 16, 1 << 16


def _chunk(keys: np.ndarray, version: int, tomb: np.ndarray | None = None) -> SyncChunk:
    """Every row of version ``v`` is ``[key, v, v, ...]``: a torn row mixes two versions or keys."""
    vals = np.full((keys.size, DIM), version, np.float32)
    vals[:, 0] = keys
    return SyncChunk(keys, vals, np.ones(keys.size, np.int64),
                     np.empty(0, np.int64) if tomb is None else tomb)


def _config(shards: int) -> TableConfig:
    return TableConfig(name="t", dim=DIM, shards=shards, initial_capacity=64).serving()


def _reader(root: str, shards: int, seconds: float, out: mp.Queue[tuple[int, int, int, int]]) -> None:
    control = Control(Path(root), MAX_SHARDS, STATE, write=False)
    _seq, state = control.read_state()
    table = attach_tables(Path(root), control, state, {"t": _config(shards)})["t"]
    rng = np.random.default_rng()
    torn = reads = nonzero = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        ids = rng.integers(0, 40_000, 256).astype(np.int64)
        rows = table.gather(ids)
        present = rows[:, 1] != 0
        # a present row: its key in column 0 and one version in every other column
        bad = present & ((rows[:, 0] != ids) | (rows[:, 1:] != rows[:, 1:2]).any(axis=1))
        torn += int(bad.sum())
        reads += ids.size
        nonzero += int(present.sum())
    retries = sum(s.retries for s in table.shards)
    out.put((torn, reads, nonzero, retries))


def _write_loop(table: EmbeddingTable, pub: TablePublisher, seconds: float) -> int:
    rng = np.random.default_rng(1)
    version, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        version += 1
        n = min(40_000, 500 * version)  # keeps inserting: rows grow, the index rehashes
        keys = np.unique(rng.integers(0, n, 2_000)).astype(np.int64)
        tomb = np.setdiff1d(np.unique(rng.integers(0, n, 100)), keys).astype(np.int64)
        with pub.writing("t"):
            table.apply_sync(_chunk(keys, version, tomb))
    return version


def _run(tmp_path: Path, shards: int, seconds: float = 3.0) -> None:
    table = EmbeddingTable(_config(shards))
    pub = TablePublisher(tmp_path, MAX_SHARDS, STATE)
    pub.adopt({"t": table})
    pub.control.write_state({"tables": pub.layout()})
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    readers = [ctx.Process(target=_reader, args=(str(tmp_path), shards, seconds, q)) for _ in range(2)]
    for r in readers:
        r.start()
    time.sleep(1.0)  # the readers import numba and attach
    versions = _write_loop(table, pub, seconds)
    results = [q.get(timeout=60) for _ in readers]
    for r in readers:
        r.join(30)
    print("versions", versions, "readers (torn, reads, present, retries):", results)
    assert versions > 5
    assert sum(r[0] for r in results) == 0, results  # torn rows
    assert all(r[2] > 0 for r in results), results  # they did read rows the writer wrote
    # the readers followed every generation: a final read equals the writer's table
    control = Control(tmp_path, MAX_SHARDS, STATE, write=False)
    shared = attach_tables(tmp_path, control, {"tables": pub.layout()}, {"t": _config(shards)})["t"]
    want_k, want_v, *_ = table.items()
    got_k, got_v, *_ = shared.items()
    assert np.array_equal(want_k, got_k) and np.array_equal(want_v, got_v)


def test_no_torn_rows_while_a_writer_applies_and_grows(tmp_path: Path) -> None:
    _run(tmp_path, shards=1)


def test_no_torn_rows_sharded_table(tmp_path: Path) -> None:
    _run(tmp_path, shards=2, seconds=2.0)


def test_reader_refuses_inserts(tmp_path: Path) -> None:
    import pytest

    from serving.shared_tables import NotPublished, SharedTablesError

    with pytest.raises(NotPublished):
        Control(tmp_path, MAX_SHARDS, STATE, write=False)
    table = EmbeddingTable(_config(1))
    pub = TablePublisher(tmp_path, MAX_SHARDS, STATE)
    pub.adopt({"t": table})
    shared = attach_tables(tmp_path, Control(tmp_path, MAX_SHARDS, STATE, write=False),
                           {"tables": pub.layout()}, {"t": _config(1)})["t"]
    with pytest.raises(SharedTablesError):
        shared.gather(np.array([1], np.int64), insert=True, event_time=1)


def test_a_reader_of_replaced_tables_reads_them_frozen(tmp_path: Path) -> None:
    """A snapshot reload publishes new tables (entries reused by other tables): a request still
    holding the old ones reads their last rows, consistently, instead of waiting forever."""
    old = EmbeddingTable(_config(1))
    old.apply_sync(_chunk(np.arange(1, 100, dtype=np.int64), 3))
    pub = TablePublisher(tmp_path, MAX_SHARDS, STATE)
    pub.adopt({"t": old})
    control = Control(tmp_path, MAX_SHARDS, STATE, write=False)
    reader = attach_tables(tmp_path, control, {"tables": pub.layout()}, {"t": _config(1)})["t"]
    assert reader.gather(np.array([5], np.int64))[0, 1] == 3
    other = EmbeddingTable(TableConfig(name="u", dim=DIM, initial_capacity=64).serving())
    new = EmbeddingTable(_config(1))
    new.apply_sync(_chunk(np.arange(1, 100, dtype=np.int64), 4))
    pub.adopt({"u": other, "t": new})  # "t" moved to another entry; entry 0 is "u"'s now
    with pub.writing("u"):
        other.apply_sync(_chunk(np.array([7], np.int64), 9))
    assert reader.gather(np.array([5, 500], np.int64))[:, 1].tolist() == [3.0, 0.0]
    assert reader.shards[0].orphaned
    fresh = attach_tables(tmp_path, control, {"tables": pub.layout()},
                          {"t": _config(1), "u": other.config})["t"]
    assert fresh.gather(np.array([5], np.int64))[0, 1] == 4
