"""Broker resets under serving (tansu restarted: memory storage lost, every topic recreated empty),
on a broker of this module's own: the feature-log spool re-ships what the reset broker may have
held (actions too), the delta reader reads the new topic from its start and reloads the trainer's new-epoch
snapshot, the real-time reader reads the new actions topic from its start."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from serving_helpers import parameters, produce_actions, publish, read_keys

from proto import Action
from services.broker_reset import read_broker_epoch
from services.kafka import create_topics
from services.settings import Settings
from serving.broker_epoch import SharedEpoch
from serving.deltas import DeltaFeed
from serving.feature_log import FeatureLogger
from serving.feature_store import FeatureStore
from serving.model import TrainerModel
from serving.realtime import RecentClicks
from tests.conftest import Broker, KilledBroker, killed_broker
from trainer import snapshots
from trainer.batch import SparseBatch
from trainer.config import deepfm_config
from trainer.model import SparseModel
from trainer.sync import encode_dense, encode_sparse_tables


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilledBroker]:
    yield from killed_broker(tmp_path_factory, "serving-reset-broker")


async def _until(predicate, timeout_s: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_feature_log_reships_retained_logs_after_a_reset(settings: Settings, broker: Broker) -> None:
    epochs = SharedEpoch(settings)
    log = FeatureLogger(settings.updated(serving=dict(kafka_retry_s=0.2)), epochs)
    log.start()
    try:
        before = [f"before-{i}" for i in range(20)]
        for rid in before:
            log.submit(rid, b"feature log of " + rid.encode())
        await _until(lambda: log.spool.pending == 0, what="first shipment")
        assert before == sorted(await read_keys(settings, settings.topics.features, set(before)),
                                key=lambda k: int(k.split("-")[1]))
        broker.restart()  # everything shipped so far lived only in the broker
        after = [f"after-{i}" for i in range(5)]
        for rid in after:
            log.submit(rid, b"feature log of " + rid.encode())
        await _until(lambda: log.reshipped >= 20 and log.spool.pending == 0, what="re-shipment")
        want = set(before) | set(after)
        seen = await read_keys(settings, settings.topics.features, want)
        assert want <= seen, sorted(want - seen)
        assert log.spool.epoch == await read_broker_epoch(settings)
    finally:
        await log.stop()
        await epochs.stop()


async def test_acknowledged_actions_are_reshipped_after_a_reset(settings: Settings, broker: Broker) -> None:
    """An action the broker acknowledged (what /actions' 202 waits for) lives only in the broker
    until someone reads it: a reset (memory storage) would lose it. Serving keeps it a while
    (``retain_actions``) and sends it again to the new broker's actions topic."""
    epochs = SharedEpoch(settings)
    log = FeatureLogger(settings.updated(serving=dict(kafka_retry_s=0.2)), epochs)
    log.start()
    try:
        await _until(lambda: log.producer is not None, what="the shipper's producer")
        log.submit("r-1", b"feature log of r-1")
        await _until(lambda: log.spool.pending == 0, what="first shipment")
        clicks = [(f"r-{i}", Action(request_id=f"r-{i}", item_id=i, action_type="click").SerializeToString())
                  for i in range(1, 11)]
        for rid, value in clicks:  # what /actions does before its 202
            assert log.producer is not None
            await log.producer.send_and_wait(settings.topics.actions, value, key=rid.encode())
        log.retain_actions(clicks)
        want = {rid for rid, _ in clicks}
        assert want <= await read_keys(settings, settings.topics.actions, want)
        broker.restart()  # nobody read them: gone with the broker
        assert want <= await read_keys(settings, settings.topics.actions, want, timeout=60)
        await _until(lambda: log.spool.pending == 0 and log.reshipped >= 1, what="the feature log re-shipped")
        assert "r-1" in await read_keys(settings, settings.topics.features, {"r-1"})
        assert log.spool.epoch == await read_broker_epoch(settings)
    finally:
        await log.stop()
        await epochs.stop()


def _train(model: SparseModel, rng: np.random.Generator, steps: int) -> None:
    for s in range(steps):
        rows = [{"user_id": [int(rng.integers(1, 50))], "item_id": [int(rng.integers(1, 200))],
                 "genres": list(map(int, rng.integers(0, 18, 2)))} for _ in range(64)]
        model.train_step(SparseBatch.from_slot_dicts(rows, slots=model.cfg.all_slots,
                                                     labels=rng.integers(0, 2, 64).astype(np.float32),
                                                     event_time_ms=np.full(64, 1_700_000_000_000 + s, np.int64)))


def _deltas(cfg, trainer: SparseModel, version: int) -> list:
    msgs = [m for _t, m in encode_sparse_tables(cfg.model_id, version, trainer.tables)]
    return msgs + [encode_dense(cfg.model_id, version, trainer.head)]


def _trainer_params(trainer: SparseModel) -> dict[str, np.ndarray]:
    out = {}
    for name, t in trainer.tables.items():
        k, v, _s, _t = t.items()
        out[f"{name}.keys"], out[f"{name}.values"] = k, v
    out.update({f"dense.{k}": v.detach().numpy() for k, v in trainer.head.state_dict().items()})
    return out


def _assert_same(expected: dict, got: dict) -> None:
    assert expected.keys() == got.keys()
    for k in expected:
        np.testing.assert_array_equal(expected[k], got[k], err_msg=k)


async def test_delta_feed_follows_the_trainer_across_a_reset(settings: Settings, broker: Broker,
                                                             tmp_path: Path) -> None:
    cfg = deepfm_config(dim=4, mlp=[8])
    rng = np.random.default_rng(9)
    trainer = SparseModel(cfg, train=True)
    root = tmp_path / "snapshots"
    feed = DeltaFeed(settings, TrainerModel(config=cfg), snapshot_dir=root, retry_s=0.2)
    feed.load_snapshot()
    feed.start()
    try:
        for version in (1, 2, 3):  # the old topic: its offsets go past what the new one will hold
            _train(trainer, rng, 3)
            await publish(settings, _deltas(cfg, trainer, version))
        await _until(lambda: feed.model.sparse.version == 3 and feed.model.dense.version == 3, what="v3")
        _assert_same(_trainer_params(trainer), parameters(feed.model))

        broker.restart()
        # The trainer (still running) goes on publishing on the new, empty topic: offset 0 on.
        _train(trainer, rng, 3)
        await publish(settings, _deltas(cfg, trainer, 4))
        await _until(lambda: feed.model.sparse.version == 4 and feed.model.dense.version == 4,
                     what="the first delta of the new topic")
        assert feed.awaiting_epoch is not None and feed.model.sparse.version == 4  # still serving

        # The trainer's snapshot of the new epoch holds training no delta carried: only a reload
        # can make the replica equal to it. Its offset says where the later deltas start.
        epoch = await read_broker_epoch(settings)
        assert epoch == feed.awaiting_epoch
        _train(trainer, rng, 3)
        end = await _end_offset(settings)
        snapshots.save(root / cfg.model_id, cfg, trainer.tables, {"head": trainer.head.state_dict()},
                       {"sparse_version": 5, "dense_version": 5, "param_deltas_offset": end,
                        "broker_epoch": epoch})
        _train(trainer, rng, 3)
        await publish(settings, _deltas(cfg, trainer, 6))
        await _until(lambda: feed.reloads == 1 and feed.model.sparse.version == 6 and feed.model.dense.version == 6,
                     what="reload and the delta after the snapshot")
        assert feed.awaiting_epoch is None
        _assert_same(_trainer_params(trainer), parameters(feed.model))
    finally:
        await feed.stop()


async def _end_offset(settings: Settings) -> int:
    from aiokafka import TopicPartition

    from services.tansu_quirks import log_end_offsets

    tp = TopicPartition(settings.topics.param_deltas, 0)
    return (await log_end_offsets(settings, [tp]))[tp]


async def test_recent_clicks_read_the_new_actions_topic_from_its_start(
        serving_settings: Settings, broker: Broker) -> None:
    settings = serving_settings
    settings.kafka.session_timeout_ms = 6_000  # tansu's first join waits about half of it
    settings.kafka.heartbeat_interval_ms = 1_000
    prefix = f"r{time.time_ns()}"
    store = FeatureStore(settings.redis, prefix)
    reader = RecentClicks(settings, store, ("click",), group_id=f"g{time.time_ns()}", retry_s=0.2)
    await create_topics(settings, {settings.topics.actions: 2})
    reader.start()
    now = int(time.time() * 1000)
    try:
        n = 0
        while not await store.redis.lrange(store.clicks_key(7), 0, -1):  # the group's first join
            n += 1
            await produce_actions(settings, [Action(request_id=f"a{n}", item_id=100 + n, action_type="click",
                                                     user_id=7, event_time_ms=now)])
            await asyncio.sleep(0.3)
            assert n < 100, "the reader never recorded a click"
        broker.restart()
        await create_topics(settings, {settings.topics.actions: 2})
        # Produced before the reader has rejoined on the new broker: "latest" would skip them.
        await produce_actions(settings, [Action(request_id=f"b{i}", item_id=500 + i, action_type="click",
                                                 user_id=8, event_time_ms=now) for i in range(5)])
        deadline = time.monotonic() + 40
        while len(clicks := [int(x) for x in await store.redis.lrange(store.clicks_key(8), 0, -1)]) < 5:
            assert time.monotonic() < deadline, clicks
            await asyncio.sleep(0.2)
        assert sorted(clicks) == [500, 501, 502, 503, 504]
        assert reader.from_beginning
        assert await store.get_marker("realtime-epoch") == await read_broker_epoch(settings)
    finally:
        await reader.stop()
        await store.close()


async def test_a_snapshot_from_before_a_reset_is_replaced_at_start(settings: Settings, tmp_path: Path) -> None:
    """Serving starts after a reset it did not see: the newest snapshot's offset points into a topic
    that is gone, so the feed reads the new topic from its start and reloads the first snapshot
    of the broker's current epoch."""
    from serving.fm_model import FMModel

    root = tmp_path / "snapshots"
    old = FMModel(dim=4)
    old.sparse.version = old.dense.version = 7
    old.save_snapshot(root, broker_epoch="an-epoch-before-the-reset")
    feed = DeltaFeed(settings, FMModel(dim=4), snapshot_dir=root, retry_s=0.2)
    feed.load_snapshot()
    feed.resume_offset = 10**6  # where the old topic was; the new one is far shorter
    feed.start()
    try:
        await _until(lambda: feed.epoch is not None, what="the feed's first connection")
        epoch = await read_broker_epoch(settings)
        assert feed.awaiting_epoch == epoch and feed.resume_offset is None and feed.loaded
        new = FMModel(dim=4)
        new.sparse.version, new.dense.version = 9, 8  # the stand-in's newest is by versions
        new.dense_params["bias"][0] = 0.25
        new.save_snapshot(root, broker_epoch=epoch)
        await _until(lambda: feed.reloads == 1, what="the reload")
        assert (feed.model.sparse.version, feed.model.dense.version) == (9, 8)
        assert float(feed.model.dense_params["bias"][0]) == 0.25 and feed.awaiting_epoch is None
    finally:
        await feed.stop()
