"""The joiner's two ends on Kafka: the input records' decoding (malformed records
dead-lettered) and the producer of columnar example batches (:class:`BatchedSender`)."""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence

from aiokafka.partitioner import murmur2
from google.protobuf.message import DecodeError

from joiner import batches
from joiner.batches import Emitted
from joiner.output_spool import OutputSpool
from proto import Action, FeatureLog
from services import example_batch
from services.codecs import MalformedMessage, codec_for, validate_feature_log
from services.kafka import TypedConsumer
from services.settings import Settings

SERVICE = "joiner"
# A batch record's largest size before it is split: under aiokafka's max_request_size and the
# broker's message.max.bytes (both about 1 MiB by default).
MAX_RECORD_BYTES = 900_000

log = logging.getLogger(__name__)


def _features_ok(f: object) -> bool:
    """Fast check of services.codecs' Features rule: every dense value finite (a float32 sum
    cannot overflow a float64, and a nan/inf term makes the sum non-finite), no empty slot name."""
    return math.isfinite(sum(f.dense.values())) and "" not in f.sparse  # type: ignore[attr-defined]


def decode_feature_log(raw: bytes | None) -> FeatureLog:
    """``codec_for(FeatureLog).decode`` with the same result and errors, faster on valid input:
    the per-candidate validation runs as one cheap check, and the full validator (which raises
    with the precise reason) only when that check fails."""
    if raw is None:
        raise MalformedMessage("undecodable", "FeatureLog value is null")
    m = FeatureLog()
    try:
        m.ParseFromString(raw)
    except (DecodeError, RuntimeError, ValueError):
        raise MalformedMessage("undecodable", "FeatureLog does not parse") from None
    if not (m.request_id and m.event_time_ms > 0 and m.candidates and _features_ok(m.context)
            and all(_features_ok(c.features) for c in m.candidates)):
        validate_feature_log(m)
    return m


class InputConsumer(TypedConsumer):
    """The input topics' decoders (one codec per topic) and the dead-lettering of the records
    they refuse. Never started: the Faust app consumes (:mod:`joiner.faust_fetch`), the worker
    (:mod:`joiner.worker`) only decodes and dead-letters with it."""

    def __init__(self, settings: Settings, dlq: object) -> None:
        super().__init__(settings, SERVICE, FeatureLog, [], None, dead_letter_producer=dlq)
        t = settings.topics
        self.decoders = {t.features: decode_feature_log, t.actions: codec_for(Action).decode}


class BatchedSender:
    """Produce a flush's emitted examples as columnar batch records: one record (an
    :func:`services.example_batch.encode` Arrow IPC batch) per output partition per flush, more
    only when one would exceed ``max_record_bytes`` (split in order).

    An example goes to the partition aiokafka's default partitioner gives its user id key
    (murmur2 of ``str(user_id)``, memoised per key), as when each example was its own record keyed
    by user id; the record is sent to that partition explicitly and has no key (it holds many
    users). Within a record the examples keep their emission order, and a flush's records are all
    acknowledged before the next flush is sent, so one user's examples keep their order.

    Before encoding, the rows are checked once, vectorized (:func:`joiner.batches.valid_rows`):
    a bad example is left out and counted (``bad_examples_<reason>``), the rest of its batch goes.
    """

    def __init__(self, prod: object, topic: str, partitions: list[int], labels: Sequence[str] = (),
                 max_record_bytes: int = MAX_RECORD_BYTES, spool: OutputSpool | None = None) -> None:
        self.prod, self.topic, self.partitions = prod, topic, sorted(partitions)
        self.spool = spool  # keeps what was acknowledged, for a broker reset
        self.labels, self.max_record_bytes = list(labels), max_record_bytes
        self._part: dict[int, int] = {}
        self.parsed = batches.ParsedFeatures()

    def partition(self, key: bytes) -> int:
        """The default partitioner's partition of ``key``."""
        return self.partitions[(murmur2(key) & 0x7FFFFFFF) % len(self.partitions)]

    def _user_partition(self, user_id: int) -> int:
        p = self._part.get(user_id)
        if p is None:
            if len(self._part) > 1_000_000:
                self._part.clear()
            p = self._part[user_id] = self.partition(str(user_id).encode())
        return p

    def encode(self, emitted: Sequence[Emitted]) -> tuple[list[tuple[int, bytes, int]], Counter[str]]:
        """``([(partition, record value, n examples)], bad example counts by reason)``."""
        bad: Counter[str] = Counter()
        return list(self.records(emitted, bad)), bad

    def records(self, emitted: Sequence[Emitted], bad: Counter[str]) -> Iterator[tuple[int, bytes, int]]:
        """``(partition, record value, n examples)`` partition by partition (so the first can be
        sent while the next is encoded); the bad examples left out are added to ``bad``."""
        groups: dict[int, list[Emitted]] = {}
        part = self._user_partition
        for e in emitted:
            p = part(e[0])
            g = groups.get(p)
            if g is None:
                g = groups[p] = []
            g.append(e)
        for p, group in sorted(groups.items()):
            cols, nan_input = batches.build(group, self.labels, self.parsed)
            ok, reasons = batches.valid_rows(cols, nan_input)
            if reasons:
                bad.update(reasons)
                log.warning("left out %d invalid examples of a batch for partition %d: %s",
                            sum(reasons.values()), p, dict(reasons))
                group = [e for e, keep in zip(group, ok.tolist()) if keep]
                if not group:
                    continue
                cols = None
            for raw, n in self._encode(group, cols):
                yield p, raw, n

    def _encode(self, group: Sequence[Emitted], cols: object) -> list[tuple[bytes, int]]:
        raw = example_batch.encode(cols if cols is not None else batches.build(group, self.labels, self.parsed)[0])
        if len(raw) <= self.max_record_bytes or len(group) == 1:
            return [(raw, len(group))]
        h = len(group) // 2
        return self._encode(group[:h], None) + self._encode(group[h:], None)

    async def send_all(self, emitted: Sequence[Emitted]) -> tuple[int, Counter[str]]:
        """Encode and send ``emitted``, wait until every record is acknowledged (then the output
        spool keeps them); return the number of records and the bad examples left out (by reason)."""
        bad: Counter[str] = Counter()
        sent: list[tuple[int, bytes]] = []

        def each() -> Iterator[tuple[int, bytes]]:  # (encoded while the ones before are sent)
            for p, raw, _ in self.records(emitted, bad):
                sent.append((p, raw))
                yield p, raw

        await self.send_raw(each())
        if self.spool is not None:
            self.spool.keep(sent)
        return len(sent), bad

    async def send_raw(self, records: Iterable[tuple[int, bytes]]) -> None:
        """Send encoded records (``(partition, value)``) and wait until each is acknowledged."""
        prod = self.prod
        futures = []
        for p, raw in records:  # each in an aiokafka batch of its own: no linger
            b = prod.create_batch()  # type: ignore[attr-defined]
            if b.append(key=None, value=raw, timestamp=None) is None:
                raise ValueError(f"a batch record of {len(raw)} bytes exceeds the producer's max_batch_size")
            b.close()
            futures.append(await prod.send_batch(b, self.topic, partition=p))  # type: ignore[attr-defined]
        await asyncio.gather(*futures)
