"""Atomic snapshots of a model: all PS tables with optimizer state, dense params + optimizer,
consumer offsets and sync versions, under ``<root>/<model_id>/snap-<seq>/`` with a ``LATEST``
pointer replaced atomically (a crash leaves either the old or the new snapshot, never half).

Tables are written by the PS itself (:meth:`ps.ParameterServer.save` /
:func:`ps.save_table` into ``snap-<seq>/tables/``, full snapshots) and read back with
:func:`ps.restore_table`, so everything the PS keeps round-trips bit-identically: values,
optimizer state, update times, admission sketches, free rows, expiry cursor and watermark.

Serving: ``tables, dense_state, manifest = load_latest(Path("var/snapshots/deepfm"))`` gives
read-only replicas; then apply ``param-deltas`` from ``manifest["param_deltas_offset"]`` on
(sparse versions <= ``manifest["sparse_version"]`` are already included).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from ps import EmbeddingTable, SnapshotError, SyncChunk, restore_table, save_table

from .config import ModelConfig

FORMAT = "driftline-trainer-snapshot/2"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save(root: Path, config: ModelConfig, tables: dict[str, EmbeddingTable], dense: dict,
         manifest: dict, keep: int = 3) -> Path:
    """Write a snapshot; ``dense`` is a dict of torch-saveable state (head, optimizer, ...)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    prev = read_manifest(root)
    seq = (prev["seq"] + 1) if prev else 1
    name = f"snap-{seq:09d}"
    tmp = root / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    rows = {}
    for tname, t in tables.items():
        save_table(t, tmp / "tables")  # per shard: temp file + fsync + rename, checksummed
        rows[tname] = len(t)
    buf = io.BytesIO()
    torch.save(dense, buf)
    _write(tmp / "dense.pt", buf.getvalue())
    full = dict(manifest, format=FORMAT, seq=seq, name=name, model_id=config.model_id, created_at_ms=int(time.time() * 1000),
                rows=rows, config=json.loads(config.model_dump_json()))
    _write(tmp / "manifest.json", json.dumps(full, indent=1).encode())
    _fsync_dir(tmp)
    os.replace(tmp, root / name)
    _fsync_dir(root)
    _write(root / "LATEST.tmp", name.encode())
    os.replace(root / "LATEST.tmp", root / "LATEST")
    _fsync_dir(root)
    old = sorted(p for p in root.glob("snap-*") if p.is_dir())
    for p in old[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    return root / name


def read_manifest(root: Path) -> dict | None:
    latest = Path(root) / "LATEST"
    if not latest.exists():
        return None
    return json.loads((Path(root) / latest.read_text().strip() / "manifest.json").read_text())


def _replica(table: EmbeddingTable, config) -> EmbeddingTable:
    """A serving replica (``config.serving()``: no optimizer) holding ``table``'s rows."""
    out = EmbeddingTable(config.serving())
    k, v, _state, times = table.items()
    if k.size:
        out.apply_sync(SyncChunk(k, v, times, np.zeros(0, np.int64)))
    for _ in out.pop_updates(1 << 20):  # restored rows are not news for serving
        pass
    return out


def load(root: Path, config: ModelConfig | None = None, *, serving: bool = True):
    """``(tables, dense, manifest)`` of the latest snapshot, or None when there is none.

    ``dense`` is the saved dict (``dense["head"]`` is the head's state_dict)."""
    root = Path(root)
    manifest = read_manifest(root)
    if manifest is None:
        return None
    config = config or ModelConfig.model_validate(manifest["config"])
    snap = root / manifest["name"]
    if manifest.get("format") != FORMAT:
        raise SnapshotError(f"{snap}: snapshot format {manifest.get('format')!r} is not {FORMAT!r} "
                            "(written before tables were PS snapshots); delete it or train again")
    tables = {}
    for t in config.tables:
        if manifest.get("rows", {}).get(t.name) is None:
            tables[t.name] = EmbeddingTable(t.serving() if serving else t)  # a table added since
            continue
        restored = restore_table(snap / "tables", t)  # verified (sha256) before it is returned
        tables[t.name] = _replica(restored, t) if serving else restored
    dense = torch.load(snap / "dense.pt", weights_only=False)
    return tables, dense, manifest


def load_latest(path: Path):
    """Serving catch-up: ``(tables, dense_state, manifest)`` - read-only replica tables, the dense
    head's state_dict, and the manifest (``sparse_version``, ``dense_version``,
    ``param_deltas_offset``, ``offsets``, ``config``). Raises FileNotFoundError when none."""
    got = load(path, serving=True)
    if got is None:
        raise FileNotFoundError(f"no snapshot under {path}")
    tables, dense, manifest = got
    return tables, dense["head"], manifest
