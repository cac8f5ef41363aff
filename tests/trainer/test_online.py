"""Online trainer on the real broker: AUC, delta reproduction, dead letters, kill -9 resume."""

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
import torch
from aiokafka import AIOKafkaConsumer, TopicPartition
from prometheus_client import REGISTRY

from proto import DeadLetter, Example, ParameterDelta
from services import example_batch
from trainer import snapshots
from trainer.config import deepfm_config
from trainer.data import MovieLensData, produce_examples
from trainer.model import make_tables
from trainer.online import OnlineTrainer
from trainer.sync import apply_delta, complete_versions

N = 20_000


@pytest.fixture(scope="module")
def ml_examples() -> list[Example]:
    d = MovieLensData(limit=N)
    return d.examples()


def small_cfg():
    return deepfm_config(dim=8, mlp=[32])


async def read_topic(settings, topic: str, timeout_s: float = 3.0) -> list[bytes]:
    c = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap_servers, enable_auto_commit=False, group_id=None)
    await c.start()
    try:
        tp = TopicPartition(topic, 0)
        c.assign([tp])
        await c.seek_to_beginning(tp)
        out, idle = [], time.monotonic()
        while time.monotonic() - idle < timeout_s:
            got = await c.getmany(tp, timeout_ms=300)
            for recs in got.values():
                if recs:
                    idle = time.monotonic()
                out.extend(r.value for r in recs)
        return out
    finally:
        await c.stop()


async def test_online_auc_deltas_and_dead_letters(settings, ml_examples):
    bad = [Example(example_id="bad/1", event_time_ms=1, sample_rate=1.0, labels={"click": 1.0}),
           Example(example_id="bad/2", event_time_ms=1, sample_rate=1.0, labels={"click": float("nan")})]
    bad[0].features.sparse["nonexistent_slot"].ids.append(3)
    dup = list(ml_examples[:500])  # at-least-once duplicates
    half = N // 2
    await produce_examples(settings, ml_examples[:half] + bad)
    # a record that is not an example batch (an Example proto, the format before batches): dead-
    # lettered whole with its exact bytes
    odd = bad[0].SerializeToString() + Example(event_time_ms=1).SerializeToString()
    from services.kafka import producer, start_client
    prod = producer(settings)
    await start_client(prod, settings)
    await prod.send_and_wait(settings.topics.examples, odd, key=b"odd")
    await prod.stop()
    # batches of one 1000-example record (batch_size 1024 takes two: fewer steps, AUC ~0.6)
    tr = OnlineTrainer(settings.updated(trainer=dict(sync_interval_s=1.0, snapshot_interval_event_s=0, batch_size=512)),
                       small_cfg())
    tr.publisher.keep_last_sync_copy = True
    run = asyncio.create_task(tr.run())
    # the second half arrives after a first version was published: several versions to replay
    deadline = time.monotonic() + 60
    while tr.publisher.sparse_version < 1 and not run.done():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    await produce_examples(settings, ml_examples[half:] + dup)
    # stopped when all is in, not after an idle spell: producing the second half took longer than
    # a 3 s one with the whole suite running, and the trainer stopped at the first half
    deadline = time.monotonic() + 120
    while (tr.examples_applied < N or tr.ingest.duplicates < 500) and not run.done():
        assert time.monotonic() < deadline, (tr.examples_applied, tr.ingest.duplicates)
        await asyncio.sleep(0.1)
    tr.stop_event.set()
    res = await asyncio.wait_for(run, 120)
    assert res["examples_applied"] == N
    assert res["bad"] == 3 and res["duplicates"] == 500 and tr.ingest.bad == 3
    assert res["auc"] > 0.6, res
    assert res["sparse_version"] >= 2
    # the counting baseline scored the same examples (the bad ones and the duplicates not), exported
    base = tr.learned.baseline
    assert base.examples == N and 0.5 < res["baseline_auc"] == base.auc.value() < 1, res
    model = {"model": small_cfg().model_id}
    assert REGISTRY.get_sample_value("driftline_trainer_baseline_auc", {**model, "baseline": "counts"}) == res["baseline_auc"]
    assert REGISTRY.get_sample_value("driftline_trainer_log_loss", {**model, "scorer": "counts"}) == res["baseline_log_loss"]
    assert REGISTRY.get_sample_value("driftline_trainer_log_loss", {**model, "scorer": "model"}) == res["log_loss"] > 0
    # and on the recent examples, beside the baseline that counts recent clicks (N is below two
    # half-lives: the model is not judged against it yet)
    assert tr.learned.recent_examples == tr.learned.recent_baseline.examples == N
    for scorer in ("model", "counts", "recent_counts"):
        got = REGISTRY.get_sample_value("driftline_trainer_recent_auc", {**model, "scorer": scorer})
        assert 0.5 < got == res["recent_auc"][scorer] < 1, (scorer, res)
    assert REGISTRY.get_sample_value("driftline_trainer_trails_recent_counts", model) == 0

    # deltas applied in order to empty tables reproduce the trainer's tables at the last sync
    msgs = [ParameterDelta.FromString(v) for v in await read_topic(settings, settings.topics.param_deltas)]
    sparse = [m for m in msgs if m.WhichOneof("payload") == "sparse"]
    versions = [m.version for m in sparse]
    assert versions == sorted(versions)
    replicas = make_tables(small_cfg(), serving=True)
    for version in complete_versions(sparse):
        for m in version:
            apply_delta(replicas, m)
    for name in tr.model.tables:
        k, v, _, _ = tr.publisher.last_sync_tables[name]
        rk, rv, _, _ = replicas[name].items()
        assert np.array_equal(k, rk), name
        assert np.array_equal(v, rv), name
    assert any(m.WhichOneof("payload") == "dense" for m in msgs)
    # the dense weights went out while it learned (the ramp from sync_interval_s), not only at the
    # start and the stop: under the hourly dense_sync_interval_s alone none would have
    assert tr.dense_schedule.learned_syncs >= 1

    letters = [DeadLetter.FromString(v) for v in await read_topic(settings, settings.topics.dead_letters)]
    reasons = sorted(letter.reason for letter in letters)
    assert len(letters) == 3 and [r.split(":")[0] for r in reasons] == ["bad_label", "undecodable", "unknown_slot"]
    assert odd in [letter.value for letter in letters]
    # a refused example's letter is a batch of that example (the rest of its record was learned)
    refused = {letter.reason.split(":")[0]: example_batch.to_examples(example_batch.decode(letter.value))
               for letter in letters if letter.value != odd}
    assert refused["unknown_slot"] == [bad[0]] and [e.example_id for e in refused["bad_label"]] == ["bad/2"]
    assert "nonexistent_slot" in reasons[2] and "'click' missing" in reasons[0], reasons

    # serving catch-up from the final snapshot equals the trainer's tables
    tables, dense, man = snapshots.load_latest(tr.snapshot_root)
    assert man["examples_applied"] == N and man["sparse_version"] == tr.publisher.sparse_version
    # the sample rates it learned under travel with it (MovieLens replay: every negative kept, slice "replay")
    assert (man["sample_rates"]["global"], man["sample_rates"]["slices"]) == (1.0, {"replay": 1.0})
    dense_msgs = [m for m in msgs if m.WhichOneof("payload") == "dense"]
    assert all(m.dense.HasField("sample_rates") for m in dense_msgs)
    assert dict(dense_msgs[-1].dense.sample_rates.slices) == {"replay": 1.0}
    k, v, _, _ = tables["item_id"].items()
    assert np.array_equal(v, tr.model.tables["item_id"].items()[1])


def _spawn(settings, tmp: Path, log: Path, idle_s: str = "4", **env_vars: str) -> subprocess.Popen:
    env = dict(os.environ, **env_vars, KAFKA_BOOTSTRAP_SERVERS=settings.bootstrap_servers,
               DRIFTLINE_VAR_DIR=str(settings.var_dir),
               DRIFTLINE_TOPICS__EXAMPLES=settings.topics.examples,
               DRIFTLINE_TOPICS__PARAM_DELTAS=settings.topics.param_deltas,
               DRIFTLINE_TOPICS__DEAD_LETTERS=settings.topics.dead_letters,
               DRIFTLINE_TRAINER__MODEL=str(tmp / "model.json"))
    return subprocess.Popen([sys.executable, "-m", "trainer", "online", "--sync-interval-s", "1",
                             "--snapshot-interval-event-s", "1800", "--stop-when-idle-s", idle_s, "--batch-size", "512"],
                            env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2])


async def test_kill_9_resume(settings, ml_examples, tmp_path):
    # the served update order: first-order rows stepped example by example inside each batch
    assert small_cfg().sequential
    (tmp_path / "model.json").write_text(small_cfg().model_dump_json())
    half = N // 2  # the second half is produced after the kill: the trainer cannot finish first
    records = await produce_examples(settings, ml_examples[:half])
    root = settings.var_dir / "snapshots" / "deepfm"
    log = tmp_path / "trainer.log"
    p = _spawn(settings, tmp_path, log)
    deadline = time.monotonic() + 90
    first = None
    while time.monotonic() < deadline:
        m = snapshots.read_manifest(root)
        if m and m["examples_applied"] >= 3000:
            first = m
            break
        await asyncio.sleep(0.2)
    assert first is not None, log.read_text()[-3000:]
    p.send_signal(signal.SIGKILL)
    p.wait()
    killed_at = snapshots.read_manifest(root)
    assert killed_at["examples_applied"] <= half
    # every partition is named, even one nothing was applied from yet: a partition left out would
    # resume at the committed offset, which batches applied after the snapshot moved past
    assert len(killed_at["offsets"]) == settings.topics.partitions, killed_at["offsets"]
    records += await produce_examples(settings, ml_examples[half:])
    p = _spawn(settings, tmp_path, log)
    assert p.wait(timeout=120) == 0, log.read_text()[-3000:]
    final = snapshots.read_manifest(root)
    # every example applied exactly once to the surviving lineage of state
    assert final["examples_applied"] == N, (killed_at, final)
    assert final["seq"] > killed_at["seq"]
    assert final["sparse_version"] > killed_at["sparse_version"]
    assert final["auc"] > 0.6
    # the counting baseline went on from the snapshot too: it counted each example once
    scores = torch.load(root / final["name"] / "dense.pt", weights_only=False)["scores"]
    assert scores["count_baseline"]["examples"] == N and scores["log_loss"][1] == N, scores["log_loss"]
    assert scores["recent_counts"]["examples"] == scores["recent_examples"] == N
    total = sum(final["offsets"].values())
    assert total == records  # next offsets of all partitions: every record consumed
    assert "resuming" in log.read_text() or "restored snapshot" in log.read_text()


async def test_online_resumes_from_batch_warm_start(settings, ml_examples, tmp_path):
    """`trainer batch --snapshot` (what `make up` runs first) writes a snapshot that `trainer online`
    resumes from: tables, head and optimizer restored (at the configuration's rate, edited since),
    stream state (offsets, streaming AUC, dedup) started fresh. Examples carrying serving's real-time `recent_items` slot train (no dead letter)
    on the item rows; the sync delay counts from the examples' arrival, not their (year 2000) event time."""
    cfg = small_cfg()
    (tmp_path / "model.json").write_text(cfg.model_dump_json())
    env = dict(os.environ, DRIFTLINE_VAR_DIR=str(settings.var_dir), DRIFTLINE_METRICS_PORT="0")
    warm = 4_000
    out = subprocess.run([sys.executable, "-m", "trainer", "batch", "--movielens", "--model", str(tmp_path / "model.json"),
                          "--limit", str(warm), "--test-fraction", "0.1", "--snapshot", "--quiet"],
                         env=env, cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    root = settings.var_dir / "snapshots" / cfg.model_id
    man = snapshots.read_manifest(root)
    assert man["source"] == "batch" and man["offsets"] == {} and man["max_event_time_ms"] > 0
    batch_tables, _, _ = snapshots.load(root, cfg, serving=False)
    batch_items = batch_tables["item_id"].items()[0]
    assert batch_items.size > 100

    stream = [Example.FromString(e.SerializeToString()) for e in ml_examples[warm:warm + 3_000]]
    for i, e in enumerate(stream[::3]):  # after a first click serving logs the user's recent clicks
        e.features.sparse["recent_items"].ids.extend([int(batch_items[i % batch_items.size]), 10_000_000 + i])
    records = await produce_examples(settings, stream)
    # the project file's dense rate edited since the warm start: the online trainer learns on at it
    online = cfg.model_copy(update={"dense_lr": 2 * cfg.dense_lr})
    tr = OnlineTrainer(settings.updated(trainer=dict(sync_interval_s=0.5, snapshot_interval_event_s=0)), online)
    labels = {"model": cfg.model_id, "table": "item_id"}
    admitted = REGISTRY.get_sample_value("driftline_ps_admitted_total", labels) or 0.0
    res = await asyncio.wait_for(tr.run(stop_when_idle_s=3.0), 120)
    assert res["examples_applied"] == len(stream) and res["bad"] == 0, res
    assert tr.model.optimizer.param_groups[0]["lr"] == online.dense_lr
    warm_steps = {int(st["step"]) for st in torch.load(root / man["name"] / "dense.pt", weights_only=False)[
        "optimizer"]["state"].values()}
    online_steps = {int(st["step"]) for st in tr.model.optimizer.state.values()}
    assert min(online_steps) > max(warm_steps) > 0  # the warm start's moments came back and went on
    # the online model continued the batch one: every batch-trained item row is still there
    items = tr.model.tables["item_id"].items()[0]
    assert np.isin(batch_items, items).all()
    assert np.isin(10_000_000 + np.arange(0, len(stream[::3])), items).all()  # recent items: item rows, raw ids
    # the PS's admissions are exported: at least the new recent items became item rows
    assert REGISTRY.get_sample_value("driftline_ps_admitted_total", labels) - admitted >= len(stream[::3])
    assert REGISTRY.get_sample_value("driftline_ps_evicted_total", labels) is not None  # no TTL: 0
    newest = max(e.event_time_ms for e in stream)
    assert REGISTRY.get_sample_value("driftline_trainer_event_time_ms", {"model": cfg.model_id}) == newest
    final = snapshots.read_manifest(root)
    assert final["source"] == "online" and final["seq"] == man["seq"] + 1
    assert sum(final["offsets"].values()) == records
    # offsets are committed in the background (one commit in flight); the run ends with all committed
    c = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap_servers, group_id=tr.group_id, enable_auto_commit=False)
    await c.start()
    try:
        committed = {p: await c.committed(TopicPartition(settings.topics.examples, p))
                     for p in range(settings.topics.partitions)}
    finally:
        await c.stop()
    assert {p: o for p, o in committed.items() if o is not None} == {int(k): v for k, v in final["offsets"].items()}
    assert 0.5 < final["auc"] <= 1.0  # the stream's own progressive AUC, not the batch's
    assert tr.publisher.delays and max(tr.publisher.delays) < 60, max(tr.publisher.delays)  # arrival -> published
    assert min(tr.publisher.event_delays) > 20 * 365 * 86_400  # event time (2000) -> published: the data's age
