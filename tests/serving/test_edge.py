"""The edge refuses what downstream could not keep: event times out of range, feature logs larger
than the topic takes; extreme but valid input is answered, never a 5xx."""

from __future__ import annotations

import asyncio
import time

import httpx
from serving_helpers import read_keys, read_records, running, wait_ready

from proto import Action, FeatureLog
from services.settings import Settings
from serving.app import create_app

I64 = 2**63 - 1


def rank(items: list[int] | None = None, **extra: object) -> dict:
    return {"user_id": 1, "candidates": [{"item_id": i} for i in (items or [1, 2, 3])], **extra}


def test_event_time_bounds_sizes_and_extreme_ids(serving_settings: Settings, filled_store: Settings) -> None:
    app = create_app(filled_store)
    bounds = serving_settings.event_time
    with running(app) as base:
        wait_ready(base)
        post = lambda path, body: httpx.post(f"{base}{path}", json=body, timeout=30)  # noqa: E731
        now = int(time.time() * 1000)

        # Event times: refused with the field and the bound named; missing means now.
        r = post("/rank", rank(event_time_ms=I64, request_id="far-future"))
        assert r.status_code == 422 and "event_time_ms" in r.json()["message"]
        assert "max_future_s" in r.json()["message"] and f"{bounds.max_future_s:g} s" in r.json()["message"]
        r = post("/rank", rank(event_time_ms=1, request_id="far-past"))
        assert r.status_code == 422 and "max_past_s" in r.json()["message"]
        assert post("/rank", rank(event_time_ms=-5)).status_code == 422
        assert post("/rank", rank(event_time_ms=now - 60_000, request_id="a-minute-ago")).status_code == 200
        assert post("/rank", rank(request_id="no-time")).status_code == 200
        r = post("/actions", {"actions": [
            {"request_id": "ok", "item_id": 1, "action_type": "click", "event_time_ms": now},
            {"request_id": "bad", "item_id": 1, "action_type": "click", "event_time_ms": I64}]})
        assert r.status_code == 422 and "actions[1].event_time_ms" in r.json()["message"], r.text
        assert post("/actions", {"actions": [{"request_id": "x", "item_id": 1, "action_type": "click",
                                              "event_time_ms": -1}]}).status_code == 422

        # Extreme valid-typed input is scored and logged, not a 5xx.
        r = post("/rank", {"request_id": "extreme", "user_id": I64, "event_time_ms": now,
                           "context": {"sparse": {"user_id": [-(2**63), I64]}},
                           "candidates": [{"item_id": I64, "features": {"sparse": {"genres": [-(2**63)]}}},
                                          {"item_id": 0}]})
        assert r.status_code == 200, r.text
        assert post("/rank", rank(context={"dense": {"d": 1e308}})).status_code == 422  # not a float32
        r = post("/actions", {"actions": [{"request_id": "z" * 128, "item_id": I64, "action_type": "c" * 64,
                                           "user_id": I64}]})
        assert r.status_code == 202, r.text

        # ~6 MB of valid JSON whose feature log would be over the topic's message size: 413, and
        # nothing spooled for it.
        pending = app.state.serving.feature_log.buffered
        big = {"request_id": "too-big", "user_id": 1, "candidates": [
            {"item_id": i, "features": {"sparse": {"genres": list(range(10**18, 10**18 + 150)),
                                                   "year": list(range(10**18, 10**18 + 150))}}}
            for i in range(1000)]}
        body = httpx.Request("POST", "/", json=big).content
        assert len(body) > 5_000_000
        r = post("/rank", big)
        assert r.status_code == 413, r.text
        message = r.json()["message"]
        assert f"over the limit of {filled_store.serving.feature_log_max_bytes} bytes" in message
        assert int(message.split(" is ")[1].split(" bytes")[0]) > filled_store.serving.feature_log_max_bytes
        assert app.state.serving.feature_log.buffered <= pending
        assert 'driftline_serving_feature_log_refused_total{reason="too_large"} 1.0' in httpx.get(f"{base}/metrics").text

    logged = asyncio.run(read_keys(serving_settings, serving_settings.topics.features,
                                   {"a-minute-ago", "no-time", "extreme"}))
    assert {"a-minute-ago", "no-time", "extreme"} <= logged and not logged & {"too-big", "far-future", "far-past"}
    logs = {m.request_id: m for m in asyncio.run(read_records(serving_settings, serving_settings.topics.features,
                                                       FeatureLog, 3))}
    # no time given: the traffic's own clock (serving/event_clock.py), here the request before it
    assert logs["no-time"].event_time_ms == logs["a-minute-ago"].event_time_ms == now - 60_000
    actions = asyncio.run(read_records(serving_settings, serving_settings.topics.actions, Action, 1, timeout=5))
    assert [a.request_id for a in actions] == ["z" * 128]  # the refused batch wrote nothing
