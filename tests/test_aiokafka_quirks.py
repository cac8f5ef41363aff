"""The aiokafka workarounds of :mod:`services.aiokafka_quirks`, against a real broker killed with -9."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from proto import Action
from services.aiokafka_quirks import stop_consumer
from services.kafka import TypedConsumer
from services.settings import Settings
from tests.conftest import KilledBroker


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[KilledBroker]:
    b = KilledBroker(tmp_path)
    yield b
    b.stop()


async def _produce_one(bootstrap: str, topic: str) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    await producer.send_and_wait(topic, b"x")
    await producer.stop()


async def _fetching_consumer(bootstrap: str) -> AIOKafkaConsumer:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None)
    await consumer.start()
    await _produce_one(bootstrap, "t")
    consumer.assign([TopicPartition("t", 0)])
    await consumer.getmany(timeout_ms=1000)  # its fetch task runs from here on
    return consumer


async def test_a_consumer_stops_cleanly_after_its_broker_was_killed(own_broker: KilledBroker) -> None:
    """Quirk 1: here plain ``consumer.stop()`` raised CancelledError 5 times out of 5."""
    for _ in range(3):
        consumer = await _fetching_consumer(own_broker.bootstrap)
        assert own_broker.proc is not None
        own_broker.proc.kill()
        own_broker.proc.wait()
        await asyncio.sleep(0.7)  # the fetch task now backs off from the unreachable broker
        await stop_consumer(consumer)
        own_broker.start()


async def test_a_typed_consumer_stops_cleanly_after_its_broker_was_killed(own_broker: KilledBroker,
                                                                           tmp_path: Path) -> None:
    settings = Settings(kafka_bootstrap_servers=own_broker.bootstrap, var_dir=tmp_path)
    await _produce_one(own_broker.bootstrap, "actions")
    consumer = TypedConsumer(settings, "test", Action, ["actions"], group_id=None)
    await consumer.start()
    await consumer.consumer.getmany(timeout_ms=1000)
    assert own_broker.proc is not None
    own_broker.proc.kill()
    own_broker.proc.wait()
    await asyncio.sleep(0.7)
    await consumer.stop()
