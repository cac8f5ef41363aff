"""The partition Kafka's default partitioner gives each key: murmur2 (aiokafka's, the Java
client's), positive, modulo the partition count, for a whole fetch at once.

The joiner checks every input record's partition against its key's (a producer with another
partitioner, such as librdkafka's CRC32 default, puts a click where its impression is not:
:meth:`joiner.worker.Worker.process` forwards it). aiokafka's pure-Python ``murmur2`` costs
~9 µs a key on an idle core, as much as joining the record; here the keys of one length are hashed
together with numpy, 4-byte blocks as uint32 columns (~0.3 µs a key).

>>> from aiokafka.partitioner import murmur2
>>> keys = [b"", b"a", b"ab", b"abc", b"request-1", b"0123456789abcdef0123456789abcdef", None]
>>> murmur2_partitions(keys, 4).tolist() == [(murmur2(k) & 0x7FFFFFFF) % 4 for k in keys[:-1]] + [-1]
True
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

_SEED, _M, _R = 0x9747B28C, np.uint32(0x5BD1E995), np.uint32(24)


def _murmur2_same_length(keys: list[bytes], length: int) -> np.ndarray:
    """murmur2 of ``keys``, every one ``length`` bytes long, as uint32."""
    data = np.frombuffer(b"".join(keys), np.uint8).reshape(len(keys), length)
    h = np.full(len(keys), (_SEED ^ length) & 0xFFFFFFFF, np.uint32)
    blocks = length // 4
    if blocks:
        words = np.ascontiguousarray(data[:, :blocks * 4]).view("<u4")
        for i in range(blocks):
            k = words[:, i] * _M
            k ^= k >> _R
            k *= _M
            h *= _M
            h ^= k
    tail = length % 4
    if tail:
        base = blocks * 4
        if tail == 3:
            h ^= data[:, base + 2].astype(np.uint32) << np.uint32(16)
        if tail >= 2:
            h ^= data[:, base + 1].astype(np.uint32) << np.uint32(8)
        h ^= data[:, base].astype(np.uint32)
        h *= _M
    h ^= h >> np.uint32(13)
    h *= _M
    h ^= h >> np.uint32(15)
    return h


def murmur2_partitions(keys: Sequence[bytes | None], partitions: int) -> np.ndarray:
    """Each key's partition under the default partitioner (-1 for a record without a key)."""
    out = np.full(len(keys), -1, np.int64)
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, k in enumerate(keys):
        if k is not None:
            by_length[len(k)].append(i)
    with np.errstate(over="ignore"):
        for length, idx in by_length.items():
            h = _murmur2_same_length([keys[i] for i in idx], length)
            out[idx] = (h & np.uint32(0x7FFFFFFF)).astype(np.int64) % partitions
    return out
