"""Kafka I/O every service shares: producers, topic creation, and a typed consumer.

The typed consumer is where the promise "bad input loses nothing" is kept: a record that does not
decode or validate is written, untouched and with its reason, to the dead-letter topic and counted
before its offset can be committed. Offsets are committed only when the caller says its work is
done (:meth:`TypedConsumer.commit`), so a crash re-delivers uncommitted records instead of losing
them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import CommitFailedError, KafkaConnectionError, KafkaError, KafkaTimeoutError, TopicAlreadyExistsError
from google.protobuf.message import Message

from proto import DeadLetter
from services import metrics, tansu_quirks
from services.aiokafka_quirks import stop_consumer
from services.codecs import Codec, MalformedMessage, codec_for
from services.kafka_security import security_options
from services.settings import Settings

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
T = TypeVar("T")


class BrokerUnavailable(RuntimeError):
    """Kafka cannot be reached. The message says where we looked and what to do."""


def _unreachable(settings: Settings) -> BrokerUnavailable:
    """The one line a client that cannot connect says: where, how, and what to do (no secret);
    counted in ``driftline_kafka_connect_failures_total``.

    >>> from services.settings import KafkaClientSettings
    >>> k = KafkaClientSettings(security_protocol="SASL_PLAINTEXT", sasl_username="u", sasl_password="pw")
    >>> str(_unreachable(Settings(kafka_bootstrap_servers="kafka:9093", kafka=k)))
    'cannot reach Kafka at kafka:9093 over SASL_PLAINTEXT as u (PLAIN): check the broker address and kafka.security_protocol, kafka.sasl_* (the client log above says why)'
    """
    k = settings.kafka
    metrics.KAFKA_CONNECT_FAILURES.labels(k.security_protocol).inc()
    if k.security_protocol == "PLAINTEXT":
        return BrokerUnavailable(
            f"cannot reach Kafka at {settings.bootstrap_servers}: run `make up` for the embedded broker, "
            "or set KAFKA_BOOTSTRAP_SERVERS to a running one"
        )
    sasl, tls = k.security_protocol.startswith("SASL_"), k.security_protocol.endswith("SSL")
    who = f" as {k.sasl_username} ({k.sasl_mechanism})" if sasl else ""
    knobs = ", ".join(["kafka.security_protocol"] + ["kafka.sasl_*"] * sasl + ["kafka.ssl_*"] * tls)
    return BrokerUnavailable(f"cannot reach Kafka at {settings.bootstrap_servers} over {k.security_protocol}{who}: "
                             f"check the broker address and {knobs} (the client log above says why)")


def unanswered(err: BaseException) -> bool:
    """Whether a Kafka client's error says the broker did not answer (hung, cut off, restarting,
    no leader yet: aiokafka's retriable errors, and a batch that expired unsent), not that it
    refused the request: sending the same again later can succeed.

    >>> from aiokafka.errors import KafkaTimeoutError, MessageSizeTooLargeError, RequestTimedOutError
    >>> unanswered(RequestTimedOutError()), unanswered(KafkaTimeoutError()), unanswered(MessageSizeTooLargeError())
    (True, True, False)
    """
    return isinstance(err, KafkaTimeoutError) or (isinstance(err, KafkaError) and bool(err.retriable))


async def send_until_answered(send: Callable[[], Awaitable[T]], what: str,
                              give_up: Callable[[KafkaError, float], Awaitable[bool]],
                              waiting: Callable[[float], None] = lambda s: None) -> T:
    """``await send()`` again after each :class:`KafkaError` until it succeeds, or until
    ``give_up(error, seconds since the first try)`` says to raise it: for a send whose copy is
    harmless (a version serving skips, an example the readers drop by id), so that a broker that
    does not answer for a while (hung, cut off, restarting) is waited out instead of ending the
    process. A warning every 30 s says for how long; ``waiting`` gets the seconds waited after
    each failure and 0 when done.

    >>> import asyncio
    >>> from aiokafka.errors import RequestTimedOutError
    >>> tries = []
    >>> async def send():
    ...     tries.append(1)
    ...     if len(tries) < 3:
    ...         raise RequestTimedOutError()
    ...     return "sent"
    >>> async def never(err, waited): return False
    >>> asyncio.run(send_until_answered(send, "a record", never)), len(tries)
    ('sent', 3)
    """
    started, warned = time.monotonic(), -1.0
    while True:
        try:
            result = await send()
            waiting(0.0)
            return result
        except KafkaError as err:
            waited = time.monotonic() - started
            waiting(waited)
            if await give_up(err, waited):
                waiting(0.0)
                raise
            if warned < 0 or waited - warned >= 30:
                warned = waited
                log.warning("sending %s failed (%r) %.0f s after the first try; sending again until the broker "
                            "answers", what, err, waited)
            await asyncio.sleep(min(1.0, 0.1 + waited / 10))


def producer(settings: Settings, **overrides: object) -> AIOKafkaProducer:
    """A producer tuned for throughput (batched, lz4) with idempotence off: tansu lacks it."""
    k = settings.kafka
    options: dict[str, object] = dict(
        bootstrap_servers=settings.bootstrap_servers,
        linger_ms=k.linger_ms,
        max_batch_size=k.max_batch_size,
        compression_type=k.compression_type,
        request_timeout_ms=k.request_timeout_ms,
        acks="all",
    )
    options.update(overrides)
    return AIOKafkaProducer(**options, **security_options(settings))


async def start_client(client: AIOKafkaProducer | AIOKafkaConsumer, settings: Settings) -> None:
    """Start a client, turning "no broker" into one actionable line instead of a traceback."""
    try:
        await asyncio.wait_for(client.start(), timeout=settings.kafka.connect_timeout_s)
    except (TimeoutError, KafkaConnectionError, OSError):
        try:
            await client.stop()
        except Exception:  # noqa: BLE001 - closing a client that never connected: the first error is the one raised
            pass
        raise _unreachable(settings) from None


def admin_client(settings: Settings) -> AIOKafkaAdminClient:
    """An admin client (topics, groups) of the configured broker; ``await start()``, ``close()``."""
    return AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap_servers, **security_options(settings))


@contextlib.asynccontextmanager
async def connected_admin(settings: Settings) -> AsyncIterator[AIOKafkaAdminClient]:
    """:func:`admin_client`, started (:class:`BrokerUnavailable` when it cannot be), closed after."""
    admin = admin_client(settings)
    try:
        await asyncio.wait_for(admin.start(), timeout=settings.kafka.connect_timeout_s)
    except (TimeoutError, KafkaConnectionError, OSError):
        raise _unreachable(settings) from None
    try:
        yield admin
    finally:
        await admin.close()


async def create_topics(settings: Settings, topics: Mapping[str, int] | None = None,
                        configs: Mapping[str, Mapping[str, str]] | None = None) -> list[str]:
    """Create the topics (name -> partitions) that do not exist yet, with their ``configs``
    (name -> topic configuration) if any; return the ones created."""
    wanted = dict(topics if topics is not None else settings.topics.all())
    async with connected_admin(settings) as admin:
        existing = set(await admin.list_topics())
        missing = [name for name in wanted if name not in existing]
        if missing:
            try:
                await admin.create_topics(
                    [NewTopic(name, num_partitions=wanted[name], replication_factor=1,
                              topic_configs=dict((configs or {}).get(name, {}))) for name in missing]
                )
            except TopicAlreadyExistsError:
                pass  # another process raced us: the topic is there, which is all we want
        return missing


async def partition_counts(settings: Settings, topics: Sequence[str]) -> dict[str, int]:
    """Each existing topic's partition count on the broker (describe only topics that exist: a
    broker that creates topics on a metadata request would create the others)."""
    async with connected_admin(settings) as admin:
        return {t["topic"]: len(t["partitions"]) for t in await admin.describe_topics(list(topics))}


@dataclass(frozen=True, slots=True)
class Record(Generic[M]):
    """One decoded record and where it came from."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: M
    timestamp_ms: int
    raw: bytes = b""  # the record's original bytes (no copy), for dead-lettering after validation


class RawRecord(Protocol):
    """What a dead letter needs of a record (aiokafka's ``ConsumerRecord``, our :class:`Record`)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


class _Joined(ConsumerRebalanceListener):  # type: ignore[misc]  # aiokafka has no type information
    """Sets ``joined`` at each assignment, after the caller's own listener (if any) has run."""

    def __init__(self, joined: asyncio.Event, inner: ConsumerRebalanceListener | None) -> None:
        self.joined = joined
        self.inner = inner

    async def on_partitions_revoked(self, revoked: object) -> None:
        if self.inner is not None:
            await self.inner.on_partitions_revoked(revoked)

    async def on_partitions_assigned(self, assigned: object) -> None:
        try:
            if self.inner is not None:
                await self.inner.on_partitions_assigned(assigned)
        finally:  # (aiokafka logs a listener's error; start() must not wait on for it)
            self.joined.set()


class TypedConsumer(Generic[M]):
    """Consume one message type from one or more topics in a consumer group, in batches.

    Malformed records never reach the caller: they go to the dead-letter topic with the reason.
    Nothing is committed automatically; call :meth:`commit` after the batch's work is durable.

    With a ``group_id`` and ``topics``, :meth:`start` returns once the group has assigned this
    member its partitions. Only reaching the broker is bounded by ``kafka.connect_timeout_s``, not
    the join: a join cut off midway leaves a member the broker waits for until its session times
    out, so on a loaded machine (where a join takes longer than the bound) every retry left the
    next one a member to wait for, and the consumer never joined (``services.tansu_quirks`` 3).
    """

    def __init__(
        self,
        settings: Settings,
        service: str,
        message_type: type[M],
        topics: list[str],
        group_id: str | None,
        *,
        auto_offset_reset: str = "earliest",
        dead_letter_producer: AIOKafkaProducer | None = None,
        codec: Codec[M] | None = None,
        listener: ConsumerRebalanceListener | None = None,
        **consumer_options: object,
    ) -> None:
        """``codec`` replaces the message type's protobuf codec, e.g. one that keeps values as
        bytes for a service that decodes whole batches itself. ``listener`` hears the group's
        assignments (with ``group_id`` and ``topics``)."""
        self.settings = settings
        self.service = service
        self.codec = codec if codec is not None else codec_for(message_type)
        self.topics = topics
        self.group_id = group_id
        self._listener = listener
        k = settings.kafka
        options: dict[str, object] = dict(
            bootstrap_servers=settings.bootstrap_servers,
            group_id=group_id,
            enable_auto_commit=False,
            auto_offset_reset=auto_offset_reset,
            session_timeout_ms=k.session_timeout_ms,
            heartbeat_interval_ms=k.heartbeat_interval_ms,
            request_timeout_ms=k.request_timeout_ms,
            max_poll_records=k.max_poll_records,
            fetch_max_wait_ms=k.fetch_max_wait_ms,
        )
        options.update(consumer_options)
        # A group's topics are subscribed in start(), after the broker is reached:
        # AIOKafkaConsumer.start() would join the group inside the bounded connect.
        self._join_topics = topics if group_id is not None else []
        self.consumer = AIOKafkaConsumer(*(topics if group_id is None else []), **options,
                                         **security_options(settings))
        self._session_timeout_ms = options["session_timeout_ms"]
        self._dlq = dead_letter_producer
        self._own_dlq = dead_letter_producer is None
        self.dead_lettered = 0

    async def start(self) -> None:
        tansu_quirks.install()
        if self._dlq is None:
            self._dlq = producer(self.settings)
            await start_client(self._dlq, self.settings)
        await start_client(self.consumer, self.settings)
        if self._join_topics:
            await self._join()

    async def _join(self) -> None:
        joined = asyncio.Event()
        self.consumer.subscribe(self._join_topics, listener=_Joined(joined, self._listener))
        started = time.monotonic()
        wait_s = self.settings.kafka.connect_timeout_s
        while not joined.is_set():
            try:
                await asyncio.wait_for(joined.wait(), timeout=wait_s)
            except TimeoutError:
                log.warning("%s: still joining consumer group %s after %.0fs (a member that stopped "
                            "without leaving holds the join until its session times out, %d ms)",
                            self.service, self.group_id, time.monotonic() - started,
                            self._session_timeout_ms)

    async def stop(self) -> None:
        try:
            await stop_consumer(self.consumer)
        finally:
            if self._own_dlq and self._dlq is not None:
                await self._dlq.stop()

    async def __aenter__(self) -> TypedConsumer[M]:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def poll(self, timeout_ms: int = 1000, max_records: int | None = None) -> list[Record[M]]:
        """Fetch up to ``max_records`` records; decode them, dead-letter the malformed ones."""
        fetched = await self.consumer.getmany(timeout_ms=timeout_ms, max_records=max_records)
        out: list[Record[M]] = []
        rejects: list[asyncio.Future[Any]] = []
        for tp, records in fetched.items():
            for r in records:
                try:
                    value = self.codec.decode(r.value)
                except MalformedMessage as err:
                    rejects.append(await self.dead_letter(r, err))
                    continue
                out.append(Record(r.topic, r.partition, r.offset, r.key, value, r.timestamp, r.value))
            if records:
                metrics.MESSAGES_CONSUMED.labels(self.service, tp.topic).inc(len(records))
                highwater = self.consumer.highwater(tp)
                if highwater is not None:
                    metrics.CONSUMER_LAG.labels(self.service, tp.topic, str(tp.partition)).set(
                        max(0, highwater - records[-1].offset - 1)
                    )
        if rejects:
            # The dead letters must be durable before the offsets past them can be committed.
            await asyncio.gather(*rejects)
        return out

    def lag_after(self, records: Sequence[Record[M]]) -> dict[int, int]:
        """Each partition's records left behind the last of ``records`` (by the consumer's last known
        high watermark; a partition without one is left out)."""
        last = {r.partition: r for r in records}
        lag = {}
        for partition, r in last.items():
            hw = self.consumer.highwater(TopicPartition(r.topic, partition))
            if hw is not None:
                lag[partition] = max(0, hw - r.offset - 1)
        return lag

    async def batches(
        self, max_records: int | None = None, timeout_ms: int = 1000
    ) -> AsyncIterator[list[Record[M]]]:
        """Poll forever, yielding non-empty batches."""
        while True:
            batch = await self.poll(timeout_ms=timeout_ms, max_records=max_records)
            if batch:
                yield batch

    async def dead_letter(self, record: RawRecord, err: MalformedMessage) -> asyncio.Future[Any]:
        """Send a raw record (anything with topic, partition, offset, key, value) to the dead-letter
        topic with its reason and count it. Await the returned future before committing past it."""
        assert self._dlq is not None
        letter = DeadLetter(
            source_topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            key=record.key or b"",
            value=record.value or b"",
            reason=str(err),
            consumer=self.service,
            rejected_at_ms=int(time.time() * 1000),
        )
        metrics.DEAD_LETTERS.labels(self.service, record.topic, err.kind).inc()
        self.dead_lettered += 1
        log.warning(
            "dead-lettered %s[%d]@%d: %s",
            record.topic, record.partition, record.offset, err,
        )
        sent: asyncio.Future[Any] = await self._dlq.send(
            self.settings.topics.dead_letters, letter.SerializeToString(), key=record.key
        )
        return sent

    async def commit(self, offsets: Mapping[TopicPartition, int] | None = None) -> None:
        """Commit the positions handed out so far (or the given next-offsets)."""
        started = time.perf_counter()
        try:
            await self.consumer.commit(dict(offsets) if offsets is not None else None)
        except KafkaError as err:
            # A rebalance took our partitions: the records will be re-delivered to their new owner.
            # (A consumer that is no member is refused while the group has one: its caller says so.)
            if self._join_topics or not isinstance(err, CommitFailedError):
                log.warning("offset commit failed (%s); uncommitted records will be re-delivered", err)
            raise
        finally:
            metrics.COMMIT_SECONDS.labels(self.service).observe(time.perf_counter() - started)
