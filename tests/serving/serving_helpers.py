"""Serving test helpers: a real uvicorn server in a thread, delta publishing, a filled store."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI

from proto import Action, DeadLetter, ParameterDelta
from proto.parameter_delta_pb2 import DenseParameters, SampleRates, SparseRows, Tensor
from services.kafka import TypedConsumer, create_topics, producer, start_client
from services.ports import free_port
from services.settings import Settings
from serving.feature_store import FeatureStore
from serving.fm_model import FMModel
from serving.model import TrainerModel

USERS = {1: {"user_id": [1], "gender": [11], "age": [25]}, 2: {"user_id": [2], "gender": [12], "age": [35]}}
ITEMS = {i: {"item_id": [i], "genres": [100 + i % 3, 200], "year": [1990 + i % 5]} for i in range(1, 51)}


@contextmanager
def running(app: FastAPI) -> Iterator[str]:
    """Serve ``app`` with uvicorn (lifespan on) in a thread; yield its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="on",
                                           log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)


def wait_ready(base: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(f"{base}/readyz", timeout=5)
        if r.status_code == 200:
            return r.json()
        if time.monotonic() > deadline:
            raise AssertionError(f"not ready: {r.text}")
        time.sleep(0.1)


@pytest.fixture
def serving_settings(settings: Settings, redis_url: str) -> Settings:
    settings.redis_url = redis_url
    return settings


def replica_settings(settings: Settings, prefix: str, snapshots: Path) -> Settings:
    """The serving settings of a test replica: the built-in FM, its own Redis prefix and its own
    realtime consumer group (the tests of one worker share a broker: a replica that an earlier test
    left in the shared group held every later join for 90 s and more). Its Kafka session is the
    joiner's (6 s, heartbeats every second): the embedded broker holds a group's first join for
    about half a session (tansu quirk 3), and a replica stopped before its realtime consumer
    joined waits that out; with the default 10 s, 4.6 s per test replica, 2.5 s with this."""
    return settings.updated(
        serving=dict(model="fm", redis_prefix=prefix, realtime_group_id=f"realtime-{prefix}", kafka_retry_s=0.5,
                     embedding_dim=4),
        kafka=dict(session_timeout_ms=6_000, heartbeat_interval_ms=1_000),
        trainer=dict(snapshot_dir=snapshots))


@pytest.fixture
def options(serving_settings: Settings, tmp_path: Path) -> Settings:
    """:func:`replica_settings` of a test on the session broker and Redis."""
    return replica_settings(serving_settings, f"t{time.time_ns()}", tmp_path / "snapshots")


@pytest.fixture
def filled_store(options: Settings) -> Settings:
    async def fill() -> None:
        store = FeatureStore(options.redis, options.serving.redis_prefix)
        await store.put(USERS, ITEMS)
        await store.close()

    asyncio.run(fill())
    return options


def sparse_delta(table: str, keys: np.ndarray, values: np.ndarray, version: int, chunk: int = 0,
                 chunks: int = 1, tombstones: np.ndarray | None = None, model_id: str = "deepfm") -> ParameterDelta:
    tomb = np.empty(0, np.int64) if tombstones is None else tombstones
    return ParameterDelta(
        model_id=model_id, version=version, chunk_index=chunk, chunk_count=chunks,
        created_at_ms=int(time.time() * 1000), max_event_time_ms=int(time.time() * 1000),
        sparse=SparseRows(table=table, dim=values.shape[1], keys=keys.astype("<i8").tobytes(),
                          values=values.astype("<f4").tobytes(), tombstones=tomb.astype("<i8").tobytes()),
    )


def dense_delta(bias: float, version: int, model_id: str = "deepfm",
                sample_rates: dict | None = None) -> ParameterDelta:
    """``sample_rates``: ``{"global": r, "slices": {...}}`` the trainer sends along (None: none)."""
    rates = None if sample_rates is None else SampleRates(global_rate=sample_rates["global"],
                                                          slices=sample_rates["slices"])
    return ParameterDelta(
        model_id=model_id, version=version, chunk_index=0, chunk_count=1, created_at_ms=int(time.time() * 1000),
        dense=DenseParameters(tensors=[Tensor(name="bias", shape=[1], values=np.array([bias], "<f4").tobytes())],
                              sample_rates=rates),
    )


async def publish(settings: Settings, messages: list[ParameterDelta]) -> int:
    """Publish deltas in order; return the offset after the last one (a snapshot's resume point)."""
    # One partition, as `make up` creates it: deltas must stay in order (auto-creation gives 4).
    await create_topics(settings, {settings.topics.param_deltas: settings.topics.param_delta_partitions})
    p = producer(settings)
    await start_client(p, settings)
    try:
        futures = []
        for m in messages:
            key = f"{m.model_id}/{m.sparse.table if m.HasField('sparse') else 'dense'}".encode()
            futures.append(await p.send(settings.topics.param_deltas, m.SerializeToString(), key=key))
        metas = await asyncio.gather(*futures)
    finally:
        await p.stop()
    return max(md.offset for md in metas) + 1


async def produce_actions(settings: Settings, actions: list[Action]) -> None:
    """Write ``actions`` to the actions topic, keyed by request id."""
    p = producer(settings)
    await start_client(p, settings)
    try:
        for a in actions:
            await p.send_and_wait(settings.topics.actions, a.SerializeToString(), key=a.request_id.encode())
    finally:
        await p.stop()


async def read_keys(settings: Settings, topic: str, want: set[str], timeout: float = 20.0) -> set[str]:
    """The record keys on ``topic`` (read from its beginning) once ``want`` is among them, or what
    was there when ``timeout`` ran out."""
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(topic, bootstrap_servers=settings.bootstrap_servers, group_id=None,
                                auto_offset_reset="earliest", enable_auto_commit=False)
    await start_client(consumer, settings)
    seen: set[str] = set()
    try:
        deadline = time.monotonic() + timeout
        while not want <= seen and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=300)
            seen |= {r.key.decode() for records in batches.values() for r in records if r.key}
    finally:
        await consumer.stop()
    return seen


async def read_records(settings: Settings, topic: str, message: type, n: int, timeout: float = 20.0) -> list:
    """The first ``n`` ``message`` records on ``topic`` (fewer when ``timeout`` passes first)."""
    consumer = TypedConsumer(settings, "test", message, [topic], None)
    out: list = []
    async with consumer:
        deadline = time.monotonic() + timeout
        while len(out) < n and time.monotonic() < deadline:
            out += [r.value for r in await consumer.poll(timeout_ms=300)]
    return out


async def dead_letters(settings: Settings, n: int, timeout: float = 20.0) -> list[DeadLetter]:
    """The first ``n`` records on the dead-letter topic (fewer when ``timeout`` passes first)."""
    return await read_records(settings, settings.topics.dead_letters, DeadLetter, n, timeout)


def parameters(model: FMModel | TrainerModel) -> dict[str, np.ndarray]:
    """Every parameter as arrays (for comparing replicas): per table sorted keys and values."""
    out: dict[str, np.ndarray] = {}
    for name, table in model.tables.items():
        keys, values, _s, _t = table.items()
        out[f"{name}.keys"], out[f"{name}.values"] = keys, values
    if isinstance(model, FMModel):
        out.update({f"dense.{k}": v.copy() for k, v in model.dense_params.items()})
    else:
        out.update({f"dense.{k}": v.detach().numpy().copy() for k, v in model.scorer.head.state_dict().items()})
    return out
