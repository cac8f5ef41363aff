"""Online training from the ``examples`` topic (Monolith's streaming trainer): the run loop.
What it shares with a rank of N (restoring, the sync schedule, broker resets, a batch's bookkeeping,
the clean stop) is :class:`trainer.loop.TrainerLoop`'s; here is the pipelined loop and its step.
(About 490 lines: the loop, its consumer's rebalance hooks and its two threads' hand-over share
one batch in flight and read best together; what stands alone is apart: :mod:`trainer.ingest`,
:mod:`trainer.publisher`, :mod:`trainer.commits`, :mod:`trainer.group_share`, :mod:`trainer.claim`.)

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
import functools
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from aiokafka import ConsumerRebalanceListener, TopicPartition

from proto import Example
from services import example_batch
from services.disk import DiskGuard
from services.kafka import TypedConsumer
from services.settings import Settings

from . import dedup
from . import metrics as M
from .batch import SparseBatch
from .claim import ALONE
from .config import ModelConfig
from .group_share import GroupShare
from .ingest import NO_HASHES, Decoded, Prepared
from .isolate import train_isolating
from .loop import TrainerLoop
from .model import SparseModel

log = logging.getLogger(__name__)


class _Seek(ConsumerRebalanceListener):
    def __init__(self, trainer: OnlineTrainer):
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
        self.t.group_share.check(self.t.consumer.consumer, assigned)
        if self.t._claim_state() != ALONE:  # (a new assignment starts unpaused)
            self.t.consumer.consumer.pause(*[tp for tp in assigned if tp.topic == self.t.topic])
            self.t._claim_paused = True
        self.t.ready.set()


@dataclass
class _NextBatch:
    """Records polled for the next batch, decoded as they arrive."""

    records: list = field(default_factory=list)
    decoded: Decoded = field(default_factory=Decoded)
    first_at: float = 0.0  # monotonic time of the first poll that filled it
    polled_at_ms: int = 0  # wall time of the same


class OnlineTrainer(TrainerLoop):
    """Every knob is a field of ``settings.trainer`` (:class:`services.settings.TrainerSettings`):
    run one with other values through ``settings.updated(trainer={...})``. Its parts:
    :attr:`ingest` (records -> batches), :attr:`publisher` (``param-deltas``), :attr:`snapshots`
    (restarts), :attr:`commits` (the group's offsets, once running), :attr:`resets` (broker resets)."""

    def __init__(self, settings: Settings, cfg: ModelConfig, *, torch_threads: int = 1):
        super().__init__(settings, cfg, ("poll", "prepare", "train", "step_gap", "wait_train", "commit", "sync",
                                         "snapshot"))
        ts = settings.trainer
        self.batch_size = ts.batch_size
        self.batch_timeout_s = ts.batch_timeout_s
        self.disk = DiskGuard.from_settings("trainer", self.snapshot_root, settings)
        self.group_id = ts.group_id
        self.group_share = GroupShare(ts.group_id, self.topic)
        self._claim_paused = False  # its partitions paused while the claim says it is not alone
        # torch intra-op threads of the training thread. 1 by default: the other core decodes and
        # assembles the next batch; 2 torch threads plus the decoding thread oversubscribe two
        # cores, and OpenMP's barriers then wait on descheduled threads (10x slower steps measured).
        self.torch_threads = torch_threads
        self.placement = {"device": ts.device, "cache_rows": ts.cache_rows, "cache_admit_after": ts.cache_admit_after,
                          "lookahead": ts.lookahead}
        self.model = SparseModel(cfg, **self.placement)
        self.ps_counts = self.learned.ps_counts = M.PSCounts(cfg.model_id, self.model.tables, self.model)
        self._step_end: float | None = None  # perf_counter when the training thread last finished a step
        self.snapshots = self.store  # (the name tests and tools use)
        self.resume_offsets: dict[int, int] = {}
        # assigned partitions whose start position is not known yet (see _note_starts)
        self.unknown_start: set[int] = set()
        self.ready = asyncio.Event()  # set once the group join assigned partitions
        self.first_batch_at: float | None = None
        self.last_batch_at: float | None = None
        # batches handed to the training thread, oldest first: (task following it, its id hashes)
        self._pending: deque[tuple[asyncio.Task, np.ndarray]] = deque()
        #: 2: the next batch waits on the training thread's queue while the current one trains, so
        #: the thread goes from one step to the next without waiting for the event loop
        self.max_in_flight = 2
        # batches handed to the training thread and not yet begun there, oldest first: the step of
        # one reads the next ahead (trainer.lookahead). Appended on the event loop, taken on the
        # training thread (deque's append and popleft are atomic).
        self._queued: deque[SparseBatch] = deque()
        # examples per record lately (how many records to poll for a batch): from one record at a time
        self._per_record = float(self.batch_size)
        self._executor: ThreadPoolExecutor | None = None

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
        self.model = SparseModel(self.cfg, got.tables, **self.placement)
        self.ps_counts = self.learned.ps_counts = M.PSCounts(self.cfg.model_id, self.model.tables, self.model)
        self.model.load_dense_state(dense)
        self.resume_offsets, self._from_start = got.offsets, got.from_start
        self.snapshots.record_epoch(self.epoch)
        auc = (dense["auc_pos"], dense["auc_neg"]) if "auc_pos" in dense and "auc_neg" in dense else None
        self._restore_stream(man, reset=got.reset, offsets=self.resume_offsets, examples_applied=man.examples_applied,
                             dedup_state=dense.get("dedup", []), auc=auc, sample_rates=man.sample_rates,
                             scores=dense.get("scores"))
        if self.max_event_time:
            M.EVENT_TIME.labels(self.cfg.model_id).set(self.max_event_time)
        log.info("restored snapshot %s (%s): %d examples applied, offsets %s", man.name,
                 man.source, self.examples_applied, self.resume_offsets)
        return True

    def snapshot(self) -> Path:
        """Write a snapshot (call with no batch in flight: see :meth:`_drain`)."""
        t0 = time.perf_counter()
        dense = {"auc_pos": self.auc.pos, "auc_neg": self.auc.neg, "dedup": self.dedup.state(),
                 "scores": self.learned.scores_state()}
        self.model.write_back()
        path = self.snapshots.save(self.model, dense, self._stream_manifest())
        self.snapshots.record_epoch(self.epoch)
        self._stage("snapshot", time.perf_counter() - t0)
        return path

    async def _write_snapshot(self) -> None:
        self.snapshot()

    # ------------------------------------------------------------------ sync
    async def sync_sparse(self) -> int:
        """Publish the touched rows as one version (call with no batch in flight); nothing while
        another trainer shares the stream (:meth:`_held`)."""
        if self._held():
            return 0
        self.model.write_back()
        return await self.publisher.sync_sparse(self.model.tables, self.max_event_time)

    async def sync_dense(self) -> None:
        """Publish the dense params as one version (not while another trainer shares the stream)."""
        if not self._held():
            await self.publisher.sync_dense(self.model.head, self.max_event_time, self.sample_rates.rates())
            M.dense_input(self.cfg.model_id, self.cfg.dense_features, self.model.head)

    def _held(self) -> bool:
        """Whether another trainer shares the stream: another member of this trainer's group holds
        partitions (:mod:`trainer.group_share`), or another trainer claims the examples under the
        same group, or the claim is not known yet (:mod:`trainer.claim`)."""
        return self.group_share.sharing or self._claim_state() != ALONE

    def _follow_claim(self) -> None:
        """This trainer's partitions paused while its claim says it is not alone, resumed when it
        is (unless its group is shared: that rebalance's check resumes them)."""
        held = self._claim_state() != ALONE
        if held == self._claim_paused:
            return
        c = self.consumer.consumer
        ours = [tp for tp in c.assignment() if tp.topic == self.topic]
        if held:
            c.pause(*ours)
        elif not self.group_share.sharing:
            c.resume(*ours)
        self._claim_paused = held

    # ------------------------------------------------------------------ training
    def _warm_up(self) -> None:
        """On the training thread, while the consumer joins its group (~5 s on tansu): load/compile
        the PS's numba kernels and touch torch's kernels on a throwaway model (fresh tables, own
        head), so the first real batch does not pay ~0.5 s of JIT/cache loading."""
        torch.set_num_threads(self.torch_threads)
        cfg = self.cfg
        m = SparseModel(cfg, **self.placement)
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
        if self._queued and self._queued[0] is batch:
            self._queued.popleft()
        then = self._queued[0] if self._queued else None
        res = train_isolating(functools.partial(self.model.train_step, then=then), batch)
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
        else:
            res = dt = gap = None
        if prev is not None:
            await prev

        def learned(batch: SparseBatch) -> None:
            self._stage("train", dt)
            self._stage("step_gap", gap)
            self.last_batch_at = time.perf_counter()
            self.max_event_time = max(self.max_event_time, batch.max_event_time)
            M.EVENT_TIME.labels(self.cfg.model_id).set(self.max_event_time)

        await self._book(p, res, learned)

    def _start(self, p: Prepared) -> None:
        """Hand the batch to the training thread *now* (a task would only submit it when the event
        loop next yields - after the next poll and prepare, serializing the two), then follow it."""
        step = None
        if p.batch is not None:
            if self.first_batch_at is None:
                self.first_batch_at = time.perf_counter()
            self._queued.append(p.batch)
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
        sparse, dense = self._syncs_due(now)
        if not (sparse or dense) or await self.resets.noticed():
            return
        await self._sync(now, sparse, dense)

    async def _quiesce(self) -> None:
        await self._drain()

    # ------------------------------------------------------------------ broker resets
    async def _reset_epoch(self) -> str | None:
        """Batches handed over before the reset was noticed hold real examples: applied first (not
        committed: the committer sees the pending reset); their ids enter the dedup window."""
        while self._pending:
            await self._pending[0][0]
            self._pending.popleft()
        return self.resets.new_epoch

    async def _reset_input(self) -> None:
        """Every assigned partition of the new topic is read from its start (:meth:`TrainerLoop._handle_reset`)."""
        self.applied_offsets, self.resume_offsets = {}, {}
        self.unknown_start = set()
        self._from_start = True
        assigned = {tp.partition for tp in self.consumer.consumer.assignment() if tp.topic == self.topic}
        for part in sorted(assigned):
            await self.consumer.consumer.seek_to_beginning(TopicPartition(self.topic, part))
            self.unknown_start.add(part)

    # ------------------------------------------------------------------ main loop
    async def _restore_at_start(self, epoch: str | None) -> None:
        self.restore(epoch)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="trainer-step")

    def _consumer(self) -> TypedConsumer:
        return TypedConsumer(self.settings, "trainer", Example, [self.topic], self.group_id,
                             dead_letter_producer=self._producer, listener=_Seek(self))

    async def _start_input(self) -> None:
        """Join the group while the training thread warms up."""
        warm = asyncio.get_running_loop().run_in_executor(self._executor, self._warm_up)
        await self.consumer.start()
        await warm

    async def _finish(self, started: float) -> dict:
        return await super()._finish(started, stages=dict(self.stage, **{f"model_{k}": v
                                                                          for k, v in self.model.timings.items()}))

    async def _teardown(self) -> None:
        for task, _ in self._pending:  # cancelled mid-batch: let the steps finish, commit nothing more
            task.cancel()
        await super()._teardown()
        self._executor.shutdown(wait=True)

    async def _loop(self, stop_when_idle_s: float | None, max_examples: int | None) -> dict:
        """The main loop: poll records until they hold ``batch_size`` examples (or
        ``batch_timeout_s`` passed), decoding each as it arrives, then hand the batch over."""
        started = time.time()
        self._schedule_start(time.monotonic())
        last_data = time.monotonic()
        begun = False
        nxt = _NextBatch()
        queued = self.examples_applied
        while not self.stop_event.is_set():
            self._follow_claim()
            if not begun and not self._held():  # (its first publish: as the only trainer)
                started = time.time()  # (the result's elapsed_s: from here, a wait for the claim left out)
                await self._begin()
                begun = True
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
            if self._held():  # (waiting for another trainer to leave is not being idle)
                last_data = now
            self.learned.rate(now)
            await self._sync_when_due(now)
            if stop_when_idle_s is not None and not nxt.records and now - last_data >= stop_when_idle_s:
                break
        if nxt.records:
            prepared = await self._prepare(nxt.records, nxt.polled_at_ms, nxt.decoded)
            await self._drain()
            self._start(prepared)
        return await self._finish(started)

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
        if self.unknown_start and not self._claim_paused:  # (recorded once it reads: after its first publish)
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
