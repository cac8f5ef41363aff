"""The online joiner service: features ⋈ actions -> examples. Run it with ``python -m joiner``.

Each batch (up to ``joiner.batch_size`` records from both input topics, or what arrived within
``joiner.batch_timeout_s``):

1. decode; malformed records go to the dead-letter topic (awaited) and are skipped;
2. join in :class:`joiner.core.JoinCore` (pure, event-time rules), then close the windows the
   action watermark has passed and forget orphans/tombstones the watermarks have passed;
3. ask the broker whether its data was reset (:class:`services.tansu_quirks.EpochWatch`);
4. produce the batch's examples to ``examples``, one columnar batch record
   (:mod:`services.example_batch`) per output partition, the partition being the default
   partitioner's of the user id (:class:`joiner.kafka_io.BatchedSender`), and wait for every ack;
5. write all state changes *and the next input offsets* in one atomic RocksDB batch.

A crash anywhere before 5 replays the batch from the previous offsets against the previous state
and, because every decision is deterministic, re-emits the same examples: the topic is
at-least-once and the duplicates are exact copies (per example: batch boundaries may differ)
with the same ``example_id``, removed by
:func:`joiner.dedup.dedup` / the dumper. See ``joiner/README.md``.

A record that decodes but makes the join raise is dead-lettered (kind ``failed``) and skipped:
the batch is rolled back to the last commit, the records before it are applied and committed,
and the loop goes on after it; the failure depends only on the record and the state, so a replay
skips it the same way. A broker reset (step 3, or a recorded epoch that differs at start-up)
keeps the committed join state, drops the batch in flight and the input offsets, produces the
examples of the last ``joiner.output_retention_s`` again (:mod:`joiner.output_spool`: the
dumper and the trainer may not have read them) and re-reads both topics from the start of the
new topics (:mod:`joiner.offsets`); what the state remembers makes re-read records duplicates.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from aiokafka import TopicPartition

from joiner import metrics as jm
from joiner.core import JoinCore
from joiner.kafka_io import SERVICE, BatchedSender, InputConsumer
from joiner.offsets import LEGACY_MARKER, OffsetBook
from joiner.output_spool import OutputSpool
from joiner.stores import open_store, store_path
from joiner.tiered import TieredState
from joiner.types import JoinConfig
from services import metrics, tansu_quirks
from services.codecs import processing_failed
from services.kafka import BrokerUnavailable, create_topics, producer, start_client
from services.log import setup_logging
from services.settings import Settings, get_settings

log = logging.getLogger(__name__)


# 2: time-index entries per FeatureLog group (joiner.core), value = item ids.
# 3: an impression record's payload is joiner.batches.payload (no longer Example bytes).
STATE_FORMAT = b"3"


def _check_state_format(store: object, url: str) -> None:
    """Refuse state written in another layout (it would be misread), mark a new store."""
    fmt = store.get(b"Mformat")  # type: ignore[attr-defined]
    if fmt == STATE_FORMAT:
        return
    if fmt is not None or next(iter(store.scan(b"", b"\xff")), None) is not None:  # type: ignore[attr-defined]
        raise RuntimeError(f"joiner state at {url} has format {fmt!r}, this joiner writes {STATE_FORMAT!r}: "
                           "remove it to rebuild the state from the input topics")
    store.write({b"Mformat": STATE_FORMAT})  # type: ignore[attr-defined]


def default_store_url(settings: Settings) -> str:
    return settings.joiner.store_url or f"rocksdb://{settings.var_dir / 'joiner' / 'state'}"


def _offset_key(tp: TopicPartition) -> bytes:
    return b"Moff:" + tp.topic.encode() + b":" + str(tp.partition).encode()


def _apply(changes: dict[bytes, bytes | None], state: TieredState) -> None:
    for key, value in changes.items():
        if value is None:
            state.delete(key)
        else:
            state.put(key, value)


def _positions_of(records: Sequence[tuple]) -> dict[TopicPartition, int]:
    """The next offset per partition after ``records`` (raw record last in each tuple)."""
    return {TopicPartition(r[-1].topic, r[-1].partition): r[-1].offset + 1 for r in records}


class _Batches:
    """The per-batch steps of :func:`run` over its open resources: join, commit, and the two ways
    off the straight path (a record that fails, a broker reset)."""

    def __init__(self, settings: Settings, core: JoinCore, state: TieredState, consumer: InputConsumer,
                 sender: BatchedSender, watch: tansu_quirks.EpochWatch, book: OffsetBook, parts: list[int]) -> None:
        self.settings, self.core, self.state, self.consumer = settings, core, state, consumer
        self.sender, self.watch, self.book, self.parts = sender, watch, book, parts
        self.features_topic = settings.topics.features
        self.spill_after_ms = int(settings.joiner.spill_after_seconds * 1000)
        self.published: dict[str, int] = {}

    async def finish(self, positions: dict[TopicPartition, int], started: float,
                     counts: Counter[str] | None = None) -> bool:
        """Produce the batch's examples, then commit its state and ``positions`` atomically.

        False if the broker's data was reset: then the batch is dropped (rolled back, ``counts``
        being the counters before it) and both inputs are re-read from the new topics' start."""
        core, state, book = self.core, self.state, self.book
        # The commit is the point of no return for these offsets: check that they still name
        # records of this broker's data (about a millisecond).
        reset_to = await self.watch.check() if positions else None
        if reset_to is not None:
            await self.reset(reset_to, counts if counts is not None else Counter(core.counts))
            return False
        out = core.take()
        if out:
            n_records, bad = await self.sender.send_all(out)
            now_ms = time.time() * 1000
            for e in out:
                if e[6]:
                    jm.JOIN_LATENCY.observe(max(0.0, (now_ms - e[6]) / 1000))
            if bad:
                core.counts["bad_examples"] += sum(bad.values())
                core.counts.update({f"bad_examples_{reason}": n for reason, n in bad.items()})
            jm.EXAMPLES.inc(len(out) - sum(bad.values()))
            metrics.MESSAGES_PRODUCED.labels(SERVICE, self.settings.topics.examples).inc(n_records)
        if positions:
            c = self.consumer.consumer
            highwaters = {tp: hw for tp in book.tps if (hw := c.highwater(tp)) is not None}
            _apply(book.commit(positions, highwaters), state)
        state.commit()
        jm.SPILLED.inc(state.evict(min(core.wf[p] for p in self.parts) - self.spill_after_ms))
        _publish(core, state, self.parts, self.published)
        jm.BATCH_SECONDS.observe(time.perf_counter() - started)
        return True

    async def reset(self, epoch: str, counts: Counter[str]) -> None:
        """The broker's data was reset under a batch: drop the batch, keep the committed state,
        drop the offsets and re-read both inputs from the start of the new topics.

        The batch may hold records read at the old offsets from the *new* topics (the later ones
        of a partition before the earlier ones): joining them would move the watermarks past the
        records skipped, which would then come as late; so nothing of it is kept. Records of the
        old data in it are lost with the rest of what was not committed (counted)."""
        self.state.rollback()
        self.core.rollback(self.parts, counts)
        changes, lost = self.book.reset(self.state.peek, epoch)
        _apply(changes, self.state)
        self.state.commit()
        await create_topics(self.settings)  # (the reset removed them; a producer may not have yet)
        if self.sender.spool is not None:  # what the dumper and the trainer may not have read
            await self.sender.spool.resend(self.sender, epoch)
        for tp in self.book.tps:
            await self.consumer.consumer.seek_to_beginning(tp)
        log.warning("broker reset: the join state is kept, both inputs are re-read from the start of the new "
                    "topics; records not consumed before the reset are lost: %s", lost)

    def join(self, records: Sequence[tuple], touched: set[int]) -> tuple[int, Exception] | None:
        """Apply the records, then advance the touched partitions. On a record that raises:
        its index and the error (the state is half-changed then: roll it back)."""
        core, features = self.core, self.features_topic
        i = 0
        try:
            for i, (topic, p, value, ts, _) in enumerate(records):
                touched.add(p)
                if topic == features:
                    core.on_features(p, value, ts)
                else:
                    core.on_action(p, value, ts)
        except (MemoryError, OSError):
            raise  # the machine's fault, not the record's
        except Exception as err:  # noqa: BLE001 - whatever a record triggers, it must not loop
            return i, err
        for p in sorted(touched):
            core.advance(p)
        return None

    async def process(self, records: list[tuple], positions: dict[TopicPartition, int], touched: set[int]) -> None:
        """Join one polled batch and commit it. A record that fails is dead-lettered and skipped:
        the others are joined as if it were not there, so a replay skips it the same way."""
        started = time.perf_counter()
        while True:
            counts = Counter(self.core.counts)
            failed = self.join(records, set(touched))
            if failed is None:
                await self.finish(positions, started, counts)
                return
            i, err = failed
            self.state.rollback()
            self.core.rollback(self.parts, counts)
            if i:
                if self.join(records[:i], set(touched)) is not None:
                    raise RuntimeError("records that joined a moment ago failed on a second try") from err
                if not await self.finish(_positions_of(records[:i]), started, counts):
                    return  # a broker reset: everything is read again
            bad = records[i][-1]
            await (await self.consumer.dead_letter(bad, processing_failed(err)))
            self.core.counts["failed_records"] += 1
            records, touched = records[i + 1:], (set() if i else touched)  # (advanced if committed)

    async def advance(self, parts: Sequence[int], *, drain: bool = False) -> None:
        """Close what the watermarks passed (or everything, ``drain``) as a batch of its own."""
        started = time.perf_counter()
        for p in parts:
            self.core.advance(p, drain=drain)
        await self.finish({}, started)


async def run(
    settings: Settings,
    *,
    stop: asyncio.Event | None = None,
    until_idle_s: float | None = None,
    partitions: Sequence[int] | None = None,
    timings: dict[str, float] | None = None,
) -> dict[str, int]:
    """Run the joiner until ``stop`` is set, or (with ``until_idle_s``) until the input has been
    idle that long and fully consumed: then every open window is closed (drain) and it returns.
    Returns the totals of its counters.

    ``timings`` (benchmarks) receives ``perf_counter`` marks: ``loop_start`` (first poll, after
    start-up), ``last_batch_end`` (last batch with input committed) and ``drain_s`` (the drain's
    own time, without the idle wait before it).

    ``settings.joiner.idle_advance_seconds`` (None = off): when an
    actions partition has had no record for that many wall seconds, its action watermark is
    raised to its features watermark minus ``settings.joiner.idle_advance_margin_seconds``, so
    the windows the features stream has left that far behind close (see the README)."""
    stop = stop or asyncio.Event()
    js = settings.joiner
    cfg = JoinConfig.from_settings(js)
    idle_advance_s = js.idle_advance_seconds
    idle_margin_ms = int(js.idle_advance_margin_seconds * 1000)
    tansu_quirks.install()
    await create_topics(settings)
    url = default_store_url(settings)
    core: JoinCore | None = None
    async with contextlib.AsyncExitStack() as resources:
        watch = tansu_quirks.EpochWatch(settings, SERVICE)
        resources.push_async_callback(watch.stop)
        epoch = await watch.start()
        store = open_store(url)
        resources.callback(store.close)
        _check_state_format(store, url)
        state = TieredState(store, js.cache_size)
        core = JoinCore(state, cfg)
        prod = producer(settings)
        await start_client(prod, settings)
        resources.push_async_callback(prod.stop)
        consumer = InputConsumer(settings, prod)
        resources.push_async_callback(consumer.stop)
        await consumer.start()
        c = consumer.consumer
        parts, tps = await _assignment(c, settings, partitions)
        book = OffsetBook(SERVICE, tps, _offset_key, prefix=b"M")
        state_dir = Path(store_path(url)) if url.startswith("rocksdb://") else None
        _apply(book.at_start(state.peek, epoch, state_dir, "the join state (waiting impressions, tombstones, "
                             "watermarks)"), state)
        state.commit()
        if state_dir is not None:
            (state_dir / LEGACY_MARKER).unlink(missing_ok=True)  # the epoch lives in the store now
        c.assign(tps)
        stored = book.positions(state.peek)
        for tp in tps:
            if tp in stored:
                c.seek(tp, stored[tp])
            else:
                await c.seek_to_beginning(tp)
        for p in parts:
            core.load(p)
        t = settings.topics
        output = OutputSpool(settings, state_dir)
        resources.callback(output.close)
        sender = BatchedSender(prod, t.examples, sorted(await prod.partitions_for(t.examples)), cfg.labels,
                               spool=output)
        await output.resend(sender, epoch)  # (the broker's data was reset while this worker was down)
        batches = _Batches(settings, core, state, consumer, sender, watch, book, parts)
        log.info("joiner started: partitions %s, store %s, window %.0f s, broker epoch %s",
                 parts, url, cfg.window_ms / 1000, epoch)
        metrics.SERVICE_UP.labels(SERVICE).set(1)
        resources.callback(metrics.SERVICE_UP.labels(SERVICE).set, 0)
        # Close what the committed watermarks already passed (only ever something after an idle
        # advance that was committed just before a crash).
        await batches.advance(parts)
        idle_since = time.monotonic()
        last_action = {p: idle_since for p in parts}  # wall time of the last action per partition
        if timings is not None:
            timings["loop_start"] = time.perf_counter()
        while not stop.is_set():
            records, positions = await consumer.poll_raw(int(js.batch_timeout_s * 1000), js.batch_size)
            now = time.monotonic()
            bumped: list[int] = []
            if idle_advance_s is not None:
                for r in records:
                    if r[0] == t.actions:
                        last_action[r[1]] = now
                assert not state.dirty, "between batches"
                bumped = [p for p in parts if now - last_action[p] >= idle_advance_s
                          and core.idle_advance(p, idle_margin_ms)]
                if bumped:
                    # The raised watermark is made durable before anything it causes (closed
                    # windows, examples) and before the records of this poll: a restart then
                    # replays with it, so the re-emitted examples are still exact copies.
                    state.commit()
                    jm.IDLE_ADVANCES.inc(len(bumped))
            if positions:
                idle_since = now
                await batches.process(records, positions, set(bumped))
                if timings is not None:
                    timings["last_batch_end"] = time.perf_counter()
                continue
            if bumped:
                await batches.advance(bumped)
            if until_idle_s is not None and now - idle_since >= until_idle_s and await _caught_up(c, tps):
                started = time.perf_counter()
                await batches.advance(parts, drain=True)
                if timings is not None:
                    timings["drain_s"] = time.perf_counter() - started
                log.info("input idle for %.1f s and fully consumed: drained, stopping", until_idle_s)
                break
    return dict(core.counts) if core is not None else {}


async def _assignment(c: object, settings: Settings, partitions: Sequence[int] | None
                      ) -> tuple[list[int], list[TopicPartition]]:
    """This worker's partitions and input topic-partitions (both inputs need as many partitions)."""
    await c.topics()  # type: ignore[attr-defined]  # full metadata
    t = settings.topics
    nf = c.partitions_for_topic(t.features) or set()  # type: ignore[attr-defined]
    na = c.partitions_for_topic(t.actions) or set()  # type: ignore[attr-defined]
    if len(nf) != len(na) or not nf:
        raise RuntimeError(
            f"{t.features} has {len(nf)} partitions and {t.actions} {len(na)}: the joiner needs "
            "both keyed by request_id with the same partition count, so one request's features "
            "and actions share a partition number"
        )
    parts = sorted(nf) if partitions is None else sorted(partitions)
    return parts, [TopicPartition(topic, p) for p in parts for topic in (t.features, t.actions)]


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
    if args.store:
        settings = settings.updated(joiner={"store_url": args.store})

    async def _main() -> dict[str, int]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await run(settings, stop=stop, until_idle_s=args.until_idle, partitions=parts)

    try:
        totals = asyncio.run(_main())
    except BrokerUnavailable as err:
        log.error("%s", err)
        return 2
    log.info("joiner stopped: %s", {k: v for k, v in sorted(totals.items())})
    return 0
