"""The Faust joiner on the real broker: the offline reference's examples, takeover after kill -9."""

from __future__ import annotations

import asyncio
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from aiokafka import TopicPartition

from joiner.faust_app import run
from joiner.reference import offline_join
from joiner.synth import ml_events
from proto import FeatureLog
from services import tansu_quirks
from services.kafka import create_topics
from services.settings import Settings
from tests.joiner.test_crash import ROOT, _until_output
from tests.joiner.test_crash import _env as crash_env
from tests.joiner.helpers import JOINER, as_map, join_config, produce, read_examples, ref_as_map

CFG = join_config()


async def test_e2e_matches_offline_reference(settings: Settings) -> None:
    events = ml_events(3000, start=20_000, seed=5)
    await create_topics(settings)
    await produce(settings, events)
    started = time.perf_counter()
    counts = await run(settings.updated(joiner=JOINER), until_idle_s=1.0)
    elapsed = time.perf_counter() - started
    examples = await read_examples(settings)
    expected = ref_as_map(offline_join(events, CFG, settings.topics.partitions))
    assert len(examples) == len(expected), "no duplicates without a crash"
    assert as_map(examples) == expected
    n_imp = sum(len(FeatureLog.FromString(v).candidates) for k, _, v in events if k == "features")
    assert counts["impressions"] == n_imp
    print(f"e2e: {counts['impressions'] / elapsed:.0f} impressions/s including start-up and drain")


def _env(settings: Settings) -> dict[str, str]:
    env = crash_env(settings)
    env["DRIFTLINE_JOINER__GROUP_ID"] = settings.joiner.group_id
    env["DRIFTLINE_JOINER__BATCH_SIZE"] = "500"
    env["DRIFTLINE_LOG_LEVEL"] = "INFO"  # (the partitions each worker opened)
    return env


def _worker(env: dict[str, str], log: Path, store: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "joiner.faust_app", "--store", f"rocksdb://{store}", *args],
                            cwd=ROOT, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT)


async def _consumed_all(settings: Settings, procs: list[subprocess.Popen], timeout: float) -> float:
    """Wait until the group has committed every input record; the seconds it took."""
    t = settings.topics
    tps = [TopicPartition(topic, p) for topic in (t.features, t.actions) for p in range(t.partitions)]
    ends = await tansu_quirks.log_end_offsets(settings, tps)
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        committed = await tansu_quirks.committed_offsets(settings, settings.joiner.group_id, tps)
        if all(committed[tp] >= ends[tp] for tp in tps):
            return time.monotonic() - started
        assert all(p.poll() is None for p in procs), "a worker exited"
        await asyncio.sleep(0.5)
    raise AssertionError(f"the group did not consume its input within {timeout} s: {committed} of {ends}")


def _partitions_opened(log: Path) -> set[int]:
    return {int(m) for m in re.findall(r"partition (\d+) opened", log.read_text())}


async def test_kill_9_of_one_of_two_workers_the_other_takes_over(settings: Settings) -> None:
    events = ml_events(20_000, start=100_000, seed=31)
    await create_topics(settings)
    await produce(settings, events)
    env = _env(settings)
    settings.var_dir.mkdir(parents=True, exist_ok=True)
    a_dir, b_dir, c_dir = (settings.var_dir / f"joiner-{w}" for w in "abc")
    a_log, b_log, log = (settings.var_dir.parent / f"joiner-{w}.log" for w in "abc")
    a, b = _worker(env, a_log, a_dir), _worker(env, b_log, b_dir)
    try:
        await _until_output(settings, a, timeout=90)
        time.sleep(random.Random(31).uniform(0.0, 0.5))
        a.send_signal(signal.SIGKILL)
        a.wait()
        before_kill = len(await read_examples(settings))
        took = await _consumed_all(settings, [b], timeout=120)
        owned_by_a = _partitions_opened(a_log)
        assert owned_by_a and owned_by_a <= _partitions_opened(b_log), "b took over a's partitions"
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
    assert b.wait(timeout=60) == 0, b_log.read_text()[-3000:]
    # A third worker, on a fresh disk, rebuilds every partition from the changelog and drains.
    c = _worker(env, log, c_dir, "--until-idle", "1")
    assert c.wait(timeout=120) == 0, log.read_text()[-3000:]
    examples = await read_examples(settings)
    cfg = join_config({"window_seconds": 120, "negative_sample_rate": 0.3})  # as crash_env sets
    expected = ref_as_map(offline_join(events, cfg, settings.topics.partitions))
    assert as_map(examples) == expected
    assert 0 < before_kill < len(expected)
    print(f"killed a (partitions {sorted(owned_by_a)}) at {before_kill} of {len(expected)} examples; "
          f"b consumed the rest {took:.1f} s later; {len(examples) - len(expected)} duplicates")
