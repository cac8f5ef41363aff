"""A rank's input: which partitions of ``examples`` it reads, where each starts, one round's poll.

Rank ``r`` of ``N`` reads the partitions ``p`` of ``examples`` with ``p % N == r`` by manual
assignment (no group rebalance: the assignment is a function of the rank). A partition starts at
the offset in the rank's snapshot, else at the group's committed offset, else at its earliest
record; after a broker reset (``from_start``) at its earliest record, never at a committed offset
(a commit of the old epoch may have reached the new broker). With more ranks than partitions some
ranks read nothing and only serve their shard.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import numpy as np
from aiokafka import TopicPartition

from ..batch import SparseBatch
from ..config import ModelConfig
from ..ingest import Decoded, Ingest

log = logging.getLogger(__name__)


class InputError(RuntimeError):
    """The examples topic cannot be read (it has no partitions)."""


def my_partitions(partitions: int, rank: int, world: int) -> list[int]:
    """The partitions of ``examples`` rank ``rank`` of ``world`` reads: ``p % world == rank``.

    >>> my_partitions(4, 1, 2), my_partitions(4, 0, 3), my_partitions(2, 2, 3)
    ([1, 3], [0, 3], [])
    """
    return [p for p in range(partitions) if p % world == rank]


def empty_batch(cfg: ModelConfig) -> SparseBatch:
    """What an idle rank steps with (every rank takes part in every collective)."""
    dense = np.zeros((0, len(cfg.dense_features)), np.float32) if cfg.dense_features else None
    return SparseBatch.from_slot_dicts([], dense, slots=cfg.all_slots, labels=np.zeros(0, np.float32),
                                       event_time_ms=np.zeros(0, np.int64))


class RankInput:
    """Rank ``rank`` of ``world``'s consumer of ``topic`` (the :class:`trainer.ingest.Ingest`'s)."""

    def __init__(self, ingest: Ingest, topic: str, rank: int, world: int, batch_size: int, batch_timeout_s: float,
                 stage: Callable[[str, float], None]):
        self.ingest, self.topic, self.rank, self.world = ingest, topic, rank, world
        self.batch_size, self.batch_timeout_s, self._stage = batch_size, batch_timeout_s, stage
        self.partitions: list[int] = []
        self._per_record = float(batch_size)  # examples per record lately

    async def assign(self, offsets: dict[int, int], from_start: bool = False) -> dict[int, int]:
        """Assign this rank's partitions, put each at its start (see the module docstring) and
        return the start of each (``offsets``: the known ones, of a snapshot)."""
        c = self.ingest.consumer.consumer
        await c.topics()  # metadata
        n = len(c.partitions_for_topic(self.topic) or ())
        if n == 0:
            raise InputError(f"topic {self.topic} has no partitions")
        self.partitions = my_partitions(n, self.rank, self.world)
        tps = [TopicPartition(self.topic, p) for p in self.partitions]
        c.assign(tps)
        # a snapshot of another assignment may name partitions this rank does not read
        starts = {p: o for p, o in offsets.items() if p in self.partitions}
        for tp in tps:
            off = starts.get(tp.partition)
            if off is None and not from_start:
                off = await c.committed(tp)
            if off is None:
                off = (await c.beginning_offsets([tp]))[tp]
            c.seek(tp, off)
            starts[tp.partition] = off
        log.info("rank %d/%d reads %s[%s] from %s", self.rank, self.world, self.topic, self.partitions, starts)
        return starts

    async def poll_round(self, stop: asyncio.Event):
        """Records until ``batch_size`` examples or ``batch_timeout_s``: ``(records, decoded, polled_at_ms)``
        (a rank without partitions waits out the timeout: the others' round takes as long)."""
        t0 = time.perf_counter()
        end = time.monotonic() + self.batch_timeout_s
        recs, decoded, polled_at = [], Decoded(), int(time.time() * 1000)
        while decoded.examples < self.batch_size and not stop.is_set():
            left = end - time.monotonic()
            if left <= 0 or not self.partitions:
                if not self.partitions:
                    await asyncio.sleep(max(0.0, left))
                break
            # about as many records as complete the batch (by the examples per record lately), as
            # the 1-process trainer polls: a batch does not swallow everything fetched
            want = max(1, int((self.batch_size - decoded.examples) / self._per_record))
            got = await self.ingest.consumer.poll(timeout_ms=max(1, int(min(0.1, left) * 1000)), max_records=want)
            if got:
                recs.extend(got)
                before = decoded.examples
                await self.ingest.decode_records(got, decoded)
                self._per_record = max(1.0, 0.8 * self._per_record + 0.2 * (decoded.examples - before) / len(got))
        self._stage("poll", time.perf_counter() - t0)
        return recs, decoded, polled_at
