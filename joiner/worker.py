"""The joiner's work inside a Faust worker: one :class:`joiner.core.JoinCore` per owned partition,
its state in that partition of the Faust table's store (:mod:`joiner.faust_store`).

Each batch of input events (both topics, any owned partitions):

1. skip the events the partition's committed state already covers (offset below the input
   offset stored in the state: they were applied before a crash, only Faust's commit of them
   was lost); decode the rest, dead-letter the malformed ones (awaited);
2. join per partition (:meth:`Worker.join`: a record that makes the join raise is dead-lettered
   and the partition's batch is joined again without it), then close what the watermarks passed;
3. produce the examples (:class:`joiner.kafka_io.BatchedSender`) and wait for every ack;
4. per partition, write the state changes and the next input offsets to the changelog followed
   by a commit marker, and wait for the acks;
5. write the same changes and the marker's changelog offset to the local RocksDB (one batch).

Faust acks the events after that and commits their offsets when it likes: the state, not Faust,
says where the input of a partition resumes. A crash before 4 completes leaves the state of the
last committed batch (a half-written changelog batch is held back by the store's recovery and
undone by :meth:`joiner.faust_store.JoinStore.repair`), so the batch is replayed against the same
state and re-emits the same examples: at-least-once on ``examples``, exactly once after dedup.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from aiokafka import AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError

from joiner import metrics as jm
from joiner.config import JoinConfig
from joiner.core import JoinCore
from joiner.faust_store import MARKER, JoinStore, PartitionKV
from joiner.kafka_io import BatchedSender, InputConsumer
from joiner.offsets import OffsetBook
from joiner.partitioning import murmur2_partitions
from joiner.tiered import TieredState
from services import metrics
from services.codecs import MalformedMessage, processing_failed
from services.kafka import send_until_answered, unanswered
from services.rocksdb_faults import StoreDamaged
from services.settings import Settings

T = TypeVar("T")
log = logging.getLogger(__name__)
STATE_FORMAT = b"faust-1"
# (logged when a partition opens; ``make chaos`` reads the watermarks a worker restored after a
# broker reset from it: bench/chaos_postmortem.py, restored_watermarks)
OPENED = "partition %d opened: inputs resume at %s; event-time watermarks: features %d, actions %d"


def _offset_key(tp: TopicPartition) -> bytes:
    return b"Moff:" + tp.topic.encode()


def offset_book(settings: Settings, p: int) -> OffsetBook:
    """Where partition ``p``'s state keeps its input offsets (and broker epoch)."""
    tps = [TopicPartition(settings.topics.features, p), TopicPartition(settings.topics.actions, p)]
    return OffsetBook("joiner", tps, _offset_key, prefix=b"M")


@dataclass
class Part:
    """One owned partition: its join state machine and where its inputs resume."""

    p: int
    kv: PartitionKV
    state: TieredState
    core: JoinCore
    book: OffsetBook
    next: dict[TopicPartition, int] = field(default_factory=dict)
    last_action: float = field(default_factory=time.monotonic)
    published: Counter[str] = field(default_factory=Counter)  # counts already in the metrics
    published_lookups: Counter[str] = field(default_factory=Counter)  # state lookups, the same

    def actions_idle(self, now: float, idle_s: float, unread: int | None) -> bool:
        """Whether the actions input had been idle ``idle_s`` seconds at ``now`` (the time of the
        broker's last answer about it): nothing read for that long, and nothing waiting on the
        broker (``unread``: the records past the read position, by the consumer's high
        watermark; None while not known). An input that lags (a backlog after a restart or a
        broker reset, a fetch that served the features first) is not idle and its clock starts
        again: raising its watermark would close the windows whose actions are already on the
        broker, and turn their clicks into late actions.

        >>> part = Part(0, None, None, None, None, last_action=100.0)
        >>> part.actions_idle(200.0, 30, unread=5)    # a backlog: not idle, the clock restarts
        False
        >>> part.actions_idle(220.0, 30, unread=0)    # caught up, 20 s since the clock restarted
        False
        >>> part.actions_idle(220.0, 30, unread=0)    # the broker has not answered since 220.0
        False
        >>> part.actions_idle(231.0, 30, unread=0)
        True
        >>> part.actions_idle(232.0, 30, unread=None)  # no high watermark yet: not known idle
        False
        >>> part.actions_idle(210.0, 30, unread=3)    # an older answer never winds the clock back
        False
        >>> part.last_action
        232.0
        """
        if unread is None or unread > 0:
            self.last_action = max(self.last_action, now)
            return False
        return now - self.last_action >= idle_s

    def publish(self) -> None:
        """Move this partition's new counts into the process-wide metrics."""
        counts = self.core.counts
        jm.publish({k: n - self.published[k] for k, n in counts.items() if n > self.published[k]})
        self.published = Counter(counts)
        for tier, n in self.state.lookups.items():
            if n > self.published_lookups[tier]:
                jm.LOOKUPS.labels(tier).inc(n - self.published_lookups[tier])
        self.published_lookups = Counter(self.state.lookups)
        p = str(self.p)
        for stream, wm in (("features", self.core.wf[self.p]), ("actions", self.core.wa[self.p])):
            if wm > 0:
                jm.WATERMARK.labels(stream, p).set(wm)
                jm.WATERMARK_LAG.labels(stream, p).set(time.time() - wm / 1000)


async def _never() -> bool:
    return False


class Worker:
    """The join over Faust's events; the caller serialises calls (one batch at a time)."""

    def __init__(self, settings: Settings, store: JoinStore, changelog: str, prod: AIOKafkaProducer,
                 sender: BatchedSender,
                 highwater_and_age: Callable[[TopicPartition], tuple[int, float] | None] = lambda tp: None,
                 keep_sending: Callable[[], Awaitable[bool]] = _never) -> None:
        self.settings, self.store, self.changelog, self.prod, self.sender = settings, store, changelog, prod, sender
        # the consumer's last high watermark of an input partition and the seconds since a fetch
        # renewed it: stored at each commit, so a broker reset can count what it took before this
        # worker read it (faust_reset.py); the idle advance judges "all read" as of that fetch (a
        # hung broker's last answer says nothing of what came since: quirk 3 of joiner.faust_quirks)
        self.highwater_and_age = highwater_and_age
        # whether an output send the broker did not answer is sent again (not after a broker reset,
        # whose new changelog must be re-seeded first, nor once the worker stops)
        self.keep_sending = keep_sending
        self.cfg = JoinConfig.from_settings(settings.joiner)
        t = settings.topics
        self.features, self.actions = t.features, t.actions
        self.inputs = InputConsumer(settings, prod)  # (its decoders and dead-lettering; never started)
        self.parts: dict[int, Part] = {}
        self.counts: Counter[str] = Counter()
        # input partition -> the offset it was sought back to after a gap (see process())
        self.gaps: dict[TopicPartition, int] = {}
        self.last_event = time.monotonic()
        self.spill_after_ms = int(settings.joiner.spill_after_seconds * 1000)
        # perf_counter marks for benchmarks: loop_start (first batch), last_batch_end
        self.timings: dict[str, float] = {}

    # -- partitions ----------------------------------------------------------------------------
    async def part(self, p: int) -> Part:
        """The state of partition ``p``, opened (and its uncommitted changelog tail undone) on
        first use after Faust assigned and recovered it."""
        part = self.parts.get(p)
        if part is not None:
            return part
        kv = self.store.kv(p)
        fmt = kv.get(b"Mformat")
        if fmt not in (None, STATE_FORMAT):
            raise RuntimeError(f"joiner state of partition {p} has format {fmt!r}, this joiner writes "
                               f"{STATE_FORMAT!r}: delete the changelog and local state to rebuild it")
        state = TieredState(kv, max(1, self.settings.joiner.cache_size // self.settings.topics.partitions))
        part = Part(p, kv, state, JoinCore(state, self.cfg), offset_book(self.settings, p))
        repair = self.store.repair(p)
        if repair:
            log.info("partition %d: undoing %d changelog records of a batch that was never committed", p, len(repair))
        if fmt is None:
            repair[b"Mformat"] = STATE_FORMAT
        if repair:
            state.dirty.update(repair)
            state.commit(changelog_offset=await self._send_changelog(p, repair))
        part.next = part.book.positions(state.peek)
        part.core.load(p)
        log.info(OPENED, p, {tp.topic: n for tp, n in part.next.items()}, part.core.wf[p], part.core.wa[p])
        self.parts[p] = part
        return part

    def drop(self, partitions: Sequence[int]) -> None:
        """Forget partitions Faust revoked (their committed state stays in the store/changelog)."""
        for p in partitions:
            part = self.parts.pop(p, None)
            if part is not None:
                self.counts.update(part.core.counts)
                log.info("partition %d closed", p)

    # -- batches -------------------------------------------------------------------------------
    async def process(self, fetched: Sequence[ConsumerRecord], owned: set[int]) -> dict[TopicPartition, int]:
        """Join one batch of input records (aiokafka ``ConsumerRecord``s: timestamps in ms) of
        partitions in ``owned`` and commit it. Returns the input partitions the consumer must
        seek back, to the offset to read next: it went past records of theirs unread (a gap
        after the offset the state resumes at), and their records after the gap are left for
        the re-read, in order. A gap found again at the same offset just after such a seek is
        taken as offsets the broker has no records at (retention; a hole, tansu quirk 8) and
        counted."""
        started = time.perf_counter()
        records: dict[int, list[tuple]] = {}
        rejects = []
        seek: dict[TopicPartition, int] = {}
        decoders = self.inputs.decoders
        actions, now = self.actions, time.monotonic()
        forwards = []
        homes = murmur2_partitions([m.key for m in fetched], self.settings.topics.partitions)
        for m, home in zip(fetched, homes.tolist()):
            p = m.partition
            if p not in owned:
                continue  # revoked while buffered: its new owner reads it
            part = self.parts.get(p) or await self.part(p)
            tp = TopicPartition(m.topic, p)
            expected = part.next.get(tp, 0)
            if m.offset < expected or tp in seek:
                continue  # already in the committed state, or after a gap: read again
            if m.offset > expected and not self._gap(tp, expected, m.offset):
                seek[tp] = expected
                continue
            self.gaps.pop(tp, None)
            part.next[tp] = m.offset + 1
            # A producer with another partitioner than murmur2 (where serving puts a request's
            # feature log and actions) left it away from its request's other records: forward it
            # there; its offset is committed once the send is acknowledged (a crash in between
            # sends it twice: the join counts the copy as a duplicate).
            if home >= 0 and home != p:
                forwards.append(await self.prod.send(m.topic, m.value, key=m.key, partition=home))
                jm.REROUTED.labels(m.topic).inc()
                self.counts["rerouted"] += 1
                continue
            batch = records.setdefault(p, [])
            try:
                value = decoders[m.topic](m.value)
            except MalformedMessage as err:
                rejects.append(await self.inputs.dead_letter(m, err))
                continue
            if m.topic == actions:
                part.last_action = now
            batch.append((m.topic, p, value, m.timestamp, m))
        if rejects or forwards:
            await asyncio.gather(*rejects, *forwards)  # dead letters and forwards durable before their offsets are
        if not records:
            return seek
        self.timings.setdefault("loop_start", started)
        self.last_event = time.monotonic()
        for p, batch in records.items():
            await self.join(self.parts[p], batch)
        await self.commit([self.parts[p] for p in records], started)
        self.timings["last_batch_end"] = time.perf_counter()
        return seek

    def _gap(self, tp: TopicPartition, expected: int, offset: int) -> bool:
        """A record at ``offset`` where ``expected`` is next: False to seek back to ``expected``
        (the first time), True to read on (the same gap again: the broker has no records there;
        counted)."""
        if self.gaps.get(tp) != expected:
            self.gaps[tp] = expected
            jm.INPUT_GAPS.labels(tp.topic).inc()
            log.warning("%s: the consumer went past offsets %d-%d unread; reading them again", tp, expected, offset - 1)
            return False
        del self.gaps[tp]
        jm.INPUT_UNREAD.labels(tp.topic).inc(offset - expected)
        self.counts["input_offsets_unread"] += offset - expected
        log.warning("%s: the broker has no records at offsets %d-%d (deleted by retention, or a hole: tansu "
                    "quirk 8); reading on", tp, expected, offset - 1)
        return True

    def _join_once(self, part: Part, batch: Sequence[tuple]) -> tuple[int, Exception] | None:
        core, features, i = part.core, self.features, 0
        try:
            for i, (topic, p, value, ts, _) in enumerate(batch):  # noqa: B007 - i: where the except below failed
                if topic == features:
                    core.on_features(p, value, ts)
                else:
                    core.on_action(p, value, ts)
        except (MemoryError, OSError, StoreDamaged):
            raise  # the machine's fault or the disk's, not the record's
        except Exception as err:  # noqa: BLE001 - handed back: the record the batch failed on is dead-lettered
            return i, err
        core.advance(part.p)
        return None

    async def join(self, part: Part, batch: list[tuple]) -> None:
        """Join a partition's records; one the join raises on is dead-lettered (kind ``failed``)
        and the others are joined as if it were not there, so a replay skips it the same way."""
        while True:
            counts = Counter(part.core.counts)
            failed = self._join_once(part, batch)
            if failed is None:
                return
            i, err = failed
            part.state.rollback()
            part.core.rollback([part.p], counts)
            await (await self.inputs.dead_letter(batch[i][-1], processing_failed(err)))
            part.core.counts["failed_records"] += 1
            batch = batch[:i] + batch[i + 1:]

    async def advance(self, parts: Sequence[Part], *, drain: bool = False) -> None:
        """Close what the watermarks passed (or everything: ``drain``) as a batch of its own."""
        started = time.perf_counter()
        for part in parts:
            part.core.advance(part.p, drain=drain)
        await self.commit(parts, started)

    async def idle_advance(self, idle_s: float, margin_ms: int) -> None:
        """Raise the action watermark of partitions whose actions were idle ``idle_s`` wall
        seconds (:meth:`Part.actions_idle`) as of the last fetch that renewed their high
        watermark: while the broker does not answer, its last answer says nothing of the actions
        produced since, so the clock stops there. The raised watermark is committed before the
        windows it closes."""
        now = time.monotonic()
        bumped = []
        for part in self.parts.values():
            tp = TopicPartition(self.actions, part.p)
            seen = self.highwater_and_age(tp)
            unread, as_of = (None, now) if seen is None else (seen[0] - part.next.get(tp, 0), now - seen[1])
            if part.actions_idle(as_of, idle_s, unread) and part.core.idle_advance(part.p, margin_ms):
                log.info("partition %d: no actions for %.0f s with all read (offset %d): action watermark raised "
                         "to %d (features watermark - %d ms)", part.p, now - part.last_action, part.next.get(tp, 0),
                         part.core.wa[part.p], margin_ms)
                bumped.append(part)
        if bumped:
            jm.IDLE_ADVANCES.inc(len(bumped))
            await self.commit(bumped, time.perf_counter())
            await self.advance(bumped)

    # -- commit --------------------------------------------------------------------------------
    async def commit(self, parts: Sequence[Part], started: float) -> None:
        out = [e for part in parts for e in part.core.take()]
        if out:
            n_records, bad = await self._until_answered(lambda: self.sender.send_all(out), f"{len(out)} examples")
            now_ms = time.time() * 1000
            for e in out:
                if e[6]:
                    jm.JOIN_LATENCY.observe(max(0.0, (now_ms - e[6]) / 1000))
            if bad:
                bad_counts = {f"bad_examples_{reason}": n for reason, n in bad.items()}
                self.counts.update(bad_counts)
                self.counts["bad_examples"] += sum(bad.values())
                jm.publish(bad_counts)
            jm.EXAMPLES.inc(len(out) - sum(bad.values()))
            metrics.MESSAGES_PRODUCED.labels("joiner", self.settings.topics.examples).inc(n_records)
        for part in parts:
            hws = {tp: seen[0] for tp in part.next if (seen := self.highwater_and_age(tp)) is not None}
            for key, value in part.book.commit(part.next, hws).items():
                part.state.put(key, value)  # type: ignore[arg-type]
        offsets = await self._until_answered(lambda: asyncio.gather(
            *(self._send_changelog(part.p, part.state.dirty) for part in parts)), "the join state's changes")
        for part, off in zip(parts, offsets):
            part.state.commit(changelog_offset=off)
            jm.SPILLED.inc(part.state.evict(part.core.wf[part.p] - self.spill_after_ms))
            part.publish()
        parts_now = self.parts.values()
        jm.WAITING.labels("memory").set(sum(len(part.state.cache) for part in parts_now))
        jm.WAITING.labels("disk").set(max(0, sum(part.core.waiting[part.p] - len(part.state.cache) for part in parts_now)))
        jm.PENDING.set(sum(part.core.pending[part.p] for part in parts_now))
        jm.BATCH_SECONDS.observe(time.perf_counter() - started)

    async def _until_answered(self, send: Callable[[], Awaitable[T]], what: str) -> T:
        """``send()``, sent again while the broker does not answer (a copy of either send is
        harmless: the readers drop an example they have by id, and the changelog's records are
        puts), so a hung broker is waited out instead of ending the worker."""
        async def give_up(err: KafkaError, waited: float) -> bool:
            return not unanswered(err) or not await self.keep_sending()

        return await send_until_answered(send, what, give_up, jm.SEND_WAITING.set)

    async def _send_changelog(self, p: int, changes: dict[bytes, bytes | None]) -> int:
        """Write ``changes`` and a commit marker to changelog partition ``p``; the marker's offset."""
        return await send_changelog(self.prod, self.changelog, p, changes.items())

    def totals(self) -> dict[str, int]:
        """The counters of every partition this worker joined (and of its own steps)."""
        total = Counter(self.counts)
        for part in self.parts.values():
            total.update(part.core.counts)
        return dict(total)


async def send_changelog(prod: AIOKafkaProducer, topic: str, p: int, changes: Iterable[tuple[bytes, bytes | None]]) -> int:
    """Write ``changes`` (a None value: a delete) and a commit marker to partition ``p`` of the
    changelog ``topic`` in as few record batches as fit; the marker's offset once all are acked."""
    futures = []
    b = prod.create_batch()
    n = size = 0
    for key, value in itertools.chain(changes, [(MARKER, b"")]):
        size += len(key) + len(value or b"")
        while b.append(key=key, value=value, timestamp=None) is None:
            if n == 0:
                raise ValueError(f"a changelog record of {len(value or b'')} bytes exceeds max_batch_size")
            b.close()
            futures.append(await prod.send_batch(b, topic, partition=p))
            b, n = prod.create_batch(), 0
        n += 1
    b.close()
    futures.append(await prod.send_batch(b, topic, partition=p))
    metas = await asyncio.gather(*futures)
    jm.CHANGELOG_BYTES.inc(size)
    return metas[-1].offset + n - 1
