"""The built-in model (``DRIFTLINE_SERVING__MODEL=fm``): a factorization machine over one serving
:class:`ps.EmbeddingTable` per slot (row = ``[w, v_1..v_k]``) and named numpy dense parameters
(``bias``). Serving's own tests and benchmarks use it: it needs no trainer.

Deltas are applied in place: a sparse chunk is one ``apply_sync`` (one lock hold per shard, so
scoring keeps running between chunks); a dense tensor is copied into the existing array. There is
never a second copy of the model.

>>> m = FMModel(slots=("user_id", "item_id"), dim=2)
>>> m.score({"user_id": [1]}, [{"item_id": [5]}, {"item_id": [6]}]).tolist()
[0.5, 0.5]
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from movielens.features import ITEM_SLOTS, USER_SLOTS
from proto import ParameterDelta
from ps import EmbeddingTable, SyncChunk, TableConfig
from serving.correction import SampleRates
from serving.model import Slots, latest_snapshot
from serving.request_features import Declared
from serving.versions import Bootstrap, DeltaRejected, VersionedModel, manifest_sample_rates, manifest_sparse_versions

__all__ = ["DEFAULT_SLOTS", "FMModel"]

#: slots of the built-in model: MovieLens user and item side plus the real-time recent clicks
DEFAULT_SLOTS: tuple[str, ...] = USER_SLOTS + ITEM_SLOTS + ("recent_items",)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -60.0, 60.0)))


class FMModel(VersionedModel):
    """Factorization machine over one embedding table per slot (sum-pooled multi-valued slots)."""

    def __init__(self, slots: Sequence[str] = DEFAULT_SLOTS, dim: int = 8, model_id: str = "deepfm") -> None:
        super().__init__(model_id)
        self.dim = dim
        self.width = dim + 1
        self.tables: dict[str, EmbeddingTable] = {
            s: EmbeddingTable(TableConfig(name=s, dim=self.width, initial_capacity=4096).serving())
            for s in slots
        }
        self.dense_params: dict[str, np.ndarray] = {"bias": np.zeros(1, np.float32)}
        self._dense_lock = threading.Lock()
        self.declared = Declared.of(slots)

    # ------------------------------------------------------------------ scoring
    def _pooled(self, slot: str, ids_per_row: Sequence[Sequence[int]]) -> np.ndarray:
        """Sum of each row's embeddings in ``slot``: float32 [rows, width] (zeros when empty)."""
        n = len(ids_per_row)
        lengths = np.fromiter((len(ids) for ids in ids_per_row), np.int64, n)
        total = int(lengths.sum())
        out = np.zeros((n, self.width), np.float32)
        if total == 0:
            return out
        flat = np.fromiter((i for ids in ids_per_row for i in ids), np.int64, total)
        emb = self.tables[slot].gather(flat)
        if total == n and bool((lengths == 1).all()):
            return emb
        np.add.at(out, np.repeat(np.arange(n), lengths), emb)
        return out

    def score(self, user_slots: Slots, item_slots_list: Sequence[Slots], dense: np.ndarray | None = None) -> np.ndarray:
        n = len(item_slots_list)  # declares no dense features: ``dense`` is always None
        linear = np.zeros(n, np.float64)
        v_sum = np.zeros((n, self.dim), np.float64)
        v_sq = np.zeros(n, np.float64)

        def add(e: np.ndarray) -> None:
            nonlocal linear, v_sum, v_sq
            linear = linear + e[:, 0]
            v = e[:, 1:].astype(np.float64)
            v_sum = v_sum + v
            v_sq = v_sq + (v * v).sum(axis=1)

        for slot, ids in user_slots.items():
            if slot in self.tables and ids:
                add(self._pooled(slot, [ids]))  # [1, width] broadcasts over candidates
        item_slot_names = {s for slots in item_slots_list for s in slots if s in self.tables}
        for slot in sorted(item_slot_names):
            add(self._pooled(slot, [slots.get(slot, ()) for slots in item_slots_list]))
        with self._dense_lock:
            bias = float(self.dense_params["bias"][0])
        z = bias + linear + 0.5 * ((v_sum * v_sum).sum(axis=1) - v_sq)
        return _sigmoid(z)

    # ------------------------------------------------------------------ deltas
    def _write_sparse(self, msg: ParameterDelta, table: EmbeddingTable) -> None:
        rows = msg.sparse
        keys = np.frombuffer(rows.keys, dtype="<i8").astype(np.int64)
        values = np.frombuffer(rows.values, dtype="<f4").astype(np.float32).reshape(keys.size, rows.dim)
        if not np.isfinite(values).all():
            raise DeltaRejected("non_finite", f"{rows.table}: rows not finite (version {msg.version})")
        tomb = np.frombuffer(rows.tombstones, dtype="<i8").astype(np.int64)
        when = msg.max_event_time_ms or msg.created_at_ms or 1
        times = np.full(keys.size, when, np.int64)
        table.apply_sync(SyncChunk(keys, values, times, tomb))

    def _write_dense(self, msg: ParameterDelta, rates: SampleRates) -> None:
        updates: list[tuple[np.ndarray, np.ndarray]] = []
        for t in msg.dense.tensors:
            current = self.dense_params.get(t.name)
            value = np.frombuffer(t.values, dtype="<f4").reshape(tuple(t.shape))
            if not np.isfinite(value).all():
                raise DeltaRejected("non_finite", f"dense {t.name}: not finite (version {msg.version})")
            if current is None:
                raise DeltaRejected("unknown_table", f"no dense tensor {t.name!r}")
            if current.shape != value.shape:
                raise DeltaRejected("bad_shape", f"{t.name} is {current.shape}, delta {value.shape}")
            updates.append((current, value))
        with self._dense_lock:  # all tensors of a chunk change together
            for current, value in updates:
                np.copyto(current, value)
            self.sample_rates = rates

    # ------------------------------------------------------------------ snapshots
    def save_snapshot(self, root: Path, broker_epoch: str | None = None) -> Path:
        """Write a full snapshot under ``root``; return its directory. (Stand-in for the trainer's.)"""
        path = root / f"snapshot-{self.sparse.version:012d}-{self.dense.version:012d}-{time.time_ns()}"
        tmp = path.with_name(path.name + ".tmp")
        tmp.mkdir(parents=True)
        for name, table in self.tables.items():
            keys, values, _state, _times = table.items()
            np.savez(tmp / f"sparse-{name}.npz", keys=keys, values=values)
        np.savez(tmp / "dense.npz", **self.dense_params)
        meta = {"model_id": self.model_id, "dim": self.dim,
                "sparse_version": self.sparse.version, "dense_version": self.dense.version,
                "shard_count": self.sparse.shard_count, "sparse_versions": self.sparse.versions(),
                "sparse_published_ms": self.sparse.published_ms,
                "dense_published_ms": self.dense.published_ms, "broker_epoch": broker_epoch,
                "sample_rates": self.sample_rates.as_dict()}
        (tmp / "meta.json").write_text(json.dumps(meta))
        tmp.rename(path)
        return path

    def load_snapshot(self, path: Path) -> None:
        meta = json.loads((path / "meta.json").read_text())
        if meta["model_id"] != self.model_id or meta["dim"] != self.dim:
            raise ValueError(f"snapshot {path} is for {meta['model_id']} dim {meta['dim']}")
        # Fresh tables, swapped in at the end: a running model reloading keeps scoring with the
        # old rows until then, and keeps none of them after.
        tables = {name: EmbeddingTable(TableConfig(name=name, dim=self.width, initial_capacity=4096).serving())
                  for name in self.tables}
        for name, table in tables.items():
            f = path / f"sparse-{name}.npz"
            if f.exists():
                with np.load(f) as z:
                    keys = z["keys"].astype(np.int64)
                    table.apply_sync(SyncChunk(keys, z["values"].astype(np.float32),
                                               np.ones(keys.size, np.int64), np.empty(0, np.int64)))
        self.tables = tables
        with np.load(path / "dense.npz") as z:
            with self._dense_lock:
                for name in z.files:
                    if name in self.dense_params:
                        np.copyto(self.dense_params[name], z[name])
        self.sample_rates = manifest_sample_rates(meta.get("sample_rates"))
        self._restore_versions(*manifest_sparse_versions(meta), meta["sparse_published_ms"],
                               meta["dense_version"], meta["dense_published_ms"])

    def bootstrap(self, root: Path | None) -> Bootstrap | None:
        path = latest_snapshot(root)
        if path is None:
            return None
        self.load_snapshot(path)
        meta = json.loads((path / "meta.json").read_text())
        shard_count, versions = manifest_sparse_versions(meta)
        return Bootstrap(path, self.sparse.version, self.dense.version, broker_epoch=meta.get("broker_epoch"),
                         shard_count=shard_count, sparse_versions=versions)

    def snapshot_epoch(self, root: Path | None) -> str | None:
        path = latest_snapshot(root)
        if path is None:
            return None
        try:
            return json.loads((path / "meta.json").read_text()).get("broker_epoch")
        except (OSError, ValueError):
            return None
