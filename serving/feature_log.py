"""Asynchronous, bounded feature logging: what /rank scored goes to topic ``features``.

``submit`` never blocks and never raises: it puts the encoded FeatureLog on a bounded in-memory
buffer, or, when the buffer is full (Kafka slow or down), drops it and counts the drop. One
background task drains the buffer into an aiokafka producer, (re)connecting with back-off while
the broker is unreachable; a send that fails or times out is dropped and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from aiokafka import AIOKafkaProducer

from services import metrics as shared_metrics
from services.kafka import BrokerUnavailable, producer, start_client
from services.settings import Settings
from serving import metrics

log = logging.getLogger(__name__)


class FeatureLogger:
    def __init__(self, settings: Settings, capacity: int, send_timeout_s: float = 2.0,
                 retry_s: float = 2.0, service: str = "serving") -> None:
        self.settings = settings
        self.topic = settings.topics.features
        self.capacity = capacity
        self.send_timeout_s = send_timeout_s
        self.retry_s = retry_s
        self.service = service
        self._queue: asyncio.Queue[tuple[bytes, bytes]] = asyncio.Queue(maxsize=max(1, capacity))
        self._task: asyncio.Task[None] | None = None
        self._producer: AIOKafkaProducer | None = None
        self.sent = 0
        self.dropped = 0

    @property
    def connected(self) -> bool:
        return self._producer is not None

    @property
    def buffered(self) -> int:
        return self._queue.qsize()

    def submit(self, key: str, value: bytes) -> bool:
        """Buffer one FeatureLog; False (and counted) when the buffer is full."""
        if self.capacity <= 0:  # asyncio.Queue(0) would be unbounded: 0 means "log nothing"
            self._drop("buffer_full")
            return False
        try:
            self._queue.put_nowait((key.encode(), value))
        except asyncio.QueueFull:
            self._drop("buffer_full")
            return False
        metrics.FEATURE_LOG_BUFFERED.set(self._queue.qsize())
        return True

    def _drop(self, reason: str, n: int = 1) -> None:
        self.dropped += n
        metrics.FEATURE_LOG_DROPPED.labels(reason).inc(n)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="feature-log")

    async def stop(self, drain_timeout_s: float = 2.0) -> None:
        """Flush what can be flushed within ``drain_timeout_s``, then stop."""
        if self._producer is not None and not self._queue.empty():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._drained(), drain_timeout_s)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._producer is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._producer.stop(), drain_timeout_s)
            self._producer = None

    async def _drained(self) -> None:
        while not self._queue.empty():
            await asyncio.sleep(0.02)

    async def _connect(self) -> AIOKafkaProducer:
        while True:
            p = producer(self.settings, request_timeout_ms=int(self.send_timeout_s * 1000) + 1000)
            try:
                await start_client(p, self.settings)
                log.info("feature log connected to %s", self.settings.bootstrap_servers)
                return p
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await p.stop()
                raise
            except BrokerUnavailable as err:
                log.warning("feature log: %s; retrying in %.1fs (buffering meanwhile)", err, self.retry_s)
                await asyncio.sleep(self.retry_s)

    async def _run(self) -> None:
        while True:
            try:
                if self._producer is None:
                    self._producer = await self._connect()
                key, value = await self._queue.get()
                batch = [(key, value)]
                while len(batch) < 500 and not self._queue.empty():
                    batch.append(self._queue.get_nowait())
                metrics.FEATURE_LOG_BUFFERED.set(self._queue.qsize())
                await self._send(batch)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the logger must outlive any broker trouble
                log.exception("feature log loop error; continuing")
                await asyncio.sleep(self.retry_s)

    async def _send(self, batch: list[tuple[bytes, bytes]]) -> None:
        assert self._producer is not None
        try:
            futures = [await asyncio.wait_for(self._producer.send(self.topic, value, key=key),
                                              self.send_timeout_s) for key, value in batch]
            await asyncio.wait_for(asyncio.gather(*futures), self.send_timeout_s)
        except Exception as err:  # noqa: BLE001 - timeouts and Kafka errors alike
            self._drop("send_failed", len(batch))
            log.warning("feature log: dropped %d records: %r", len(batch), err)
            return
        self.sent += len(batch)
        metrics.FEATURE_LOG_SENT.inc(len(batch))
        shared_metrics.MESSAGES_PRODUCED.labels(self.service, self.topic).inc(len(batch))
