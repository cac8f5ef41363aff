"""The online trainer's example-id dedup window: the 128-bit hashes of the last ``capacity``
example ids, in a numba open-addressing table over a ring buffer (lookups and inserts of a whole
batch in one call), saved in snapshots (:meth:`DedupWindow.state` / :meth:`DedupWindow.load`).

The hashes are the ``id_hash`` column the producer ships in each example batch
(:func:`services.example_batch.hash_ids`: BLAKE2b-128 of the UTF-8 example id). Two distinct ids
collide with probability ~2^-128 per pair, i.e. ~1e-25 for a 200k-id window against a billion
examples - never, in practice.

Format change: before the columnar ``examples`` records the window held MurmurHash3 x64-128
hashes (computed by the removed ``trainer.wire`` parser). A window restored from a snapshot of
that time holds hashes no shipped ``id_hash`` equals: duplicates of the examples of its last
window (the joiner's re-emissions after a crash, or examples re-read after a broker reset) are
not recognized, once, after the upgrade. A window restored from a list of id strings (older
snapshots still) is re-hashed with BLAKE2b and works.

>>> from services.example_batch import hash_ids
>>> w = DedupWindow(2)
>>> w.add_many(hash_ids(["a", "b", "c"]))  # "a" leaves: capacity 2
>>> w.contains_many(hash_ids(["a", "b", "c"])).tolist(), len(w)
([False, True, True], 2)
>>> duplicates(w, hash_ids(["x"]), hash_ids(["b", "x", "y", "y"])).tolist()
[True, True, False, True]
"""

from __future__ import annotations

import numpy as np

from ps._jit import njit
from services.example_batch import hash_ids

__all__ = ["DedupWindow", "duplicates"]


@njit
def _probe_home(h1, mask):
    return np.int64(h1 & np.uint64(mask))


@njit
def _win_find(table, ring, h1, h2):
    mask = table.size - 1
    j = _probe_home(h1, mask)
    while True:
        r = table[j]
        if r < 0:
            return -1
        if ring[r, 0] == h1 and ring[r, 1] == h2:
            return j
        j = (j + 1) & mask


@njit
def _win_delete(table, ring, j):
    """Backward-shift deletion at table position ``j`` (linear probing)."""
    mask = table.size - 1
    table[j] = -1
    i = j
    while True:
        j = (j + 1) & mask
        r = table[j]
        if r < 0:
            return
        home = _probe_home(ring[r, 0], mask)
        # keep r where it is when its home lies cyclically in (i, j]
        if i <= j:
            stay = home > i and home <= j
        else:
            stay = home > i or home <= j
        if not stay:
            table[i] = r
            table[j] = -1
            i = j


@njit
def _win_add(table, ring, meta, hashes):
    """Append ``hashes`` to the window (meta = [head, length]); the oldest leave past capacity."""
    cap = ring.shape[0]
    mask = table.size - 1
    for r in range(hashes.shape[0]):
        h1 = hashes[r, 0]
        h2 = hashes[r, 1]
        if _win_find(table, ring, h1, h2) >= 0:
            continue
        head = meta[0]
        if meta[1] == cap:  # full: evict the oldest, at head
            j = _win_find(table, ring, ring[head, 0], ring[head, 1])
            _win_delete(table, ring, j)
        else:
            meta[1] += 1
        ring[head, 0] = h1
        ring[head, 1] = h2
        j = _probe_home(h1, mask)
        while table[j] >= 0:
            j = (j + 1) & mask
        table[j] = head
        meta[0] = head + 1 if head + 1 < cap else 0


@njit
def _win_contains(table, ring, hashes, out):
    for r in range(hashes.shape[0]):
        out[r] = _win_find(table, ring, hashes[r, 0], hashes[r, 1]) >= 0


@njit
def _dedup(table, ring, inflight, hashes, status):
    """Mark DUPLICATE (True) the examples whose id is in the window, in flight, or earlier in this
    batch (``status`` bool, False on entry)."""
    n = hashes.shape[0]
    m = inflight.shape[0]
    size = 16
    while size < 2 * (n + m):
        size *= 2
    mask = size - 1
    seen = np.full(size, -1, np.int64)  # index into the concatenation inflight ++ hashes
    for r in range(m + n):
        if r < m:
            h1 = inflight[r, 0]
            h2 = inflight[r, 1]
        else:
            h1 = hashes[r - m, 0]
            h2 = hashes[r - m, 1]
            if table.size > 0 and _win_find(table, ring, h1, h2) >= 0:
                status[r - m] = True
                continue
        j = _probe_home(h1, mask)
        dup = False
        while seen[j] >= 0:
            q = seen[j]
            a1 = inflight[q, 0] if q < m else hashes[q - m, 0]
            a2 = inflight[q, 1] if q < m else hashes[q - m, 1]
            if a1 == h1 and a2 == h2:
                dup = True
                break
            j = (j + 1) & mask
        if dup:
            if r >= m:
                status[r - m] = True
        else:
            seen[j] = r


class DedupWindow:
    """The 128-bit hashes of the last ``capacity`` example ids (insertion order), in a numba
    open-addressing table over a ring buffer: lookups and inserts of a whole batch in one call."""

    def __init__(self, capacity: int = 200_000):
        self.capacity = int(capacity)
        size = 16
        while size < 2 * self.capacity:
            size *= 2
        self._table = np.full(size if self.capacity > 0 else 0, -1, np.int64)
        self._ring = np.zeros((max(self.capacity, 1), 2), np.uint64)
        self._meta = np.zeros(2, np.int64)  # head (next write), length

    def __len__(self) -> int:
        return int(self._meta[1])

    def add_many(self, hashes: np.ndarray) -> None:
        if self.capacity > 0 and len(hashes):
            _win_add(self._table, self._ring, self._meta, np.ascontiguousarray(hashes, np.uint64))

    def contains_many(self, hashes: np.ndarray) -> np.ndarray:
        hashes = np.ascontiguousarray(hashes, np.uint64).reshape(-1, 2)
        out = np.zeros(len(hashes), np.bool_)
        if self.capacity > 0:
            _win_contains(self._table, self._ring, hashes, out)
        return out

    def __contains__(self, eid: str) -> bool:
        return bool(self.contains_many(hash_ids([eid]))[0])

    def add(self, eid: str) -> None:
        if eid:
            self.add_many(hash_ids([eid]))

    def state(self) -> np.ndarray:
        """The window's hashes, oldest first (``uint64 [n, 2]``)."""
        head, n = int(self._meta[0]), int(self._meta[1])
        if n < self.capacity or self.capacity == 0:
            return self._ring[:n].copy()
        return np.concatenate([self._ring[head:], self._ring[:head]])

    def load(self, state) -> None:
        """From :meth:`state`, or from a list of example id strings (snapshots before the hashes)."""
        self.__init__(self.capacity)
        if isinstance(state, np.ndarray):
            hashes = state.reshape(-1, 2)
        else:
            hashes = hash_ids(list(state))
        self.add_many(hashes[-self.capacity:] if self.capacity else hashes[:0])


def duplicates(window: DedupWindow, inflight: np.ndarray, hashes: np.ndarray) -> np.ndarray:
    """bool ``[n]``: which of ``hashes`` (uint64 ``[n, 2]``) are in ``window``, in ``inflight``
    (the batches handed to training, not applied yet), or earlier in ``hashes`` itself."""
    hashes = np.ascontiguousarray(hashes, np.uint64).reshape(-1, 2)
    inflight = np.ascontiguousarray(inflight, np.uint64).reshape(-1, 2)
    out = np.zeros(len(hashes), np.bool_)
    if len(hashes):
        _dedup(window._table, window._ring, inflight, hashes, out)
    return out
