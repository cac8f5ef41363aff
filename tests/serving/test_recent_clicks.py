"""A user's recent clicks hold each action once, however often it is delivered: the reader reads
``actions`` at least once, a client retries an ``/actions`` whose 503 hid a late write, and a
Redis call that timed out may have been carried out (real broker, real Redis)."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import REGISTRY
from serving_helpers import produce_actions

from proto import Action
from services.kafka import create_topics
from services.settings import Settings
from serving.feature_store import Click, FeatureStore, click_tag
from serving.realtime import RecentClicks


def _without_user() -> float:
    return REGISTRY.get_sample_value("driftline_serving_realtime_clicks_without_user_total") or 0


async def _read_all(settings: Settings, store: FeatureStore, n: int, without_user: float) -> None:
    """A reader of its own group from the topic's start, until it recorded ``n`` clicks and counted
    ``without_user`` clicks without a user in all."""
    reader = RecentClicks(settings, store, ("click", "like"), group_id=f"g{time.time_ns()}", retry_s=0.2)
    reader.from_beginning = True  # (a new group would start at the end)
    reader.start()
    try:
        deadline = time.monotonic() + 30
        while reader.recorded < n or _without_user() < without_user:
            assert time.monotonic() < deadline, (reader.recorded, _without_user())
            await asyncio.sleep(0.1)
    finally:
        await reader.stop()


async def test_an_action_delivered_twice_is_one_recent_click(serving_settings: Settings) -> None:
    settings = serving_settings
    settings.kafka.session_timeout_ms = 6_000  # tansu's first join waits about half of it
    settings.kafka.heartbeat_interval_ms = 1_000
    store = FeatureStore(settings.redis, f"p{time.time_ns()}")
    await create_topics(settings, {settings.topics.actions: 2})
    now = int(time.time() * 1000)
    act = lambda rid, item, kind="click": Action(request_id=rid, item_id=item, action_type=kind,  # noqa: E731
                                                 user_id=7, event_time_ms=now)
    await produce_actions(settings, [act("r1", 1), act("r2", 2), act("r1", 1),  # r1's click again: a client's retry
                              act("r3", 2), act("r1", 1, "like"),  # item 2 again and a like: new actions
                              Action(request_id="r4", item_id=4, action_type="click", event_time_ms=now)])  # no user
    before = _without_user()
    try:
        await _read_all(settings, store, 5, before + 1)  # (the click without a user is counted, not recorded)
        clicks = [int(x) for x in await store.redis.lrange(store.clicks_key(7), 0, -1)]
        assert sorted(clicks) == [1, 1, 2, 2] and len(await store.redis.lrange(store.click_tags_key(7), 0, -1)) == 4
        # A reader that reads them all again (one killed before its commit) records nothing new.
        await _read_all(settings, store, 5, before + 2)
        assert [int(x) for x in await store.redis.lrange(store.clicks_key(7), 0, -1)] == clicks
    finally:
        await store.close()


async def test_a_store_call_made_twice_records_once_and_keeps_k(redis_url: str) -> None:
    """As after a call that timed out once Redis had carried it out; K bounds both lists."""
    store = FeatureStore(redis_url, f"p{time.time_ns()}", recent_clicks=3)
    try:
        clicks = [Click(5, item, click_tag(f"r{item}", item, "click")) for item in (1, 2, 3, 4)]
        assert await store.record_clicks(clicks[:3]) == []
        assert await store.record_clicks(clicks[:3]) == []
        assert [int(x) for x in await store.redis.lrange(store.clicks_key(5), 0, -1)] == [3, 2, 1]
        assert await store.record_clicks(clicks) == []  # (only the 4th is new)
        assert [int(x) for x in await store.redis.lrange(store.clicks_key(5), 0, -1)] == [4, 3, 2]
        assert await store.redis.llen(store.click_tags_key(5)) == 3
        assert (await store.fetch(5, [1])).recent_items == [4, 3, 2]
        none = FeatureStore(redis_url, store.prefix, recent_clicks=0)
        assert await none.record_clicks([Click(6, 1, b"t")]) == [] and not await store.redis.exists(store.clicks_key(6))
        assert (await none.fetch(5, [1])).recent_items == []
        await none.close()
    finally:
        await store.close()
