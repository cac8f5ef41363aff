"""User and item features from your own Parquet or CSV files, for the feature store.

``driftline features load --users users.parquet --items items.csv`` (``--user-key`` and
``--item-key`` name the key columns, ``user_id`` and ``item_id`` by default). Each file has one row
per user (item): the key column holds the non-negative integer id ``/rank`` names it by (or strings,
turned into those ids by :func:`services.hashing.string_key`: list the column in ``--strings``
for a CSV of digits), and every other column is one sparse slot of that name:

* an integer column gives one id per row;
* a string column one id per row, hashed with :func:`services.hashing.string_id`;
* a list column (Parquet ``list<int>`` or ``list<string>``) a bag of ids; with ``--separator``,
  strings are split into bags first (a CSV cell ``a|b|c``);
* a null (an empty CSV cell) leaves the slot out for that row.

A CSV column of digits reads as integers (ids as they are): name it in ``--strings`` to have its
values hashed as the strings they are (a zip code ``02134`` stays ``"02134"``), as a client that
hashes them must.

With a project file (``--config``) only the file's declared features are loaded (a users file's
``source = "user"`` ones, an items file's ``source = "item"``): its sparse features as slots, its
dense ones (``kind = "dense"``: a price, a click rate) as numbers; every other column is skipped
and named, with the reason, in the command's output. Without one, every column is a slot, except
float and boolean ones, which are skipped and named (declare them dense in a project file to load
them). A declared sparse feature whose column holds floats is refused (the file and the
declaration disagree). Column names must be slot names (letters, digits, ``_.-``). The rows are
written as :mod:`serving.feature_store` lays them out (``<prefix>:u:<user_id>`` and
``<prefix>:i:<item_id>``, each ``slot=id,id;slot=id;name:value``), replacing what a key held.

>>> import pyarrow as pa
>>> t = pa.table({"id": [1, 2], "genre": ["a|b", None], "year": [1990, 2001]})
>>> rows = table_slots(t, "id", separator="|")
>>> rows[2]
{'year': [2001]}
>>> rows[1]["genre"] == string_ids(["a", "b"]), rows[1]["year"]
(True, [1990])
>>> list(table_slots(pa.table({"sku": ["A-1"], "year": [1]}), "sku")) == [string_key("A-1")]
True
>>> skipped = {}
>>> table_slots(pa.table({"id": [1], "price": [9.5], "year": [2001], "note": ["x"]}), "id", declared=["year"],
...             skipped=skipped)
{1: {'year': [2001]}}
>>> skipped
{'price': "not a declared feature of this file's source", 'note': "not a declared feature of this file's source"}
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.types as pat

from services.cli_args import run_main
from services.hashing import string_id, string_ids, string_key
from services.redis_client import redacted, without_password
from serving.feature_keeper import Load
from serving.feature_store import FeatureStore, FeatureStoreError

if TYPE_CHECKING:
    from services.settings import Settings

Slots = dict[str, list[int]]
_SLOT = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


class FeatureFileError(ValueError):
    """A features file that cannot be loaded; the message names the file and the column."""


def read_table(path: Path, strings: Sequence[str] = ()) -> pa.Table:
    """A Parquet (``.parquet``, ``.pq``) or CSV (``.csv``) file as an Arrow table; the columns in
    ``strings`` (those the file has) as strings."""
    suffix = path.suffix.lower()
    try:
        if suffix in (".parquet", ".pq"):
            import pyarrow.parquet as pq

            table = pq.read_table(path)
            for name in strings:
                if name in table.column_names:
                    i = table.column_names.index(name)
                    table = table.set_column(i, name, table.column(i).cast(pa.string()))
            return table
        if suffix == ".csv":
            import pyarrow.csv as pcsv

            # an empty cell is a missing value (as in a numeric column), not the string ""
            types = {name: pa.string() for name in strings}  # (names the file lacks are ignored)
            return pcsv.read_csv(path, convert_options=pcsv.ConvertOptions(strings_can_be_null=True,
                                                                           column_types=types))
    except (OSError, pa.ArrowException) as err:
        raise FeatureFileError(str(err)) from None
    raise FeatureFileError("not a .parquet, .pq or .csv file")


def _column_ids(name: str, column: pa.ChunkedArray, separator: str | None) -> list[list[int] | None]:
    kind = column.type
    values = column.to_pylist()
    if pat.is_integer(kind):
        return [None if v is None else [v] for v in values]
    if pat.is_string(kind) or pat.is_large_string(kind):
        if separator is None:
            return [None if v is None else [string_id(v)] for v in values]
        return [None if v is None else string_ids(p for p in v.split(separator) if p) for v in values]
    if pat.is_list(kind) or pat.is_large_list(kind):
        inner = kind.value_type
        if pat.is_integer(inner):
            return [None if v is None else [i for i in v if i is not None] for v in values]
        if pat.is_string(inner) or pat.is_large_string(inner):
            return [None if v is None else string_ids(s for s in v if s is not None) for v in values]
    raise FeatureFileError(f"column {name!r} is {kind}: a sparse slot takes integers, strings or lists of "
                           "them (declare the feature kind = \"dense\" to load numbers)")


def _loaded_columns(table: pa.Table, key: str, declared: Sequence[str] | None,
                    skipped: dict[str, str], dense: Sequence[str] = ()) -> list[str]:
    """The columns to load as slots; the others but the ``dense`` ones go into ``skipped`` with
    the reason."""
    names = []
    for name in (c for c in table.column_names if c != key and c not in dense):
        kind = table.column(name).type
        if declared is not None and name not in declared:
            skipped[name] = "not a declared feature of this file's source"
        elif declared is None and (pat.is_floating(kind) or pat.is_boolean(kind)):
            skipped[name] = (f"{kind}: a sparse slot takes integers, strings or lists of them (a project file "
                             "that declares it kind = \"dense\" loads it as a number)")
        else:
            names.append(name)
    return names


def table_slots(table: pa.Table, key: str, separator: str | None = None, declared: Sequence[str] | None = None,
                skipped: dict[str, str] | None = None, dense: Sequence[str] = ()) -> dict[int, Slots]:
    """``{key: {slot: ids}}`` of a table: one slot per column but the key, or per ``declared``
    column (the others, and without ``declared`` the float and boolean ones, are left out and
    named in ``skipped``; the ``dense`` ones are left out: :func:`table_dense` reads them)."""
    names = _loaded_columns(table, key, declared, {} if skipped is None else skipped, dense)
    for name in names:
        if not _SLOT.match(name):
            raise FeatureFileError(f"column {name!r} is not a slot name (letters, digits, '_', '.', '-')")
    keys = _keys(table, key)
    ids = {name: _column_ids(name, table.column(name), separator) for name in names}
    out: dict[int, Slots] = {}
    for row, k in enumerate(keys):
        out[k] = {name: col[row] for name, col in ids.items() if col[row] is not None}  # type: ignore[misc]
    return out


def table_dense(table: pa.Table, key: str, dense: Sequence[str]) -> dict[int, dict[str, float]]:
    """``{key: {name: value}}`` of the table's ``dense`` columns (those it has): numbers (a null
    leaves the value out for that row); a column of anything else, or a value that is not a finite
    float32, is refused.

    >>> table_dense(pa.table({"id": [1, 2], "price": [9.5, None], "n": [3, 4]}), "id", ["price", "n", "ctr"])
    {1: {'price': 9.5, 'n': 3.0}, 2: {'n': 4.0}}
    """
    names = [n for n in dense if n in table.column_names]
    if not names:
        return {}
    keys = _keys(table, key)
    values = {}
    for name in names:
        col = table.column(name)
        if not (pat.is_integer(col.type) or pat.is_floating(col.type) or pat.is_boolean(col.type)
                or pat.is_decimal(col.type)):
            raise FeatureFileError(f"column {name!r} is {col.type}: a dense feature takes numbers")
        floats = pc.cast(col, pa.float64()).to_pylist()
        bad = next((v for v in floats if v is not None and not (abs(v) <= _FLOAT32_MAX)), None)
        if bad is not None:
            raise FeatureFileError(f"column {name!r} holds {bad!r}: a dense value is a finite float32")
        values[name] = floats
    out: dict[int, dict[str, float]] = {}
    for row, k in enumerate(keys):
        row_values = {name: col[row] for name, col in values.items() if col[row] is not None}
        if row_values:
            out[k] = row_values
    return out


_FLOAT32_MAX = 3.4028234663852886e38


def _keys(table: pa.Table, key: str) -> list[int]:
    """The key column's ids (strings through :func:`services.hashing.string_key`)."""
    if key not in table.column_names:
        raise FeatureFileError(f"no key column {key!r} (columns: {', '.join(table.column_names)})")
    keys = table.column(key)
    if pat.is_string(keys.type) or pat.is_large_string(keys.type):  # string ids: /rank names them by string_key
        if keys.null_count:
            raise FeatureFileError(f"key column {key!r} has nulls")
        keys = pa.array([string_key(k) for k in keys.to_pylist()], pa.int64())
    if not pat.is_integer(keys.type) or keys.null_count or (len(keys) and pc.min(keys).as_py() < 0):
        raise FeatureFileError(f"key column {key!r} must hold non-negative integer ids without nulls "
                               f"(it is {keys.type}): the ids /rank names users and items by")
    return keys.to_pylist()


def file_rows(path: Path, key: str, separator: str | None = None, strings: Sequence[str] = (),
              declared: Sequence[str] | None = None, skipped: dict[str, str] | None = None,
              dense: Sequence[str] = ()) -> tuple[dict[int, Slots], dict[int, dict[str, float]]]:
    """A file's slots (:func:`table_slots`) and dense values (:func:`table_dense`) per key."""
    try:
        table = read_table(path, list(strings))
        return table_slots(table, key, separator, declared, skipped, dense), table_dense(table, key, dense)
    except FeatureFileError as err:
        raise FeatureFileError(f"{path}: {err}") from None


async def load_files(url: str, prefix: str, users: Path | None, items: Path | None, *, user_key: str = "user_id",
                     item_key: str = "item_id", separator: str | None = None, strings: Sequence[str] = (),
                     user_features: Sequence[str] | None = None, item_features: Sequence[str] | None = None,
                     user_dense: Sequence[str] = (), item_dense: Sequence[str] = (),
                     skipped: dict[str, dict[str, str]] | None = None) -> tuple[int, float]:
    """Fill the store from a users file and/or an items file; return (keys written, seconds).
    ``user_features`` / ``item_features``: the declared sparse features to load (None: every
    id column); ``user_dense`` / ``item_dense``: the declared dense ones; ``skipped`` gets
    ``{file: {column: reason}}``. Both files are read and checked before anything is written."""
    started = time.perf_counter()
    skipped = {} if skipped is None else skipped
    user_rows = item_rows = {}
    users_dense = items_dense = {}
    if users is not None:
        user_rows, users_dense = file_rows(users, user_key, separator, strings, user_features,
                                           skipped.setdefault(str(users), {}), user_dense)
    if items is not None:
        item_rows, items_dense = file_rows(items, item_key, separator, strings, item_features,
                                           skipped.setdefault(str(items), {}), item_dense)
    store = FeatureStore(url, prefix, timeout_s=30.0)
    try:
        n = await store.put(user_rows, item_rows, users_dense=users_dense, items_dense=items_dense)
    finally:
        await store.close()
    return n, time.perf_counter() - started


async def load_dataset(url: str, dataset: str, data_dir: Path, prefix: str = "driftline",
                       content: bool = False) -> tuple[int, float]:
    """Fill the store with a MovieLens dataset's user and item features; return (keys, seconds).
    ``content``: each item's content tokens too, as :data:`movielens.features.ITEM_CONTENT` (a
    content encoder's input, trainer/content.py: what serving scores and logs it from)."""
    from movielens.data import load
    from movielens.features import ITEM_CONTENT, MovieLensFeatures

    started = time.perf_counter()
    ml = load(dataset, data_dir)
    feats = MovieLensFeatures(ml.users, ml.items)
    items = {i: feats.item_slots(i) for i in feats.item_ids}
    if content:
        items = {i: {**slots, ITEM_CONTENT: feats.item_content(i)} for i, slots in items.items()}
    store = FeatureStore(url, prefix, timeout_s=30.0)
    try:
        n = await store.put({u: feats.user_slots(u) for u in feats.user_ids}, items)
    finally:
        await store.close()
    return n, time.perf_counter() - started


def _apply_project(args: argparse.Namespace) -> None:
    """Fill the flags the command line left out from the project file's ``[store]`` and features."""
    if args.config is not None:
        from driftline.project import load_project  # the project layer, lazily

        project = load_project(args.config)
        store = project.store
        args.user_key = args.user_key or store.user_key
        args.item_key = args.item_key or store.item_key
        args.separator = args.separator or store.separator
        hashed = [f.name for f in project.features if f.hashed and f.source in ("user", "item")]
        args.strings = ",".join([c for c in args.strings.split(",") if c] + hashed)
        args.declared = {source: [f.name for f in project.features if f.source == source and f.kind == "sparse"]
                         for source in ("user", "item")}
        args.dense = {source: [f.name for f in project.features if f.source == source and f.kind == "dense"]
                      for source in ("user", "item")}
        if args.users is None and args.items is None and not args.movielens:
            args.users, args.items = project.feature_files
    args.user_key, args.item_key = args.user_key or "user_id", args.item_key or "item_id"


def _load(args: argparse.Namespace, skipped: dict[str, dict[str, str]]) -> tuple[str, Load]:
    """What the command line asks to load, and the load itself (run once, or by the watch each time
    the store loses it: it reads the files again)."""
    if args.movielens:
        from movielens.features import ITEM_CONTENT

        # the items' content when the project declares it (an item feature the model's encoder reads)
        content = ITEM_CONTENT in args.declared.get("item", ())
        return args.dataset, lambda: load_dataset(args.redis_url, args.dataset, args.data_dir, args.prefix, content)
    declared = args.declared
    return " and ".join(str(p) for p in (args.users, args.items) if p is not None), lambda: load_files(
        args.redis_url, args.prefix, args.users, args.items, user_key=args.user_key, item_key=args.item_key,
        separator=args.separator, strings=[c for c in args.strings.split(",") if c],
        user_features=declared.get("user"), item_features=declared.get("item"),
        user_dense=args.dense.get("user", ()), item_dense=args.dense.get("item", ()), skipped=skipped)


def _watch(args: argparse.Namespace, load: Load, settings: Settings) -> int:
    """``--watch``: keep the store loaded until stopped (:mod:`serving.feature_keeper`)."""
    from services.log import setup_logging
    from services.metrics import serve_metrics
    from serving.feature_keeper import FeatureKeeper

    setup_logging("feature-keeper", settings.log_level)
    if settings.metrics_port:
        serve_metrics(settings.metrics_port)

    async def keep() -> None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        store = FeatureStore(args.redis_url, args.prefix, timeout_s=5.0)
        try:
            await FeatureKeeper(store, load, settings.serving.feature_store_check_s).run(stop)
        finally:
            await store.close()

    asyncio.run(keep())
    return 0


def main(argv: list[str] | None = None) -> int:
    from services.settings import get_settings

    settings = get_settings()
    parser = argparse.ArgumentParser(prog="driftline features",
                                     description="The online feature store in Redis: fill it with user and item features.")
    sub = parser.add_subparsers(dest="command", required=True)
    p_load = sub.add_parser("load", help="fill the store from your users/items files, or from MovieLens (the demo)",
                            description="Fill the store from --users/--items files (Parquet or CSV: see "
                                        "serving/feature_files.py) or, with --movielens, from a MovieLens dataset.")
    p_load.add_argument("--users", type=Path, help="users file (.parquet, .pq or .csv): one row per user")
    p_load.add_argument("--items", type=Path, help="items file (.parquet, .pq or .csv): one row per item")
    p_load.add_argument("--config", type=Path, default=settings.project,
                        help="a project file (driftline.toml): its [store] key columns and separator, its files "
                             "when --users/--items are not given, and its string features hashed as strings "
                             "(default: $DRIFTLINE_PROJECT)")
    p_load.add_argument("--user-key", default=None, help="the users file's id column (default user_id)")
    p_load.add_argument("--item-key", default=None, help="the items file's id column (default item_id)")
    p_load.add_argument("--separator", help="split string cells on this into bags of ids (e.g. '|')")
    p_load.add_argument("--strings", default="", help="comma-separated columns hashed as strings even where "
                                                     "they look like numbers (zip codes)")
    p_load.add_argument("--movielens", action="store_true", help="load the MovieLens demo's features instead")
    p_load.add_argument("--dataset", default=settings.replay.dataset, choices=["ml-1m", "ml-100k"])
    p_load.add_argument("--data-dir", type=Path, default=settings.data_dir)
    p_load.add_argument("--redis-url", default=settings.redis)
    p_load.add_argument("--prefix", default=settings.serving.redis_prefix)
    p_load.add_argument("--watch", action="store_true",
                        help="keep the store loaded: stay running, and load again whenever Redis has lost the "
                             "features (restarted without them, or flushed), this start included "
                             "(serving/feature_keeper.py)")
    p_load.set_defaults(declared={}, dense={})  # source -> its declared sparse / dense features (a project file's)
    args = parser.parse_args(argv)
    try:
        _apply_project(args)
    except ValueError as err:
        print(f"driftline features load: {err}", file=sys.stderr)
        return 2
    files = args.users is not None or args.items is not None
    if files == args.movielens:
        print("driftline features load: give --users FILE and/or --items FILE (or a project file whose [store] "
              "names them), or --movielens (the demo), not both", file=sys.stderr)
        return 2
    skipped: dict[str, dict[str, str]] = {}
    source, load = _load(args, skipped)
    if args.watch:
        return _watch(args, load, settings)
    try:
        n, seconds = asyncio.run(load())
    except FeatureFileError as err:
        print(f"driftline features load: {err}", file=sys.stderr)
        return 2
    except FeatureStoreError as err:
        print(f"driftline features load: {without_password(str(err), args.redis_url)}; run `make up`, or set "
              "REDIS_URL (redis://user:password@host:port/0) and DRIFTLINE_REDIS_CLIENT__*", file=sys.stderr)
        return 1
    print(f"loaded {n} feature keys from {source} into {redacted(args.redis_url)} in {seconds:.2f}s")
    for path, columns in skipped.items():
        for column, reason in columns.items():
            print(f"skipped {path} column {column!r}: {reason}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main, "python -m serving.feature_files"))
