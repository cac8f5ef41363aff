"""The joiner's interfaces: the durable key-value store under the waiting state.

Store implementations live in :mod:`joiner.stores` and are chosen by URL (``memory://``,
``rocksdb://path``), Faust style. A store is an ordered byte-key map with atomic multi-key writes:
that is all the join needs (point lookups for joins, ordered range scans for event-time indexes,
and one atomic write per batch that carries the state *and* the input offsets together).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class KVStore(Protocol):
    """An ordered bytes -> bytes map with atomic batched writes."""

    url: str

    def get(self, key: bytes) -> bytes | None: ...

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]: ...

    def scan(self, lo: bytes, hi: bytes) -> Iterator[tuple[bytes, bytes]]:
        """Items with ``lo <= key < hi`` in key order (:class:`services.rocksdb_faults.StoreDamaged` if it cannot read them all)."""
        ...

    def write(self, changes: Mapping[bytes, bytes | None]) -> None:
        """Apply puts (bytes) and deletes (None) atomically: all or nothing, even on kill -9."""
        ...

    def close(self) -> None: ...
