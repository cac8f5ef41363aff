"""The stable 64-bit hash that turns string feature values into sparse ids.

Sparse ids are int64 everywhere (the store, ``/rank``, the PS tables). A string value becomes
one with :func:`string_id`: BLAKE2b of its UTF-8 bytes with an 8-byte digest (``hashlib``,
RFC 7693), read as a little-endian **signed** int64. The same string gives the same id on every
machine, Python version and process (unlike ``hash()``, which is salted per process), so a
loader, a client and a trainer hashing independently agree. Ids are per slot: equal strings in
two slots give equal ids, and a model that shares a table between slots salts them
(``trainer.config.ModelConfig.salt``).

Collisions: with n distinct values in a slot, about n^2 / 2^65 pairs collide (none expected below
~10^8 values).

>>> string_id("user-42")
-6417657526719176593
>>> string_id("user-42") == string_id("user-42 "), string_id("") == 0
(False, False)
>>> string_ids(["a", "b"]) == [string_id("a"), string_id("b")]
True

String **keys** (the user and item ids ``/rank`` and ``/actions`` name, the key columns of
``driftline features load``) must be non-negative: :func:`string_key` is :func:`string_id` with the
sign bit cleared (``& (2**63 - 1)``), 63 bits, so about n^2 / 2^64 pairs of n keys collide. A slot
that holds the same strings as ids (``item_id`` filled from ``string_key``) stays consistent because
ids and keys travel together: a client, a loader and serving all call :func:`string_key` for keys.

>>> string_key("user-42"), string_key("user-42") == string_id("user-42") & (2**63 - 1)
(2805714510135599215, True)
>>> all(string_key(str(i)) >= 0 for i in range(1000))
True
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def string_id(value: str) -> int:
    """The sparse id of a string: ``int.from_bytes(blake2b(utf8, digest_size=8), "little", signed=True)``."""
    return int.from_bytes(hashlib.blake2b(value.encode("utf-8"), digest_size=8).digest(), "little", signed=True)


def string_key(value: str) -> int:
    """The non-negative key of a string user or item id: ``string_id(value) & (2**63 - 1)``."""
    return string_id(value) & 0x7FFF_FFFF_FFFF_FFFF


def string_ids(values: Iterable[str]) -> list[int]:
    return [string_id(v) for v in values]
