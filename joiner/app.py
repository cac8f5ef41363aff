"""The online joiner service: features ⋈ actions -> examples. Run it with ``python -m joiner``.

Each batch (up to ``joiner.batch_size`` records from both input topics, or what arrived within
``joiner.batch_timeout_s``):

1. decode; malformed records go to the dead-letter topic (awaited) and are skipped;
2. join in :class:`joiner.core.JoinCore` (pure, event-time rules), then close the windows the
   action watermark has passed and forget orphans/tombstones the watermarks have passed;
3. produce the batch's examples to ``examples`` (keyed by user id) and wait for every ack;
4. write all state changes *and the next input offsets* in one atomic RocksDB batch.

A crash anywhere before 4 replays the batch from the previous offsets against the previous state
and, because every decision is deterministic, re-emits the same examples: the topic is
at-least-once and the duplicates are exact copies with the same ``example_id``, removed by
:func:`joiner.dedup.dedup` / the dumper. See ``joiner/README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import shutil
import signal
import struct
import time
from collections.abc import Sequence
from pathlib import Path

from aiokafka import TopicPartition
from aiokafka.partitioner import murmur2
from google.protobuf.message import DecodeError

from joiner import metrics as jm
from joiner.core import JoinCore
from joiner.stores import open_store, store_path
from joiner.tiered import TieredState
from joiner.types import JoinConfig
from proto import Action, FeatureLog
from services import metrics, tansu_quirks
from services.codecs import MalformedMessage, codec_for, validate_feature_log
from services.kafka import BrokerUnavailable, TypedConsumer, create_topics, producer, start_client
from services.log import setup_logging
from services.settings import Settings, get_settings

log = logging.getLogger(__name__)
SERVICE = "joiner"
_I64 = struct.Struct("<q")


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
        fetched = await self.consumer.getmany(timeout_ms=timeout_ms, max_records=max_records)
        out: list[tuple[str, int, object, int]] = []
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
                out.append((tp.topic, tp.partition, value, r.timestamp))
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


STATE_FORMAT = b"2"  # 2: time-index entries per FeatureLog group (joiner.core), value = item ids


def _check_state_format(store: object, url: str) -> None:
    """Refuse state written in another layout (it would be misread), mark a new store."""
    fmt = store.get(b"Mformat")  # type: ignore[attr-defined]
    if fmt == STATE_FORMAT:
        return
    if fmt is not None or next(iter(store.scan(b"", b"\xff")), None) is not None:  # type: ignore[attr-defined]
        store.close()  # type: ignore[attr-defined]
        raise RuntimeError(f"joiner state at {url} has format {fmt!r}, this joiner writes {STATE_FORMAT!r}: "
                           "remove it to rebuild the state from the input topics")
    store.write({b"Mformat": STATE_FORMAT})  # type: ignore[attr-defined]


def default_store_url(settings: Settings) -> str:
    return settings.joiner.store_url or f"rocksdb://{settings.var_dir / 'joiner' / 'state'}"


def _offset_key(tp: TopicPartition) -> bytes:
    return b"Moff:" + tp.topic.encode() + b":" + str(tp.partition).encode()


async def run(
    settings: Settings,
    *,
    stop: asyncio.Event | None = None,
    until_idle_s: float | None = None,
    store_url: str | None = None,
    partitions: Sequence[int] | None = None,
    config: JoinConfig | None = None,
    cache_size: int | None = None,
    timings: dict[str, float] | None = None,
    idle_advance_s: float | None | object = ...,
    idle_advance_margin_s: float | None = None,
) -> dict[str, int]:
    """Run the joiner until ``stop`` is set, or (with ``until_idle_s``) until the input has been
    idle that long and fully consumed: then every open window is closed (drain) and it returns.
    Returns the totals of its counters.

    ``timings`` (benchmarks) receives ``perf_counter`` marks: ``loop_start`` (first poll, after
    start-up), ``last_batch_end`` (last batch with input committed) and ``drain_s`` (the drain's
    own time, without the idle wait before it).

    ``idle_advance_s`` (default ``settings.joiner.idle_advance_seconds``, None = off): when an
    actions partition has had no record for that many wall seconds, its action watermark is
    raised to its features watermark minus ``settings.joiner.idle_advance_margin_seconds``, so
    the windows the features stream has left that far behind close (see the README)."""
    stop = stop or asyncio.Event()
    js = settings.joiner
    cfg = config or JoinConfig.from_settings(js)
    tansu_quirks.install()
    await create_topics(settings)
    url = store_url or default_store_url(settings)
    if url.startswith("rocksdb://"):
        path = Path(store_path(url))
        epoch = await tansu_quirks.ensure_broker_epoch(settings)
        if not tansu_quirks.state_matches_broker(path, epoch):
            shutil.rmtree(path)
            tansu_quirks.state_matches_broker(path, epoch)
    store = open_store(url)
    _check_state_format(store, url)
    state = TieredState(store, js.cache_size if cache_size is None else cache_size)
    core = JoinCore(state, cfg)
    spill_after_ms = int(js.spill_after_seconds * 1000)
    if idle_advance_s is ...:
        idle_advance_s = js.idle_advance_seconds
    if idle_advance_margin_s is None:
        idle_advance_margin_s = js.idle_advance_margin_seconds
    idle_margin_ms = int(idle_advance_margin_s * 1000)
    prod = producer(settings)
    await start_client(prod, settings)
    consumer = InputConsumer(settings, prod)
    totals: dict[str, int] = {}
    try:
        await consumer.start()
        c = consumer.consumer
        await c.topics()  # full metadata
        t = settings.topics
        nf, na = c.partitions_for_topic(t.features) or set(), c.partitions_for_topic(t.actions) or set()
        if len(nf) != len(na) or not nf:
            raise RuntimeError(
                f"{t.features} has {len(nf)} partitions and {t.actions} {len(na)}: the joiner needs "
                "both keyed by request_id with the same partition count, so one request's features "
                "and actions share a partition number"
            )
        parts = sorted(nf) if partitions is None else sorted(partitions)
        sender = BatchedSender(prod, t.examples, sorted(await prod.partitions_for(t.examples)))
        tps = [TopicPartition(topic, p) for p in parts for topic in (t.features, t.actions)]
        c.assign(tps)
        for tp in tps:
            raw = state.peek(_offset_key(tp))
            if raw is None:
                await c.seek_to_beginning(tp)
            else:
                c.seek(tp, _I64.unpack(raw)[0])
        for p in parts:
            core.load(p)
        log.info("joiner started: partitions %s, store %s, window %.0f s", parts, url, cfg.window_ms / 1000)
        metrics.SERVICE_UP.labels(SERVICE).set(1)

        async def finish_batch(positions: dict[TopicPartition, int], started: float) -> None:
            out = core.take()
            if out:
                await sender.send_all(out)
                now_ms = time.time() * 1000
                for _, _, ref in out:
                    if ref:
                        jm.JOIN_LATENCY.observe(max(0.0, (now_ms - ref) / 1000))
                jm.EXAMPLES.inc(len(out))
                metrics.MESSAGES_PRODUCED.labels(SERVICE, t.examples).inc(len(out))
            for tp, off in positions.items():
                state.put(_offset_key(tp), _I64.pack(off))
            state.commit()
            cutoff = min(core.wf[p] for p in parts) - spill_after_ms
            jm.SPILLED.inc(state.evict(cutoff))
            _publish(core, state, parts, published)
            jm.BATCH_SECONDS.observe(time.perf_counter() - started)

        published: dict[str, int] = {}
        # Close what the committed watermarks already passed (only ever something after an idle
        # advance that was committed just before a crash), as a batch of its own.
        started = time.perf_counter()
        for p in parts:
            core.advance(p)
        await finish_batch({}, started)
        idle_since = time.monotonic()
        last_action = {p: idle_since for p in parts}  # wall time of the last action per partition
        if timings is not None:
            timings["loop_start"] = time.perf_counter()
        while not stop.is_set():
            records, positions = await consumer.poll_raw(int(js.batch_timeout_s * 1000), js.batch_size)
            now = time.monotonic()
            bumped: list[int] = []
            if idle_advance_s is not None:
                for _, p, _, _ in (r for r in records if r[0] == t.actions):
                    last_action[p] = now
                assert not state.dirty, "between batches"
                bumped = [p for p in parts if now - last_action[p] >= idle_advance_s
                          and core.idle_advance(p, idle_margin_ms)]
                if bumped:
                    # The raised watermark is made durable before anything it causes (closed
                    # windows, examples) and before the records of this poll: a restart then
                    # replays with it, so the re-emitted examples are still exact copies.
                    state.commit()
                    jm.IDLE_ADVANCES.inc(len(bumped))
            if not positions:
                if bumped:
                    started = time.perf_counter()
                    for p in bumped:
                        core.advance(p)
                    await finish_batch({}, started)
                if until_idle_s is not None and now - idle_since >= until_idle_s:
                    if await _caught_up(c, tps):
                        started = time.perf_counter()
                        for p in parts:
                            core.advance(p, drain=True)
                        await finish_batch({}, started)
                        if timings is not None:
                            timings["drain_s"] = time.perf_counter() - started
                        log.info("input idle for %.1f s and fully consumed: drained, stopping", until_idle_s)
                        break
                continue
            idle_since = now
            started = time.perf_counter()
            touched = set(bumped)
            for topic, p, value, ts in records:
                touched.add(p)
                if topic == t.features:
                    core.on_features(p, value, ts)
                else:
                    core.on_action(p, value, ts)
            for p in sorted(touched):
                core.advance(p)
            await finish_batch(positions, started)
            if timings is not None:
                timings["last_batch_end"] = time.perf_counter()
    finally:
        totals = dict(core.counts)
        metrics.SERVICE_UP.labels(SERVICE).set(0)
        try:
            await consumer.stop()
        finally:
            await prod.stop()
            store.close()
    return totals


async def _caught_up(c: object, tps: list[TopicPartition]) -> bool:
    for tp in tps:
        hw = c.highwater(tp)  # type: ignore[attr-defined]
        if hw is None or await c.position(tp) < hw:  # type: ignore[attr-defined]
            return False
    return True


def _publish(core: JoinCore, state: TieredState, parts: list[int], _last_published: dict[str, int]) -> None:
    """Move this run's counts (totals so far) into the process-wide Prometheus metrics."""
    counts = dict(core.counts)
    jm.publish({k: v - _last_published.get(k, 0) for k, v in counts.items()})
    _last_published.update(counts)
    for tier, n in (("cache", state.cache_hits), ("disk", state.disk_hits), ("miss", state.misses)):
        key = f"lookup_{tier}"
        if n > _last_published.get(key, 0):
            jm.LOOKUPS.labels(tier).inc(n - _last_published.get(key, 0))
        _last_published[key] = n
    waiting = sum(core.waiting[p] for p in parts)
    jm.WAITING.labels("memory").set(len(state.cache))
    jm.WAITING.labels("disk").set(max(0, waiting - len(state.cache)))
    jm.PENDING.set(sum(core.pending[p] for p in parts))
    now = time.time()
    for p in parts:
        for stream, wm in (("features", core.wf[p]), ("actions", core.wa[p])):
            if wm > 0:
                jm.WATERMARK.labels(stream, str(p)).set(wm)
                jm.WATERMARK_LAG.labels(stream, str(p)).set(now - wm / 1000)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m joiner", description=__doc__.split("\n")[0])
    parser.add_argument("--until-idle", type=float, default=None, metavar="S",
                        help="drain and exit once the input has been idle S seconds (replays, tests)")
    parser.add_argument("--partitions", default=None, help="comma-separated partitions (default: all)")
    parser.add_argument("--store", default=None, help="state store URL (default rocksdb://<var>/joiner/state)")
    parser.add_argument("--metrics-port", type=int, default=None)
    args = parser.parse_args(argv)
    settings = get_settings()
    setup_logging(SERVICE, settings.log_level)
    port = metrics.serve_metrics(settings.metrics_port if args.metrics_port is None else args.metrics_port)
    log.info("metrics on http://127.0.0.1:%d/metrics", port)
    parts = [int(x) for x in args.partitions.split(",")] if args.partitions else None

    async def _main() -> dict[str, int]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await run(settings, stop=stop, until_idle_s=args.until_idle, store_url=args.store, partitions=parts)

    try:
        totals = asyncio.run(_main())
    except BrokerUnavailable as err:
        log.error("%s", err)
        return 2
    log.info("joiner stopped: %s", {k: v for k, v in sorted(totals.items())})
    return 0
