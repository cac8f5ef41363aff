"""The serving parameter server's feed: consume ``param-deltas`` and apply them in place.

Bootstrap: load the newest snapshot (if any), then read the delta topic from its beginning,
skipping versions the snapshot already holds, up to the end offsets seen at start-up; from then
on the model counts as loaded (``/readyz``) and deltas keep being applied as they arrive.

Every replica reads every partition by manual assignment (no consumer group), so replicas never
split the stream between them, and since the topic has one partition per model the order is the
trainer's order: replicas that have read the same offsets hold identical parameters.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from aiokafka import TopicPartition

from proto import ParameterDelta
from serving import metrics
from serving.background import BackgroundLoop
from serving.model import DeltaRejected, ServingModel
from services.kafka import TypedConsumer, create_topics
from services.settings import Settings
from pathlib import Path

log = logging.getLogger(__name__)


class DeltaFeed(BackgroundLoop):
    """Background task keeping ``model`` up to date with the delta topic."""

    task_name = "param-deltas"

    def __init__(self, settings: Settings, model: ServingModel, snapshot_dir: Path | None = None,
                 retry_s: float = 2.0, service: str = "serving") -> None:
        self.settings = settings
        self.model = model
        self.snapshot_dir = snapshot_dir
        self.retry_s = retry_s
        self.service = service
        self.snapshot: Path | None = None
        self.snapshot_versions = (0, 0)
        self.resume_offset: int | None = None
        self.caught_up = asyncio.Event()
        self.applied = 0
        self.skipped = 0
        self._task: asyncio.Task[None] | None = None

    @property
    def loaded(self) -> bool:
        """A model is loaded: from a snapshot, or by having read the delta topic to its end."""
        return self.snapshot is not None or self.caught_up.is_set()

    def load_snapshot(self) -> None:
        boot = self.model.bootstrap(self.snapshot_dir)
        if boot is not None:
            self.snapshot = boot.path
            self.snapshot_versions = (boot.sparse_version, boot.dense_version)
            self.resume_offset = boot.param_deltas_offset
            log.info("bootstrapped from %s (sparse %d, dense %d)", boot.path, *self.snapshot_versions)
        self.publish_metrics()

    def publish_metrics(self) -> None:
        mid = self.model.model_id
        for kind, state in (("sparse", self.model.sparse), ("dense", self.model.dense)):
            metrics.MODEL_VERSION.labels(mid, kind).set(state.version)
            stale = state.staleness_s()
            if stale is not None:
                metrics.DELTA_STALENESS.labels(mid, kind).set(stale)

    async def _consume(self) -> None:
        topic = self.settings.topics.param_deltas
        await create_topics(self.settings, {topic: self.settings.topics.param_delta_partitions})
        consumer: TypedConsumer[ParameterDelta] = TypedConsumer(
            self.settings, self.service, ParameterDelta, [], None, auto_offset_reset="earliest"
        )
        try:
            await consumer.start()
            parts = consumer.consumer.partitions_for_topic(topic)
            if not parts:
                await consumer.consumer._client.force_metadata_update()  # noqa: SLF001
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
            else:
                await consumer.consumer.seek_to_beginning(*tps)
            ends = await consumer.consumer.end_offsets(tps)
            while True:
                if not self.caught_up.is_set():
                    positions = {tp: await consumer.consumer.position(tp) for tp in tps}
                    if all(positions[tp] >= ends[tp] for tp in tps):
                        self.caught_up.set()
                        log.info("param deltas caught up: sparse %d, dense %d",
                                 self.model.sparse.version, self.model.dense.version)
                records = await consumer.poll(timeout_ms=200, max_records=64)
                for r in records:
                    await self._apply(r.value)
                self.publish_metrics()
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(consumer.stop())

    async def _apply(self, msg: ParameterDelta) -> None:
        kind = msg.WhichOneof("payload") or "none"
        held = self.snapshot_versions[0] if kind == "sparse" else self.snapshot_versions[1]
        if msg.version <= held:
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
            log.warning("param delta v%d chunk %d skipped: %s", msg.version, msg.chunk_index, err)
            return
        self.applied += 1
        metrics.DELTAS_APPLIED.labels(kind).inc()
        metrics.DELTA_APPLY_SECONDS.labels(kind).observe(time.perf_counter() - started)
        if msg.created_at_ms:
            metrics.DELTA_LAG.labels(kind).observe(max(0.0, time.time() - msg.created_at_ms / 1000))
