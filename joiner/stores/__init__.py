"""Waiting-state stores, chosen by URL: ``memory://`` (tests) or ``rocksdb://<path>`` (default)."""

from __future__ import annotations

from urllib.parse import urlparse

from joiner.types import KVStore


def open_store(url: str) -> KVStore:
    """Open the store a URL names. ``rocksdb://var/joiner/state`` is a relative path,
    ``rocksdb:///abs/path`` an absolute one."""
    scheme = urlparse(url).scheme
    if scheme == "memory":
        from joiner.stores.memory import MemoryStore

        return MemoryStore(url)
    if scheme == "rocksdb":
        from joiner.stores.rocksdb import RocksDBStore

        return RocksDBStore(url)
    raise ValueError(f"unknown store URL {url!r}: use memory:// or rocksdb://<path>")
