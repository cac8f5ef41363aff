"""Online training from the ``examples`` topic (Monolith's streaming trainer).

Fetching: by default a loader subprocess (:mod:`trainer.loader`, ``TrainerSettings.loader``)
fetches the records and ships each batch's raw bytes; this process keeps the consumer group member
(membership, the rebalance listener, commits; its partitions paused, it never fetches) and drops
batches of a superseded assignment (generation). ``loader="inline"``: this process' consumer fetches.

Loop: poll -> decode + validate (bad -> dead letters, with the record's original bytes) -> dedup by
example_id (bounded window) -> assemble the batch -> score it with the current model and update the
streaming AUC (progressive validation) -> train on it -> commit its offsets. Training runs on one
dedicated thread (1 torch intra-op thread; torch ops and the PS kernels release the GIL) while the
event loop fetches, decodes and assembles the next batch. At most two batches are in flight (one
training, the next queued on the training thread), and a batch's offsets are committed after it is
applied, in order (in the background, one commit in flight, each taking the newest offsets). Decoding builds no protobuf objects:
the consumer hands over each record's bytes and :mod:`trainer.wire` parses a whole poll's bytes
into the batch arrays in one numba call with the GIL released (~1-3 us/example; refused records
alone are re-decoded with protobuf, for the dead letter's exact reason). Every ``sync_interval_s``
the touched sparse rows are published to ``param-deltas`` as one version (several chunks); every
``dense_sync_interval_s`` the dense params.
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
* duplicates from the joiner (at-least-once) are dropped within ``dedup_window`` example ids
  (compared as 128-bit hashes), and the window is saved in the snapshot so it survives restarts. The window learns a batch's ids
  only once the batch is applied, so a snapshot never marks as seen an example it did not train on.
Without a snapshot the group's committed offsets are used (a fresh model starting from there).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from aiokafka import ConsumerRebalanceListener, TopicPartition

from proto import Example
from services import metrics as service_metrics
from services import tansu_quirks
from services.codecs import MalformedMessage, codec_for
from services.kafka import TypedConsumer, create_topics, producer, start_client
from services.settings import Settings

from . import metrics as M
from . import loader as loader_mod
from . import snapshots, wire
from .batch import SparseBatch
from .config import ModelConfig
from .model import SparseModel
from .sync import encode_dense, encode_sparse_tables

log = logging.getLogger(__name__)
_NO_HASHES = np.zeros((0, 2), np.uint64)


_RAW, _PART, _OFF, _STAMP = (attrgetter(a) for a in ("raw", "partition", "offset", "timestamp_ms"))


def _positions(recs) -> tuple[dict[int, int], np.ndarray]:
    """``({partition: next offset}, int64 Kafka timestamps with -1 where none)`` of a poll's records.

    The event loop fetches and decodes the next batch while the current one trains, and whatever
    Python it runs per record delays both (GIL, the other core): C-level ``map``s instead of a
    Python loop over the ~1000 records."""
    n = len(recs)
    parts = np.fromiter(map(_PART, recs), np.int64, n)
    offs = np.fromiter(map(_OFF, recs), np.int64, n)
    try:
        stamps = np.fromiter(map(_STAMP, recs), np.int64, n)
    except TypeError:  # a record without a timestamp (None)
        stamps = np.array([-1 if t is None else t for t in map(_STAMP, recs)], np.int64)
    if n and (parts == parts[0]).all():
        return {int(parts[0]): int(offs.max()) + 1}, stamps
    return {int(p): int(offs[parts == p].max()) + 1 for p in np.unique(parts)}, stamps


class RawExampleCodec:
    """The trainer consumer's codec: record values stay bytes (``Record.value is Record.raw``).
    A poll's records are decoded together by :class:`trainer.wire.ExampleDecoder`; only a null
    value is refused here (the consumer dead-letters it, as the protobuf codec did)."""

    message_type = Example
    name = "Example"

    def encode(self, message: Example) -> bytes:
        return message.SerializeToString()

    def decode(self, raw: bytes | None) -> bytes:
        if raw is None:
            raise MalformedMessage("undecodable", "Example value is null")
        return raw


def check_example(ex: Example, known_slots: set[str], label: str, dense_features: list[str]) -> tuple[str, str] | None:
    """The trainer's own checks of an Example the codec accepted (``kind, detail`` or None)."""
    sparse = ex.features.sparse
    if not known_slots.issuperset(sparse.keys()):
        return "unknown_slot", str(sorted(set(sparse.keys()) - known_slots))
    if label not in ex.labels or not math.isfinite(ex.labels[label]):
        return "bad_label", f"{label!r} missing or not finite"
    dense = ex.features.dense
    if len(dense) != len(dense_features) or any(k not in dense for k in dense_features):
        return "wrong_dim", f"dense features {sorted(dense)} != {dense_features}"
    if any(not math.isfinite(v) for v in dense.values()):
        return "nan_value", "non-finite dense feature"
    return None


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
            elif tp.topic == self.t.topic and tp.partition not in self.t.applied_offsets:
                self.t.unknown_start.add(tp.partition)
        self.t.ready.set()


class _Assign(ConsumerRebalanceListener):
    """The group member's listener when a loader process fetches (``loader="process"``): the member
    never fetches (its partitions are paused); every assignment goes to the loader as a new
    generation, with each partition's start (see :meth:`OnlineTrainer._send_assignment`)."""

    def __init__(self, trainer: "OnlineTrainer"):
        self.t = trainer

    async def on_partitions_revoked(self, revoked):
        self.t._new_generation(set())

    async def on_partitions_assigned(self, assigned):
        self.t.consumer.consumer.pause(*assigned)
        self.t._new_generation({tp.partition for tp in assigned if tp.topic == self.t.topic})
        self.t.ready.set()


@dataclass
class Prepared:
    """One polled batch after validation and dedup: what to train on and what to commit."""

    batch: SparseBatch | None
    offsets: dict[int, int]  # partition -> next offset (records of this poll)
    hashes: np.ndarray  # uint64 [n, 2] example id hashes, entered into the dedup window once applied
    arrival_ms: np.ndarray | None = None  # int64 [batch.size]: when each example reached the topic


class OnlineTrainer:
    """Every knob defaults to ``settings.trainer`` (:class:`services.settings.TrainerSettings`)."""

    def __init__(self, settings: Settings, cfg: ModelConfig, *, sync_interval_s: float | None = None,
                 dense_sync_interval_s: float | None = None, snapshot_interval_event_s: float | None = None,
                 batch_size: int | None = None, batch_timeout_s: float | None = None,
                 dedup_window: int | None = None, snapshot_root: Path | None = None, group_id: str | None = None,
                 torch_threads: int = 1, loader: str | None = None):
        ts = settings.trainer
        self.settings, self.cfg = settings, cfg
        self.topic = settings.topics.examples
        self.sync_interval_s = ts.sync_interval_s if sync_interval_s is None else sync_interval_s
        self.dense_sync_interval_s = ts.dense_sync_interval_s if dense_sync_interval_s is None else dense_sync_interval_s
        self.snapshot_interval_ms = int(1000 * (ts.snapshot_interval_event_s if snapshot_interval_event_s is None
                                                else snapshot_interval_event_s))
        self.batch_size = batch_size or ts.batch_size
        self.batch_timeout_s = ts.batch_timeout_s if batch_timeout_s is None else batch_timeout_s
        root = snapshot_root or ts.snapshot_dir or settings.var_dir / "snapshots"
        self.snapshot_root = Path(root) / cfg.model_id
        self.group_id = group_id or ts.group_id
        self.consumer_start_timeout_s = ts.consumer_start_timeout_s
        #: "process": a loader subprocess fetches (:mod:`trainer.loader`); "inline": this process
        self.loader = ts.loader if loader is None else loader
        if self.loader not in ("process", "inline"):
            raise ValueError(f"loader must be 'process' or 'inline', not {self.loader!r}")
        self._loader: loader_mod.LoaderClient | None = None
        self.generation = 0  # of the partitions assigned (loader="process")
        # partition -> next offset after the records taken into batches this run (loader="process"):
        # where a partition kept across a rebalance continues
        self._fetched: dict[int, int] = {}
        self._assign_task: asyncio.Task | None = None
        # torch intra-op threads of the training thread. 1 by default: the other core decodes and
        # assembles the next batch; 2 torch threads plus the decoding thread oversubscribe two
        # cores, and OpenMP's barriers then wait on descheduled threads (10x slower steps measured).
        self.torch_threads = torch_threads
        self.model = SparseModel(cfg)
        self.ps_counts = M.PSCounts(cfg.model_id, self.model.tables)
        self.auc = M.StreamingAUC()
        self.dedup = wire.DedupWindow(ts.dedup_window if dedup_window is None else dedup_window)
        self.known_slots = set(cfg.all_slots)
        self.resume_offsets: dict[int, int] = {}
        self.applied_offsets: dict[int, int] = {}
        # assigned partitions whose start position is not known yet (see _note_starts)
        self.unknown_start: set[int] = set()
        self.sparse_version = 0
        self.dense_version = 0
        self.param_deltas_offset = 0
        self.examples_applied = 0
        self.max_event_time = 0
        self.next_snapshot_at: int | None = None
        self.stop_event = asyncio.Event()
        self.ready = asyncio.Event()  # set once the group join assigned partitions
        self.bad = 0
        self.duplicates = 0
        #: recent sync delays (s): arrival -> published (:data:`M.SYNC_DELAY`) and event time ->
        #: published (:data:`M.EVENT_FRESHNESS`), a sample of each sync's examples
        self.delays: deque[float] = deque(maxlen=100_000)
        self.event_delays: deque[float] = deque(maxlen=100_000)
        # (event times, arrival times) in ms of the examples applied since the last sparse sync
        self._unsynced_times: list[tuple[np.ndarray, np.ndarray]] = []
        self.loss_ema = float("nan")
        self.stage = {k: 0.0 for k in ("poll", "prepare", "train", "wait_train", "commit", "sync", "snapshot")}
        self.last_sync_tables: dict[str, tuple] | None = None
        self.keep_last_sync_copy = False
        self.first_batch_at: float | None = None
        self.last_batch_at: float | None = None
        self._last_sync = self._last_dense = 0.0  # monotonic times of the last sparse / dense sync
        # batches handed to the training thread, oldest first: (task following it, its id hashes)
        self._pending: deque[tuple[asyncio.Task, np.ndarray]] = deque()
        self._commit_task: asyncio.Task | None = None
        self._commit_wanted = False
        #: 2: the next batch waits on the training thread's queue while the current one trains, so
        #: the thread goes from one step to the next without waiting for the event loop
        self.max_in_flight = 2
        self.decoder = wire.ExampleDecoder(cfg.all_slots, cfg.label, cfg.dense_features)
        self._codec = codec_for(Example)
        self._executor: ThreadPoolExecutor | None = None
        self._rate_mark = (time.monotonic(), 0)

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
        self.ps_counts = M.PSCounts(self.cfg.model_id, self.model.tables)
        self.model.head.load_state_dict(dense["head"])
        if "optimizer" in dense:
            self.model.optimizer.load_state_dict(dense["optimizer"])
        # A `trainer batch --snapshot` warm start has no stream state: no offsets (the group's
        # committed ones, or the earliest, apply), no streaming AUC (the online AUC starts from the
        # stream, not from the batch's training passes) and no dedup window.
        same_topic = man.get("topic", self.topic) == self.topic
        self.resume_offsets = {int(k): int(v) for k, v in man.get("offsets", {}).items()} if same_topic else {}
        self.applied_offsets = dict(self.resume_offsets)
        self.sparse_version = int(man.get("sparse_version", 0))
        self.dense_version = int(man.get("dense_version", 0))
        self.param_deltas_offset = int(man.get("param_deltas_offset", 0) or 0)
        self.examples_applied = int(man.get("examples_applied", 0))
        self.max_event_time = int(man.get("max_event_time_ms", 0))
        self.next_snapshot_at = man.get("next_snapshot_at")
        if self.max_event_time:
            M.EVENT_TIME.labels(self.cfg.model_id).set(self.max_event_time)
        if "auc_pos" in dense and "auc_neg" in dense:
            self.auc.load(dense["auc_pos"], dense["auc_neg"])
        self.dedup.load(dense.get("dedup", []))
        log.info("restored snapshot %s (%s): %d examples applied, offsets %s", man["name"],
                 man.get("source", "online"), self.examples_applied, self.resume_offsets)
        return True

    def snapshot(self) -> Path:
        """Write a snapshot (call with no batch in flight: see :meth:`_drain`)."""
        t0 = time.perf_counter()
        dense = {"head": self.model.head.state_dict(), "optimizer": self.model.optimizer.state_dict(),
                 "auc_pos": self.auc.pos, "auc_neg": self.auc.neg, "dedup": self.dedup.state()}
        man = {"offsets": {str(k): v for k, v in self.applied_offsets.items()}, "topic": self.topic,
               "sparse_version": self.sparse_version, "dense_version": self.dense_version,
               "param_deltas_offset": self.param_deltas_offset, "examples_applied": self.examples_applied,
               "max_event_time_ms": self.max_event_time, "next_snapshot_at": self.next_snapshot_at,
               "auc": self.auc.value(), "source": "online"}
        path = snapshots.save(self.snapshot_root, self.cfg, self.model.tables, dense, man)
        M.SNAPSHOTS.labels(self.cfg.model_id).inc()
        self._stage("snapshot", time.perf_counter() - t0)
        return path

    def _stage(self, name: str, seconds: float) -> None:
        self.stage[name] += seconds
        M.STAGE_SECONDS.labels(self.cfg.model_id, name).inc(seconds)

    # ------------------------------------------------------------------ sync
    async def sync_sparse(self) -> int:
        """Publish the touched rows as one version (call with no batch in flight)."""
        t0 = time.perf_counter()
        msgs = encode_sparse_tables(self.cfg.model_id, self.sparse_version + 1, self.model.tables,
                                    max_event_time_ms=self.max_event_time)
        if self.keep_last_sync_copy:
            self.last_sync_tables = {n: t.items() for n, t in self.model.tables.items()}
        if not msgs:
            self._unsynced_times = []  # their updates changed no row (e.g. ids not admitted yet)
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
        if self._unsynced_times:
            self._observe_delays(time.time())
        dt = time.perf_counter() - t0
        M.SYNC_BYTES.labels(self.cfg.model_id, "sparse").observe(nbytes)
        M.SYNC_SECONDS.labels(self.cfg.model_id, "sparse").observe(dt)
        self._stage("sync", dt)
        for n, t in self.model.tables.items():
            M.TABLE_SIZE.labels(self.cfg.model_id, n).set(len(t))
        return nbytes

    def _observe_delays(self, now: float) -> None:
        """Per example applied since the last sync: published ``now`` minus its arrival
        (:data:`M.SYNC_DELAY`) and minus its event time (:data:`M.EVENT_FRESHNESS`)."""
        event = np.concatenate([e for e, _ in self._unsynced_times])
        arrival = np.concatenate([a for _, a in self._unsynced_times])
        self._unsynced_times = []
        for ts, sink, hist in ((arrival, self.delays, M.SYNC_DELAY), (event, self.event_delays, M.EVENT_FRESHNESS)):
            d = np.maximum(now - ts / 1000.0, 0.0)
            sink.extend(d.tolist() if d.size < 10_000 else d[:: d.size // 10_000 + 1].tolist())
            for q in np.percentile(d, [50, 95, 100]):
                hist.labels(self.cfg.model_id).observe(float(q))

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
    async def _reject(self, rec, raw: bytes, kind: str, detail: str):
        """Dead-letter one record (its original bytes) through the consumer's own dead-letter path."""
        self.bad += 1
        M.BAD_EXAMPLES.labels(self.cfg.model_id, kind).inc()
        err = MalformedMessage(kind, detail)
        original = SimpleNamespace(topic=rec.topic, partition=rec.partition, offset=rec.offset, key=rec.key,
                                   value=raw)
        return await self.consumer.dead_letter(original, err)

    def _check(self, ex: Example) -> tuple[str, str] | None:
        """Trainer-specific validation (the codec's checks come first: finiteness, ids, ...)."""
        return check_example(ex, self.known_slots, self.cfg.label, self.cfg.dense_features)

    async def _reject_record(self, rec):
        """Dead-letter a record the decoder refused, with the reason protobuf + the validators give
        (re-decoding only the refused records: the reason text stays exactly what it was)."""
        try:
            ex = self._codec.decode(rec.raw)
        except MalformedMessage as err:  # the codec's own refusal, as the consumer used to send it
            return await self.consumer.dead_letter(rec, err)
        why = self._check(ex)
        if why is None:  # decoder and protobuf disagree: a decoder bug; never drop the record silently
            log.error("fast decoder refused %s[%d]@%d that protobuf accepts", rec.topic, rec.partition, rec.offset)
            why = ("decoder_mismatch", "trainer.wire refused an Example that protobuf accepts")
        return await self._reject(rec, rec.raw, *why)

    async def prepare(self, recs, polled_at_ms: int | None = None) -> Prepared:
        """Decode, validate, dead-letter (durably), dedup and assemble one batch on the event loop.

        One numba pass over the poll's concatenated record bytes (GIL released): see
        :mod:`trainer.wire`. Duplicates of: the applied window, the batch in flight, this batch.
        The window learns a batch's ids only once it is applied, so a snapshot never holds ids it
        has not trained on. An example *arrives* at its record's Kafka timestamp (when the joiner
        produced it), or at ``polled_at_ms`` (the trainer's poll) when the record has none; never
        later than the poll."""
        t0 = time.perf_counter()
        raws = list(map(_RAW, recs))
        starts = np.zeros(len(raws) + 1, np.int64)
        np.cumsum(np.fromiter(map(len, raws), np.int64, len(raws)), out=starts[1:])
        offsets, stamps = _positions(recs)
        return await self._prepare(np.frombuffer(b"".join(raws), np.uint8), starts, offsets, stamps,
                                   recs.__getitem__, polled_at_ms, [], t0)

    async def prepare_shipment(self, sh: loader_mod.Shipment) -> Prepared:
        """:meth:`prepare` of a batch the loader process shipped (raw bytes + record arrays).
        Null values are dead-lettered here, as the inline consumer's codec does."""
        t0 = time.perf_counter()
        service_metrics.MESSAGES_CONSUMED.labels("trainer", self.topic).inc(sh.size)
        for part, lag in sh.lag.items():
            service_metrics.CONSUMER_LAG.labels("trainer", self.topic, str(part)).set(lag)
        lengths, parts, offs = sh.lengths, sh.partitions, sh.offsets
        if sh.size and (parts == parts[0]).all():
            offsets = {int(parts[0]): int(offs.max()) + 1}
        else:
            offsets = {int(p): int(offs[parts == p].max()) + 1 for p in np.unique(parts)}
        for part, off in offsets.items():
            if off > self._fetched.get(part, -1):
                self._fetched[part] = off
        vstarts = np.zeros(sh.size + 1, np.int64)
        np.cumsum(np.maximum(lengths, 0), out=vstarts[1:])
        kstarts = np.zeros(sh.size + 1, np.int64)
        np.cumsum(np.maximum(sh.key_lengths, 0), out=kstarts[1:])

        def record(j: int) -> SimpleNamespace:
            kl = int(sh.key_lengths[j])
            raw = None if lengths[j] < 0 else sh.values[vstarts[j]:vstarts[j + 1]]
            return SimpleNamespace(topic=self.topic, partition=int(parts[j]), offset=int(offs[j]),
                                   key=None if kl < 0 else sh.keys[kstarts[j]:kstarts[j + 1]], value=raw, raw=raw)

        letters = []
        stamps = sh.timestamps
        nulls = lengths < 0
        if nulls.any():
            for j in np.flatnonzero(nulls).tolist():
                letters.append(await self.consumer.dead_letter(
                    record(j), MalformedMessage("undecodable", "Example value is null")))
            sel = np.flatnonzero(~nulls)
            vstarts_sel = np.append(vstarts[sel], vstarts[-1])
            stamps = stamps[sel]
            record_at = (lambda i: record(int(sel[i])))
        else:
            vstarts_sel = vstarts
            record_at = record
        return await self._prepare(np.frombuffer(sh.values, np.uint8), vstarts_sel, offsets, stamps, record_at,
                                   sh.polled_at_ms, letters, t0)

    async def _prepare(self, buf, starts, offsets, stamps, record_at, polled_at_ms, letters, t0) -> Prepared:
        """Decode records ``buf[starts[i]:starts[i + 1]]`` (``record_at(i)``: the record, for a dead
        letter), dedup, assemble; ``offsets``: the next offset per partition of all the records."""
        inflight = (np.concatenate([h for _, h in self._pending]) if len(self._pending) > 1
                    else self._pending[0][1] if self._pending else _NO_HASHES)
        dec = self.decoder.decode_concat(buf, starts, self.dedup, inflight)
        status = dec.status
        if dec.size < status.size:
            for i in np.flatnonzero((status == wire.UNDECODABLE) | (status == wire.REJECT)).tolist():
                letters.append(await self._reject_record(record_at(i)))
            dups = int(np.count_nonzero(status == wire.DUPLICATE))
            if dups:
                self.duplicates += dups
                M.DUPLICATES.labels(self.cfg.model_id).inc(dups)
        batch = arrival = None
        if dec.size:
            ids, offs = dec.slot_arrays(self.cfg.all_slots)
            batch = SparseBatch(dec.size, ids, offs, dec.labels, dec.event_time_ms, dec.sample_rate, dec.dense)
            polled = int(time.time() * 1000) if polled_at_ms is None else polled_at_ms
            arrival = stamps[dec.keep]
            arrival = np.where((arrival > 0) & (arrival < polled), arrival, polled)
        self._stage("prepare", time.perf_counter() - t0)
        if letters:  # dead letters durable before their offsets can be committed
            await asyncio.gather(*letters)
        return Prepared(batch, offsets, dec.hashes, arrival)

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
        ex = Example(example_id="warm-up", event_time_ms=1, sample_rate=1.0, labels={cfg.label: 1.0})
        for s in cfg.all_slots:
            ex.features.sparse[s].ids.append(1)
        for d in cfg.dense_features:
            ex.features.dense[d] = 0.0
        self.decoder.decode([ex.SerializeToString()] * 2, wire.DedupWindow(4), _NO_HASHES)

    def _train(self, batch: SparseBatch):
        """On the training thread."""
        if torch.get_num_threads() != self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        t0 = time.perf_counter()
        loss, probs = self.model.train_step(batch)
        return loss, probs, time.perf_counter() - t0

    async def _apply(self, p: Prepared, step: asyncio.Future | None, prev: asyncio.Task | None) -> None:
        """Wait for a prepared batch's step (on the training thread) and for the batch before it
        (bookkeeping and commits stay in batch order), then commit its offsets."""
        if p.batch is not None:
            # progressive validation: the step's forward pass scores the batch before it is learned
            loss, probs, dt = await step
        if prev is not None:
            await prev
        if p.batch is not None:
            batch = p.batch
            self._stage("train", dt)
            self.auc.update(probs, batch.labels)
            self.examples_applied += batch.size
            self.last_batch_at = time.perf_counter()
            self.max_event_time = max(self.max_event_time, batch.max_event_time)
            M.EVENT_TIME.labels(self.cfg.model_id).set(self.max_event_time)
            self._unsynced_times.append((batch.event_time_ms, p.arrival_ms))
            self.ps_counts.update()
            self.loss_ema = loss if math.isnan(self.loss_ema) else 0.98 * self.loss_ema + 0.02 * loss
            M.EXAMPLES.labels(self.cfg.model_id, "online").inc(batch.size)
            M.LOSS.labels(self.cfg.model_id, "online").set(self.loss_ema)
            M.AUC.labels(self.cfg.model_id, "online").set(self.auc.value())
        self.dedup.add_many(p.hashes)
        for part, off in p.offsets.items():
            if off > self.applied_offsets.get(part, -1):
                self.applied_offsets[part] = off
        self._request_commit()

    def _request_commit(self) -> None:
        """Commit the applied offsets in the background, one commit in flight at a time (the next
        one takes the newest offsets). The broker round trip stays off the path that hands the next
        batch to the training thread: awaited there, it left the thread idle between steps."""
        self._commit_wanted = True
        if self._commit_task is None or self._commit_task.done():
            if self._commit_task is not None:
                self._commit_task.result()  # a failed commit (a rebalance) stops the run, as it did
            self._commit_task = asyncio.create_task(self._committer())

    async def _committer(self) -> None:
        while self._commit_wanted:
            self._commit_wanted = False
            t0 = time.perf_counter()
            await self.consumer.commit({TopicPartition(self.topic, q): o for q, o in self.applied_offsets.items()})
            self._stage("commit", time.perf_counter() - t0)

    async def _flush_commits(self) -> None:
        """Wait until every applied batch's offsets are committed (raises a failed commit)."""
        if self._commit_task is not None:  # it loops while commits were requested meanwhile
            await self._commit_task

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
        if self._commit_task is not None and self._commit_task.done():
            self._commit_task.result()  # a failed commit (a rebalance) stops the run, as it did
        if self.snapshot_interval_ms > 0:
            if self.next_snapshot_at is None:
                self.next_snapshot_at = (self.max_event_time // self.snapshot_interval_ms + 1) * self.snapshot_interval_ms
            elif self.max_event_time >= self.next_snapshot_at:
                while self._pending:
                    await self._pending[0][0]
                    self._pending.popleft()
                await self.sync_sparse()
                self.snapshot()
                self.next_snapshot_at = (self.max_event_time // self.snapshot_interval_ms + 1) * self.snapshot_interval_ms

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

    # ------------------------------------------------------------------ loader process
    def _new_generation(self, partitions: set[int]) -> None:
        """A (re)assignment (an empty set: a revocation): from now on shipments of older
        generations are dropped, and the loader is told where to fetch the new one's partitions."""
        self.generation += 1
        if self._assign_task is not None and not self._assign_task.done():
            self._assign_task.cancel()
        self._assign_task = asyncio.create_task(self._send_assignment(self.generation, partitions))

    async def _send_assignment(self, generation: int, partitions: set[int]) -> None:
        """Each partition's start: after the last record taken into a batch this run (a partition
        kept across a rebalance continues where it was; what the loader had fetched beyond is
        dropped with its generation), else the snapshot's offset, else the group's committed
        offset, else the earliest (None: the loader resolves it and reports it back)."""
        starts: dict[int, int | None] = {}
        for part in sorted(partitions):
            off = self._fetched.get(part, self.resume_offsets.get(part))
            if off is None:
                off = await self.consumer.consumer.committed(TopicPartition(self.topic, part))
            elif part not in self._fetched:
                log.info("resuming %s[%d] at snapshot offset %d", self.topic, part, off)
            starts[part] = off
        if generation == self.generation:
            self._loader.assign(generation, starts)

    def _loader_started(self, generation: int, positions: dict[int, int]) -> None:
        """The loader's start positions: a partition's becomes its applied offset if it has none
        yet, so snapshots name every partition (see :meth:`_note_starts`)."""
        if generation != self.generation:
            return
        for part, off in positions.items():
            self.applied_offsets.setdefault(part, off)

    async def _next_shipment(self, timeout_s: float) -> loader_mod.Shipment | None:
        """The loader's next batch of the current generation (None after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self._assign_task is not None and self._assign_task.done():
                self._assign_task.result()  # a failed committed-offset lookup stops the run
            msg = await self._loader.get(max(0.0, deadline - time.monotonic()))
            if msg is None:
                return None
            if isinstance(msg, tuple):  # ("started", generation, positions)
                self._loader_started(msg[1], msg[2])
            elif msg.generation == self.generation:
                return msg
            else:
                log.info("dropped a batch of %d records fetched for superseded assignment %d (now %d)",
                         msg.size, msg.generation, self.generation)
            if time.monotonic() >= deadline:
                return None

    async def _sync_when_due(self, now: float) -> None:
        """Publish sparse rows every ``sync_interval_s`` and dense weights every ``dense_sync_interval_s``,
        each after the batches in flight are applied (a sync holds only applied updates)."""
        if now - self._last_sync >= self.sync_interval_s:
            self._last_sync = now
            await self._drain()
            await self.sync_sparse()
        if now - self._last_dense >= self.dense_sync_interval_s:
            self._last_dense = now
            await self._drain()
            await self.sync_dense()

    def _update_rate(self, now: float) -> None:
        t, n = self._rate_mark
        if now - t >= 1.0:
            M.EXAMPLES_PER_S.labels(self.cfg.model_id, "online").set((self.examples_applied - n) / (now - t))
            self._rate_mark = (now, self.examples_applied)

    # ------------------------------------------------------------------ main loop
    async def run(self, stop_when_idle_s: float | None = None, max_examples: int | None = None) -> dict:
        s = self.settings
        await create_topics(s, {self.topic: s.topics.partitions, s.topics.param_deltas: 1, s.topics.dead_letters: 1})
        try:
            epoch = await tansu_quirks.ensure_broker_epoch(s)
        except Exception:  # noqa: BLE001 - an external Kafka without the marker topic
            epoch = None
        restored = self.restore(epoch)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="trainer-step")
        self._producer = producer(s)
        await start_client(self._producer, s)
        # a kill -9'd predecessor stays a group member until its session times out, and the join
        # waits for it: allow the consumer start longer than the default connect timeout.
        cs = s.model_copy(deep=True)
        cs.kafka.connect_timeout_s = max(s.kafka.connect_timeout_s, self.consumer_start_timeout_s)
        process = self.loader == "process"
        self.consumer = TypedConsumer(cs, "trainer", Example, [self.topic], self.group_id,
                                      dead_letter_producer=self._producer, codec=RawExampleCodec())
        self.consumer.consumer.subscribe([self.topic], listener=_Assign(self) if process else _Seek(self))
        if process:  # spawned before the join: its start-up overlaps the join's wait
            self._loader = loader_mod.LoaderClient(s, self.topic, self.batch_size, self.batch_timeout_s)
        try:
            warm = asyncio.get_running_loop().run_in_executor(self._executor, self._warm_up)
            await self.consumer.start()
            await warm
            return await (self._run_process if process else self._run_inline)(restored, stop_when_idle_s, max_examples)
        finally:
            if self._loader is not None:
                self._loader.close()
            if self._assign_task is not None and not self._assign_task.done():
                self._assign_task.cancel()

    async def _run_process(self, restored: bool, stop_when_idle_s: float | None, max_examples: int | None) -> dict:
        """The main loop when the loader process fetches: each shipment is one batch."""
        started = time.time()
        self._last_sync = self._last_dense = last_keepalive = time.monotonic()
        last_data = time.monotonic()
        if not restored or self.dense_version == 0:
            await self.sync_dense()
        queued = self.examples_applied
        try:
            while not self.stop_event.is_set():
                now = time.monotonic()
                wait = min(0.1, max(0.0, self._last_sync + self.sync_interval_s - now))
                t0 = time.perf_counter()
                sh = await self._next_shipment(wait)
                self._stage("poll", time.perf_counter() - t0)
                now = time.monotonic()
                if sh is not None:
                    last_data = now
                    prepared = await self.prepare_shipment(sh)
                    await self._drain(self.max_in_flight - 1)
                    self._start(prepared)
                    queued += prepared.batch.size if prepared.batch is not None else 0
                    if max_examples is not None and queued >= max_examples:
                        break
                if now - last_keepalive >= 1.0:
                    # the member's partitions are paused, so this fetches nothing; it tells aiokafka
                    # the consumer is polled (max_poll_interval_ms) and raises its errors
                    last_keepalive = now
                    await self.consumer.consumer.getmany(timeout_ms=0)
                self._update_rate(now)
                await self._sync_when_due(now)
                if stop_when_idle_s is not None and now - last_data >= stop_when_idle_s:
                    break
            return await self._finish(started)
        finally:
            await self._teardown()

    async def _finish(self, started: float) -> dict:
        await self._drain()
        await self.sync_sparse()
        await self.sync_dense()
        self.snapshot()
        await self._flush_commits()
        elapsed = time.time() - started
        return {"examples_applied": self.examples_applied, "auc": self.auc.value(), "loss": self.loss_ema,
                "bad": self.consumer.dead_lettered, "duplicates": self.duplicates, "sparse_version": self.sparse_version,
                "elapsed_s": elapsed, "stages": dict(self.stage, **{f"model_{k}": v for k, v in self.model.timings.items()})}

    async def _teardown(self) -> None:
        for task, _ in self._pending:  # cancelled mid-batch: let the steps finish, commit nothing more
            task.cancel()
        if self._commit_task is not None and not self._commit_task.done():
            self._commit_task.cancel()
        await self.consumer.stop()
        await self._producer.stop()
        self._executor.shutdown(wait=True)

    async def _run_inline(self, restored: bool, stop_when_idle_s: float | None, max_examples: int | None) -> dict:
        """The main loop when this process' consumer fetches (``loader="inline"``)."""
        started = time.time()
        self._last_sync = self._last_dense = time.monotonic()
        last_data = time.monotonic()
        if not restored or self.dense_version == 0:
            await self.sync_dense()
        buf: list = []
        first_at = 0.0
        polled_at_ms = 0  # wall time of the first poll that filled buf
        queued = self.examples_applied
        try:
            while not self.stop_event.is_set():
                now = time.monotonic()
                # wake up in time for the batch timeout and the next sync, not just every 100 ms
                wait = min(0.1, max(0.0, self._last_sync + self.sync_interval_s - now))
                if buf:
                    wait = min(wait, max(0.0, first_at + self.batch_timeout_s - now))
                t0 = time.perf_counter()
                recs = await self.consumer.poll(timeout_ms=int(wait * 1000), max_records=self.batch_size - len(buf))
                self._stage("poll", time.perf_counter() - t0)
                if self.unknown_start:
                    await self._note_starts(recs)
                now = time.monotonic()
                if recs:
                    if not buf:
                        first_at = now
                        polled_at_ms = int(time.time() * 1000)
                    buf.extend(recs)
                    last_data = now
                if buf and (len(buf) >= self.batch_size or now - first_at >= self.batch_timeout_s):
                    prepared = await self.prepare(buf, polled_at_ms)
                    buf = []
                    await self._drain(self.max_in_flight - 1)
                    self._start(prepared)
                    queued += prepared.batch.size if prepared.batch is not None else 0
                    if max_examples is not None and queued >= max_examples:
                        break
                now = time.monotonic()
                self._update_rate(now)
                await self._sync_when_due(now)
                if stop_when_idle_s is not None and not buf and now - last_data >= stop_when_idle_s:
                    break
            if buf:
                prepared = await self.prepare(buf, polled_at_ms)
                await self._drain()
                self._start(prepared)
            return await self._finish(started)
        finally:
            await self._teardown()
