"""``driftline traffic``'s join report (:mod:`producers.join_report`) against a real joiner worker:
a stream with stragglers (feature logs far behind their clicks in event time) is counted as the
joiner counted it, and the report warns, naming the settings, when more than 0.1% was lost."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx

from producers.join_report import read_counts, with_join_report
from services.kafka import create_topics
from services.ports import free_port
from services.settings import Settings
from tests.joiner.helpers import produce
from tests.joiner.synth import ml_events
from tests.joiner.test_crash import _env, _joiner


async def test_the_report_counts_what_the_joiner_lost_and_names_the_settings(settings: Settings) -> None:
    events = ml_events(3000, start=60_000, seed=41, straggler_p=0.05)
    await create_topics(settings)
    settings.var_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    urls = [f"http://127.0.0.1:{port}/metrics"]
    proc = _joiner(_env(settings), settings.var_dir.parent / "joiner.log", "--metrics-port", str(port))
    try:
        async with httpx.AsyncClient() as client:
            deadline = time.monotonic() + 60
            while await read_counts(client, urls) is None:
                assert proc.poll() is None and time.monotonic() < deadline, "the joiner's /metrics never answered"
                await asyncio.sleep(0.2)
        sent = sum(kind == "actions" for kind, _, _ in events)

        async def replay() -> dict:
            await produce(settings, events)
            return {"actions": sent}

        join = (await with_join_report(replay(), urls, settle_s=120))["join"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert join["actions"] == join["actions_sent"] == sent, join  # the joiner read every action sent
    assert join["joined"] > 0.8 * sent, join
    # the stragglers' clicks (their feature logs 600 s behind, past the 120 s window) were late
    assert join["late_actions"] > 0 and join["lost"] == join["orphan_actions"] + join["late_actions"]
    assert join["lost"] > 0.001 * sent, join
    for setting in ("joiner.orphan_grace_seconds", "joiner.allowed_lateness_seconds", "joiner.window_seconds", "--speed"):
        assert setting in join["warning"], (setting, join)


async def test_a_joiner_restarted_during_the_replay_is_said_not_counted() -> None:
    """Counters lower after the replay than before: the worker restarted (kill -9, a broker
    reset), so the deltas mean nothing; the report says so at once instead of waiting to settle."""
    from prometheus_client import CollectorRegistry, Counter, start_http_server

    from producers.join_report import report_after

    registry = CollectorRegistry()  # a restarted worker's exporter: 5 actions since its start
    Counter("driftline_joiner_actions", "Actions consumed.", registry=registry).inc(5)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        async with httpx.AsyncClient() as client:
            started = time.monotonic()
            before = {"actions": 900.0, "joined": 800.0, "orphan_actions": 0.0, "late_actions": 0.0,
                      "expired_impressions": 0.0, "pending_actions": 0.0}
            report = await report_after(client, [f"http://127.0.0.1:{port}/metrics"], before, 1000, settle_s=30)
        assert report["restarted"] is True and "warning" not in report and time.monotonic() - started < 5, report
    finally:
        server.shutdown()
        thread.join(timeout=5)
