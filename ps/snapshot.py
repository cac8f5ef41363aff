"""Atomic, checksummed full and incremental snapshots of table shards.

Each shard writes its own pair of files, so shards in different processes snapshot
independently::

    <root>/<table>.s0003-of-0008.00000007.incr.bin    raw arrays, 64-byte aligned
    <root>/<table>.s0003-of-0008.00000007.incr.json   manifest: config, arrays, sha256

Both are written to a temp file, fsync'ed and renamed; the manifest goes last, so a
snapshot exists only once it is complete. A *full* snapshot holds every live row;
an *incremental* one holds the rows changed since the shard's previous snapshot plus
the list of all live row numbers (so deletions and expiries replay exactly).
Restoring follows ``parent_seq`` links back to a full snapshot, verifies every file
(size, sha256, manifest fields) and only then builds the shard, so a truncated or
corrupt link raises :class:`ps.errors.SnapshotCorruptError` and nothing is loaded.

Restored state is bit-identical for: keys and their row numbers, values, optimizer
state, last-update times, the free-row list, the admission sketch counters and RNG
draw counter, the expiry cursor and the event-time watermark. The touched-key stream
is *not* saved: a restored table starts with nothing pending (rows that were pending
tombstones become free), so replicas should bootstrap from the same snapshot.

>>> import tempfile
>>> from ps import EmbeddingTable, TableConfig
>>> t = EmbeddingTable(TableConfig(name="item", dim=4, shards=2))
>>> _ = t.gather(np.arange(100), insert=True, event_time=1)
>>> with tempfile.TemporaryDirectory() as d:
...     _ = save_table(t, d)
...     _ = t.delete(np.arange(50))
...     _ = save_table(t, d, incremental=True)
...     r = restore_table(d, "item")
>>> len(r), bool((r.items()[1] == t.items()[1]).all())
(50, True)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np

from . import rows as R
from .config import TableConfig
from .errors import SnapshotCorruptError, SnapshotError, SnapshotNotFoundError
from .hashmap import empty_slots
from .shard import TableShard
from .table import EmbeddingTable

FORMAT = "driftline-ps-snapshot"
VERSION = 1
_ALIGN = 64
#: a directory given by the caller
StrPath: TypeAlias = str | os.PathLike[str]
#: a parsed manifest: JSON, so its values' types are checked where they are read, not here
Manifest: TypeAlias = dict[str, Any]

_NAME = re.compile(r"^(?P<table>.+)\.s(?P<shard>\d{4})-of-(?P<n>\d{4})\.(?P<seq>\d{8})\.(?P<kind>full|incr)\.json$")


def _stem(table: str, shard: int, n: int, seq: int, kind: str) -> str:
    return f"{table}.s{shard:04d}-of-{n:04d}.{seq:08d}.{kind}"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, chunks: Iterable[bytes | memoryview]) -> tuple[int, str]:
    """Write byte chunks to ``path`` via temp file + fsync + rename; returns (size, sha256)."""
    h = hashlib.sha256()
    size = 0
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for c in chunks:
                mv = memoryview(c).cast("B")
                h.update(mv)
                f.write(mv)
                size += mv.nbytes
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return size, h.hexdigest()


# ---------------------------------------------------------------------- export
def _export(shard: TableShard, incremental: bool) -> tuple[dict[str, np.ndarray], dict[str, int], np.ndarray]:
    """Copy what a snapshot needs out of ``shard`` (caller holds the lock)."""
    m = shard.meta
    high = int(m[R.M_HIGH])
    flags = shard._flags[:high]
    live = np.flatnonzero(flags & R.LIVE)
    rows = np.flatnonzero((flags & (R.LIVE | R.SNAP)) == (R.LIVE | R.SNAP)) if incremental else live
    dead = np.flatnonzero(flags & R.DEAD)
    arrays = {
        "rows": rows, "keys": shard._row_keys[rows], "emb": shard._emb[rows],
        "state": shard._state[rows], "times": shard._times[rows],
        "live_rows": live if incremental else np.empty(0, np.int64),
        "free": np.concatenate([shard._free[: int(m[R.M_NFREE])], dead]),
        "sketch": shard._sketch.copy(),
    }
    meta = {"high": high, "rng": int(m[R.M_RNG]), "cursor": int(m[R.M_CURSOR]),
            "watermark": int(m[R.M_WATERMARK]), "size": int(live.size)}
    return arrays, meta, rows


def save_shard(shard: TableShard, root: StrPath, incremental: bool = False) -> Path:
    """Snapshot one shard into directory ``root``; returns the manifest path.

    An incremental snapshot needs an earlier snapshot of this shard object in the same
    ``root`` (written or restored), else :class:`SnapshotError`.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    cfg = shard.config
    with shard.lock:
        parent = getattr(shard, "_snap_parent", None)
        if incremental and (parent is None or parent[0] != root.resolve()):
            raise SnapshotError(f"{cfg.name}[{shard.shard_index}]: incremental snapshot needs a previous "
                                f"snapshot of this shard in {root}")
        seq = (parent[1] if parent is not None and parent[0] == root.resolve() else 0) + 1
        arrays, meta, rows = _export(shard, incremental)
        # changes from here on belong to the next snapshot; re-marked below if writing fails
        shard._flags[rows] &= np.uint8(0xFF ^ R.SNAP)
    kind = "incr" if incremental else "full"
    stem = _stem(cfg.name, shard.shard_index, cfg.shards, seq, kind)
    try:
        layout: dict[str, dict[str, Any]] = {}
        chunks: list[bytes | memoryview] = []
        off = 0
        for name, a in arrays.items():
            a = np.ascontiguousarray(a)
            pad = (-off) % _ALIGN
            if pad:
                chunks.append(bytes(pad))
                off += pad
            layout[name] = {"dtype": a.dtype.str, "shape": list(a.shape), "offset": off, "nbytes": a.nbytes}
            if a.nbytes:
                chunks.append(a.reshape(-1).view(np.uint8).data)
            off += a.nbytes
        size, digest = _atomic_write(root / (stem + ".bin"), chunks)
        manifest = {
            "format": FORMAT, "version": VERSION, "table": cfg.name, "shard": shard.shard_index,
            "num_shards": cfg.shards, "seq": seq, "kind": kind,
            "parent_seq": parent[1] if incremental and parent is not None else None,
            "config": json.loads(cfg.model_dump_json()), "meta": meta, "data_file": stem + ".bin",
            "data_bytes": size, "sha256": digest, "arrays": layout, "rows": int(rows.size),
            "created_unix": time.time(),
        }
        _atomic_write(root / (stem + ".json"), [json.dumps(manifest, indent=1).encode()])
        _fsync_dir(root)
    except BaseException:
        with shard.lock:
            keep = rows[(shard._flags[rows] & R.LIVE) != 0] if rows.size else rows
            shard._flags[keep] |= np.uint8(R.SNAP)
        raise
    with shard.lock:
        shard._snap_parent = (root.resolve(), seq)
    return root / (stem + ".json")


# ---------------------------------------------------------------------- reading
def _corrupt(path: StrPath, why: str) -> SnapshotCorruptError:
    return SnapshotCorruptError(f"snapshot {path}: {why}; refusing to load it")


def read_snapshot(manifest_path: StrPath) -> tuple[Manifest, dict[str, np.ndarray]]:
    """Verify and read one snapshot: ``(manifest, arrays)``. Raises SnapshotCorruptError."""
    mp = Path(manifest_path)
    try:
        man = json.loads(mp.read_bytes())
    except FileNotFoundError:
        raise SnapshotNotFoundError(f"snapshot manifest {mp} does not exist") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise _corrupt(mp, f"manifest is not valid JSON ({e})") from None
    try:
        if man["format"] != FORMAT or man["version"] != VERSION:
            raise _corrupt(mp, f"unknown format {man.get('format')!r} v{man.get('version')}")
        data_path = mp.parent / man["data_file"]
        expected, digest, layout = int(man["data_bytes"]), str(man["sha256"]), dict(man["arrays"])
        kind, seq = man["kind"], int(man["seq"])
        TableConfig.model_validate(man["config"])
        {k: int(man["meta"][k]) for k in ("high", "rng", "cursor", "watermark", "size")}
    except SnapshotCorruptError:
        raise
    except Exception as e:  # noqa: BLE001 - missing or mistyped fields: a corrupt snapshot, named
        raise _corrupt(mp, f"manifest is malformed ({type(e).__name__}: {e})") from None
    if kind not in ("full", "incr") or seq < 1:
        raise _corrupt(mp, "bad kind/seq")
    try:
        actual = data_path.stat().st_size
    except FileNotFoundError:
        raise _corrupt(mp, f"data file {data_path.name} is missing") from None
    if actual != expected:
        raise _corrupt(mp, f"data file has {actual} bytes, manifest says {expected} (truncated?)")
    buf = np.empty(expected, np.uint8)
    with open(data_path, "rb") as f:
        if f.readinto(buf.data) != expected:
            raise _corrupt(mp, "short read")
    if hashlib.sha256(buf.data).hexdigest() != digest:
        raise _corrupt(mp, "sha256 mismatch")
    arrays: dict[str, np.ndarray] = {}
    try:
        for name, spec in layout.items():
            dt = np.dtype(spec["dtype"])
            shape = tuple(int(x) for x in spec["shape"])
            off, nb = int(spec["offset"]), int(spec["nbytes"])
            if off < 0 or off + nb > expected or nb != dt.itemsize * int(np.prod(shape, dtype=np.int64)):
                raise ValueError(f"array {name} out of bounds")
            arrays[name] = buf[off:off + nb].view(dt).reshape(shape)
    except (TypeError, ValueError, KeyError) as e:
        raise _corrupt(mp, f"array layout is invalid ({e})") from None
    return man, arrays


def list_snapshots(root: StrPath, table: str, shard: int, num_shards: int) -> dict[int, Path]:
    """``seq -> manifest path`` of every committed snapshot of one shard in ``root``."""
    out: dict[int, Path] = {}
    root = Path(root)
    if not root.is_dir():
        return out
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and m["table"] == table and int(m["shard"]) == shard and int(m["n"]) == num_shards:
            out[int(m["seq"])] = p
    return out


def _chain(root: StrPath, table: str, shard: int, num_shards: int,
           seq: int | None) -> list[tuple[Manifest, dict[str, np.ndarray]]]:
    snaps = list_snapshots(root, table, shard, num_shards)
    if not snaps:
        raise SnapshotNotFoundError(f"no snapshot of {table} shard {shard}/{num_shards} in {root}")
    seq = max(snaps) if seq is None else seq
    chain = []
    while True:
        if seq not in snaps:
            raise _corrupt(root, f"{table} shard {shard}: snapshot seq {seq} of the chain is missing")
        man, arrays = read_snapshot(snaps[seq])
        if man["table"] != table or man["shard"] != shard or man["num_shards"] != num_shards or man["seq"] != seq:
            raise _corrupt(snaps[seq], "manifest does not match its file name")
        chain.append((man, arrays))
        if man["kind"] == "full":
            break
        if man["parent_seq"] is None or int(man["parent_seq"]) >= seq:
            raise _corrupt(snaps[seq], "incremental snapshot has no valid parent")
        seq = int(man["parent_seq"])
    return chain[::-1]


def _check_rows(man: Manifest, a: dict[str, np.ndarray], high: int, cap_rows: int) -> None:
    r = a["rows"]
    n = r.size
    shapes_ok = (a["keys"].shape == (n,) and a["times"].shape == (n,) and a["emb"].shape[0] == n
                 and a["state"].shape[0] == n)

    def out_of_range(x: np.ndarray) -> int | np.bool_:  # 0 for an empty array
        return x.size and (x.min() < 0 or x.max() >= high)
    if (not shapes_ok or out_of_range(r) or out_of_range(a["live_rows"]) or out_of_range(a["free"])
            or high > cap_rows):
        raise _corrupt(man["data_file"], "row arrays are inconsistent")


def load_shard(root: StrPath, table: str, shard: int = 0, num_shards: int = 1, seq: int | None = None,
               config: TableConfig | None = None) -> TableShard:
    """Restore one shard from its newest (or ``seq``) snapshot chain in ``root``."""
    chain = _chain(root, table, shard, num_shards, seq)
    saved_cfg = TableConfig.model_validate(chain[-1][0]["config"])
    cfg = config or saved_cfg
    if (cfg.dim, cfg.slot_width, cfg.shards) != (saved_cfg.dim, saved_cfg.slot_width, saved_cfg.shards):
        raise SnapshotError(f"{table}: snapshot has dim/optimizer/shards {saved_cfg.dim}/"
                            f"{saved_cfg.optimizer}/{saved_cfg.shards}, config asks otherwise")
    last = chain[-1]
    high = int(last[0]["meta"]["high"])
    s = TableShard(cfg, shard, capacity=max(high, 16))
    width = s._state.shape[1]
    for man, a in chain:
        h = int(man["meta"]["high"])
        _check_rows(man, a, h, s._rows_cap)
        if a["emb"].shape[1:] != (cfg.dim,) or a["state"].shape[1:] != (width,):
            raise _corrupt(man["data_file"], "row width does not match the table config")
    # everything verified: only now build state
    flags = np.zeros(s._rows_cap, np.uint8)
    for man, a in chain:
        r = a["rows"]
        s._row_keys[r] = a["keys"]
        s._emb[r] = a["emb"]
        s._state[r] = a["state"]
        s._times[r] = a["times"]
        if man["kind"] == "full":
            flags[r] = R.LIVE
        else:
            flags[:] = 0
            flags[a["live_rows"]] = R.LIVE
    s._flags[:] = flags
    free = a["free"]
    m = last[0]["meta"]
    s.meta[R.M_HIGH], s.meta[R.M_RNG] = high, m["rng"]
    s.meta[R.M_CURSOR], s.meta[R.M_WATERMARK] = m["cursor"], m["watermark"]
    s.meta[R.M_NFREE] = free.size
    s._free[: free.size] = free
    if a["sketch"].shape == s._sketch.shape:
        s._sketch[:] = a["sketch"]
    else:
        raise _corrupt(last[0]["data_file"], "admission sketch shape does not match the config")
    s._slots = empty_slots(int(m["size"]))
    n = R.rebuild_index(s._slots, s._slots.shape[0] - 1, s._row_keys, s._flags, high)
    if n != int(m["size"]):
        raise _corrupt(last[0]["data_file"], f"{n} live rows, manifest says {m['size']} (duplicate keys?)")
    s.meta[R.M_SIZE] = n
    s._snap_parent = (Path(root).resolve(), int(last[0]["seq"]))
    return s


def save_table(table: EmbeddingTable, root: StrPath, incremental: bool = False) -> list[Path]:
    """Snapshot every shard of ``table`` (each one independently); returns manifest paths."""
    return [save_shard(s, root, incremental) for s in table.shards]


def restore_table(root: StrPath, table: str | TableConfig) -> EmbeddingTable:
    """Rebuild a table from the newest snapshot chains of all its shards in ``root``.

    Every shard is verified before the table is returned; any corruption raises.
    """
    cfg = table if isinstance(table, TableConfig) else None
    name = table.name if isinstance(table, TableConfig) else table
    if cfg is None:
        found = [p for p in Path(root).glob(f"{glob_escape(name)}.s0000-of-*.json") if _NAME.match(p.name)]
        if not found:
            raise SnapshotNotFoundError(f"no snapshot of table {name!r} in {root}")
        first = _NAME.match(found[0].name)
        assert first is not None  # found holds matching names only
        num = int(first["n"])
    else:
        num = cfg.shards
    shards = [load_shard(root, name, i, num, config=cfg) for i in range(num)]
    return EmbeddingTable(cfg or shards[0].config, shards)


def glob_escape(s: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", s)
