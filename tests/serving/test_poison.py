"""Serving's readers never crash-loop on one record: a record that decodes and then fails is
dead-lettered with the reason, counted, and the reader moves on (real broker, real Redis)."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import redis
from serving_helpers import dead_letters, dense_delta, produce_actions, publish, sparse_delta

from driftline.embedded import redis_binary, wait_for_port
from proto import Action, ParameterDelta
from proto.parameter_delta_pb2 import DenseParameters, Tensor
from services.kafka import create_topics
from services.ports import free_port
from services.settings import Settings
from serving.deltas import DeltaFeed
from serving.feature_store import FeatureStore
from serving.fm_model import FMModel
from serving.realtime import RecentClicks


async def test_a_delta_that_fails_to_apply_is_dead_lettered(settings: Settings) -> None:
    # Decodes and validates (one value for a shape whose product is 1), but cannot be reshaped.
    poison = ParameterDelta(model_id="deepfm", version=1, chunk_index=0, chunk_count=1,
                            dense=DenseParameters(tensors=[Tensor(name="bias", shape=[-1, -1],
                                                                  values=np.ones(1, "<f4").tobytes())]))
    feed = DeltaFeed(settings, FMModel(dim=4), retry_s=0.2)
    feed.start()
    try:
        await publish(settings, [poison, sparse_delta("item_id", np.array([5], np.int64),
                                                      np.ones((1, 5), np.float32), version=1),
                                 dense_delta(0.5, version=2)])
        deadline = time.monotonic() + 20
        while not (feed.model.sparse.version == 1 and feed.model.dense.version == 2):
            assert time.monotonic() < deadline, (feed.model.sparse.version, feed.model.dense.version)
            await asyncio.sleep(0.05)
        assert feed.failed == 1 and float(feed.model.dense_params["bias"][0]) == 0.5
    finally:
        await feed.stop()
    [letter] = await dead_letters(settings, 1)
    assert letter.source_topic == settings.topics.param_deltas and letter.offset == 0
    assert letter.reason.startswith("failed: ValueError") and letter.value == poison.SerializeToString()


async def test_a_delta_that_runs_out_of_memory_is_applied_again_not_dead_lettered(settings: Settings,
                                                                                   monkeypatch) -> None:
    """Out of memory is the machine's fault, not the delta's: skipping it would leave the replica
    apart from the others for good. The feed stops, reconnects and applies it again."""
    model = FMModel(dim=4)
    real, starved = model.apply_delta, [1]

    def apply_delta(msg: ParameterDelta) -> None:  # (a machine out of memory once, then not)
        if starved:
            starved.pop()
            raise MemoryError("no memory")
        real(msg)

    monkeypatch.setattr(model, "apply_delta", apply_delta)
    feed = DeltaFeed(settings, model, retry_s=0.2)
    feed.start()
    try:
        await publish(settings, [sparse_delta("item_id", np.array([5], np.int64), np.ones((1, 5), np.float32),
                                              version=1), dense_delta(0.5, version=2)])
        deadline = time.monotonic() + 20
        while not (model.sparse.version == 1 and model.dense.version == 2):
            assert time.monotonic() < deadline, (model.sparse.version, model.dense.version)
            await asyncio.sleep(0.05)
        assert feed.failed == 0 and feed.skipped == 0 and not starved
    finally:
        await feed.stop()
    assert await dead_letters(settings, 1, timeout=2.0) == []


async def test_a_click_redis_refuses_is_dead_lettered(serving_settings: Settings) -> None:
    settings = serving_settings
    settings.kafka.session_timeout_ms = 6_000  # tansu's first join waits about half of it
    settings.kafka.heartbeat_interval_ms = 1_000
    store = FeatureStore(settings.redis, f"p{time.time_ns()}")
    await store.redis.set(store.clicks_key(9), "not a list")  # user 9's clicks cannot be pushed
    await create_topics(settings, {settings.topics.actions: 1})
    now = int(time.time() * 1000)
    await produce_actions(settings, [
        Action(request_id="r1", item_id=11, action_type="click", user_id=10, event_time_ms=now),
        Action(request_id="poison", item_id=12, action_type="click", user_id=9, event_time_ms=now),
        Action(request_id="r3", item_id=13, action_type="click", user_id=10, event_time_ms=now)])
    reader = RecentClicks(settings, store, ("click",), group_id=f"g{time.time_ns()}", retry_s=0.2)
    reader.from_beginning = True  # a fresh group would start at the end
    reader.start()
    try:
        deadline = time.monotonic() + 30
        while reader.recorded < 2:
            assert time.monotonic() < deadline, reader.recorded
            await asyncio.sleep(0.1)
        assert [int(x) for x in await store.redis.lrange(store.clicks_key(10), 0, -1)] == [13, 11]
        assert reader.failed == 1
    finally:
        await reader.stop()
        await store.close()
    [letter] = await dead_letters(settings, 1)
    assert letter.key == b"poison" and "WRONGTYPE" in letter.reason and letter.reason.startswith("failed:")


@pytest.mark.parametrize("fault", ["full", "read-only"])
async def test_clicks_a_full_or_read_only_redis_refuses_wait_for_it_and_are_not_dead_lettered(
        serving_settings: Settings, tmp_path: Path, fault: str) -> None:
    """Redis at its ``maxmemory`` with ``noeviction`` (OOM), or turned into a replica (READONLY),
    refuses every write: the store's state, not the click's. The reader waits and records them once
    Redis takes writes again; none is dead-lettered."""
    settings = serving_settings
    settings.kafka.session_timeout_ms = 6_000
    settings.kafka.heartbeat_interval_ms = 1_000
    port = free_port()
    server = subprocess.Popen([str(redis_binary()), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", str(tmp_path), "--maxmemory", "4mb",
                               "--maxmemory-policy", "noeviction"], stdout=subprocess.DEVNULL)
    wait_for_port("127.0.0.1", port, 20, "redis", server)
    store = FeatureStore(f"redis://127.0.0.1:{port}/0", "p")
    reader = RecentClicks(settings, store, ("click",), group_id=f"g{time.time_ns()}", retry_s=0.2)
    try:
        if fault == "full":
            for size in (10_000, 10):  # (until Redis refuses even a small write: OOM command not allowed)
                for i in range(100_000):
                    try:
                        await store.redis.set(f"filler:{size}:{i}", "x" * size)
                    except redis.exceptions.OutOfMemoryError:
                        break
                else:
                    raise AssertionError("Redis never filled up")
        else:
            await store.redis.replicaof("127.0.0.1", free_port())  # (a master that is not there)
        await create_topics(settings, {settings.topics.actions: 1})
        now = int(time.time() * 1000)
        await produce_actions(settings, [Action(request_id=f"r{i}", item_id=i, action_type="click", user_id=7,
                                         event_time_ms=now) for i in range(1, 4)])
        reader.from_beginning = True
        reader.start()
        await asyncio.sleep(4)
        assert reader.recorded == 0 and reader.failed == 0
        if fault == "full":
            await store.redis.flushdb()  # (deletes are allowed at maxmemory)
        else:
            await store.redis.replicaof("NO", "ONE")
        deadline = time.monotonic() + 30
        while reader.recorded < 3:
            assert time.monotonic() < deadline, reader.recorded
            await asyncio.sleep(0.1)
        assert [int(x) for x in await store.redis.lrange(store.clicks_key(7), 0, -1)] == [3, 2, 1]
        assert reader.failed == 0
    finally:
        await reader.stop()
        await store.close()
        server.kill()
        server.wait()
    assert await dead_letters(settings, 1, timeout=2) == []
