"""How a service learns that the broker lost its data (tansu quirk 5, :mod:`services.tansu_quirks`):
the broker epoch, a random id written into a marker topic when the broker's data begins.

:func:`ensure_broker_epoch` writes it (the first writer wins) and :func:`read_broker_epoch` reads
it; a service that keeps state across broker restarts records it beside that state and compares
(:func:`state_matches_broker`); a running consumer checks it before every commit
(:class:`EpochWatch`). A service that must restart to follow a reset exits with
:data:`RESET_EXIT_CODE`. What a reset means for each service is in ``docs/broker-reset.md``.

The marker's one record must outlive the broker's retention: Kafka deletes a partition's records
once they are older than ``retention.ms`` (7 days by default), the active segment's included, and
an empty marker reads as a broker whose data began anew: every service would follow a "reset" a
week into the stack's life. So the topic keeps its record for ever (:data:`EPOCH_TOPIC_CONFIG`;
:func:`keep_epoch_record` sets it on a topic created before), and where a record was deleted all
the same (the topic is there, its log starts past 0: not a new broker), a running service writes
back the epoch it knows instead of a new one (:func:`epoch_to_write`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from pathlib import Path

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError

from services import metrics
from services.aiokafka_quirks import stop_consumer
from services.kafka import BrokerUnavailable, connected_admin, create_topics, producer, start_client
from services.kafka_security import security_options
from services.settings import Settings

__all__ = ["EPOCH_TOPIC", "EPOCH_TOPIC_CONFIG", "RESET_EXIT_CODE", "EpochWatch", "ensure_broker_epoch",
           "epoch_to_write", "keep_epoch_record", "read_broker_epoch", "state_matches_broker"]

log = logging.getLogger(__name__)

EPOCH_TOPIC = "_driftline-epoch"
#: the marker topic's configuration: its record is never deleted for its age or the partition's size
EPOCH_TOPIC_CONFIG = {"retention.ms": "-1", "retention.bytes": "-1"}
# "the broker's data was reset: restart me" (a designed restart, not a crash).
RESET_EXIT_CODE = 3


async def read_broker_epoch(settings: Settings, timeout_s: float = 5.0) -> str | None:
    """The epoch id written when this broker's data began, or None if there is none."""
    return (await _read_marker(settings, timeout_s))[0]


async def _read_marker(settings: Settings, timeout_s: float) -> tuple[str | None, int | None]:
    """``(epoch, log start)`` of the marker topic: ``(None, None)`` when there is no topic."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.bootstrap_servers, enable_auto_commit=False, group_id=None,
        fetch_max_wait_ms=settings.kafka.fetch_max_wait_ms, **security_options(settings),
    )
    try:
        await start_client(consumer, settings)  # (no broker: BrokerUnavailable, one line)
        partitions = consumer.partitions_for_topic(EPOCH_TOPIC)
        if not partitions:
            await consumer._client.force_metadata_update()
            partitions = consumer.partitions_for_topic(EPOCH_TOPIC)
        if not partitions:
            return None, None
        tp = TopicPartition(EPOCH_TOPIC, 0)
        consumer.assign([tp])
        start: int | None = None
        try:  # (bounded: without a leader yet, a broker just restarted, it waits the request timeout)
            start = (await asyncio.wait_for(consumer.beginning_offsets([tp]), timeout_s))[tp]
            consumer.seek(tp, start)
        except (TimeoutError, KafkaError):
            await consumer.seek_to_beginning(tp)  # (the log start unknown: taken for a new broker's)
        batch = await consumer.getmany(tp, timeout_ms=int(timeout_s * 1000), max_records=1)
        records = batch.get(tp, [])
        return (records[0].value.decode() if records else None), start
    finally:
        await stop_consumer(consumer)


def epoch_to_write(log_start: int | None, remembered: str | None) -> str | None:
    """The epoch a service writes into an empty marker: None for a new one (the broker's data
    began anew: no topic, or one whose log starts at 0), or the epoch it ``remembered`` when the
    marker's record was deleted from a topic that kept its offsets (retention, DeleteRecords).

    >>> epoch_to_write(None, "e1"), epoch_to_write(0, "e1"), epoch_to_write(1, "e1"), epoch_to_write(1, None)
    (None, None, 'e1', None)
    """
    return remembered if log_start and remembered else None


async def ensure_broker_epoch(settings: Settings, remembered: str | None = None) -> str:
    """Return the broker's epoch id, writing one if the broker has none: a new one for fresh data,
    or ``remembered`` (the epoch the caller knows) when only the marker's record was deleted."""
    return (await _ensure(settings, remembered))[0]


async def _ensure(settings: Settings, remembered: str | None) -> tuple[str, int]:
    """:func:`ensure_broker_epoch`, and the offset its record is at."""
    existing, log_start = await _read_marker(settings, timeout_s=1.0)
    if existing:
        return existing, log_start or 0
    epoch = epoch_to_write(log_start, remembered)
    if epoch is not None:
        log.warning("the broker epoch's record was deleted from %s (its log starts at %d): the broker kept its "
                    "data, so epoch %s is written back, not a new one", EPOCH_TOPIC, log_start, epoch)
    epoch = epoch or uuid.uuid4().hex
    await create_topics(settings, {EPOCH_TOPIC: 1}, configs={EPOCH_TOPIC: EPOCH_TOPIC_CONFIG})
    p = producer(settings, compression_type=None)
    await start_client(p, settings)
    try:
        await p.send_and_wait(EPOCH_TOPIC, epoch.encode(), partition=0)
    finally:
        await p.stop()
    # Two starters may race: the first record wins for everyone.
    first, at = await _read_marker(settings, timeout_s=5.0)
    return (first, at or 0) if first else (epoch, log_start or 0)


async def keep_epoch_record(settings: Settings) -> bool:
    """Give a marker topic created without :data:`EPOCH_TOPIC_CONFIG` (by an older version: the
    broker's retention) that configuration; True when it has it. False, with a warning that says
    how to set it by hand, when the broker does not allow it (an ACL, a broker without
    AlterConfigs: the embedded one, whose memory storage never keeps a topic that old)."""
    resource = ConfigResource(ConfigResourceType.TOPIC, EPOCH_TOPIC)
    try:
        async with connected_admin(settings) as admin:
            [described] = await admin.describe_configs([resource])
            current = {entry[0]: entry[1] for res in described.resources for entry in res[4]}
            if all(current.get(k) == v for k, v in EPOCH_TOPIC_CONFIG.items()):
                return True
            answers = await admin.alter_configs([ConfigResource(ConfigResourceType.TOPIC, EPOCH_TOPIC,
                                                                configs=EPOCH_TOPIC_CONFIG)])
            errors = [f"{res[1] or res[0]}" for answer in answers for res in answer.resources if res[0]]
            if errors:
                raise KafkaError("; ".join(errors))
    except (KafkaError, BrokerUnavailable, OSError, TimeoutError) as err:
        log.warning("the broker epoch's topic %s keeps its record only for the broker's retention (%r): once "
                    "that deletes it, a service starting in the seconds before a running one writes it back "
                    "takes the broker for a new one. Set it by hand: kafka-configs.sh --bootstrap-server %s "
                    "--alter --entity-type topics --entity-name %s --add-config %s", EPOCH_TOPIC, err,
                    settings.bootstrap_servers, EPOCH_TOPIC, ",".join(f"{k}={v}" for k, v in EPOCH_TOPIC_CONFIG.items()))
        return False
    log.info("the broker epoch's topic %s now keeps its record for ever (%s)", EPOCH_TOPIC, EPOCH_TOPIC_CONFIG)
    return True


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
        self._at = 0  # where the marker's record is: past 0 once it was deleted and written back

    async def start(self) -> str:
        """Open the watch; return the broker's epoch (written first if it has none)."""
        if self.epoch is None:
            self.epoch, self._at = await _ensure(self.settings, None)
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
        c.seek(self._tp, self._at)
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
                # The topic is new or gone (a restarted broker), or its record deleted: the slow path
                # writes an epoch (ours again in the last case).
                current, self._at = await asyncio.wait_for(
                    _ensure(self.settings, self.epoch), self.settings.kafka.connect_timeout_s
                )
        except (TimeoutError, KafkaError, OSError, BrokerUnavailable) as err:
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
