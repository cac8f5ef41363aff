"""Online training from the ``examples`` topic (Monolith's streaming trainer).

Fetching: this process' consumer fetches, on the event loop. (A loader subprocess fetched while
each record carried one example: it hid aiokafka's per-record Python. With ~1000 examples per
record that cost is ~1000x smaller. Measured with ``QUICK=1 bench/bench_trainer.py`` on 2 shared
cores (30 steps, so +-15%), ``online_vs_batch_ratio``: inline 0.80, 0.86, 0.74 and 0.69 with
batches of 2 records (this loop), 0.47 and 0.50 with batches of 1 record; the loader 0.70 with
shipments of 2 records, 0.61, 0.65 and 0.65 with 1 record. Inline at its best beat the loader at
its best, so the loader, its process and its assignment generations were removed.)

Records: one record on ``examples`` is one example batch (:mod:`services.example_batch`: an Arrow
IPC record batch of many examples, ~1000 from the producers' chunks, with an ``id_hash`` column).
A training batch is whole records (a record's offset is committed once all of it is applied):
those polled until they hold ``batch_size`` examples (with records of 1000 and ``batch_size`` 1024:
two records, 2000 examples), or ``batch_timeout_s`` passed.

Loop: poll -> decode each record (``example_batch.decode``: schema and values validated; bad ->
the whole record dead-lettered with its original bytes) -> the trainer's checks per example,
vectorized (:mod:`trainer.ingest`) -> dedup by the shipped ``id_hash`` (:mod:`trainer.dedup`,
bounded window) -> assemble the batch (``example_batch.to_sparse_batch_arrays``: the model's slots,
label and dense features only) -> score it with the current model and update the streaming AUC
(progressive validation) -> train on it -> commit its offsets. Training runs on one dedicated
thread (1 torch intra-op thread; torch ops and the PS kernels release the GIL) while the event
loop fetches, decodes and assembles the next batch. At most two batches are in flight (one
training, the next queued on the training thread), and a batch's offsets are committed after it
is applied, in order (in the background, one commit in flight, each taking the newest offsets).
Decoding builds no protobuf objects and no per-example Python: pyarrow hands numpy views of the
record's buffers. Every ``sync_interval_s`` the touched sparse rows are published to
``param-deltas`` as one version (several chunks); every ``dense_sync_interval_s`` the dense params,
with the negative sample rates the model learned under (:mod:`trainer.sample_rates`, per slice and
global: serving's log-odds correction uses them, not the joiner's setting).
Every ``snapshot_interval_event_s`` of event time (and on a clean stop) a snapshot records tables,
optimizer state, dense params, the next offsets of everything applied, the broker epoch they belong
to, the sync versions, the ``param-deltas`` offset after the last publish, the AUC histograms,
the dedup window and the sample-rate tracker (manifest ``sample_rates``).

Bad records never stop the trainer: a record ``example_batch.decode`` refuses is dead-lettered
whole with its reason (``undecodable``/``invalid``); a record whose decoding *raises* something
else (a bug) whole as ``failed``. An example that decodes but must not be learned
(:func:`trainer.ingest.refusals`: an unknown slot, the label missing or outside [0, 1], the dense
features not the model's, an event time more than ``event_time.max_future_s`` ahead of the wall
clock: it would move the trainer's event-time clock, which schedules snapshots and expires TTL
rows, for good) is dropped and dead-lettered as a batch of the refused examples of its record and
kind (``services.example_batch.take``), and the rest of its record is learned. An example the
training step *fails* on is found by retrying alone (:mod:`trainer.isolate`: a failing step
changes no parameter) and dead-lettered as ``failed`` (a batch of that example) with the error,
while the rest of its batch is trained once. Each is counted (``driftline_dead_letters_total``
per letter, ``driftline_trainer_bad_examples_total`` per example) and its record's offset is
committed past like any other, so a restart never meets it again.

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
  (compared as the shipped 128-bit BLAKE2b ``id_hash``), and the window is saved in the snapshot so
  it survives restarts (a window restored from a snapshot written before example batches holds
  MurmurHash3 hashes: it misses the duplicates of its last window once, see :mod:`trainer.dedup`). The window learns a batch's ids
  only once the batch is applied, so a snapshot never marks as seen an example it did not train on.
Without a snapshot the group's committed offsets are used (a fresh model starting from there).

Broker resets (tansu's memory storage lost with a broker restart; told by
:class:`services.tansu_quirks.EpochWatch`, a check costing ~1 ms, made before every offset commit
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
import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from aiokafka import ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError

from proto import Example
from services import metrics as service_metrics
from services import tansu_quirks
from services.atomic import write_bytes_atomic
from services import example_batch
from services.codecs import MalformedMessage, processing_failed
from services.example_batch import BadExampleBatch
from services.kafka import TypedConsumer, create_topics, producer, start_client
from services.settings import Settings

from . import metrics as M
from . import dedup, ingest, snapshots
from .batch import SparseBatch
from .config import ModelConfig
from .isolate import train_isolating
from .model import SparseModel
from .sample_rates import SampleRateTracker
from .sync import encode_dense, encode_sparse_tables

log = logging.getLogger(__name__)
_EPOCH_MARKER = "broker-epoch"  # tansu_quirks.state_matches_broker's marker file
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
    """The trainer consumer's codec: record values stay bytes (``Record.value is Record.raw``), each
    decoded by :func:`services.example_batch.decode` in the trainer; only a null value is refused
    here (the consumer dead-letters it)."""

    message_type = Example
    name = "ExampleBatch"

    def encode(self, message: bytes) -> bytes:
        return message

    def decode(self, raw: bytes | None) -> bytes:
        if raw is None:
            raise MalformedMessage("undecodable", "Example batch value is null")
        return raw


@dataclass
class _Decoded:
    """Records decoded so far for the next batch: their non-empty example batches with the record
    each came from, and the dead letters of the records refused (sent, awaited before a commit)."""

    parts: list = field(default_factory=list)
    records: list = field(default_factory=list)
    letters: list = field(default_factory=list)
    examples: int = 0


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
class Prepared:
    """One polled batch after validation and dedup: what to train on and what to commit."""

    batch: SparseBatch | None
    offsets: dict[int, int]  # partition -> next offset (records of this poll)
    hashes: np.ndarray  # uint64 [n, 2] example id hashes, entered into the dedup window once applied
    arrival_ms: np.ndarray | None = None  # int64 [batch.size]: when each example reached the topic
    #: batch row -> (its record, the bytes of a batch of that one example): a dead letter's
    letter_of: Callable[[int], tuple[object, bytes]] | None = None


class OnlineTrainer:
    """Every knob is a field of ``settings.trainer`` (:class:`services.settings.TrainerSettings`):
    run one with other values through ``settings.updated(trainer={...})``."""

    def __init__(self, settings: Settings, cfg: ModelConfig, *, torch_threads: int = 1):
        ts = settings.trainer
        self.settings, self.cfg = settings, cfg
        self.topic = settings.topics.examples
        self.sync_interval_s = ts.sync_interval_s
        self.dense_sync_interval_s = ts.dense_sync_interval_s
        self.snapshot_interval_ms = int(1000 * ts.snapshot_interval_event_s)
        self.batch_size = ts.batch_size
        self.batch_timeout_s = ts.batch_timeout_s
        self.snapshot_root = settings.snapshot_root / cfg.model_id
        self.group_id = ts.group_id
        self.consumer_start_timeout_s = ts.consumer_start_timeout_s
        # torch intra-op threads of the training thread. 1 by default: the other core decodes and
        # assembles the next batch; 2 torch threads plus the decoding thread oversubscribe two
        # cores, and OpenMP's barriers then wait on descheduled threads (10x slower steps measured).
        self.torch_threads = torch_threads
        self.model = SparseModel(cfg)
        self.ps_counts = M.PSCounts(cfg.model_id, self.model.tables)
        self.auc = M.StreamingAUC()
        self.dedup = dedup.DedupWindow(ts.dedup_window)
        self.sample_rates = SampleRateTracker(ts.sample_rate_half_life)  # what serving corrects with
        self.known_slots = set(cfg.all_slots)
        self.resume_offsets: dict[int, int] = {}
        self.applied_offsets: dict[int, int] = {}
        #: the broker epoch the offsets belong to (None: an external Kafka without one)
        self.epoch: str | None = None
        self._watch: tansu_quirks.EpochWatch | None = None
        self.epoch_check_interval_s = ts.epoch_check_interval_s
        self._epoch_checked_at = 0.0  # monotonic time of the last check
        self._epoch_lock = asyncio.Lock()  # one check at a time over the watch's connection
        self._reset_epoch: str | None = None  # a reset noticed and not handled yet: its new epoch
        self._reset_at_start = False  # the restored snapshot was written in another broker epoch
        #: a partition without an applied offset starts at its earliest record, not at the group's
        #: committed offset (after a reset: a stale commit may have reached the new broker)
        self._from_start = False
        self._highwater: dict[int, int] = {}  # partition -> last known high watermark
        # (high watermarks, applied offsets) when a check last saw the current epoch
        self._confirmed: tuple[dict[int, int], dict[int, int]] = ({}, {})
        #: examples further ahead of the wall clock are refused (one would move the trainer's
        #: event-time clock: snapshots due by event time, the PS's TTL watermark)
        self.max_future_ms = int(1000 * settings.event_time.max_future_s)
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
        #: record bytes -> :class:`services.example_batch.ExampleColumns` (raises BadExampleBatch)
        self.decode = example_batch.decode
        self._executor: ThreadPoolExecutor | None = None
        self._rate_mark = (time.monotonic(), 0)

    # ------------------------------------------------------------------ state
    def restore(self, epoch: str | None) -> bool:
        """Load the newest snapshot, whatever broker epoch it was written in (its state lives
        outside the broker). Its offsets only count on the broker data they were read from: after a
        broker reset (``epoch`` differs from the snapshot's) every partition is read from its start
        instead, and the dedup window drops the examples the snapshot already learned."""
        self.epoch = epoch
        got = snapshots.load(self.snapshot_root, self.cfg, serving=False)
        if got is None:
            self._record_epoch()
            return False
        tables, dense, man = got
        # snapshots written before manifests named their epoch: the marker beside them
        marker = self.snapshot_root / _EPOCH_MARKER
        snap_epoch = man.get("broker_epoch") or (marker.read_text().strip() if marker.exists() else None)
        self._reset_at_start = epoch is not None and snap_epoch is not None and snap_epoch != epoch
        self.model = SparseModel(self.cfg, tables)
        self.ps_counts = M.PSCounts(self.cfg.model_id, self.model.tables)
        self.model.head.load_state_dict(dense["head"])
        if "optimizer" in dense:
            self.model.optimizer.load_state_dict(dense["optimizer"])
        # A `trainer batch --snapshot` warm start has no stream state: no offsets (the group's
        # committed ones, or the earliest, apply), no streaming AUC (the online AUC starts from the
        # stream, not from the batch's training passes) and no dedup window.
        same_topic = man.get("topic", self.topic) == self.topic
        if self._reset_at_start:
            log.warning("the broker's data was reset since snapshot %s (epoch %s, now %s): keeping its "
                        "state, reading every partition of %s from its start", man["name"], snap_epoch,
                        epoch, self.topic)
            self.resume_offsets, self._from_start = {}, True
        else:
            self.resume_offsets = ({int(k): int(v) for k, v in man.get("offsets", {}).items()} if same_topic
                                   else {})
            self._from_start = bool(man.get("from_start", False))
        self.applied_offsets = dict(self.resume_offsets)
        self._record_epoch()
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
        self.sample_rates.load(man.get("sample_rates", {}))
        log.info("restored snapshot %s (%s): %d examples applied, offsets %s", man["name"],
                 man.get("source", "online"), self.examples_applied, self.resume_offsets)
        return True

    def snapshot(self) -> Path:
        """Write a snapshot (call with no batch in flight: see :meth:`_drain`)."""
        t0 = time.perf_counter()
        dense = {"head": self.model.head.state_dict(), "optimizer": self.model.optimizer.state_dict(),
                 "auc_pos": self.auc.pos, "auc_neg": self.auc.neg, "dedup": self.dedup.state()}
        man = {"offsets": {str(k): v for k, v in self.applied_offsets.items()}, "topic": self.topic,
               "broker_epoch": self.epoch, "from_start": self._from_start,
               "sparse_version": self.sparse_version, "dense_version": self.dense_version,
               "param_deltas_offset": self.param_deltas_offset, "examples_applied": self.examples_applied,
               "max_event_time_ms": self.max_event_time, "next_snapshot_at": self.next_snapshot_at,
               "auc": self.auc.value(), "source": "online", "sample_rates": self.sample_rates.state()}
        path = snapshots.save(self.snapshot_root, self.cfg, self.model.tables, dense, man)
        M.SNAPSHOTS.labels(self.cfg.model_id).inc()
        self._stage("snapshot", time.perf_counter() - t0)
        return path

    def _record_epoch(self) -> None:
        """The broker epoch the trainer's state now follows, beside the snapshots (what ``driftline
        up`` compares with an external broker's before it skips the warm start)."""
        if self.epoch is not None:
            write_bytes_atomic(self.snapshot_root / _EPOCH_MARKER, self.epoch.encode())

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
        records = [(f"{self.cfg.model_id}/{table}".encode(), m.SerializeToString()) for table, m in msgs]
        nbytes = sum(len(v) for _, v in records)
        self.param_deltas_offset = await self._publish(records)
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
                         max_event_time_ms=self.max_event_time, sample_rates=self.sample_rates.rates())
        data = m.SerializeToString()
        self.param_deltas_offset = await self._publish([(f"{self.cfg.model_id}/dense".encode(), data)])
        M.SYNC_BYTES.labels(self.cfg.model_id, "dense").observe(len(data))
        M.SYNC_SECONDS.labels(self.cfg.model_id, "dense").observe(time.perf_counter() - t0)

    async def _publish(self, records: list[tuple[bytes, bytes]]) -> int:
        """Send ``(key, value)`` records to ``param-deltas`` (partition 0, in order); the offset
        after the last. A refused send is retried for up to ``kafka.connect_timeout_s`` (tansu
        refuses produce requests for a moment after a reset, while the topics are recreated); a
        version sent twice is harmless (serving upserts rows, and skips versions it holds)."""
        deadline = time.monotonic() + self.settings.kafka.connect_timeout_s
        while True:
            try:
                futs = [await self._producer.send(self.settings.topics.param_deltas, value, key=key, partition=0)
                        for key, value in records]
                metas = await asyncio.gather(*futs)
                return max(md.offset for md in metas) + 1
            except KafkaError as err:
                if time.monotonic() >= deadline:
                    raise
                log.warning("publishing %d parameter deltas failed (%r); retrying", len(records), err)
                await asyncio.sleep(0.2)

    # ------------------------------------------------------------------ batches
    async def _reject(self, rec, raw: bytes, kind: str, detail: str):
        """Dead-letter one record (its original bytes) through the consumer's own dead-letter path."""
        return await self._dead_letter(rec, raw, MalformedMessage(kind, detail))

    async def _dead_letter(self, rec, raw: bytes, err: MalformedMessage, examples: int = 1):
        """Dead-letter ``raw`` (a record's bytes, or a batch of some of its examples) as if it were
        record ``rec``'s value; ``examples``: how many examples it refuses (counted)."""
        self.bad += examples
        M.BAD_EXAMPLES.labels(self.cfg.model_id, err.kind).inc(examples)
        original = SimpleNamespace(topic=rec.topic, partition=rec.partition, offset=rec.offset, key=rec.key,
                                   value=raw)
        return await self.consumer.dead_letter(original, err)

    async def _decode_records(self, raws, record_at, out: _Decoded) -> None:
        """Decode records (``record_at(i)``: record ``i``, for a dead letter) into ``out``; a record
        that does not decode is dead-lettered whole with its reason (``undecodable``/``invalid``,
        or ``failed`` when decoding raised something else: a bug must not stop the trainer)."""
        for i, raw in enumerate(raws):
            try:
                c = self.decode(raw)
            except BadExampleBatch as err:
                out.letters.append(await self._reject(record_at(i), raw, err.kind, err.detail))
                continue
            except Exception as err:  # noqa: BLE001 - a record this path fails on must not stop the trainer
                out.letters.append(await self._dead_letter(record_at(i), raw, processing_failed(err)))
                continue
            if c.size:
                out.parts.append(c)
                out.records.append(record_at(i))
                out.examples += c.size

    async def prepare(self, recs, polled_at_ms: int | None = None, decoded: _Decoded | None = None) -> Prepared:
        """Decode (unless ``decoded`` holds the records' decoded batches already), check, dead-letter
        (durably), dedup and assemble one batch on the event loop: see :meth:`_prepare`."""
        t0 = time.perf_counter()
        if decoded is None:
            decoded = _Decoded()
            await self._decode_records(list(map(_RAW, recs)), recs.__getitem__, decoded)
        offsets, stamps = _positions(recs)
        for part in offsets:
            hw = self.consumer.consumer.highwater(TopicPartition(self.topic, part))
            if hw is not None:
                self._highwater[part] = hw
        return await self._prepare(decoded, offsets, polled_at_ms, t0)

    async def _prepare(self, decoded: _Decoded, offsets: dict[int, int], polled_at_ms: int | None, t0: float) -> Prepared:
        """Check the decoded batches' examples (:func:`trainer.ingest.refusals`: a refused example
        is dead-lettered as a batch of the refused examples of its record and kind, and counted;
        the rest of its record is learned), dedup by the shipped ``id_hash`` against the applied
        window, the batches in flight and this batch itself, and assemble the ``SparseBatch``
        (:func:`services.example_batch.to_sparse_batch_arrays`). The window learns a batch's ids
        only once it is applied, so a snapshot never holds ids it has not trained on. An example
        *arrives* at its record's Kafka timestamp (when the joiner produced it), or at
        ``polled_at_ms`` (the trainer's poll) when the record has none; never later than the poll.
        ``offsets``: the next offset per partition of all the records."""
        letters, parts, cfg = decoded.letters, decoded.parts, self.cfg
        inflight = (np.concatenate([h for _, h in self._pending]) if len(self._pending) > 1
                    else self._pending[0][1] if self._pending else _NO_HASHES)
        now_ms = int(time.time() * 1000)
        keep = []
        for c, rec in zip(parts, decoded.records):
            codes = ingest.refusals(c, self.known_slots, cfg.label, cfg.dense_features, now_ms=now_ms,
                                    max_future_ms=self.max_future_ms)
            keep.append(codes == 0)
            if keep[-1].all():
                continue
            for k in np.unique(codes[codes > 0]).tolist():
                rows = np.flatnonzero(codes == k)
                kind = ingest.KINDS[k]
                why = ingest.detail(c, int(rows[0]), kind, self.known_slots, cfg.label, cfg.dense_features,
                                    now_ms=now_ms, max_future_ms=self.max_future_ms)
                if rows.size > 1:
                    why = f"{rows.size} of {c.size} examples, the first: {why}"
                letters.append(await self._dead_letter(rec, example_batch.encode(ingest.take(c, rows)),
                                                       MalformedMessage(kind, why), int(rows.size)))
        batch, hashes, arrival, rows = None, _NO_HASHES, None, np.zeros(0, np.int64)
        if parts:
            keep = np.concatenate(keep)
            arrays = example_batch.to_sparse_batch_arrays(parts, cfg.all_slots, cfg.label, cfg.dense_features)
            hashes = arrays.pop("meta")["id_hash"]
            rows = np.flatnonzero(keep)
            dup = dedup.duplicates(self.dedup, inflight, hashes[rows])
            if dup.any():
                self.duplicates += int(dup.sum())
                M.DUPLICATES.labels(cfg.model_id).inc(int(dup.sum()))
                rows = rows[~dup]
            batch = SparseBatch(**arrays)
            if rows.size < batch.size:
                batch = batch.select(rows) if rows.size else None
            hashes = hashes[rows]
        if batch is not None:
            sizes = np.array([c.size for c in parts], np.int64)
            part_of = np.repeat(np.arange(len(parts)), sizes)[rows]
            stamps = np.array([-1 if t is None else t for t in map(_STAMP, decoded.records)], np.int64)
            polled = now_ms if polled_at_ms is None else polled_at_ms
            arrival = stamps[part_of]
            arrival = np.where((arrival > 0) & (arrival < polled), arrival, polled)
            starts = np.concatenate([[0], np.cumsum(sizes)])

            def letter_of(j: int) -> tuple[object, bytes]:  # batch row -> (its record, its example's batch bytes)
                q = int(part_of[j])
                return decoded.records[q], example_batch.encode(ingest.take(parts[q], rows[j:j + 1] - starts[q]))
        else:
            letter_of = None
        self._stage("prepare", time.perf_counter() - t0)
        if letters:  # dead letters durable before their offsets can be committed
            await asyncio.gather(*letters)
        return Prepared(batch, offsets, hashes, arrival, letter_of)

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
        dedup.duplicates(dedup.DedupWindow(4), _NO_HASHES, h)  # load the numba kernels

    def _train(self, batch: SparseBatch):
        """On the training thread."""
        if torch.get_num_threads() != self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        t0 = time.perf_counter()
        return train_isolating(self.model.train_step, batch), time.perf_counter() - t0

    async def _apply(self, p: Prepared, step: asyncio.Future | None, prev: asyncio.Task | None) -> None:
        """Wait for a prepared batch's step (on the training thread) and for the batch before it
        (bookkeeping and commits stay in batch order), then commit its offsets."""
        if p.batch is not None:
            # progressive validation: the step's forward pass scores the batch before it is learned
            res, dt = await step
            loss, probs = res.loss, res.probs
        if prev is not None:
            await prev
        hashes = p.hashes
        if p.batch is not None and res.failed:
            letters = []  # records the step failed on alone (durable before the commit below)
            for row, err in res.failed:
                rec, raw = p.letter_of(row)
                letters.append(await self._dead_letter(rec, raw, processing_failed(err)))
            await asyncio.gather(*letters)
            hashes = hashes[res.applied]
            p = dataclasses.replace(p, batch=p.batch.select(res.applied) if res.applied.size else None,
                                    arrival_ms=p.arrival_ms[res.applied])
        if p.batch is not None:
            batch = p.batch
            self._stage("train", dt)
            self.auc.update(probs, batch.labels)
            self.sample_rates.update(batch.slice_ids, batch.slice_names, batch.sample_rate, batch.labels)
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
        self.dedup.add_many(hashes)
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
            # offsets read from a broker whose data is gone must not land in the new data's group
            if await self._reset_noticed():
                return
            t0 = time.perf_counter()
            deadline = time.monotonic() + self.settings.kafka.connect_timeout_s
            while True:
                try:
                    await self.consumer.commit({TopicPartition(self.topic, q): o
                                                for q, o in self.applied_offsets.items()})
                    break
                except KafkaError:
                    # the group is gone with the broker's data (a reset), or rejoining (after one, or
                    # a rebalance): the member keeps its partitions, so the next try commits
                    if await self._reset_noticed():
                        return
                    if time.monotonic() >= deadline:
                        raise
                    await asyncio.sleep(0.5)
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

    async def _sync_when_due(self, now: float) -> None:
        """Publish sparse rows every ``sync_interval_s`` and dense weights every ``dense_sync_interval_s``,
        each after the batches in flight are applied (a sync holds only applied updates); not while
        a broker reset waits to be handled (it publishes onto the new topics itself)."""
        sparse = now - self._last_sync >= self.sync_interval_s
        dense = now - self._last_dense >= self.dense_sync_interval_s
        if not (sparse or dense) or await self._reset_noticed():
            return
        if sparse:
            self._last_sync = now
            await self._drain()
            await self.sync_sparse()
        if dense:
            self._last_dense = now
            await self._drain()
            await self.sync_dense()

    def _update_rate(self, now: float) -> None:
        t, n = self._rate_mark
        if now - t >= 1.0:
            M.EXAMPLES_PER_S.labels(self.cfg.model_id, "online").set((self.examples_applied - n) / (now - t))
            self._rate_mark = (now, self.examples_applied)

    # ------------------------------------------------------------------ broker resets
    async def _reset_noticed(self) -> bool:
        """Whether the broker's data was reset (a new epoch) and the reset is not handled yet; asks
        the broker (~1 ms; while the broker is down, until it is back or ``connect_timeout_s``)."""
        if self._reset_epoch is None and self._watch is not None:
            async with self._epoch_lock:
                if self._reset_epoch is None:
                    self._reset_epoch = await self._watch.check()
                    self._epoch_checked_at = time.monotonic()
                    if self._reset_epoch is None:  # what a reset from here on would lose
                        self._confirmed = (dict(self._highwater), dict(self.applied_offsets))
        return self._reset_epoch is not None

    async def _check_epoch_when_due(self, now: float) -> bool:
        """Ask every ``epoch_check_interval_s`` (a busy trainer asks before each commit anyway)."""
        if self._reset_epoch is None and now - self._epoch_checked_at >= self.epoch_check_interval_s:
            await self._reset_noticed()
        return self._reset_epoch is not None

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
        epoch = self._reset_epoch
        # batches handed over before the reset was noticed hold real examples: apply them (not
        # committed: the committer sees the pending reset); their ids enter the dedup window
        while self._pending:
            await self._pending[0][0]
            self._pending.popleft()
        if self._commit_task is not None:  # a commit of the old offsets, waiting for the lost group
            self._commit_task.cancel()
            try:
                await self._commit_task
            except (asyncio.CancelledError, KafkaError):
                pass
            self._commit_task = None
        # as of the last check that saw the old epoch: later fetches may come from the new topics
        highwater, applied = self._confirmed
        lost = sum(max(0, hw - applied[p]) for p, hw in highwater.items() if p in applied)
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
        self.applied_offsets, self.resume_offsets, self._highwater = {}, {}, {}
        self._confirmed = ({}, {})
        self.unknown_start = set()
        self._from_start = True
        self._reset_epoch = None
        assigned = {tp.partition for tp in self.consumer.consumer.assignment() if tp.topic == self.topic}
        for part in sorted(assigned):
            await self.consumer.consumer.seek_to_beginning(TopicPartition(self.topic, part))
            self.unknown_start.add(part)
        await self.sync_dense()  # the new topic's first delta; param_deltas_offset now points into it
        self.snapshot()
        self._record_epoch()

    async def _begin(self, restored: bool) -> None:
        """Before the first batch: publish the dense weights if serving has none of this run's; if
        the restored snapshot was written in another broker epoch, also write a snapshot of this
        one at once (serving bootstraps from it after a reset)."""
        if not restored or self.dense_version == 0 or self._reset_at_start:
            await self.sync_dense()
        if self._reset_at_start:
            self.snapshot()
            self._reset_at_start = False

    # ------------------------------------------------------------------ main loop
    async def run(self, stop_when_idle_s: float | None = None, max_examples: int | None = None) -> dict:
        s = self.settings
        await create_topics(s, {self.topic: s.topics.partitions, s.topics.param_deltas: 1, s.topics.dead_letters: 1})
        self._watch = tansu_quirks.EpochWatch(s, "trainer")
        try:
            epoch = await self._watch.start()
        except Exception:  # noqa: BLE001 - an external Kafka without the marker topic
            await self._watch.stop()
            self._watch, epoch = None, None
        restored = self.restore(epoch)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="trainer-step")
        self._producer = producer(s)
        await start_client(self._producer, s)
        # a kill -9'd predecessor stays a group member until its session times out, and the join
        # waits for it: allow the consumer start longer than the default connect timeout.
        cs = s.model_copy(deep=True)
        cs.kafka.connect_timeout_s = max(s.kafka.connect_timeout_s, self.consumer_start_timeout_s)
        self.consumer = TypedConsumer(cs, "trainer", Example, [self.topic], self.group_id,
                                      dead_letter_producer=self._producer, codec=RawExampleCodec())
        self.consumer.consumer.subscribe([self.topic], listener=_Seek(self))
        try:
            warm = asyncio.get_running_loop().run_in_executor(self._executor, self._warm_up)
            await self.consumer.start()
            await warm
            return await self._loop(restored, stop_when_idle_s, max_examples)
        finally:
            if self._watch is not None:
                await self._watch.stop()

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

    async def _loop(self, restored: bool, stop_when_idle_s: float | None, max_examples: int | None) -> dict:
        """The main loop: poll records until they hold ``batch_size`` examples (or
        ``batch_timeout_s`` passed), decoding each as it arrives, then hand the batch over."""
        started = time.time()
        self._last_sync = self._last_dense = time.monotonic()
        last_data = time.monotonic()
        await self._begin(restored)
        buf: list = []  # records polled for the next batch, decoded into `dec`
        dec = _Decoded()
        # examples per record lately (how many records to poll for a batch): from one record at a time
        per_record = float(self.batch_size)
        first_at = 0.0
        polled_at_ms = 0  # wall time of the first poll that filled buf
        queued = self.examples_applied
        try:
            while not self.stop_event.is_set():
                now = time.monotonic()
                if await self._check_epoch_when_due(now):
                    buf, dec = [], _Decoded()  # fetched from the old topic or at its positions: lost / read again
                    await self._handle_reset()
                # wake up in time for the batch timeout and the next sync, not just every 100 ms
                wait = min(0.1, max(0.0, self._last_sync + self.sync_interval_s - now))
                if buf:
                    wait = min(wait, max(0.0, first_at + self.batch_timeout_s - now))
                t0 = time.perf_counter()
                want = max(1, int((self.batch_size - dec.examples) / per_record))
                recs = await self.consumer.poll(timeout_ms=int(wait * 1000), max_records=want)
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
                    t0 = time.perf_counter()
                    before = dec.examples
                    await self._decode_records(list(map(_RAW, recs)), recs.__getitem__, dec)
                    self._stage("prepare", time.perf_counter() - t0)
                    per_record = max(1.0, 0.8 * per_record + 0.2 * (dec.examples - before) / len(recs))
                if buf and (dec.examples >= self.batch_size or now - first_at >= self.batch_timeout_s):
                    prepared = await self.prepare(buf, polled_at_ms, dec)
                    buf, dec = [], _Decoded()
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
                prepared = await self.prepare(buf, polled_at_ms, dec)
                await self._drain()
                self._start(prepared)
            return await self._finish(started)
        finally:
            await self._teardown()
