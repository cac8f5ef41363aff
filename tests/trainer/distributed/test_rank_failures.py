"""Two ranks under torch's elastic launcher through what goes wrong in production: the broker's data
reset under them (tansu memory storage, a kill -9 of the broker), and an example that decodes but
fails its training step on one rank. Real broker (this module's own, restarted by the test), real
processes; the group must go on without a restart.

The happy paths and kill -9 of a rank: tests/trainer/distributed/test_ranks.py."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from aiokafka import TopicPartition

from proto import DeadLetter, Example
from services import broker_reset, example_batch, tansu_quirks
from tests.conftest import killed_broker
from trainer import snapshots
from trainer.config import ModelConfig, deepfm_config
from trainer.data import MovieLensData, produce_examples
from trainer.model import SparseModel
from trainer.snapshot_store import SnapshotStore

from ..test_online import read_topic
from .test_ranks import REPO, _env, _results

N = 4_000
OLD, NEW = 2_000, 2_000  # examples before and after the reset
REPEATED = 300  # examples of the old epoch the new topic holds again (a joiner re-emitting them)
HUGE = 3e38  # a finite float32: the decoder accepts it, a dense weight of 2 overflows the logit


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory):
    yield from killed_broker(tmp_path_factory, "rank-failures-broker")


@pytest.fixture(scope="module")
def ml_examples() -> list[Example]:
    return MovieLensData(limit=N).examples()


def _spawn(settings, tmp: Path, log: Path, cfg: ModelConfig, idle_s: str = "600",
           mode: str = "sync") -> subprocess.Popen:
    """The trainer with 2 ranks in ``mode``, stopping when idle ``idle_s`` (by default stopped by
    SIGTERM), no periodic snapshots."""
    (tmp / "model.json").write_text(cfg.model_dump_json())
    return subprocess.Popen([sys.executable, "-m", "trainer", "online", "--sync-interval-s", "1",
                             "--snapshot-interval-event-s", "0", "--stop-when-idle-s", idle_s, "--batch-size", "512"],
                            env=dict(_env(settings, tmp), DRIFTLINE_TRAINER__DIST_MODE=mode), stdout=open(log, "ab"),
                            stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)


async def _committed(settings) -> int:
    """The records the trainer group committed on ``examples`` (all partitions; -1: none)."""
    tps = [TopicPartition(settings.topics.examples, p) for p in range(settings.topics.partitions)]
    got = await tansu_quirks.committed_offsets(settings, settings.trainer.group_id, tps)
    return sum(max(0, o) for o in got.values())


async def _until_committed(settings, records: int, p: subprocess.Popen, log: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert p.poll() is None, log.read_text()[-4000:]
        try:
            if await _committed(settings) >= records:
                return
        except Exception:  # noqa: BLE001 - the broker restarting, or the group not there yet
            pass
        assert time.monotonic() < deadline, f"{records} records not committed\n" + log.read_text()[-4000:]
        await asyncio.sleep(0.5)


def _stop(p: subprocess.Popen, log: Path) -> str:
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == 0, log.read_text()[-4000:]
    text = log.read_text()
    assert "failed (exitcode" not in text, text[-4000:]  # no rank failed: the group never restarted
    return text


@pytest.mark.parametrize("mode", ["sync", "gba"])
async def test_two_ranks_follow_a_broker_reset(settings, broker, ml_examples, tmp_path, mode):
    """gba: the rounds do not wait (trainer.dist.rounds): the reset is handled after the agreement
    in flight that carries it, by both ranks."""
    old, new = ml_examples[:OLD], ml_examples[OLD:OLD + NEW]
    root = settings.var_dir / "snapshots" / "deepfm"
    log = tmp_path / "trainer.log"
    records = await produce_examples(settings, old, chunk=250)
    p = _spawn(settings, tmp_path, log, deepfm_config(dim=8, mlp=[32], sequential=mode != "gba"), mode=mode)
    try:
        await _until_committed(settings, records, p, log)
        # the last touched rows published (sync every 1 s): a send in flight at the kill would be
        # retried into the new broker before its topic exists (tansu then numbers offsets twice)
        await asyncio.sleep(3)
        old_epoch = await broker_reset.read_broker_epoch(settings)
        await asyncio.to_thread(broker.restart)  # kill -9: every topic, offset and group is gone
        records = await produce_examples(settings, old[:REPEATED] + new, chunk=250)
        await _until_committed(settings, records, p, log)
        await asyncio.sleep(1)
    finally:
        text = _stop(p, log) if p.poll() is None else log.read_text()
    new_epoch = await broker_reset.read_broker_epoch(settings)
    assert new_epoch and new_epoch != old_epoch
    assert text.count("broker reset (epoch") == 2, text[-4000:]  # each rank followed it, once
    res = _results(log)
    assert sorted(res) == [0, 1] and {r["broker_epoch"] for r in res.values()} == {new_epoch}
    # every example once: the repeated ones (and any fetched at old positions) dropped as duplicates
    assert sum(r["examples_applied"] for r in res.values()) == OLD + NEW, res
    assert sum(r["duplicates"] for r in res.values()) >= REPEATED, res
    mans = sorted((json.loads((d / "manifest.json").read_text()) for d in root.glob("snap-*")), key=lambda m: m["seq"])
    at_reset = next(m for m in mans if m.get("broker_epoch") == new_epoch)  # written when the reset was handled
    assert at_reset["examples_applied"] >= OLD and at_reset["shard_count"] == 2
    final = snapshots.read_manifest(root)
    assert final["broker_epoch"] == new_epoch and final["examples_applied"] == OLD + NEW
    assert sum(final["offsets"].values()) == records  # every record of the new topic consumed
    assert (root / "broker-epoch").read_text() == new_epoch


async def test_two_ranks_started_after_a_broker_reset_keep_their_snapshot(settings, broker, ml_examples, tmp_path):
    """The group stopped, the broker's data reset, the group started again (or restarted by the
    launcher mid-reset): the snapshot of the old epoch is restored whole, its offsets are not used."""
    old, new = ml_examples[:OLD], ml_examples[OLD:OLD + NEW]
    root = settings.var_dir / "snapshots" / "deepfm"
    log = tmp_path / "trainer.log"
    cfg = deepfm_config(dim=8, mlp=[32])
    await produce_examples(settings, old, chunk=250)
    p = _spawn(settings, tmp_path, log, cfg, idle_s="3")
    assert p.wait(timeout=240) == 0, log.read_text()[-4000:]
    stopped = snapshots.read_manifest(root)
    assert stopped["examples_applied"] == OLD and stopped["broker_epoch"]
    await asyncio.to_thread(broker.restart)
    records = await produce_examples(settings, old[:REPEATED] + new, chunk=250)
    p = _spawn(settings, tmp_path, log, cfg, idle_s="3")
    assert p.wait(timeout=240) == 0, log.read_text()[-4000:]
    text = log.read_text()
    assert "failed (exitcode" not in text and "in another broker epoch" in text, text[-4000:]
    new_epoch = await broker_reset.read_broker_epoch(settings)
    res = _results(log)
    assert sum(r["examples_applied"] for r in res.values()) == OLD + NEW, res
    assert sum(r["duplicates"] for r in res.values()) >= REPEATED, res
    mans = sorted((json.loads((d / "manifest.json").read_text()) for d in root.glob("snap-*")), key=lambda m: m["seq"])
    at_start = next(m for m in mans if m["seq"] == stopped["seq"] + 1)  # written before any batch
    assert at_start["broker_epoch"] == new_epoch and at_start["examples_applied"] == OLD
    assert at_start["dense_version"] == stopped["dense_version"] + 1
    final = snapshots.read_manifest(root)
    assert final["broker_epoch"] == new_epoch and sum(final["offsets"].values()) == records


def _overflowing_warm_start(root: Path, cfg: ModelConfig, topic: str) -> None:
    """A snapshot whose dense weight is above 1: ``x = HUGE`` then overflows the logit to inf (a
    state training could reach; the other examples' ``x = 0`` never move the weight)."""
    model = SparseModel(cfg)
    with torch.no_grad():
        model.head.dense_linear.weight.fill_(2.0)
    SnapshotStore(root, cfg, topic).save(model, {}, {"topic": topic, "offsets": {}, "examples_applied": 0})


@pytest.mark.parametrize("mode", ["sync", "hybrid", "gba"])
async def test_a_failing_example_on_one_rank_is_dead_lettered_and_the_group_goes_on(settings, ml_examples, tmp_path, mode):
    # gba: its own rank bisects (no lockstep), on a model that is not sequential (gba refuses one)
    # raw dense inputs: a scaled x could not overflow (trainer.dense_scaling)
    cfg = ModelConfig.model_validate({**deepfm_config(dim=8, mlp=[32], sequential=mode != "gba").model_dump(),
                                      "dense_features": ["x"], "dense_scaling": "none"})
    examples = [Example.FromString(e.SerializeToString()) for e in ml_examples[:N // 2]]
    for e in examples:
        e.features.dense["x"] = 0.0
    poison = Example.FromString(examples[500].SerializeToString())
    poison.example_id, poison.labels["click"] = "poison/500", 0.0
    poison.features.dense["x"] = HUGE
    root = settings.var_dir / "snapshots" / "deepfm"
    _overflowing_warm_start(root, cfg, settings.topics.examples)
    records = await produce_examples(settings, examples[:1000] + [poison] + examples[1000:], chunk=250)
    log = tmp_path / "trainer.log"
    p = _spawn(settings, tmp_path, log, cfg, mode=mode)
    try:
        await _until_committed(settings, records, p, log)
    finally:
        _stop(p, log) if p.poll() is None else None
    res = _results(log)
    assert sorted(res) == [0, 1], log.read_text()[-3000:]
    assert sum(r["examples_applied"] for r in res.values()) == len(examples), res
    assert {r["mode"] for r in res.values()} == {mode} and not any(r["failed_updates"] for r in res.values())
    assert sum(r["failed_steps"] for r in res.values()) == 1 and sum(r["bad"] for r in res.values()) == 1, res
    [letter] = [DeadLetter.FromString(v) for v in await read_topic(settings, settings.topics.dead_letters, timeout_s=1.0)]
    ids = [e.example_id for e in example_batch.to_examples(example_batch.decode(letter.value))]
    assert ids == ["poison/500"] and letter.reason.startswith("failed: NonFiniteStepError"), letter.reason
    man = snapshots.read_manifest(root)
    assert man["shard_count"] == 2 and man["examples_applied"] == len(examples)
    assert sum(man["offsets"].values()) == records  # moved past it
    assert np.isfinite([r["loss"] for r in res.values()]).all()
