"""The online trainer as one rank of N (``trainer online --nproc N``, or under ``torchrun``).

Each rank is a process started by torch's elastic launcher (:mod:`trainer.launch`) and joined to
the others by a gloo process group. The model is :class:`trainer.distributed.DistributedModel`:
rank ``r`` owns shard ``r`` of every table (:func:`trainer.sharding.shard_of`), the dense head is
replicated. The parts of the 1-process trainer are reused: :class:`trainer.ingest.Ingest`
(records -> checked, deduplicated batches), :class:`trainer.publisher.Publisher` (its shard's
rows, named ``shard=r, shard_count=N``; dense by rank 0 only), :class:`trainer.commits.Committer`
(the group's offsets) and the snapshot file format (:mod:`trainer.snapshots`, N-rank layout).

**Input.** Rank ``r`` of ``N`` reads the partitions ``p`` of ``examples`` with ``p % N == r`` by
manual assignment (no group rebalance: the assignment is a function of the rank). A partition
starts at the offset in the rank's snapshot, else at the group's committed offset, else at its
earliest record; offsets are committed per partition as the 1-process trainer does. With more
ranks than partitions some ranks read nothing and only serve their shard.

**One round**, on every rank, in lockstep:

1. poll until ``batch_size`` examples or ``batch_timeout_s`` passed (an idle rank gives up after
   the timeout: it delays the others by at most that);
2. *agree* (one ``all_gather`` of a few int64 per rank): whether any rank was asked to stop
   (SIGTERM reaches one rank or all), whether every rank has been idle ``stop_when_idle_s``, the
   global max event time (snapshots are due by it: every rank decides the same), the examples
   queued, and rank 0's clock decisions (sparse / dense sync due). Every rank then takes the same
   decisions without another message;
3. step (:meth:`DistributedModel.train_step`, collective; an empty batch on an idle rank), then
   bookkeeping and the offsets' commit as in the 1-process trainer;
4. when due: each rank publishes its shard's touched rows; rank 0 the dense weights with the
   sample rates of *all* ranks (their trackers' sums, gathered); every rank snapshots its shard
   (:meth:`RankTrainer.snapshot`).

A step that is not finite is refused by every rank together (the engine's flag) and skipped: the
1-process trainer's isolation of the failing example (:mod:`trainer.isolate`) needs a collective
retry protocol not built yet; its offsets still move on (at-most-once for that batch, logged).

**Snapshots** (all ranks at the same round): each rank writes its shard (rows + PS optimizer
state) and its own stream state (its partitions' next offsets, dedup window, AUC histograms,
sample-rate sums, examples applied); rank 0, after an ``all_gather`` of the ranks' summaries (the
barrier), writes the dense weights and optimizer and the manifest last
(:func:`trainer.snapshots.commit_ranks`; what is recorded and how a rank resumes:
:mod:`trainer.rank_resume`). A kill -9 of any rank makes the elastic launcher stop
and restart the whole group (``trainer.max_restarts``), and every rank resumes from the last
complete manifest; a snapshot of N ranks restores into M ranks (rows resharded on load, offsets
split by the partition rule, the global stream state given to rank 0).

**Not here yet** (issue #14): broker resets (the 1-process trainer's :mod:`trainer.resets`) are
not watched: after a tansu reset the group must be restarted; ``hybrid`` mode runs the engine's
``train_step``, so the online loop does not overlap lookups yet; polling and training alternate
within a round instead of overlapping. (The dedup window is per rank: enough, examples are keyed
by user, so a joiner duplicate lands on the same partition, i.e. the same rank.)
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from aiokafka import TopicPartition

from proto import Example
from services.kafka import TypedConsumer, create_topics, producer, start_client
from services.settings import Settings

from . import dedup
from . import metrics as M
from . import rank_resume, snapshots
from .batch import SparseBatch
from .commits import Committer
from .config import ModelConfig
from .distributed import DistributedModel
from .ingest import Decoded, Ingest
from .model import NonFiniteStepError
from .publisher import DenseSchedule, Publisher
from .sample_rates import SampleRateTracker

log = logging.getLogger(__name__)

# the agreed-upon control vector of one round (int64 per rank)
_STOP, _IDLE, _EXAMPLES, _EVENT, _SYNC, _DENSE = range(6)


class RankError(RuntimeError):
    """A rank cannot run: no process group, or a snapshot that does not fit."""


def my_partitions(partitions: int, rank: int, world: int) -> list[int]:
    """The partitions of ``examples`` rank ``rank`` of ``world`` reads: ``p % world == rank``.

    >>> my_partitions(4, 1, 2), my_partitions(4, 0, 3), my_partitions(2, 2, 3)
    ([1, 3], [0, 3], [])
    """
    return [p for p in range(partitions) if p % world == rank]


class RankTrainer:
    """Rank ``dist.get_rank()`` of the online trainer; every knob is a field of ``settings.trainer``."""

    def __init__(self, settings: Settings, cfg: ModelConfig):
        if not dist.is_initialized():
            raise RankError("torch.distributed is not initialized (start ranks with trainer.launch or torchrun)")
        ts = settings.trainer
        self.settings, self.cfg, self.ts = settings, cfg, ts
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.topic = settings.topics.examples
        self.root = settings.snapshot_root / cfg.model_id
        self.snapshot_interval_ms = int(1000 * ts.snapshot_interval_event_s)
        self.stage = {k: 0.0 for k in ("poll", "prepare", "train", "commit", "sync", "snapshot", "agree",
                                         "comm")}
        self.dedup = dedup.DedupWindow(ts.dedup_window)
        self.auc = M.StreamingAUC()
        self.sample_rates = SampleRateTracker(ts.sample_rate_half_life)
        self.ingest = Ingest(cfg, self.topic, self.dedup, max_future_ms=int(1000 * settings.event_time.max_future_s),
                             stage=self._stage)
        self.publisher = Publisher(settings, cfg.model_id, self._stage)
        self.publisher.shard, self.publisher.shard_count = self.rank, self.world
        self.applied_offsets: dict[int, int] = {}
        self.partitions: list[int] = []
        self.examples_applied = 0
        self.max_event_time = 0
        self.next_snapshot_at: int | None = None
        self.loss_ema = float("nan")
        self.skipped_steps = 0
        self.stop_event = asyncio.Event()
        # every collective runs on this one thread, in the same order on every rank
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"rank{self.rank}-step")
        self.dm: DistributedModel | None = None
        self._rate_mark = (time.monotonic(), 0)
        self._parent = os.getppid()
        self._per_record = float(ts.batch_size)  # examples per record lately
        self.restored = False

    def _stage(self, name: str, seconds: float) -> None:
        self.stage[name] = self.stage.get(name, 0.0) + seconds
        M.STAGE_SECONDS.labels(self.cfg.model_id, name).inc(seconds)

    async def _coll(self, fn, *args):
        """Run a collective (or a step) on the collectives' thread, keeping the event loop (the
        consumer's fetches, the producer) running meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # ------------------------------------------------------------------ state
    def _restore(self) -> None:
        """Build the model from the latest complete snapshot (any number of ranks wrote it,
        :mod:`trainer.rank_resume`) or fresh. Collective (the engine broadcasts rank 0's head)."""
        torch.set_num_threads(1)
        got = rank_resume.load(self.root, self.cfg, self.topic, self.rank, self.world)
        ts = self.ts
        self.dm = DistributedModel(self.cfg, mode=ts.dist_mode, staleness=ts.staleness,
                                   tables=got.tables if got is not None else None)
        if got is None:
            return
        man = got.manifest
        self.dm.head.load_state_dict(got.dense["head"])
        if "optimizer" in got.dense:
            self.dm.optimizer.load_state_dict(got.dense["optimizer"])
        self.restored = True
        self.publisher.dense_version = int(man.get("dense_version", 0))
        self.publisher.param_deltas_offset = int(man.get("param_deltas_offset", 0) or 0)
        self.publisher.sparse_version = got.sparse_version
        self.max_event_time = int(man.get("max_event_time_ms", 0))
        self.next_snapshot_at = man.get("next_snapshot_at")
        self.dedup.load(got.dedup)
        if got.auc is not None:
            self.auc.load(*got.auc)
        self.sample_rates.load(got.sample_rates)
        self.examples_applied = got.examples_applied
        self.applied_offsets = {int(k): int(v) for k, v in got.offsets.items()}
        log.info("rank %d/%d restored snapshot %s (%d ranks wrote it): %d examples applied here",
                 self.rank, self.world, man["name"], int(man.get("shard_count", 0) or 1), self.examples_applied)

    async def snapshot(self) -> Path | None:
        """Collective: every rank writes its part, rank 0 commits the set (the manifest last)."""
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        seq = [snapshots.next_seq(self.root) if self.rank == 0 else 0]
        await self._coll(dist.broadcast_object_list, seq, 0)
        seq = int(seq[0])
        tables = self.dm.tables
        part = rank_resume.rank_part(self.applied_offsets, self.dedup.state(), self.auc, self.sample_rates,
                                     self.examples_applied)
        await loop.run_in_executor(None, snapshots.save_rank, self.root, seq, self.rank, tables, part)
        mine = rank_resume.summary(part, self.publisher.sparse_version, self.publisher.param_deltas_offset, tables)
        parts: list = [None] * self.world
        await self._coll(dist.all_gather_object, parts, mine)  # also the barrier: every part is written
        path = None
        if self.rank == 0:
            man, rows = rank_resume.manifest_of(
                parts, topic=self.topic, dense_version=self.publisher.dense_version,
                max_event_time_ms=self.max_event_time, next_snapshot_at=self.next_snapshot_at,
                half_life=self.ts.sample_rate_half_life)
            dense = {"head": self.dm.head.state_dict(), "optimizer": self.dm.optimizer.state_dict()}
            path = await loop.run_in_executor(
                None, lambda: snapshots.commit_ranks(self.root, self.cfg, seq, self.world, dense, man, rows))
            M.SNAPSHOTS.labels(self.cfg.model_id).inc()
        self._stage("snapshot", time.perf_counter() - t0)
        return path

    # ------------------------------------------------------------------ sync
    async def sync_sparse(self) -> None:
        await self.publisher.sync_sparse(self.dm.tables, self.max_event_time)

    async def sync_dense(self) -> None:
        """Collective (the ranks' sample-rate sums are gathered); rank 0 publishes."""
        states: list = [None] * self.world
        await self._coll(dist.all_gather_object, states, self.sample_rates.state())
        if self.rank == 0:
            rates = rank_resume.merged_rates(states, self.ts.sample_rate_half_life).rates()
            await self.publisher.sync_dense(self.dm.head, self.max_event_time, rates)

    # ------------------------------------------------------------------ input
    async def _assign(self) -> None:
        """Assign this rank's partitions and put each at its start (see the module docstring)."""
        c = self.consumer.consumer
        await c.topics()  # metadata
        n = len(c.partitions_for_topic(self.topic) or ())
        if n == 0:
            raise RankError(f"topic {self.topic} has no partitions")
        self.partitions = my_partitions(n, self.rank, self.world)
        tps = [TopicPartition(self.topic, p) for p in self.partitions]
        c.assign(tps)
        for tp in tps:
            off = self.applied_offsets.get(tp.partition)
            if off is None:
                off = await c.committed(tp)
                if off is None:
                    off = (await c.beginning_offsets([tp]))[tp]
            c.seek(tp, off)
            self.applied_offsets[tp.partition] = off
        # a snapshot of another assignment may name partitions this rank does not read
        self.applied_offsets = {p: o for p, o in self.applied_offsets.items() if p in self.partitions}
        log.info("rank %d/%d reads %s[%s] from %s", self.rank, self.world, self.topic, self.partitions,
                 self.applied_offsets)

    async def _poll_round(self):
        """Records until ``batch_size`` examples or ``batch_timeout_s``: ``(records, decoded, polled_at_ms)``."""
        t0 = time.perf_counter()
        end = time.monotonic() + self.ts.batch_timeout_s
        recs, decoded, polled_at = [], Decoded(), int(time.time() * 1000)
        while decoded.examples < self.ts.batch_size and not self.stop_event.is_set():
            left = end - time.monotonic()
            if left <= 0 or not self.partitions:
                if not self.partitions:
                    await asyncio.sleep(max(0.0, left))
                break
            # about as many records as complete the batch (by the examples per record lately), as
            # the 1-process trainer polls: a batch does not swallow everything fetched
            want = max(1, int((self.ts.batch_size - decoded.examples) / self._per_record))
            got = await self.consumer.poll(timeout_ms=max(1, int(min(0.1, left) * 1000)), max_records=want)
            if got:
                recs.extend(got)
                before = decoded.examples
                await self.ingest.decode_records(got, decoded)
                self._per_record = max(1.0, 0.8 * self._per_record + 0.2 * (decoded.examples - before) / len(got))
        self._stage("poll", time.perf_counter() - t0)
        return recs, decoded, polled_at

    def _empty(self) -> SparseBatch:
        cfg = self.cfg
        dense = np.zeros((0, len(cfg.dense_features)), np.float32) if cfg.dense_features else None
        return SparseBatch.from_slot_dicts([], dense, slots=cfg.all_slots, labels=np.zeros(0, np.float32),
                                           event_time_ms=np.zeros(0, np.int64))

    def _step(self, batch: SparseBatch):
        t0 = time.perf_counter()
        try:
            loss, probs = self.dm.train_step(batch)
        except NonFiniteStepError as err:  # raised on every rank together: nothing applied anywhere
            log.error("rank %d: step skipped: %s", self.rank, err)
            return None, time.perf_counter() - t0
        return (loss, probs), time.perf_counter() - t0

    async def _agree(self, stop: bool, idle: bool, examples: int, event: int, now: float) -> np.ndarray:
        """The round's control vectors of every rank ``[world, 6]`` (one all_gather)."""
        t0 = time.perf_counter()
        mine = torch.zeros(6, dtype=torch.int64)
        mine[_STOP], mine[_IDLE], mine[_EXAMPLES], mine[_EVENT] = int(stop), int(idle), examples, event
        if self.rank == 0:  # rank 0's clock decides the time-based syncs for everyone
            mine[_SYNC] = int(now - self._last_sync >= self.ts.sync_interval_s)
            mine[_DENSE] = int(self.dense_schedule.due(now))
        out = [torch.zeros(6, dtype=torch.int64) for _ in range(self.world)]
        await self._coll(dist.all_gather, out, mine)
        self._stage("agree", time.perf_counter() - t0)
        return torch.stack(out).numpy()

    # ------------------------------------------------------------------ main loop
    async def run(self, stop_when_idle_s: float | None = None, max_examples: int | None = None) -> dict:
        s = self.settings
        if self.rank == 0:
            await create_topics(s, {self.topic: s.topics.partitions, s.topics.param_deltas: 1,
                                    s.topics.dead_letters: 1})
        await self._coll(self._restore)  # collective; after it rank 0's topics exist too
        self._producer = self.publisher.producer = producer(s)
        await start_client(self._producer, s)
        self.consumer = self.ingest.consumer = TypedConsumer(
            s, "trainer", Example, [], self.ts.group_id, dead_letter_producer=self._producer)
        await self.consumer.start()
        self.commits = Committer(self.consumer, self.topic, lambda: self.applied_offsets, _never,
                                 s.kafka.connect_timeout_s, self._stage)
        try:
            await self._assign()
            return await self._loop(stop_when_idle_s, max_examples)
        finally:
            self.commits.cancel()
            await self.consumer.stop()
            await self._producer.stop()
            self.dm.close()
            self._executor.shutdown(wait=True)

    async def _loop(self, stop_when_idle_s: float | None, max_examples: int | None) -> dict:
        started = time.time()
        self._last_sync = time.monotonic()
        self.dense_schedule = DenseSchedule(self.ts.sync_interval_s, self.ts.dense_sync_interval_s, self._last_sync)
        if not self.restored or self.publisher.dense_version == 0:
            await self.sync_dense()
        last_data, queued = time.monotonic(), 0
        while True:
            recs, decoded, polled_at = await self._poll_round()
            now = time.monotonic()
            p = await self.ingest.prepare(recs, polled_at, decoded) if recs else None
            if recs:
                last_data = now
            batch = p.batch if p is not None and p.batch is not None else None
            idle = stop_when_idle_s is not None and not recs and now - last_data >= stop_when_idle_s
            if os.getppid() != self._parent:  # the launcher is gone (kill -9): nobody would restart us
                log.warning("rank %d: the launcher (pid %d) is gone: stopping", self.rank, self._parent)
                self.stop_event.set()
            ctl = await self._agree(self.stop_event.is_set(), idle, batch.size if batch is not None else 0,
                                    batch.max_event_time if batch is not None else 0, now)
            steps = self.dm.steps
            res, dt = await self._coll(self._step, batch if batch is not None else self._empty())
            self._stage("train", dt)
            if self.dm.steps > steps:  # the step's seconds in collectives (an empty global step has none)
                self._stage("comm", self.dm.comm_s[-1])
            self._update_rate(time.monotonic())
            if p is not None:
                self._applied(p, batch, res)
            queued += int(ctl[:, _EXAMPLES].sum())
            self.max_event_time = max(self.max_event_time, int(ctl[:, _EVENT].max()))
            if ctl[0, _SYNC]:
                self._last_sync = now
                await self.sync_sparse()
            if ctl[0, _DENSE]:
                self.dense_schedule.published(now, queued)
                await self.sync_dense()
            await self._snapshot_when_due()
            if ctl[:, _STOP].any() or ctl[:, _IDLE].all() or (max_examples is not None and queued >= max_examples):
                break
        await self.sync_sparse()
        await self.sync_dense()
        await self.snapshot()
        await self.commits.flush()
        return {"rank": self.rank, "world": self.world, "examples_applied": self.examples_applied,
                "auc": self.auc.value(), "loss": self.loss_ema, "bad": self.consumer.dead_lettered,
                "duplicates": self.ingest.duplicates, "skipped_steps": self.skipped_steps,
                "sparse_version": self.publisher.sparse_version, "elapsed_s": time.time() - started,
                "alltoall_bytes": self.dm.alltoall_bytes, "comm_s": float(sum(self.dm.comm_s)),
                "stages": dict(self.stage)}

    def _update_rate(self, now: float) -> None:
        """This rank's examples/s (its own /metrics port: see trainer.__main__)."""
        t, n = self._rate_mark
        if now - t >= 1.0:
            M.EXAMPLES_PER_S.labels(self.cfg.model_id, "online").set((self.examples_applied - n) / (now - t))
            self._rate_mark = (now, self.examples_applied)

    def _applied(self, p, batch: SparseBatch | None, res) -> None:
        """Bookkeeping of a round's batch (as :meth:`trainer.online.OnlineTrainer._apply`)."""
        if batch is not None and res is None:
            self.skipped_steps += 1
            M.BAD_EXAMPLES.labels(self.cfg.model_id, "failed").inc(batch.size)
        elif batch is not None:
            loss, probs = res
            self.auc.update(probs, batch.labels)
            self.sample_rates.update(batch.slice_ids, batch.slice_names, batch.sample_rate, batch.labels)
            self.examples_applied += batch.size
            self.publisher.applied(batch.event_time_ms, p.arrival_ms)
            self.loss_ema = loss if math.isnan(self.loss_ema) else 0.98 * self.loss_ema + 0.02 * loss
            M.EXAMPLES.labels(self.cfg.model_id, "online").inc(batch.size)
            M.LOSS.labels(self.cfg.model_id, "online").set(self.loss_ema)
            M.AUC.labels(self.cfg.model_id, "online").set(self.auc.value())
        self.dedup.add_many(p.hashes)
        for part, off in p.offsets.items():
            if off > self.applied_offsets.get(part, -1):
                self.applied_offsets[part] = off
        self.commits.request()

    async def _snapshot_when_due(self) -> None:
        """Every rank sees the same global max event time: all decide alike."""
        if self.snapshot_interval_ms <= 0:
            return
        k = self.snapshot_interval_ms
        if self.next_snapshot_at is None:
            self.next_snapshot_at = (self.max_event_time // k + 1) * k
        elif self.max_event_time >= self.next_snapshot_at:
            await self.sync_sparse()
            self.next_snapshot_at = (self.max_event_time // k + 1) * k
            await self.snapshot()


async def _never() -> bool:
    """Broker resets are not watched by ranks yet (see the module docstring)."""
    return False
