"""How a service learns that the broker lost its data (tansu quirk 5, :mod:`services.tansu_quirks`):
the broker epoch, a random id written into a marker topic when the broker's data begins.

:func:`ensure_broker_epoch` writes it (the first writer wins) and :func:`read_broker_epoch` reads
it; a service that keeps state across broker restarts records it beside that state and compares
(:func:`state_matches_broker`); a running consumer checks it before every commit
(:class:`EpochWatch`). A service that must restart to follow a reset exits with
:data:`RESET_EXIT_CODE`. What a reset means for each service is in ``docs/broker-reset.md``.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from pathlib import Path

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from services import metrics
from services.aiokafka_quirks import stop_consumer
from services.kafka import create_topics, producer, start_client
from services.kafka_security import security_options
from services.settings import Settings

__all__ = ["EPOCH_TOPIC", "RESET_EXIT_CODE", "EpochWatch", "ensure_broker_epoch", "read_broker_epoch",
           "state_matches_broker"]

log = logging.getLogger(__name__)

EPOCH_TOPIC = "_driftline-epoch"
# "the broker's data was reset: restart me" (a designed restart, not a crash).
RESET_EXIT_CODE = 3


async def read_broker_epoch(settings: Settings, timeout_s: float = 5.0) -> str | None:
    """The epoch id written when this broker's data began, or None if there is none."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.bootstrap_servers, enable_auto_commit=False, group_id=None,
        fetch_max_wait_ms=settings.kafka.fetch_max_wait_ms, **security_options(settings),
    )
    try:
        await consumer.start()
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
        await stop_consumer(consumer)


async def ensure_broker_epoch(settings: Settings) -> str:
    """Return the broker's epoch id, writing a new one if the broker has none (fresh data)."""
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
    """True when the state in ``state_dir`` was built against this broker's data.

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


class EpochWatch:
    """Tells a running consumer that the broker's data was reset under it.

    :meth:`check` reads the epoch record over a connection kept open (one Fetch, about a
    millisecond on a local broker), so a service can afford it before every commit: that is the
    point after which records read at stale offsets would count as done. A broker with no epoch
    (it has just restarted with empty memory storage) is given a new one first, so every service
    that checks agrees on it. On a change :meth:`check` returns the new epoch, counts it in
    ``driftline_broker_resets_total`` and logs it; the caller then re-reads its input from the
    beginning of the new topics and keeps the state it holds outside the broker.
    """

    def __init__(self, settings: Settings, service: str, epoch: str | None = None) -> None:
        self.settings = settings
        self.service = service
        self.epoch = epoch
        self._consumer: AIOKafkaConsumer | None = None
        self._tp = TopicPartition(EPOCH_TOPIC, 0)

    async def start(self) -> str:
        """Open the watch; return the broker's epoch (written first if it has none)."""
        if self.epoch is None:
            self.epoch = await ensure_broker_epoch(self.settings)
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=self.settings.bootstrap_servers, enable_auto_commit=False, group_id=None,
            fetch_max_wait_ms=self.settings.kafka.fetch_max_wait_ms, **security_options(self.settings),
        )
        await self._consumer.start()
        return self.epoch

    async def stop(self) -> None:
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            await stop_consumer(consumer)

    async def _read_fast(self) -> str | None:
        c = self._consumer
        if c is None:
            return None
        if c.assignment() != {self._tp}:
            if not c.partitions_for_topic(EPOCH_TOPIC):
                return None
            c.assign([self._tp])
        c.seek(self._tp, 0)
        batch = await c.getmany(self._tp, timeout_ms=500, max_records=1)
        records = batch.get(self._tp, [])
        return records[0].value.decode() if records else None

    async def check(self) -> str | None:
        """The new epoch if the broker's data was reset since the last check, else None.

        None also when the broker cannot be asked right now (it is down): the caller's own Kafka
        calls fail then, and the next check, once the broker is back, sees the reset.
        """
        try:
            current = await self._read_fast()
            if current is None:
                # The topic is new or gone (a restarted broker): the slow path writes an epoch.
                current = await asyncio.wait_for(
                    ensure_broker_epoch(self.settings), self.settings.kafka.connect_timeout_s
                )
        except (TimeoutError, KafkaError, OSError) as err:
            log.debug("epoch check failed (%r); the broker is unreachable", err)
            return None
        if current == self.epoch:
            return None
        log.warning(
            "%s: the broker's data was reset (epoch %s -> %s): re-reading the new topics from "
            "their start; state outside the broker is kept", self.service, self.epoch, current,
        )
        self.epoch = current
        metrics.BROKER_RESETS.labels(self.service).inc()
        return current
