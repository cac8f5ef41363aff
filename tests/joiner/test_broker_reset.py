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

from joiner import dumper
from joiner.app import run as run_joiner
from joiner.reference import offline_join
from joiner.synth import ml_events
from proto import Example
from services import example_batch
from services.kafka import create_topics
from services.settings import Settings
from tests.conftest import Broker, KilledBroker, killed_broker
from tests.joiner.helpers import JOINER, as_map, join_config, produce, read_examples, ref_as_map

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


def _consumed(service: str, topic: str) -> float:
    return _value("driftline_messages_consumed_total", service=service, topic=topic)


def _caught_up(settings: Settings, service: str, topics: list[str], counts: dict[str, int]) -> bool:
    """The service consumed at least ``counts[topic]`` records of each topic and its last poll
    of every partition left no lag."""
    if any(_consumed(service, t) < counts[t] for t in topics):
        return False
    return all(_value("driftline_consumer_lag_messages", service=service, topic=t, partition=str(p)) == 0
               for t in topics for p in range(settings.topics.partitions))


def _count(events: list, kind: str) -> int:
    return sum(1 for k, _, _ in events if k == kind)


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


@pytest.mark.parametrize("joiner_running", [True, False], ids=["running", "stopped"])
async def test_joiner_keeps_its_state_across_a_broker_reset(settings: Settings, broker: Broker,
                                                           joiner_running: bool) -> None:
    """Part 1 is joined, the broker is reset, part 2 goes to the new topics. The joiner (running
    through the reset, or stopped and restarted after it) keeps the waiting impressions, so part
    2's actions still join part 1's impressions: the result is exactly the reference join of
    part 1 + part 2, as if nothing had happened, with no conflicting re-emission."""
    events = ml_events(2400, start=200_000, seed=31)
    cut = _busiest_cut(events)
    part1, part2 = events[:cut], events[cut:]
    t = settings.topics
    await create_topics(settings)
    await produce(settings, part1)
    resets = _value("driftline_broker_resets_total", service="joiner")
    resent = _value("driftline_joiner_output_resent_total")
    lost = [_value("driftline_broker_reset_lost_total", service="joiner", topic=x) for x in (t.features, t.actions)]
    stop = asyncio.Event()
    task = asyncio.create_task(run_joiner(settings.updated(joiner=JOINER), stop=stop))
    consumed = {t.features: _consumed("joiner", t.features), t.actions: _consumed("joiner", t.actions)}
    want = {t.features: consumed[t.features] + _count(part1, "features"),
            t.actions: consumed[t.actions] + _count(part1, "actions")}
    await _until(lambda: _caught_up(settings, "joiner", [t.features, t.actions], want) or task.done(),
                 what="part 1 consumed")
    await asyncio.sleep(0.5)  # (its last batch committed)
    if not joiner_running:
        stop.set()
        await task
    before = await read_examples(settings)
    assert before, "part 1 gave examples"
    await asyncio.to_thread(broker.restart)
    await create_topics(settings)
    await produce(settings, part2)
    if joiner_running:
        await _until(lambda: _value("driftline_broker_resets_total", service="joiner") > resets or task.done(),
                     what="the running joiner to notice the reset")
        assert not task.done(), task.result()
        stop.set()
        await task
    # Drain (closes every window) on the new epoch; the stopped joiner notices the reset here.
    counts = await run_joiner(settings.updated(joiner=JOINER), until_idle_s=1.0)
    assert _value("driftline_broker_resets_total", service="joiner") == resets + 1
    after = await read_examples(settings)
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
    assert counts["impressions"] > 0


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
