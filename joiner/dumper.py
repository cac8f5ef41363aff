"""``python -m joiner.dumper``: the ``examples`` topic -> Parquet files by event hour, each example once.

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
label_<name>           float32             one column per label (label_click, label_like, ...)
sparse_<slot>          list<int64>         one column per sparse slot (context and candidate)
dense_<name>           float32             one column per dense feature
=====================  ==================  =====================================================

Files of different flushes may have different ``sparse_*``/``dense_*`` column sets (new features
appear); read them with ``pyarrow.dataset.dataset(path, format="parquet", partitioning="hive")``
after unifying schemas (:func:`read_examples` does), missing columns read as null.

Exactly once: the joiner's topic is at-least-once with exact duplicates. The dumper keeps the
example_ids it has written and its own input offsets in RocksDB (``<var>/examples/_state``).
Ids are pruned once their event time is ``dedup_horizon_s`` behind the newest example written
(:func:`default_dedup_horizon_s`: beyond the joiner's maximum re-emission distance), so the state
stays bounded; an example older than the horizon is written without a dedup guarantee and
counted (``beyond_horizon``). A
flush writes each file to a temp name, fsyncs and renames it, *then* commits ids + offsets +
the flush sequence number in one atomic batch. After a crash, part files with a sequence number
above the committed one are deleted (their records are re-read from the committed offsets), so
each example_id is in exactly one file.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import struct
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
from aiokafka import TopicPartition

from joiner.stores.rocksdb import RocksDBStore
from proto import Example
from services.atomic import write_parquet_atomic
from services import metrics, tansu_quirks
from services.kafka import BrokerUnavailable, TypedConsumer, create_topics
from services.log import setup_logging
from services.settings import Settings, get_settings

log = logging.getLogger(__name__)
SERVICE = "joiner-dumper"
_I64 = struct.Struct("<q")


_TS = struct.Struct(">Q")


def default_dedup_horizon_s(settings: Settings) -> float:
    """How far behind the newest example (event time) a duplicate can still arrive, with slack.

    The joiner re-emits only the examples of batches it had not committed when it crashed, and it
    emits an impression's examples while its action watermark is within W + L + R of the
    impression (positives, negatives at window close, corrections) and its features watermark
    has passed the impression; the newest example the dumper has seen is at most the features
    watermark. So W + L + R + G (orphan grace, for actions before features) bounds the distance,
    plus how far the actions stream lags behind the features stream (idle partitions: see
    ``idle_advance_seconds``), for which one hour is added. Set ``--dedup-horizon`` higher when
    the action stream may lag more than that.
    """
    js = settings.joiner
    retention = js.window_seconds if js.late_retention_seconds is None else js.late_retention_seconds
    return (js.window_seconds + js.allowed_lateness_seconds + retention + js.orphan_grace_seconds + 3600.0)


def flatten(examples: list[Example], labels: list[str]) -> pa.Table:
    """Examples -> one flat table (schema in the module doc)."""
    n = len(examples)
    cols: dict[str, list] = {
        "example_id": [e.example_id for e in examples],
        "request_id": [e.request_id for e in examples],
        "item_id": [e.item_id for e in examples],
        "user_id": [e.user_id for e in examples],
        "event_time_ms": [e.event_time_ms for e in examples],
        "sample_rate": [e.sample_rate for e in examples],
        "model_id": [e.model_id for e in examples],
    }
    label_names = sorted(set(labels).union(*(e.labels.keys() for e in examples)))
    sparse_names = sorted(set().union(*(e.features.sparse.keys() for e in examples)))
    dense_names = sorted(set().union(*(e.features.dense.keys() for e in examples)))
    for name in label_names:
        cols[f"label_{name}"] = [e.labels.get(name, 0.0) for e in examples]
    for name in sparse_names:
        cols[f"sparse_{name}"] = [list(e.features.sparse[name].ids) if name in e.features.sparse else None
                                  for e in examples]
    for name in dense_names:
        cols[f"dense_{name}"] = [e.features.dense[name] if name in e.features.dense else None for e in examples]
    types = {"item_id": pa.int64(), "user_id": pa.int64(), "event_time_ms": pa.int64(),
             "sample_rate": pa.float32()}
    arrays = {}
    for k, v in cols.items():
        if k in types:
            t = types[k]
        elif k.startswith(("label_", "dense_")):
            t = pa.float32()
        elif k.startswith("sparse_"):
            t = pa.list_(pa.int64())
        else:
            t = pa.string()
        arrays[k] = pa.array(v, type=t, size=n)
    return pa.table(arrays)


def hour_dir(root: Path, event_time_ms: int) -> Path:
    t = datetime.fromtimestamp(event_time_ms / 1000, tz=timezone.utc)
    return root / f"dt={t:%Y-%m-%d}" / f"hour={t:%H}"


def _part_seq(path: Path) -> int:
    return int(path.name.split("-")[1])


def recover(root: Path, committed_seq: int) -> int:
    """Delete temp files and part files of flushes that never committed; return how many."""
    removed = 0
    for path in list(root.glob("dt=*/hour=*/*")):
        if path.name.endswith(".tmp") or (path.name.startswith("part-") and _part_seq(path) > committed_seq):
            path.unlink()
            removed += 1
    return removed


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


async def run(
    settings: Settings,
    *,
    out_dir: Path | None = None,
    stop: asyncio.Event | None = None,
    until_idle_s: float | None = None,
    flush_rows: int = 100_000,
    flush_interval_s: float = 30.0,
    dedup_horizon_s: float | None = None,
) -> dict[str, int]:
    """Dump until ``stop`` (or ``until_idle_s`` of no input). Written ids are remembered for
    ``dedup_horizon_s`` of event time behind the newest example seen (default
    :func:`default_dedup_horizon_s`); older ones are pruned at each flush."""
    stop = stop or asyncio.Event()
    horizon_ms = int((default_dedup_horizon_s(settings) if dedup_horizon_s is None else dedup_horizon_s) * 1000)
    root = out_dir or settings.var_dir / "examples"
    root.mkdir(parents=True, exist_ok=True)
    tansu_quirks.install()
    await create_topics(settings)
    epoch = await tansu_quirks.ensure_broker_epoch(settings)
    state_path = root / "_state"
    if not tansu_quirks.state_matches_broker(state_path, epoch):
        # The broker lost its data: offsets are meaningless, but written files stay valid.
        import shutil

        shutil.rmtree(state_path)
        tansu_quirks.state_matches_broker(state_path, epoch)
    store = RocksDBStore(f"rocksdb://{state_path}")
    raw_seq = store.get(b"seq")
    seq = _I64.unpack(raw_seq)[0] if raw_seq else 0
    raw_max = store.get(b"maxt")
    max_t = _I64.unpack(raw_max)[0] if raw_max else 0  # newest example event time written
    removed = recover(root, seq)
    if removed:
        log.warning("removed %d part files of a flush that did not commit (crash); re-reading them", removed)
    labels = sorted(set(settings.joiner.label_map.values()))
    consumer = TypedConsumer(settings, SERVICE, Example, [], None)
    totals = {"examples": 0, "duplicates": 0, "files": 0, "pruned_ids": 0, "beyond_horizon": 0}
    try:
        await consumer.start()
        c = consumer.consumer
        await c.topics()
        topic = settings.topics.examples
        tps = [TopicPartition(topic, p) for p in sorted(c.partitions_for_topic(topic) or [])]
        c.assign(tps)
        for tp in tps:
            raw = store.get(b"off:" + str(tp.partition).encode())
            if raw is None:
                await c.seek_to_beginning(tp)
            else:
                c.seek(tp, _I64.unpack(raw)[0])
        buffered: dict[Path, list[Example]] = defaultdict(list)
        buffered_ids: dict[str, int] = {}  # example_id -> event time
        positions: dict[TopicPartition, int] = {}
        first_at = None
        idle_since = time.monotonic()
        prune_floor = [0]

        def flush() -> None:
            nonlocal seq, first_at, max_t
            if not positions:
                return
            seq += 1
            for n, (directory, rows) in enumerate(sorted(buffered.items())):
                write_parquet_atomic(flatten(rows, labels), directory / f"part-{seq:010d}-{n:04d}.parquet")
                totals["files"] += 1
            changes: dict[bytes, bytes | None] = {}
            max_t = max([max_t, *buffered_ids.values()])
            # Forget the ids the horizon has passed (nothing re-emits them any more), those of
            # this flush included.
            cutoff = max_t - horizon_ms
            for eid, t in buffered_ids.items():
                if t < cutoff:
                    totals["pruned_ids"] += 1
                    continue
                e = eid.encode()
                changes[b"S" + e] = b""
                changes[b"E" + _TS.pack(max(t, 0)) + e] = b""  # event-time index, for pruning
            if cutoff > prune_floor[0]:
                # (from the last cutoff, so the scan does not step over the deleted keys again)
                for key, _ in store.scan(b"E" + _TS.pack(prune_floor[0]), b"E" + _TS.pack(cutoff)):
                    changes[key] = None
                    changes[b"S" + key[9:]] = None
                    totals["pruned_ids"] += 1
                prune_floor[0] = cutoff
            for tp, off in positions.items():
                changes[b"off:" + str(tp.partition).encode()] = _I64.pack(off)
            changes[b"seq"] = _I64.pack(seq)
            changes[b"maxt"] = _I64.pack(max_t)
            store.write(changes)
            totals["examples"] += len(buffered_ids)
            buffered.clear()
            buffered_ids.clear()
            positions.clear()
            first_at = None

        while not stop.is_set():
            fetched = await c.getmany(timeout_ms=500, max_records=settings.joiner.batch_size)
            got = False
            for tp, records in fetched.items():
                for r in records:
                    got = True
                    try:
                        e = consumer.codec.decode(r.value)
                    except Exception as err:  # MalformedMessage: dead-letter, skip
                        await (await consumer.dead_letter(r, err))  # type: ignore[arg-type]
                        continue
                    if e.example_id in buffered_ids or store.get(b"S" + e.example_id.encode()) is not None:
                        totals["duplicates"] += 1
                        continue
                    if e.event_time_ms < max_t - horizon_ms:
                        totals["beyond_horizon"] += 1  # its id may have been pruned: written anyway
                    buffered_ids[e.example_id] = e.event_time_ms
                    buffered[hour_dir(root, e.event_time_ms)].append(e)
                if records:
                    positions[tp] = records[-1].offset + 1
                    metrics.MESSAGES_CONSUMED.labels(SERVICE, topic).inc(len(records))
            now = time.monotonic()
            if got:
                idle_since = now
                first_at = first_at or now
            if len(buffered_ids) >= flush_rows or (first_at and now - first_at >= flush_interval_s):
                flush()
            if not got and until_idle_s is not None and now - idle_since >= until_idle_s:
                break
        flush()
    finally:
        await consumer.stop()
        store.close()
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m joiner.dumper", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="output root (default <var>/examples)")
    parser.add_argument("--until-idle", type=float, default=None, metavar="S", help="flush and exit after S idle seconds")
    parser.add_argument("--flush-rows", type=int, default=100_000)
    parser.add_argument("--flush-interval", type=float, default=30.0)
    parser.add_argument("--dedup-horizon", type=float, default=None, metavar="S",
                        help="event-time seconds to remember written ids (default: from the joiner's windows)")
    parser.add_argument("--metrics-port", type=int, default=None)
    args = parser.parse_args(argv)
    settings = get_settings()
    setup_logging(SERVICE, settings.log_level)
    metrics.serve_metrics(settings.metrics_port if args.metrics_port is None else args.metrics_port)

    async def _main() -> dict[str, int]:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await run(settings, out_dir=args.out, stop=stop, until_idle_s=args.until_idle,
                         flush_rows=args.flush_rows, flush_interval_s=args.flush_interval,
                         dedup_horizon_s=args.dedup_horizon)

    try:
        totals = asyncio.run(_main())
    except BrokerUnavailable as err:
        log.error("%s", err)
        return 2
    log.info("dumper stopped: %s", totals)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
