"""The dumper: examples topic (example batches, with the joiner's at-least-once duplicates) ->
hourly Parquet, each example exactly once, flat columns; a flush that crashed before committing is
redone."""

from __future__ import annotations

import struct

import pyarrow.compute as pc
import pytest

from joiner import dumper
from joiner.faust_app import run as run_joiner
from joiner.stores.rocksdb import RocksDBStore
from services import example_batch
from services.kafka import create_topics
from services.settings import Settings
from tests.joiner.helpers import JOINER, produce, read_examples
from tests.joiner.synth import ml_events


def batches(topic: str, examples: list, per_record: int = 1) -> list[tuple[str, bytes, bytes]]:
    """``(topic, key, value)`` records of example batches, ``per_record`` examples each."""
    return [(topic, str(examples[a].user_id).encode(),
             example_batch.encode(example_batch.from_examples(examples[a:a + per_record])))
            for a in range(0, len(examples), per_record)]


async def test_dumper_writes_each_example_once_by_event_hour(settings: Settings) -> None:
    await create_topics(settings)
    await produce(settings, ml_events(800, start=60_000, seed=9))
    await run_joiner(settings.updated(joiner=JOINER), until_idle_s=0.5)
    joined = await read_examples(settings)
    # the joiner's examples on a topic of their own as batches of 100, then duplicates as a
    # crashed joiner would leave them: exact copies of whole records and examples again in new
    # records, later in the topic
    s = settings.model_copy(deep=True)
    s.topics.examples = settings.topics.examples + "-batches"
    records = batches(s.topics.examples, joined, 100)
    await create_topics(s)
    await produce(s, records + records[:2] + batches(s.topics.examples, joined[200:300], 30))
    root = settings.var_dir / "examples"
    # ml_events follows ml-1m's file order (by user), so event times jump by years: remember
    # every id here (the horizon has its own test below).
    forever = 20 * 365 * 86400.0
    totals = await dumper.run(s.updated(dumper=dict(flush_rows=1000, dedup_horizon_s=forever)), until_idle_s=1.0)
    assert totals["duplicates"] == 300 and totals["examples"] == len(joined) > 300
    table = dumper.read_examples(root)
    assert table.num_rows == len(joined)
    assert pc.count_distinct(table["example_id"]).as_py() == len(joined)
    expected = {e.example_id: e for e in joined}
    for row in table.select(["example_id", "label_click", "sample_rate", "event_time_ms", "sparse_item", "dense_pop",
                             "sparse_user", "dt", "hour"]).to_pylist()[:200]:
        e = expected[row["example_id"]]
        assert row["label_click"] == e.labels["click"] and abs(row["sample_rate"] - e.sample_rate) < 1e-6
        assert row["sparse_item"] == list(e.features.sparse["item"].ids)
        assert row["sparse_user"] == [e.user_id]
        assert str(dumper.hour_dir(root, e.event_time_ms)).endswith(f"dt={row['dt']}/hour={row['hour']:02d}")
    # A part file that cannot be read is set aside, not deleted, and not read as data.
    before = sorted(p.name for p in root.glob("dt=*/hour=*/part-*.parquet"))
    ghost = root / "dt=2000-01-01" / "hour=00" / "part-9999999999-0000.parquet"
    ghost.parent.mkdir(parents=True)
    ghost.write_bytes(b"partial")
    await produce(s, batches(s.topics.examples, joined[:10], 10))
    totals = await dumper.run(s.updated(dumper=dict(dedup_horizon_s=forever)), until_idle_s=1.0)
    assert totals["duplicates"] == 10 and totals["examples"] == 0 and not ghost.exists()
    assert ghost.with_name(ghost.name + ".unreadable").read_bytes() == b"partial"
    assert sorted(p.name for p in root.glob("dt=*/hour=*/part-*.parquet")) == before


def test_flatten_empty() -> None:
    t = dumper.flatten(example_batch.decode(example_batch.encode(example_batch.from_examples([]))), ["click"])
    assert t.num_rows == 0 and "label_click" in t.column_names


async def test_dumper_prunes_ids_beyond_the_dedup_horizon(settings: Settings) -> None:
    from proto import Example

    await create_topics(settings)
    hour = 3_600_000
    t0 = 1_700_000_000_000

    def ex(i: int, t: int) -> Example:
        return Example(example_id=f"h/{i}", request_id="h", item_id=i, user_id=1, event_time_ms=t, sample_rate=1.0)

    # 10 hours of examples, one every 6 minutes; horizon 2 hours.
    first = [ex(i, t0 + i * hour // 10) for i in range(100)]
    await produce(settings, batches(settings.topics.examples, first, 10))
    root = settings.var_dir / "examples"
    pruning_now = dict(dedup_horizon_s=7200, dedup_min_wall_s=0)  # the event-time rule alone
    totals = await dumper.run(settings.updated(dumper=dict(flush_rows=10, **pruning_now)), until_idle_s=1.0)
    assert totals["examples"] == 100
    # The dedup clock: the (k+1)-th newest distinct example time (one far-future example
    # cannot make it forget every id).
    newest = t0 + (99 - settings.joiner.watermark_outliers) * hour // 10
    pruned = [i for i in range(100) if t0 + i * hour // 10 < newest - 2 * hour]
    assert totals["pruned_ids"] == len(pruned) > 70
    store = RocksDBStore(f"rocksdb://{root / '_state'}")
    try:
        kept = [k for k, _ in store.scan(b"S", b"T")]
        assert len(kept) == 100 - len(pruned)
    finally:
        store.close()
    # Duplicates within the horizon are still dropped; one beyond it is written again (counted).
    await produce(settings, batches(settings.topics.examples, [first[99], first[90], first[0]], 3))
    totals = await dumper.run(settings.updated(dumper=pruning_now), until_idle_s=1.0)
    assert totals["duplicates"] == 2 and totals["examples"] == 1 and totals["beyond_horizon"] == 1


async def test_dedup_remembers_ids_for_a_wall_time_minimum(settings: Settings, monkeypatch) -> None:
    """A fast replay moves event time by hours a second, so copies that come back through
    wall-clock processes (producer retries, restarts, serving's re-ship after a broker reset)
    can land far behind the event-time horizon: an id is remembered for dedup_min_wall_s of wall
    time after its flush whatever its event time, then the event-time horizon applies."""
    from proto import Example

    await create_topics(settings)
    hour, t0 = 3_600_000, 1_700_000_000_000

    def ex(i: int) -> tuple[str, bytes, bytes]:
        e = Example(example_id=f"w/{i}", request_id="w", item_id=i, user_id=1, event_time_ms=t0 + i * hour,
                    sample_rate=1.0)
        return batches(settings.topics.examples, [e])[0]  # a record of one example

    # 100 hours of event time in one stream, horizon 2 hours: most ids are beyond it at once.
    await produce(settings, [ex(i) for i in range(100)])
    s = settings.updated(dumper=dict(flush_rows=10, dedup_horizon_s=7200, dedup_min_wall_s=900))
    totals = await dumper.run(s, until_idle_s=1.0)
    assert totals["examples"] == 100 and totals["pruned_ids"] == 0
    await produce(settings, [ex(0), ex(50), ex(99)])  # re-delivered seconds later
    totals = await dumper.run(s, until_idle_s=1.0)
    assert totals["duplicates"] == 3 and totals["examples"] == 0
    # A quarter of an hour later the ids behind the horizon (as the clock stood then) are forgotten.
    real = dumper.time.time
    monkeypatch.setattr(dumper.time, "time", lambda: real() + 1000)
    await produce(settings, [ex(100)])
    totals = await dumper.run(s, until_idle_s=1.0)
    assert totals["examples"] == 1 and totals["pruned_ids"] > 90
    await produce(settings, [ex(0), ex(99)])
    totals = await dumper.run(s, until_idle_s=1.0)
    assert totals["duplicates"] == 1 and totals["examples"] == 1 and totals["beyond_horizon"] == 1
    assert dumper.read_examples(settings.var_dir / "examples").num_rows == 102


class _Crash(Exception):
    """The process dying between a flush's renames and its commit."""


def _crash_at_commit(monkeypatch, seq: int) -> None:
    """The dumper's store refuses the commit of flush ``seq`` (its files are renamed by then)."""
    real = RocksDBStore.write

    def write(self: RocksDBStore, changes: dict) -> None:
        if b"seq" in changes and struct.unpack("<q", changes[b"seq"])[0] == seq:
            raise _Crash
        real(self, changes)

    monkeypatch.setattr(RocksDBStore, "write", write)


def _examples(settings: Settings, n: int) -> list[tuple[str, bytes, bytes]]:
    from proto import Example

    return batches(settings.topics.examples, [Example(
        example_id=f"c/{i}", request_id="c", item_id=i, user_id=1, event_time_ms=1_700_000_000_000 + i,
        sample_rate=1.0) for i in range(n)])


async def test_a_flush_that_crashed_before_its_commit_is_adopted_not_deleted(settings: Settings, monkeypatch) -> None:
    """Crash after flush 2 renamed its files, before it committed: the restart keeps those rows
    (adopted: ids in the dedup state), skips their records when it reads them again, and writes
    the rest once."""
    settings.joiner.batch_size = 50  # (polls of 50: flushes of 100)
    await create_topics(settings)
    await produce(settings, _examples(settings, 300))
    root = settings.var_dir / "examples"
    _crash_at_commit(monkeypatch, 2)
    with pytest.raises(_Crash):
        await dumper.run(settings.updated(dumper=dict(flush_rows=100)), until_idle_s=1.0)
    monkeypatch.undo()
    files = {p.name for p in root.glob("dt=*/hour=*/part-*.parquet")}
    assert dumper.read_examples(root).num_rows == 200  # flush 1 committed, flush 2 renamed only
    totals = await dumper.run(settings.updated(dumper=dict(flush_rows=100)), until_idle_s=1.0)
    assert totals["adopted_rows"] == 100 and totals["duplicates"] == 100 and totals["examples"] == 100
    table = dumper.read_examples(root)
    assert table.num_rows == 300 == pc.count_distinct(table["example_id"]).as_py()
    assert files <= {p.name for p in root.glob("dt=*/hour=*/part-*.parquet")}


def test_a_scan_that_meets_damage_raises_instead_of_ending_early(tmp_path):
    """A bit flipped in the store's table file (a disk's error): a scan over it raises
    ``StoreDamaged`` rather than end at the damaged block, which would drop the keys after it (the
    dumper's and the joiner's windows and indexes are scans) without a word."""
    import os

    import pytest

    from services.rocksdb_faults import StoreDamaged

    store = RocksDBStore(f"rocksdb://{tmp_path / 'state'}")
    store.write({f"k{i:05d}".encode(): os.urandom(100) for i in range(2000)})
    store.db.flush()
    store.close()
    sst = max((tmp_path / "state").glob("*.sst"), key=lambda p: p.stat().st_size)
    data = bytearray(sst.read_bytes())
    data[len(data) // 2] ^= 0xFF
    sst.write_bytes(bytes(data))
    store = RocksDBStore(f"rocksdb://{tmp_path / 'state'}")
    with pytest.raises(StoreDamaged, match="Corruption"):
        list(store.scan(b"k", b"l"))
    store.close()
