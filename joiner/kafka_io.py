"""The joiner's two ends on Kafka: one consumer for both input topics (decoded, malformed
records dead-lettered) and the batched producer of examples."""

from __future__ import annotations

import asyncio
import math

from aiokafka import TopicPartition
from aiokafka.partitioner import murmur2
from google.protobuf.message import DecodeError

from proto import Action, FeatureLog
from services import metrics
from services.codecs import MalformedMessage, codec_for, validate_feature_log
from services.kafka import TypedConsumer
from services.settings import Settings

SERVICE = "joiner"


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
    """Both input topics in one consumer (one fetch loop), each decoded with its own codec.

    Manual partition assignment, no consumer group: the offsets live in the joiner's state
    store, written in the same atomic batch as the state they produced.
    """

    def __init__(self, settings: Settings, dlq: object) -> None:
        super().__init__(settings, SERVICE, FeatureLog, [], None, dead_letter_producer=dlq)  # type: ignore[arg-type]
        t = settings.topics
        self.decoders = {t.features: decode_feature_log, t.actions: codec_for(Action).decode}

    async def poll_raw(self, timeout_ms: int, max_records: int) -> tuple[list, dict[TopicPartition, int]]:
        """``(topic, partition, message, broker timestamp, raw record)`` of the decoded records,
        and the next offset of each partition that had records."""
        fetched = await self.consumer.getmany(timeout_ms=timeout_ms, max_records=max_records)
        out: list[tuple[str, int, object, int, object]] = []
        positions: dict[TopicPartition, int] = {}
        rejects = []
        for tp, records in fetched.items():
            if not records:
                continue
            decode = self.decoders[tp.topic]
            for r in records:
                try:
                    value = decode(r.value)
                except MalformedMessage as err:
                    rejects.append(await self.dead_letter(r, err))
                    continue
                out.append((tp.topic, tp.partition, value, r.timestamp, r))
            positions[tp] = records[-1].offset + 1
            metrics.MESSAGES_CONSUMED.labels(SERVICE, tp.topic).inc(len(records))
            hw = self.consumer.highwater(tp)
            if hw is not None:
                metrics.CONSUMER_LAG.labels(SERVICE, tp.topic, str(tp.partition)).set(max(0, hw - positions[tp]))
        if rejects:
            await asyncio.gather(*rejects)  # dead letters durable before their offsets are
        return out, positions


class BatchedSender:
    """Produce a batch's examples as one aiokafka record batch per partition (``send_batch``)
    instead of one ``send`` per example: the partition is the default partitioner's (murmur2 of
    the key, memoised per key), so one user's examples keep their order exactly as with ``send``."""

    def __init__(self, prod: object, topic: str, partitions: list[int]) -> None:
        self.prod, self.topic, self.partitions = prod, topic, sorted(partitions)
        self._part: dict[bytes, int] = {}

    def partition(self, key: bytes) -> int:
        p = self._part.get(key)
        if p is None:
            if len(self._part) > 1_000_000:
                self._part.clear()
            p = self._part[key] = self.partitions[(murmur2(key) & 0x7FFFFFFF) % len(self.partitions)]
        return p

    async def send_all(self, records: list[tuple[bytes, bytes, int]]) -> None:
        """Send every ``(key, value, _)`` and wait until all are acknowledged."""
        prod = self.prod
        batches: dict[int, object] = {}
        futures = []
        partition = self.partition
        for key, value, _ in records:
            p = partition(key)
            b = batches.get(p)
            if b is None:
                b = batches[p] = prod.create_batch()  # type: ignore[attr-defined]
            if b.append(key=key, value=value, timestamp=None) is None:  # type: ignore[attr-defined]
                b.close()  # type: ignore[attr-defined]
                futures.append(await prod.send_batch(b, self.topic, partition=p))  # type: ignore[attr-defined]
                b = batches[p] = prod.create_batch()  # type: ignore[attr-defined]
                if b.append(key=key, value=value, timestamp=None) is None:  # type: ignore[attr-defined]
                    raise ValueError(f"an example of {len(value)} bytes exceeds the producer's max_batch_size")
        for p, b in batches.items():
            b.close()  # type: ignore[attr-defined]
            futures.append(await prod.send_batch(b, self.topic, partition=p))  # type: ignore[attr-defined]
        await asyncio.gather(*futures)
