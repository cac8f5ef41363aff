"""The online trainer's publishing to ``param-deltas``: sparse rows and dense weights, as versions.

Every ``sync_interval_s`` the rows touched since the last sync are published as one sparse version
(several chunks, :func:`trainer.sync.encode_sparse_tables`); when :class:`DenseSchedule` says (every
``sync_interval_s`` at first, then less often, up to every ``dense_sync_interval_s``) the dense
params as one dense version, with the negative sample rates the model learned under
(:mod:`trainer.sample_rates`, per slice and global: serving's log-odds correction uses them, not the
joiner's setting). The trainer calls both with no batch in flight, so a version holds
only applied updates. Versions keep increasing across restarts and broker resets (a snapshot records
them, with the ``param-deltas`` offset after the last publish: where a serving replica restarting
from that snapshot resumes). A version sent twice is harmless: serving upserts rows and skips
versions it holds.

Each sparse sync also measures freshness over the examples applied since the previous one:
arrival -> published (:data:`trainer.metrics.SYNC_DELAY`, kept in :attr:`Publisher.delays`) and
event time -> published (:data:`trainer.metrics.EVENT_FRESHNESS`, :attr:`Publisher.event_delays`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

import numpy as np
import torch
from aiokafka.errors import KafkaError

from services.kafka import send_until_answered, unanswered
from services.settings import Settings

from . import metrics as M
from .manifest import Manifest
from .sync import NonFiniteDelta, encode_dense, encode_sparse_tables

log = logging.getLogger(__name__)


class Publisher:
    """Publishes one model's parameters to ``param-deltas`` (partition 0, in order) through
    :attr:`producer` (set by the trainer once started); ``stage(name, seconds)`` accounts the time."""

    def __init__(self, settings: Settings, model_id: str, stage: Callable[[str, float], None]):
        self.settings, self.model_id, self._stage = settings, model_id, stage
        self.producer = None
        #: whether the trainer is stopping (set by the trainer): a stopping trainer waits for an
        #: unanswering broker only ``kafka.connect_timeout_s``
        self.stopping: Callable[[], bool] = lambda: False
        #: the shard this publisher's sparse rows are (rank r of N ranks: r and N; 0 and 0 for one
        #: trainer process): serving applies each shard's versions independently
        self.shard, self.shard_count = 0, 0
        self.sparse_version = 0
        self.dense_version = 0
        #: the ``param-deltas`` offset after the last publish (a snapshot's resume point for serving)
        self.param_deltas_offset = 0
        #: recent sync delays (s): arrival -> published (:data:`M.SYNC_DELAY`) and event time ->
        #: published (:data:`M.EVENT_FRESHNESS`), a sample of each sync's examples
        self.delays: deque[float] = deque(maxlen=100_000)
        self.event_delays: deque[float] = deque(maxlen=100_000)
        for kind in ("sparse", "dense"):  # exported at 0 from the start: an increase is seen from its first
            M.NON_FINITE_DELTAS.labels(model_id, kind)
        M.PUBLISH_WAITING.labels(model_id).set(0)
        # (event times, arrival times) in ms of the examples applied since the last sparse sync
        self._unsynced_times: list[tuple[np.ndarray, np.ndarray]] = []
        #: with keep_last_sync_copy, every table's items as of the last sparse sync (for tests)
        self.last_sync_tables: dict[str, tuple] | None = None
        self.keep_last_sync_copy = False

    def applied(self, event_time_ms: np.ndarray, arrival_ms: np.ndarray) -> None:
        """Note a batch applied (its examples' event and arrival times) for the next sync's delays."""
        self._unsynced_times.append((event_time_ms, arrival_ms))

    @property
    def unsynced(self) -> bool:
        """Whether examples were applied since the last sparse sync."""
        return bool(self._unsynced_times)

    def versions(self) -> dict[str, int]:
        """What a snapshot records of the publishing (:class:`trainer.manifest.Manifest`'s fields)."""
        return dict(sparse_version=self.sparse_version, dense_version=self.dense_version,
                    param_deltas_offset=self.param_deltas_offset)

    def restore(self, manifest: Manifest, *, sparse_version: int | None = None, reset: bool = False) -> None:
        """The versions a restored snapshot records: the one restore path of both trainers.
        ``sparse_version``: this publisher's own stream's (a rank's shard), when not the manifest's;
        ``reset``: the snapshot was written in another broker epoch, so nothing of ours is on the
        new ``param-deltas`` and serving resumes at most from its start."""
        self.sparse_version = manifest.sparse_version if sparse_version is None else sparse_version
        self.dense_version = manifest.dense_version
        self.param_deltas_offset = 0 if reset else int(manifest.param_deltas_offset or 0)

    async def sync_sparse(self, tables: dict, max_event_time_ms: int, confirm: bool = False) -> int:
        """Publish the touched rows of ``tables`` as one version; the bytes published. ``confirm``:
        a version even with no touched row (:func:`trainer.sync.encode_sparse_tables`)."""
        t0 = time.perf_counter()
        try:
            msgs = encode_sparse_tables(self.model_id, self.sparse_version + 1, tables,
                                        max_event_time_ms=max_event_time_ms, shard=self.shard,
                                        shard_count=self.shard_count, confirm=confirm)
        except NonFiniteDelta as err:  # the PS refuses non-finite gradients: a bug if it happens
            self._refused("sparse", err)
            return 0
        if self.keep_last_sync_copy:
            self.last_sync_tables = {n: t.items() for n, t in tables.items()}
        if not msgs:
            self._unsynced_times = []  # their updates changed no row (e.g. ids not admitted yet)
            return 0
        self.sparse_version += 1
        records = [(f"{self.model_id}/{table}".encode(), m.SerializeToString()) for table, m in msgs]
        nbytes = sum(len(v) for _, v in records)
        self.param_deltas_offset = await self._publish(records)
        if self._unsynced_times:
            self._observe_delays(time.time())
        dt = time.perf_counter() - t0
        M.SYNC_BYTES.labels(self.model_id, "sparse").observe(nbytes)
        M.SYNC_SECONDS.labels(self.model_id, "sparse").observe(dt)
        self._stage("sync", dt)
        for n, t in tables.items():
            M.TABLE_SIZE.labels(self.model_id, n).set(len(t))
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
                hist.labels(self.model_id).observe(float(q))

    async def sync_dense(self, head: torch.nn.Module, max_event_time_ms: int, sample_rates: dict) -> None:
        """Publish the dense params (``head``) as one version, with the negative sample rates the model
        learned under (:mod:`trainer.sample_rates`: serving's log-odds correction uses them)."""
        t0 = time.perf_counter()
        try:
            m = encode_dense(self.model_id, self.dense_version + 1, head, max_event_time_ms=max_event_time_ms,
                             sample_rates=sample_rates)
        except NonFiniteDelta as err:  # the step refuses non-finite gradients: a bug if it happens
            self._refused("dense", err)
            return
        self.dense_version += 1
        data = m.SerializeToString()
        self.param_deltas_offset = await self._publish([(f"{self.model_id}/dense".encode(), data)])
        M.SYNC_BYTES.labels(self.model_id, "dense").observe(len(data))
        M.SYNC_SECONDS.labels(self.model_id, "dense").observe(time.perf_counter() - t0)

    def _refused(self, kind: str, err: NonFiniteDelta) -> None:
        """Serving keeps the last good parameters: the rows of a refused sparse version stay
        unpublished until they are touched again, a refused dense version waits for the next."""
        M.NON_FINITE_DELTAS.labels(self.model_id, kind).inc()
        log.error("not publishing a %s version with non-finite values: %s", kind, err)

    async def _publish(self, records: list[tuple[bytes, bytes]]) -> int:
        """Send ``(key, value)`` records to ``param-deltas`` (partition 0, in order); the offset
        after the last. A version sent twice is harmless (serving upserts rows, and skips versions
        it holds), so a failed send is sent again (:func:`services.kafka.send_until_answered`):

        * while the broker does not answer (:func:`services.kafka.unanswered`: hung, cut off,
          restarting), until it does (the wait in ``driftline_trainer_publish_waiting_seconds``).
          A trainer that exited instead would restart from its last snapshot and train again what
          it had applied since, and a broker away for longer than a restart's own connect timeout
          would make it crash-loop;
        * otherwise (tansu refuses produce requests for a moment after a reset, while the topics
          are recreated), and once the trainer is stopping, for up to ``kafka.connect_timeout_s``."""
        async def send() -> int:
            futs = [await self.producer.send(self.settings.topics.param_deltas, value, key=key, partition=0)
                    for key, value in records]
            return max(md.offset for md in await asyncio.gather(*futs)) + 1

        async def give_up(err: KafkaError, waited: float) -> bool:
            return waited >= self.settings.kafka.connect_timeout_s and (self.stopping() or not unanswered(err))

        return await send_until_answered(send, f"{len(records)} parameter deltas", give_up,
                                         M.PUBLISH_WAITING.labels(self.model_id).set)


class DenseSchedule:
    """When the dense weights are due: every ``sync_interval_s`` at first, the interval doubling with
    each dense sync that carries learning, up to ``dense_sync_interval_s``.

    Why not ``dense_sync_interval_s`` from the start: serving scores the sparse rows it receives
    every ``sync_interval_s`` with the dense head it last received, and a model's head moves most
    while the model is young. With only the hourly default a new model would serve its random
    initial head beside trained embeddings for an hour. With the ramp (10 s, 20 s, 40 s, ...: about
    ten dense versions in the first hour, then one an hour) the head serving holds follows the one
    training quickly early, and rarely once it has settled. A dense version is small next to the
    sparse rows (the DeepFM head: ~0.3 MB), so the early ones cost little. A restarted trainer ramps
    again; syncs with nothing learned since the last one (a trainer waiting for traffic) do not
    advance the ramp.

    >>> s = DenseSchedule(10.0, 3600.0, now=0.0)
    >>> s.due(9.0), s.due(10.0)
    (False, True)
    >>> s.published(10.0, examples=5); s.interval, s.due(29.0), s.due(30.0)
    (20.0, False, True)
    >>> s.published(30.0, examples=5); s.interval  # nothing learned since the last one
    20.0
    >>> [s.interval_after(k) for k in (0, 1, 8, 9, 5000)]
    [10.0, 20.0, 2560.0, 3600.0, 3600.0]
    """

    def __init__(self, sync_interval_s: float, dense_sync_interval_s: float, now: float | None = None) -> None:
        self.sync_interval_s, self.dense_sync_interval_s = sync_interval_s, dense_sync_interval_s
        self.last = time.monotonic() if now is None else now
        self.learned_syncs = 0
        self._examples = 0

    def interval_after(self, syncs: int) -> float:
        return min(self.dense_sync_interval_s, self.sync_interval_s * 2.0 ** min(syncs, 64))

    @property
    def interval(self) -> float:
        return self.interval_after(self.learned_syncs)

    def due(self, now: float) -> bool:
        return now - self.last >= self.interval

    def published(self, now: float, examples: int) -> None:
        """A dense sync at ``now``, ``examples`` learned in this run so far."""
        if examples > self._examples:
            self.learned_syncs += 1
        self.last, self._examples = now, examples
