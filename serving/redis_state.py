"""What Redis says of its own state, apart from any key: whether it takes writes now
(:func:`refuses_all_writes`) and whether it may evict, and did evict, keys (:class:`Evictions`).
Either is the store's condition, never a record's: a write it refuses for now is tried again, and
features it may have evicted are not trusted as training data (:mod:`serving.store_watch`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import (
    BusyLoadingError,
    ClusterDownError,
    MasterDownError,
    OutOfMemoryError,
    ReadOnlyError,
    TryAgainError,
)

#: what Redis answers a write it takes from nobody for now: full at its ``maxmemory`` under
#: ``noeviction`` (OOM), a replica (READONLY), loading its file, a cluster slot moving or down
_REFUSES_ALL = (OutOfMemoryError, ReadOnlyError, BusyLoadingError, TryAgainError, ClusterDownError, MasterDownError)


def refuses_all_writes(err: Exception) -> bool:
    """Whether a write's error is the store's state rather than the write's: Redis would refuse
    any write now (see ``_REFUSES_ALL``; and ``MISCONF``: it cannot persist, its disk full;
    ``BUSY``: a script runs; ``NOREPLICAS``). Such a write is tried again later, never set aside
    as the record's fault.

    >>> from redis.exceptions import ResponseError
    >>> refuses_all_writes(OutOfMemoryError("command not allowed when used memory > 'maxmemory'."))
    True
    >>> refuses_all_writes(ResponseError("MISCONF Errors writing to the AOF file: No space left on device"))
    True
    >>> refuses_all_writes(ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"))
    False
    """
    return isinstance(err, _REFUSES_ALL) or str(err).startswith(("MISCONF", "BUSY ", "NOREPLICAS"))


@dataclass(frozen=True)
class Evictions:
    """What Redis says of evicting keys (``INFO``): its policy, its memory bound, the keys it
    evicted since it started, and which start that is (``run_id``; a Cluster: every master's).

    >>> Evictions("allkeys-lru", 1 << 30, 5, "r1").may_evict_features
    True
    >>> Evictions("volatile-lru", 1 << 30, 5, "r1").may_evict_features  # (features have no TTL)
    False
    >>> Evictions.since("12 keys at 99; evicted 3 on r1", Evictions("allkeys-lru", 1, 5, "r1"))
    2
    >>> Evictions.since("12 keys at 99; evicted 3 on r0", Evictions("allkeys-lru", 1, 5, "r1"))  # (restarted)
    5
    >>> Evictions.since("12 keys at 99", Evictions("allkeys-lru", 1, 5, "r1")) is None
    True
    """

    policy: str
    maxmemory: int
    evicted: int
    run_id: str

    @property
    def may_evict_features(self) -> bool:
        """Whether Redis may evict any key, features included (``allkeys-*`` with a memory bound;
        ``volatile-*`` evicts only keys with a TTL, which features have not)."""
        return self.maxmemory > 0 and self.policy.startswith("allkeys-")

    def stamp(self) -> str:
        """What a load's marker records of them (:meth:`since` reads it back)."""
        return f"evicted {self.evicted} on {self.run_id}"

    @staticmethod
    def since(marker: str, now: Evictions) -> int | None:
        """Keys evicted since the load that wrote ``marker`` (None: the marker does not say)."""
        m = _STAMPED.search(marker)
        if m is None:
            return None
        return now.evicted - (int(m.group(1)) if m.group(2) == now.run_id else 0)

    @classmethod
    def of(cls, infos: Sequence[Mapping[str, Any]]) -> Evictions:
        """From the ``INFO`` of each master."""
        evicting = [i for i in infos if str(i.get("maxmemory_policy", "")).startswith("allkeys-")]
        return cls(str((evicting or infos)[0].get("maxmemory_policy", "noeviction")),
                   max(int(i.get("maxmemory", 0)) for i in (evicting or infos)),
                   sum(int(i.get("evicted_keys", 0)) for i in infos),
                   ",".join(sorted(str(i.get("run_id", "?")) for i in infos)))


_STAMPED = re.compile(r"; evicted (\d+) on (\S+)$")
