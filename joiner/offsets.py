"""Input offsets kept beside a consumer's own state, and what a broker reset does to them.

The joiner and the dumper keep their state outside the broker (RocksDB, Parquet) and their input
offsets in the same store, written in the same atomic batch as the state they produced; no
consumer group. Beside them: the high watermark last seen per partition and the broker epoch
the offsets belong to (:mod:`services.tansu_quirks`, quirk 5).

A broker reset (tansu with memory storage restarted: every topic recreated empty) makes the
offsets meaningless, and worse, valid again once the new topics grow past them, so a consumer
that kept them would silently skip the first records of the new topics. On a reset (noticed by
:class:`services.broker_reset.EpochWatch` while running, or at start-up by an epoch that differs
from the recorded one) the consumer keeps its state, drops the offsets and re-reads the new
topics from their start; :meth:`OffsetBook.reset` gives the store changes for that and counts
what the reset lost: records the broker had that this consumer had not consumed, by the last
high watermark seen (``driftline_broker_reset_lost_total``). Records produced after that last
look and before the reset are not counted (nothing here saw them).

>>> from aiokafka import TopicPartition
>>> book = OffsetBook("demo", [TopicPartition("t", 0)], lambda tp: b"off:" + str(tp.partition).encode())
>>> store = book.commit({TopicPartition("t", 0): 7}, {TopicPartition("t", 0): 10})
>>> book.positions(store.get)
{TopicPartition(topic='t', partition=0): 7}
>>> changes, lost = book.reset(store.get, "e2")
>>> lost, changes[b"off:0"], changes[b"epoch"]
({'t': 3}, None, b'e2')
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

from aiokafka import TopicPartition

from services import metrics

log = logging.getLogger(__name__)
_I64 = struct.Struct("<q")
Get = Callable[[bytes], "bytes | None"]
Changes = dict[bytes, "bytes | None"]  # puts, and deletes (None), for one atomic write
LEGACY_MARKER = "broker-epoch"  # services.broker_reset.state_matches_broker's file, before this module


class OffsetBook:
    """Keys and rules for one consumer's offsets in its store (``get`` reads it; methods return
    the changes to write, ``None`` meaning delete, in the caller's atomic batch)."""

    def __init__(self, service: str, tps: Iterable[TopicPartition], offset_key: Callable[[TopicPartition], bytes],
                 prefix: bytes = b"") -> None:
        self.service = service
        self.tps = list(tps)
        self.offset_key = offset_key
        self.epoch_key = prefix + b"epoch"
        self._hw_prefix = prefix + b"hw:"

    def hw_key(self, tp: TopicPartition) -> bytes:
        return self._hw_prefix + tp.topic.encode() + b":" + str(tp.partition).encode()

    def positions(self, get: Get) -> dict[TopicPartition, int]:
        """The stored next offsets (partitions without one are left out: read from the start)."""
        out = {}
        for tp in self.tps:
            raw = get(self.offset_key(tp))
            if raw is not None:
                out[tp] = _I64.unpack(raw)[0]
        return out

    def commit(self, positions: dict[TopicPartition, int], highwaters: dict[TopicPartition, int]) -> Changes:
        """Changes recording ``positions`` (next offsets) and the high watermarks seen."""
        changes: Changes = {}
        for tp, off in positions.items():
            changes[self.offset_key(tp)] = _I64.pack(off)
        for tp, hw in highwaters.items():
            changes[self.hw_key(tp)] = _I64.pack(hw)
        return changes

    def recorded_epoch(self, get: Get, state_dir: Path | None = None) -> str | None:
        """The broker epoch the stored offsets belong to; ``state_dir``'s marker file for a
        store written before the epoch lived in it; None for a new store."""
        raw = get(self.epoch_key)
        if raw is not None:
            return raw.decode()
        marker = state_dir / LEGACY_MARKER if state_dir is not None else None
        if marker is not None and marker.exists():
            return marker.read_text().strip() or None
        return None

    def reset(self, get: Get, epoch: str) -> tuple[Changes, dict[str, int]]:
        """The broker's data was reset (new ``epoch``): changes that drop the offsets and record
        the epoch, and the records lost per topic (also counted in the metric)."""
        changes: Changes = {}
        lost: dict[str, int] = {}
        for tp in self.tps:
            off, hw = get(self.offset_key(tp)), get(self.hw_key(tp))
            position = _I64.unpack(off)[0] if off is not None else 0
            if hw is not None:
                n = max(0, _I64.unpack(hw)[0] - position)
                lost[tp.topic] = lost.get(tp.topic, 0) + n
            changes[self.offset_key(tp)] = None
            changes[self.hw_key(tp)] = None
        for topic, n in lost.items():
            metrics.BROKER_RESET_LOST.labels(self.service, topic).inc(n)
        changes[self.epoch_key] = epoch.encode()
        return changes, lost

    def at_start(self, get: Get, epoch: str, state_dir: Path | None, kept: str) -> Changes:
        """Start-up: the changes that drop offsets recorded on another broker epoch (a reset
        while this consumer was down: counted and logged, ``kept`` saying what stays) or else
        claim them for ``epoch``."""
        recorded = self.recorded_epoch(get, state_dir)
        if recorded is None or recorded == epoch:
            return {self.epoch_key: epoch.encode()}
        changes, lost = self.reset(get, epoch)
        metrics.BROKER_RESETS.labels(self.service).inc()
        log.warning("%s: the broker's data was reset since the last run (epoch %s, offsets of %s): %s are "
                    "kept, the inputs are re-read from the start of the new topics; records not consumed "
                    "before the reset are lost: %s", self.service, epoch, recorded, kept, lost)
        return changes
