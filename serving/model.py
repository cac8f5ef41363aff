"""The model being served, behind a small interface: :class:`ServingModel`, and the trainer's
model over serving-replica tables, :class:`TrainerModel`.

:class:`ServingModel` is what the app needs: ``score(user_slots, item_slots_list)``,
``apply_delta(msg)``, and the versions (:mod:`serving.versions`). The built-in FM that needs no
trainer is :class:`serving.fm_model.FMModel`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from proto import ParameterDelta
from ps import EmbeddingTable, SyncChunk, TableConfig
from serving.correction import SampleRates
from serving.request_features import Declared
from serving.split_head import SplitHead
from serving.versions import (
    Bootstrap,
    DeltaRejected,
    SparseVersions,
    VersionedModel,
    VersionState,
    manifest_sample_rates,
    manifest_sparse_versions,
)
from trainer.sharding import whole_tables

if TYPE_CHECKING:
    from trainer.batch import SparseBatch
    from trainer.config import ModelConfig
    from trainer.head import DenseHead
    from trainer.inference import Scorer
    from trainer.model import SparseModel

Slots = Mapping[str, Sequence[int]]
_NO_IDS = np.zeros(0, np.int64)


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


def _request_batch(user_slots: Slots, item_slots_list: Sequence[Slots], slots: Sequence[str],
                   item_keys: set[str] | None = None) -> SparseBatch:
    """The :class:`trainer.batch.SparseBatch` of one request: row 0 the user's slots, rows 1..n
    the candidates' (a slot in neither is empty). The user's slots cost O(1) rows, not n.
    ``item_keys``: the slots any candidate carries, when known (the others need no pass over them).

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
        elif item_keys is not None and slot not in item_keys:
            ids[slot] = _NO_IDS
            offs = np.zeros(n + 1, np.int64)
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


class TrainerModel(VersionedModel):
    """The trainer's model (``trainer.inference.Scorer``: DeepFM or LR) over serving-replica tables.

    Sparse deltas go through ``trainer.sync.apply_delta`` (``apply_sync`` in place, per chunk,
    versions per shard: :class:`SparseVersions`);
    a dense delta builds the new (small) head and swaps one reference, so a concurrent ``score``
    sees the old or the new head, never half of each. Snapshots are the trainer's
    (``trainer.snapshots.load_latest(<root>/<model_id>)``), resumed at their ``param_deltas_offset``.
    """

    def __init__(self, model_name: str = "deepfm", config: object | None = None) -> None:
        from driftline.project import named_config
        from trainer.inference import Scorer

        self.config = config if config is not None else named_config(model_name)
        self.scorer = Scorer(self.config)  # type: ignore[arg-type]
        super().__init__(self.config.model_id)  # type: ignore[attr-defined]
        self._pooler: SparseModel | None = None
        self._declared: tuple[object, Declared] | None = None
        self._splits: tuple[object, dict[frozenset[str], SplitHead]] = (None, {})

    @property
    def tables(self) -> dict[str, EmbeddingTable]:
        return self.scorer.tables

    @property
    def declared(self) -> Declared:
        config = self.config
        cached = self._declared
        if cached is None or cached[0] is not config:
            cached = self._declared = (config, Declared.of(config.all_slots, config.dense_features,
                                                         config.position_slot))  # type: ignore[attr-defined]
        return cached[1]

    def score(self, user_slots: Slots, item_slots_list: Sequence[Slots], dense: np.ndarray | None = None) -> np.ndarray:
        """The user's fields are looked up and pooled once per request, not once per candidate.

        A field's pooled embedding depends only on its own slot's ids, so one batch whose row 0
        holds the user's slots and whose rows 1..n hold the candidates' (each lacking the other's
        slots: empty bags, which pool to exactly zero) gives, added ``row 0 + row i``, the same
        head input as the merged rows. That skips gathering and pooling the user's ids (20
        recent clicks and more) once per candidate and building the merged rows; the head then
        takes the user's part once too (:mod:`serving.split_head`). A slot that a candidate and
        the user both carry (the candidate's replaces the user's) falls back to the merged rows.
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
        item_keys: set[str] = set().union(*item_slots_list)
        # a content encoder (trainer.content) is one more field the split head does not know: merged rows
        if not item_keys.isdisjoint(user_slots) or scorer.config.content is not None:
            user = dict(user_slots)
            rows = [{**user, **item} for item in item_slots_list]
            return np.asarray(scorer.predict_slot_dicts(rows, dense), dtype=np.float64)
        pooler = self._pooler_for(scorer)
        batch = _request_batch(user_slots, item_slots_list, pooler.cfg.all_slots, item_keys)
        head = scorer.head  # the head of one dense version for the whole request
        with torch.inference_mode():
            (emb, lin, _), _ = pooler.forward(batch)
            split = self._split_head(head, pooler.cfg, user_slots)
            logits = split.logits(None if emb is None else emb.numpy(), None if lin is None else lin.numpy(),
                                  None if dense is None else np.ascontiguousarray(dense, np.float32))
            return torch.sigmoid(torch.from_numpy(logits)).numpy().astype(np.float64)

    def _split_head(self, head: DenseHead, config: ModelConfig, user_slots: Slots) -> SplitHead:
        """``head`` split for the user's fields (:mod:`serving.split_head`), cached per dense
        version: a handful of field splits (known user or not, clicks or not)."""
        if self._splits[0] is not head:
            self._splits = (head, {})
        cache = self._splits[1]
        user = frozenset(user_slots.keys() & config.slots.keys())
        split = cache.get(user)
        if split is None:
            split = cache[user] = SplitHead(head, list(config.slots), user, config.embed_dim)
        return split

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
        from trainer.sync import NonFiniteDelta

        try:
            return super().apply_delta(msg)
        except NonFiniteDelta as err:  # checked before anything is written: the last good model stays
            raise DeltaRejected("non_finite", str(err)) from None

    def _whole(self) -> frozenset[str]:
        return whole_tables(self.config)

    def _write_sparse(self, msg: ParameterDelta, table: EmbeddingTable) -> None:
        from trainer.sync import apply_delta

        apply_delta(self.scorer.tables, msg)

    def _write_dense(self, msg: ParameterDelta, rates: SampleRates) -> None:
        from trainer.sync import decode_dense

        state = decode_dense(msg)  # a non-finite one raises first (NonFiniteDelta)
        try:
            self.scorer.load_dense(state)
        except (RuntimeError, ValueError, KeyError) as err:
            raise DeltaRejected("bad_shape", f"dense parameters do not fit the head: {err}") from None
        self.sample_rates = rates

    def bootstrap(self, root: Path | None) -> Bootstrap | None:
        from trainer.inference import Scorer
        from trainer.snapshots import load_latest

        if root is None:
            return None
        path = root / self.model_id
        try:
            tables, dense_state, manifest = load_latest(path)
        except FileNotFoundError:
            return None
        self.config = manifest.model_config()
        rates = manifest_sample_rates(manifest.sample_rates)  # a bad one fails before the swap
        self.scorer = Scorer(self.config, tables, dense_state)
        self.sample_rates = rates
        created = int(manifest.created_at_ms or 0)
        shard_count, versions = manifest_sparse_versions(manifest)
        self._restore_versions(shard_count, versions, created, manifest.dense_version, created)
        # 0 is an offset too: a warm start's snapshot predates every delta on the topic (read from
        # its start, every delta is after it, whatever the layout of the trainer that publishes)
        return Bootstrap(path / manifest.name, self.sparse.version, self.dense.version,
                         manifest.param_deltas_offset, manifest.broker_epoch,
                         shard_count, versions)

    def snapshot_epoch(self, root: Path | None) -> str | None:
        from trainer.snapshots import latest

        if root is None:
            return None
        try:
            manifest = latest(root / self.model_id)
        except (OSError, ValueError):
            return None  # being replaced right now: the next look sees the new one
        return manifest.broker_epoch if manifest else None
