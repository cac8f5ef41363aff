"""The two-tier waiting store: a bounded in-memory cache in front of the durable store.

Write path (write-through, batched): every change of a batch goes to an in-memory *dirty*
overlay; :meth:`TieredState.commit` writes the overlay to the durable store as one atomic batch
(together with the input offsets, which the caller puts in the same overlay). Impression records
are also kept in the *cache*, an insertion-ordered dict bounded by ``cache_size``: it is evicted
("spilled") oldest-first when it overflows and when its entries have waited longer than
``spill_after`` (event time). Spilling costs nothing because the record is already durable.

Read path: dirty overlay -> cache -> durable store. Each counted lookup adds one to
:attr:`TieredState.lookups` under its tier (``cache``: the overlay or the cache, ``disk``, ``miss``):
the worker moves them into ``driftline_joiner_lookups_total{tier}``.
"""

from __future__ import annotations

import struct
from collections import Counter, OrderedDict

from joiner.types import KVStore

_MISSING = object()
_T = struct.Struct("<q")  # impression records start with their event time (core.HEADER)


class TieredState:
    def __init__(self, store: KVStore, cache_size: int) -> None:
        self.store = store
        self.cache_size = max(0, int(cache_size))
        self.cache: OrderedDict[bytes, bytes] = OrderedDict()
        self.dirty: dict[bytes, bytes | None] = {}
        # Dirty keys of the ordered indexes by their 3-byte prefix (kind + partition), so a scan
        # merges the store's range with only its own partition's few dirty keys.
        self._dirty_index: dict[bytes, dict[bytes, bytes | None]] = {}
        self.lookups: Counter[str] = Counter()

    # -- reads ---------------------------------------------------------------------------------
    def get(self, key: bytes) -> bytes | None:
        """A record, counting where it was found (for impression and pending-action lookups)."""
        v = self.dirty.get(key, _MISSING)
        if v is _MISSING:
            v = self.cache.get(key)
            if v is not None:
                self.lookups["cache"] += 1
                return v
            v = self.store.get(key)
            self.lookups["miss" if v is None else "disk"] += 1
            return v
        self.lookups["miss" if v is None else "cache"] += 1
        return v  # type: ignore[return-value]

    def peek(self, key: bytes) -> bytes | None:
        """A record, without counting (metadata)."""
        v = self.dirty.get(key, _MISSING)
        if v is not _MISSING:
            return v  # type: ignore[return-value]
        v = self.cache.get(key)
        return v if v is not None else self.store.get(key)

    def scan_items(self, lo: bytes, hi: bytes) -> list[tuple[bytes, bytes]]:
        """Index items in ``[lo, hi)`` as they will be after this batch commits, in key order
        (index keyspaces only; a list, so the caller may change the index while iterating)."""
        assert lo[:3] == hi[:3], "scans stay within one index prefix"
        dirty = self._dirty_index.get(lo[:3])
        items = list(self.store.scan(lo, hi))
        if not dirty:
            return items
        merged = dict(items)
        for k, v in dirty.items():
            if lo <= k < hi:
                if v is None:
                    merged.pop(k, None)
                else:
                    merged[k] = v
        return sorted(merged.items())

    # -- writes --------------------------------------------------------------------------------
    def put(self, key: bytes, value: bytes, *, cache: bool = False) -> None:
        self.dirty[key] = value
        if cache:
            self.cache[key] = value
        elif key in self.cache:
            del self.cache[key]

    def put_index(self, key: bytes, value: bytes = b"") -> None:
        self.dirty[key] = value
        d = self._dirty_index.get(key[:3])
        if d is None:
            d = self._dirty_index[key[:3]] = {}
        d[key] = value

    def delete(self, key: bytes) -> None:
        self.dirty[key] = None
        self.cache.pop(key, None)

    def delete_index(self, key: bytes) -> None:
        self.dirty[key] = None
        d = self._dirty_index.get(key[:3])
        if d is None:
            d = self._dirty_index[key[:3]] = {}
        d[key] = None

    def commit(self, **write_args: object) -> int:
        """Write the batch's changes atomically (``write_args`` go to the store's ``write``);
        return how many keys were written."""
        n = len(self.dirty)
        self.store.write(self.dirty, **write_args)
        self.dirty = {}
        self._dirty_index.clear()
        return n

    def rollback(self) -> None:
        """Forget every change since the last :meth:`commit` (the cache too: it may hold
        uncommitted records; it refills from the store)."""
        self.dirty = {}
        self._dirty_index.clear()
        self.cache.clear()

    def evict(self, older_than_ms: int | None = None) -> int:
        """Spill cache entries beyond ``cache_size`` or with event time < ``older_than_ms``.

        Only call after :meth:`commit`: evicted records must already be durable.
        """
        assert not self.dirty, "evict() after commit()"
        n = 0
        cache = self.cache
        while len(cache) > self.cache_size:
            cache.popitem(last=False)
            n += 1
        if older_than_ms is not None:
            while cache:
                key, value = next(iter(cache.items()))
                if _T.unpack_from(value, 0)[0] >= older_than_ms:
                    break
                del cache[key]
                n += 1
        return n
