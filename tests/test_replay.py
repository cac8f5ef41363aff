"""The replay: requests grouped right, actions delayed and out of order, readable back from Kafka."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from movielens.features import MovieLensFeatures
from producers.replay import Refused, encode_messages, make_plan, replay, replay_events, request_id
from proto import Action, DeadLetter, FeatureLog
from services.codecs import codec_for
from services.kafka import TypedConsumer
from services.settings import ReplaySettings, Settings


def test_plan_groups_one_users_ratings_in_one_second_into_one_request() -> None:
    user = np.array([1, 2, 1, 1, 3])
    item = np.array([10, 20, 11, 12, 30])
    ts = np.array([5, 5, 5, 6, 6])
    label = np.array([1, 0, 1, 0, 1])
    plan = make_plan(user, item, ts, label, ReplaySettings(seed=1))
    requests = [
        (int(plan.request_user[i]), int(plan.request_time_ms[i]),
         plan.item_id[plan.request_start[i]:plan.request_start[i + 1]].tolist())
        for i in range(plan.n_requests)
    ]
    assert requests == [(1, 5000, [10, 11]), (2, 5000, [20]), (1, 6000, [12]), (3, 6000, [30])]
    assert plan.n_actions == 3
    assert sorted(plan.action_item.tolist()) == [10, 11, 30]
    # Every action happens after its impression.
    assert (plan.action_time_ms > plan.request_time_ms[plan.action_request]).all()
    assert np.all(np.diff(plan.emit_time_ms) >= 0)


def test_events_outside_the_bounds_are_dead_lettered_not_produced() -> None:
    """The replay is an edge: an int64-max or far-past event time goes to dead-letters with its
    reason, and the actions of a refused request with it; the rest is produced as usual."""
    now_ms = 1_700_000_000_000
    user = np.array([1, 2, 3])
    item = np.array([10, 20, 30])
    ts = np.array([now_ms // 1000 - 60, (2**63 - 1) // 1000, now_ms // 1000 - 10 * 86_400])
    plan = make_plan(user, item, ts, np.array([1, 1, 1]), ReplaySettings(seed=1))
    refused = Refused.check(plan, now_ms, max_past_s=86_400, max_future_s=300)
    assert sorted(plan.request_user[refused.requests].tolist()) == [2, 3]
    assert sorted(plan.request_user[plan.action_request[refused.actions]].tolist()) == [2, 3]
    feats = MovieLensFeatures(pa.table({"user_id": pa.array([], pa.int64())}),
                              pa.table({"item_id": pa.array([], pa.int64())}))
    out = list(encode_messages(plan, feats, ("f", "a"), refused, "dl", now_ms, (86_400, 300)))
    produced = [(t, k) for t, k, _, _ in out if t != "dl"]
    letters = [DeadLetter.FromString(v) for t, _, v, _ in out if t == "dl"]
    assert produced == [("f", b"u1-t" + str(ts[0] * 1000).encode()), ("a", b"u1-t" + str(ts[0] * 1000).encode())]
    assert len(letters) == 4
    assert any("ahead of the clock" in d.reason for d in letters)
    assert any("behind the clock" in d.reason for d in letters)
    assert {d.source_topic for d in letters} == {"f", "a"}


def test_ml1m_slice_messages_decode_and_actions_follow_their_impressions(settings: Settings) -> None:
    seen_requests: dict[str, FeatureLog] = {}
    actions: list[Action] = []
    out_of_order = 0
    last_action_time = 0
    for topic, key, value in replay_events(settings, "ml-1m", limit=5000):
        if topic == settings.topics.features:
            log = codec_for(FeatureLog).decode(value)
            assert key == log.request_id.encode()
            assert log.request_id == request_id(log.user_id, log.event_time_ms)
            assert {"user_id", "gender", "age", "occupation", "zip"} <= set(log.context.sparse)
            assert all({"item_id", "genres", "year"} <= set(c.features.sparse) for c in log.candidates)
            seen_requests[log.request_id] = log
        else:
            action = codec_for(Action).decode(value)
            assert action.request_id in seen_requests, "an action before its impression was emitted"
            impression = seen_requests[action.request_id]
            assert action.item_id in {c.item_id for c in impression.candidates}
            assert action.event_time_ms > impression.event_time_ms
            out_of_order += action.event_time_ms < last_action_time
            last_action_time = max(last_action_time, action.event_time_ms)
            actions.append(action)
    assert sum(len(log.candidates) for log in seen_requests.values()) == 5000
    assert len(actions) > 1000
    assert out_of_order > 0, "transport jitter should reorder some actions"


async def test_replay_to_broker_reads_back(settings: Settings) -> None:
    stats = await replay(settings, "ml-1m", speed=0, limit=3000, progress=False)
    assert stats["impressions"] == 3000
    async with TypedConsumer(settings, "t", FeatureLog, [settings.topics.features], "g-f") as c:
        logs = []
        for _ in range(40):
            logs += await c.poll(timeout_ms=500)
            if len(logs) >= stats["feature_logs"]:
                break
    assert len(logs) == stats["feature_logs"]
    assert sum(len(r.value.candidates) for r in logs) == 3000
    async with TypedConsumer(settings, "t", Action, [settings.topics.actions], "g-a") as c:
        acts = []
        for _ in range(40):
            acts += await c.poll(timeout_ms=500)
            if len(acts) >= stats["actions"]:
                break
    assert len(acts) == stats["actions"]
    # Same key, same partition count: a request's actions sit on its features' partition number.
    partition_of = {r.value.request_id: r.partition for r in logs}
    assert all(partition_of[a.value.request_id] == a.partition for a in acts)


@pytest.mark.parametrize("speed", [600.0])
async def test_paced_replay_takes_event_time_over_speed(settings: Settings, speed: float) -> None:
    stats = await replay(settings, "ml-1m", speed=speed, limit=50, progress=False)
    assert stats["messages"] > 0
