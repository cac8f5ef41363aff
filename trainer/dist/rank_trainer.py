"""The online trainer as one rank of N (``trainer online --nproc N``, or under ``torchrun``).

Each rank is a process started by torch's elastic launcher (:mod:`trainer.dist.launch`) and joined to
the others by a gloo process group. The model is :class:`trainer.dist.model.DistributedModel`:
rank ``r`` owns shard ``r`` of every table (:func:`trainer.sharding.shard_of`), the dense head is
replicated. The parts of the 1-process trainer are reused: :class:`trainer.ingest.Ingest`
(records -> checked, deduplicated batches), :class:`trainer.publisher.Publisher` (its shard's
rows, named ``shard=r, shard_count=N``; dense by rank 0 only), :class:`trainer.commits.Committer`
(the group's offsets) and the snapshot file format (:mod:`trainer.snapshots`, N-rank layout).

**Input** (:mod:`trainer.dist.input`). Rank ``r`` of ``N`` reads the partitions ``p`` of
``examples`` with ``p % N == r`` by manual assignment; offsets are committed per partition as the
1-process trainer does.

**One round**, on every rank, in lockstep (sync and hybrid; gba's rounds do not wait: below):

1. poll until ``batch_size`` examples or ``batch_timeout_s`` passed (an idle rank gives up after
   the timeout: it delays the others by at most that);
2. *agree* (one ``all_gather`` of a few int64 per rank): whether any rank was asked to stop
   (SIGTERM reaches one rank or all), whether any rank noticed a broker reset, whether every rank
   has been idle ``stop_when_idle_s``, the global max event time (snapshots are due by it), the
   examples queued, rank 0's clock decisions (sparse / dense sync due), clock and claim, and each
   rank's work in its last step (``dist_mode = "auto"``'s input). Every rank then takes the same
   decisions without another message;
3. step (:meth:`DistributedModel.step`, collective; an empty batch on an idle rank; then
   ``trainer.debug_slow_rank``'s sleep on a straggler made on purpose, :mod:`trainer.dist.straggler`), then
   the bookkeeping of the 1-process trainer (:class:`trainer.learned.Learned`) and per-rank
   metrics (label ``rank``: examples, steps, seconds and bytes in collectives);
4. when due: each rank publishes its shard's touched rows; rank 0 the dense weights with the
   sample rates of *all* ranks (their trackers' sums, gathered); every rank snapshots its shard
   (:meth:`RankTrainer.snapshot`).

**One trainer per topic and group** (:mod:`trainer.claim`): the ranks are no members of the
trainer's group, so rank 0 joins the trainers' claim group and puts what it says into the rounds'
agreement. While another trainer claims the same examples (a one-process trainer, another set), or
before rank 0's first claim assignment, no rank polls, and nothing is published: the first
publication (:meth:`_begin`) waits for the first agreement that says the set is alone, the syncs
keep their rows touched for later. A batch polled before the agreement that says otherwise is
trained and booked as usual.

**A failing example** (its loss or gradients not finite, or the step raising on it) fails the
step on every rank together: the engine's per-rank failure flags (:class:`trainer.dist.model.RankStepError`)
tell each rank whether its own batch failed, and nothing is applied anywhere. The ranks then
retry in lockstep (:func:`trainer.isolate.train_isolating_ranks`): a rank whose batch failed
halves it down to the failing examples, the others retry theirs whole (or step empty), until
every piece is learned or failed alone. Those are dead-lettered with the error (reason
``failed: ...``) and the offsets move on, as in the 1-process trainer: no rank hangs in a
collective and no failure reaches the launcher (no restart, no crash loop).

**Broker resets** (tansu's memory storage lost with a broker restart, :mod:`trainer.resets`):
every rank watches the broker epoch (before each commit, and every ``epoch_check_interval_s``)
and puts what it saw into the round's agreement; when any rank saw a reset, all ranks handle it
in the same round (:meth:`trainer.loop.TrainerLoop._handle_reset`, the 1-process trainer's too): the round's
batch is dropped (fetched from the old topic, or from the new one at old positions: read again),
the model, versions and dedup windows are kept, rank 0 creates the topics again, every rank reads
its partitions from their start, rank 0 publishes the dense weights on the new ``param-deltas``,
the group writes a snapshot of the new epoch. A group started on a snapshot of another epoch does
the same (:mod:`trainer.dist.rank_snapshots`).

**Snapshots** (all ranks at the same round): each rank writes its shard (rows + PS optimizer
state) and its own stream state (its partitions' next offsets, dedup window, AUC histograms,
sample-rate sums, examples applied); rank 0, after an ``all_gather`` of the ranks' summaries (the
barrier), writes the dense weights and optimizer and the manifest last
(:func:`trainer.snapshots.commit_ranks`; what is recorded and how a rank resumes:
:mod:`trainer.dist.rank_snapshots`). A kill -9 of any rank makes the elastic launcher stop
and restart the whole group (``trainer.max_restarts``), and every rank resumes from the last
complete manifest; a snapshot of N ranks restores into M ranks (rows resharded on load, offsets
split by the partition rule, the global stream state given to rank 0). Ranks whose launcher is
gone stop the group after a last snapshot (:meth:`RankTrainer._launchers_lost`).

**Hybrid** (``trainer.dist_mode = "hybrid"``): each round's step queues its lookup, then the sparse
updates of the rounds older than ``trainer.staleness``; those run on the engine's lookup thread
during this round's forward and backward, and this round's update waits for the next round
(:meth:`DistributedModel.step`: a looked-up row misses at most ``staleness`` rounds of updates;
with ``staleness`` 0 a round's update is queued at once and overlaps the round's bookkeeping and
the next poll instead: ``sync``'s results).
Before the rows are published and before a snapshot every rank applies what is deferred
(:meth:`DistributedModel.flush`; it also writes back the owner cache of ``trainer.cache_rows``),
so deltas and snapshots hold every example counted as applied. ``trainer.device``: each rank's
head on its GPU (:mod:`trainer.dist.placement`); GBA ranks refuse it and the cache.
Polling and training still alternate within a round.

**GBA** (``trainer.dist_mode = "gba"`` or ``"async"``, :mod:`trainer.dist.gba_model`): the step is
:meth:`GBAModel.step`, not collective (a failing example is bisected on its own rank by
:func:`trainer.isolate.train_isolating`); its ``flush`` before a publication or a snapshot is
:meth:`GBAModel.finish`, collective: every owner applies what its buffer holds, short of a global
batch or not, so deltas and snapshots hold every example counted as applied, and a GBA snapshot
is a sync one (shards, rank 0's master head and Adam state): it restores into sync, hybrid and
the 1-process trainer. **GBA's rounds do not wait for each other** (:mod:`trainer.dist.rounds`,
the design and why): the agreement is an ``all_gather`` in flight on a gloo group of its own,
started after a round and looked at, without blocking, after each of the rank's next rounds; once
every rank contributed (the examples it stepped since its last contribution, its flags, rank 0's
clock decisions), every rank acts on it at its next round boundary and starts the next one. A fast
rank runs several rounds while a straggler runs one; the actions (a reset, the syncs, a snapshot,
a switch, the stop) stay collective, each after the same n-th agreement on every rank
(bench/bench_gba_online.py measures the group's rate with a straggler).

**Switching** (:mod:`trainer.dist.mode_switch`): with ``dist_mode = "auto"`` the group starts in
sync and, from the rounds' agreed work times, switches to gba while a rank straggles and back to
sync when it recovers; with another mode it switches at a snapshot when the project file's
``dist_mode`` changed. The switch (:meth:`RankTrainer._switch`) is collective, in the same round
on every rank: the engine applies everything it holds (its ``flush``), and the other engine is
built in memory on the same table shards with rank 0's head and Adam state, as :meth:`_restore`
builds one from a snapshot; learning rates and batch sizes stay the settings'. RPC, once up, stays
up (:meth:`GBAModel.close` ``keep_rpc``) until the ranks end. Logged, counted
(``driftline_trainer_dist_mode_switches_total``) and listed in the result line (``switches``).

One module of about 610 lines because the round, the snapshots, the syncs and the mode switches
all act on one rank's state through its one collectives' thread; what needs none of it lives beside
it (:mod:`trainer.dist.input`, :mod:`trainer.dist.rank_snapshots`, :mod:`trainer.dist.mode_switch`,
:mod:`trainer.dist.rounds`).

The dedup window is per rank: enough, examples are keyed by user, so a joiner duplicate lands on
the same partition, i.e. the same rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from proto import Example
from services.kafka import TypedConsumer
from services.settings import Settings

from .. import metrics as M
from .. import snapshots
from ..batch import SparseBatch
from ..claim import ALONE, UNKNOWN
from ..config import ModelConfig
from ..head import load_dense_optimizer
from ..isolate import StepResult, train_isolating, train_isolating_ranks
from ..loop import TrainerLoop
from . import rank_snapshots
from .gba import MODES as GBA_MODES
from .gba_model import GBAModel, shutdown_rpc, unsupported
from .input import RankInput, empty_batch, my_partitions  # noqa: F401 - the rule, named here too
from .mode_switch import AutoSwitch, FileMode, Speed
from .model import DistributedModel
from .rounds import (CLAIM, CLOCK, DENSE, EVENT, EXAMPLES, IDLE, ORPHAN, RESET, STOP, SYNC, WORK, FreeAgreement, Tally,
                     control_vector)
from .straggler import Straggler

log = logging.getLogger(__name__)


EXIT_REGROUP = 75
"""A rank's exit status when another machine's launcher is gone: a failure to its own launcher,
which restarts the group (``trainer.max_restarts``) and waits in the rendezvous for the rest."""


class RankError(RuntimeError):
    """A rank cannot run: no process group, or a snapshot that does not fit."""


class RankTrainer(TrainerLoop):
    """Rank ``dist.get_rank()`` of the online trainer; every knob is a field of ``settings.trainer``."""

    GROUP_MEMBER = False  # (its input is assigned by hand: trainer.dist.input)

    def __init__(self, settings: Settings, cfg: ModelConfig):
        if not dist.is_initialized():
            raise RankError("torch.distributed is not initialized (start ranks with trainer.dist.launch or torchrun)")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        ts = settings.trainer
        if ts.dist_mode in GBA_MODES and (why := unsupported(cfg, ts.device, ts.cache_rows)) is not None:
            raise RankError(why)
        if cfg.meta is not None and ts.dist_mode != "sync":  # (trainer.dist.meta)
            raise RankError(f"model.meta on N ranks trains in sync, not {ts.dist_mode!r}")
        super().__init__(settings, cfg, ("poll", "prepare", "train", "commit", "sync", "snapshot", "agree", "comm"),
                         rank=self.rank)
        ts = self.ts
        self.root = self.snapshot_root
        self.input = RankInput(self.ingest, self.topic, self.rank, self.world, ts.batch_size, ts.batch_timeout_s,
                               self._stage)
        self.publisher.shard, self.publisher.shard_count = self.rank, self.world
        # every collective runs on this one thread, in the same order on every rank
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"rank{self.rank}-step")
        self.dm: DistributedModel | GBAModel | None = None
        self._parent = os.getppid()  # the launcher: gone when this changes
        self.regroup = False  # exit with EXIT_REGROUP: another machine's launcher is gone
        self._queued = 0  # examples queued by all ranks in this run (the dense schedule's count)
        self._learned_since_sync = False
        # rank 0's claim (trainer.claim) as last agreed: the set polls, trains and publishes only
        # while it is the only trainer of its examples and group; its first publication waits for it
        self._claim = UNKNOWN
        # its first publication's time (None: not yet); the result's elapsed_s counts from it, the claim's wait left out
        self._began_at: float | None = None
        # switching sync <-> gba (trainer.dist.mode_switch): auto's rule, the project file's mode
        # (rank 0 reads it), this rank's last step's work, the switches made, the old models' counts
        self.straggler = Straggler.for_rank(ts.debug_slow_rank, self.rank)
        self.auto: AutoSwitch | None = None
        if ts.dist_mode == "auto":
            if (why := unsupported(cfg, ts.device, ts.cache_rows)) is None:
                self.auto = AutoSwitch(ts.gba.straggler_ratio, ts.gba.switch_after_s)
            else:
                log.warning("dist_mode auto stays in sync: %s", why)
        self._file_mode = FileMode(settings.project) if self.rank == 0 else None
        self.speed = Speed(ts.batch_size)
        self._t0 = time.monotonic()
        # gba / async: the agreement in flight (its own gloo group, built in _restore) and what this
        # rank stepped since its last contribution (trainer.dist.rounds)
        self._agreement: FreeAgreement | None = None
        self._tally = Tally()
        self._last_data = time.monotonic()
        self.switches: list[dict] = []
        self._retired = {"alltoall_bytes": 0, "comm_s": 0.0, "failed_updates": 0, "overlapped_updates": 0}

    @property
    def partitions(self) -> list[int]:
        return self.input.partitions

    async def _coll(self, fn, *args):
        """Run a collective (or a step) on the collectives' thread, keeping the event loop (the
        consumer's fetches, the producer) running meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # ------------------------------------------------------------------ state
    def _restore(self, epoch: str | None) -> None:
        """Build the model from the latest complete snapshot (any number of ranks wrote it,
        :mod:`trainer.dist.rank_snapshots`) or fresh. Collective (the engine broadcasts rank 0's head, and
        rank 0's broker epoch: every rank follows the same)."""
        torch.set_num_threads(1)
        agreed = [epoch]
        dist.broadcast_object_list(agreed, 0)
        # the group of gba's agreements in flight (trainer.dist.rounds): built by every rank here,
        # in the same order as every collective, whatever mode the group later switches to
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.ts.collective_timeout_s))
        self._agreement = FreeAgreement(group, self.world)
        self.epoch = agreed[0]
        if self.resets.watch is not None:
            self.resets.watch.epoch = self.epoch
        got = rank_snapshots.newest_every_rank_reads(self.root, self.cfg, self.topic, self.rank, self.world, self.epoch)
        self.dm = self._model("sync" if self.ts.dist_mode == "auto" else self.ts.dist_mode,
                              got.tables if got is not None else None)
        # this rank's shard of the tables: admissions and TTL evictions counted per rank (the shards
        # are disjoint, so the dashboards' sums over instances are the model's); its device copies
        # and owner cache labelled with its rank
        self.learned.ps_counts = M.PSCounts(self.cfg.model_id, self.dm.tables,
                                            self.dm if isinstance(self.dm, DistributedModel) else None, self.rank)
        if got is None:
            return
        man = got.manifest
        self.dm.head.load_state_dict(got.dense["head"])
        if "optimizer" in got.dense and self.dm.optimizer is not None:  # gba: rank 0's master alone
            load_dense_optimizer(self.dm.optimizer, got.dense["optimizer"], self.dm.head)
        if "meta" in got.dense and self.cfg.meta is not None:  # (sync: a DistributedModel)
            self.dm.model.meta.load_state_dict(got.dense["meta"])
        self._from_start = got.reset
        self._restore_stream(man, reset=got.reset, offsets=got.offsets, examples_applied=got.examples_applied,
                             dedup_state=got.dedup, auc=got.auc, sample_rates=got.sample_rates, scores=got.scores,
                             sparse_version=got.sparse_version)
        log.info("rank %d/%d restored snapshot %s (%d ranks wrote it%s): %d examples applied here",
                 self.rank, self.world, man.name, man.shards or 1,
                 ", in another broker epoch: reading from the start" if got.reset else "", self.examples_applied)

    def _model(self, mode: str, tables: dict | None) -> DistributedModel | GBAModel:
        """The engine of ``mode`` on ``tables`` (this rank's shard; None: fresh). Collective."""
        ts = self.ts
        if mode in GBA_MODES:  # GBA's steps are not collective; the rounds' agreement still is
            return GBAModel(self.cfg, mode=mode, global_batch=ts.gba.global_batch or self.world * ts.batch_size,
                            max_staleness=ts.gba.max_staleness, fresh_wait=ts.gba.fresh_wait, tables=tables)
        return DistributedModel(self.cfg, mode=mode, staleness=ts.staleness, tables=tables, device=ts.device,
                                cache_rows=ts.cache_rows, cache_admit_after=ts.cache_admit_after)

    async def snapshot(self) -> Path | None:
        """Collective: every rank writes its part, rank 0 commits the set (the manifest last)."""
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        await self._coll(self.dm.flush)  # hybrid: the shards then hold every round applied
        seq = [snapshots.next_seq(self.root) if self.rank == 0 else 0]
        await self._coll(dist.broadcast_object_list, seq, 0)
        seq = int(seq[0])
        tables = self.dm.tables
        part = rank_snapshots.rank_part(self.applied_offsets, self.dedup.state(), self.auc, self.sample_rates,
                                     self.examples_applied, self.learned.scores_state())
        await loop.run_in_executor(None, snapshots.save_rank, self.root, seq, self.rank, tables, part)
        mine = rank_snapshots.summary(part, self.publisher.sparse_version, self.publisher.param_deltas_offset, tables)
        parts: list = [None] * self.world
        await self._coll(dist.all_gather_object, parts, mine)  # also the barrier: every part is written
        path = None
        if self.rank == 0:
            man, rows = rank_snapshots.manifest_of(parts, self._stream_manifest(), half_life=self.ts.sample_rate_half_life)
            dense = {"head": self.dm.head.state_dict(), "optimizer": self.dm.optimizer.state_dict()}
            if self.cfg.meta is not None:  # the starting point, equal on every rank (trainer.dist.meta)
                dense["meta"] = self.dm.model.meta.state_dict()
            path = await loop.run_in_executor(
                None, lambda: snapshots.commit_ranks(self.root, self.cfg, seq, self.world, dense, man, rows))
            self.store.record_epoch(self.epoch)
            M.SNAPSHOTS.labels(self.cfg.model_id).inc()
        self._stage("snapshot", time.perf_counter() - t0)
        return path

    # ------------------------------------------------------------------ sync
    async def sync_sparse(self) -> None:
        """Collective in ``hybrid`` (the deferred sparse updates are applied first: every rank
        publishes rows that hold every round it counts as applied)."""
        await self._coll(self.dm.flush)
        if self._claim != ALONE:  # (another trainer shares the stream, or not known yet: the rows stay touched)
            return
        # the group learned since the last sync: every shard makes a version, rows or not (a rank
        # may own none: sequential_embeddings), so serving's per-shard versions all move
        await self.publisher.sync_sparse(self.dm.tables, self.max_event_time, confirm=self._learned_since_sync)
        self._learned_since_sync = False

    async def sync_dense(self) -> None:
        """Collective (the ranks' sample-rate sums are gathered); rank 0 publishes (only while the
        set is the only trainer, as :meth:`sync_sparse`)."""
        states: list = [None] * self.world
        await self._coll(dist.all_gather_object, states, self.sample_rates.state())
        if self.rank == 0 and self._claim == ALONE:
            rates = rank_snapshots.merged_rates(states, self.ts.sample_rate_half_life).rates()
            await self.publisher.sync_dense(self.dm.head, self.max_event_time, rates)
            M.dense_input(self.cfg.model_id, self.cfg.dense_features, self.dm.head)

    # ------------------------------------------------------------------ a round
    def _step(self, batch: SparseBatch) -> tuple[StepResult, float]:
        """The round's step, then ``debug_slow_rank``'s sleep: ``(result, seconds of both)``; the
        rank's work (the step less its waits for others, plus the sleep) goes into its speed for the
        next agreements (:class:`trainer.dist.mode_switch.Speed`)."""
        t0 = time.perf_counter()
        steps = self.dm.steps
        if isinstance(self.dm, GBAModel):  # a GBA step fails on its own rank alone: bisected there
            res = train_isolating(self.dm.step, batch)
        else:
            res = train_isolating_ranks(self.dm, batch)
        work = max(0.0, time.perf_counter() - t0 - float(sum(self.dm.comm_s[steps:])))
        if batch.size:
            self.speed.stepped(batch.size, work + self.straggler.after(work))
        return res, time.perf_counter() - t0

    def _vector(self, stop: bool, idle: bool, reset: bool, examples: int, event: int, work_us: int,
                now: float) -> torch.Tensor:
        """This rank's control vector (:mod:`trainer.dist.rounds`); rank 0's clock decides the
        time-based syncs (and auto's timer) for everyone."""
        due = self._syncs_due(now) if self.rank == 0 else None
        return control_vector(stop=stop, idle=idle, reset=reset, examples=examples, event=event,
                              orphan=os.getppid() != self._parent, work_us=work_us, due=due,
                              clock_us=int(1e6 * (now - self._t0)), claim=self._claim_state())

    async def _agree(self, stop: bool, idle: bool, reset: bool, examples: int, event: int, now: float) -> np.ndarray:
        """The round's control vectors of every rank ``[world, COLUMNS]`` (one all_gather, lockstep)."""
        t0 = time.perf_counter()
        # what a gba round stepped after its last free agreement (a switch to sync since) counts here
        left, left_event = self._tally.take()
        mine = self._vector(stop, idle, reset, examples + left, max(event, left_event), self.speed.us, now)
        out = [torch.zeros_like(mine) for _ in range(self.world)]
        await self._coll(dist.all_gather, out, mine)
        self._stage("agree", time.perf_counter() - t0)
        return torch.stack(out).numpy()

    # ------------------------------------------------------------------ main loop
    async def _restore_at_start(self, epoch: str | None) -> None:
        await self._coll(self._restore, epoch)  # collective; after it rank 0's topics exist too

    def _consumer(self) -> TypedConsumer:
        """Manually assigned (:mod:`trainer.dist.input`): no group join, no rebalances."""
        return TypedConsumer(self.settings, "trainer", Example, [], self.ts.group_id, dead_letter_producer=self._producer)

    async def _start_input(self) -> None:
        await self.consumer.start()
        self.applied_offsets = await self.input.assign(self.applied_offsets, self._from_start)

    async def _teardown(self) -> None:
        await super()._teardown()
        self.dm.close()
        shutdown_rpc()  # a GBAModel switched away from left it up
        self._executor.shutdown(wait=True)

    def _examples_learned(self) -> int:
        return self._queued

    async def _loop(self, stop_when_idle_s: float | None, max_examples: int | None) -> dict:
        started = time.time()
        self._schedule_start(time.monotonic())
        self._learned_since_sync = False
        self._last_data, self._queued = time.monotonic(), 0
        while not await (self._free_round if self._free() else self._lockstep_round)(stop_when_idle_s, max_examples):
            pass
        old = self._retired
        return await self._finish(
            self._began_at or started, {"rank": self.rank, "world": self.world}, failed_steps=self.failed_steps, mode=self.dm.mode,
            dist_mode=self.ts.dist_mode, mode_switches=len(self.switches), switches=self.switches,
            overlapped_updates=old["overlapped_updates"] + self.dm.overlapped_updates,
            failed_updates=old["failed_updates"] + self.dm.failed_updates,
            alltoall_bytes=old["alltoall_bytes"] + self.dm.alltoall_bytes,
            comm_s=old["comm_s"] + float(sum(self.dm.comm_s)), broker_epoch=self.epoch,
            stages=dict(self.stage), regroup=self.regroup, ps_admitted=M.ps_admitted(self.cfg.model_id),
            cache=vars(self.dm.cache.stats) if getattr(self.dm, "cache", None) is not None else None,
            gba=self._gba_summary())

    def _gba_summary(self) -> dict | None:
        """The GBA engine's seconds per phase and fresh waits, the agreements in flight (None in sync)."""
        if not isinstance(self.dm, GBAModel):
            return None
        ag = self._agreement
        return {"timings": {k: round(v, 3) for k, v in self.dm.timings.items()}, "steps": self.dm.steps,
                "waits": self.dm.waits, "waits_timed_out": self.dm.waits_timed_out,
                "agreements": ag.started if ag is not None else 0,
                "agreement_waited_s": round(ag.waited_s, 3) if ag is not None else 0.0}

    # ------------------------------------------------------------------ the rounds
    def _free(self) -> bool:
        """gba / async with another rank: rounds that do not wait (:mod:`trainer.dist.rounds`)."""
        return isinstance(self.dm, GBAModel) and self.world > 1

    async def _poll(self, stop_when_idle_s: float | None):
        """One round's input: ``(prepared or None, now, idle)``; none while the set is not the only
        trainer (the last agreed claim): a batch's time spent waiting, not idle."""
        if self._claim != ALONE:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop_event.wait(), self.ts.batch_timeout_s)
            self._last_data = time.monotonic()
            return None, self._last_data, False
        recs, decoded, polled_at = await self.input.poll_round(self.stop_event)
        now = time.monotonic()
        p = await self.ingest.prepare(recs, polled_at, decoded) if recs else None
        if recs:
            self._last_data = now
        idle = stop_when_idle_s is not None and not recs and now - self._last_data >= stop_when_idle_s
        return p, now, idle

    async def _train(self, batch: SparseBatch) -> StepResult:
        """The step on the collectives' thread, its stages and per-rank metrics."""
        steps, sent = self.dm.steps, self.dm.alltoall_bytes
        res, dt = await self._coll(self._step, batch)
        self._stage("train", dt)
        if self.dm.steps > steps:  # seconds in collectives (an all-idle step has none; a retry several)
            comm = float(sum(self.dm.comm_s[steps:]))
            self._stage("comm", comm)
            M.rank_steps(self.cfg.model_id, self.rank, self.dm.steps - steps, comm, self.dm.alltoall_bytes - sent)
        self.learned.rate(time.monotonic())
        return res

    async def _lockstep_round(self, stop_when_idle_s: float | None, max_examples: int | None) -> bool:
        """sync / hybrid: poll, agree (blocking), step (collective), act. Whether to stop."""
        p, now, idle = await self._poll(stop_when_idle_s)
        reset = await self.resets.check_when_due(now)
        batch = p.batch if p is not None and p.batch is not None else None
        ctl = await self._agree(self.stop_event.is_set(), idle, reset, batch.size if batch is not None else 0,
                                batch.max_event_time if batch is not None else 0, now)
        if ctl[:, RESET].any():  # every rank: this round's records belong to no epoch we read on
            await self._handle_reset()
            self._last_data = time.monotonic()
            return False
        res = await self._train(batch if batch is not None else empty_batch(self.cfg))
        if p is not None:
            await self._book(p, res)
        self._account(ctl)
        return await self._act(ctl, now, max_examples)

    async def _free_round(self, stop_when_idle_s: float | None, max_examples: int | None) -> bool:
        """gba / async (:mod:`trainer.dist.rounds`): poll and step without waiting for the other
        ranks; act on the agreement in flight once every rank contributed, then start the next
        one with what this rank stepped since. Whether to stop."""
        ag = self._agreement
        assert ag is not None
        # a rank that saw a reset steps (and polls) nothing more until the group handles it
        reset = await self.resets.check_when_due(time.monotonic())
        p, now, idle = (None, time.monotonic(), False) if reset else await self._poll(stop_when_idle_s)
        batch = p.batch if p is not None and p.batch is not None else None
        ctl = ag.ready()
        if ctl is None and batch is None and ag.pending:  # nothing to step: wait for the others a while
            ctl = await ag.wait(self.ts.batch_timeout_s)
        if ctl is not None:
            self._account(ctl)
            if ctl[:, RESET].any():  # the batch in hand is dropped (read again from the new start)
                await self._handle_reset()
                self._last_data = time.monotonic()
                return False
        res = None
        if batch is not None:
            res = await self._train(batch)
            self._tally.add(batch.size, batch.max_event_time)
        if p is not None:
            await self._book(p, res)
        if ctl is not None and await self._act(ctl, now, max_examples):
            return True
        if not ag.pending and self._free():  # (a switch to sync since: the lockstep agreement takes over)
            examples, event = self._tally.take()
            ag.start(self._vector(self.stop_event.is_set(), idle, reset, examples, event, self.speed.us, time.monotonic()))
        return False

    def _account(self, ctl: np.ndarray) -> None:
        """The agreed examples (stepped, or about to be in lockstep) and max event time."""
        self._claim = int(ctl[0, CLAIM])
        self._queued += int(ctl[:, EXAMPLES].sum())
        self._learned_since_sync |= bool(ctl[:, EXAMPLES].any())
        self.max_event_time = max(self.max_event_time, int(ctl[:, EVENT].max()))

    async def _act(self, ctl: np.ndarray, now: float, max_examples: int | None) -> bool:
        """What the agreement decided, taken by every rank alike (syncs, a snapshot, a switch);
        whether to stop."""
        if self._began_at is None and self._claim == ALONE:  # (before the first batch: polled after this agreement)
            self._began_at = time.time()
            await self._begin()
        await self._sync(now, bool(ctl[0, SYNC]), bool(ctl[0, DENSE]))  # rank 0's decisions, for all
        if self.clock.due(self.max_event_time):  # the same global event time on every rank
            await self.sync_sparse()
            self.clock.taken(self.max_event_time)
            await self.snapshot()
            await self._file_mode_changed()
        # a round where no rank stepped tells nothing new (the ranks' speeds are the last round's)
        if self.auto is not None and ctl[:, EXAMPLES].any() and \
                (to := self.auto.observe(ctl[0, CLOCK] / 1e6, self.dm.mode, ctl[:, WORK])):
            await self._switch(to, f"a rank's work over {self.ts.gba.straggler_ratio} x the others' median"
                               if to == "gba" else "no straggler")
        if ctl[:, ORPHAN].any():
            self._launchers_lost(ctl[:, ORPHAN])
            return True
        return bool(ctl[:, STOP].any() or ctl[:, IDLE].all()
                    or (max_examples is not None and self._queued >= max_examples))

    # ------------------------------------------------------------------ switching modes
    async def _file_mode_changed(self) -> None:
        """After a snapshot: rank 0 re-reads the project file's ``dist_mode`` and the group follows
        it when it changed (:mod:`trainer.dist.mode_switch`). Collective (one broadcast)."""
        got = [self._file_mode.changed() if self._file_mode is not None else None]
        await self._coll(dist.broadcast_object_list, got, 0)
        to = got[0]
        if to is None or to not in ("sync", "hybrid", "gba", "async", "auto"):
            if to is not None and self.rank == 0:
                log.warning("the project file's dist_mode %r is not a mode: kept %s", to, self.dm.mode)
            return
        if to == "auto":  # from here on auto decides (from the current mode)
            self.auto = AutoSwitch(self.ts.gba.straggler_ratio, self.ts.gba.switch_after_s)
            return
        if to in GBA_MODES and (why := unsupported(self.cfg, self.ts.device, self.ts.cache_rows)) is not None:
            if self.rank == 0:
                log.warning("the project file's dist_mode %s is not possible here (%s): kept %s", to, why, self.dm.mode)
            return
        self.auto = None
        if to != self.dm.mode:
            await self._switch(to, "the project file's dist_mode changed")

    async def _switch(self, to: str, why: str) -> None:
        """Collective, every rank in the same round: the current engine applies everything it
        holds (hybrid's deferred updates, GBA's buffers: every example counted is in the tables),
        and the engine of ``to`` is built on the same tables (rows and PS optimizer state, in
        memory) with rank 0's head and Adam state (in GBA only its master's are current); learning
        rates and batch sizes are the settings', unchanged. RPC, once up, stays up."""
        t0 = time.perf_counter()
        old = self.dm
        await self._coll(old.flush)
        for k in self._retired:
            self._retired[k] += float(sum(old.comm_s)) if k == "comm_s" else getattr(old, k)
        await self._coll(self._handover, old, to)
        self.speed.reset()
        self.switches.append({"to": to, "at_s": round(time.monotonic() - self._t0, 3), "why": why})
        if self.rank == 0:
            M.DIST_MODE_SWITCHES.labels(self.cfg.model_id, to).inc()
        log.info("rank %d/%d: dist_mode %s -> %s (%s), switch %d, %.2f s", self.rank, self.world, old.mode, to, why,
                 len(self.switches), time.perf_counter() - t0)

    def _handover(self, old: DistributedModel | GBAModel, to: str) -> None:
        """:meth:`_switch`'s collectives, on the collectives' thread."""
        dense = [copy.deepcopy({"head": old.head.state_dict(), "optimizer": old.optimizer.state_dict()})
                 if self.rank == 0 else None]
        dist.broadcast_object_list(dense, 0)
        if isinstance(old, GBAModel):
            old.close(keep_rpc=True)
        else:
            old.close()
        self.dm = self._model(to, old.tables)
        self.dm.head.load_state_dict(dense[0]["head"])
        if self.dm.optimizer is not None:  # gba: rank 0's master alone
            load_dense_optimizer(self.dm.optimizer, dense[0]["optimizer"], self.dm.head)

    async def _write_snapshot(self) -> None:
        await self.snapshot()

    def _launchers_lost(self, orphans: np.ndarray) -> None:
        """Some ranks' launcher is gone (kill -9 of it, or of the machine's agent): nobody would
        restart them, so the group stops after a last snapshot, together. When every launcher is
        gone (one machine; ``driftline up``'s supervisor starts a new one) that is a clean stop.
        When only some are, the ranks whose launcher lives exit with :data:`EXIT_REGROUP` so their
        launchers restart them and wait in the rendezvous for the lost ones; a clean exit would
        end the job on every machine."""
        lost = np.flatnonzero(orphans).tolist()
        self.regroup = not orphans.all() and not orphans[self.rank]
        log.warning("rank %d: the launcher of rank(s) %s is gone: stopping the group after a last snapshot%s",
                    self.rank, lost, " (exit %d: this launcher restarts us)" % EXIT_REGROUP if self.regroup else "")

    async def _reset_epoch(self) -> str | None:
        """Collective, every rank in the same round: the new epoch any rank saw (the module docstring;
        what is lost and why: :meth:`trainer.loop.TrainerLoop._handle_reset`)."""
        epochs: list = [None] * self.world
        await self._coll(dist.all_gather_object, epochs, self.resets.new_epoch)
        epoch = next(e for e in epochs if e is not None)  # ranks racing to write it read the first
        if self.resets.watch is not None:
            self.resets.watch.epoch = epoch
        return epoch

    def _reset_where(self) -> str:
        return f"{self.topic}[{self.partitions}]"

    async def _barrier(self) -> None:
        await self._coll(dist.barrier)

    async def _reset_input(self) -> None:
        self.applied_offsets = await self.input.assign({}, from_start=True)
        # nothing of this rank's is on the new param-deltas: serving resumes at most from its start
        self.publisher.param_deltas_offset = 0
