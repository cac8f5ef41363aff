"""A clean stop: SIGTERM to the trainer's whole process group (what the supervisor sends on Ctrl-C of
``driftline up``): the trainer drains, commits, writes its final snapshot and exits 0."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from aiokafka import TopicPartition

from services import broker_reset, tansu_quirks
from trainer import snapshots
from trainer.config import deepfm_config
from trainer.data import MovieLensData, produce_examples

N = 3_000


async def test_sigterm_to_the_process_group_stops_cleanly(settings, tmp_path):
    cfg = deepfm_config(dim=8, mlp=[32])
    (tmp_path / "model.json").write_text(cfg.model_dump_json())
    records = await produce_examples(settings, MovieLensData(limit=N).examples())
    env = dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=settings.bootstrap_servers, DRIFTLINE_VAR_DIR=str(settings.var_dir),
               DRIFTLINE_TOPICS__EXAMPLES=settings.topics.examples,
               DRIFTLINE_TOPICS__PARAM_DELTAS=settings.topics.param_deltas,
               DRIFTLINE_TOPICS__DEAD_LETTERS=settings.topics.dead_letters,
               DRIFTLINE_TRAINER__MODEL=str(tmp_path / "model.json"),
               DRIFTLINE_METRICS_PORT="0")
    log = tmp_path / "trainer.log"
    # as `driftline up` runs it, in a process group of its own (the supervisor signals the group);
    # no periodic snapshot: the only one is the final one
    p = subprocess.Popen([sys.executable, "-m", "driftline.cli", "trainer", "online", "--sync-interval-s", "0.5",
                          "--snapshot-interval-event-s", "0", "--batch-size", "256"],
                         env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2],
                         start_new_session=True)
    try:
        parts = [TopicPartition(settings.topics.examples, q) for q in range(settings.topics.partitions)]
        deadline = time.monotonic() + 90
        committed = 0
        while committed < records:  # offsets are committed once their batch is applied
            assert time.monotonic() < deadline and p.poll() is None, log.read_text()[-3000:]
            await asyncio.sleep(0.5)
            offs = await tansu_quirks.committed_offsets(settings, settings.trainer.group_id, parts)
            committed = sum(max(0, o) for o in offs.values())
        assert snapshots.read_manifest(settings.var_dir / "snapshots" / cfg.model_id) is None
        stopped_at = time.monotonic()
        os.killpg(p.pid, signal.SIGTERM)
        assert p.wait(timeout=10) == 0, log.read_text()[-3000:]
        assert time.monotonic() - stopped_at < 10  # within the supervisor's grace period
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    out = log.read_text()
    assert "Traceback" not in out, out[-3000:]
    man = snapshots.read_manifest(settings.var_dir / "snapshots" / cfg.model_id)
    assert man is not None and man["examples_applied"] == N and sum(man["offsets"].values()) == records
    assert man["broker_epoch"] == (await broker_reset.read_broker_epoch(settings))
