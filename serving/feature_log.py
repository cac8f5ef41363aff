"""Feature logging: what /rank scored goes to topic ``features``, and nothing answered is lost.

:meth:`FeatureLogger.submit` runs on the request's path, before the 200: it refuses a FeatureLog
larger than ``serving.feature_log_max_bytes`` (:class:`FeatureLogTooLarge`: the topic could never
take it) and appends the rest to the local spool (:mod:`services.spool`, one RocksDB put), which
survives a ``kill -9``. It never waits for Kafka. One background task ships the spool to Kafka in
order (keyed by request id), retrying every failure with back-off and never dropping an entry;
it marks entries shipped once Kafka acknowledged them, ships the unshipped tail first after a
restart, and after a broker reset re-ships what the spool still retains (the joiner drops the
duplicate impressions). A crash between Kafka's acknowledgement and the shipped mark re-ships
those entries too: delivery is at least once.

``POST /actions`` sends its Actions straight to Kafka (a 202 once acknowledged) and then keeps
them a while in a second spool, ``<spool>-actions`` (:meth:`FeatureLogger.retain_actions`,
already shipped, kept for ``serving.spool_retention_s``): after a broker reset they are sent again
with the feature logs, so an action the reset broker held and nobody had read yet is not lost
with it (the joiner and the recent clicks count an action once). They do not queue behind the
feature logs: a backlog of those (a slow broker) would hold every click back.

Why refuse an oversized log rather than split it: a FeatureLog is one impression group, joined by
request id; split over several messages the joiner would have to know how many parts to wait
for and merge them, and a lost part would corrupt the group. Requests with that many features are
a client error (413), named with the size and the limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path

from aiokafka import AIOKafkaProducer
from aiokafka.errors import MessageSizeTooLargeError, RecordTooLargeError
from google.protobuf.internal.encoder import _VarintBytes

from proto import FeatureLog, Features, ModelVersion
from services import metrics as shared_metrics
from services.aiokafka_quirks import set_lz4_level
from services.disk import DiskGuard
from services.kafka import BrokerUnavailable, producer, start_client
from services.settings import Settings
from services.spool import Entry, Spool, SpoolDamaged, SpoolDiskFull, SpoolError
from serving import metrics
from serving.background import cancel_and_wait, raise_if_cancelled
from serving.broker_epoch import SharedEpoch

log = logging.getLogger(__name__)
_FLOAT = struct.Struct("<f")

_CACHE_MAX = 200_000


def _varint(n: int) -> bytes:
    return _VarintBytes(n)


def features_message(slots: Mapping[str, Sequence[int]], dense: Mapping[str, float] | None = None) -> Features:
    f = Features()
    for name, ids in slots.items():
        f.sparse[name].ids.extend(ids)
    for name, value in (dense or {}).items():
        f.dense[name] = value
    return f


class FeatureLogEncoder:
    """Builds an encoded FeatureLog by concatenating protobuf fields, caching each stored item's
    encoded ``Features`` by its raw feature-store value: a 100-candidate log costs tens of
    microseconds instead of building 100 messages, and the result is plain bytes (nothing for
    the garbage collector to walk while it waits in the buffer).

    >>> enc = FeatureLogEncoder()
    >>> raw = enc.encode("r", 5, 7, Features(), ModelVersion(model_id="m", sparse_version=2),
    ...                  [3], [b"k"], [{"item_id": [3]}], [0.5])
    >>> m = FeatureLog.FromString(raw)
    >>> m.request_id, m.candidates[0].item_id, list(m.candidates[0].features.sparse["item_id"].ids)
    ('r', 3, [3])
    """

    def __init__(self) -> None:
        #: (item_id, raw stored value) -> the encoded candidate up to its score: the field tag and
        #: length, item_id and features, and the score's tag (the score is the only part that
        #: changes between requests, and it is a fixed 4 bytes, so the length is known)
        self._candidates: dict[tuple[int, bytes], bytes] = {}

    def _candidate_head(self, item_id: int, key: bytes | None, slots: Mapping[str, Sequence[int]],
                        dense: Mapping[str, float] | None) -> bytes:
        if key is None:
            return _candidate_head(item_id, features_message(slots, dense).SerializeToString())
        cached = self._candidates.get((item_id, key))
        if cached is None:
            if len(self._candidates) >= _CACHE_MAX:
                self._candidates.clear()
            cached = self._candidates[(item_id, key)] = _candidate_head(
                item_id, features_message(slots, dense).SerializeToString())
        return cached

    def encode(self, request_id: str, event_time_ms: int, user_id: int, context: Features,
               version: ModelVersion, item_ids: Sequence[int], keys: Sequence[bytes | None],
               slots: Sequence[Mapping[str, Sequence[int]]], scores: Sequence[float],
               dense: Sequence[Mapping[str, float] | None] | None = None) -> bytes:
        """One candidate per index of ``item_ids``: its cache key (None: not cacheable, e.g. a
        candidate with features of its own; a key names the candidate's whole features, its
        slots and its dense values: the stored item's), sparse slots, score, and dense values
        (``dense``, None when no candidate has any).

        The cached heads are looked up and interleaved with the packed scores by C-level passes
        (map, slice assignment): a Python loop runs only over the candidates not cached yet."""
        heads: list[bytes | None] = list(map(self._candidates.get, zip(item_ids, keys)))
        if None in heads:
            for i, head in enumerate(heads):
                if head is None:
                    heads[i] = self._candidate_head(item_ids[i], keys[i], slots[i],
                                                    dense[i] if dense is not None else None)
        parts: list[bytes | None] = [None] * (2 * len(heads) + 1)
        parts[0] = FeatureLog(request_id=request_id, event_time_ms=event_time_ms, user_id=user_id,
                              context=context, model_version=version).SerializeToString()
        parts[1::2] = heads
        parts[2::2] = list(map(_FLOAT.pack, scores))
        return b"".join(parts)  # type: ignore[arg-type]


def _candidate_head(item_id: int, features: bytes) -> bytes:
    """A FeatureLog ``candidates`` field (6) but the score's 4 bytes: ``Candidate{item_id = 1,
    features = 2, score = 3 (float)}`` with the score last, so the length is known before it."""
    body = b"".join((b"\x08", _varint(item_id), b"\x12", _varint(len(features)), features, b"\x1d"))
    return b"\x32" + _varint(len(body) + _FLOAT.size) + body


class FeatureLogTooLarge(ValueError):
    """A FeatureLog (+ its key) larger than the topic takes: the request is refused (413)."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(
            f"the feature log of this request is {size} bytes, over the limit of {limit} bytes "
            "(serving.feature_log_max_bytes, kept under the topic's maximum message size): send "
            "fewer candidates or fewer features per candidate")
        self.size = size
        self.limit = limit


# Room for the record batch header and the record's own overhead (aiokafka estimates < 100 bytes)
# on top of key + value, so the producer never refuses a log that submit() accepted.
_RECORD_OVERHEAD = 1024
_BATCH_ENTRIES = 256
_BATCH_BYTES = 8 << 20
_MIN_BACKOFF_S = 0.1
# Errors no retry can fix: the broker refuses the record for its size (a broker whose limit is
# below serving.feature_log_max_bytes). Retrying would stop every later entry for good.
_PERMANENT = (MessageSizeTooLargeError, RecordTooLargeError)


class FeatureLogger:
    """Spools FeatureLogs on :meth:`submit` and ships them to Kafka in the background."""

    def __init__(self, settings: Settings, epochs: SharedEpoch, service: str = "serving") -> None:
        options = settings.serving
        self.settings = settings
        self.topic = settings.topics.features
        self.max_bytes = options.feature_log_max_bytes
        self.send_timeout_s = options.feature_log_send_timeout_s
        self.lz4_level = options.feature_log_lz4_level
        self.retry_s = options.kafka_retry_s
        self.drain_timeout_s = options.spool_drain_timeout_s
        self.service = service
        self.epochs = epochs
        self.spool = Spool(settings.serving_spool_dir, options.spool_max_bytes, sync=options.spool_sync,
                           retention_s=options.spool_retention_s, name="feature-log spool", knobs="serving.spool")
        # A full disk fails RocksDB's writes; refused before the write instead, with a message that
        # says why, a gauge, and /readyz false so a balancer moves the traffic to another replica.
        self.disk = DiskGuard.from_settings(service, self.spool.path, settings)
        self._disk_full = self.disk.full()
        self._disk_checked = time.monotonic()
        self.producer: AIOKafkaProducer | None = None
        self.shipped = 0
        self.reshipped = 0
        self._cursor = self.spool.shipped  # the next position to send
        self._reship_until = 0  # positions below this are being re-shipped after a broker reset
        self._reship_epoch: str | None = None
        self.actions_topic = settings.topics.actions
        self.actions = Spool(Path(f"{settings.serving_spool_dir}-actions"), options.spool_max_bytes,
                             sync=options.spool_sync, retention_s=options.spool_retention_s,
                             name="actions spool", knobs="serving.spool")
        self._actions_cursor: int | None = None  # re-sending the retained actions from here (a reset)
        self._actions_reship_until = 0
        self._warned_actions = 0.0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # (position, monotonic time): the entries from that position on were spooled at or after
        # that time; one mark a second at most, so a long outage keeps a short list. The oldest
        # unshipped entry's age, past the joiner's orphan grace, means its clicks are lost.
        self._spooled_at: deque[tuple[int, float]] = deque([(self.spool.shipped, time.monotonic())])
        self._late_after_s = settings.joiner.orphan_after_seconds
        self._warned_late = False
        metrics.FEATURE_LOG_SPOOL_RECOVERIES.inc(self.spool.recoveries)
        if self.spool.pending:
            log.info("feature-log spool %s: %d entries left unshipped by the last run; shipping them first",
                     self.spool.path, self.spool.pending)
        self._gauges()

    @property
    def connected(self) -> bool:
        return self.producer is not None

    @property
    def buffered(self) -> int:
        """Feature logs spooled and not yet acknowledged by Kafka."""
        return self.spool.pending

    def submit(self, key: str, value: bytes) -> None:
        """Spool one encoded FeatureLog (durable when this returns; see :mod:`services.spool`).

        Raises :class:`FeatureLogTooLarge`, :class:`services.spool.SpoolFull` (its
        :class:`services.spool.SpoolDiskFull` too) or :class:`services.spool.SpoolError`; the
        caller must then not answer 200.
        """
        raw_key = key.encode()
        size = len(raw_key) + len(value)
        if size > self.max_bytes:
            metrics.FEATURE_LOG_REFUSED.labels("too_large").inc()
            raise FeatureLogTooLarge(size, self.max_bytes)
        if self.disk_full():
            metrics.FEATURE_LOG_REFUSED.labels("SpoolDiskFull").inc()
            raise SpoolDiskFull(f"the disk under the feature-log spool {self.spool.path} is nearly full "
                                f"(below disk.pause_below_bytes)")
        try:
            position = self.spool.append(raw_key, value)
        except Exception as err:
            metrics.FEATURE_LOG_REFUSED.labels(type(err).__name__).inc()
            raise
        now = time.monotonic()
        if now - self._spooled_at[-1][1] >= 1.0:
            self._spooled_at.append((position, now))
        metrics.FEATURE_LOG_SPOOLED.inc()
        self._gauges()
        self._wake.set()

    def retain_actions(self, actions: Sequence[tuple[str, bytes]]) -> None:
        """Keep Actions ``(request id, message)`` Kafka acknowledged, to send again after a broker
        reset. Best effort: they are in Kafka already, so a spool that cannot take them (the disk
        full) only loses that protection, said in a warning a minute at most."""
        try:
            if self.disk_full():  # (the feature log's guard: the disk is left to what must be kept)
                raise SpoolDiskFull(f"the disk under {self.actions.path} is nearly full (below disk.pause_below_bytes)")
            entries = []
            for request_id, value in actions:
                key = request_id.encode()
                entries.append(Entry(self.actions.append(key, value), key, value))
            self.actions.mark_shipped(entries)
        except SpoolError as err:
            if time.monotonic() - self._warned_actions >= 60.0:
                self._warned_actions = time.monotonic()
                log.warning("actions not kept for a broker reset (they are in Kafka): %s", err)

    def disk_full(self) -> bool:
        """Whether the spool's disk is nearly full (looked at once per ``disk.check_s``, not per request)."""
        now = time.monotonic()
        if now - self._disk_checked >= self.disk.check_s:
            self._disk_checked, self._disk_full = now, self.disk.full()
        return self._disk_full

    def unshipped_age_s(self) -> float:
        """Wall seconds the oldest entry not yet shipped has waited (to within a second; 0: none).
        An entry left by the last run counts from this run's start."""
        marks, shipped = self._spooled_at, self.spool.shipped
        while len(marks) > 1 and marks[1][0] <= shipped:
            marks.popleft()
        return time.monotonic() - marks[0][1] if self.spool.pending else 0.0

    def _gauges(self) -> None:
        metrics.FEATURE_LOG_PENDING.set(self.spool.pending)
        metrics.FEATURE_LOG_SPOOL_BYTES.set(self.spool.bytes)
        age = self.unshipped_age_s()
        metrics.FEATURE_LOG_UNSHIPPED_AGE.set(age)
        if age > self._late_after_s and not self._warned_late:
            log.warning("feature log: the oldest of %d unshipped feature logs has waited %.0f s, past the joiner's "
                        "orphan grace (%.0f s): the clicks on those that ship this late are lost "
                        "(driftline_joiner_orphan_actions_total)", self.spool.pending, age, self._late_after_s)
        self._warned_late = age > self._late_after_s
        metrics.FEATURE_LOG_LATE.set(int(self._warned_late))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="feature-log")

    async def stop(self) -> None:
        """Ship what can be shipped within ``drain_timeout_s``; the rest stays for the next start."""
        deadline = time.monotonic() + self.drain_timeout_s
        while self.producer is not None and self.spool.pending and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self._task is not None:
            await cancel_and_wait(self._task)
        if self.producer is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.producer.stop(), max(0.5, deadline - time.monotonic()))
            self.producer = None
        if self.spool.pending:
            log.warning("%d feature logs stay in the spool %s: the next start ships them",
                        self.spool.pending, self.spool.path)
        self.spool.close()
        self.actions.close()

    async def _connect(self) -> AIOKafkaProducer:
        if self.lz4_level is not None:  # batches are compressed on the requests' event loop
            set_lz4_level(self.lz4_level)
        while True:
            p = producer(self.settings, request_timeout_ms=int(self.send_timeout_s * 1000) + 1000,
                         max_request_size=self.max_bytes + _RECORD_OVERHEAD)
            try:
                await start_client(p, self.settings)
                log.info("feature log connected to %s", self.settings.bootstrap_servers)
                return p
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    await p.stop()
                raise
            except BrokerUnavailable as err:
                log.warning("feature log: %s; retrying in %.1fs (spooling meanwhile)", err, self.retry_s)
                self._gauges()
                raise_if_cancelled()
                await asyncio.sleep(self.retry_s)

    async def _run(self) -> None:
        backoff = _MIN_BACKOFF_S
        while True:
            damage = None
            try:
                if self.producer is None:
                    self.producer = await self._connect()
                await self._follow_epoch()
                if self._actions_cursor is not None:
                    await self._reship_actions()
                self.spool.trim_expired()
                self.actions.trim_expired()
                self._wake.clear()
                entries = self.spool.read(self._cursor, _BATCH_ENTRIES, _BATCH_BYTES)
                if not entries:
                    self._gauges()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), 1.0)
                    continue
                await self._ship(entries)
                backoff = _MIN_BACKOFF_S
            except asyncio.CancelledError:
                raise
            except SpoolDamaged as err:  # (recovered below: its traceback holds the spool's iterators)
                damage = str(err)
            except Exception as err:  # noqa: BLE001 - shipping retries whatever failed; the entries stay in the spool
                metrics.FEATURE_LOG_SEND_ERRORS.inc()
                log.warning("feature log: shipping failed (%r); retrying in %.1fs, the entries stay "
                            "in the spool", err, backoff)
                self._gauges()
                raise_if_cancelled()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, max(self.retry_s, _MIN_BACKOFF_S))
            if damage is not None:
                self._recover_spool(damage)

    def _recover_spool(self, damage: str) -> None:
        """The spool's files were damaged while running: go on in a fresh spool with its readable
        unshipped entries (:meth:`services.spool.Spool.recover`; /rank's appends run on this
        event loop, so none lands in between), shipping from its start."""
        self.spool.recover(damage)
        self._cursor = self.spool.shipped
        self._spooled_at = deque([(self.spool.shipped, time.monotonic())])  # (ages count from here)
        self._reship_until = 0
        metrics.FEATURE_LOG_SPOOL_RECOVERIES.inc()
        self._gauges()

    async def _follow_epoch(self) -> None:
        """After a broker reset, send the retained (already shipped) entries again: they may have
        lived only in the reset broker."""
        current = await self.epochs.current(1.0)
        if current is None:
            return
        known = self.spool.epoch
        if known is None:
            self.spool.set_epoch(current)
        elif current != known and current != self._reship_epoch:
            self._reship_epoch = current
            self._reship_until = self.spool.shipped
            self._cursor = self.spool.low
            log.warning("feature log: the broker's data was reset: re-shipping the %d retained bytes "
                        "of shipped feature logs", self._reship_until - self._cursor)
            self._actions_cursor, self._actions_reship_until = self.actions.low, self.actions.shipped
        self._end_reship()

    async def _reship_actions(self) -> None:
        """Send the retained actions again (a broker reset), in order; raises on a failed send (the
        loop retries from the first entry not acknowledged)."""
        assert self.producer is not None and self._actions_cursor is not None
        while self._actions_cursor < self._actions_reship_until:
            damage = None
            try:
                entries = self.actions.read(self._actions_cursor, _BATCH_ENTRIES, _BATCH_BYTES)
            except SpoolDamaged as err:  # (this spool's, not the feature log's: recovered here)
                damage = str(err)
            if damage is not None:  # (outside the except: recover wants no traceback holding iterators)
                log.error("actions: the retained actions' spool is damaged (%s): the rest are not re-sent", damage)
                self.actions.recover(damage)
                break
            entries = [e for e in entries if e.position < self._actions_reship_until]
            if not entries:
                break
            sends = [await self.producer.send(self.actions_topic, e.value, key=e.key) for e in entries]
            await asyncio.wait_for(asyncio.gather(*sends), self.send_timeout_s)
            self._actions_cursor = entries[-1].end
            metrics.ACTIONS_RESHIPPED.inc(len(entries))
            shared_metrics.MESSAGES_PRODUCED.labels(self.service, self.actions_topic).inc(len(entries))
        log.warning("actions: re-sent the retained actions after the broker reset")
        self._actions_cursor = None

    def _end_reship(self) -> None:
        """Once the re-shipped range is sent, the spool's entries all live in the new epoch."""
        if self._reship_epoch is not None and self._cursor >= self._reship_until:
            self.spool.set_epoch(self._reship_epoch)
            self._reship_epoch = None

    async def _ship(self, entries: list[Entry]) -> None:
        """Send ``entries`` in order; mark the acknowledged prefix shipped; raise on the first
        entry that failed (it and the ones after it are sent again after the back-off)."""
        assert self.producer is not None
        sends: list[asyncio.Future | BaseException] = []
        for e in entries:
            try:
                async with asyncio.timeout(self.send_timeout_s):  # no task per message, unlike wait_for
                    sends.append(await self.producer.send(self.topic, e.value, key=e.key))
            except _PERMANENT as err:
                sends.append(err)
            await asyncio.sleep(0)  # one message at a time: requests go first
        futures = [f for f in sends if not isinstance(f, BaseException)]
        results = iter(await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True),
                                              self.send_timeout_s))
        done: list[Entry] = []
        skipped = 0
        failure: BaseException | None = None
        for e, sent in zip(entries, sends):
            outcome = sent if isinstance(sent, BaseException) else next(results)
            if isinstance(outcome, _PERMANENT):
                skipped += 1
                metrics.FEATURE_LOG_UNSHIPPABLE.inc()
                log.error("feature log %r (%d bytes) refused by the broker for its size (%r): skipped; "
                          "lower serving.feature_log_max_bytes to the broker's limit",
                          e.key, len(e.value), outcome)
            elif isinstance(outcome, BaseException):
                failure = outcome
                break
            done.append(e)
        if done:
            self._shipped(done, skipped)
        if failure is not None:
            raise failure

    def _shipped(self, done: list[Entry], skipped: int) -> None:
        again = sum(1 for e in done if e.position < self._reship_until)
        self.spool.mark_shipped(done)
        self._cursor = done[-1].end
        sent = len(done) - skipped
        self.shipped += sent
        self.reshipped += again
        metrics.FEATURE_LOG_SHIPPED.inc(sent)
        if again:
            metrics.FEATURE_LOG_RESHIPPED.inc(again)
        shared_metrics.MESSAGES_PRODUCED.labels(self.service, self.topic).inc(sent)
        self._end_reship()
        self._gauges()
