"""The Faust joiner across a broker reset (tansu memory storage restarted): the join state
survives in the workers' local stores and is written back into the new changelog."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from rocksdict import Options, Rdict

from joiner.faust_app import BrokerReset, changelog_topic, run, state_dir
from joiner.faust_reset import partition_stores
from joiner.reference import offline_join
from joiner.synth import ml_events
from services import tansu_quirks
from services.kafka import create_topics, producer, start_client
from services.settings import Settings
from tests.conftest import KilledBroker, killed_broker
from tests.joiner.helpers import JOINER, as_map, join_config, produce, read_examples, ref_as_map
from tests.joiner.test_broker_reset import _busiest_cut
from tests.joiner.test_faust_joiner import _consumed_all


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilledBroker]:
    yield from killed_broker(tmp_path_factory, "faust-reset-broker")


async def test_a_broker_reset_keeps_the_waiting_impressions(settings: Settings, broker: KilledBroker) -> None:
    """Part 1 is consumed (windows still open), the broker is reset under the running worker,
    which stops (BrokerReset) without writing to the new topics; part 2 goes to the new topics
    and a restarted worker re-seeds the changelog from its local store and drains. Part 2's
    actions join part 1's impressions: the output is the reference join of part 1 + part 2."""
    s = settings.updated(joiner=JOINER)
    events = ml_events(1200, start=10_000, seed=3)
    cut = _busiest_cut(events)
    part1, part2 = events[:cut], events[cut:]
    await create_topics(settings)
    await produce(settings, part1)
    stop = asyncio.Event()
    task = asyncio.create_task(run(s, stop=stop))
    try:
        await _consumed_all(s, [], timeout=120)
        await asyncio.sleep(1.0)  # (its last batch committed)
        before = await read_examples(settings)
        await asyncio.to_thread(broker.restart)
        with pytest.raises(BrokerReset):
            await asyncio.wait_for(task, timeout=60)
    finally:
        stop.set()
    await create_topics(settings)
    await produce(settings, part2)
    counts = await run(s, until_idle_s=1.0)
    after = await read_examples(settings)
    assert counts["impressions"] > 0
    assert as_map(before + after) == ref_as_map(offline_join(events, join_config(), settings.topics.partitions))
    part1_requests = {k.decode() for kind, k, _ in part1 if kind == "features"}
    assert sum(1 for e in after if e.request_id in part1_requests and e.labels["click"] == 1.0) >= 5


async def test_a_reseed_cut_short_is_redone_and_its_extra_keys_deleted(settings: Settings, broker: KilledBroker) -> None:
    """A re-seed cut short (a worker killed while writing it) leaves records without their
    commit marker in the new epoch's changelog. The next worker does not take them for another
    worker's re-seed (which would drop its local state): it re-seeds, deleting their keys."""
    s = settings.updated(joiner=JOINER)
    events = ml_events(600, start=10_000, seed=4)
    await create_topics(settings)
    await produce(settings, events[: len(events) // 2])
    await run(s, until_idle_s=1.0)
    await asyncio.to_thread(broker.restart)
    await create_topics(settings)
    topic = changelog_topic(s, await tansu_quirks.ensure_broker_epoch(s))
    await create_topics(settings, {topic: settings.topics.partitions})
    prod = producer(settings)
    await start_client(prod, settings)
    try:
        for p in range(settings.topics.partitions):
            await prod.send_and_wait(topic, b"x", key=b"Istray/1", partition=p)  # (no commit marker)
    finally:
        await prod.stop()
    await produce(settings, events[len(events) // 2:])
    counts = await run(s, until_idle_s=1.0)
    assert counts["impressions"] > 0
    stores = partition_stores(state_dir(s) / "v1" / "tables", "state")
    assert stores, "the local state was kept, not dropped for a re-seed nobody made"
    for path in stores.values():
        db = Rdict(str(path), Options(raw_mode=True))
        try:
            assert db.get(b"Istray/1") is None
        finally:
            db.close()
