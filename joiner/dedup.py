"""Exact downstream dedup by ``example_id``: the other half of the joiner's delivery guarantee.

The joiner writes ``examples`` at-least-once: after a crash it re-emits the examples of the
batches it had not checkpointed, byte-for-byte the same messages with the same ``example_id``.
Consumers that need each example once (the dumper, an online trainer) drop ids they have seen.
Duplicates are close together in the topic (they come from at most the uncommitted batches
before a crash), so a bounded window of recent ids is exact in practice; the dumper keeps every
id it has written in RocksDB and is exact unconditionally.

>>> from proto import Example
>>> a, b = Example(example_id="r/1", sample_rate=1.0), Example(example_id="r/2", sample_rate=1.0)
>>> [e.example_id for e in dedup([a, b, a])]
['r/1', 'r/2']
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator

from proto import Example


class Deduper:
    """Remembers the last ``capacity`` example ids (None: all of them)."""

    def __init__(self, capacity: int | None = 10_000_000) -> None:
        self.capacity = capacity
        self._seen: OrderedDict[str, None] = OrderedDict()
        self.duplicates = 0

    def first_time(self, example_id: str) -> bool:
        if example_id in self._seen:
            self.duplicates += 1
            return False
        self._seen[example_id] = None
        if self.capacity is not None and len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return True


def dedup(examples: Iterable[Example], deduper: Deduper | None = None) -> Iterator[Example]:
    """The examples whose ids were not seen before, in order."""
    d = deduper or Deduper(capacity=None)
    for e in examples:
        if d.first_time(e.example_id):
            yield e
