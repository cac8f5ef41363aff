"""driftline parameter server core: collisionless embedding tables (Monolith-style).

* :class:`EmbeddingTable` - int64 id -> float32 row, exact (no hash collisions), sharded
  by id hash, with per-table admission, TTL expiry, optimizer and touched-key stream.
* :class:`ParameterServer` - many tables; one packed lookup for a batch of many slots.
* :mod:`ps.snapshot` - atomic, checksummed full/incremental snapshots.

Event time is int64 **milliseconds** since the epoch everywhere. Absent or not-yet
admitted ids read as zeros. Typical trainer step::

    emb = ps.gather(batch, insert=True, event_time=t)      # dict slot -> float32 [n, dim]
    ...                                                    # torch forward/backward
    ps.apply_gradients(batch, grads, event_time=t)         # dict slot -> float32 grads
"""

from importlib import import_module
from typing import TYPE_CHECKING

from .config import AdagradConfig, AdamConfig, AdmissionConfig, FtrlConfig, InitializerConfig, SGDConfig, TableConfig
from .errors import (
    InvalidEventTimeError,
    InvalidGradientError,
    InvalidIdsError,
    InvalidInputError,
    NonFiniteGradientError,
    PSError,
    ReadOnlyTableError,
    SnapshotCorruptError,
    SnapshotError,
    SnapshotNotFoundError,
    UnknownTableError,
)

if TYPE_CHECKING:
    from .server import PackedBatch, ParameterServer
    from .shard import TableShard
    from .sharding import ShardRouter
    from .snapshot import load_shard, restore_table, save_shard, save_table
    from .sync import SyncChunk
    from .table import EmbeddingTable

# The tables and the server load numba and its compiled kernels (~0.5 s of CPU per process): they
# are imported on first use, so a process that only reads configuration (a project file, the
# client package, the joiner) does not pay for them.
_MODULE_OF = {
    "PackedBatch": "server", "ParameterServer": "server", "TableShard": "shard", "ShardRouter": "sharding",
    "load_shard": "snapshot", "restore_table": "snapshot", "save_shard": "snapshot", "save_table": "snapshot",
    "SyncChunk": "sync", "EmbeddingTable": "table",
}


def __getattr__(name: str) -> object:
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_MODULE_OF[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "AdagradConfig", "AdamConfig", "AdmissionConfig", "FtrlConfig", "InitializerConfig", "SGDConfig",
    "TableConfig", "EmbeddingTable", "ParameterServer", "PackedBatch",
    "save_table", "restore_table", "save_shard", "load_shard", "TableShard", "ShardRouter", "SyncChunk",
    "PSError", "InvalidInputError", "InvalidIdsError", "InvalidGradientError", "NonFiniteGradientError",
    "InvalidEventTimeError", "UnknownTableError", "ReadOnlyTableError", "SnapshotError",
    "SnapshotCorruptError", "SnapshotNotFoundError",
]
