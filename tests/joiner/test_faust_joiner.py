"""Several joiner workers (Faust) in one group on the real broker: kill -9 of one, the other
takes over; a worker added while traffic flows; the join watchdog. One worker's behaviour:
``test_joiner_broker.py``, ``test_poison.py``, ``test_crash.py``, ``test_broker_reset.py``."""

from __future__ import annotations

import asyncio
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from services.kafka import create_topics
from services.settings import Settings
from tests.joiner.helpers import as_map, consumed_all, join_config, produce, read_examples, ref_as_map
from tests.joiner.reference import offline_join
from tests.joiner.synth import ml_events
from tests.joiner.test_crash import ROOT, _until_output
from tests.joiner.test_crash import _env as crash_env


def _env(settings: Settings) -> dict[str, str]:
    env = crash_env(settings)
    env["DRIFTLINE_JOINER__BATCH_SIZE"] = "500"
    env["DRIFTLINE_LOG_LEVEL"] = "INFO"  # (the partitions each worker opened)
    return env


def _worker(env: dict[str, str], log: Path, store: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "joiner", "--store", f"rocksdb://{store}", *args],
                            cwd=ROOT, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def _partitions_opened(log: Path) -> set[int]:
    return {int(m) for m in re.findall(r"partition (\d+) opened", log.read_text())}


def _drain(env: dict[str, str], log: Path, store: Path) -> None:
    """A worker on ``store`` restores every partition and drains. On an empty disk it rebuilds them
    from the whole changelog (~104k records for the 12k requests here: about a second alone, a
    fetch at a time: joiner.faust_restore; the bound is not a speed); on a stopped worker's disk it
    reads only the changelog past what that worker stored (its active partitions and its standby
    copies of the others)."""
    c = _worker(env, log, store, "--until-idle", "1")
    try:
        try:
            code = c.wait(timeout=300)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"no drain within 300 s:\n{log.read_text()[-3000:]}") from None
        assert code == 0, log.read_text()[-3000:]
    finally:
        if c.poll() is None:
            c.kill()


async def test_kill_9_of_one_of_two_workers_the_other_takes_over(settings: Settings) -> None:
    events = ml_events(12_000, start=100_000, seed=31)
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
        took = await consumed_all(settings, [b], timeout=120)
        owned_by_a = _partitions_opened(a_log)
        assert owned_by_a and owned_by_a <= _partitions_opened(b_log), "b took over a's partitions"
    finally:
        for p in (a, b):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
    assert b.wait(timeout=60) == 0, b_log.read_text()[-3000:]
    _drain(env, log, c_dir)  # a machine lost with its disk: its replacement starts empty
    rebuilt = re.findall(r"rebuilt partitions from (\d+) changelog records", log.read_text())
    assert rebuilt and int(rebuilt[-1]) > 0, "the rebuild took the changelog a fetch at a time (joiner.faust_restore)"
    examples = await read_examples(settings)
    cfg = join_config({"window_seconds": 120, "negative_sample_rate": 0.3})  # as crash_env sets
    expected = ref_as_map(offline_join(events, cfg, settings.topics.partitions))
    assert as_map(examples) == expected
    assert 0 < before_kill < len(expected)
    print(f"killed a (partitions {sorted(owned_by_a)}) at {before_kill} of {len(expected)} examples; "
          f"b consumed the rest {took:.1f} s later; {len(examples) - len(expected)} duplicates")


async def test_a_worker_added_while_traffic_flows_takes_partitions_without_loss(settings: Settings) -> None:
    events = ml_events(12_000, start=200_000, seed=32)
    await create_topics(settings)
    env = _env(settings)
    settings.var_dir.mkdir(parents=True, exist_ok=True)
    a_log, b_log, log = (settings.var_dir.parent / f"joiner-{w}.log" for w in "abc")
    a = _worker(env, a_log, settings.var_dir / "joiner-a")
    b = None
    step = len(events) // 10
    try:
        await produce(settings, events[:3 * step])
        await _until_output(settings, a, timeout=90)  # a alone has all partitions, mid-stream
        b = _worker(env, b_log, settings.var_dir / "joiner-b")
        for i in range(3, 10):
            if i == 9:  # the last tenth once b holds partitions: b has traffic to take, however slowly it joined
                _wait_for(b_log, "Worker ready", b, timeout=90)
            await produce(settings, events[i * step:(i + 1) * step if i < 9 else None])
            await asyncio.sleep(1.0)
        await consumed_all(settings, [a, b], timeout=120)
        assert _partitions_opened(b_log), "b got partitions"
    finally:
        for p in (a, b):  # one after the other
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=60)
    assert a.returncode == 0 and b is not None and b.returncode == 0
    _drain(env, log, settings.var_dir / "joiner-b")  # b started again
    examples = await read_examples(settings)
    cfg = join_config({"window_seconds": 120, "negative_sample_rate": 0.3})  # as crash_env sets
    assert as_map(examples) == ref_as_map(offline_join(events, cfg, settings.topics.partitions))
    print(f"a had {sorted(_partitions_opened(a_log))}, b took {sorted(_partitions_opened(b_log))}; "
          f"{len(examples) - len(set(e.example_id for e in examples))} duplicates")


async def test_a_worker_without_an_assignment_exits_to_be_restarted_and_stops_on_sigterm(settings: Settings) -> None:
    """The join watchdog: a worker waiting longer than ``joiner.join_timeout_s`` for its group
    assignment exits with code 4, and SIGTERM stops a worker that is still waiting (Faust's start
    does not return before the first assignment is recovered). Both exit while the broker still
    holds their join (faust_quirks quirk 4): the process does not wait for the consumer thread."""
    await create_topics(settings)
    settings.var_dir.mkdir(parents=True, exist_ok=True)
    # (tansu holds a first join for about half the session timeout, tansu_quirks quirk 3: ~30 s
    # here, so both workers are still in it when the watchdog looks and when SIGTERM comes; the
    # suite's 3 s joined in ~1.5 s, within a busy machine's reach)
    env = _env(settings) | {"DRIFTLINE_JOINER__SESSION_TIMEOUT_MS": "60000"}
    logs = [settings.var_dir.parent / f"joiner-{w}.log" for w in ("watchdog", "term")]
    impatient = _worker(env | {"DRIFTLINE_JOINER__JOIN_TIMEOUT_S": "2.5"}, logs[0], settings.var_dir / "joiner-a")
    termed = _worker(env | {"DRIFTLINE_JOINER__GROUP_ID": settings.joiner.group_id + "-term"}, logs[1],
                     settings.var_dir / "joiner-b")
    try:
        _wait_for(logs[1], "Recovery]: Starting", termed, timeout=60)  # (Faust started; it joins next)
        termed.send_signal(signal.SIGTERM)
        assert "Executing _on_partitions_assigned" not in logs[1].read_text()
        assert _exit_code(impatient, timeout=20) == 4, logs[0].read_text()[-3000:]
        assert "no group assignment for 2.5 s" in logs[0].read_text()
        assert _exit_code(termed, timeout=20) == 0, logs[1].read_text()[-3000:]
    finally:
        for p in (impatient, termed):
            if p.poll() is None:
                p.kill()


def _wait_for(log: Path, text: str, proc: subprocess.Popen, timeout: float) -> float:
    """Seconds until ``text`` is in the worker's log."""
    started = time.monotonic()
    while text not in log.read_text():
        assert time.monotonic() - started < timeout, f"no {text!r} within {timeout} s: {log.read_text()[-3000:]}"
        assert proc.poll() is None, f"exited {proc.returncode}: {log.read_text()[-3000:]}"
        time.sleep(0.1)
    return time.monotonic() - started


async def test_after_two_workers_stop_at_once_a_new_worker_gets_an_assignment(settings: Settings) -> None:
    """tansu quirk 6: after two members left at the same instant the coordinator kept one of them
    as the leader, and a new worker's joins never completed (4 of 7 tries). The workaround (the
    group deleted after 3 failed follower SyncGroups) lets it in after ~25 s; without the bug it
    is in after one join. Either way it gets an assignment long before the join watchdog."""
    await create_topics(settings)
    await produce(settings, ml_events(500, start=300_000, seed=33))
    settings.var_dir.mkdir(parents=True, exist_ok=True)
    env = _env(settings)
    logs = [settings.var_dir.parent / f"joiner-{w}.log" for w in "abc"]
    a, b = (_worker(env, logs[i], settings.var_dir / f"joiner-{w}") for i, w in enumerate("ab"))
    c = None
    try:
        for proc, log in ((a, logs[0]), (b, logs[1])):
            _wait_for(log, "Worker ready", proc, timeout=90)
        await consumed_all(settings, [a, b], timeout=60)  # (both in the group's last generation)
        a.send_signal(signal.SIGTERM)
        b.send_signal(signal.SIGTERM)
        assert a.wait(timeout=60) == 0 and b.wait(timeout=60) == 0
        c = _worker(env, logs[2], settings.var_dir / "joiner-c")
        took = _wait_for(logs[2], "Executing _on_partitions_assigned", c, timeout=55)
        print(f"the new worker got its assignment after {took:.1f} s; the workaround "
              f"{'ran' if 'tansu quirk 6' in logs[2].read_text() else 'was not needed'}")
    finally:
        for p in (a, b, c):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=60)


def _exit_code(proc: subprocess.Popen, timeout: float) -> int | None:
    """The process's exit code, or None when it is still running after ``timeout`` s (its log is
    then the assertion's message, not a ``TimeoutExpired``)."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
