"""kill -9 the joiner process (one worker) at random moments, restart it, repeat: after dedup by example_id the
examples equal the uninterrupted result (the offline reference, itself checked against an
uninterrupted run in test_joiner_broker), and every re-emitted example is an exact copy. The
same for the dumper (every example in Parquet once), and SIGTERM/SIGINT stop both cleanly."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from aiokafka import TopicPartition

from joiner import dumper
from proto import Example
from services import example_batch, tansu_quirks
from services.kafka import create_topics
from services.ports import free_port
from services.settings import Settings
from tests.joiner.helpers import as_map, join_config, produce, read_examples, ref_as_map
from tests.joiner.reference import offline_join
from tests.joiner.synth import ml_events

ROOT = Path(__file__).resolve().parents[2]


def _env(settings: Settings) -> dict[str, str]:
    t = settings.topics
    env = dict(os.environ)
    env.update({
        "KAFKA_BOOTSTRAP_SERVERS": settings.bootstrap_servers,
        "DRIFTLINE_VAR_DIR": str(settings.var_dir),
        "DRIFTLINE_TOPICS__FEATURES": t.features,
        "DRIFTLINE_TOPICS__ACTIONS": t.actions,
        "DRIFTLINE_TOPICS__EXAMPLES": t.examples,
        "DRIFTLINE_TOPICS__DEAD_LETTERS": t.dead_letters,
        "DRIFTLINE_TOPICS__PARAM_DELTAS": t.param_deltas,
        "DRIFTLINE_JOINER__GROUP_ID": settings.joiner.group_id,  # (and the changelog topic's name)
        "DRIFTLINE_JOINER__WINDOW_SECONDS": "120",
        "DRIFTLINE_JOINER__NEGATIVE_SAMPLE_RATE": "0.3",
        "DRIFTLINE_JOINER__CACHE_SIZE": "2000",  # most of the waiting state is on disk
        "DRIFTLINE_JOINER__BATCH_SIZE": "100",   # many small batches: more moments to die in
        # A restarted worker waits for the killed one's session to time out: half the default
        # halves that wait for each of the kills (nothing here blocks the consumer thread).
        "DRIFTLINE_JOINER__SESSION_TIMEOUT_MS": "3000",
        "DRIFTLINE_LOG_LEVEL": "WARNING",
        "PYTHONPATH": str(ROOT),
    })
    return env


def _joiner(env: dict[str, str], log: Path, *args: str, module: str = "joiner") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def _dumper(env: dict[str, str], log: Path, *args: str) -> subprocess.Popen:
    return _joiner(env, log, *args, module="joiner.dumper")


def _until_consumed(proc: subprocess.Popen, port: int, topic: str, n: int, log: Path) -> None:
    """Wait until the dumper's /metrics says it read ``n`` records of ``topic`` (its signal handlers
    are installed before it reads: a signal sent after this cannot meet its imports)."""
    line = f'driftline_messages_consumed_total{{service="{dumper.SERVICE}",topic="{topic}"}} {float(n)}'
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-2000:]
        try:
            if line in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode():
                return
        except OSError:
            pass  # not listening yet
        time.sleep(0.1)
    raise AssertionError(f"the dumper did not read {n} records within 90 s: " + log.read_text()[-2000:])


async def _until_output(settings: Settings, proc: subprocess.Popen, timeout: float, above: int = 0) -> None:
    """Wait until the examples topic has more than ``above`` records (the joiner is then mid-stream)."""
    t = settings.topics
    tps = [TopicPartition(t.examples, p) for p in range(t.partitions)]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum((await tansu_quirks.log_end_offsets(settings, tps)).values()) > above:
            return
        assert proc.poll() is None, f"the joiner exited with {proc.returncode} before producing"
        await asyncio.sleep(0.02)
    raise AssertionError(f"no example within {timeout} s")


async def _crash_run(settings: Settings, n_requests: int, kills: int, seed: int) -> None:
    events = ml_events(n_requests, start=100_000, seed=seed)
    await create_topics(settings)
    # The stream arrives in kills + 1 parts, each while a worker runs (over 5 s: a fast machine
    # joined a part produced at once before the kill came): every restarted worker has input left
    # and dies mid-stream, however fast the machine (one that finished a stream produced at once
    # before the second kill had no new window to close after its restart).
    parts = [events[i * len(events) // (kills + 1):(i + 1) * len(events) // (kills + 1)] for i in range(kills + 1)]
    env = _env(settings)
    log = settings.var_dir.parent / "joiner.log"
    settings.var_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    produced_before_kill = []
    records = 0  # batch records on the examples topic
    for part in parts[:-1]:
        proc = _joiner(env, log)
        producing = asyncio.create_task(produce(settings, part, over_s=5.0))
        # On progress (start-up and the group join take seconds, varying with the machine's
        # load): once the restarted worker has produced, mid-stream.
        await _until_output(settings, proc, timeout=90, above=records)
        await asyncio.sleep(rng.uniform(0.0, 1.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        await producing
        produced_before_kill.append(len(await read_examples(settings)))
        records = sum((await tansu_quirks.log_end_offsets(
            settings, [TopicPartition(settings.topics.examples, p) for p in range(settings.topics.partitions)])).values())
    await produce(settings, parts[-1])
    proc = _joiner(env, log, "--until-idle", "1")
    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    examples = await read_examples(settings)
    cfg = join_config({"window_seconds": 120, "negative_sample_rate": 0.3})  # as _env sets
    expected = ref_as_map(offline_join(events, cfg, settings.topics.partitions))
    got = as_map(examples)
    assert got == expected
    # The kills really happened mid-stream: some output before the last kill, not all of it.
    assert 0 < produced_before_kill[-1] or 0 < produced_before_kill[0]
    assert min(produced_before_kill) < len(expected)
    print(f"kills at {produced_before_kill} examples of {len(expected)}; "
          f"{len(examples) - len(expected)} duplicates removed by dedup")


async def test_kill_9_and_restart_gives_the_same_examples(settings: Settings) -> None:
    await _crash_run(settings, n_requests=12_000, kills=5, seed=22)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_a_signal_stops_cleanly_and_commits(settings: Settings, sig: signal.Signals) -> None:
    await create_topics(settings)
    await produce(settings, ml_events(2000, start=150_000, seed=23))
    env = _env(settings)
    settings.var_dir.mkdir(parents=True, exist_ok=True)
    log = settings.var_dir.parent / "joiner-term.log"
    proc = _joiner(env, log)
    await _until_output(settings, proc, timeout=90)
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == 0, log.read_text()[-2000:]
    first = await read_examples(settings)
    proc = _joiner(env, log, "--until-idle", "1")
    assert proc.wait(timeout=60) == 0
    examples = await read_examples(settings)
    assert len(first) > 0
    assert len(examples) == len({e.example_id for e in examples}), "a clean stop re-emits nothing"


def _examples(n: int, prefix: str = "d") -> list[Example]:
    return [Example(example_id=f"{prefix}/{i}", request_id=prefix, item_id=i, user_id=i % 13,
                    event_time_ms=1_700_000_000_000 + i * 100, sample_rate=1.0,
                    labels={"click": float(i % 3 == 0)}) for i in range(n)]


def _batch(e: Example) -> bytes:
    """One example as a batch record (a batch of one keeps the record counts of the flushes)."""
    return example_batch.encode(example_batch.from_examples([e]))


def _wait_for_new_part(root: Path, seen: set[str], proc: subprocess.Popen, timeout: float) -> None:
    """Block until the dumper has written a part file not in `seen` (it is then mid-stream)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if {p.name for p in root.glob("dt=*/hour=*/part-*.parquet")} - seen:
            return
        assert proc.poll() is None, f"the dumper exited with {proc.returncode} before writing"
        time.sleep(0.005)
    raise AssertionError(f"no new part file within {timeout} s")


async def test_dumper_kill_9_and_restart_writes_each_example_once(settings: Settings) -> None:
    """kill -9 the dumper mid-stream (many small flushes: kills land in and between them),
    restart, repeat: every example in Parquet exactly once, no part file deleted."""
    values = _examples(6000)
    await create_topics(settings)
    t = settings.topics.examples
    await produce(settings, [(t, str(e.user_id).encode(), _batch(e)) for e in values])
    env = _env(settings) | {"DRIFTLINE_JOINER__BATCH_SIZE": "10"}  # polls and flushes of 10: ~600 flushes
    settings.var_dir.mkdir(parents=True, exist_ok=True)
    log = settings.var_dir.parent / "dumper.log"
    root = settings.var_dir / "examples"
    rng = random.Random(24)
    seen: set[str] = set()
    rows_at_kills = []
    for _ in range(2):
        proc = _dumper(env, log, "--flush-rows", "10", "--flush-interval", "0.05")
        # Kill on progress, not on a clock: start-up time varies from machine to machine, and a
        # fast one finished the whole stream inside a fixed sleep.
        _wait_for_new_part(root, seen, proc, timeout=60)
        time.sleep(rng.uniform(0.0, 0.05))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        now = {p.name for p in root.glob("dt=*/hour=*/part-*.parquet")}
        assert seen <= now, "a part file was deleted"
        seen = now
        rows_at_kills.append(dumper.read_examples(root).num_rows if now else 0)
    assert min(rows_at_kills) < len(values), f"killed mid-stream: rows at the kills {rows_at_kills}"
    proc = _dumper(env, log, "--flush-rows", "10", "--until-idle", "1")
    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    table = dumper.read_examples(root)
    assert sorted(table["example_id"].to_pylist()) == sorted(e.example_id for e in values)
    assert seen <= {p.name for p in root.glob("dt=*/hour=*/part-*.parquet")}
    assert not [p for p in root.rglob("*") if ".tmp" in p.name], "temp files are removed"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_dumper_signal_flushes_and_exits_0(settings: Settings, sig: signal.Signals) -> None:
    """With flushes that would never come on their own, a signal flushes what was read."""
    values = _examples(500, prefix="s")
    await create_topics(settings)
    await produce(settings, [(settings.topics.examples, b"1", _batch(e)) for e in values])
    env = _env(settings)
    settings.var_dir.mkdir(parents=True, exist_ok=True)
    log = settings.var_dir.parent / "dumper-term.log"
    port = free_port()
    proc = _dumper(env, log, "--flush-rows", "1000000", "--flush-interval", "3600", "--metrics-port", str(port))
    _until_consumed(proc, port, settings.topics.examples, 500, log)
    assert not list((settings.var_dir / "examples").glob("dt=*")), "nothing flushed before the signal"
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == 0, log.read_text()[-2000:]
    table = dumper.read_examples(settings.var_dir / "examples")
    assert table.num_rows == 500 and sorted(table["example_id"].to_pylist()) == sorted(
        e.example_id for e in values)
