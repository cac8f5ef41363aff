"""``python -m joiner.dumper``: the ``examples`` topic -> Parquet files by event hour, each example once.

(Near 500 lines: one consumer, whose poll, flatten, write and crash-recovery rules read best beside
each other; the layout table below is a good part of it.)

Each ``examples`` record is one example batch (:mod:`services.example_batch`: an Arrow record
batch); the dumper builds its Parquet tables from the decoded Arrow columns (:func:`flatten`,
renaming ``label.x`` to ``label_x``, ``sparse.s`` to ``sparse_s``, ``dense.d`` to ``dense_d``),
splits a batch's rows by UTC event hour with numpy and drops its duplicates with a mask: no
per-example re-encoding. A record that does not decode is dead-lettered whole.

Layout: ``<var>/examples/dt=YYYY-MM-DD/hour=HH/part-<seq>-<n>.parquet`` (UTC event hour of the
impression). One row per example, flattened so a trainer reads columns with no per-row work:

=====================  ==================  =====================================================
column                 type                meaning
=====================  ==================  =====================================================
example_id             string              request_id + "/" + item_id (unique in the dataset)
request_id             string
item_id                int64
user_id                int64
event_time_ms          int64               impression event time, unix ms
sample_rate            float32             negative-sampling keep rate (1.0 for positives);
                                           log-odds correction: p' = p / (p + (1 - p) / rate)
model_id               string              the model that served the impression
label_<name>           float32             one column per label (label_click, label_like, ...;
                                           absent: 0.0)
sparse_<slot>          list<int64>         one column per sparse slot (context and candidate; an
                                           example without the slot: an empty list)
dense_<name>           float32             one column per dense feature (absent: null)
=====================  ==================  =====================================================

Files of different flushes may have different ``sparse_*``/``dense_*`` column sets (new features
appear); read them with ``pyarrow.dataset.dataset(path, format="parquet", partitioning="hive")``
after unifying schemas (:func:`read_examples` does), missing columns read as null.

Exactly once: the joiner's topic is at-least-once with exact duplicates. The dumper keeps the
example_ids it has written and its own input offsets in RocksDB (``<var>/examples/_state``).
Ids are pruned once their event time is ``dedup_horizon_s`` behind the dedup clock (the
(k+1)-th newest distinct example time written, k = ``joiner.watermark_outliers``, so one
far-future example cannot make it forget every id; :func:`default_dedup_horizon_s`: beyond the
joiner's maximum re-emission distance) *as the clock stood* ``dedup_min_wall_s`` *of wall time
ago* (copies that come back through producer retries, restarts or serving's re-ship after a
broker reset are bounded in wall time, and a fast replay moves event time by hours a second), so
the state stays bounded; an example older than the
horizon is written without a dedup guarantee and counted (``beyond_horizon``). A flush writes
each file to a temp name, fsyncs and renames it, *then* commits ids + offsets + the flush
sequence number in one atomic batch.

Nothing here deletes a Parquet part file. After a crash between the rename and the commit, the
part files above the committed sequence number are *adopted*: their example ids join the dedup
state and the sequence number moves past them, so their rows stay even when their records can no
longer be re-read (a broker reset), and the records that are re-read are duplicates. Only temp
files are removed (a file that cannot be read is renamed ``*.unreadable`` and left alone). A
broker reset (:mod:`joiner.offsets`: noticed before each flush commit and at start-up) keeps the
files and the dedup state and drops only the input offsets: the new topic is read from its start.
An example that decodes but cannot be written (an event time beyond the calendar) is
dead-lettered (kind ``failed``, as a batch of the examples of its record that cannot be placed)
instead of stopping the dumper; the rest of its record is written.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import struct
import time
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
from aiokafka import TopicPartition

from joiner.offsets import LEGACY_MARKER, OffsetBook
from joiner.stores.rocksdb import RocksDBStore
from joiner.watermark import Watermark
from proto import Example
from services import broker_reset, example_batch, metrics, tansu_quirks
from services.atomic import write_parquet_atomic
from services.cli_args import at_least, run_main, tcp_port
from services.codecs import MalformedMessage, processing_failed
from services.disk import DiskGuard
from services.example_batch import BadExampleBatch, ExampleColumns, take
from services.in_use import IN_USE_EXIT, DirInUse, own_dir
from services.kafka import BrokerUnavailable, TypedConsumer, create_topics
from services.log import setup_logging
from services.rocksdb_faults import StoreDamaged, exit_on_damage, is_damage, mark_for_check, set_aside_damaged
from services.settings import Settings, get_settings

log = logging.getLogger(__name__)
SERVICE = "joiner-dumper"
CHECK_MARKER = "_state.check"  # (in the output root: the store was found damaged; read it in full at start)
_I64 = struct.Struct("<q")


_TS = struct.Struct(">Q")
_NO_PRUNE = -(1 << 62)


def default_dedup_horizon_s(settings: Settings) -> float:
    """How far behind the newest example (event time) a duplicate can still arrive, with slack.

    The joiner re-emits only the examples of batches it had not committed when it crashed, and it
    emits an impression's examples while its action watermark is within W + L + R of the
    impression (positives, negatives at window close, corrections) and its features watermark
    has passed the impression; the dumper's dedup clock (the (k+1)-th newest example time it
    wrote) is at most about the features watermark (the same rule over impression times). So W + L + R + G (orphan grace, for actions before features) bounds the distance,
    plus how far the actions stream lags behind the features stream (idle partitions: see
    ``idle_advance_seconds``), for which one hour is added. Set ``--dedup-horizon`` higher when
    the action stream may lag more than that.
    """
    js = settings.joiner
    return js.refused_after_seconds + js.orphan_after_seconds + 3600.0


def flatten(c: ExampleColumns, labels: list[str]) -> pa.Table:
    """A decoded example batch -> one flat table (schema in the module doc), from its Arrow columns
    (no per-example work): ``label.x`` -> ``label_x`` (every label of ``labels`` present, an absent
    label is 0.0), ``sparse.s`` -> ``sparse_s``, ``dense.d`` -> ``dense_d`` (absent: null).

    >>> import numpy as np
    >>> from services.example_batch import decode, encode
    >>> c = ExampleColumns(["r/1", "r/2"], ["r", "r"], np.array([1, 2]), np.array([9, 9]), np.array([5, 6]),
    ...                    np.ones(2, np.float32), ["m", "m"], labels={"click": np.array([1, np.nan], np.float32)},
    ...                    sparse={"genre": (np.array([7, 8]), np.array([0, 2, 2]))},
    ...                    dense={"pop": np.array([0.5, np.nan], np.float32)})
    >>> t = flatten(decode(encode(c)), ["click", "like"])
    >>> t.column_names
    ['example_id', 'request_id', 'item_id', 'user_id', 'event_time_ms', 'sample_rate', 'model_id', 'label_click', 'label_like', 'sparse_genre', 'dense_pop']
    >>> t["label_click"].to_pylist(), t["sparse_genre"].to_pylist(), t["dense_pop"].to_pylist()
    ([1.0, 0.0], [[7, 8], []], [0.5, None])
    """
    n = c.size
    strings = lambda v: v.arrow if hasattr(v, "arrow") else pa.array(list(v), pa.string())  # noqa: E731
    cols = {"example_id": strings(c.example_ids), "request_id": strings(c.request_ids),
            "item_id": pa.array(np.asarray(c.item_id, np.int64)), "user_id": pa.array(np.asarray(c.user_id, np.int64)),
            "event_time_ms": pa.array(np.asarray(c.event_time_ms, np.int64)),
            "sample_rate": pa.array(np.asarray(c.sample_rate, np.float32)), "model_id": strings(c.model_ids)}
    for name in sorted(set(labels).union(c.labels)):
        v = c.labels.get(name)
        cols[f"label_{name}"] = pa.array(np.zeros(n, np.float32) if v is None else np.nan_to_num(v, nan=0.0))
    for name, (ids, offs) in sorted(c.sparse.items()):
        cols[f"sparse_{name}"] = pa.ListArray.from_arrays(pa.array(np.asarray(offs, np.int32)), pa.array(ids, pa.int64()))
    for name, v in sorted(c.dense.items()):
        cols[f"dense_{name}"] = pa.array(v, pa.float32(), mask=np.isnan(v))
    return pa.table(cols)


def hour_dir(root: Path, event_time_ms: int) -> Path:
    t = datetime.fromtimestamp(event_time_ms / 1000, tz=UTC)
    return root / f"dt={t:%Y-%m-%d}" / f"hour={t:%H}"


def _part_seq(path: Path) -> int:
    return int(path.name.split("-")[1])


def _is_temp(path: Path) -> bool:
    """A temp file of :func:`services.atomic.atomic_target` (``.<name>.tmp-<pid>``) or an older ``*.tmp``."""
    return path.name.endswith(".tmp") or (path.name.startswith(".") and ".tmp-" in path.name)


def recover(root: Path, committed_seq: int) -> tuple[dict[str, int], int]:
    """After a crash: remove temp files and read the part files of flushes that renamed their
    files but never committed (sequence number above ``committed_seq``), to be adopted.

    Returns their ``example_id -> event_time_ms`` and the highest sequence number among all part
    files (at least ``committed_seq``), so the next flush's file names are new. A part file that
    cannot be read is renamed ``<name>.unreadable`` (kept, outside :func:`read_examples`)."""
    adopted: dict[str, int] = {}
    top = committed_seq
    for path in sorted(root.glob("dt=*/hour=*/*")):
        if _is_temp(path):
            path.unlink()
            continue
        if not (path.name.startswith("part-") and path.name.endswith(".parquet")):
            continue
        seq = _part_seq(path)
        if seq <= committed_seq:
            continue
        try:
            table = pq.read_table(path, columns=["example_id", "event_time_ms"])
        except (OSError, pa.ArrowException) as err:
            log.error("part file %s cannot be read (%s): renamed *.unreadable, its rows are not adopted", path, err)
            path.rename(path.with_name(path.name + ".unreadable"))
            continue
        top = max(top, seq)
        adopted.update(zip(table["example_id"].to_pylist(), table["event_time_ms"].to_pylist()))
    return adopted, top


def read_examples(root: Path) -> pa.Table:
    """Every dumped example as one table (schemas unified; hive columns dt and hour added)."""
    files = sorted(root.glob("dt=*/hour=*/part-*.parquet"))
    if not files:
        return pa.table({})
    hive = pa.schema([("dt", pa.string()), ("hour", pa.int32())])
    schema = pa.unify_schemas([pq.read_schema(f) for f in files] + [hive])
    return pads.dataset(
        [str(f) for f in files], schema=schema, format="parquet",
        partitioning=pads.partitioning(hive, flavor="hive"), partition_base_dir=str(root),
    ).to_table()


class _Dumper:
    """The dumper's state between flushes over its open resources (see :func:`run`)."""

    def __init__(self, settings: Settings, root: Path, store: RocksDBStore, consumer: TypedConsumer,
                 watch: broker_reset.EpochWatch, book: OffsetBook, horizon_ms: int) -> None:
        self.root, self.store, self.consumer, self.watch, self.book = root, store, consumer, watch, book
        self.settings = settings
        self.horizon_ms = horizon_ms
        self.labels = sorted(set(settings.joiner.label_map.values()))
        raw_seq = store.get(b"seq")
        self.seq = _I64.unpack(raw_seq)[0] if raw_seq else 0
        raw_max = store.get(b"maxt")  # (a store from before the outlier-robust clock)
        self.clock = Watermark.decode(store.get(b"clock"), settings.joiner.watermark_outliers,
                                      _I64.unpack(raw_max)[0] if raw_max else 0)
        #: (wall ms, clock value) at each flush of the last dedup_min_wall_s, plus the newest older
        #: one: the clock pruning goes by is the one that newest older entry saw
        self.min_wall_ms = int(settings.dumper.dedup_min_wall_s * 1000)
        raw_hist = store.get(b"clockhist")
        self.clock_history = np.frombuffer(raw_hist, "<i8").reshape(-1, 2).tolist() if raw_hist else []
        self.buffered: dict[Path, list[pa.Table]] = defaultdict(list)  # rows of each hour's next file
        self.buffered_ids: dict[str, int] = {}  # example_id -> event time
        self.positions: dict[TopicPartition, int] = {}
        self.first_at: float | None = None
        self.prune_floor = 0
        self.totals = {"examples": 0, "duplicates": 0, "files": 0, "pruned_ids": 0, "beyond_horizon": 0,
                       "failed": 0, "adopted_rows": 0}

    def adopt(self) -> None:
        """Take over the part files of a flush that crashed before its commit (:func:`recover`)."""
        ids, top = recover(self.root, self.seq)
        if ids or top > self.seq:
            log.warning("adopted %d rows of part files above the committed flush %d (a crash between "
                        "their rename and the commit): their records read again are duplicates", len(ids), self.seq)
            self.totals["adopted_rows"] += len(ids)
            self.buffered_ids = ids
            self.seq = top - 1  # _commit writes seq + 1
            self._commit({}, write_files=False)

    def _prune_clock(self) -> int:
        """The dedup clock as it stood ``dedup_min_wall_s`` ago; while the history does not reach
        back that far (a fresh state), a clock below every event time: nothing is pruned yet."""
        now = int(time.time() * 1000)
        hist = self.clock_history
        hist.append([now, self.clock.value])
        old = [i for i, (wall, _) in enumerate(hist) if wall <= now - self.min_wall_ms]
        if not old:
            return _NO_PRUNE
        del hist[:old[-1]]  # keep the newest entry old enough and what came after it
        return hist[0][1]

    async def take(self, r: object) -> None:
        """One record: decoded, deduplicated, its rows buffered by their hour's file. Raises
        :class:`MalformedMessage` for a record that does not decode; its examples that cannot be
        filed (no calendar hour) are dead-lettered here (``failed``), the others buffered."""
        try:
            c = example_batch.decode(r.value)  # type: ignore[attr-defined]
        except BadExampleBatch as err:
            raise MalformedMessage(err.kind, err.detail) from err
        if not c.size:
            return
        t = np.asarray(c.event_time_ms, np.int64)
        keep = np.ones(c.size, np.bool_)
        new: dict[str, int] = {}  # this record's ids to buffer (-> event time), once all went well
        ids = list(c.example_ids)
        stored = self.store.get_many([b"S" + eid.encode() for eid in ids])  # one multi-get per record
        for i, (eid, seen) in enumerate(zip(ids, stored)):
            if seen is not None or eid in self.buffered_ids or eid in new:
                keep[i] = False
                self.totals["duplicates"] += 1
            else:
                new[eid] = int(t[i])
        hours = t // 3_600_000
        dirs, unfiled = {}, np.zeros(c.size, np.bool_)
        for h in np.unique(hours[keep]).tolist():
            try:
                dirs[h] = hour_dir(self.root, h * 3_600_000)
            except (OverflowError, ValueError, OSError):  # no calendar hour (year > 9999)
                unfiled |= keep & (hours == h)
        if unfiled.any():
            rows = np.flatnonzero(unfiled)
            for i in rows.tolist():
                del new[c.example_ids[i]]
            keep &= ~unfiled
            self.totals["failed"] += int(rows.size)
            err = ValueError(f"{rows.size} of {c.size} examples have an event time with no calendar hour "
                             f"(the first: {int(t[rows[0]])})")
            await (await self.consumer.dead_letter(SimpleNamespace(
                topic=r.topic, partition=r.partition, offset=r.offset, key=r.key,
                value=example_batch.encode(take(c, rows))), processing_failed(err)))
        if not keep.any():
            return
        table = flatten(c, self.labels)
        old = t < self.clock.value - self.horizon_ms
        self.totals["beyond_horizon"] += int(np.count_nonzero(old & keep))  # ids may have been pruned: written anyway
        self.buffered_ids.update(new)
        for h, directory in dirs.items():
            rows = np.flatnonzero(keep & (hours == h))
            if rows.size:
                self.buffered[directory].append(table.take(pa.array(rows)))

    async def poll(self, timeout_ms: int) -> bool:
        """Fetch and take a batch; True if there were records."""
        c = self.consumer.consumer
        fetched = await c.getmany(timeout_ms=timeout_ms, max_records=self.settings.joiner.batch_size)
        got = False
        for tp, records in fetched.items():
            for r in records:
                got = True
                try:
                    await self.take(r)
                except MalformedMessage as err:
                    await (await self.consumer.dead_letter(r, err))
                except (MemoryError, OSError, StoreDamaged):
                    raise  # the machine's fault or the disk's, not the record's
                except Exception as err:  # noqa: BLE001 - a record this path fails on is dead-lettered, never a crash loop
                    self.totals["failed"] += 1
                    await (await self.consumer.dead_letter(r, processing_failed(err)))
            if records:
                self.positions[tp] = records[-1].offset + 1
                metrics.MESSAGES_CONSUMED.labels(SERVICE, tp.topic).inc(len(records))
        return got

    async def flush(self) -> None:
        """Write the buffered rows (one file per hour), then commit ids, offsets and the sequence
        number; on a broker reset noticed just before the commit, the offsets are dropped and the
        new topic is read from its start."""
        if not self.positions:
            return
        reset_to = await self.watch.check()
        if reset_to is None:
            c = self.consumer.consumer
            highwaters = {tp: hw for tp in self.book.tps if (hw := c.highwater(tp)) is not None}
            changes = self.book.commit(self.positions, highwaters)
        else:
            changes, lost = self.book.reset(self.store.get, reset_to)
            log.warning("broker reset: Parquet files and dedup ids are kept, the examples topic is re-read "
                        "from its start; examples not consumed before the reset are lost: %s", lost)
        self.totals["examples"] += len(self.buffered_ids)
        self._commit(changes, write_files=True)
        if reset_to is not None:
            for tp in self.book.tps:
                await self.consumer.consumer.seek_to_beginning(tp)

    def _commit(self, changes: dict[bytes, bytes | None], *, write_files: bool) -> None:
        self.seq += 1
        seq = self.seq
        if write_files:
            for n, (directory, rows) in enumerate(sorted(self.buffered.items())):
                table = pa.concat_tables(rows, promote_options="default") if len(rows) > 1 else rows[0]
                write_parquet_atomic(table, directory / f"part-{seq:010d}-{n:04d}.parquet")
                self.totals["files"] += 1
        for t in self.buffered_ids.values():
            self.clock.observe(t)
        # Forget the ids the horizon had passed dedup_min_wall_s ago (nothing re-emits them any
        # more), those of this flush included.
        cutoff = self._prune_clock() - self.horizon_ms
        for eid, t in self.buffered_ids.items():
            if t < cutoff:
                self.totals["pruned_ids"] += 1
                continue
            e = eid.encode()
            changes[b"S" + e] = b""
            changes[b"E" + _TS.pack(max(t, 0)) + e] = b""  # event-time index, for pruning
        if cutoff > self.prune_floor:
            # (from the last cutoff, so the scan does not step over the deleted keys again)
            for key, _ in self.store.scan(b"E" + _TS.pack(max(self.prune_floor, 0)), b"E" + _TS.pack(max(cutoff, 0))):
                changes[key] = None
                changes[b"S" + key[9:]] = None
                self.totals["pruned_ids"] += 1
            self.prune_floor = cutoff
        changes[b"seq"] = _I64.pack(seq)
        changes[b"clock"] = self.clock.encode()
        changes[b"clockhist"] = np.asarray(self.clock_history, "<i8").tobytes()
        self.store.write(changes)
        self.buffered.clear()
        self.buffered_ids.clear()
        self.positions.clear()
        self.first_at = None


async def run(
    settings: Settings,
    *,
    out_dir: Path | None = None,
    stop: asyncio.Event | None = None,
    until_idle_s: float | None = None,
) -> dict[str, int]:
    """Dump until ``stop`` (or ``until_idle_s`` of no input), then flush (``settings.dumper``:
    when and how much). Written ids are remembered for ``settings.dumper.dedup_horizon_s`` of
    event time behind the dedup clock (None: :func:`default_dedup_horizon_s`); older ones are
    pruned at each flush. A damaged store (:func:`services.rocksdb_faults.is_damage`) stops it,
    marked: the next start sets it aside and rebuilds it from the Parquet files (every id in
    them adopted, the topic read again from its start: what was not flushed is read again, what
    was is a duplicate). An output root another dumper holds raises
    :class:`services.in_use.DirInUse` before anything in it is touched."""
    root = out_dir or settings.var_dir / "examples"
    with own_dir(root, "the dumper's output root", "var_dir"):
        try:
            return await _run(settings, root, stop or asyncio.Event(), until_idle_s)
        except Exception as err:
            if is_damage(err):
                mark_for_check(root / CHECK_MARKER, err)
            raise


async def _run(settings: Settings, root: Path, stop: asyncio.Event, until_idle_s: float | None) -> dict[str, int]:
    ds = settings.dumper
    flush_rows, flush_interval_s = ds.flush_rows, ds.flush_interval_s
    horizon_s = default_dedup_horizon_s(settings) if ds.dedup_horizon_s is None else ds.dedup_horizon_s
    horizon_ms = int(horizon_s * 1000)
    root.mkdir(parents=True, exist_ok=True)
    tansu_quirks.install()
    await create_topics(settings)
    state_path = root / "_state"
    async with contextlib.AsyncExitStack() as resources:
        watch = broker_reset.EpochWatch(settings, SERVICE)
        resources.push_async_callback(watch.stop)
        epoch = await watch.start()
        if set_aside_damaged([state_path], root / CHECK_MARKER):
            log.error("the dedup ids are rebuilt from the Parquet files and the examples topic is read from its start")
        store = RocksDBStore(f"rocksdb://{state_path}")
        resources.callback(store.close)
        consumer = TypedConsumer(settings, SERVICE, Example, [], None)
        resources.push_async_callback(consumer.stop)
        await consumer.start()
        c = consumer.consumer
        await c.topics()
        topic = settings.topics.examples
        tps = [TopicPartition(topic, p) for p in sorted(c.partitions_for_topic(topic) or [])]
        book = OffsetBook(SERVICE, tps, lambda tp: b"off:" + str(tp.partition).encode())
        store.write(book.at_start(store.get, epoch, state_path, "the Parquet files and the dedup ids"))
        (state_path / LEGACY_MARKER).unlink(missing_ok=True)  # the epoch lives in the store now
        d = _Dumper(settings, root, store, consumer, watch, book, horizon_ms)
        d.adopt()
        c.assign(tps)
        stored = book.positions(store.get)
        for tp in tps:
            if tp in stored:
                c.seek(tp, stored[tp])
            else:
                await c.seek_to_beginning(tp)
        idle_since = time.monotonic()
        disk = DiskGuard.from_settings(SERVICE, root, settings)
        while not stop.is_set():
            if await disk.wait_for_space(stop):
                idle_since = time.monotonic()  # (a pause is not idleness)
                continue
            got = await d.poll(500)
            now = time.monotonic()
            if got:
                idle_since = now
                d.first_at = d.first_at or now
            if len(d.buffered_ids) >= flush_rows or (d.first_at and now - d.first_at >= flush_interval_s):
                await d.flush()
            if not got and until_idle_s is not None and now - idle_since >= until_idle_s:
                break
        await d.flush()
    return d.totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m joiner.dumper", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="output root (default <var>/examples)")
    parser.add_argument("--until-idle", type=at_least(0, float), default=None, metavar="S", help="flush and exit after S idle seconds")
    parser.add_argument("--flush-rows", type=int, default=None, help="(default: dumper.flush_rows)")
    parser.add_argument("--flush-interval", type=float, default=None, metavar="S",
                        help="(default: dumper.flush_interval_s)")
    parser.add_argument("--dedup-horizon", type=float, default=None, metavar="S",
                        help="event-time seconds to remember written ids (default: dumper.dedup_horizon_s, "
                             "else from the joiner's windows)")
    parser.add_argument("--metrics-port", type=tcp_port, default=None)
    args = parser.parse_args(argv)
    flags = {"flush_rows": args.flush_rows, "flush_interval_s": args.flush_interval,
             "dedup_horizon_s": args.dedup_horizon}
    settings = get_settings().updated(dumper={k: v for k, v in flags.items() if v is not None})
    setup_logging(SERVICE, settings.log_level)
    metrics.serve_metrics(settings.metrics_port if args.metrics_port is None else args.metrics_port)

    async def _main() -> dict[str, int]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await run(settings, out_dir=args.out, stop=stop, until_idle_s=args.until_idle)

    try:
        totals = asyncio.run(_main())
    except BrokerUnavailable as err:
        log.error("%s", err)
        return 2
    except DirInUse as err:  # (another dumper's output root: a restart cannot help)
        log.error("%s", err)
        return IN_USE_EXIT
    except Exception as err:  # noqa: BLE001 - re-raised unless a store is damaged
        return exit_on_damage(err, "the Parquet files")
    log.info("dumper stopped: %s", totals)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main, "python -m joiner.dumper"))
