"""Online training from the ``examples`` topic (Monolith's streaming trainer).

Loop: poll -> validate (bad -> dead letters) -> dedup by example_id (bounded window) -> score the
batch with the current model and update the streaming AUC (progressive validation) -> train on it
-> commit its offsets. Every ``sync_interval_s`` the touched sparse rows are published to
``param-deltas`` as one version (several chunks); every ``dense_sync_interval_s`` the dense params.
Every ``snapshot_interval_event_s`` of event time (and on a clean stop) a snapshot records tables,
optimizer state, dense params, the next offsets of everything applied, the sync versions, the
``param-deltas`` offset after the last publish, the AUC histograms and the dedup window.

Crash semantics (kill -9): the restart loads the latest snapshot and *seeks to its offsets*
(committed group offsets are ahead of it and are ignored while a snapshot exists). So:
* nothing is lost: every example after the snapshot is re-consumed (needs topic retention >= T);
* nothing is applied twice to the restored state: the examples re-consumed were applied only to
  the state that died. The work redone is bounded by one snapshot interval T of event time
  (plus one batch), i.e. at most the examples with event time in [snapshot, crash].
* serving may have received deltas from the lost work; the redone training republishes those rows
  with higher versions, so replicas converge. A serving replica restarting from this snapshot
  skips to its ``param_deltas_offset``: deltas of the dead run after it are applied and then
  superseded - a transient, bounded by T as well.
* duplicates from the joiner (at-least-once) are dropped within ``dedup_window`` example ids,
  and the window is saved in the snapshot so it survives restarts.
Without a snapshot the group's committed offsets are used (a fresh model starting from there).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict, deque
from pathlib import Path

import numpy as np
import torch
from aiokafka import ConsumerRebalanceListener, TopicPartition

from proto import DeadLetter, Example
from services import tansu_quirks
from services.kafka import TypedConsumer, create_topics, producer, start_client
from services.settings import Settings

from . import metrics as M
from . import snapshots
from .batch import SparseBatch
from .config import ModelConfig
from .model import SparseModel
from .sync import encode_dense, encode_sparse_tables

log = logging.getLogger(__name__)


class DedupWindow:
    """The last ``capacity`` example ids (insertion order)."""

    def __init__(self, capacity: int = 200_000):
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def seen_or_add(self, eid: str) -> bool:
        if not eid:
            return False
        if eid in self._ids:
            return True
        self._ids[eid] = None
        if len(self._ids) > self.capacity:
            self._ids.popitem(last=False)
        return False

    def state(self) -> list[str]:
        return list(self._ids)

    def load(self, ids: list[str]) -> None:
        self._ids = OrderedDict.fromkeys(ids[-self.capacity:])


class _Seek(ConsumerRebalanceListener):
    def __init__(self, trainer: "OnlineTrainer"):
        self.t = trainer

    async def on_partitions_revoked(self, revoked):
        pass

    async def on_partitions_assigned(self, assigned):
        for tp in assigned:
            off = self.t.resume_offsets.get(tp.partition)
            if off is not None and tp.topic == self.t.topic:
                self.t.consumer.consumer.seek(tp, off)
                log.info("resuming %s[%d] at snapshot offset %d", tp.topic, tp.partition, off)


class OnlineTrainer:
    def __init__(self, settings: Settings, cfg: ModelConfig, *, sync_interval_s: float | None = None,
                 dense_sync_interval_s: float | None = None, snapshot_interval_event_s: float | None = None,
                 batch_size: int | None = None, batch_timeout_s: float = 0.2, dedup_window: int = 200_000,
                 snapshot_root: Path | None = None, group_id: str | None = None):
        ts = settings.trainer
        self.settings, self.cfg = settings, cfg
        self.topic = settings.topics.examples
        self.sync_interval_s = ts.sync_interval_s if sync_interval_s is None else sync_interval_s
        self.dense_sync_interval_s = ts.dense_sync_interval_s if dense_sync_interval_s is None else dense_sync_interval_s
        self.snapshot_interval_ms = int(1000 * (ts.snapshot_interval_event_s if snapshot_interval_event_s is None
                                                else snapshot_interval_event_s))
        self.batch_size = batch_size or ts.batch_size
        self.batch_timeout_s = batch_timeout_s
        self.snapshot_root = Path(snapshot_root or settings.var_dir / "snapshots") / cfg.model_id
        self.group_id = group_id or f"trainer-{cfg.model_id}"
        self.model = SparseModel(cfg)
        self.auc = M.StreamingAUC()
        self.dedup = DedupWindow(dedup_window)
        self.known_slots = set(cfg.all_slots)
        self.resume_offsets: dict[int, int] = {}
        self.applied_offsets: dict[int, int] = {}
        self.sparse_version = 0
        self.dense_version = 0
        self.param_deltas_offset = 0
        self.examples_applied = 0
        self.max_event_time = 0
        self.next_snapshot_at: int | None = None
        self.stop_event = asyncio.Event()
        self.bad = 0
        self.duplicates = 0
        self.delays: deque[float] = deque(maxlen=100_000)
        self._unsynced_times: list[np.ndarray] = []
        self.loss_ema = float("nan")
        self.stage = {"decode": 0.0, "train": 0.0, "commit": 0.0, "sync": 0.0, "snapshot": 0.0}
        self.last_sync_tables: dict[str, tuple] | None = None
        self.keep_last_sync_copy = False
        self.first_batch_at: float | None = None
        self.last_batch_at: float | None = None

    # ------------------------------------------------------------------ state
    def restore(self, epoch: str | None) -> bool:
        if not tansu_quirks.state_matches_broker(self.snapshot_root, epoch):
            import shutil
            shutil.rmtree(self.snapshot_root, ignore_errors=True)
            tansu_quirks.state_matches_broker(self.snapshot_root, epoch)
            return False
        got = snapshots.load(self.snapshot_root, self.cfg, serving=False)
        if got is None:
            return False
        tables, dense, man = got
        self.model = SparseModel(self.cfg, tables)
        self.model.head.load_state_dict(dense["head"])
        self.model.optimizer.load_state_dict(dense["optimizer"])
        same_topic = man.get("topic", self.topic) == self.topic
        self.resume_offsets = {int(k): int(v) for k, v in man["offsets"].items()} if same_topic else {}
        self.applied_offsets = dict(self.resume_offsets)
        self.sparse_version = man["sparse_version"]
        self.dense_version = man["dense_version"]
        self.examples_applied = man["examples_applied"]
        self.max_event_time = man["max_event_time_ms"]
        self.next_snapshot_at = man.get("next_snapshot_at")
        self.auc.load(dense["auc_pos"], dense["auc_neg"])
        self.dedup.load(dense.get("dedup", []))
        log.info("restored snapshot %s: %d examples applied, offsets %s", man["name"], self.examples_applied,
                 self.resume_offsets)
        return True

    def snapshot(self) -> Path:
        t0 = time.perf_counter()
        dense = {"head": self.model.head.state_dict(), "optimizer": self.model.optimizer.state_dict(),
                 "auc_pos": self.auc.pos, "auc_neg": self.auc.neg, "dedup": self.dedup.state()}
        man = {"offsets": {str(k): v for k, v in self.applied_offsets.items()}, "topic": self.topic,
               "sparse_version": self.sparse_version, "dense_version": self.dense_version,
               "param_deltas_offset": self.param_deltas_offset, "examples_applied": self.examples_applied,
               "max_event_time_ms": self.max_event_time, "next_snapshot_at": self.next_snapshot_at,
               "auc": self.auc.value()}
        path = snapshots.save(self.snapshot_root, self.cfg, self.model.tables, dense, man)
        M.SNAPSHOTS.labels(self.cfg.model_id).inc()
        self.stage["snapshot"] += time.perf_counter() - t0
        return path

    # ------------------------------------------------------------------ sync
    async def sync_sparse(self) -> int:
        t0 = time.perf_counter()
        msgs = encode_sparse_tables(self.cfg.model_id, self.sparse_version + 1, self.model.tables,
                                    max_event_time_ms=self.max_event_time)
        if self.keep_last_sync_copy:
            self.last_sync_tables = {n: t.items() for n, t in self.model.tables.items()}
        if not msgs:
            return 0
        self.sparse_version += 1
        nbytes = 0
        futs = []
        for table, m in msgs:
            data = m.SerializeToString()
            nbytes += len(data)
            futs.append(await self._producer.send(self.settings.topics.param_deltas, data,
                                                  key=f"{self.cfg.model_id}/{table}".encode(), partition=0))
        metas = await asyncio.gather(*futs)
        self.param_deltas_offset = max(md.offset for md in metas) + 1
        now = time.time()
        if self._unsynced_times:
            ts = np.concatenate(self._unsynced_times)
            self._unsynced_times = []
            d = now - ts / 1000.0
            self.delays.extend(d.tolist() if d.size < 10_000 else d[:: d.size // 10_000 + 1].tolist())
            for q in np.percentile(d, [50, 95, 100]):
                M.SYNC_DELAY.labels(self.cfg.model_id).observe(float(q))
        dt = time.perf_counter() - t0
        M.SYNC_BYTES.labels(self.cfg.model_id, "sparse").observe(nbytes)
        M.SYNC_SECONDS.labels(self.cfg.model_id, "sparse").observe(dt)
        self.stage["sync"] += dt
        for n, t in self.model.tables.items():
            M.TABLE_SIZE.labels(self.cfg.model_id, n).set(len(t))
        return nbytes

    async def sync_dense(self) -> None:
        t0 = time.perf_counter()
        self.dense_version += 1
        m = encode_dense(self.cfg.model_id, self.dense_version, self.model.head,
                         max_event_time_ms=self.max_event_time)
        data = m.SerializeToString()
        md = await self._producer.send_and_wait(self.settings.topics.param_deltas, data,
                                                key=f"{self.cfg.model_id}/dense".encode(), partition=0)
        self.param_deltas_offset = md.offset + 1
        M.SYNC_BYTES.labels(self.cfg.model_id, "dense").observe(len(data))
        M.SYNC_SECONDS.labels(self.cfg.model_id, "dense").observe(time.perf_counter() - t0)

    # ------------------------------------------------------------------ batches
    async def _dead_letter(self, rec, reason: str):
        self.bad += 1
        M.BAD_EXAMPLES.labels(self.cfg.model_id, reason.split(":")[0]).inc()
        letter = DeadLetter(source_topic=rec.topic, partition=rec.partition, offset=rec.offset, key=rec.key or b"",
                            value=rec.value.SerializeToString(), reason=reason, consumer="trainer",
                            rejected_at_ms=int(time.time() * 1000))
        return await self._producer.send(self.settings.topics.dead_letters, letter.SerializeToString(), key=rec.key)

    def _check(self, ex: Example) -> str | None:
        unknown = set(ex.features.sparse.keys()) - self.known_slots
        if unknown:
            return f"unknown_slot: {sorted(unknown)}"
        if self.cfg.label not in ex.labels or not math.isfinite(ex.labels[self.cfg.label]):
            return f"bad_label: {self.cfg.label!r} missing or not finite"
        dense = ex.features.dense
        if len(dense) != len(self.cfg.dense_features) or any(k not in dense for k in self.cfg.dense_features):
            return f"wrong_dim: dense features {sorted(dense)} != {self.cfg.dense_features}"
        if any(not math.isfinite(v) for v in dense.values()):
            return "nan_value: non-finite dense feature"
        return None

    async def process(self, recs) -> None:
        t0 = time.perf_counter()
        good, letters = [], []
        for r in recs:
            why = self._check(r.value)
            if why is not None:
                letters.append(await self._dead_letter(r, why))
            elif self.dedup.seen_or_add(r.value.example_id):
                self.duplicates += 1
                M.DUPLICATES.labels(self.cfg.model_id).inc()
            else:
                good.append(r.value)
        t1 = time.perf_counter()
        if good:
            if self.first_batch_at is None:
                self.first_batch_at = time.perf_counter()
            batch = SparseBatch.from_examples(good, self.cfg.all_slots, self.cfg.label, self.cfg.dense_features)
            t2 = time.perf_counter()
            # progressive validation: the step's forward pass scores the batch before it is learned
            loss, probs = self.model.train_step(batch)
            self.auc.update(probs, batch.labels)
            self.examples_applied += batch.size
            self.last_batch_at = time.perf_counter()
            self.max_event_time = max(self.max_event_time, batch.max_event_time)
            self._unsynced_times.append(batch.event_time_ms)
            self.loss_ema = loss if math.isnan(self.loss_ema) else 0.98 * self.loss_ema + 0.02 * loss
            M.EXAMPLES.labels(self.cfg.model_id, "online").inc(batch.size)
            M.LOSS.labels(self.cfg.model_id, "online").set(self.loss_ema)
            M.AUC.labels(self.cfg.model_id, "online").set(self.auc.value())
            self.stage["decode"] += t2 - t1
            self.stage["train"] += time.perf_counter() - t2
        self.stage["decode"] += t1 - t0
        t3 = time.perf_counter()
        if letters:  # dead letters durable before their offsets are committed
            await asyncio.gather(*letters)
        for r in recs:
            if r.offset + 1 > self.applied_offsets.get(r.partition, -1):
                self.applied_offsets[r.partition] = r.offset + 1
        await self.consumer.commit({TopicPartition(self.topic, p): o for p, o in self.applied_offsets.items()})
        self.stage["commit"] += time.perf_counter() - t3

    # ------------------------------------------------------------------ main loop
    async def run(self, stop_when_idle_s: float | None = None, max_examples: int | None = None) -> dict:
        torch.set_num_threads(2)
        s = self.settings
        await create_topics(s, {self.topic: s.topics.partitions, s.topics.param_deltas: 1, s.topics.dead_letters: 1})
        try:
            epoch = await tansu_quirks.ensure_broker_epoch(s)
        except Exception:  # noqa: BLE001 - an external Kafka without the marker topic
            epoch = None
        restored = self.restore(epoch)
        self._producer = producer(s)
        await start_client(self._producer, s)
        # a kill -9'd predecessor stays a group member until its session times out, and the join
        # waits for it: allow the consumer start longer than the default connect timeout.
        cs = s.model_copy(deep=True)
        cs.kafka.connect_timeout_s = max(s.kafka.connect_timeout_s, 3 * s.kafka.session_timeout_ms / 1000)
        self.consumer = TypedConsumer(cs, "trainer", Example, [self.topic], self.group_id,
                                      dead_letter_producer=self._producer)
        self.consumer.consumer.subscribe([self.topic], listener=_Seek(self))
        await self.consumer.start()
        started = time.time()
        last_sync = last_dense = time.monotonic()
        last_data = time.monotonic()
        if not restored or self.dense_version == 0:
            await self.sync_dense()
        buf: list = []
        first_at = 0.0
        try:
            while not self.stop_event.is_set():
                recs = await self.consumer.poll(timeout_ms=100, max_records=self.batch_size - len(buf))
                now = time.monotonic()
                if recs:
                    if not buf:
                        first_at = now
                    buf.extend(recs)
                    last_data = now
                if buf and (len(buf) >= self.batch_size or now - first_at >= self.batch_timeout_s):
                    await self.process(buf)
                    buf = []
                    if self.snapshot_interval_ms > 0:
                        if self.next_snapshot_at is None:
                            self.next_snapshot_at = (self.max_event_time // self.snapshot_interval_ms + 1) * self.snapshot_interval_ms
                        elif self.max_event_time >= self.next_snapshot_at:
                            await self.sync_sparse()
                            self.snapshot()
                            self.next_snapshot_at = (self.max_event_time // self.snapshot_interval_ms + 1) * self.snapshot_interval_ms
                    if max_examples is not None and self.examples_applied >= max_examples:
                        break
                now = time.monotonic()
                if now - last_sync >= self.sync_interval_s:
                    last_sync = now
                    await self.sync_sparse()
                if now - last_dense >= self.dense_sync_interval_s:
                    last_dense = now
                    await self.sync_dense()
                if stop_when_idle_s is not None and not buf and now - last_data >= stop_when_idle_s:
                    break
            if buf:
                await self.process(buf)
            await self.sync_sparse()
            await self.sync_dense()
            self.snapshot()
        finally:
            await self.consumer.stop()
            await self._producer.stop()
        elapsed = time.time() - started
        return {"examples_applied": self.examples_applied, "auc": self.auc.value(), "loss": self.loss_ema,
                "bad": self.bad + self.consumer.dead_lettered, "duplicates": self.duplicates, "sparse_version": self.sparse_version,
                "elapsed_s": elapsed, "stages": dict(self.stage, **{f"model_{k}": v for k, v in self.model.timings.items()})}
