"""``driftline features load --users FILE --items FILE``: your own Parquet and CSV files into Redis,
in the documented key format; files it cannot load are a one-line error naming the column."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis

from services.hashing import string_id
from serving.feature_files import main
from serving.feature_store import FeatureStore


def test_users_parquet_and_items_csv_load(redis_url: str, tmp_path: Path, capsys) -> None:
    users = tmp_path / "users.parquet"
    pq.write_table(pa.table({"uid": [1, 2], "country": ["fr", None], "tags": [["a", "b"], []],
                             "cohort": [3, 4]}), users)
    items = tmp_path / "items.csv"
    items.write_text("item_id,brand,cats,price_band,zip\n10,acme,x|y,2,02134\n11,,z,,\n")
    prefix = f"own{time.time_ns()}"
    assert main(["load", "--users", str(users), "--items", str(items), "--user-key", "uid", "--separator", "|",
                 "--strings", "zip,cohort", "--redis-url", redis_url, "--prefix", prefix]) == 0
    assert "loaded 4 feature keys" in capsys.readouterr().out

    raw = redis.Redis.from_url(redis_url)
    try:  # the documented format: <prefix>:u:<id> -> slot=id,id;slot=id (ids in decimal)
        assert raw.get(f"{prefix}:u:1").decode() == (f"country={string_id('fr')};tags={string_id('a')},"
                                                     f"{string_id('b')};cohort={string_id('3')}")
    finally:
        raw.close()

    async def fetch():
        store = FeatureStore(redis_url, prefix)
        try:
            return await store.fetch(2, [10, 11, 12])
        finally:
            await store.close()

    got = asyncio.run(fetch())
    assert got.user == {"tags": [], "cohort": [string_id("4")]}  # a null leaves the slot out
    assert got.items == [{"brand": [string_id("acme")], "cats": [string_id("x"), string_id("y")], "price_band": [2],
                          "zip": [string_id("02134")]},
                         {"cats": [string_id("z")]}, None]


@pytest.mark.parametrize(("table", "args", "needle"), [
    ({"uid": [1], "a": [1]}, [], "no key column 'user_id'"),
    ({"user_id": [1.5], "a": [1]}, [], "key column 'user_id' must hold non-negative integer ids"),
    ({"user_id": [1], "a b": [1]}, [], "column 'a b' is not a slot name"),
])
def test_bad_files_are_one_line_errors(redis_url: str, tmp_path: Path, capsys, table: dict, args: list,
                                       needle: str) -> None:
    path = tmp_path / "users.parquet"
    pq.write_table(pa.table(table), path)
    assert main(["load", "--users", str(path), "--redis-url", redis_url, *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and str(path) in err and len(err.strip().splitlines()) == 1


def test_a_source_is_required(redis_url: str, tmp_path: Path, capsys) -> None:
    assert main(["load", "--redis-url", redis_url]) == 2
    assert main(["load", "--movielens", "--users", str(tmp_path / "u.csv"), "--redis-url", redis_url]) == 2
    assert main(["load", "--users", str(tmp_path / "u.txt"), "--redis-url", redis_url]) == 2
    assert "not a .parquet, .pq or .csv file" in capsys.readouterr().err


def test_the_project_file_names_the_keys_and_the_string_features(redis_url: str, tmp_path: Path, capsys) -> None:
    """``--config driftline.toml``: the key column from ``[store]``, the columns of its
    ``ids = "string"`` features hashed as strings (digits too), string keys through string_key."""
    from services.hashing import string_key

    config = tmp_path / "driftline.toml"
    config.write_text('name = "shop"\n[store]\nitem_key = "sku"\n'
                      '[[features]]\nname = "brand"\nsource = "item"\nids = "string"\n'
                      '[[features]]\nname = "band"\nsource = "item"\n')
    items = tmp_path / "items.csv"
    items.write_text("sku,brand,band\nSKU-1,007,2\n")
    prefix = f"proj{time.time_ns()}"
    assert main(["load", "--config", str(config), "--items", str(items), "--redis-url", redis_url,
                 "--prefix", prefix]) == 0
    raw = redis.Redis.from_url(redis_url)
    try:
        assert raw.get(f"{prefix}:i:{string_key('SKU-1')}").decode() == f"brand={string_id('007')};band=2"
    finally:
        raw.close()
    config.write_text('name = "shop"\n[store]\nitem_key = "sku"\n'
                      '[[features]]\nname = "brand"\nsource = "item"\nkind = "dense"\n')
    items.write_text("sku,brand\nSKU-1,acme\n")
    assert main(["load", "--config", str(config), "--items", str(items), "--redis-url", redis_url]) == 2
    assert "column 'brand' is string: a dense feature takes numbers" in capsys.readouterr().err


def test_the_project_files_load_when_the_command_names_none(redis_url: str, tmp_path: Path, capsys) -> None:
    """``[store] items_file`` (relative to the project file): what ``features load --config`` loads
    without ``--items`` (``up --config`` keeps it loaded); a file on the command line wins."""
    from services.hashing import string_key

    (tmp_path / "data").mkdir()
    config = tmp_path / "driftline.toml"
    config.write_text('name = "shop"\n[store]\nitem_key = "sku"\nitems_file = "data/items.csv"\n'
                      '[[features]]\nname = "band"\nsource = "item"\n')
    (tmp_path / "data" / "items.csv").write_text("sku,band\nSKU-1,2\n")
    other = tmp_path / "other.csv"
    other.write_text("sku,band\nSKU-1,5\n")
    prefix = f"projfiles{time.time_ns()}"
    raw = redis.Redis.from_url(redis_url)
    try:
        assert main(["load", "--config", str(config), "--redis-url", redis_url, "--prefix", prefix]) == 0
        assert raw.get(f"{prefix}:i:{string_key('SKU-1')}").decode() == "band=2"
        assert "data/items.csv" in capsys.readouterr().out
        assert main(["load", "--config", str(config), "--items", str(other), "--redis-url", redis_url,
                     "--prefix", prefix]) == 0
        assert raw.get(f"{prefix}:i:{string_key('SKU-1')}").decode() == "band=5"
    finally:
        raw.close()


def test_only_declared_sparse_features_load_and_the_rest_is_named(redis_url: str, tmp_path: Path, capsys) -> None:
    """A users file with more columns than the project declares: the declared sparse features
    load, every other column is skipped and named with the reason (a float column too); without a
    project file, float columns are skipped and the rest loads. A declared sparse feature whose
    column holds floats is refused: the file and the declaration disagree."""
    users = tmp_path / "users.parquet"
    pq.write_table(pa.table({"user_id": [1], "segment": ["pros"], "spend": [12.5], "visits": [7]}), users)
    config = tmp_path / "driftline.toml"
    config.write_text('name = "shop"\n[[features]]\nname = "segment"\nsource = "user"\nids = "string"\n')
    prefix = f"decl{time.time_ns()}"
    raw = redis.Redis.from_url(redis_url)
    try:
        assert main(["load", "--config", str(config), "--users", str(users), "--redis-url", redis_url,
                     "--prefix", prefix]) == 0
        out = capsys.readouterr().out
        assert f"skipped {users} column 'spend': not a declared feature of this file's source" in out, out
        assert f"skipped {users} column 'visits': not a declared feature of this file's source" in out, out
        assert raw.get(f"{prefix}:u:1").decode() == f"segment={string_id('pros')}"
        assert main(["load", "--users", str(users), "--redis-url", redis_url, "--prefix", prefix]) == 0
        out = capsys.readouterr().out
        assert f"skipped {users} column 'spend': double" in out and "visits" not in out, out
        assert raw.get(f"{prefix}:u:1").decode() == f"segment={string_id('pros')};visits=7"
    finally:
        raw.close()
    config.write_text('name = "shop"\n[[features]]\nname = "spend"\nsource = "user"\n')
    assert main(["load", "--config", str(config), "--users", str(users), "--redis-url", redis_url]) == 2
    assert "column 'spend' is double" in capsys.readouterr().err
    # declared dense: the store holds the number beside the ids (and visits, an int column, as a float)
    config.write_text('name = "shop"\n[[features]]\nname = "segment"\nsource = "user"\nids = "string"\n'
                      '[[features]]\nname = "spend"\nsource = "user"\nkind = "dense"\n'
                      '[[features]]\nname = "visits"\nsource = "user"\nkind = "dense"\n')
    raw = redis.Redis.from_url(redis_url)
    try:
        assert main(["load", "--config", str(config), "--users", str(users), "--redis-url", redis_url,
                     "--prefix", prefix]) == 0
        assert "skipped" not in capsys.readouterr().out
        assert raw.get(f"{prefix}:u:1").decode() == f"segment={string_id('pros')};spend:12.5;visits:7.0"
    finally:
        raw.close()
