"""The joiner's input topics deleted under a running worker (an operator's ``kafka-topics
--delete``), on the real broker: tansu keeps taking and serving the topics' new records with the
topics out of its metadata and answers every offset commit UnknownTopicOrPartition, which aiokafka
retries for ever (tansu quirk 11). The worker's commit then held its lock, and the join and the
clean stop with it, for ever. Now each commit is bounded: the worker goes on joining what it
reads, shows that its commits get no answer, and stops cleanly."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import REGISTRY

from joiner.faust_app import run
from services.kafka import connected_admin, create_topics, producer, start_client
from services.settings import Settings
from tests.joiner.helpers import JOINER, consumed_all, produce
from tests.joiner.synth import ml_events


def _sample(name: str, labels: dict) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_a_worker_whose_inputs_are_deleted_goes_on_says_so_and_stops_cleanly(settings: Settings, caplog) -> None:
    events = ml_events(400, start=40_000, seed=3)
    await create_topics(settings)
    await produce(settings, events)
    s = settings.updated(joiner=JOINER, kafka={"connect_timeout_s": 3.0})  # (each commit's bound)
    stop = asyncio.Event()
    task = asyncio.create_task(run(s, stop=stop))
    try:
        await consumed_all(settings, [], timeout=120)
        joined = _sample("driftline_joiner_examples_produced_total", {})
        out = producer(settings)  # (started while the topics exist: it knows their partitions)
        await start_client(out, settings)
        try:
            async with connected_admin(settings) as admin:
                await admin.delete_topics([settings.topics.features, settings.topics.actions])
            await asyncio.sleep(2)
            # the events again, twice, on the ghosts: past the positions the worker waits at (quirk 11)
            topics = {"features": settings.topics.features, "actions": settings.topics.actions}
            for _ in range(2):
                await asyncio.gather(*[await out.send(topics[kind], value, key=key) for kind, key, value in events])
        finally:
            await out.stop()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _sample("driftline_offset_commits_unanswered", {"service": "joiner"}):
            assert not task.done(), task
            await asyncio.sleep(0.5)
        assert _sample("driftline_offset_commits_unanswered", {"service": "joiner"}) == 1
        assert "an offset commit got no answer from the broker" in caplog.text
    finally:
        stop.set()
    t0 = time.monotonic()
    await asyncio.wait_for(task, 60)  # (it waited for ever)
    assert time.monotonic() - t0 < 20
    assert _sample("driftline_joiner_examples_produced_total", {}) >= joined
