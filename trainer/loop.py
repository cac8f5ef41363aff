"""The online trainer's skeleton: what the 1-process trainer (:class:`trainer.online.OnlineTrainer`)
and a rank of N (:class:`trainer.dist.rank_trainer.RankTrainer`) share, written once.

Why a skeleton and not the 1-process trainer as the world-size-1 case of the ranks: the ranks run
lockstep rounds (poll, agree with an ``all_gather``, step), the 1-process trainer pipelines (up to
two batches on its training thread while the event loop polls and decodes the next one, what
``bench-trainer`` measures). So the engines keep their loop and their step and plug into this:

* the parts: ingest (records -> batches), publisher (``param-deltas``), the bookkeeping of what is
  learned (:class:`trainer.learned.Learned`), the snapshot clock and store, the broker-reset watch;
* restoring: one path from a snapshot's typed manifest (:meth:`_restore_stream`; the versions by
  :meth:`trainer.publisher.Publisher.restore`), and the stream-state fields of the manifest a
  snapshot writes (:meth:`_stream_manifest`);
* when a sparse or dense sync is due (:meth:`_syncs_due`, :meth:`_sync`: one
  :class:`trainer.publisher.DenseSchedule`, built in :meth:`_schedule_start`);
* a batch's bookkeeping, failed examples dead-lettered first (:meth:`_book`);
* before the first batch (:meth:`_begin`), a broker reset (:meth:`_handle_reset`), the clean end
  (:meth:`_finish`), the clients (producer, committer) set up and closed.

An engine supplies its snapshot write (one process, or collective), its reset's epoch and input
(seek, or reassign), its quiescing before a sync (drain the batches in flight, or nothing: a round
has none) and its result line's extra fields.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from aiokafka.errors import KafkaError

from services import metrics as service_metrics
from services import tansu_quirks
from services.codecs import processing_failed
from services.kafka import TypedConsumer, create_topics, producer, start_client
from services.settings import Settings

from . import dedup
from . import metrics as M
from .claim import ALONE, Claim
from .commits import Committer
from .config import ModelConfig
from .count_baseline import CountBaseline
from .ingest import Ingest, Prepared
from .isolate import StepResult
from .learned import Learned, LearnedFields
from .manifest import Manifest, own_snapshots
from .publisher import DenseSchedule, Publisher
from .resets import ResetWatch
from .sample_rates import SampleRateTracker
from .snapshot_store import SnapshotStore, check_same_model
from .snapshots import EventClock

log = logging.getLogger(__name__)


class TrainerLoop(LearnedFields):
    """The shared state and steps of an online trainer process (``rank`` of ``world``; 0 of 1 for
    the 1-process trainer). Every knob is a field of ``settings.trainer``."""

    rank, world = 0, 1
    #: whether the consumer of ``examples`` is a member of the trainer's group (the ranks: manually assigned)
    GROUP_MEMBER = True

    def __init__(self, settings: Settings, cfg: ModelConfig, stages: tuple[str, ...], *, rank: int | None = None):
        ts = settings.trainer
        self.settings, self.cfg, self.ts = settings, cfg, ts
        self.topic = settings.topics.examples
        self.sync_interval_s = ts.sync_interval_s
        self.dense_sync_interval_s = ts.dense_sync_interval_s
        self.snapshot_root = settings.model_snapshots(cfg.model_id)
        self.stage = {k: 0.0 for k in stages}
        self.dedup = dedup.DedupWindow(ts.dedup_window)
        self.auc = M.StreamingAUC()
        self.sample_rates = SampleRateTracker(ts.sample_rate_half_life)  # what serving corrects with
        self.ingest = Ingest(cfg, self.topic, self.dedup, max_future_ms=int(1000 * settings.event_time.max_future_s),
                             stage=self._stage)
        self.publisher = Publisher(settings, cfg.model_id, self._stage)
        # (each rank's baseline counts the users and items of its own partitions)
        self.learned = Learned(cfg.model_id, self.auc, self.sample_rates, self.dedup, self.publisher.applied,
                               rank=rank, baseline=CountBaseline(settings.eval.count_prior, cfg.position_slot),
                               recent_baseline=CountBaseline(settings.eval.count_prior, cfg.position_slot,
                                                             half_life=ts.recent_half_life))
        self.store = SnapshotStore(self.snapshot_root, cfg, self.topic)
        self.clock = EventClock(int(1000 * ts.snapshot_interval_event_s))
        self.commits: Committer | None = None
        #: whether another trainer reads the same examples under the same group (rank 0's, in run())
        self.claim: Claim | None = None
        #: the broker epoch the offsets belong to (None: an external Kafka without one)
        self.epoch: str | None = None
        self.resets = ResetWatch(ts.epoch_check_interval_s, lambda: (self.ingest.highwater, self.applied_offsets))
        #: a partition without an applied offset starts at its earliest record, not at the group's
        #: committed offset (the snapshot's broker epoch is gone, or a reset since)
        self._from_start = False
        self._reset_at_start = False  # the restored snapshot was written in another broker epoch
        self.restored = False
        self.max_event_time = 0
        self.failed_steps = 0  # batches (rounds) whose step failed on some example (isolated, dead-lettered)
        self.stop_event = asyncio.Event()
        self._schedule_start(time.monotonic())

    def _stage(self, name: str, seconds: float) -> None:
        self.stage[name] = self.stage.get(name, 0.0) + seconds
        M.STAGE_SECONDS.labels(self.cfg.model_id, name).inc(seconds)

    # ------------------------------------------------------------------ engine hooks
    async def _write_snapshot(self) -> None:
        """Write a snapshot (every rank's part, collective, for the ranks)."""
        raise NotImplementedError

    async def _quiesce(self) -> None:
        """Before a sync or a snapshot: nothing of this process' may be in flight (applied or not)."""

    def _examples_learned(self) -> int:
        """What the dense schedule counts as learned so far (it only ramps while examples come)."""
        return self.examples_applied

    async def _reset_epoch(self) -> str | None:
        """A broker reset is being handled: the new epoch (and whatever must be applied first)."""
        return self.resets.new_epoch

    async def _reset_input(self) -> None:
        """After a broker reset: read every partition from the new topic's start."""
        raise NotImplementedError

    def _reset_where(self) -> str:
        """The log line's words for what this process reads (``rank r ... topic[partitions]``)."""
        return self.topic

    # ------------------------------------------------------------------ state
    def _restore_stream(self, man: Manifest, *, reset: bool, offsets: dict[int, int], examples_applied: int,
                        dedup_state, auc: tuple | None, sample_rates: dict, scores: dict | None,
                        sparse_version: int | None = None) -> None:
        """The one restore path of a snapshot's stream state (both trainers; the model is the engine's):
        the versions, clocks, counts, offsets, dedup window, AUC, sample rates and scores."""
        self.restored, self._reset_at_start = True, reset
        self.publisher.restore(man, sparse_version=sparse_version, reset=reset)
        self.max_event_time = man.max_event_time_ms
        self.clock.next_at = man.next_snapshot_at
        self.examples_applied = examples_applied
        self.applied_offsets = dict(offsets)
        self.dedup.load(dedup_state)
        if auc is not None:
            self.auc.load(*auc)
        self.sample_rates.load(sample_rates)
        self.learned.load_scores(scores)

    def _stream_manifest(self) -> Manifest:
        """This process' stream state as a snapshot's manifest records it."""
        return Manifest(offsets=dict(self.applied_offsets), topic=self.topic, broker_epoch=self.epoch,
                        from_start=self._from_start, **self.publisher.versions(),
                        examples_applied=self.examples_applied, max_event_time_ms=self.max_event_time,
                        next_snapshot_at=self.clock.next_at, auc=self.auc.value(), sample_rates=self.sample_rates.state())

    # ------------------------------------------------------------------ sync
    def _schedule_start(self, now: float) -> None:
        """The sync clocks start at ``now`` (a run's start): sparse every ``sync_interval_s``, dense
        on :class:`DenseSchedule`'s ramp."""
        self._last_sync = now  # monotonic time of the last sparse sync
        self.dense_schedule = DenseSchedule(self.sync_interval_s, self.dense_sync_interval_s, now)

    def _syncs_due(self, now: float) -> tuple[bool, bool]:
        """Whether a sparse and a dense sync are due at ``now``."""
        return now - self._last_sync >= self.sync_interval_s, self.dense_schedule.due(now)

    async def _sync(self, now: float, sparse: bool, dense: bool) -> None:
        """The syncs due, each after nothing is in flight (a sync holds only applied updates)."""
        if sparse:
            self._last_sync = now
            await self._quiesce()
            await self.sync_sparse()
        if dense:
            await self._quiesce()
            self.dense_schedule.published(now, self._examples_learned())
            await self.sync_dense()

    # ------------------------------------------------------------------ a batch learned
    async def _book(self, p: Prepared, res: StepResult | None, learned: Callable | None = None) -> None:
        """Bookkeeping of a prepared batch after its step (:class:`trainer.learned.Learned`). An example
        the step *failed* on alone (:mod:`trainer.isolate`: a failing step changes no parameter) is
        dead-lettered as ``failed`` with the error, durable before the commit of its offsets; the
        rest is learned. ``learned(batch)``: the engine's own bookkeeping of what was learned."""
        hashes, batch, arrival = p.hashes, p.batch, p.arrival_ms
        if batch is not None and res.failed:
            self.failed_steps += 1
            letters = []
            for row, err in res.failed:
                rec, raw = p.letter_of(row)
                letters.append(await self.ingest.dead_letter(rec, raw, processing_failed(err)))
            await asyncio.gather(*letters)
            hashes, arrival = hashes[res.applied], arrival[res.applied]
            batch = batch.select(res.applied) if res.applied.size else None
        if batch is not None:
            if learned is not None:
                learned(batch)
            self.learned.batch(batch, res.loss, res.probs, arrival)
        self.learned.done(hashes, p.offsets)

    async def _restore_at_start(self, epoch: str | None) -> None:
        """The model and stream state from the newest snapshot, or fresh (``epoch``: the broker's now)."""
        raise NotImplementedError

    def _consumer(self) -> TypedConsumer:
        """This process' consumer of ``examples`` (not started)."""
        raise NotImplementedError

    async def _start_input(self) -> None:
        """Start reading (the consumer joins its group, or is assigned its partitions)."""
        raise NotImplementedError

    async def _loop(self, stop_when_idle_s: float | None, max_examples: int | None) -> dict:
        raise NotImplementedError

    # ------------------------------------------------------------------ start, resets, end
    async def run(self, stop_when_idle_s: float | None = None, max_examples: int | None = None) -> dict:
        """Train until stopped (``stop_event``), idle ``stop_when_idle_s`` or ``max_examples`` queued;
        the result line. The topics (rank 0), the broker epoch, the restore, the producer, the consumer
        and the committer are set up here for every engine, and closed here. The one-process trainer
        holds its snapshot root alone (:func:`trainer.manifest.own_snapshots`)."""
        with own_snapshots(self.snapshot_root) if self.world == 1 else contextlib.nullcontext():
            return await self._run(stop_when_idle_s, max_examples)

    async def _run(self, stop_when_idle_s: float | None, max_examples: int | None) -> dict:
        check_same_model(self.snapshot_root, self.cfg)  # (before the broker: a person must act on it)
        if self.rank == 0:
            await self._create_topics()
            self.claim = Claim(self.settings, self.topic, self.ts.group_id)
            await self.claim.start()  # (it joins while the model is restored)
        try:
            epoch = await self.resets.start(self.settings)
            await self._restore_at_start(epoch)
            await self._start_producer()
            # (a kill -9'd predecessor stays a group member until its session times out: start() waits)
            self.consumer = self.ingest.consumer = self._consumer()
            self._start_commits()
            try:
                await self._start_input()
                return await self._loop(stop_when_idle_s, max_examples)
            finally:
                await self._teardown()
        finally:
            if self.claim is not None:
                await self.claim.stop()

    def _claim_state(self) -> int:
        """This process' claim (:mod:`trainer.claim`; a trainer not running, or a rank but 0: alone)."""
        return self.claim.state if self.claim is not None else ALONE

    async def _teardown(self) -> None:
        """Stopping (cleanly or not): commit nothing more, close the clients and the epoch watch."""
        await self._close_clients()
        await self.resets.stop()

    async def _create_topics(self) -> None:
        s = self.settings
        await create_topics(s, {self.topic: s.topics.partitions, s.topics.param_deltas: 1, s.topics.dead_letters: 1})

    async def _start_producer(self) -> None:
        self._producer = self.publisher.producer = producer(self.settings)
        self.publisher.stopping = self.stop_event.is_set
        await start_client(self._producer, self.settings)

    def _start_commits(self) -> None:
        """The group's offsets, once the consumer exists: every batch done asks for a commit. A
        consumer that is no group member (:attr:`GROUP_MEMBER`) has the group's departed members
        expelled by rank 0 while the group refuses its commits (:mod:`trainer.commits`)."""
        member = self.GROUP_MEMBER
        self.commits = Committer(self.consumer, self.topic, lambda: self.applied_offsets, self.resets.noticed,
                                 self.settings.kafka.connect_timeout_s, self._stage, member=member,
                                 expel=self._expel_departed if not member and self.rank == 0 else None)
        self.learned.commit = self.commits.request

    async def _expel_departed(self) -> None:
        s = self.settings
        log.warning("expelling the departed members of group %r (tansu quirk 10): one join and leave", self.ts.group_id)
        await tansu_quirks.expel_departed_members(s, self.ts.group_id, self.topic, 3 * s.kafka.session_timeout_ms / 1000)

    async def _close_clients(self) -> None:
        self.commits.cancel()
        await self.consumer.stop()
        await self._producer.stop()

    async def _begin(self) -> None:
        """Before the first batch: publish the dense weights if serving has none of this run's; if
        the restored snapshot was written in another broker epoch, also write a snapshot of this
        one at once (serving bootstraps from it after a reset)."""
        if not self.restored or self.publisher.dense_version == 0 or self._reset_at_start:
            await self.sync_dense()
        if self._reset_at_start:
            await self._write_snapshot()
            self._reset_at_start = False

    async def _handle_reset(self) -> None:
        """The broker's data was reset under the running trainer: the topics are new (empty, or
        refilled since), the group and its offsets are gone. The model, the versions and the dedup
        window are kept; every partition of the new ``examples`` is read from its start (the window
        drops what was applied already). What the old topics held beyond the last record applied is
        lost with them: counted from the last known high watermark and the last record applied, both
        as of the last check that still saw the old epoch (``driftline_broker_reset_lost_total``;
        over by what was applied after that check, a batch or two at most: a busy trainer checks
        before every commit). Then the topics are created with their configured partitions (tansu
        auto-creates a missing one with its default), the dense weights are published on the new
        ``param-deltas``, and a snapshot of the new epoch is written at once: serving reloads from
        it and reads the new ``param-deltas`` after its ``param_deltas_offset``."""
        epoch = await self._reset_epoch()
        await self.commits.drop()  # a commit of the old offsets, waiting for the lost group
        lost = self.resets.lost()
        service_metrics.BROKER_RESET_LOST.labels("trainer", self.topic).inc(lost)
        log.warning("%sbroker reset (epoch %s -> %s): %d examples of the old %s were not applied yet and are lost; "
                    "model kept at %d examples applied%s, re-reading from the start",
                    f"rank {self.rank}: " if self.world > 1 else "", self.epoch, epoch, lost, self._reset_where(),
                    self.examples_applied, " here" if self.world > 1 else "")
        # sends still retrying since the reset (a sync in flight then) land before ours, not among them
        try:
            await asyncio.wait_for(self._producer.flush(), self.settings.kafka.connect_timeout_s)
        except (TimeoutError, KafkaError) as err:
            log.warning("sends of the old epoch still pending after the reset (%r)", err)
        if self.rank == 0:  # with their configured partitions (tansu auto-creates with its default)
            await create_topics(self.settings)
        await self._barrier()
        self.epoch, self.ingest.highwater = epoch, {}
        self.resets.handled()
        await self._reset_input()
        await self.sync_dense()  # the new topic's first delta; param_deltas_offset now points into it
        await self._write_snapshot()

    async def _barrier(self) -> None:
        """Every process of the trainer got here (one process: at once)."""

    async def _finish(self, started: float, head: dict | None = None, **extra) -> dict:
        """The clean end: nothing in flight, sparse and dense weights published, the final snapshot
        written, the offsets committed; the result line (``head``: the engine's first fields, which
        readers of a log match lines by; ``extra``: its last)."""
        await self._quiesce()
        await self.sync_sparse()
        await self.sync_dense()
        await self._write_snapshot()
        await self.commits.flush()
        return {**(head or {}), "examples_applied": self.examples_applied, "auc": self.auc.value(), "loss": self.loss_ema,
                **self.learned.scores(), "bad": self.consumer.dead_lettered, "duplicates": self.ingest.duplicates,
                "sparse_version": self.publisher.sparse_version, "elapsed_s": time.time() - started, **extra}
