"""Pure encode/decode between PS sync chunks / torch state_dicts and ParameterDelta protos.

Serving imports these; nothing here touches Kafka.

>>> import numpy as np
>>> from ps import SyncChunk
>>> c = SyncChunk(np.array([5, 9], np.int64), np.ones((2, 3), np.float32), np.zeros(2, np.int64),
...               np.array([7], np.int64))
>>> msg = encode_sparse("m", 3, "item", 3, c, chunk_index=0, chunk_count=1)
>>> table, keys, values, tomb = decode_sparse(msg)
>>> table, keys.tolist(), values.shape, tomb.tolist()
('item', [5, 9], (2, 3), [7])

Non-finite values are neither sent nor taken (one NaN weight turns every score into NaN):

>>> bad = SyncChunk(c.keys, np.array([[1, 2, 3], [np.nan, 0, 0]], np.float32), np.zeros(2, np.int64), c.tombstones)
>>> encode_sparse("m", 4, "item", 3, bad)
Traceback (most recent call last):
...
trainer.sync.NonFiniteDelta: item: 1 of 2 rows not finite (version 4)
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import torch

from proto import DenseParameters, ParameterDelta, SampleRates, SparseRows, Tensor
from ps import EmbeddingTable, SyncChunk

#: keep each message well under the producer's 1 MiB request size
MAX_MESSAGE_BYTES = 768 * 1024


class NonFiniteDelta(ValueError):
    """A delta with a NaN or infinite value: the trainer does not publish it, serving does not apply it."""


def _check_finite(what: str, values: np.ndarray, version: int) -> None:
    if not np.isfinite(values).all():
        rows = values.reshape(values.shape[0], -1) if values.ndim and values.shape[0] else values.reshape(1, -1)
        bad = int((~np.isfinite(rows)).any(axis=1).sum())
        raise NonFiniteDelta(f"{what}: {bad} of {rows.shape[0]} rows not finite (version {version})")


def rows_per_chunk(dim: int, max_bytes: int = MAX_MESSAGE_BYTES) -> int:
    return max(1, max_bytes // (dim * 4 + 8))


def encode_sparse(model_id: str, version: int, table: str, dim: int, chunk: SyncChunk, *,
                  chunk_index: int = 0, chunk_count: int = 1, created_at_ms: int | None = None,
                  max_event_time_ms: int = 0, shard: int = 0, shard_count: int = 0) -> ParameterDelta:
    keys = np.ascontiguousarray(chunk.keys, "<i8")
    values = np.ascontiguousarray(chunk.values, "<f4").reshape(keys.size, dim)
    tomb = np.ascontiguousarray(chunk.tombstones, "<i8")
    _check_finite(table, values, version)
    return ParameterDelta(
        model_id=model_id, version=version, chunk_index=chunk_index, chunk_count=chunk_count,
        created_at_ms=int(time.time() * 1000) if created_at_ms is None else created_at_ms,
        max_event_time_ms=max_event_time_ms, shard=shard, shard_count=shard_count,
        sparse=SparseRows(table=table, dim=dim, keys=keys.tobytes(), values=values.tobytes(),
                          tombstones=tomb.tobytes()))


def decode_sparse(msg: ParameterDelta) -> tuple[str, np.ndarray, np.ndarray, np.ndarray]:
    """``(table, keys int64 [n], values float32 [n, dim], tombstones int64 [m])`` (read-only views)."""
    s = msg.sparse
    keys = np.frombuffer(s.keys, "<i8")
    values = np.frombuffer(s.values, "<f4").reshape(keys.size, s.dim) if s.dim else np.empty((0, 0), np.float32)
    if values.shape[0] != keys.size:
        raise ValueError(f"{s.table}: {keys.size} keys but {values.shape[0]} rows")
    _check_finite(s.table, values, msg.version)
    return s.table, keys, values, np.frombuffer(s.tombstones, "<i8")


def to_sync_chunk(keys: np.ndarray, values: np.ndarray, tombstones: np.ndarray,
                  event_time_ms: int = 0) -> SyncChunk:
    """A decoded sparse delta as a :class:`ps.SyncChunk` for ``EmbeddingTable.apply_sync``."""
    return SyncChunk(keys, values, np.full(keys.size, event_time_ms, np.int64), tombstones)


def apply_delta(tables: dict[str, EmbeddingTable], msg: ParameterDelta) -> str | None:
    """Apply one sparse delta message to serving replicas; returns the table name (None for dense)."""
    if msg.WhichOneof("payload") != "sparse":
        return None
    table, keys, values, tomb = decode_sparse(msg)
    tables[table].apply_sync(to_sync_chunk(keys, values, tomb, msg.max_event_time_ms))
    return table


def encode_sparse_tables(model_id: str, version: int, tables: dict[str, EmbeddingTable], *,
                         max_event_time_ms: int = 0, shard: int = 0, shard_count: int = 0,
                         confirm: bool = False) -> list[tuple[str, ParameterDelta]]:
    """Drain every table's touched-key stream into ``[(table, delta)]`` of one version (of shard
    ``shard`` of ``shard_count`` when the trainer runs ranks, see ``ParameterDelta.shard``).
    ``confirm``: with no touched row, one empty delta (no rows) still makes the version: a rank
    whose examples changed none of its own rows (every row of a ``sequential_embeddings`` model
    is rank 0's) confirms its shard is current, or serving's per-shard version would stand still."""
    created = int(time.time() * 1000)
    pending: list[tuple[str, int, SyncChunk]] = []
    for name, t in tables.items():
        for c in t.pop_updates(rows_per_chunk(t.dim)):
            pending.append((name, t.dim, c))
    if confirm and not pending and tables:
        name, t = next(iter(tables.items()))
        none = np.zeros(0, np.int64)
        pending.append((name, t.dim, SyncChunk(none, np.zeros((0, t.dim), np.float32), none, none)))
    n = len(pending)
    return [(name, encode_sparse(model_id, version, name, dim, c, chunk_index=i, chunk_count=n,
                                 created_at_ms=created, max_event_time_ms=max_event_time_ms,
                                 shard=shard, shard_count=shard_count))
            for i, (name, dim, c) in enumerate(pending)]


def encode_dense(model_id: str, version: int, state: dict[str, torch.Tensor] | torch.nn.Module, *,
                 max_event_time_ms: int = 0, created_at_ms: int | None = None,
                 sample_rates: Mapping | None = None) -> ParameterDelta:
    """The dense delta; ``sample_rates``: the rates the parameters were trained under
    (:meth:`trainer.sample_rates.SampleRateTracker.rates`: ``{"global": r, "slices": {s: r}}``),
    sent along so serving corrects with them (None: the message carries none)."""
    if isinstance(state, torch.nn.Module):
        state = state.state_dict()
    tensors = []
    for name, t in state.items():
        a = t.detach().to(torch.float32).cpu().contiguous().numpy()
        _check_finite(f"dense {name}", a, version)
        tensors.append(Tensor(name=name, shape=list(a.shape), values=a.astype("<f4").tobytes()))
    return ParameterDelta(model_id=model_id, version=version, chunk_index=0, chunk_count=1,
                          created_at_ms=int(time.time() * 1000) if created_at_ms is None else created_at_ms,
                          max_event_time_ms=max_event_time_ms,
                          dense=DenseParameters(tensors=tensors, sample_rates=None if sample_rates is None else
                                                SampleRates(global_rate=sample_rates["global"],
                                                            slices=sample_rates["slices"])))


def decode_dense(msg: ParameterDelta) -> dict[str, torch.Tensor]:
    """A torch state_dict (float32, owned copies) for ``DenseHead.load_state_dict`` / ``Scorer.load_dense``;
    raises :class:`NonFiniteDelta` when a value is NaN or infinite."""
    state = {}
    for t in msg.dense.tensors:
        a = np.frombuffer(t.values, "<f4").reshape(tuple(t.shape))
        _check_finite(f"dense {t.name}", a, msg.version)
        state[t.name] = torch.from_numpy(a.copy())
    return state


def complete_versions(msgs: Iterable[ParameterDelta]) -> Iterator[list[ParameterDelta]]:
    """Group an in-order stream of sparse deltas into complete versions (all chunks present)."""
    cur: list[ParameterDelta] = []
    for m in msgs:
        if cur and m.version != cur[0].version:
            cur = []
        cur.append(m)
        if len(cur) == m.chunk_count:
            yield sorted(cur, key=lambda x: x.chunk_index)
            cur = []
