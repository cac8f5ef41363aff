"""Shared by the joiner's broker tests and the benchmark: produce streams, read examples back."""

from __future__ import annotations

import asyncio
import time

from aiokafka import AIOKafkaConsumer, TopicPartition

from joiner import batches
from joiner.config import JoinConfig
from proto import Example
from services import example_batch, tansu_quirks
from services.kafka import producer, start_client
from services.settings import JoinerSettings, Settings

# The join rules of most joiner tests: a two-minute window, the rest as in services/settings.py.
JOINER = {"window_seconds": 120, "negative_sample_rate": 0.3, "seed": 11}


def join_config(joiner: dict | None = None, **overrides: object) -> JoinConfig:
    """The rules ``settings.updated(joiner=joiner)`` gives the joiner (default: :data:`JOINER`),
    some fields replaced (``overrides``, in :class:`JoinConfig`'s units)."""
    return JoinConfig.from_settings(JoinerSettings(**(JOINER if joiner is None else joiner)), **overrides)


async def produce(settings: Settings, events: list[tuple[str, bytes, bytes]], *, over_s: float = 0.0) -> None:
    """Produce ``(kind, key, value)`` in order; kind is ``features``/``actions`` or a topic name.
    ``over_s``: spread them over about that many seconds (slices of 100, each acknowledged)."""
    topics = {"features": settings.topics.features, "actions": settings.topics.actions}
    p = producer(settings)
    await start_client(p, settings)
    step = 100 if over_s else max(len(events), 1)
    pause = over_s * step / max(len(events), 1)
    try:
        for i in range(0, len(events), step):
            futures = [await p.send(topics.get(kind, kind), value, key=key) for kind, key, value in events[i:i + step]]
            await asyncio.gather(*futures)
            await asyncio.sleep(pause)
    finally:
        await p.stop()


async def read_topic(settings: Settings, topic: str) -> list[bytes]:
    """Every record value on a topic, up to its true end offsets."""
    c = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap_servers, enable_auto_commit=False, group_id=None)
    await c.start()
    try:
        await c.topics()
        tps = [TopicPartition(topic, p) for p in sorted(c.partitions_for_topic(topic) or [])]
        ends = await tansu_quirks.log_end_offsets(settings, tps)
        c.assign(tps)
        for tp in tps:
            await c.seek_to_beginning(tp)
        out: list[bytes] = []
        pos = {tp: 0 for tp in tps}
        while any(pos[tp] < ends[tp] for tp in tps):
            batch = await c.getmany(timeout_ms=1000)
            for tp, records in batch.items():
                for r in records:
                    if r.offset < ends[tp]:
                        out.append(r.value)
                    pos[tp] = r.offset + 1
        return out
    finally:
        await c.stop()


def batch_examples(values: list[bytes]) -> list[Example]:
    """The examples of batch records (``services.example_batch``), in record order."""
    return [e for v in values for e in example_batch.to_examples(example_batch.decode(v))]


async def read_examples(settings: Settings) -> list[Example]:
    """Every example on the examples topic (its records are columnar batches)."""
    return batch_examples(await read_topic(settings, settings.topics.examples))


def emitted_examples(emitted: list, labels: list[str]) -> list[Example]:
    """``JoinCore.take()``'s emitted examples as Example protos, through the joiner's own path:
    :func:`joiner.batches.build`, then ``example_batch.encode`` and ``decode``."""
    if not emitted:
        return []
    return batch_examples([example_batch.encode(batches.build(emitted, labels)[0])])


def take_examples(core) -> list[Example]:
    return emitted_examples(core.take(), core.labels)


def as_map(examples: list[Example]) -> dict[str, tuple[dict[str, float], float, int]]:
    """Dedup by example_id, checking that every re-emission is an exact copy."""
    got: dict[str, tuple[dict[str, float], float, int]] = {}
    for e in examples:
        value = (dict(e.labels), round(e.sample_rate, 6), e.user_id)
        assert got.setdefault(e.example_id, value) == value, f"re-emission of {e.example_id} differs"
    return got


def ref_as_map(ref: dict) -> dict:
    return {k: (lbl, round(r, 6), u) for k, (lbl, r, u) in ref.items()}


async def consumed_all(settings: Settings, procs: list, timeout: float) -> float:
    """Wait until the joiner's group has committed every input record (``procs``: worker
    processes that must stay alive meanwhile); the seconds it took."""
    t = settings.topics
    tps = [TopicPartition(topic, p) for topic in (t.features, t.actions) for p in range(t.partitions)]
    ends = await tansu_quirks.log_end_offsets(settings, tps)
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        committed = await tansu_quirks.committed_offsets(settings, settings.joiner.group_id, tps)
        if all(max(committed[tp], 0) >= ends[tp] for tp in tps):  # (-1: none committed)
            return time.monotonic() - started
        assert all(p.poll() is None for p in procs), "a worker exited"
        await asyncio.sleep(0.5)
    raise AssertionError(f"the group did not consume its input within {timeout} s: {committed} of {ends}")


async def run_until_consumed(settings: Settings, *, extra_s: float = 0.0) -> dict[str, int]:
    """Run a joiner worker (no drain) until its group has committed all input, ``extra_s``
    more, then stop it as SIGTERM does; its counts."""
    from joiner.faust_app import run

    stop = asyncio.Event()
    task = asyncio.create_task(run(settings, stop=stop))
    try:
        await consumed_all(settings, [], timeout=120)
        await asyncio.sleep(extra_s)
    finally:
        stop.set()
    return await task
