"""Snapshots: full + incremental chains round-trip bit-identically; corruption is refused."""

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_tables_identical
from hypothesis import given, settings
from hypothesis import strategies as st

from ps import (
    AdmissionConfig,
    EmbeddingTable,
    FtrlConfig,
    SnapshotCorruptError,
    SnapshotError,
    SnapshotNotFoundError,
    TableConfig,
    restore_table,
    save_table,
)
from ps import rows as R

CFG = TableConfig(name="snap", dim=3, shards=2, optimizer=FtrlConfig(), ttl_seconds=100,
                  admission=AdmissionConfig(min_count=2, probability=0.7, sketch_width=256),
                  initial_capacity=8, track_updates=False)


def assert_restored(orig, rest):
    assert_tables_identical(orig, rest)
    for a, b in zip(orig.shards, rest.shards):
        for f in (R.M_SIZE, R.M_HIGH, R.M_RNG, R.M_CURSOR, R.M_WATERMARK, R.M_NFREE):
            assert a.meta[f] == b.meta[f], R.META_FIELDS[f]
        n = int(a.meta[R.M_NFREE])
        assert (a._free[:n] == b._free[:n]).all()
        assert (a._sketch == b._sketch).all()
        k = a.items()[0]
        assert (a.lookup(k) == b.lookup(k)).all()  # same row numbers


def mutate(t, rng, step):
    ids = rng.integers(-30, 30, 40)
    tm = step * 1000
    t.gather(ids, insert=True, event_time=tm)
    t.apply_gradients(ids, rng.normal(size=(40, 3)).astype(np.float32), event_time=tm)
    t.delete(rng.integers(-30, 30, 3))
    t.expire(now=tm, max_scan=7)


@settings(max_examples=20)
@given(seed=st.integers(0, 2**32 - 1), plan=st.lists(st.booleans(), min_size=1, max_size=5))
def test_chain_roundtrip_bit_identical(seed, plan):
    rng = np.random.default_rng(seed)
    t = EmbeddingTable(CFG)
    with tempfile.TemporaryDirectory() as d:
        for i, incremental in enumerate([False] + plan):
            mutate(t, rng, i)
            save_table(t, d, incremental=incremental)
            assert_restored(t, restore_table(d, "snap"))
        # the restored table continues exactly like the original
        r = restore_table(d, "snap")
        mutate(t, np.random.default_rng(1), 99)
        mutate(r, np.random.default_rng(1), 99)
        assert_restored(t, r)


def saved(tmp_path, incrementals=1):
    t = EmbeddingTable(CFG)
    rng = np.random.default_rng(0)
    mutate(t, rng, 0)
    save_table(t, tmp_path)
    for i in range(incrementals):
        mutate(t, rng, i + 1)
        save_table(t, tmp_path, incremental=True)
    return t


def data_files(tmp_path, kind="incr"):
    return sorted(p for p in Path(tmp_path).glob(f"*.{kind}.bin"))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete_bin", "bad_json", "bad_field", "drop_parent"])
def test_corrupt_or_truncated_snapshot_refused(tmp_path, damage):
    saved(tmp_path, incrementals=2)
    target = data_files(tmp_path)[0]
    if damage == "flip":
        b = bytearray(target.read_bytes())
        b[len(b) // 2] ^= 1
        target.write_bytes(bytes(b))
    elif damage == "truncate":
        os.truncate(target, target.stat().st_size - 5)
    elif damage == "delete_bin":
        target.unlink()
    elif damage == "bad_json":
        target.with_suffix(".json").write_text("{not json")
    elif damage == "bad_field":
        m = json.loads(target.with_suffix(".json").read_text())
        m["arrays"]["emb"]["shape"] = [10**9, 3]
        target.with_suffix(".json").write_text(json.dumps(m))
    elif damage == "drop_parent":
        for p in Path(tmp_path).glob("*.s0000-of-0002.00000001.full.*"):
            p.unlink()
    with pytest.raises(SnapshotCorruptError, match="refusing") as e:
        restore_table(tmp_path, "snap")
    assert isinstance(e.value, ValueError)


def test_incremental_needs_base_and_missing_snapshot(tmp_path):
    t = EmbeddingTable(CFG)
    with pytest.raises(SnapshotError):
        save_table(t, tmp_path, incremental=True)
    with pytest.raises(SnapshotNotFoundError):
        restore_table(tmp_path, "snap")


def test_incremental_is_small_and_atomic(tmp_path):
    t = EmbeddingTable(TableConfig(name="inc", dim=16, track_updates=False))
    ids = np.arange(50_000, dtype=np.int64)
    t.gather(ids, insert=True, event_time=0)
    save_table(t, tmp_path)
    t.apply_gradients(ids[:100], np.ones((100, 16), np.float32), event_time=1)
    save_table(t, tmp_path, incremental=True)
    full, incr = data_files(tmp_path, "full")[0], data_files(tmp_path)[0]
    assert incr.stat().st_size < full.stat().st_size / 5
    assert not list(Path(tmp_path).glob("*.tmp"))
    assert_tables_identical(t, restore_table(tmp_path, "inc"))


def test_failed_write_keeps_changes_for_next_incremental(tmp_path, monkeypatch):
    import ps.snapshot as S
    t = EmbeddingTable(TableConfig(name="f", dim=2, track_updates=False))
    t.gather(np.arange(10), insert=True, event_time=0)
    save_table(t, tmp_path)
    t.apply_gradients(np.arange(3), np.ones((3, 2), np.float32), event_time=1)
    real = S._atomic_write
    monkeypatch.setattr(S, "_atomic_write", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        save_table(t, tmp_path, incremental=True)
    monkeypatch.setattr(S, "_atomic_write", real)
    save_table(t, tmp_path, incremental=True)
    assert_tables_identical(t, restore_table(tmp_path, "f"))
