"""Which version of the model a replica serves, and what a delta or a snapshot brings.

Sparse versions are per shard (:class:`SparseVersions`): a trainer running N ranks publishes each
rank's shard with its own version sequence (``ParameterDelta.shard`` / ``shard_count``), and the
shards interleave on the one delta partition in no fixed order. The shards own disjoint ids
(``trainer.sharding.shard_of``, except a sequential model's first-order tables: all shard 0's,
``whole_tables``; a delta with a row of another shard is rejected, ``wrong_shard``),
so applying each shard's deltas in its own order gives the union of the trainer's shards whatever
the interleaving, and every shard's version is counted on its own. ``sparse.version`` is the
*minimum* over the shards: the newest version every shard has reached (what the FeatureLog's
``ModelVersion.sparse_version`` and the old single gauge carry; see :class:`SparseVersions`).

A version counts as served once all its chunks are applied (:func:`chunk_done`); chunks of a newer
version become visible as they arrive (Monolith does the same).

>>> v = SparseVersions(); v.restore(2, {0: 3, 1: 5}); v.version, v.versions()
(3, {'0': 3, '1': 5})
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from proto import ParameterDelta
from ps import EmbeddingTable
from serving.correction import BadSampleRates, SampleRates
from trainer.manifest import Manifest

__all__ = ["Bootstrap", "DeltaRejected", "SparseVersions", "VersionState", "VersionedModel", "check_shard",
           "chunk_done", "delta_sample_rates", "manifest_sample_rates", "manifest_sparse_versions"]


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


def manifest_sparse_versions(manifest: Manifest | Mapping) -> tuple[int, dict[int, int]]:
    """``(shard_count, {shard: version})`` a snapshot holds: ``shard_count`` and ``sparse_versions``
    written by an N-rank trainer, or the one ``sparse_version`` of a one-process trainer."""
    man = Manifest.from_dict(manifest)
    if man.shards and man.sparse_versions is not None:
        return man.shards, dict(man.sparse_versions)
    return man.shards, {0: man.sparse_version}


def check_shard(msg: ParameterDelta, whole: frozenset[str] = frozenset()) -> None:
    """Refuse a sparse delta whose shard is not in its layout or that carries rows another shard
    owns: two shards writing one row would make replicas depend on how the shards interleave.
    ``whole``: the tables that live whole on rank 0 (``trainer.sharding.whole_tables``: a
    sequential model's first-order tables), whose rows shard 0 owns, every one."""
    n, shard = msg.shard_count, msg.shard
    if shard >= max(1, n):
        raise DeltaRejected("bad_shard", f"shard {shard} of shard_count {n}")
    if n <= 1:
        return
    from trainer.sharding import shard_of  # the one sharding function; numpy + ps only

    for what, raw in (("keys", msg.sparse.keys), ("tombstones", msg.sparse.tombstones)):
        ids = np.frombuffer(raw, dtype="<i8").astype(np.int64)
        owners = np.zeros(ids.size, np.int64) if msg.sparse.table in whole else shard_of(ids, n)
        if ids.size and not bool((owners == shard).all()):
            raise DeltaRejected("wrong_shard", f"{msg.sparse.table}: {what} of another shard in "
                                               f"shard {shard} of {n} (version {msg.version})")


class DeltaRejected(ValueError):
    """A delta that cannot be applied to this model; ``reason`` is a metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


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


class VersionedModel:
    """What every served model shares: its versions, the sample rates its parameters were trained
    under, and a delta's checks and bookkeeping. A model brings its ``tables``, how a checked chunk
    is written (:meth:`_write_sparse`, :meth:`_write_dense`) and the tables that live whole on
    shard 0 (:meth:`_whole`, for :func:`check_shard`)."""

    tables: Mapping[str, EmbeddingTable]

    def __init__(self, model_id: str) -> None:
        self.model_id = model_id
        self.sparse = SparseVersions()
        self.dense = VersionState()
        self.sample_rates = SampleRates()

    def apply_delta(self, msg: ParameterDelta) -> str:
        """Apply one chunk in place; return its kind ("sparse" or "dense"). A chunk that does not
        fit raises :class:`DeltaRejected` before anything of it is written."""
        if msg.model_id != self.model_id:
            raise DeltaRejected("other_model", f"delta for {msg.model_id!r}, serving {self.model_id!r}")
        kind = msg.WhichOneof("payload")
        if kind == "sparse":
            rows = msg.sparse
            table = self.tables.get(rows.table)
            if table is None:
                raise DeltaRejected("unknown_table", f"no table {rows.table!r}")
            if rows.dim != table.dim:
                raise DeltaRejected("bad_shape", f"table {rows.table} has dim {table.dim}, delta {rows.dim}")
            check_shard(msg, self._whole())
            self._write_sparse(msg, table)
            self.sparse.done(msg)
        elif kind == "dense":
            self._write_dense(msg, delta_sample_rates(msg, self.sample_rates))
            chunk_done(self.dense, msg)
        else:
            raise DeltaRejected("bad_shape", "delta without payload")
        return kind

    def _whole(self) -> frozenset[str]:
        return frozenset()

    def _write_sparse(self, msg: ParameterDelta, table: EmbeddingTable) -> None:
        raise NotImplementedError

    def _write_dense(self, msg: ParameterDelta, rates: SampleRates) -> None:
        """Write the dense chunk and take ``rates`` (the sample rates it brings) with it."""
        raise NotImplementedError

    def _restore_versions(self, shard_count: int, versions: Mapping[int, int], sparse_ms: int,
                          dense_version: int, dense_ms: int) -> None:
        """The versions a snapshot holds become the served ones (chunks pending are forgotten)."""
        self.sparse.restore(shard_count, versions, sparse_ms)
        self.dense.version = dense_version
        self.dense.published_ms = dense_ms
        self.dense.pending.clear()
