"""The actions topic deleted under serving's recent-clicks reader (an operator's ``kafka-topics
--delete``), on the real broker and real Redis: tansu keeps taking and serving the topic's new
records with the topic out of its metadata and answers every offset commit
UnknownTopicOrPartition, which aiokafka retries for ever (tansu quirk 11). The reader then stopped
at its first commit for good; now it records the clicks that come, shows that its commits get no
answer, and stops cleanly."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import REGISTRY

from proto import Action
from services.kafka import connected_admin, create_topics, producer, start_client
from services.settings import Settings
from serving.feature_store import FeatureStore
from serving.realtime import RecentClicks


def _unanswered() -> float:
    return REGISTRY.get_sample_value("driftline_offset_commits_unanswered", {"service": "serving"}) or 0.0


async def test_a_reader_whose_actions_topic_is_deleted_goes_on_and_says_so(serving_settings: Settings) -> None:
    settings = serving_settings
    settings.kafka.session_timeout_ms = 6_000  # tansu's first join waits about half of it
    settings.kafka.heartbeat_interval_ms = 1_000
    settings.kafka.connect_timeout_s = 3.0  # (each commit's bound)
    store = FeatureStore(settings.redis, f"p{time.time_ns()}")
    await create_topics(settings, {settings.topics.actions: 1})
    out = producer(settings)  # (started while the topic exists: it knows its partition)
    await start_client(out, settings)
    reader = RecentClicks(settings, store, ("click",), group_id=f"g{time.time_ns()}", retry_s=0.2)
    reader.from_beginning = True  # a fresh group would start at the end

    async def clicks(items: range) -> None:
        now = int(time.time() * 1000)
        for i in items:
            await out.send_and_wait(settings.topics.actions, Action(
                request_id=f"r{i}", item_id=i, action_type="click", user_id=10, event_time_ms=now).SerializeToString(),
                key=f"r{i}".encode(), partition=0)

    async def recorded(n: int) -> None:
        deadline = time.monotonic() + 30
        while reader.recorded < n:
            assert time.monotonic() < deadline, reader.recorded
            await asyncio.sleep(0.1)

    try:
        await clicks(range(3))
        reader.start()
        await recorded(3)
        async with connected_admin(settings) as admin:
            await admin.delete_topics([settings.topics.actions])
        await asyncio.sleep(2)
        await clicks(range(100, 106))  # the ghost's offsets 0-5: the reader, at 3, reads 3-5 (quirk 11)
        await recorded(6)
        deadline = time.monotonic() + 30
        while not _unanswered():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)
        await clicks(range(200, 203))
        await recorded(9)  # (it waited in its first commit for ever)
        assert [int(x) for x in await store.redis.lrange(store.clicks_key(10), 0, 2)] == [202, 201, 200]
    finally:
        await out.stop()
        await asyncio.wait_for(reader.stop(), 30)
        await store.close()
