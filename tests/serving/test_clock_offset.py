"""A serving replica measures its clock against the feature store's (Redis ``TIME``, real Redis),
warns once it is a minute or more off, and the status page names it: a replica whose clock runs
ahead closes the other replicas' join windows early (:mod:`serving.clock_offset`)."""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import REGISTRY

from serving.clock_offset import ClockOffsetLoop
from serving.feature_store import FeatureStore
from status.options import Target
from status.problems import problems
from status.targets import TargetState


def test_a_replica_whose_clock_runs_ahead_is_measured_warned_and_named(redis_url: str, caplog) -> None:
    async def go() -> tuple[float | None, float | None, float | None]:
        store = FeatureStore(redis_url, "clocktest")
        try:
            right, ahead = ClockOffsetLoop(store, 1.0), ClockOffsetLoop(store, 1.0, clock=lambda: time.time() + 900)
            await right.check()
            with caplog.at_level(logging.WARNING, logger="serving.clock_offset"):
                await ahead.check()
                await ahead.check()  # (said once)
            return right.offset, ahead.offset, REGISTRY.get_sample_value("driftline_serving_clock_offset_seconds")
        finally:
            await store.close()

    right, ahead, exported = asyncio.run(go())
    assert right is not None and abs(right) < 1.0  # (the same machine's clock)
    assert ahead is not None and 899 < ahead < 901 and exported == ahead
    warnings = [r.getMessage() for r in caplog.records if r.name == "serving.clock_offset"]
    assert len(warnings) == 1 and "900 s ahead of the feature store's" in warnings[0], warnings

    serving = TargetState(Target("serving", "http://s/metrics"), up=True)
    serving.history.append((1.0, {"driftline_serving_clock_offset_seconds": [({}, ahead)]}))
    assert [p["problem"] for p in problems([serving], now=1.0, window_s=30.0)] == [
        "this replica's clock is 900 s off the feature store's (ahead: it closes the other replicas' join windows "
        "that much early, their later clicks learned as negatives; behind: its own impressions come late for the "
        "join): set the clocks right (NTP)"]


def test_an_unreachable_store_gives_no_reading() -> None:
    async def go() -> float | None:
        store = FeatureStore("redis://127.0.0.1:1/0", "clocktest", timeout_s=0.5)
        try:
            loop = ClockOffsetLoop(store, 1.0)
            await loop.check()
            return loop.offset
        finally:
            await store.close()

    assert asyncio.run(go()) is None
