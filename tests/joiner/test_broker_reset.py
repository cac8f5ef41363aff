"""Broker resets (tansu restarted: memory storage lost, every topic recreated empty) under the
joiner and the dumper, on a real broker of this module's own (the other tests' topics are not
wiped): state kept, offsets dropped, the new topics read from their start, nothing the consumer
had consumed lost, no example id emitted twice with different bytes, no Parquet row deleted."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pyarrow.compute as pc
import pytest
from prometheus_client import REGISTRY
from rocksdict import Options, Rdict

from joiner import dumper
from joiner.faust_app import BrokerReset
from joiner.faust_app import run as run_joiner
from proto import Example
from services import example_batch
from services.kafka import create_topics
from services.settings import Settings
from tests.conftest import Broker, KilledBroker, killed_broker
from tests.joiner.helpers import JOINER, as_map, consumed_all, join_config, produce, read_examples, ref_as_map, run_until_consumed
from tests.joiner.reference import offline_join
from tests.joiner.synth import ml_events

CFG = join_config()


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilledBroker]:
    yield from killed_broker(tmp_path_factory, "reset-broker")


def _value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def _until(predicate, timeout_s: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def _busiest_cut(events: list) -> int:
    """The split (in the middle third) with the most actions after it for feature logs before it."""
    feature_at = {}
    spans = [0] * (len(events) + 1)
    for j, (kind, key, _) in enumerate(events):
        if kind == "features":
            feature_at.setdefault(key, j)
        elif key in feature_at:  # the action crosses every cut in (features, action]
            spans[feature_at[key] + 1] += 1
            spans[j + 1] -= 1
    best, best_n, n = 0, -1, 0
    for cut in range(len(events)):
        n += spans[cut]
        if len(events) // 3 <= cut <= 2 * len(events) // 3 and n > best_n:
            best, best_n = cut, n
    return best


async def _write_strays(settings: Settings) -> bytes:
    """What a re-seed cut short leaves in the new epoch's changelog: records without their
    commit marker, in every partition; the stray key."""
    from joiner.faust_app import changelog_topic
    from services import broker_reset
    from services.kafka import producer, start_client

    topic = changelog_topic(settings, await broker_reset.ensure_broker_epoch(settings))
    await create_topics(settings, {topic: settings.topics.partitions})
    prod = producer(settings)
    await start_client(prod, settings)
    try:
        for p in range(settings.topics.partitions):
            await prod.send_and_wait(topic, b"x", key=b"Istray/1", partition=p)
    finally:
        await prod.stop()
    return b"Istray/1"


@pytest.mark.parametrize("joiner_running,strays", [(True, False), (False, False), (False, True)],
                         ids=["running", "stopped", "stray changelog records"])
async def test_joiner_keeps_its_state_across_a_broker_reset(settings: Settings, broker: Broker,
                                                           joiner_running: bool, strays: bool) -> None:
    """Part 1 is consumed (windows still open), the broker is reset, part 2 goes to the new
    topics. A running worker notices the reset and stops (``BrokerReset``) without writing to
    the new topics; a stopped one notices it at its next start. The restarted worker re-seeds
    the new changelog from its local store and drains: part 2's actions still join part 1's
    impressions, the result is exactly the reference join of part 1 + part 2. Records a re-seed
    cut short left in the new changelog (``strays``: no commit marker) are not taken for another
    worker's re-seed, and their keys are deleted."""
    s = settings.updated(joiner=JOINER)
    events = ml_events(1200, start=10_000, seed=3)
    cut = _busiest_cut(events)
    part1, part2 = events[:cut], events[cut:]
    await create_topics(settings)
    await produce(settings, part1)
    resets = _value("driftline_broker_resets_total", service="joiner")
    t = settings.topics
    resent = _value("driftline_joiner_output_resent_total")
    lost = [_value("driftline_broker_reset_lost_total", service="joiner", topic=x) for x in (t.features, t.actions)]
    if joiner_running:
        stop = asyncio.Event()
        task = asyncio.create_task(run_joiner(s, stop=stop))
        try:
            await consumed_all(s, [], timeout=120)
            await asyncio.sleep(1.0)  # (its last batch committed)
            before = await read_examples(settings)
            await asyncio.to_thread(broker.restart)
            with pytest.raises(BrokerReset):
                await asyncio.wait_for(task, timeout=60)
        finally:
            stop.set()
    else:
        await run_until_consumed(s)
        before = await read_examples(settings)
        await asyncio.to_thread(broker.restart)
    assert before, "part 1 gave examples"
    await create_topics(settings)
    stray = await _write_strays(s) if strays else None
    await produce(settings, part2)
    counts = await run_joiner(s, until_idle_s=1.0)  # re-seeds the changelog, then drains
    if stray is not None:
        from joiner.faust_app import state_dir
        from joiner.faust_store import partition_stores

        stores = partition_stores(state_dir(s) / "v1" / "tables", "state")
        assert stores, "the local state was kept, not dropped for a re-seed nobody made"
        for path in stores.values():
            db = Rdict(str(path), Options(raw_mode=True))
            try:
                assert db.get(stray) is None
            finally:
                db.close()
    assert _value("driftline_broker_resets_total", service="joiner") > resets
    after = await read_examples(settings)
    assert counts["impressions"] > 0
    assert as_map(before + after) == ref_as_map(offline_join(events, CFG, t.partitions))
    # Part 1's examples were produced again into the new topics, first and byte for byte (the
    # dumper and the trainer may not have read them before the reset): its own spool.
    old_ids = {e.example_id for e in before}
    assert sorted(e.SerializeToString() for e in after if e.example_id in old_ids) == \
        sorted(e.SerializeToString() for e in before)
    assert _value("driftline_joiner_output_resent_total") > resent
    # The state was kept: part 2's actions joined impressions of part 1.
    part1_requests = {k.decode() for kind, k, _ in part1 if kind == "features"}
    new = [e for e in after if e.example_id not in old_ids]
    assert sum(1 for e in new if e.request_id in part1_requests and e.labels["click"] == 1.0) >= 5
    # Part 1 was consumed in full before the reset: nothing lost.
    assert [_value("driftline_broker_reset_lost_total", service="joiner", topic=x)
            for x in (t.features, t.actions)] == lost


async def test_joiner_counts_the_records_a_reset_took_before_it_read_them(settings: Settings, broker: Broker) -> None:
    """A worker stopped mid-stream (its last commit saw high watermarks above its offsets), then a
    reset: the restarted worker counts those unread records as lost (by the high watermarks its
    commits stored), per input topic."""
    # 50 records a batch: the worker is stopped while most are unread (with whole fetches it
    # could read all of them before the stop takes effect)
    s = settings.updated(joiner={**JOINER, "batch_size": 50}, kafka={"max_poll_records": 50})
    t = settings.topics
    await create_topics(settings)
    await produce(settings, ml_events(3000, start=12_000, seed=4))
    lost = sum(_value("driftline_broker_reset_lost_total", service="joiner", topic=x) for x in (t.features, t.actions))
    stop = asyncio.Event()
    task = asyncio.create_task(run_joiner(s, stop=stop))
    await _until(lambda: _value("driftline_messages_consumed_total", service="joiner", topic=t.features) > 0
                 or task.done(), timeout_s=90, what="the first batch")
    stop.set()
    await task
    await asyncio.to_thread(broker.restart)
    await create_topics(settings)
    await run_joiner(s, until_idle_s=0.5)  # notices the reset at start-up, counts, drains
    now = sum(_value("driftline_broker_reset_lost_total", service="joiner", topic=x) for x in (t.features, t.actions))
    assert now > lost


async def test_joiner_after_a_reset_refuses_expired_impressions_and_remembers_the_rest(
        settings: Settings, broker: Broker) -> None:
    """After a reset the new topics may carry feature logs the joiner already has (serving
    re-ships its spool). One still remembered is a duplicate; one so old that its tombstone may
    be gone is refused (``expired_impressions``). Neither emits anything: the new topic holds
    only the copy of the examples produced before (the joiner's own output spool)."""
    events = ml_events(1500, start=260_000, seed=32)
    await create_topics(settings)
    await produce(settings, events)
    await run_joiner(settings.updated(joiner=JOINER), until_idle_s=1.0)
    first = await read_examples(settings)
    await asyncio.to_thread(broker.restart)
    await create_topics(settings)
    features = [e for e in events if e[0] == "features"]
    # The newest feature logs (still remembered) and the oldest (far behind the watermark).
    resent = features[:50] + features[-20:]
    await produce(settings, resent)
    counts = await run_joiner(settings.updated(joiner=JOINER), until_idle_s=1.0)
    again = await read_examples(settings)
    assert sorted(e.SerializeToString() for e in again) == sorted(e.SerializeToString() for e in first), \
        "the examples of before the reset, once, and nothing else"
    assert counts["expired_impressions"] > 0 and counts["duplicate_impressions"] > 0
    assert counts["expired_impressions"] + counts["duplicate_impressions"] == counts["impressions"]
    assert as_map(first) == ref_as_map(offline_join(events, CFG, settings.topics.partitions))


def _ex(prefix: str, i: int) -> tuple[str, bytes, bytes]:
    e = Example(example_id=f"{prefix}/{i}", request_id=prefix, item_id=i, user_id=i % 7,
                event_time_ms=1_700_000_000_000 + i * 1_000, sample_rate=1.0, labels={"click": float(i % 2)})
    return "examples", str(i % 7).encode(), e.SerializeToString()  # produced as a batch of one: _batch


def _batch(raw: bytes) -> bytes:
    """An Example's bytes as a record of the examples topic (a batch of that one example)."""
    return example_batch.encode(example_batch.from_examples([Example.FromString(raw)]))


async def test_dumper_keeps_every_parquet_row_across_broker_resets(settings: Settings, broker: Broker) -> None:
    """A: dumped. Reset under the running dumper, then B (with some of A again, as a joiner's
    re-emission). Stop, reset again, C; restart. Every row of A, B and C is in Parquet once; no
    part file was deleted."""
    topic = settings.topics.examples
    root = settings.var_dir / "examples"

    async def put(rows: list) -> None:  # one example batch per example
        await produce(settings, [(topic, k, _batch(v)) for _, k, v in rows])

    def rows() -> list[str]:
        return dumper.read_examples(root)["example_id"].to_pylist() if list(root.glob("dt=*")) else []

    a, b, c = ([_ex(x, i) for i in range(n)] for x, n in (("a", 300), ("b", 500), ("c", 100)))
    await create_topics(settings)
    await put(a)
    resets = _value("driftline_broker_resets_total", service="joiner-dumper")
    stop = asyncio.Event()
    task = asyncio.create_task(dumper.run(settings.updated(dumper=dict(flush_rows=100, flush_interval_s=0.3)), stop=stop))
    await _until(lambda: len(rows()) == 300 or task.done(), what="A in Parquet")
    files = {p.name for p in root.glob("dt=*/hour=*/part-*.parquet")}
    await asyncio.to_thread(broker.restart)
    await create_topics(settings)
    await put(b + a[:50])
    await _until(lambda: len(rows()) == 800 or task.done(), what="B in Parquet")
    await asyncio.sleep(1.0)  # (a flush of duplicates, if any, would show now)
    stop.set()
    totals = await task
    assert _value("driftline_broker_resets_total", service="joiner-dumper") == resets + 1
    assert totals["duplicates"] >= 50
    await asyncio.to_thread(broker.restart)
    await create_topics(settings)
    await put(c)
    await dumper.run(settings, until_idle_s=1.0)
    assert _value("driftline_broker_resets_total", service="joiner-dumper") == resets + 2
    table = dumper.read_examples(root)
    assert table.num_rows == 900 == pc.count_distinct(table["example_id"]).as_py()
    assert files <= {p.name for p in root.glob("dt=*/hour=*/part-*.parquet")}, "no part file deleted"


async def test_dumper_keeps_the_rows_of_an_uncommitted_flush_whose_records_a_reset_took(
        settings: Settings, broker: Broker, monkeypatch) -> None:
    """Crash between flush 2's renames and its commit, then a broker reset: flush 2's records
    can no longer be re-read, and its rows survive because they are adopted, not deleted."""
    from tests.joiner.test_dumper import _Crash, _crash_at_commit

    settings.joiner.batch_size = 50  # (polls of 50: flushes of 100)
    topic = settings.topics.examples
    root = settings.var_dir / "examples"
    await create_topics(settings)
    await produce(settings, [(topic, k, _batch(v)) for _, k, v in (_ex("a", i) for i in range(300))])
    _crash_at_commit(monkeypatch, 2)
    with pytest.raises(_Crash):
        await dumper.run(settings.updated(dumper=dict(flush_rows=100)), until_idle_s=1.0)
    monkeypatch.undo()
    on_disk = dumper.read_examples(root)["example_id"].to_pylist()  # flush 1, and flush 2 uncommitted
    await asyncio.to_thread(broker.restart)
    await create_topics(settings)
    await produce(settings, [(topic, k, _batch(v)) for _, k, v in (_ex("b", i) for i in range(50))])
    totals = await dumper.run(settings.updated(dumper=dict(flush_rows=100)), until_idle_s=1.0)
    assert totals["adopted_rows"] >= 100 and totals["examples"] == 50
    ids = dumper.read_examples(root)["example_id"].to_pylist()
    assert len(ids) == len(set(ids))
    assert sorted(ids) == sorted(on_disk + [f"b/{i}" for i in range(50)])
