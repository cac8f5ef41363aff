"""The serving parameter server's feed: consume ``param-deltas`` and apply them in place.

Bootstrap: load the newest snapshot (if any), then read the delta topic from the snapshot's
offset (or its beginning), skipping versions the snapshot already holds, up to the end offsets
seen at start-up; from then on the model counts as loaded (``/readyz``) and deltas keep being
applied as they arrive.

Sharded trainers: the sparse deltas of an N-rank trainer name their shard and ``shard_count`` and
number their versions per shard, interleaved in any order on the one partition. "Versions the
snapshot holds" is then per shard: a sparse delta of the snapshot's layout is skipped when its
version is at most the manifest's ``sparse_versions[shard]`` (a one-process trainer's manifest has
one ``sparse_version``, layout 0). A delta of another layout is either from before the snapshot
(the trainer was restarted with another rank count and resharded an older snapshot) or after it
(restarted since, from this snapshot): read from the snapshot's offset, everything is after it and
is applied; read from the topic's beginning, it is taken as before the snapshot until a delta of
the snapshot's own layout has been read. The first delta of a later layout applied supersedes the
snapshot's versions: from then on they gate nothing (the new ranks number afresh), and the model
resets its per-shard versions to the new layout (:class:`serving.versions.SparseVersions`).

Every replica reads every partition by manual assignment (no consumer group), so replicas never
split the stream between them, and since the topic has one partition per model the order is the
trainer's order: replicas that have read the same offsets hold identical parameters.

A delta that decodes but fails to apply (a bug, a shape the model does not expect) is written to
``dead-letters`` with the reason and skipped, counted in
``driftline_serving_deltas_skipped_total{reason="failed"}``: one record never stops the feed. A
delta the model refuses before writing anything (:class:`serving.versions.DeltaRejected`: NaN or
infinite values, a table or shape it does not have, ...) is skipped too, so the model keeps its
last good parameters; it is logged as an error, counted under its reason, and dead-lettered
(``refused: ...``). Each such record is dead-lettered once per replica, not again when a restart
re-reads it (:class:`serving.refused_deltas.RefusedDeltas`). Another model's deltas on a shared
topic are only counted (``other_model``).

Broker resets (tansu memory storage; :class:`serving.broker_epoch.SharedEpoch` tells): the old
topic and its offsets are gone, so the feed re-reads the new topic from its beginning, keeps
serving the current model (no 503), and waits for the trainer's first snapshot of the new epoch
(manifest key ``broker_epoch``): it reloads the model from it and resumes at its
``param_deltas_offset``, so every replica converges to the trainer's state although the deltas
of the old topic are gone. The same happens at start-up when the newest snapshot belongs to an
older epoch. Deltas that were on the old topic and not read yet are lost with it and counted in
``driftline_broker_reset_lost_total{service="serving"}``; the new snapshot contains their effect.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from pathlib import Path

from aiokafka import TopicPartition

from proto import ParameterDelta
from services import metrics as shared_metrics
from services.codecs import MalformedMessage, processing_failed
from services.kafka import Record, TypedConsumer, create_topics
from services.settings import Settings
from serving import metrics
from serving.background import BackgroundLoop
from serving.broker_epoch import SharedEpoch
from serving.model import ServingModel
from serving.refused_deltas import RefusedDeltas
from serving.versions import Bootstrap, DeltaRejected
from trainer.isolate import out_of_memory

log = logging.getLogger(__name__)

#: how often the snapshot directory is looked at while waiting for a new-epoch snapshot
_SNAPSHOT_POLL_S = 1.0


class DeltaFeed(BackgroundLoop):
    """Background task keeping ``model`` up to date with the delta topic."""

    task_name = "param-deltas"

    def __init__(self, settings: Settings, model: ServingModel, snapshot_dir: Path | None = None,
                 retry_s: float = 2.0, service: str = "serving", epochs: SharedEpoch | None = None) -> None:
        self.settings = settings
        self.model = model
        self.snapshot_dir = snapshot_dir
        self.retry_s = retry_s
        self.service = service
        self.epochs = epochs if epochs is not None else SharedEpoch(settings, service)
        self._own_epochs = epochs is None
        self.snapshot: Path | None = None
        self.snapshot_versions = (0, 0)
        #: the snapshot whose per-shard sparse versions decide which deltas it already holds (None:
        #: no snapshot, or superseded by a delta of a later shard layout)
        self.gate: Bootstrap | None = None
        #: the feed is past the snapshot's position in the topic (at its offset, or it has read a
        #: delta of the snapshot's layout): a delta of another layout is then a later one
        self.past_snapshot = True
        self.snapshot_epoch: str | None = None
        self.resume_offset: int | None = None
        #: the broker epoch the feed's offsets belong to
        self.epoch: str | None = None
        #: after a reset: the epoch whose first snapshot the model is reloaded from
        self.awaiting_epoch: str | None = None
        self.caught_up = asyncio.Event()
        self.applied = 0
        self.skipped = 0
        self.failed = 0
        self.reloads = 0
        self.refused = RefusedDeltas(settings.var_dir / "serving" / f"refused-deltas-{settings.serving.port}")
        self._lag: dict[int, int] = {}
        self._behind_since: float | None = None  # monotonic: when deltas first waited unapplied
        self._shard_series: set[str] = set()
        self._snapshot_looked = 0.0
        self._task: asyncio.Task[None] | None = None

    @property
    def loaded(self) -> bool:
        """A model is loaded: from a snapshot, or by having read the delta topic to its end."""
        return self.snapshot is not None or self.caught_up.is_set()

    def load_snapshot(self) -> None:
        boot = self.model.bootstrap(self.snapshot_dir)
        if boot is not None:
            self._adopt(boot)
            log.info("bootstrapped from %s (sparse %d, dense %d)", boot.path, *self.snapshot_versions)
        self.publish_metrics()

    def _adopt(self, boot: Bootstrap) -> None:
        self.snapshot = boot.path
        self.snapshot_versions = (boot.sparse_version, boot.dense_version)
        self.resume_offset = boot.param_deltas_offset
        self.snapshot_epoch = boot.broker_epoch
        self.gate = boot
        self.past_snapshot = False

    def publish_metrics(self) -> None:
        self._shard_series = publish_model_metrics(self.model, self._shard_series)

    async def stop(self) -> None:
        await super().stop()
        if self._own_epochs:
            await self.epochs.stop()

    async def _consume(self) -> None:
        topic = self.settings.topics.param_deltas
        await create_topics(self.settings, {topic: self.settings.topics.param_delta_partitions})
        await self._start_epoch()
        consumer: TypedConsumer[ParameterDelta] = TypedConsumer(
            self.settings, self.service, ParameterDelta, [], None, auto_offset_reset="earliest"
        )
        try:
            await consumer.start()
            parts = consumer.consumer.partitions_for_topic(topic)
            if not parts:
                await consumer.consumer._client.force_metadata_update()
                parts = consumer.consumer.partitions_for_topic(topic) or {0}
            tps = [TopicPartition(topic, p) for p in sorted(parts)]
            if len(tps) > 1:
                log.warning("%s has %d partitions: deltas are only ordered within one; replicas may "
                            "diverge and snapshot offsets cannot be used", topic, len(tps))
            consumer.consumer.assign(tps)
            # Re-read from the snapshot's offset (single-partition topic) or the beginning on every
            # (re)connect: versions the snapshot already holds are skipped.
            if self.resume_offset is not None and len(tps) == 1:
                consumer.consumer.seek(tps[0], self.resume_offset)
                self.past_snapshot = True
            else:
                await consumer.consumer.seek_to_beginning(*tps)
                self.past_snapshot = self.gate is None
            ends = await consumer.consumer.end_offsets(tps)
            while True:
                if not self.caught_up.is_set():
                    positions = {tp: await consumer.consumer.position(tp) for tp in tps}
                    if all(positions[tp] >= ends[tp] for tp in tps):
                        self.caught_up.set()
                        log.info("param deltas caught up: sparse %d, dense %d",
                                 self.model.sparse.version, self.model.dense.version)
                records = await consumer.poll(timeout_ms=200, max_records=64)
                self._note_lag(consumer, records)
                for r in records:
                    await self._apply(consumer, r)
                self.publish_metrics()
                # Both end this connection; the next one seeks where the new state says.
                if await self._reset_seen() or await self._reloaded():
                    return
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(consumer.stop())

    async def _start_epoch(self) -> None:
        """On the first connection: a snapshot from before a broker reset has an offset into a
        topic that no longer exists; read the new one from its start and wait for a new snapshot."""
        if self.epoch is not None:
            return
        current = await self.epochs.current(0)
        if current is None:
            return  # the broker is unreachable: the consumer's start fails and is retried
        self.epoch = current
        if self.snapshot_epoch is not None and self.snapshot_epoch != current:
            log.warning("param deltas: snapshot %s was taken on broker epoch %s, the broker is now at "
                        "%s (reset since): reading the new topic from its start and reloading from "
                        "the trainer's first snapshot of this epoch", self.snapshot, self.snapshot_epoch,
                        current)
            self.resume_offset = None
            self.awaiting_epoch = current

    def _note_lag(self, consumer: TypedConsumer[ParameterDelta], records: list[Record[ParameterDelta]]) -> None:
        self._lag.update(consumer.lag_after(records))
        if not any(self._lag.values()):
            self._behind_since = None
        elif self._behind_since is None:
            self._behind_since = time.monotonic()

    def behind_s(self) -> float:
        """Seconds since deltas on the topic have waited unapplied (0: caught up with it)."""
        return 0.0 if self._behind_since is None else time.monotonic() - self._behind_since

    async def _reset_seen(self) -> bool:
        current = await self.epochs.current(1.0)
        if current is None or current == self.epoch:
            return False
        if self.epoch is None:
            self.epoch = current
            return False
        lost = sum(self._lag.values())
        if lost:
            shared_metrics.BROKER_RESET_LOST.labels(self.service, self.settings.topics.param_deltas).inc(lost)
        log.warning("param deltas: the broker's data was reset (%d deltas not yet read are lost with "
                    "it): reading the new topic from its start, serving the current model until the "
                    "trainer's snapshot of epoch %s appears in %s", lost, current, self.snapshot_dir)
        self._lag.clear()
        self.epoch = current
        self.resume_offset = None
        self.awaiting_epoch = current
        return True

    async def _reloaded(self) -> bool:
        """While a reset is pending: reload from the new epoch's snapshot once it is there."""
        awaiting = self.awaiting_epoch
        if awaiting is None or time.monotonic() - self._snapshot_looked < _SNAPSHOT_POLL_S:
            return False
        self._snapshot_looked = time.monotonic()
        if await asyncio.to_thread(self.model.snapshot_epoch, self.snapshot_dir) != awaiting:
            return False
        try:
            # In a worker thread, building new tables: requests keep being scored on the old ones.
            boot = await asyncio.to_thread(self.model.bootstrap, self.snapshot_dir)
        except Exception:
            log.exception("param deltas: reloading from the snapshot of epoch %s failed; keeping the "
                          "current model", awaiting)
            return False
        if boot is None:
            return False
        self._adopt(boot)
        if boot.broker_epoch == awaiting:
            self.awaiting_epoch = None
        self.reloads += 1
        metrics.SNAPSHOT_RELOADS.inc()
        log.info("param deltas: reloaded from %s (broker epoch %s, sparse %d, dense %d); resuming the "
                 "deltas at offset %s", boot.path, boot.broker_epoch, boot.sparse_version,
                 boot.dense_version, boot.param_deltas_offset)
        self.publish_metrics()
        return True

    def _held(self, msg: ParameterDelta, kind: str) -> bool:
        """Whether the snapshot the model was loaded from already holds this delta (module doc)."""
        if kind != "sparse":
            return msg.version <= self.snapshot_versions[1]
        gate = self.gate
        if gate is None:
            return msg.version <= 0
        holds = gate.holds(msg)
        if holds is not None:
            self.past_snapshot = True
            return holds
        if not self.past_snapshot:
            return True  # another layout, read before the snapshot's own: older than the snapshot
        log.info("param deltas: sparse shard layout %d (snapshot: %d): the snapshot's versions are "
                 "superseded", msg.shard_count, gate.shard_count)
        self.gate = None
        return False

    async def _apply(self, consumer: TypedConsumer[ParameterDelta], record: Record[ParameterDelta]) -> None:
        msg = record.value
        kind = msg.WhichOneof("payload") or "none"
        if self._held(msg, kind):
            self.skipped += 1
            metrics.DELTAS_SKIPPED.labels("stale").inc()
            return
        started = time.perf_counter()
        try:
            # In a worker thread: the PS kernels release the GIL and the table lock is per chunk,
            # so requests keep being scored on the event loop while a large chunk is applied.
            await asyncio.to_thread(self.model.apply_delta, msg)
        except DeltaRejected as err:
            self.skipped += 1
            metrics.DELTAS_SKIPPED.labels(err.reason).inc()
            if err.reason == "other_model":  # a shared topic: another model's delta, not a bad one
                return
            log.error("param delta v%d chunk %d refused, the model keeps its last good parameters: %s",
                      msg.version, msg.chunk_index, err)
            await self._dead_letter_once(consumer, record, MalformedMessage("refused", str(err)[:500]))
            return
        except Exception as err:
            if out_of_memory(err):
                # (the machine's fault, not the delta's: skipping it would leave this replica apart
                # from the others for good; the feed reconnects after retry_s and applies it again)
                raise
            self.skipped += 1
            self.failed += 1
            metrics.DELTAS_SKIPPED.labels("failed").inc()
            await self._dead_letter_once(consumer, record, processing_failed(err))
            return
        self.applied += 1
        metrics.DELTAS_APPLIED.labels(kind).inc()
        metrics.DELTA_APPLY_SECONDS.labels(kind).observe(time.perf_counter() - started)
        if msg.created_at_ms:
            metrics.DELTA_LAG.labels(kind).observe(max(0.0, time.time() - msg.created_at_ms / 1000))

    async def _dead_letter_once(self, consumer: TypedConsumer[ParameterDelta], record: Record[ParameterDelta],
                                reason: MalformedMessage) -> None:
        """Dead-letter the record's original bytes, unless this replica already did (before a restart)."""
        if self.refused.first_time(self.epoch, record.partition, record.offset):
            await (await consumer.dead_letter(dataclasses.replace(record, value=record.raw), reason))


def publish_model_metrics(model: ServingModel, shard_series: set[str]) -> set[str]:
    """Set the served-model gauges (versions, staleness, sample rate) from ``model``; returns the
    shard series now set (pass it back next time: a previous layout's shards are removed). Shared
    by the feed and by a shared serving PS's workers, which report the PS's model."""
    mid = model.model_id
    rate, source = model.sample_rates.rate_for(mid)
    for other in ("slice", "global", "unrecorded"):  # one series: the source in use
        if other != source:
            with contextlib.suppress(KeyError):
                metrics.SAMPLE_RATE.remove(mid, other)
    metrics.SAMPLE_RATE.labels(mid, source).set(rate)
    for kind, state in (("sparse", model.sparse), ("dense", model.dense)):
        metrics.MODEL_VERSION.labels(mid, kind).set(state.version)
        stale = state.staleness_s()
        if stale is not None:
            metrics.DELTA_STALENESS.labels(mid, kind).set(stale)
    versions = model.sparse.versions()
    for shard in shard_series - versions.keys():  # a previous layout's shards
        with contextlib.suppress(KeyError):
            metrics.SPARSE_VERSION.remove(mid, shard)
    for shard, version in versions.items():
        metrics.SPARSE_VERSION.labels(mid, shard).set(version)
    metrics.SHARD_COUNT.labels(mid).set(model.sparse.shard_count)
    return set(versions)
