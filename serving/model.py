"""The model being served, behind a small interface, and a built-in FM over PS tables.

:class:`ServingModel` is what the app needs: ``score(user_slots, item_slots_list)``,
``apply_delta(msg)``, and the versions. :class:`FMModel` implements it with a factorization
machine whose sparse parameters are one serving-replica :class:`ps.EmbeddingTable` per slot
(row = ``[w, v_1..v_k]``) and whose dense parameters are named numpy arrays (``bias``). The
trainer's DeepFM ``Scorer`` replaces it behind the same interface once it lands.

Deltas are applied in place: a sparse chunk is one ``apply_sync`` (one lock hold per shard, so
scoring keeps running between chunks); a dense tensor is copied into the existing array. There is
never a second copy of the model. A version counts as served once all its chunks are applied;
chunks of a newer version become visible as they arrive (Monolith does the same).

Sparse versions are per shard (:class:`SparseVersions`): a trainer running N ranks publishes each
rank's shard with its own version sequence (``ParameterDelta.shard`` / ``shard_count``), and the
shards interleave on the one delta partition in no fixed order. The shards own disjoint ids
(``trainer.sharding.shard_of``; a delta with a row of another shard is rejected, ``wrong_shard``),
so applying each shard's deltas in its own order gives the union of the trainer's shards whatever
the interleaving, and every shard's version is counted on its own. ``sparse.version`` is the
*minimum* over the shards: the newest version every shard has reached (what the FeatureLog's
``ModelVersion.sparse_version`` and the old single gauge carry; see :class:`SparseVersions`).

>>> m = FMModel(slots=("user_id", "item_id"), dim=2)
>>> m.score({"user_id": [1]}, [{"item_id": [5]}, {"item_id": [6]}]).tolist()
[0.5, 0.5]
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from producers.movielens_features import ITEM_SLOTS, USER_SLOTS
from proto import ParameterDelta
from ps import EmbeddingTable, SyncChunk, TableConfig
from serving.correction import BadSampleRates, SampleRates
from serving.request_features import Declared

if TYPE_CHECKING:
    from trainer.batch import SparseBatch
    from trainer.inference import Scorer
    from trainer.model import SparseModel

Slots = Mapping[str, Sequence[int]]

#: slots of the built-in model: MovieLens user and item side plus the real-time recent clicks
DEFAULT_SLOTS: tuple[str, ...] = USER_SLOTS + ITEM_SLOTS + ("recent_items",)


@dataclass
class VersionState:
    """Served version of one kind of parameters and when it was published."""

    version: int = 0
    published_ms: int = 0
    applied_ms: int = 0
    #: version -> chunk indexes seen so far (a version completes when it has all of them)
    pending: dict[int, set[int]] = field(default_factory=dict)

    def staleness_s(self, now_ms: int | None = None) -> float | None:
        if not self.published_ms:
            return None
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        return max(0.0, (now_ms - self.published_ms) / 1000.0)


class SparseVersions:
    """Served sparse versions: one :class:`VersionState` per shard of the trainer's current layout.

    ``shard_count`` is the layout the deltas name (0: a one-process trainer, which has one shard,
    0, and behaves exactly as before shards existed). The shards' version sequences are
    independent, so each is tracked (and its chunks counted) on its own.

    A delta naming another ``shard_count`` comes from a trainer restarted with another number of
    ranks (it resharded its snapshot on load): it supersedes the old layout, whose versions are not
    comparable with the new ones. Every shard's version then restarts at 0 (nothing of the new
    layout served yet) and counts up as the new ranks' versions complete; the rows already held
    stay (they are the old trainer's, and the new one started from a snapshot of them). A replica
    that reloads from a snapshot takes the layout and per-shard versions of its manifest
    (:meth:`restore`).

    ``version`` is the minimum over the layout's shards: the newest version every shard has
    reached, so the rows served include each shard's updates up to at least it. Ranks publish at
    the same steps (they step together), so it is the trainer's version the whole model has
    reached; a sum would move when any shard moves but match no version of the trainer. It equals
    the one version of a one-process trainer, and never decreases within one layout.
    """

    def __init__(self) -> None:
        self.shard_count = 0
        self.shards: dict[int, VersionState] = {0: VersionState()}

    def _layout(self) -> list[VersionState]:
        return self.layout()[1]

    def layout(self) -> tuple[int, list[VersionState]]:
        """``(shard_count, [state of shard 0, 1, ...])`` read once: it is read on the event loop
        while a worker thread applies deltas (so no writes here either)."""
        shards, n = self.shards, self.shard_count
        return n, [shards.get(s) or VersionState() for s in range(max(1, n))]

    @property
    def version(self) -> int:
        return min(state.version for state in self._layout())

    @version.setter
    def version(self, version: int) -> None:
        """Set every shard of the current layout to ``version`` (a one-process layout's one
        version: what a stand-in model that knows no shards sets)."""
        for s in range(max(1, self.shard_count)):
            self.shards.setdefault(s, VersionState()).version = version

    @property
    def published_ms(self) -> int:
        """Publish time of the stalest shard's newest version (0: no shard has any)."""
        published = [state.published_ms for state in self._layout() if state.published_ms]
        return min(published) if published else 0

    def staleness_s(self, now_ms: int | None = None) -> float | None:
        """Age of the stalest shard: one rank that stopped publishing shows here."""
        published = self.published_ms
        if not published:
            return None
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        return max(0.0, (now_ms - published) / 1000.0)

    def versions(self) -> dict[str, int]:
        """``{"<shard>": version}`` of the current layout (string keys: they are JSON keys)."""
        return self.report()[1]

    def report(self) -> tuple[int, dict[str, int]]:
        """``(shard_count, versions())`` of one moment."""
        n, states = self.layout()
        return n, {str(s): state.version for s, state in enumerate(states)}

    def restore(self, shard_count: int, versions: Mapping[int, int], published_ms: int = 0) -> None:
        """Take the layout and per-shard versions of a snapshot (no chunk pending)."""
        self.shards = {s: VersionState(int(versions.get(s, 0)), published_ms)
                       for s in range(max(1, shard_count))}
        self.shard_count = shard_count

    def done(self, msg: ParameterDelta) -> None:
        """Count one applied sparse chunk for its shard (a new layout resets every shard first)."""
        if msg.shard_count != self.shard_count:
            self.restore(msg.shard_count, {})
        chunk_done(self.shards.setdefault(msg.shard, VersionState()), msg)


def manifest_sparse_versions(manifest: Mapping) -> tuple[int, dict[int, int]]:
    """``(shard_count, {shard: version})`` a snapshot holds: ``shard_count`` and ``sparse_versions``
    written by an N-rank trainer, or the one ``sparse_version`` of a one-process trainer."""
    shard_count = int(manifest.get("shard_count") or 0)
    per_shard = manifest.get("sparse_versions")
    if shard_count and per_shard is not None:
        return shard_count, {int(s): int(v) for s, v in per_shard.items()}
    return shard_count, {0: int(manifest.get("sparse_version", 0))}


def check_shard(msg: ParameterDelta) -> None:
    """Refuse a sparse delta whose shard is not in its layout or that carries rows another shard
    owns: two shards writing one row would make replicas depend on how the shards interleave."""
    n, shard = msg.shard_count, msg.shard
    if shard >= max(1, n):
        raise DeltaRejected("bad_shard", f"shard {shard} of shard_count {n}")
    if n <= 1:
        return
    from trainer.sharding import shard_of  # the one sharding function; numpy + ps only

    for what, raw in (("keys", msg.sparse.keys), ("tombstones", msg.sparse.tombstones)):
        ids = np.frombuffer(raw, dtype="<i8").astype(np.int64)
        if ids.size and not bool((shard_of(ids, n) == shard).all()):
            raise DeltaRejected("wrong_shard", f"{msg.sparse.table}: {what} of another shard in "
                                               f"shard {shard} of {n} (version {msg.version})")


class DeltaRejected(ValueError):
    """A delta that cannot be applied to this model; ``reason`` is a metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class ServingModel(Protocol):
    model_id: str
    sparse: SparseVersions
    dense: VersionState
    #: the negative sample rates the parameters were trained under (snapshot manifest, then every
    #: dense delta that carries them): what ``/rank``'s log-odds correction uses
    sample_rates: SampleRates

    @property
    def declared(self) -> Declared:
        """The features the model reads now (a snapshot may bring another config)."""
        ...

    def score(self, user_slots: Slots, item_slots_list: Sequence[Slots], dense: np.ndarray | None = None) -> np.ndarray:
        """Uncorrected probabilities, one per item, float64. ``dense``: float32 ``[items, K]``, the
        model's ``declared.dense`` features in order (None when it declares none)."""
        ...

    def apply_delta(self, msg: ParameterDelta) -> str:
        """Apply one chunk in place; return its kind ("sparse" or "dense")."""
        ...

    def bootstrap(self, root: Path | None) -> Bootstrap | None:
        """Load the newest snapshot under ``root`` into this model, replacing its parameters (a
        running model keeps scoring with the old ones meanwhile); None when there is none."""
        ...

    def snapshot_epoch(self, root: Path | None) -> str | None:
        """The broker epoch recorded in the newest snapshot under ``root`` (None: none recorded)."""
        ...


@dataclass(frozen=True)
class Bootstrap:
    """What a snapshot gave: its path, versions, and where to resume the delta topic (None: start)."""

    path: Path
    sparse_version: int
    dense_version: int
    param_deltas_offset: int | None = None
    #: the broker epoch the offset belongs to (the trainer's manifest key ``broker_epoch``)
    broker_epoch: str | None = None
    #: the layout of the snapshot's sparse versions (0: a one-process trainer's)
    shard_count: int = 0
    #: shard -> the sparse version the snapshot holds of it (``{0: sparse_version}`` for layout 0)
    sparse_versions: Mapping[int, int] = field(default_factory=dict)

    def holds(self, msg: ParameterDelta) -> bool | None:
        """Whether the snapshot already holds this sparse delta: True or False for a delta of the
        snapshot's layout (its version against the shard's), None for another layout."""
        if msg.shard_count != self.shard_count:
            return None
        return msg.version <= self.sparse_versions.get(msg.shard, 0)


def chunk_done(state: VersionState, msg: ParameterDelta) -> None:
    """Count one applied chunk; the version is served once all ``chunk_count`` chunks are in."""
    if msg.version <= state.version:
        return  # a re-delivered chunk of a version already complete: applied again, harmless
    seen = state.pending.setdefault(msg.version, set())
    seen.add(msg.chunk_index)
    if len(seen) >= msg.chunk_count:
        state.version = msg.version
        state.published_ms = msg.created_at_ms
        state.applied_ms = int(time.time() * 1000)
        for v in [v for v in state.pending if v <= msg.version]:
            del state.pending[v]


def delta_sample_rates(msg: ParameterDelta, current: SampleRates) -> SampleRates:
    """The rates a dense delta brings (checked before any of it is applied), or ``current`` when it
    carries none (a trainer that does not record them: the delta says nothing about them)."""
    if not msg.dense.HasField("sample_rates"):
        return current
    try:
        return SampleRates.from_message(msg.dense.sample_rates)
    except BadSampleRates as err:
        raise DeltaRejected("bad_sample_rate", str(err)) from None


def manifest_sample_rates(rates: Mapping | None) -> SampleRates:
    """A snapshot's ``sample_rates`` (None or empty: the trainer recorded none: no correction)."""
    return SampleRates.from_mapping(rates) if rates else SampleRates()


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.clip(z, -60.0, 60.0)))


class FMModel:
    """Factorization machine over one embedding table per slot (sum-pooled multi-valued slots)."""

    def __init__(self, slots: Sequence[str] = DEFAULT_SLOTS, dim: int = 8, model_id: str = "deepfm") -> None:
        self.model_id = model_id
        self.dim = dim
        self.width = dim + 1
        self.tables: dict[str, EmbeddingTable] = {
            s: EmbeddingTable(TableConfig(name=s, dim=self.width, initial_capacity=4096).serving())
            for s in slots
        }
        self.dense_params: dict[str, np.ndarray] = {"bias": np.zeros(1, np.float32)}
        self._dense_lock = threading.Lock()
        self.sparse = SparseVersions()
        self.dense = VersionState()
        self.sample_rates = SampleRates()
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
    def apply_delta(self, msg: ParameterDelta) -> str:
        if msg.model_id != self.model_id:
            raise DeltaRejected("other_model", f"delta for {msg.model_id!r}, serving {self.model_id!r}")
        kind = msg.WhichOneof("payload")
        if kind == "sparse":
            check_shard(msg)
            self._apply_sparse(msg)
            self.sparse.done(msg)
        elif kind == "dense":
            self._apply_dense(msg)
            chunk_done(self.dense, msg)
        else:
            raise DeltaRejected("bad_shape", "delta without payload")
        return kind

    def _apply_sparse(self, msg: ParameterDelta) -> None:
        rows = msg.sparse
        table = self.tables.get(rows.table)
        if table is None:
            raise DeltaRejected("unknown_table", f"no table {rows.table!r}")
        if rows.dim != table.dim:
            raise DeltaRejected("bad_shape", f"table {rows.table} has dim {table.dim}, delta {rows.dim}")
        keys = np.frombuffer(rows.keys, dtype="<i8").astype(np.int64)
        values = np.frombuffer(rows.values, dtype="<f4").astype(np.float32).reshape(keys.size, rows.dim)
        tomb = np.frombuffer(rows.tombstones, dtype="<i8").astype(np.int64)
        when = msg.max_event_time_ms or msg.created_at_ms or 1
        times = np.full(keys.size, when, np.int64)
        table.apply_sync(SyncChunk(keys, values, times, tomb))

    def _apply_dense(self, msg: ParameterDelta) -> None:
        rates = delta_sample_rates(msg, self.sample_rates)
        updates: list[tuple[np.ndarray, np.ndarray]] = []
        for t in msg.dense.tensors:
            current = self.dense_params.get(t.name)
            value = np.frombuffer(t.values, dtype="<f4").reshape(tuple(t.shape))
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
        self.sparse.restore(*manifest_sparse_versions(meta), meta["sparse_published_ms"])
        self.dense.version = meta["dense_version"]
        self.dense.published_ms = meta["dense_published_ms"]
        self.dense.pending.clear()

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


def warm_up(model: ServingModel) -> None:
    """Compile the PS kernels that deltas and scoring use (numba JITs on first call, holding the
    GIL for seconds), on a scratch table, so the first live delta does not stall requests."""
    scratch = EmbeddingTable(TableConfig(name="warmup", dim=2).serving())
    scratch.apply_sync(SyncChunk(np.array([1, 2], np.int64), np.ones((2, 2), np.float32),
                                 np.ones(2, np.int64), np.array([3], np.int64)))
    scratch.apply_sync(SyncChunk(np.empty(0, np.int64), np.empty((0, 2), np.float32),
                                 np.empty(0, np.int64), np.array([1], np.int64)))
    scratch.gather(np.array([1, 2, 5], np.int64))
    declared = model.declared
    dense = np.zeros((2, len(declared.dense)), np.float32) if declared.dense else None
    model.score({}, [{s: [1] for s in declared.slots}, {s: [2, 3] for s in declared.slots}], dense)


def latest_snapshot(root: Path | None) -> Path | None:
    """The newest complete snapshot directory under ``root`` (by name: versions, then time)."""
    if root is None or not root.is_dir():
        return None
    done = sorted(p for p in root.glob("snapshot-*") if p.is_dir() and (p / "meta.json").exists()
                  and not p.name.endswith(".tmp"))
    return done[-1] if done else None


def _request_batch(user_slots: Slots, item_slots_list: Sequence[Slots], slots: Sequence[str]) -> SparseBatch:
    """The :class:`trainer.batch.SparseBatch` of one request: row 0 the user's slots, rows 1..n
    the candidates' (a slot in neither is empty). The user's slots cost O(1) rows, not n.

    >>> b = _request_batch({"u": [7, 8]}, [{"i": [1]}, {"i": [2, 3]}], ["i", "u", "x"])
    >>> b.size, b.ids["u"].tolist(), b.offsets["u"].tolist(), b.offsets["i"].tolist(), b.offsets["x"].tolist()
    (3, [7, 8], [0, 2, 2, 2], [0, 0, 1, 3], [0, 0, 0, 0])
    """
    from trainer.batch import SparseBatch

    n = len(item_slots_list) + 1
    ids: dict[str, np.ndarray] = {}
    offsets: dict[str, np.ndarray] = {}
    for slot in slots:
        user = user_slots.get(slot)
        if user is not None:
            ids[slot] = np.asarray(user, np.int64).reshape(-1)
            offs = np.full(n + 1, len(user), np.int64)
            offs[0] = 0
        else:
            bags = [item.get(slot, ()) for item in item_slots_list]
            offs = np.zeros(n + 1, np.int64)
            np.cumsum(np.fromiter(map(len, bags), np.int64, n - 1), out=offs[2:])
            ids[slot] = np.fromiter(chain.from_iterable(bags), np.int64, int(offs[-1]))
        offsets[slot] = offs
    return SparseBatch(n, ids, offsets)


class _PooledInputs:
    """A stand-in head: returns what the head would get, ``(emb, lin, dense)``."""

    def __call__(self, emb: object, lin: object, dense: object) -> tuple[object, object, object]:
        return emb, lin, dense


class TrainerModel:
    """The trainer's model (``trainer.inference.Scorer``: DeepFM or LR) over serving-replica tables.

    Sparse deltas go through ``trainer.sync.apply_delta`` (``apply_sync`` in place, per chunk,
    versions per shard: :class:`SparseVersions`);
    a dense delta builds the new (small) head and swaps one reference, so a concurrent ``score``
    sees the old or the new head, never half of each. Snapshots are the trainer's
    (``trainer.snapshots.load_latest(<root>/<model_id>)``), resumed at their ``param_deltas_offset``.
    """

    def __init__(self, model_name: str = "deepfm", config: object | None = None) -> None:
        from trainer.config import named_config
        from trainer.inference import Scorer

        self.config = config if config is not None else named_config(model_name)
        self.scorer = Scorer(self.config)  # type: ignore[arg-type]
        self.model_id: str = self.config.model_id  # type: ignore[attr-defined]
        self.sparse = SparseVersions()
        self.dense = VersionState()
        self.sample_rates = SampleRates()
        self._pooler: SparseModel | None = None
        self._declared: tuple[object, Declared] | None = None

    @property
    def tables(self) -> dict[str, EmbeddingTable]:
        return self.scorer.tables

    @property
    def declared(self) -> Declared:
        config = self.config
        cached = self._declared
        if cached is None or cached[0] is not config:
            cached = self._declared = (config, Declared.of(config.all_slots, config.dense_features))  # type: ignore[attr-defined]
        return cached[1]

    def score(self, user_slots: Slots, item_slots_list: Sequence[Slots], dense: np.ndarray | None = None) -> np.ndarray:
        """The user's fields are looked up and pooled once per request, not once per candidate.

        A field's pooled embedding depends only on its own slot's ids, so one batch whose row 0
        holds the user's slots and whose rows 1..n hold the candidates' (each lacking the other's
        slots: empty bags, which pool to exactly zero) gives, added ``row 0 + row i``, the same
        head input as the merged rows: ``x + 0.0 == x`` (bit-identical scores). That skips
        gathering and pooling the user's ids (20 recent clicks and more) once per candidate and
        building the merged rows. A slot that a candidate and the user both carry (the
        candidate's replaces the user's) falls back to the merged rows.
        """
        import torch

        scorer = self.scorer  # one reference: a concurrent bootstrap swaps in a new scorer
        if not item_slots_list:
            return np.zeros(0, np.float64)
        n_dense = len(scorer.config.dense_features)
        if n_dense and (dense is None or dense.shape != (len(item_slots_list), n_dense)):
            raise ValueError(f"the model reads {n_dense} dense features per item, got "
                             f"{None if dense is None else dense.shape}")
        dense = dense if n_dense else None
        if any(not item.keys().isdisjoint(user_slots) for item in item_slots_list):
            user = dict(user_slots)
            rows = [{**user, **item} for item in item_slots_list]
            return np.asarray(scorer.predict_slot_dicts(rows, dense), dtype=np.float64)
        pooler = self._pooler_for(scorer)
        batch = _request_batch(user_slots, item_slots_list, pooler.cfg.all_slots)
        head = scorer.head  # the head of one dense version for the whole request
        with torch.inference_mode():
            (emb, lin, _), _ = pooler.forward(batch)
            emb = None if emb is None else emb[1:] + emb[:1]
            lin = None if lin is None else lin[1:] + lin[:1]
            x = None if dense is None else torch.from_numpy(np.ascontiguousarray(dense, np.float32))
            return torch.sigmoid(head(emb, lin, x)).numpy().astype(np.float64)

    def _pooler_for(self, scorer: Scorer) -> SparseModel:
        """A :class:`trainer.model.SparseModel` over ``scorer``'s tables whose head returns its
        inputs (the pooled fields): the trainer's own lookup and pooling, the head applied once
        the user's and the candidates' parts are added. Rebuilt when a snapshot brings new tables."""
        from trainer.model import SparseModel

        pooler = self._pooler
        if pooler is None or pooler.tables is not scorer.tables or pooler.cfg is not scorer.config:
            pooler = self._pooler = SparseModel(scorer.config, scorer.tables, _PooledInputs(), train=False)
        return pooler

    def apply_delta(self, msg: ParameterDelta) -> str:
        from trainer.sync import apply_delta, decode_dense

        if msg.model_id != self.model_id:
            raise DeltaRejected("other_model", f"delta for {msg.model_id!r}, serving {self.model_id!r}")
        kind = msg.WhichOneof("payload")
        if kind == "sparse":
            table = self.scorer.tables.get(msg.sparse.table)
            if table is None:
                raise DeltaRejected("unknown_table", f"no table {msg.sparse.table!r}")
            if msg.sparse.dim != table.dim:
                raise DeltaRejected("bad_shape", f"table {table.name} has dim {table.dim}, delta {msg.sparse.dim}")
            check_shard(msg)
            apply_delta(self.scorer.tables, msg)
            self.sparse.done(msg)
        elif kind == "dense":
            rates = delta_sample_rates(msg, self.sample_rates)
            try:
                self.scorer.load_dense(decode_dense(msg))
            except (RuntimeError, ValueError, KeyError) as err:
                raise DeltaRejected("bad_shape", f"dense parameters do not fit the head: {err}") from None
            self.sample_rates = rates
            chunk_done(self.dense, msg)
        else:
            raise DeltaRejected("bad_shape", "delta without payload")
        return kind

    def bootstrap(self, root: Path | None) -> Bootstrap | None:
        from trainer.config import ModelConfig
        from trainer.inference import Scorer
        from trainer.snapshots import load_latest

        if root is None:
            return None
        path = root / self.model_id
        try:
            tables, dense_state, manifest = load_latest(path)
        except FileNotFoundError:
            return None
        self.config = ModelConfig.model_validate(manifest["config"])
        rates = manifest_sample_rates(manifest.get("sample_rates"))  # a bad one fails before the swap
        self.scorer = Scorer(self.config, tables, dense_state)
        self.sample_rates = rates
        created = int(manifest.get("created_at_ms", 0))
        shard_count, versions = manifest_sparse_versions(manifest)
        self.sparse.restore(shard_count, versions, created)
        self.dense.version = int(manifest.get("dense_version", 0))
        self.dense.published_ms = created
        self.dense.pending.clear()
        offset = manifest.get("param_deltas_offset")
        return Bootstrap(path / manifest["name"], self.sparse.version, self.dense.version,
                         int(offset) if offset else None, manifest.get("broker_epoch"),
                         shard_count, versions)

    def snapshot_epoch(self, root: Path | None) -> str | None:
        from trainer.snapshots import read_manifest

        if root is None:
            return None
        try:
            manifest = read_manifest(root / self.model_id)
        except (OSError, ValueError):
            return None  # being replaced right now: the next look sees the new one
        return manifest.get("broker_epoch") if manifest else None


def parameters(model: FMModel | TrainerModel) -> dict[str, np.ndarray]:
    """Every parameter as arrays (for comparing replicas): per table sorted keys and values."""
    out: dict[str, np.ndarray] = {}
    for name, table in model.tables.items():
        keys, values, _s, _t = table.items()
        out[f"{name}.keys"], out[f"{name}.values"] = keys, values
    if isinstance(model, FMModel):
        out.update({f"dense.{k}": v.copy() for k, v in model.dense_params.items()})
    else:
        out.update({f"dense.{k}": v.detach().numpy().copy() for k, v in model.scorer.head.state_dict().items()})
    return out
