"""``memory://``: a sorted dict. Not durable: for tests and for trying the joiner out."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from sortedcontainers import SortedDict


class MemoryStore:
    def __init__(self, url: str = "memory://") -> None:
        self.url = url
        self._data: SortedDict = SortedDict()

    def get(self, key: bytes) -> bytes | None:
        return self._data.get(key)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [self._data.get(k) for k in keys]

    def scan(self, lo: bytes, hi: bytes) -> Iterator[tuple[bytes, bytes]]:
        for k in list(self._data.irange(lo, hi, inclusive=(True, False))):
            yield k, self._data[k]

    def write(self, changes: Mapping[bytes, bytes | None]) -> None:
        for k, v in changes.items():
            if v is None:
                self._data.pop(k, None)
            else:
                self._data[k] = v

    def close(self) -> None:
        pass
