"""Online training from the ``examples`` topic (Monolith's streaming trainer): the run loop.

Fetching: this process' consumer fetches, on the event loop. (A loader subprocess fetched while
each record carried one example: it hid aiokafka's per-record Python. With ~1000 examples per
record that cost is ~1000x smaller. Measured with ``QUICK=1 bench/bench_trainer.py`` on 2 shared
cores (30 steps, so +-15%), ``online_vs_batch_ratio``: inline 0.80, 0.86, 0.74 and 0.69 with
batches of 2 records (this loop), 0.47 and 0.50 with batches of 1 record; the loader 0.70 with
shipments of 2 records, 0.61, 0.65 and 0.65 with 1 record. Inline at its best beat the loader at
its best, so the loader, its process and its assignment generations were removed.)

Loop: poll records until they hold ``batch_size`` examples (or ``batch_timeout_s`` passed),
decoding each as it arrives -> check, dead-letter, dedup and assemble the batch
(:mod:`trainer.ingest`, which also says what a record is and what is dead-lettered) -> score it
with the current model and update the streaming AUC (progressive validation) -> train on it ->
commit its offsets (:mod:`trainer.commits`). Training runs on one dedicated thread (1 torch
intra-op thread; torch ops and the PS kernels release the GIL) while the event loop fetches,
decodes and assembles the next batch. At most two batches are in flight (one training, the next
queued on the training thread), and a batch's offsets are committed after it is applied, in order.
Every ``sync_interval_s`` the touched sparse rows are published to ``param-deltas`` as one version,
the dense params at first as often, then less and less up to every ``dense_sync_interval_s``
(:class:`trainer.publisher.DenseSchedule` says why). Every
``snapshot_interval_event_s`` of event time (and on a clean stop) a snapshot is written; a restart
resumes from the newest (:mod:`trainer.snapshot_store`: what it records, and the crash semantics).

Broker resets (tansu's memory storage lost with a broker restart; told by
:class:`services.broker_reset.EpochWatch`, a check costing ~1 ms, made before every offset commit
and every ``epoch_check_interval_s`` when idle): the snapshots are kept, they live outside the broker.
* at start, the newest snapshot is restored even if written in another broker epoch, but its
  offsets are not used: every partition of the new ``examples`` is read from its start (the dedup
  window drops the examples the snapshot had learned); a snapshot of the new epoch (manifest
  ``broker_epoch``) is written before the first batch, after the dense weights went out on the new
  ``param-deltas``, so serving can reload from it and resume the deltas at its
  ``param_deltas_offset``;
* a running trainer does the same when it notices the reset: it applies the batches in flight, drops
  what was fetched but not handed to training (the old topic's records are gone; records fetched at
  the old positions from the new topic are read again), seeks every assigned partition to the
  new topic's start, creates the topics with their configured partitions, publishes the dense
  weights and writes the new epoch's snapshot. Versions keep increasing across it;
* offsets of the old epoch are never committed into the new broker's group, and until every
  partition has an offset of the new epoch a partition without one starts at its earliest record,
  not at a committed offset (a snapshot records this as ``from_start``);
* what a reset loses is what lived only in the broker: the old topic's records this trainer had not
  applied (counted in ``driftline_broker_reset_lost_total`` from the last known high watermark).

Clean stop (SIGTERM or SIGINT, also when sent to the whole process group as the supervisor does):
the loop ends, the batches in flight are applied, sparse and dense weights published, the final
snapshot written, the offsets committed; exit 0, well within the supervisor's 10 s grace period.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from aiokafka import ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError

from proto import Example
from services import metrics as service_metrics
from services.disk import DiskGuard
from services import example_batch
from services.codecs import processing_failed
from services.kafka import TypedConsumer, create_topics, producer, start_client
from services.settings import Settings

from . import metrics as M
from . import dedup
from .batch import SparseBatch
from .commits import Committer
from .config import ModelConfig
from .count_baseline import CountBaseline
from .ingest import NO_HASHES, Decoded, Ingest, Prepared
from .isolate import train_isolating
from .manifest import Manifest
from .model import SparseModel
from .publisher import DenseSchedule, Publisher
from .resets import ResetWatch
from .snapshot_store import SnapshotStore
from .snapshots import EventClock
from .sample_rates import SampleRateTracker

log = logging.getLogger(__name__)


class _Seek(ConsumerRebalanceListener):
    def __init__(self, trainer: "OnlineTrainer"):
        self.t = trainer

    async def on_partitions_revoked(self, revoked):
        pass

    async def on_partitions_assigned(self, assigned):
        """A partition continues after the last record applied (a snapshot's offset right after a
        restore), not at the group's committed offset; one with none starts at the committed offset,
        or at its earliest record after a broker reset (see ``OnlineTrainer._from_start``)."""
        for tp in assigned:
            if tp.topic != self.t.topic:
                continue
            off = self.t.applied_offsets.get(tp.partition)
            if off is not None:
                self.t.consumer.consumer.seek(tp, off)
                log.info("resuming %s[%d] at offset %d", tp.topic, tp.partition, off)
                continue
            if self.t._from_start:
                await self.t.consumer.consumer.seek_to_beginning(tp)
            self.t.unknown_start.add(tp.partition)
        self.t.ready.set()


@dataclass
class _NextBatch:
    """Records polled for the next batch, decoded as they arrive."""

    records: list = field(default_factory=list)
    decoded: Decoded = field(default_factory=Decoded)
    first_at: float = 0.0  # monotonic time of the first poll that filled it
    polled_at_ms: int = 0  # wall time of the same


class OnlineTrainer(M.LearnedFields):
    """Every knob is a field of ``settings.trainer`` (:class:`services.settings.TrainerSettings`):
    run one with other values through ``settings.updated(trainer={...})``. Its parts:
    :attr:`ingest` (records -> batches), :attr:`publisher` (``param-deltas``), :attr:`snapshots`
    (restarts), :attr:`commits` (the group's offsets, once running), :attr:`resets` (broker resets)."""

    def __init__(self, settings: Settings, cfg: ModelConfig, *, torch_threads: int = 1):
        ts = settings.trainer
        self.settings, self.cfg = settings, cfg
        self.topic = settings.topics.examples
        self.sync_interval_s = ts.sync_interval_s
        self.dense_sync_interval_s = ts.dense_sync_interval_s
        self.snapshot_interval_ms = int(1000 * ts.snapshot_interval_event_s)
        self.batch_size = ts.batch_size
        self.batch_timeout_s = ts.batch_timeout_s
        self.snapshot_root = settings.model_snapshots(cfg.model_id)
        self.disk = DiskGuard.from_settings("trainer", self.snapshot_root, settings)
        self.group_id = ts.group_id
        # torch intra-op threads of the training thread. 1 by default: the other core decodes and
        # assembles the next batch; 2 torch threads plus the decoding thread oversubscribe two
        # cores, and OpenMP's barriers then wait on descheduled threads (10x slower steps measured).
        self.torch_threads = torch_threads
        self.model = SparseModel(cfg)
        self.ps_counts = M.PSCounts(cfg.model_id, self.model.tables)
        self.auc = M.StreamingAUC()
        self.dedup = dedup.DedupWindow(ts.dedup_window)
        self.sample_rates = SampleRateTracker(ts.sample_rate_half_life)  # what serving corrects with
        self.stage = {k: 0.0 for k in ("poll", "prepare", "train", "step_gap", "wait_train", "commit",
                                                "sync", "snapshot")}
        self._step_end: float | None = None  # perf_counter when the training thread last finished a step
        self.ingest = Ingest(cfg, self.topic, self.dedup, max_future_ms=int(1000 * settings.event_time.max_future_s),
                             stage=self._stage)
        self.publisher = Publisher(settings, cfg.model_id, self._stage)
        self.learned = M.Learned(cfg.model_id, self.auc, self.sample_rates, self.dedup, self.publisher.applied,
                                 self.ps_counts, baseline=CountBaseline(settings.eval.count_prior))
        self.snapshots = SnapshotStore(self.snapshot_root, cfg, self.topic)
        self.commits: Committer | None = None
        self.resume_offsets: dict[int, int] = {}
        #: the broker epoch the offsets belong to (None: an external Kafka without one)
        self.epoch: str | None = None
        self.resets = ResetWatch(ts.epoch_check_interval_s, lambda: (self.ingest.highwater, self.applied_offsets))
        self._reset_at_start = False  # the restored snapshot was written in another broker epoch
        #: a partition without an applied offset starts at its earliest record, not at the group's
        #: committed offset (after a reset: a stale commit may have reached the new broker)
        self._from_start = False
        # assigned partitions whose start position is not known yet (see _note_starts)
        self.unknown_start: set[int] = set()
        self.max_event_time = 0
        self.clock = EventClock(self.snapshot_interval_ms)
        self.stop_event = asyncio.Event()
        self.ready = asyncio.Event()  # set once the group join assigned partitions
        self.first_batch_at: float | None = None
        self.last_batch_at: float | None = None
        self._last_sync = 0.0  # monotonic time of the last sparse sync
        self.dense_schedule = DenseSchedule(self.sync_interval_s, self.dense_sync_interval_s)
        # batches handed to the training thread, oldest first: (task following it, its id hashes)
        self._pending: deque[tuple[asyncio.Task, np.ndarray]] = deque()
        #: 2: the next batch waits on the training thread's queue while the current one trains, so
        #: the thread goes from one step to the next without waiting for the event loop
        self.max_in_flight = 2
        # examples per record lately (how many records to poll for a batch): from one record at a time
        self._per_record = float(self.batch_size)
        self._executor: ThreadPoolExecutor | None = None

    def _stage(self, name: str, seconds: float) -> None:
        self.stage[name] += seconds
        M.STAGE_SECONDS.labels(self.cfg.model_id, name).inc(seconds)

    # ------------------------------------------------------------------ state
    def restore(self, epoch: str | None) -> bool:
        """Load the newest snapshot (:meth:`trainer.snapshot_store.SnapshotStore.load`: after a broker reset,
        ``epoch`` differing from the snapshot's, its offsets are not used); False if there is none."""
        self.epoch = epoch
        got = self.snapshots.load(epoch)
        if got is None:
            self.snapshots.record_epoch(self.epoch)
            return False
        dense, man = got.dense, got.manifest
        self._reset_at_start = got.reset
        self.model = SparseModel(self.cfg, got.tables)
        self.ps_counts = self.learned.ps_counts = M.PSCounts(self.cfg.model_id, self.model.tables)
        self.model.head.load_state_dict(dense["head"])
        if "optimizer" in dense:
            self.model.optimizer.load_state_dict(dense["optimizer"])
        self.resume_offsets, self._from_start = got.offsets, got.from_start
        self.applied_offsets = dict(self.resume_offsets)
        self.snapshots.record_epoch(self.epoch)
        self.publisher.restore(man, reset=got.reset)
        self.examples_applied = man.examples_applied
        self.max_event_time = man.max_event_time_ms
        self.clock.next_at = man.next_snapshot_at
        if self.max_event_time:
            M.EVENT_TIME.labels(self.cfg.model_id).set(self.max_event_time)
        if "auc_pos" in dense and "auc_neg" in dense:
            self.auc.load(dense["auc_pos"], dense["auc_neg"])
        self.dedup.load(dense.get("dedup", []))
        self.learned.load_scores(dense.get("scores"))
        self.sample_rates.load(man.sample_rates)
        log.info("restored snapshot %s (%s): %d examples applied, offsets %s", man.name,
                 man.source, self.examples_applied, self.resume_offsets)
        return True

    def snapshot(self) -> Path:
        """Write a snapshot (call with no batch in flight: see :meth:`_drain`)."""
        t0 = time.perf_counter()
        dense = {"auc_pos": self.auc.pos, "auc_neg": self.auc.neg, "dedup": self.dedup.state(),
                 "scores": self.learned.scores_state()}
        man = Manifest(offsets=dict(self.applied_offsets), topic=self.topic, broker_epoch=self.epoch,
                       from_start=self._from_start, **self.publisher.versions(),
                       examples_applied=self.examples_applied, max_event_time_ms=self.max_event_time,
                       next_snapshot_at=self.clock.next_at, auc=self.auc.value(), sample_rates=self.sample_rates.state())
        path = self.snapshots.save(self.model, dense, man)
        self._stage("snapshot", time.perf_counter() - t0)
        return path

    # ------------------------------------------------------------------ sync
    async def sync_sparse(self) -> int:
        """Publish the touched rows as one version (call with no batch in flight)."""
        return await self.publisher.sync_sparse(self.model.tables, self.max_event_time)

    async def sync_dense(self) -> None:
        """Publish the dense params as one version."""
        await self.publisher.sync_dense(self.model.head, self.max_event_time, self.sample_rates.rates())

    # ------------------------------------------------------------------ training
    def _warm_up(self) -> None:
        """On the training thread, while the consumer joins its group (~5 s on tansu): load/compile
        the PS's numba kernels and touch torch's kernels on a throwaway model (fresh tables, own
        head), so the first real batch does not pay ~0.5 s of JIT/cache loading."""
        torch.set_num_threads(self.torch_threads)
        cfg = self.cfg
        m = SparseModel(cfg)
        # a tiny batch, then a full one: torch's allocator and BLAS see the real shapes here, not in
        # the first streamed steps (which took ~3x a steady step)
        for n in (2, self.batch_size):
            rows = [{s: [i, i + 1] if i % 2 else [i] for s in cfg.all_slots} for i in range(n)]
            dense = np.zeros((n, len(cfg.dense_features)), np.float32) if cfg.dense_features else None
            b = SparseBatch.from_slot_dicts(rows, dense, slots=cfg.all_slots, labels=[float(i % 2) for i in range(n)],
                                            event_time_ms=[1] * n)
            m.train_step(b)
            m.predict(b)
        h = example_batch.hash_ids(["warm-up", "warm-up"])
        dedup.duplicates(dedup.DedupWindow(4), NO_HASHES, h)  # load the numba kernels

    def _train(self, batch: SparseBatch):
        """On the training thread."""
        if torch.get_num_threads() != self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        t0 = time.perf_counter()
        # stage "step_gap": the training thread idle between two steps, no batch ready (no data, or
        # the event loop late with the next one: a backlog should show ~0)
        gap = 0.0 if self._step_end is None else t0 - self._step_end
        res = train_isolating(self.model.train_step, batch)
        self._step_end = time.perf_counter()
        return res, self._step_end - t0, gap

    async def _apply(self, p: Prepared, step: asyncio.Future | None, prev: asyncio.Task | None) -> None:
        """Wait for a prepared batch's step (on the training thread) and for the batch before it
        (bookkeeping and commits stay in batch order), then commit its offsets. An example the step
        *failed* on was found by retrying alone (:mod:`trainer.isolate`: a failing step changes no
        parameter) and is dead-lettered as ``failed`` (a batch of that example) with the error,
        while the rest of its batch was trained once."""
        if p.batch is not None:
            # progressive validation: the step's forward pass scores the batch before it is learned
            res, dt, gap = await step
            loss, probs = res.loss, res.probs
        if prev is not None:
            await prev
        hashes = p.hashes
        if p.batch is not None and res.failed:
            letters = []  # records the step failed on alone (durable before the commit below)
            for row, err in res.failed:
                rec, raw = p.letter_of(row)
                letters.append(await self.ingest.dead_letter(rec, raw, processing_failed(err)))
            await asyncio.gather(*letters)
            hashes = hashes[res.applied]
            p = dataclasses.replace(p, batch=p.batch.select(res.applied) if res.applied.size else None,
                                    arrival_ms=p.arrival_ms[res.applied])
        if p.batch is not None:
            batch = p.batch
            self._stage("train", dt)
            self._stage("step_gap", gap)
            self.learned.batch(batch, loss, probs, p.arrival_ms)
            self.last_batch_at = time.perf_counter()
            self.max_event_time = max(self.max_event_time, batch.max_event_time)
            M.EVENT_TIME.labels(self.cfg.model_id).set(self.max_event_time)
        self.learned.done(hashes, p.offsets)

    def _start(self, p: Prepared) -> None:
        """Hand the batch to the training thread *now* (a task would only submit it when the event
        loop next yields - after the next poll and prepare, serializing the two), then follow it."""
        step = None
        if p.batch is not None:
            if self.first_batch_at is None:
                self.first_batch_at = time.perf_counter()
            step = asyncio.get_running_loop().run_in_executor(self._executor, self._train, p.batch)
        prev = self._pending[-1][0] if self._pending else None
        self._pending.append((asyncio.create_task(self._apply(p, step, prev)), p.hashes))

    async def _prepare(self, recs, polled_at_ms: int, decoded: Decoded) -> Prepared:
        """:meth:`trainer.ingest.Ingest.prepare`, deduplicating against the batches in flight too."""
        return await self.ingest.prepare(recs, polled_at_ms, decoded, [h for _, h in self._pending])

    async def _drain(self, keep: int = 0) -> None:
        """Wait until at most ``keep`` batches are in flight (oldest first), then snapshot if the
        event time crossed a boundary (after draining every batch: a snapshot has none in flight)."""
        if len(self._pending) <= keep:
            return
        t0 = time.perf_counter()
        while len(self._pending) > keep:
            await self._pending[0][0]
            self._pending.popleft()
        self._stage("wait_train", time.perf_counter() - t0)
        self.commits.raise_failed()  # a failed commit (a rebalance) stops the run, as it did
        if self.clock.due(self.max_event_time):
            while self._pending:
                await self._pending[0][0]
                self._pending.popleft()
            await self.sync_sparse()
            self.snapshot()
            self.clock.taken(self.max_event_time)

    async def _note_starts(self, recs) -> None:
        """Record where each newly assigned partition starts (its committed offset, or the earliest)
        as its applied offset: snapshots then name every partition. A partition left out of a
        snapshot would resume at the group's committed offset, which batches applied after the
        snapshot moved past - losing them on a crash. The start is the first record this poll
        returned from it, or, if none yet, the consumer's position (which only moves when records
        are returned)."""
        first: dict[int, int] = {}
        for r in recs:
            if r.partition in self.unknown_start and r.partition not in first:
                first[r.partition] = r.offset
        for part in list(self.unknown_start):
            start = first.get(part)
            if start is None:
                try:
                    start = await self.consumer.consumer.position(TopicPartition(self.topic, part))
                except Exception:  # noqa: BLE001 - revoked meanwhile: nothing to record
                    self.unknown_start.discard(part)
                    continue
            self.applied_offsets.setdefault(part, start)
            self.unknown_start.discard(part)

    async def _sync_when_due(self, now: float) -> None:
        """Publish sparse rows every ``sync_interval_s`` and dense weights when :attr:`dense_schedule` says,
        each after the batches in flight are applied (a sync holds only applied updates); not while
        a broker reset waits to be handled (it publishes onto the new topics itself)."""
        sparse = now - self._last_sync >= self.sync_interval_s
        dense = self.dense_schedule.due(now)
        if not (sparse or dense) or await self.resets.noticed():
            return
        if sparse:
            self._last_sync = now
            await self._drain()
            await self.sync_sparse()
        if dense:
            await self._drain()
            self.dense_schedule.published(now, self.examples_applied)
            await self.sync_dense()

    # ------------------------------------------------------------------ broker resets
    async def _handle_reset(self) -> None:
        """The broker's data was reset under the running trainer: the topics are new (empty, or
        refilled since), the group and its offsets are gone. The model, the versions and the dedup
        window are kept; every partition of the new ``examples`` is read from its start (the window
        drops what was applied already). What the old topics held
        beyond the last record applied is lost with them: counted from the last known high
        watermark and the last record applied, both as of the last check that still saw the old
        epoch (``driftline_broker_reset_lost_total``; over by what was applied after that check, a
        batch or two at most: a busy trainer checks before every commit). Then the topics are
        created with their configured partitions (tansu auto-creates a missing one with its
        default), the dense weights are published on the new ``param-deltas``, and a snapshot of
        the new epoch is written at once: serving reloads from it and reads the new
        ``param-deltas`` after its ``param_deltas_offset``."""
        epoch = self.resets.new_epoch
        # batches handed over before the reset was noticed hold real examples: apply them (not
        # committed: the committer sees the pending reset); their ids enter the dedup window
        while self._pending:
            await self._pending[0][0]
            self._pending.popleft()
        await self.commits.drop()  # a commit of the old offsets, waiting for the lost group
        lost = self.resets.lost()
        service_metrics.BROKER_RESET_LOST.labels("trainer", self.topic).inc(lost)
        log.warning("broker reset (epoch %s -> %s): %d examples of the old %s were not applied yet and are "
                    "lost; model kept at %d examples applied, re-reading %s from its start", self.epoch,
                    epoch, lost, self.topic, self.examples_applied, self.topic)
        # sends still retrying since the reset (a sync in flight then) land before ours, not among them
        try:
            await asyncio.wait_for(self._producer.flush(), self.settings.kafka.connect_timeout_s)
        except (asyncio.TimeoutError, KafkaError) as err:
            log.warning("sends of the old epoch still pending after the reset (%r)", err)
        await create_topics(self.settings)
        self.epoch = epoch
        self.applied_offsets, self.resume_offsets, self.ingest.highwater = {}, {}, {}
        self.unknown_start = set()
        self._from_start = True
        self.resets.handled()
        assigned = {tp.partition for tp in self.consumer.consumer.assignment() if tp.topic == self.topic}
        for part in sorted(assigned):
            await self.consumer.consumer.seek_to_beginning(TopicPartition(self.topic, part))
            self.unknown_start.add(part)
        await self.sync_dense()  # the new topic's first delta; param_deltas_offset now points into it
        self.snapshot()
        self.snapshots.record_epoch(self.epoch)

    async def _begin(self, restored: bool) -> None:
        """Before the first batch: publish the dense weights if serving has none of this run's; if
        the restored snapshot was written in another broker epoch, also write a snapshot of this
        one at once (serving bootstraps from it after a reset)."""
        if not restored or self.publisher.dense_version == 0 or self._reset_at_start:
            await self.sync_dense()
        if self._reset_at_start:
            self.snapshot()
            self._reset_at_start = False

    # ------------------------------------------------------------------ main loop
    async def run(self, stop_when_idle_s: float | None = None, max_examples: int | None = None) -> dict:
        s = self.settings
        await create_topics(s, {self.topic: s.topics.partitions, s.topics.param_deltas: 1, s.topics.dead_letters: 1})
        epoch = await self.resets.start(s)
        restored = self.restore(epoch)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="trainer-step")
        self._producer = self.publisher.producer = producer(s)
        await start_client(self._producer, s)
        # (a kill -9'd predecessor stays a group member until its session times out: start() waits)
        self.consumer = self.ingest.consumer = TypedConsumer(
            s, "trainer", Example, [self.topic], self.group_id, dead_letter_producer=self._producer,
            listener=_Seek(self))
        self.commits = Committer(self.consumer, self.topic, lambda: self.applied_offsets, self.resets.noticed,
                                 s.kafka.connect_timeout_s, self._stage)
        self.learned.commit = self.commits.request
        try:
            warm = asyncio.get_running_loop().run_in_executor(self._executor, self._warm_up)
            await self.consumer.start()
            await warm
            return await self._loop(restored, stop_when_idle_s, max_examples)
        finally:
            await self.resets.stop()

    async def _finish(self, started: float) -> dict:
        await self._drain()
        await self.sync_sparse()
        await self.sync_dense()
        self.snapshot()
        await self.commits.flush()
        elapsed = time.time() - started
        return {"examples_applied": self.examples_applied, "auc": self.auc.value(), "loss": self.loss_ema,
                **self.learned.scores(), "bad": self.consumer.dead_lettered, "duplicates": self.ingest.duplicates,
                "sparse_version": self.publisher.sparse_version, "elapsed_s": elapsed,
                "stages": dict(self.stage, **{f"model_{k}": v for k, v in self.model.timings.items()})}

    async def _teardown(self) -> None:
        for task, _ in self._pending:  # cancelled mid-batch: let the steps finish, commit nothing more
            task.cancel()
        self.commits.cancel()
        await self.consumer.stop()
        await self._producer.stop()
        self._executor.shutdown(wait=True)

    async def _loop(self, restored: bool, stop_when_idle_s: float | None, max_examples: int | None) -> dict:
        """The main loop: poll records until they hold ``batch_size`` examples (or
        ``batch_timeout_s`` passed), decoding each as it arrives, then hand the batch over."""
        started = time.time()
        self._last_sync = time.monotonic()
        self.dense_schedule = DenseSchedule(self.sync_interval_s, self.dense_sync_interval_s, self._last_sync)
        last_data = time.monotonic()
        await self._begin(restored)
        nxt = _NextBatch()
        queued = self.examples_applied
        try:
            while not self.stop_event.is_set():
                now = time.monotonic()
                if await self.resets.check_when_due(now):
                    nxt = _NextBatch()  # fetched from the old topic or at its positions: lost / read again
                    await self._handle_reset()
                if await self.disk.wait_for_space(self.stop_event):
                    continue  # (the stop may have come meanwhile)
                recs = await self._poll(nxt, now)
                now = time.monotonic()
                if recs:
                    last_data = now
                    await self._add(nxt, recs, now)
                if nxt.records and (nxt.decoded.examples >= self.batch_size or now - nxt.first_at >= self.batch_timeout_s):
                    prepared = await self._prepare(nxt.records, nxt.polled_at_ms, nxt.decoded)
                    nxt = _NextBatch()
                    await self._drain(self.max_in_flight - 1)
                    self._start(prepared)
                    queued += prepared.batch.size if prepared.batch is not None else 0
                    if max_examples is not None and queued >= max_examples:
                        break
                now = time.monotonic()
                self.learned.rate(now)
                await self._sync_when_due(now)
                if stop_when_idle_s is not None and not nxt.records and now - last_data >= stop_when_idle_s:
                    break
            if nxt.records:
                prepared = await self._prepare(nxt.records, nxt.polled_at_ms, nxt.decoded)
                await self._drain()
                self._start(prepared)
            return await self._finish(started)
        finally:
            await self._teardown()

    async def _poll(self, nxt: _NextBatch, now: float) -> list:
        """Poll about as many records as complete the next batch (by the examples per record
        lately), waiting at most 100 ms, and no longer than the batch timeout or the next sync."""
        wait = min(0.1, max(0.0, self._last_sync + self.sync_interval_s - now))
        if nxt.records:
            wait = min(wait, max(0.0, nxt.first_at + self.batch_timeout_s - now))
        t0 = time.perf_counter()
        want = max(1, int((self.batch_size - nxt.decoded.examples) / self._per_record))
        recs = await self.consumer.poll(timeout_ms=int(wait * 1000), max_records=want)
        self._stage("poll", time.perf_counter() - t0)
        if self.unknown_start:
            await self._note_starts(recs)
        return recs

    async def _add(self, nxt: _NextBatch, recs: list, now: float) -> None:
        """Add polled records to the next batch, decoded now (while the current batch trains)."""
        if not nxt.records:
            nxt.first_at = now
            nxt.polled_at_ms = int(time.time() * 1000)
        nxt.records.extend(recs)
        t0 = time.perf_counter()
        before = nxt.decoded.examples
        await self.ingest.decode_records(recs, nxt.decoded)
        self._stage("prepare", time.perf_counter() - t0)
        self._per_record = max(1.0, 0.8 * self._per_record + 0.2 * (nxt.decoded.examples - before) / len(recs))
