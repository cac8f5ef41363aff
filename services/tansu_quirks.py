"""Every way the embedded tansu broker (0.6.0) differs from Apache Kafka, worked around here only.

Each workaround is also correct on Apache Kafka, so the same code runs against both:

1. ListOffsets(LATEST) answers the base offset of the last record batch + 1, not the log-end
   offset, so ``end_offsets()`` is too low whenever the last batch held several records. The high
   watermark in a Fetch response is right: :func:`log_end_offsets` reads that instead.
2. The first group generation is 0, and aiokafka sends LeaveGroup only above 0, so a cleanly
   stopped first-generation member lingers until its session times out and the next member's
   join waits for it. :func:`install` makes aiokafka leave at any valid generation (>= 0; -1 is
   aiokafka's "no generation").
3. A first group join waits about half the session timeout: the default session timeout in
   :mod:`services.settings` is 10 s for that reason.
4. ``list_consumer_group_offsets(group)`` without explicit partitions breaks the connection:
   :func:`committed_offsets` always names the partitions.
5. Memory storage is lost when the broker restarts. :func:`ensure_broker_epoch` writes a random
   epoch id into a marker topic when the stack starts; a service that keeps state across broker
   restarts compares it with the one stored beside its state (:func:`state_matches_broker`) and
   discards stale state with a clear log line instead of crashing on offsets that no longer exist.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterable
from pathlib import Path

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.consumer import group_coordinator

from services.settings import Settings

log = logging.getLogger(__name__)

EPOCH_TOPIC = "_driftline-epoch"
_installed = False


def install() -> None:
    """Patch aiokafka so a member of generation 0 sends LeaveGroup on a clean stop (quirk 2)."""
    global _installed
    if _installed:
        return
    coordinator = group_coordinator.GroupCoordinator
    original = coordinator._maybe_leave_group

    async def _maybe_leave_group(self: group_coordinator.GroupCoordinator) -> None:
        if self.generation == 0:
            # aiokafka only leaves above generation 0; bump it for the check alone.
            # The LeaveGroup request itself carries only group and member id.
            self.generation = 1
        await original(self)

    coordinator._maybe_leave_group = _maybe_leave_group  # type: ignore[method-assign]
    _installed = True


async def log_end_offsets(
    settings: Settings, partitions: Iterable[TopicPartition]
) -> dict[TopicPartition, int]:
    """The true log-end offset (high watermark) of each partition, read from a Fetch (quirk 1)."""
    tps = list(partitions)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.bootstrap_servers, enable_auto_commit=False, group_id=None
    )
    await consumer.start()
    try:
        consumer.assign(tps)
        # ListOffsets(LATEST) is at most the true end, so a fetch from there is short and its
        # response carries the true high watermark.
        approx = await consumer.end_offsets(tps)
        for tp in tps:
            consumer.seek(tp, approx[tp])
        result: dict[TopicPartition, int] = {}
        deadline = asyncio.get_running_loop().time() + settings.kafka.connect_timeout_s
        while len(result) < len(tps):
            await consumer.getmany(*tps, timeout_ms=200, max_records=1)
            for tp in tps:
                hw = consumer.highwater(tp)
                if hw is not None:
                    result[tp] = max(hw, approx[tp])
            if asyncio.get_running_loop().time() > deadline:
                for tp in tps:
                    result.setdefault(tp, approx[tp])
        return result
    finally:
        await consumer.stop()


async def committed_offsets(
    settings: Settings, group_id: str, partitions: Iterable[TopicPartition]
) -> dict[TopicPartition, int]:
    """A group's committed offsets, asking for the partitions by name (quirk 4). -1 = none."""
    tps = list(partitions)
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap_servers)
    await admin.start()
    try:
        answer = await admin.list_consumer_group_offsets(group_id, partitions=tps)
        return {tp: (meta.offset if meta is not None else -1) for tp, meta in answer.items()}
    finally:
        await admin.close()


async def read_broker_epoch(settings: Settings, timeout_s: float = 5.0) -> str | None:
    """The epoch id written when this broker's data began, or None if there is none."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.bootstrap_servers, enable_auto_commit=False, group_id=None
    )
    await consumer.start()
    try:
        partitions = consumer.partitions_for_topic(EPOCH_TOPIC)
        if not partitions:
            await consumer._client.force_metadata_update()
            partitions = consumer.partitions_for_topic(EPOCH_TOPIC)
        if not partitions:
            return None
        tp = TopicPartition(EPOCH_TOPIC, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        batch = await consumer.getmany(tp, timeout_ms=int(timeout_s * 1000), max_records=1)
        records = batch.get(tp, [])
        return records[0].value.decode() if records else None
    finally:
        await consumer.stop()


async def ensure_broker_epoch(settings: Settings) -> str:
    """Return the broker's epoch id, writing a new one if the broker has none (fresh data)."""
    from services.kafka import create_topics, producer, start_client

    existing = await read_broker_epoch(settings, timeout_s=1.0)
    if existing:
        return existing
    await create_topics(settings, {EPOCH_TOPIC: 1})
    epoch = uuid.uuid4().hex
    p = producer(settings, compression_type=None)
    await start_client(p, settings)
    try:
        await p.send_and_wait(EPOCH_TOPIC, epoch.encode(), partition=0)
    finally:
        await p.stop()
    # Two starters may race: the first record wins for everyone.
    return await read_broker_epoch(settings) or epoch


def state_matches_broker(state_dir: Path, epoch: str | None) -> bool:
    """True when the state in ``state_dir`` was built against this broker's data (quirk 5).

    On a mismatch the caller must discard the state. A directory without a recorded epoch is
    claimed for this one.
    """
    marker = state_dir / "broker-epoch"
    if epoch is None:
        return True
    if not marker.exists():
        state_dir.mkdir(parents=True, exist_ok=True)
        marker.write_text(epoch)
        return True
    recorded = marker.read_text().strip()
    if recorded != epoch:
        log.warning(
            "the broker's data was reset (epoch %s, state built on %s: tansu memory storage "
            "does not survive a restart); discarding the state in %s",
            epoch, recorded, state_dir,
        )
        return False
    return True
