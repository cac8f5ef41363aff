"""The joiner worker, a Faust app (faust-streaming): ``python -m joiner``; N workers with the same
``joiner.group_id`` share the partitions.

* **Inputs**: both input topics (``features`` and ``actions``, both keyed by request id with
  the default partitioner and with the same partition count, so one request's records share a
  partition number and Faust assigns a partition of both to one worker) are subscribed without
  an agent: :mod:`joiner.faust_fetch` hands each fetch's records to :meth:`JoinerApp.on_records`
  in one call (Faust's per-record streams cost more than the join), which gives them to
  :class:`joiner.worker.Worker` (the pure join stays in :mod:`joiner.core`). Their offsets are
  committed from the worker's state (the timer, a revocation, the stop), not by Faust's acks.
* **Table**: ``state``, raw bytes, one partition per input partition, store ``driftline://``
  (:mod:`joiner.faust_store`: Faust's RocksDB store on rocksdict, recovered batch by batch) with
  the memory cache of :mod:`joiner.tiered` in front. Its changelog topic (:func:`changelog_topic`:
  ``<group>-state-changelog-<broker epoch>``) is how another worker rebuilds a partition (takeover) and how standby replicas follow it.
* **Timer**: the broker-epoch check, the offset commits, idle advance and, with
  ``until_idle_s``, the drain at the end of input.
* **Broker reset**: seen while running (before every batch and tick), the worker writes nothing
  more and :func:`run` raises :class:`BrokerReset` (``main``: exit 3, to be restarted); at
  start-up a new epoch makes the worker re-seed the new epoch's changelog from its local stores
  (:mod:`joiner.faust_reset`).
* **A broker that does not answer** (hung, cut off): the worker's output is sent again until it
  answers (:meth:`joiner.worker.Worker.commit`), and the idle advance's clock stops at its last
  answer (:mod:`joiner.faust_quirks`, quirk 3); nothing ends the worker but a reset or a stop.

The delivery guarantee and the crash cases are in :mod:`joiner.worker`. (Over 450 lines, one
module: the app's start, fetch hand-off, timer, rebalance hooks, stop and :func:`run`'s watchdog
share the app's state.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

import faust
from faust.types import TP

from joiner import faust_fetch, faust_quirks, faust_reset, faust_store
from joiner import metrics as jm
from joiner.config import short_grace_warning
from joiner.kafka_io import SERVICE, BatchedSender
from joiner.output_spool import OutputSpool
from joiner.worker import Worker
from services import broker_reset, metrics, tansu_quirks
from services.cli_args import at_least, run_main, tcp_port
from services.disk import DiskGuard
from services.in_use import IN_USE_EXIT, DirInUse, own_dir
from services.kafka import BrokerUnavailable, create_topics, partition_counts, producer, start_client
from services.kafka_security import faust_credentials
from services.log import setup_logging
from services.rocksdb_faults import exit_on_damage, is_damage, mark_for_check, set_aside_damaged
from services.settings import Settings, get_settings
from services.unanswered_commits import UnansweredCommits

log = logging.getLogger(__name__)
TABLE = "state"
# Faust's RocksDB defaults (64 MB write buffers x 3, a 2 GB block cache) per partition would
# break the joiner's memory bound; the bloom filter keeps "is it waiting?" misses off the disk.
ROCKSDB_OPTIONS = {"write_buffer_size": 8 << 20, "max_write_buffer_number": 2, "block_cache_size": 32 << 20,
                   "bloom_filter_size": 10}


class BrokerReset(RuntimeError):
    """The broker's data was reset under a running worker: it stops, to re-seed on restart."""


class TopicLayoutError(RuntimeError):
    """The input topics are not co-partitioned as the join needs (:func:`check_copartitioned`)."""


class JoinTimeout(RuntimeError):
    """No group assignment for ``joiner.join_timeout_s``: the worker exits to be restarted."""


def state_dir(settings: Settings) -> Path:
    """Where this worker keeps its RocksDB files (Faust's datadir): one per worker process."""
    url = settings.joiner.store_url
    return Path(url.split("://", 1)[1]) if url else settings.var_dir / "joiner" / "faust"


async def check_copartitioned(settings: Settings) -> None:
    """Refuse to start unless ``features`` and ``actions`` both have ``topics.partitions``
    partitions: one request's feature log and actions must land on the same partition number
    (and the state table has that many). A topic another client created first, with the broker's
    own default (Kafka's ``num.partitions``, often 1), puts them apart; without this check the
    worker crashed forwarding a record to its home partition (aiokafka's "Unrecognized
    partition"), on every restart, with no word of why."""
    t = settings.topics
    counts = await partition_counts(settings, [t.features, t.actions])
    if set(counts.values()) != {t.partitions}:
        raise TopicLayoutError(
            f"the join needs {t.features} and {t.actions} with topics.partitions = {t.partitions} partitions "
            f"each; the broker has {counts} (created by another client with its own default?): recreate "
            f"them with {t.partitions} partitions, or set DRIFTLINE_TOPICS__PARTITIONS to their count if "
            "both have the same, for every service")


def changelog_topic(settings: Settings, epoch: str) -> str:
    """The join table's changelog topic on the broker whose data began with ``epoch``.

    One per broker epoch (tansu quirk 5; on Apache Kafka the epoch never changes): a worker
    writes only the changelog of the epoch it started on, and one dying in a broker reset can
    still write to its topic on the new broker (its producer's retries, its stop's flush). On
    one name that debris met the re-seed: tansu answered ListOffsets with 1 and a Fetch with
    nothing, or a Fetch stopped half-way, and a worker dropped its state or could not start.

    >>> changelog_topic(Settings(), "5e1f")
    'driftline-joiner-state-changelog-5e1f'
    """
    return f"{settings.joiner.group_id}-{TABLE}-changelog-{epoch}"


class EpochTable(faust.Table):
    """A Faust table whose changelog topic is ``changelog_name`` (:func:`changelog_topic`), not
    Faust's fixed ``<app id>-<table>-changelog``."""

    def __init__(self, *args: object, changelog_name: str, **kwargs: object) -> None:
        self.changelog_name = changelog_name
        super().__init__(*args, **kwargs)

    def _changelog_topic_name(self) -> str:
        return self.changelog_name


class JoinerApp:
    """The Faust app, its agent and timer, and the :class:`Worker` they drive."""

    def __init__(self, settings: Settings, epoch: str, until_idle_s: float | None = None) -> None:
        tansu_quirks.install_faust(settings)
        faust_store.register()
        self.settings, self.until_idle_s = settings, until_idle_s
        js, t, k = settings.joiner, settings.topics, settings.kafka
        self.app = app = faust.App(
            js.group_id, broker=[f"kafka://{s}" for s in settings.bootstrap_servers.split(",")],
            datadir=str(state_dir(settings)), store="driftline://", topic_partitions=t.partitions,
            table_standby_replicas=js.standby_replicas, broker_session_timeout=js.session_timeout_ms / 1000,
            broker_heartbeat_interval=js.heartbeat_interval_ms / 1000, broker_max_poll_records=k.max_poll_records,
            consumer_auto_offset_reset="earliest", topic_allow_declare=True, topic_disable_leader=True,
            web_enabled=False, autodiscover=False, stream_buffer_maxsize=max(js.batch_size * 2, 4096),
            broker_credentials=faust_credentials(settings),
        )
        raw = dict(key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")
        # (acks=False: Faust does not commit these offsets; commit_offsets() does, from the state)
        self.source = app.topic(t.features, t.actions, acks=False, **raw)
        app.topics.add(self.source)
        faust_fetch.install(app, (t.features, t.actions), self.on_records)
        self.epoch = epoch
        self.changelog = changelog_topic(settings, epoch)
        # (app.Table's own steps, with the table class that names its changelog by epoch)
        self.table = app.tables.add(EpochTable(app, name=TABLE, beacon=app.tables.beacon, changelog_name=self.changelog,
                                               partitions=t.partitions, options=dict(ROCKSDB_OPTIONS),
                                               key_type=bytes, value_type=bytes))
        self.worker: Worker | None = None
        self.output: OutputSpool | None = None  # the examples produced, kept for a broker reset
        self.disk = DiskGuard.from_settings(SERVICE, state_dir(settings), settings)
        self.reset_to: str | None = None  # the new broker epoch, once a reset was seen while running
        self.stopping = False  # (set before the stop waits for the batch in flight)
        self.committed: dict[TP, int] = {}  # input offsets this worker committed last
        self.commits = UnansweredCommits(SERVICE, settings.kafka.connect_timeout_s)
        self.lock = asyncio.Lock()
        self.done = asyncio.Event()
        # (the join watchdog, run(): since when this worker has waited for an assignment)
        self.unassigned_since: float | None = time.monotonic()
        app.on_partitions_assigned.connect(self._on_assigned)
        app.timer(min(1.0, js.batch_timeout_s * 5), name=f"{js.group_id}.tick")(self._tick)
        app.on_partitions_revoked.connect(self._on_revoked)

    def owned(self) -> set[int]:
        """The input partitions assigned to this worker as active (not standby)."""
        return {tp.partition for tp in self.app.assignor.assigned_actives() if tp.topic == self.settings.topics.features}

    async def start(self) -> None:
        """Everything but Faust's own start (:meth:`start_faust`): damaged stores set aside,
        topics, producer, broker epoch."""
        s = self.settings
        stores = faust_store.partition_stores(Path(self.app.conf.tabledir), TABLE).values()
        moved = set_aside_damaged(stores, state_dir(s) / faust_store.CHECK_MARKER)
        if moved:  # (Faust recovers them from the changelog, as for a takeover)
            log.error("%d partition store(s) set aside: rebuilt from the changelog", len(moved))
        jm.STORES_SET_ASIDE.inc(len(moved))
        await create_topics(s)
        await check_copartitioned(s)
        self.prod = producer(s)
        await start_client(self.prod, s)
        await self._check_broker_epoch()
        t = s.topics
        self.output = OutputSpool(s, state_dir(s))
        sender = BatchedSender(self.prod, t.examples, sorted(await self.prod.partitions_for(t.examples)),
                               self.worker_labels(), spool=self.output)
        await self.output.resend(sender, self.epoch)  # (a reset since the last run: the dumper may lack them)
        self.worker = Worker(s, self.table.data, self.changelog, self.prod, sender,
                             highwater_and_age=lambda tp: faust_quirks.highwater_and_age(self.app, tp),
                             keep_sending=self._keep_sending)
        self.watch = broker_reset.EpochWatch(s, SERVICE, self.epoch)
        await self.watch.start()

    async def _keep_sending(self) -> bool:
        """Whether the worker's output, unanswered by the broker, is sent again: not once it
        stops, nor after a broker reset (the restart re-seeds the new changelog first)."""
        if not self.stopping and self.reset_to is None:
            self.reset_to = await self.watch.check()
        return not self.stopping and self.reset_to is None

    def start_faust(self) -> asyncio.Future:
        """Faust's start, as a task: it returns only once the first assignment is recovered, so
        :func:`run` watches it beside the stop signal and the join watchdog."""
        return asyncio.ensure_future(self.app.start())

    async def _check_broker_epoch(self) -> None:
        """If the broker's data was reset since the local stores were written (quirk 5), re-seed
        this epoch's changelog from them first (:mod:`joiner.faust_reset`): it starts empty, and
        Faust refuses a store ahead of its changelog (``ConsistencyError``)."""
        marker = state_dir(self.settings) / "broker-epoch"
        epoch = self.epoch
        recorded = marker.read_text().strip() if marker.exists() else None
        if recorded is not None and recorded != epoch:
            log.warning("the broker's data was reset (epoch %s, local state written on %s): "
                        "re-seeding the changelog from the local state", epoch, recorded)
            await create_topics(self.settings, {self.changelog: self.settings.topics.partitions},
                                configs={self.changelog: {"cleanup.policy": "compact"}})
            await faust_reset.reseed(self.settings, self.prod, Path(self.app.conf.tabledir), TABLE,
                                     self.changelog, epoch)
            metrics.BROKER_RESETS.labels(SERVICE).inc()
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(epoch)

    def worker_labels(self) -> list[str]:
        from joiner.config import JoinConfig

        return JoinConfig.from_settings(self.settings.joiner).labels

    async def stop(self) -> None:
        if self.worker is not None:
            with contextlib.suppress(Exception):  # (only a re-read for the next owner)
                await self.commit_offsets()
            self.worker.drop(list(self.worker.parts))  # (their counts stay in the totals)
        faust_quirks.bound_consumer_thread_stop(self.app)  # (its offsets are committed above)
        await self.app.stop()
        await self.watch.stop()
        await self.prod.stop()
        if self.output is not None:
            self.output.close()

    def unassigned_for(self) -> float:
        """Seconds this worker has been waiting for a group assignment (0 while it has one)."""
        return 0.0 if self.unassigned_since is None else time.monotonic() - self.unassigned_since

    async def _on_assigned(self, app: faust.App, assigned: set[TP], **_: object) -> None:
        self.unassigned_since = None

    async def on_records(self, records: list) -> None:
        """Join one fetch's input records (aiokafka ``ConsumerRecord``s) and commit them, unless
        the broker's data was reset: records read at stale offsets must not count as done."""
        await self.disk.wait_for_space()  # (Faust's fetcher waits meanwhile: back-pressure)
        async with self.lock:
            assert self.worker is not None
            if self.reset_to is None:
                self.reset_to = await self.watch.check()
            if self.reset_to is None:
                seek = await self.worker.process(records, self.owned())
                self._count_consumed(records)
                assigned = self.app.consumer.assignment()
                for tp, offset in seek.items():
                    if TP(tp.topic, tp.partition) in assigned:  # (revoked meanwhile: its next owner reads it)
                        await self.app.consumer.seek(TP(tp.topic, tp.partition), offset)

    def _count_consumed(self, records: list) -> None:
        """The shared consumer metrics (records consumed, lag per partition), as every consumer
        of the stack exports them (the dashboards' joiner lag)."""
        last: dict[tuple[str, int], int] = {}
        for r in records:
            last[(r.topic, r.partition)] = r.offset
        for topic, n in Counter(r.topic for r in records).items():
            metrics.MESSAGES_CONSUMED.labels(SERVICE, topic).inc(n)
        for (topic, p), offset in last.items():
            hw = self.app.consumer.highwater(TP(topic, p))
            if hw is not None:
                metrics.CONSUMER_LAG.labels(SERVICE, topic, str(p)).set(max(0, hw - offset - 1))

    async def commit_offsets(self, partitions: Iterable[int] | None = None) -> None:
        """Commit the group's input offsets of open partitions (all, or ``partitions``) where
        their committed state resumes: a new owner then starts reading there."""
        w = self.worker
        if w is None or self.reset_to is not None:
            return  # (after a reset these offsets would skip the new topics' first records)
        offsets = {TP(tp.topic, tp.partition): n for p, part in w.parts.items()
                   if partitions is None or p in partitions for tp, n in part.next.items()
                   if n > self.committed.get(tp, -1)}
        # (bounded: one the broker never answers would hold the lock, and the join with it, for ever)
        if await self.commits.commit(lambda: faust_fetch.commit(self.app, offsets)):
            self.committed.update(offsets)

    async def _on_revoked(self, app: faust.App, revoked: set[TP], **_: object) -> None:
        self.unassigned_since = time.monotonic()  # (a rebalance begins: the next join is watched)
        async with self.lock:  # (after the batch in flight has committed)
            if self.worker is not None:
                gone = [tp.partition for tp in revoked if tp.topic == self.settings.topics.features]
                try:
                    await self.commit_offsets(gone)
                except Exception as err:  # noqa: BLE001 - logged: the partitions' new owner starts from their last commit
                    log.warning("committing the offsets of revoked partitions %s failed: %r", gone, err)
                self.worker.drop(gone)
                for tp in [tp for tp in self.committed if tp.partition in gone]:
                    del self.committed[tp]

    def _ready(self) -> bool:
        app = self.app
        return not app.rebalancing and app.tables.recovery.completed.is_set() and not app.tables.recovery.in_recovery

    async def _tick(self) -> None:
        if not self.app.tables.recovery.in_recovery:  # (also when Faust's own path ended the rebuild)
            jm.REBUILD_REMAINING.set(0)
        js, w = self.settings.joiner, self.worker
        if w is None or not self._ready() or self.reset_to is not None:
            return
        async with self.lock:
            # (a reset: nothing may be written to the new changelog before the restart re-seeds it)
            self.reset_to = await self.watch.check()
            if self.reset_to is not None:
                return
            await self.commit_offsets()
            if js.idle_advance_seconds is not None:
                await w.idle_advance(js.idle_advance_seconds, int(js.idle_advance_margin_seconds * 1000))
            if self.until_idle_s is None or time.monotonic() - w.last_event < self.until_idle_s:
                return
            owned = sorted(self.owned())
            parts = [await w.part(p) for p in owned]
            if not owned or not self._caught_up(parts, w.last_event + self.until_idle_s):
                return
            started = time.perf_counter()
            await w.advance(parts, drain=True)
            w.timings["drain_s"] = time.perf_counter() - started
            log.info("input idle for %.1f s and fully consumed: drained partitions %s", self.until_idle_s, owned)
            self.done.set()

    def _caught_up(self, parts: list, after: float) -> bool:
        """Whether every input partition of ``parts`` was read to the high watermark of a fetch
        made after ``after`` (``time.monotonic()``): a hung broker's last answer does not count."""
        for part in parts:
            for tp in part.book.tps:
                seen = faust_quirks.highwater_and_age(self.app, TP(tp.topic, tp.partition))
                if seen is None or part.next.get(tp, 0) < seen[0] or time.monotonic() - seen[1] < after:
                    return False
        return True


async def _new_epoch(japp: JoinerApp, tries: int = 10) -> str | None:
    """The broker's new epoch if its data was reset, asking a few times (None also while the
    broker does not answer, as just after a restart)."""
    for _ in range(tries):
        epoch = await japp.watch.check()
        if epoch is not None:
            return epoch
        if await broker_reset.read_broker_epoch(japp.settings, timeout_s=1.0) == japp.epoch:
            return None  # (the broker answers with the epoch this worker started on)
        await asyncio.sleep(0.5)
    return None


async def run(settings: Settings, *, stop: asyncio.Event | None = None, until_idle_s: float | None = None,
              timings: dict[str, float] | None = None) -> dict[str, int]:
    """Run one worker until ``stop`` is set or (``until_idle_s``) its partitions are drained; the
    totals of its counters. ``timings`` (benchmarks) receives ``perf_counter`` marks as
    ``loop_start`` (first batch), ``last_batch_end``, ``drain_s``. Raises :class:`BrokerReset`
    (the broker's data was reset), :class:`JoinTimeout` (no group assignment for
    ``joiner.join_timeout_s``, also at start: Faust's start waits for the first one), and what a
    damaged store raised (:func:`services.rocksdb_faults.is_damage`: marked for the next start, which
    sets the store aside and rebuilds it from the changelog). A state directory another worker
    holds raises :class:`services.in_use.DirInUse` before anything in it is touched."""
    with own_dir(state_dir(settings), "the joiner worker's state directory", "joiner.store_url"):
        try:
            return await _run(settings, stop or asyncio.Event(), until_idle_s, timings)
        except Exception as err:
            if is_damage(err):
                mark_for_check(state_dir(settings) / faust_store.CHECK_MARKER, err)
            raise


async def _run(settings: Settings, stop: asyncio.Event, until_idle_s: float | None,
               timings: dict[str, float] | None) -> dict[str, int]:
    japp = JoinerApp(settings, await broker_reset.ensure_broker_epoch(settings), until_idle_s)
    await japp.start()
    metrics.SERVICE_UP.labels(SERVICE).set(1)
    join_timeout_s = settings.joiner.join_timeout_s
    try:
        starting = japp.start_faust()
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(japp.done.wait())]
        try:
            while not (stop.is_set() or japp.done.is_set()):
                crashed = japp.app.crashed or japp.app.should_stop
                if crashed and japp.reset_to is None:
                    # (a reset often crashes Faust first: its recovery finds the changelog gone)
                    japp.reset_to = await _new_epoch(japp)
                if japp.reset_to is not None:
                    # (the local stores are kept; the next start re-seeds the new changelog)
                    raise BrokerReset(f"the broker's data was reset (new epoch {japp.reset_to}): restart the worker")
                if crashed:
                    # (a crashed Faust service stops itself: exit non-zero, to be restarted)
                    raise RuntimeError(f"the Faust app stopped: {japp.app.crash_reason!r}") from japp.app.crash_reason
                if starting.done() and not starting.cancelled() and starting.exception() is not None:
                    raise starting.exception()  # type: ignore[misc]
                if japp.unassigned_for() > join_timeout_s:
                    # (a group join that never completed: seen on tansu after two workers left
                    # at once; a new process joins as a new member. joiner/README.md)
                    raise JoinTimeout(f"no group assignment for {join_timeout_s:g} s: exiting, to be restarted")
                await asyncio.wait(waits + ([] if starting.done() else [starting]), timeout=0.5,
                                   return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in [*waits, starting]:
                w.cancel()
    finally:
        metrics.SERVICE_UP.labels(SERVICE).set(0)
        japp.stopping = True
        async with japp.lock:
            await japp.stop()
    if japp.worker is None:
        return {}
    if timings is not None:
        timings.update(japp.worker.timings)
    return japp.worker.totals()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m joiner", description=__doc__.split("\n")[0])
    parser.add_argument("--until-idle", type=at_least(0, float), default=None, metavar="S",
                        help="drain and exit once this worker's input has been idle S seconds (replays, tests)")
    parser.add_argument("--store", default=None, help="this worker's state directory URL (default rocksdb://<var>/joiner/faust)")
    parser.add_argument("--metrics-port", type=tcp_port, default=None)
    args = parser.parse_args(argv)
    settings = get_settings()
    setup_logging(SERVICE, settings.log_level)
    port = metrics.serve_metrics(settings.metrics_port if args.metrics_port is None else args.metrics_port)
    log.info("metrics on http://127.0.0.1:%d/metrics", port)
    if args.store:
        settings = settings.updated(joiner={"store_url": args.store})
    if (warning := short_grace_warning(settings.joiner)) is not None:
        log.warning("%s", warning)

    async def _main() -> dict[str, int]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await run(settings, stop=stop, until_idle_s=args.until_idle)

    try:
        code = _exit_code(lambda: asyncio.run(_main()))
    except Exception:  # (logged with its traceback, as an uncaught one would be)
        log.exception("the joiner worker stopped on an error")
        code = 1
    faust_quirks.exit_past_stuck_threads(code)
    return code


def _exit_code(serve: Callable[[], dict[str, int]]) -> int:
    """Run the worker (``serve``): its process's exit code, each known fault logged in a line;
    another error is raised."""
    try:
        totals = serve()
    except BrokerUnavailable as err:
        log.error("%s", err)
        return 2
    except DirInUse as err:  # (another worker's directory: a restart cannot help)
        log.error("%s", err)
        return IN_USE_EXIT
    except BrokerReset as err:
        log.warning("%s", err)
        return broker_reset.RESET_EXIT_CODE
    except JoinTimeout as err:
        log.error("%s", err)
        return 4
    except TopicLayoutError as err:
        log.error("%s", err)
        return 2
    except Exception as err:  # noqa: BLE001 - re-raised unless a store is damaged
        return exit_on_damage(err, "the changelog")
    log.info("joiner stopped: %s", dict(sorted(totals.items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main, "python -m joiner"))
