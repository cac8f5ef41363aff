"""Atomic snapshots of a model: all PS tables with optimizer state, dense params + optimizer,
consumer offsets and sync versions, under ``<root>/<model_id>/snap-<seq>/`` with a ``LATEST``
pointer replaced atomically (a crash leaves either the old or the new snapshot, never half).

Tables are written by the PS itself (:meth:`ps.ParameterServer.save` /
:func:`ps.save_table` into ``snap-<seq>/tables/``, full snapshots) and read back with
:func:`ps.restore_table`, so everything the PS keeps round-trips bit-identically: values,
optimizer state, update times, admission sketches, free rows, expiry cursor and watermark.

Serving: ``tables, dense_state, manifest = load_latest(Path("var/snapshots/deepfm"))`` gives
read-only replicas; then apply ``param-deltas`` from ``manifest.param_deltas_offset`` on
(sparse versions <= ``manifest.sparse_version`` are already included; the manifest is a
:class:`trainer.manifest.Manifest`).

**N ranks** (:mod:`trainer.dist.rank_trainer`): each rank writes its shard into
``.snap-<seq>.tmp/rank-<r>/`` (:func:`save_rank`: ``tables/`` as the PS writes a one-shard table,
and ``state.pt``: its offsets, dedup window, AUC histograms, sample-rate sums); after a barrier
rank 0 writes ``dense.pt`` and the manifest (``"shard_count": N``, ``"sparse_versions": {"0": v0,
...}``, the union of the offsets) and renames the directory into place, then ``LATEST``
(:func:`commit_ranks`): the manifest and ``LATEST`` come last, so a crash before them leaves the
previous complete snapshot in force. :func:`load` returns the union of the shards' rows, so readers
(serving) need not know how many ranks wrote a snapshot; :func:`load_rank` gives one rank of M its
rows (its own directory when M == N, bit-identical; else the union resharded with
:func:`trainer.sharding.shard_of`).
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from ps import EmbeddingTable, SnapshotError, SyncChunk, restore_table, save_table
from services.atomic import fsync_path, write_bytes_atomic

from .config import ModelConfig

# the store's manifest readers live beside the class, where a process without torch reads them
from .manifest import Manifest
from .manifest import candidates as candidates
from .manifest import latest as latest
from .manifest import learned_online as learned_online
from .manifest import manifest_of as manifest_of
from .manifest import read_manifest as read_manifest

FORMAT = "driftline-trainer-snapshot/2"
#: what reading a damaged snapshot raises (a table's checksum, a truncated torch file or manifest, a
#: file gone): :func:`newest_readable` then tries the one before it
UNREADABLE = (SnapshotError, OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError, KeyError, TypeError)

log = logging.getLogger(__name__)
T = TypeVar("T")


class EventClock:
    """When a snapshot falls due by event time: at every multiple of ``interval_ms`` (0: never) the
    newest event time applied crosses, the same rule for the 1-process trainer and the ranks (who
    all see the same global event time, so all decide alike). ``next_at`` is recorded in manifests.

    >>> c = EventClock(1000)
    >>> c.due(1500), c.next_at  # the first look only sets the boundary
    (False, 2000)
    >>> c.due(1999), c.due(2000)
    (False, True)
    >>> c.taken(2500); c.next_at
    3000
    """

    def __init__(self, interval_ms: int, next_at: int | None = None):
        self.interval_ms, self.next_at = interval_ms, next_at

    def due(self, event_ms: int) -> bool:
        if self.interval_ms <= 0:
            return False
        if self.next_at is None:
            self.taken(event_ms)
            return False
        return event_ms >= self.next_at

    def taken(self, event_ms: int) -> None:
        """A snapshot was written at event time ``event_ms``: the next is due at the boundary after it."""
        self.next_at = (event_ms // self.interval_ms + 1) * self.interval_ms


def _write(path: Path, data: bytes) -> None:
    """A file inside a snapshot directory not yet renamed into place: the directory's rename is
    the atomic step, so the file is only written and synced."""
    path.write_bytes(data)
    fsync_path(path)


def save(root: Path, config: ModelConfig, tables: dict[str, EmbeddingTable], dense: dict,
         manifest: Manifest | Mapping, keep: int = 3) -> Path:
    """Write a snapshot; ``dense`` is a dict of torch-saveable state (head, optimizer, ...)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    seq = next_seq(root)
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
    full = replace(Manifest.from_dict(manifest), format=FORMAT, seq=seq, name=name, model_id=config.model_id,
                   created_at_ms=int(time.time() * 1000), rows=rows, config=json.loads(config.model_dump_json()))
    _write(tmp / "manifest.json", json.dumps(full.to_dict(), indent=1).encode())
    fsync_path(tmp)
    os.replace(tmp, root / name)
    fsync_path(root)
    write_bytes_atomic(root / "LATEST", name.encode())
    old = sorted(p for p in root.glob("snap-*") if p.is_dir())
    for p in old[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    return root / name


def _staging(root: Path, seq: int) -> Path:
    return Path(root) / f".snap-{seq:09d}.tmp"


def next_seq(root: Path) -> int:
    """The sequence number of the next snapshot under ``root`` (rank 0 decides it for all ranks):
    past every snapshot directory, so neither one that a crash left unpointed-at (moved into place,
    ``LATEST`` not yet replaced) nor a damaged newest that a restore skipped is written over."""
    seqs = [int(p.name[5:]) for p in Path(root).glob("snap-*") if p.is_dir() and p.name[5:].isdigit()]
    return max(seqs, default=0) + 1


def newest_readable(root: Path, read: Callable[[str], T],
                    on_unreadable: Callable[[str, BaseException], None] | None = None) -> T | None:
    """``read(name)`` of the newest snapshot it does not fail on (:data:`UNREADABLE`), each failure
    logged; None when there is no snapshot. A damaged newest snapshot (a disk's error, a file cut
    short outside the atomic write) so restores the one before it, whose offsets are where the
    stream is read again from, instead of failing every restart; when none is readable, raises
    :class:`ps.SnapshotError` naming each one's error. ``on_unreadable(name, error)``: told of each
    (a metric)."""
    errors = []
    for name in candidates(root):
        try:
            got = read(name)
        except UNREADABLE as err:
            log.error("snapshot %s under %s is unreadable (%s: %s): trying the one before it", name, root,
                      type(err).__name__, err)
            errors.append(f"{name}: {type(err).__name__}: {err}")
            if on_unreadable is not None:
                on_unreadable(name, err)
            continue
        if errors:
            log.warning("restoring snapshot %s under %s: the newer %s unreadable", name, root, errors)
        return got
    if errors:
        raise SnapshotError(f"no snapshot under {root} is readable: " + "; ".join(errors))
    return None


def local_config(t):
    """A rank's table config: its rows are shard ``rank`` of the N-shard table already, held in one
    local shard (see :mod:`trainer.sharding`)."""
    return t.model_copy(update={"shards": 1})


def save_rank(root: Path, seq: int, rank: int, tables: dict[str, EmbeddingTable], state: dict) -> None:
    """Rank ``rank``'s part of snapshot ``seq``: its shard of every table (optimizer state included)
    and its own ``state`` (torch-saveable), durable when it returns; invisible until
    :func:`commit_ranks`."""
    d = _staging(root, seq) / f"rank-{rank}"
    shutil.rmtree(d, ignore_errors=True)  # a part left by a crashed attempt at the same seq
    (d / "tables").mkdir(parents=True)
    for t in tables.values():
        save_table(t, d / "tables")
    buf = io.BytesIO()
    torch.save(state, buf)
    _write(d / "state.pt", buf.getvalue())
    fsync_path(d)


def rank_state(snap: Path, rank: int) -> dict:
    """Rank ``rank``'s own part (:func:`save_rank`'s ``state``) of the N-rank snapshot at ``snap``."""
    return torch.load(Path(snap) / f"rank-{rank}" / "state.pt", weights_only=False, map_location="cpu")


def commit_ranks(root: Path, config: ModelConfig, seq: int, shard_count: int, dense: dict, manifest: Manifest | Mapping,
                 rows: dict[str, int], keep: int = 3) -> Path:
    """Rank 0, once every rank's :func:`save_rank` returned (a barrier): write ``dense.pt`` and the
    manifest, move the snapshot into place, then point ``LATEST`` at it."""
    root = Path(root)
    tmp, name = _staging(root, seq), f"snap-{seq:09d}"
    missing = [r for r in range(shard_count) if not (tmp / f"rank-{r}" / "state.pt").exists()]
    if missing:
        raise SnapshotError(f"{tmp}: ranks {missing} wrote no part; not committing snapshot {seq}")
    buf = io.BytesIO()
    torch.save(dense, buf)
    _write(tmp / "dense.pt", buf.getvalue())
    full = replace(Manifest.from_dict(manifest), format=FORMAT, seq=seq, name=name, model_id=config.model_id,
                   created_at_ms=int(time.time() * 1000), rows=rows, shard_count=shard_count,
                   config=json.loads(config.model_dump_json()))
    _write(tmp / "manifest.json", json.dumps(full.to_dict(), indent=1).encode())
    fsync_path(tmp)
    shutil.rmtree(root / name, ignore_errors=True)  # never pointed at: LATEST names seq - 1
    os.replace(tmp, root / name)
    fsync_path(root)
    write_bytes_atomic(root / "LATEST", name.encode())
    for p in sorted(p for p in root.glob("snap-*") if p.is_dir())[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    for p in root.glob(".snap-*.tmp"):  # parts of attempts that never committed
        if p.name < tmp.name:
            shutil.rmtree(p, ignore_errors=True)
    return root / name


def _shard_parts(snap: Path, t, shard_count: int) -> list[EmbeddingTable]:
    """Every rank's shard of table ``t`` in an N-rank snapshot (verified, optimizer state included)."""
    return [restore_table(snap / f"rank-{r}" / "tables", local_config(t)) for r in range(shard_count)]


def _union(parts: list[EmbeddingTable], t, serving: bool, keep=None) -> EmbeddingTable:
    """One table (``t``'s config; a replica when ``serving``) holding the rows of ``parts``, or
    only those ``keep(keys)`` selects."""
    out = EmbeddingTable(t.serving() if serving else t)
    for part in parts:
        k, v, st, times = part.items()
        if keep is not None:
            sel = keep(k)
            k, v, st, times = k[sel], v[sel], st[sel], times[sel]
        if not k.size:
            continue
        if serving:
            out.apply_sync(SyncChunk(k, v, times, np.zeros(0, np.int64)))
        else:
            out.load_rows(k, v, st, times)
    for _ in out.pop_updates(1 << 30):  # restored rows are not news for serving
        pass
    return out


def load_rank(root: Path, config: ModelConfig, rank: int, world: int, name: str):
    """Rank ``rank`` of ``world``'s part of snapshot ``name`` (:func:`candidates`; the ranks agree on
    one every rank can read: :mod:`trainer.dist.rank_snapshots`): ``(tables, dense, manifest, state)``
    with ``tables`` its shard in one local shard per table (:func:`local_config`), ``state`` its
    own :func:`save_rank` state when the snapshot was written by ``world`` ranks (else None: the
    caller splits the manifest's global state). Any snapshot restores into any number of ranks:
    rows move to the rank :func:`trainer.sharding.shard_of` names, a table of
    :func:`trainer.sharding.whole_tables` wholly to rank 0 (an admission sketch's counts of ids
    not admitted yet are not moved)."""
    from .sharding import shard_of, whole_tables

    root = Path(root)
    manifest = manifest_of(root, name)
    snap = root / name
    if manifest.format != FORMAT:
        raise SnapshotError(f"{snap}: snapshot format {manifest.format!r} is not {FORMAT!r}")
    n = manifest.shards
    tables, state = {}, None
    whole = whole_tables(config)
    for t in config.tables:
        lt = local_config(t)
        if (manifest.rows or {}).get(t.name) is None or (t.name in whole and rank != 0):
            tables[t.name] = EmbeddingTable(lt)
        elif t.name in whole:  # all of it, however the writer's ranks held it
            parts = _shard_parts(snap, t, n) if n else [restore_table(snap / "tables", t)]
            tables[t.name] = _union(parts, lt, False)
        elif n == world:
            tables[t.name] = restore_table(snap / f"rank-{rank}" / "tables", lt)
        else:
            parts = _shard_parts(snap, t, n) if n else [restore_table(snap / "tables", t)]
            tables[t.name] = _union(parts, lt, False, keep=lambda k: shard_of(k, world) == rank)
    if n == world:
        state = rank_state(snap, rank)
    dense = torch.load(snap / "dense.pt", weights_only=False, map_location="cpu")
    return tables, dense, manifest, state


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
    """``(tables, dense, manifest)`` of the newest readable snapshot (:func:`newest_readable`), or
    None when there is none; the tables hold every row (of every rank's shard when N ranks wrote it).

    ``dense`` is the saved dict (``dense["head"]`` is the head's state_dict)."""
    return newest_readable(Path(root), lambda name: load_named(Path(root), name, config, serving=serving))


def load_named(root: Path, name: str, config: ModelConfig | None = None, *, serving: bool = True):
    """:func:`load` of snapshot ``name`` (:func:`candidates`); raises what a damaged one does."""
    manifest = manifest_of(root, name)
    config = config or manifest.model_config()
    snap = root / name
    if manifest.format != FORMAT:
        raise SnapshotError(f"{snap}: snapshot format {manifest.format!r} is not {FORMAT!r} "
                            "(written before tables were PS snapshots); delete it or train again")
    tables = {}
    n = manifest.shards
    for t in config.tables:
        if (manifest.rows or {}).get(t.name) is None:
            tables[t.name] = EmbeddingTable(t.serving() if serving else t)  # a table added since
            continue
        if n:  # written by n ranks: the union of their shards
            tables[t.name] = _union(_shard_parts(snap, t, n), t, serving)
            continue
        restored = restore_table(snap / "tables", t)  # verified (sha256) before it is returned
        tables[t.name] = _replica(restored, t) if serving else restored
    dense = torch.load(snap / "dense.pt", weights_only=False, map_location="cpu")
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
