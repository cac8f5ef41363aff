"""A partition store a disk damaged, on the real broker: the joiner neither dead-letters the
records that met the damage (not their fault) nor crash-loops on it. The worker stops, its next
start sets the damaged store aside and Faust rebuilds the partition from the changelog; the
examples are then exactly the reference join, as if nothing had happened."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pyarrow.compute as pc
import pytest
from prometheus_client import REGISTRY
from rocksdict import BlockBasedOptions, Options, Rdict, SstFileWriter

from joiner import dumper
from joiner.faust_app import run as run_joiner
from joiner.faust_app import state_dir
from joiner.faust_store import CHECK_MARKER, partition_stores
from services.kafka import create_topics
from services.rocksdb_faults import is_damage
from services.settings import Settings
from tests.joiner.helpers import JOINER, as_map, join_config, produce, read_examples, read_topic, ref_as_map, run_until_consumed
from tests.joiner.reference import offline_join
from tests.joiner.synth import ml_events
from tests.joiner.test_broker_reset import _busiest_cut
from tests.joiner.test_crash import _examples
from tests.joiner.test_dumper import batches

CFG = join_config()


def _set_aside() -> float:
    return REGISTRY.get_sample_value("driftline_joiner_stores_set_aside_total") or 0.0


def _tables(s: Settings) -> Path:
    return state_dir(s) / "v1" / "tables"


def _damage(store: Path, how: str, records: bytes = b"I") -> None:
    """``current``: RocksDB cannot open the store. ``blocks``: the middle third of its largest
    table file zeroed (data blocks: it opens, reads there fail their checksum). ``records``: the
    keys starting with ``records`` alone in the newest table file, one data block (``_one_block``),
    a byte of it flipped: every read of those keys fails, and only those."""
    if how == "current":
        (store / "CURRENT").write_text("garbage\n")
        return
    db = Rdict(str(store), Options(raw_mode=True))
    db.flush()  # (the state into table files: the memtable lives in the WAL until then)
    if how == "records":
        moved = {k: v for k, v in db.items(from_key=records) if k.startswith(records)}
        assert moved
        for k in moved:
            del db[k]
        db.flush()
        db.ingest_external_file([_one_block(moved, Path(tempfile.mkdtemp()) / "moved.sst")])
    db.close()
    if how == "records":
        sst = max(store.glob("*.sst"), key=lambda p: int(p.stem))
        data = bytearray(sst.read_bytes())
        data[10] ^= 0xFF
    else:
        sst = max(store.glob("*.sst"), key=lambda p: p.stat().st_size)
        data = bytearray(sst.read_bytes())
        third = len(data) // 3
        data[third:2 * third] = bytes(third)
    sst.write_bytes(bytes(data))


def _one_block(records: dict[bytes, bytes], path: Path) -> str:
    """A table file holding ``records`` in one data block. The store's own 4 KB blocks would put
    them in a dozen, and a byte flipped in one reached a tenth of them: whether the join read one
    of those was chance (rocksdict reopens a store with the options it was made with, so the block
    size is set here, on a file written apart and ingested)."""
    options = Options(raw_mode=True)
    table = BlockBasedOptions()
    table.set_block_size(64 << 20)
    options.set_block_based_table_factory(table)
    writer = SstFileWriter(options)
    writer.open(str(path))
    for k in sorted(records):
        writer[k] = records[k]
    writer.finish()
    return str(path)


@pytest.mark.parametrize("how", ["blocks", "records", "current"])
async def test_a_damaged_partition_store_is_rebuilt_from_the_changelog(settings: Settings, how: str) -> None:
    """Part 1 is consumed (windows still open, their impressions in the stores), every
    partition's store is damaged, part 2 comes. ``blocks``: reads meet the damage while running;
    the worker stops (what it raised names the damage) and marks its stores, and its restart
    moves them aside. ``records``: the waiting impressions' records damaged, met by the join itself
    (an action looking up its impression), which must not take it for the action's fault. ``current``: the stores do not open; the start moves them aside. Either
    way part 2's actions still join part 1's impressions: the result is the reference join of
    part 1 + part 2, and nothing went to dead letters."""
    s = settings.updated(joiner=JOINER)
    events = ml_events(1200, start=20_000, seed=5)
    cut = _busiest_cut(events)
    await create_topics(settings)
    await produce(settings, events[:cut])
    await run_until_consumed(s)
    before = await read_examples(settings)
    stores = partition_stores(_tables(s), "state")
    assert len(stores) == settings.topics.partitions
    for store in stores.values():
        _damage(store, how)
    await produce(settings, events[cut:])
    set_aside = _set_aside()
    if how != "current":
        with pytest.raises(Exception) as stopped:  # (Faust's crash or ours: what matters is the cause)
            await run_joiner(s, until_idle_s=1.0)
        assert is_damage(stopped.value), stopped.value
        assert (state_dir(s) / CHECK_MARKER).exists()
        assert _set_aside() == set_aside  # (found while running: moved at the next start)
    counts = await run_joiner(s, until_idle_s=1.0)
    assert _set_aside() - set_aside == len(stores)
    assert sorted(p.name.split(".damaged-")[0] for p in _tables(s).glob("state-*.db.damaged-*")) == \
        sorted(p.name for p in stores.values())
    assert not (state_dir(s) / CHECK_MARKER).exists()
    assert counts.get("failed_records", 0) == 0
    assert await read_topic(settings, settings.topics.dead_letters) == []
    after = await read_examples(settings)
    assert as_map(before + after) == ref_as_map(offline_join(events, CFG, settings.topics.partitions))
    part1 = {k.decode() for kind, k, _ in events[:cut] if kind == "features"}
    old = {e.example_id for e in before}
    assert sum(1 for e in after if e.example_id not in old and e.request_id in part1 and e.labels["click"] == 1.0) >= 5


@pytest.mark.parametrize("how", ["records", "current"])
async def test_a_damaged_dumper_store_is_rebuilt_from_the_parquet_files(settings: Settings, how: str) -> None:
    """The dumper's store (written ids, input offsets) damaged after a first run: copies of every
    example written come again (the joiner re-emitting), with new ones. ``records``: the written
    ids' records damaged, met by the dedup lookup (not a record's fault: nothing dead-lettered),
    the dumper stops, marked; ``current``: the store does not open. The start after that sets the
    store aside, adopts every id in the Parquet files and reads the topic from its start: each
    example is in Parquet once."""
    await create_topics(settings)
    topic = settings.topics.examples
    first, later = _examples(300, "a"), _examples(200, "b")
    await produce(settings, batches(topic, first, 50))
    root = settings.var_dir / "examples"
    s = settings.updated(dumper=dict(flush_rows=100))
    assert (await dumper.run(s, until_idle_s=1.0))["examples"] == 300
    _damage(root / "_state", how, records=b"S")
    await produce(settings, batches(topic, first + later, 50))
    if how != "current":
        with pytest.raises(Exception) as stopped:
            await dumper.run(s, until_idle_s=1.0)
        assert is_damage(stopped.value), stopped.value
    totals = await dumper.run(s, until_idle_s=1.0)
    assert [p.name.split("-")[0] for p in root.glob("_state.damaged-*")] == ["_state.damaged"]
    assert totals["adopted_rows"] == 300 and totals["failed"] == 0
    table = dumper.read_examples(root)
    assert table.num_rows == 500 == pc.count_distinct(table["example_id"]).as_py()
    assert await read_topic(settings, settings.topics.dead_letters) == []
