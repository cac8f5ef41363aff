"""The shared consumer helper against a real broker: dead letters, resume from committed offsets."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from aiokafka import AIOKafkaConsumer
from prometheus_client import REGISTRY

from proto import Action, DeadLetter
from services.codecs import codec_for
from services.kafka import TypedConsumer, create_topics, producer, start_client
from services.settings import Settings


def _action(i: int) -> bytes:
    return Action(request_id=f"r{i}", item_id=i, action_type="click", event_time_ms=1000 + i).SerializeToString()


async def _produce(settings: Settings, topic: str, values: list[bytes]) -> None:
    p = producer(settings)
    await start_client(p, settings)
    try:
        for v in values:
            await p.send(topic, v, key=b"k", partition=0)
        await p.flush()
    finally:
        await p.stop()


async def _drain(consumer: TypedConsumer, want: int, polls: int = 60) -> list:
    got: list = []
    for _ in range(polls):
        got += await consumer.poll(timeout_ms=500)
        if len(got) >= want:
            break
    return got


async def test_malformed_messages_go_to_dead_letter_topic_with_reason(settings: Settings) -> None:
    topic = settings.topics.actions
    await create_topics(settings)
    bad_bytes = b"\xff\xfe not protobuf"
    missing_id = Action(item_id=1, action_type="click", event_time_ms=5).SerializeToString()
    await _produce(settings, topic, [_action(1), bad_bytes, missing_id, _action(2)])

    def dead(kind: str) -> float:
        return REGISTRY.get_sample_value(
            "driftline_dead_letters_total", {"service": "test-dlq", "topic": topic, "kind": kind}
        ) or 0.0

    before = dead("undecodable"), dead("invalid")
    async with TypedConsumer(settings, "test-dlq", Action, [topic], "g-dlq") as consumer:
        good = await _drain(consumer, 2)
        await consumer.commit()
    assert [r.value.request_id for r in good] == ["r1", "r2"]
    assert (dead("undecodable") - before[0], dead("invalid") - before[1]) == (1.0, 1.0)

    async with TypedConsumer(
        settings, "test-dlq-reader", DeadLetter, [settings.topics.dead_letters], "g-dlq-reader"
    ) as reader:
        letters = [r.value for r in await _drain(reader, 2)]
    assert len(letters) == 2
    by_reason = {letter.reason.split(":")[0]: letter for letter in letters}
    assert by_reason["undecodable"].value == bad_bytes  # the original bytes, untouched
    assert by_reason["invalid"].value == missing_id
    assert "request_id is empty" in by_reason["invalid"].reason
    assert {letter.source_topic for letter in letters} == {topic}
    assert sorted(letter.offset for letter in letters) == [1, 2]


async def test_consumer_restart_resumes_from_committed_offset(settings: Settings) -> None:
    topic = settings.topics.actions
    await create_topics(settings)
    await _produce(settings, topic, [_action(i) for i in range(10)])

    async with TypedConsumer(settings, "test-resume", Action, [topic], "g-resume", max_poll_records=4) as c:
        first = await c.poll(timeout_ms=5000, max_records=4)
        while not first:
            first = await c.poll(timeout_ms=1000, max_records=4)
        await c.commit()
        # Fetched but never committed: these must come back after the restart.
        uncommitted = await c.poll(timeout_ms=1000, max_records=3)
    assert [r.offset for r in first] == [0, 1, 2, 3]
    assert uncommitted, "expected a second batch before the restart"

    async with TypedConsumer(settings, "test-resume", Action, [topic], "g-resume") as c:
        rest = await _drain(c, 6)
    assert [r.offset for r in rest] == list(range(4, 10))
    assert [r.value.item_id for r in rest] == list(range(4, 10))


async def test_a_join_longer_than_the_connect_timeout_is_waited_for(
        settings: Settings, caplog: pytest.LogCaptureFixture) -> None:
    """A group join takes ~5 s on tansu (quirk 3) and longer behind a member that never finished
    joining. Only reaching the broker is bounded by the connect timeout: before, a consumer whose
    join outlasted it gave up midway, left the next try such a member, and never joined."""
    topic, group = "join-slow", "g-join-slow"
    await create_topics(settings, {topic: 3})
    await _produce(settings, topic, [_action(1)])
    # a member cut off mid-join, as a timed-out start left one
    half = AIOKafkaConsumer(topic, bootstrap_servers=settings.bootstrap_servers, group_id=group,
                            enable_auto_commit=False, session_timeout_ms=10_000)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(half.start(), timeout=0.5)
    await half.stop()
    s = settings.model_copy(deep=True)
    s.kafka.connect_timeout_s = 2.0
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, "services.kafka"):
        async with TypedConsumer(s, "test-join", Action, [topic], group) as consumer:
            took = time.monotonic() - started
            assert {tp.partition for tp in consumer.consumer.assignment()} == {0, 1, 2}
            got = await _drain(consumer, 1)
    assert [r.value.request_id for r in got] == ["r1"]
    assert took > 2.0, took  # the join outlasted the bound; the old start() raised BrokerUnavailable
    assert "still joining consumer group g-join-slow" in caplog.text


def test_every_codec_round_trips() -> None:
    raw = _action(3)
    assert codec_for(Action).decode(raw).SerializeToString() == raw


async def test_an_epoch_check_while_the_broker_is_down_is_no_reset() -> None:
    """The epoch marker's reader turns "no broker" into BrokerUnavailable (one line for a service
    that starts without one: tests/test_cli_errors.py), and a running service's watch takes it as
    "no reset known": its own Kafka calls fail then, and the next check sees a reset once the
    broker is back (bench/chaos.py's kill -9 of the broker stopped its capture on it once)."""
    from services.broker_reset import EpochWatch, read_broker_epoch
    from services.kafka import BrokerUnavailable
    from services.ports import free_port

    down = Settings().model_copy(update={"kafka_bootstrap_servers": f"127.0.0.1:{free_port()}"}).updated(
        kafka={"connect_timeout_s": 1.0})
    assert await EpochWatch(down, "test", epoch="e1").check() is None
    with pytest.raises(BrokerUnavailable, match="cannot reach Kafka at 127.0.0.1:"):
        await read_broker_epoch(down)
