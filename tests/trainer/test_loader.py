"""The online trainer's loader process (``TrainerSettings.loader = "process"``): it dies with the
trainer, its death is the trainer's error, and batches of a superseded assignment are never applied."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from proto import Example
from trainer import snapshots
from trainer.config import deepfm_config
from trainer.data import MovieLensData, produce_examples
from trainer.loader import LoaderDied, Shipment
from trainer.online import OnlineTrainer

N = 6_000


@pytest.fixture(scope="module")
def ml_examples() -> list[Example]:
    return MovieLensData(limit=N).examples()


def small_cfg():
    return deepfm_config(dim=8, mlp=[32])


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == pid:
                out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited (its new parent reaps it)


async def test_loader_dies_with_killed_trainer(settings, ml_examples, tmp_path):
    (tmp_path / "model.json").write_text(small_cfg().model_dump_json())
    await produce_examples(settings, ml_examples[:2000])
    env = dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=settings.bootstrap_servers, DRIFTLINE_VAR_DIR=str(settings.var_dir),
               DRIFTLINE_TOPICS__EXAMPLES=settings.topics.examples,
               DRIFTLINE_TOPICS__PARAM_DELTAS=settings.topics.param_deltas,
               DRIFTLINE_TOPICS__DEAD_LETTERS=settings.topics.dead_letters,
               DRIFTLINE_TRAINER__MODEL=str(tmp_path / "model.json"), DRIFTLINE_TRAINER__LOADER="process")
    log = tmp_path / "trainer.log"
    p = subprocess.Popen([sys.executable, "-m", "trainer", "online", "--sync-interval-s", "0.5",
                          "--snapshot-interval-event-s", "0", "--batch-size", "256"],
                         env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2])
    try:
        deadline = time.monotonic() + 90
        loaders: list[int] = []
        while time.monotonic() < deadline and not loaders:
            loaders = [c for c in _children(p.pid) if "multiprocessing" in Path(f"/proc/{c}/cmdline").read_text()]
            await asyncio.sleep(0.1)
        assert loaders, log.read_text()[-3000:]
        await asyncio.sleep(7.0)  # past the group join (~5 s on tansu): the loader is assigned and fetching
        assert p.poll() is None, log.read_text()[-3000:]
        p.send_signal(signal.SIGKILL)
        p.wait()
        gone_by = time.monotonic() + 10
        while time.monotonic() < gone_by and any(_alive(c) for c in loaders):
            await asyncio.sleep(0.1)
        assert not any(_alive(c) for c in loaders), "the loader outlived its kill -9'd trainer"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


async def test_stale_generation_not_applied(settings, ml_examples, tmp_path, caplog):
    """A reassignment mid-stream (the same partitions, as a rebalance that keeps them gives) drops
    what the loader had fetched for the old generation and continues each partition where the last
    batch taken ended: every example applied exactly once (no duplicates re-fetched either). A batch
    of an old generation still in the pipe is dropped, never trained on."""
    caplog.set_level("INFO", logger="trainer.online")
    records = await produce_examples(settings, ml_examples)
    tr = OnlineTrainer(settings.updated(trainer=dict(sync_interval_s=0.5, snapshot_interval_event_s=0, batch_size=256, loader="process")), small_cfg())
    run = asyncio.create_task(tr.run(stop_when_idle_s=3.0))
    deadline = time.monotonic() + 60
    while tr.examples_applied < 1000:
        assert time.monotonic() < deadline and not run.done()
        await asyncio.sleep(0.01)
    # a batch of examples that are not in the topic, tagged with the current (about to be old) generation
    fake = [Example(example_id=f"stale/{i}", event_time_ms=1, sample_rate=1.0, labels={"click": 1.0})
            for i in range(50)]
    for e in fake:
        for s in small_cfg().all_slots:
            e.features.sparse[s].ids.append(7)
    raws = [e.SerializeToString() for e in fake]
    n = len(raws)
    stale = Shipment(tr.generation, int(time.time() * 1000), b"".join(raws), np.array([len(r) for r in raws]),
                     np.zeros(n, np.int64), np.arange(10**6, 10**6 + n), np.full(n, -1), b"", np.full(n, -1), {})
    tr._loader._queue.appendleft(stale)
    tr._new_generation(set(range(settings.topics.partitions)))
    res = await asyncio.wait_for(run, 120)
    assert tr.generation >= 2
    assert "dropped a batch of 50 records fetched for superseded assignment" in caplog.text
    assert res["examples_applied"] == N and res["duplicates"] == 0 and res["bad"] == 0, res
    man = snapshots.read_manifest(tr.snapshot_root)
    assert sum(man["offsets"].values()) == records and max(man["offsets"].values()) < 10**6


async def test_loader_crash_is_a_trainer_error(settings, ml_examples):
    await produce_examples(settings, ml_examples[:500])
    tr = OnlineTrainer(settings.updated(trainer=dict(sync_interval_s=0.5, snapshot_interval_event_s=0, loader="process")), small_cfg())
    run = asyncio.create_task(tr.run())
    deadline = time.monotonic() + 60
    while tr.examples_applied < 500:
        assert time.monotonic() < deadline and not run.done()
        await asyncio.sleep(0.05)
    os.kill(tr._loader.process.pid, signal.SIGKILL)
    with pytest.raises(LoaderDied):
        await asyncio.wait_for(run, 30)
