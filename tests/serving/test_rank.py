"""/rank, /actions, health and validation against a real uvicorn, Redis and broker."""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
import pytest
from prometheus_client import REGISTRY
from serving_helpers import dense_delta, publish, read_records, running, sparse_delta, wait_ready

from proto import FeatureLog
from services.settings import Settings
from serving.app import create_app
from serving.correction import correct
from serving.fm_model import FMModel


def rank_body(user_id: int = 1, items: list[int] | None = None, **extra: object) -> dict:
    items = items if items is not None else list(range(1, 21))
    return {"user_id": user_id, "candidates": [{"item_id": i} for i in items], **extra}


async def read_feature_logs(settings: Settings, n: int, timeout: float = 20.0) -> list[FeatureLog]:
    return await read_records(settings, settings.topics.features, FeatureLog, n, timeout)


def test_rank_sorted_logged_and_deltas_change_scores(serving_settings: Settings, filled_store: Settings) -> None:
    app = create_app(filled_store)
    with running(app) as base:
        ready = wait_ready(base)
        assert ready["model_version"]["sparse_version"] == 0
        r = httpx.post(f"{base}/rank", json=rank_body(request_id="req-1"), timeout=10)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["request_id"] == "req-1" and body["user_known"] is True
        scores = [it["score"] for it in body["items"]]
        assert scores == sorted(scores, reverse=True) and len(scores) == 20
        # Untrained model: p = 0.5, and no sample rate recorded with it: not corrected.
        assert scores[0] == pytest.approx(0.5)
        assert ready["sample_rate"] == {"rate": 1.0, "source": "unrecorded", "slice": "deepfm"}
        before = {it["item_id"]: it["score"] for it in body["items"]}

        # Publish deltas for three of the candidates and a bias: scores move within seconds.
        keys = np.array([3, 7, 11], np.int64)
        values = np.zeros((3, 5), np.float32)
        values[:, 0] = [2.0, 1.0, -1.0]
        asyncio.run(publish(serving_settings, [sparse_delta("item_id", keys, values, version=1),
                                               dense_delta(-0.5, version=1, sample_rates={
                                                   "global": 0.5, "slices": {"deepfm": 0.25, "other": 0.1}})]))
        deadline = time.monotonic() + 15
        while True:
            body = httpx.post(f"{base}/rank", json=rank_body(), timeout=10).json()
            if body["model_version"]["sparse_version"] >= 1 and body["model_version"]["dense_version"] >= 1:
                break
            assert time.monotonic() < deadline, body["model_version"]
            time.sleep(0.1)
        after = {it["item_id"]: it["score"] for it in body["items"]}
        assert [it["item_id"] for it in body["items"][:2]] == [3, 7]
        assert after[11] < after[1] < before[1]
        # item 1 has no rows: raw sigmoid(-0.5), corrected with the delta's rate of this slice
        assert after[1] == pytest.approx(float(correct(1 / (1 + np.exp(0.5)), 0.25)), rel=1e-6)
        assert httpx.get(f"{base}/readyz").json()["sample_rate"] == {"rate": 0.25, "source": "slice",
                                                                     "slice": "deepfm"}
        metrics = httpx.get(f"{base}/metrics").text
        assert 'driftline_serving_model_version{kind="sparse",model_id="deepfm"} 1.0' in metrics
        assert "driftline_serving_delta_apply_lag_seconds_count" in metrics
        assert 'driftline_serving_sample_rate{model_id="deepfm",source="slice"} 0.25' in metrics
        assert 'driftline_serving_sample_rate{model_id="deepfm",source="unrecorded"}' not in metrics  # other tests' models may have one
        assert "driftline_serving_request_seconds_bucket" in metrics

        # Unknown user: scored with defaults, flagged.
        r = httpx.post(f"{base}/rank", json=rank_body(user_id=999_999), timeout=10)
        assert r.status_code == 200 and r.json()["user_known"] is False

        # /actions writes Actions; clicks become the user's real-time recent_items.
        r = httpx.post(f"{base}/actions", timeout=10, json={"actions": [
            {"request_id": "req-1", "item_id": 3, "action_type": "click", "user_id": 1}]})
        assert r.status_code == 202, r.text

    logs = asyncio.run(read_feature_logs(serving_settings, 3))
    first = next(m for m in logs if m.request_id == "req-1")
    assert len(first.candidates) == 20 and first.user_id == 1
    assert list(first.context.sparse["gender"].ids) == [11]
    assert set(first.candidates[0].features.sparse) == {"item_id", "genres", "year"}


def test_recent_clicks_from_actions(serving_settings: Settings, filled_store: Settings) -> None:
    app = create_app(filled_store)
    with running(app) as base:
        wait_ready(base)
        store = app.state.serving.store
        # the realtime consumer joins its group a few seconds after start-up; on a loaded machine
        # (3 test workers on 2 cores) its first connects timed out twice, 10 s each, and 30 s was short
        deadline = time.monotonic() + 90
        n = 0
        while True:
            n += 1
            r = httpx.post(f"{base}/actions", timeout=10, json={"actions": [
                {"request_id": f"a{n}", "item_id": 40 + n % 5, "action_type": "click", "user_id": 2},
                {"request_id": f"a{n}", "item_id": 9, "action_type": "view", "user_id": 2}]})
            assert r.status_code == 202
            time.sleep(0.3)
            clicks = asyncio.run(_clicks(serving_settings.redis, store.clicks_key(2)))
            if clicks:
                break
            assert time.monotonic() < deadline, "recent clicks never recorded"
        assert 9 not in clicks and all(40 <= c < 45 for c in clicks)


async def _clicks(url: str, key: str) -> list[int]:
    import redis.asyncio as aioredis

    r = aioredis.Redis.from_url(url)
    try:
        return [int(x) for x in await r.lrange(key, 0, -1)]
    finally:
        await r.aclose()


BAD_INPUT = [  # (body, what the message names)
    ({"user_id": 1, "candidates": []}, "candidates"),
    ({"user_id": 1, "candidates": [{"item_id": i} for i in range(1001)]}, "at most 1000"),
    ({"user_id": "abc", "candidates": [{"item_id": 1}]}, "user_id"),
    ({"user_id": 1, "candidates": [{"item_id": "x"}]}, "item_id"),
    ({"user_id": -5, "candidates": [{"item_id": 1}]}, "user_id"),
    # features the model does not declare (the built-in FM reads the demo's slots, no dense)
    ({"user_id": 1, "context": {"sparse": {"device": [3]}}, "candidates": [{"item_id": 1}]},
     "context.sparse: the model has no sparse feature 'device'"),
    ({"user_id": 1, "candidates": [{"item_id": 1}, {"item_id": 2, "features": {"dense": {"hour": 1.0}}}]},
     "candidates[1].features.dense: the model has no dense feature 'hour'"),
    ({"user_id": 1, "candidates": [{"item_id": 1, "features": {"dense": {"x": "NaN"}}}]}, "dense"),
    ({"user_id": 1, "candidates": [{"item_id": 1}], "surprise": 1}, "surprise"),
    ({"user_id": 2**64, "candidates": [{"item_id": 1}]}, "user_id"),
]


def test_rank_rejects_bad_input(serving_settings: Settings, filled_store: Settings) -> None:
    """Each body is a 422 naming what is wrong. Validation is our logic only: the ASGI transport
    suffices; one lifespan for all (it gives the model the feature names are checked against)."""
    app = create_app(filled_store)

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            async with app.router.lifespan_context(app):
                return [await c.post("/rank", json=body) for body, _ in BAD_INPUT]

    for (_, needle), r in zip(BAD_INPUT, asyncio.run(go())):
        assert r.status_code == 422, (needle, r.text)
        assert needle in r.json()["message"] or needle in str(r.json()["detail"]), (needle, r.json())


def test_kafka_down_rank_answers_from_the_spool(redis_url: str, tmp_path, filled_store: Settings,
                                                serving_settings: Settings) -> None:
    """Kafka unreachable: /rank still answers (each feature log spooled, never blocking on Kafka)
    until the spool is full, then 503 with Retry-After; /actions is a 503 naming Kafka."""
    from services.ports import free_port

    down = filled_store.model_copy(update={"kafka_bootstrap_servers": f"127.0.0.1:{free_port()}"})
    down.redis_url = redis_url
    # A snapshot is the model when Kafka is unreachable.
    model = FMModel(dim=filled_store.serving.embedding_dim)
    model.sparse.version, model.dense.version = 5, 2
    model.save_snapshot(filled_store.snapshot_root)
    app = create_app(down.updated(serving=dict(spool_max_bytes=20_000)))
    with running(app) as base:
        ready = wait_ready(base, timeout=10)
        assert ready["model_version"]["sparse_version"] == 5 and not ready["feature_log_connected"]
        started = time.monotonic()
        codes = [httpx.post(f"{base}/rank", json=rank_body(), timeout=5) for _ in range(30)]
        assert time.monotonic() - started < 5  # never blocked on Kafka
        ok = [r for r in codes if r.status_code == 200]
        full = [r for r in codes if r.status_code == 503]
        assert ok and full and len(ok) + len(full) == 30
        assert codes.index(full[0]) == len(ok)  # every 200 came before the spool filled
        assert "spool full" in full[0].json()["message"] and int(full[0].headers["Retry-After"]) >= 1
        ready = httpx.get(f"{base}/readyz").json()
        assert ready["feature_log_buffered"] == len(ok) and 0 < ready["feature_log_spool_bytes"] <= 20_000
        text = httpx.get(f"{base}/metrics").text
        assert 'driftline_serving_feature_log_refused_total{reason="SpoolFull"}' in text
        r = httpx.post(f"{base}/actions", json={"actions": [{"request_id": "r", "item_id": 1, "action_type": "click"}]})
        assert r.status_code == 503 and "Kafka" in r.text


def test_not_ready_without_model(serving_settings: Settings, filled_store: Settings) -> None:
    """No snapshot and no reachable delta topic: /healthz is fine, /readyz and /rank say 503."""
    from services.ports import free_port

    down = filled_store.model_copy(update={"kafka_bootstrap_servers": f"127.0.0.1:{free_port()}"})
    app = create_app(down)

    async def go() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            async with app.router.lifespan_context(app):
                return (await c.get("/healthz"), await c.get("/readyz"), await c.post("/rank", json=rank_body()))

    health, ready, rank = asyncio.run(go())
    assert health.status_code == 200
    assert ready.status_code == 503 and ready.json()["model_loaded"] is False
    assert rank.status_code == 503 and "no model loaded" in rank.json()["message"]


def test_feature_store_down_is_a_503_unless_defaults_are_asked_for(filled_store: Settings,
                                                                    serving_settings: Settings) -> None:
    """Redis unreachable: /rank is a 503 with Retry-After, not an answer on default features; with
    allow_default_features it is a 200 marked degraded whose feature log is not written."""
    from services.ports import free_port

    down = filled_store.model_copy(update={"redis_url": f"redis://127.0.0.1:{free_port()}/0"})
    app = create_app(down.updated(serving=dict(feature_store_wait_s=0.2)))
    with running(app) as base:
        wait_ready(base)
        r = httpx.post(f"{base}/rank", json=rank_body(request_id="refused"), timeout=10)
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1, r.text
        assert "feature store" in r.json()["message"]
        r = httpx.post(f"{base}/rank", json=rank_body(request_id="degraded", allow_default_features=True), timeout=10)
        assert r.status_code == 200 and r.headers["X-Driftline-Degraded"] == "feature-store", r.text
        assert httpx.get(f"{base}/readyz").json()["feature_log_buffered"] == 0
        assert "driftline_serving_feature_store_unavailable_total 1.0" in httpx.get(f"{base}/metrics").text
    assert not asyncio.run(read_feature_logs(serving_settings, 1, timeout=3))


def test_a_hung_feature_store_is_a_503_in_time_and_answers_come_back_with_it(filled_store: Settings,
                                                                             tmp_path) -> None:
    """Redis that keeps its connections and stops answering (SIGSTOP: a fork for a large save, a
    network that drops packets): each /rank is a 503 with Retry-After within the store's timeout,
    none hangs and none is scored on default features; once Redis answers again, so does /rank."""
    import signal
    import subprocess

    from serving_helpers import ITEMS, USERS

    from driftline.embedded import redis_binary, wait_for_port
    from services.ports import free_port
    from serving.feature_store import FeatureStore

    port = free_port()
    server = subprocess.Popen([str(redis_binary()), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    try:
        wait_for_port("127.0.0.1", port, 20, "redis", server)
        own = filled_store.model_copy(update={"redis_url": f"redis://127.0.0.1:{port}/0"})

        async def fill() -> None:
            store = FeatureStore(own.redis, own.serving.redis_prefix)
            await store.put(USERS, ITEMS)
            await store.close()

        asyncio.run(fill())
        with running(create_app(own)) as base:
            wait_ready(base)
            post = lambda: httpx.post(f"{base}/rank", json=rank_body(), timeout=10)  # noqa: E731
            assert post().json()["user_known"]
            server.send_signal(signal.SIGSTOP)
            try:
                for _ in range(3):
                    started = time.monotonic()
                    r = post()
                    assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1, r.text
                    assert time.monotonic() - started < 3.0
            finally:
                server.send_signal(signal.SIGCONT)
            deadline = time.monotonic() + 15
            while (r := post()).status_code != 200:
                assert time.monotonic() < deadline, r.text
                time.sleep(0.2)
            assert r.json()["user_known"] and "X-Driftline-Degraded" not in r.headers
    finally:
        server.kill()
        server.wait()


def test_overload_is_503s_never_answers_on_default_features(filled_store: Settings) -> None:
    """500 concurrent /rank on a pool of 4 Redis connections: each answer is a 200 scored with the
    user's stored features or a 503 with Retry-After; none on default features."""
    app = create_app(filled_store.updated(serving=dict(feature_store_connections=4, feature_store_wait_s=0.05)))

    async def burst(base: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base, timeout=60, limits=httpx.Limits(max_connections=500)) as c:
            return await asyncio.gather(*(c.post("/rank", json=rank_body()) for _ in range(500)))

    with running(app) as base:
        wait_ready(base)
        answers = asyncio.run(burst(base))
    codes = {r.status_code for r in answers}
    assert codes <= {200, 503}, codes
    ok = [r for r in answers if r.status_code == 200]
    assert ok and all(r.json()["user_known"] and "X-Driftline-Degraded" not in r.headers for r in ok)
    assert all(int(r.headers["Retry-After"]) >= 1 for r in answers if r.status_code == 503)


def test_a_request_without_event_time_takes_the_traffics_clock(filled_store: Settings,
                                                               serving_settings: Settings) -> None:
    """Beside a replay of the year 2000, a request and an action without event_time_ms are stamped
    with the replay's time, not the wall clock: they cannot move a joiner watermark years ahead."""
    year_2000 = 946_684_800_000
    app = create_app(filled_store.updated(event_time=dict(max_past_s=40 * 365 * 86400)))
    with running(app) as base:
        wait_ready(base)
        r = httpx.post(f"{base}/rank", json=rank_body(request_id="replayed", event_time_ms=year_2000), timeout=10)
        assert r.status_code == 200, r.text
        r = httpx.post(f"{base}/rank", json=rank_body(request_id="curl"), timeout=10)
        assert r.status_code == 200, r.text
    logs = {m.request_id: m for m in asyncio.run(read_feature_logs(serving_settings, 2))}
    assert logs["replayed"].event_time_ms == logs["curl"].event_time_ms == year_2000


def test_a_score_only_request_writes_no_feature_log_and_moves_no_clock(filled_store: Settings,
                                                                       serving_settings: Settings) -> None:
    """``"log": false`` is scored like any request, but logs no impression (nothing is trained on
    it, no action joins it), and its event time does not become the clock of later requests."""
    year_2000 = 946_684_800_000
    app = create_app(filled_store.updated(event_time=dict(max_past_s=40 * 365 * 86400)))

    def score_only() -> float:  # this process's count: other tests score too
        return REGISTRY.get_sample_value("driftline_serving_score_only_total") or 0.0

    before = score_only()
    with running(app) as base:
        wait_ready(base)
        logged = httpx.post(f"{base}/rank", json=rank_body(request_id="replayed", event_time_ms=year_2000), timeout=10)
        probe = httpx.post(f"{base}/rank", timeout=10, json=rank_body(
            request_id="probe", event_time_ms=int(time.time() * 1000), log=False))
        assert logged.status_code == probe.status_code == 200, probe.text
        assert probe.json()["items"] == logged.json()["items"]
        curl = httpx.post(f"{base}/rank", json=rank_body(request_id="curl"), timeout=10)
        assert curl.status_code == 200, curl.text
        assert score_only() - before == 1
        assert "driftline_serving_score_only_total" in httpx.get(f"{base}/metrics").text
        bad = httpx.post(f"{base}/rank", json=rank_body(log="no"), timeout=10)
        assert bad.status_code == 422 and "log" in bad.text
    logs = {m.request_id: m for m in asyncio.run(read_feature_logs(serving_settings, 3, timeout=5))}
    assert set(logs) == {"replayed", "curl"}
    assert logs["curl"].event_time_ms == year_2000  # the probe's wall-clock time moved nothing


def _ranked(base: str, request_id: str) -> httpx.Response:
    r = httpx.post(f"{base}/rank", json=rank_body(request_id=request_id), timeout=10)
    assert r.status_code == 200, r.text
    return r


def _until(check, what: str) -> None:
    deadline = time.monotonic() + 10
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_an_emptied_feature_store_marks_answers_and_withholds_their_feature_logs(
        serving_settings: Settings, filled_store: Settings) -> None:
    """The store loses its loaded features (what a Redis restart without persistence does): answers
    are marked degraded, /readyz says so, their feature logs are withheld; a reload ends it. A
    replica started while the store is empty knows it from its first request."""
    import redis
    from serving_helpers import ITEMS, USERS

    from serving.feature_store import FeatureStore

    fast = filled_store.updated(serving=dict(feature_store_check_s=0.1))
    prefix = fast.serving.redis_prefix
    client = redis.Redis.from_url(fast.redis)

    with running(create_app(fast)) as base:
        wait_ready(base)
        r = _ranked(base, "whole")
        assert r.json()["user_known"] and "X-Driftline-Degraded" not in r.headers
        client.delete(*client.keys(f"{prefix}:*"))  # the restart without persistence
        _until(lambda: httpx.get(f"{base}/readyz").json()["feature_store_emptied"], "emptied not seen")
        ready = httpx.get(f"{base}/readyz").json()
        assert ready["feature_store"] is False and ready["ready"] is True
        r = _ranked(base, "emptied")
        assert r.headers["X-Driftline-Degraded"] == "feature-store-emptied" and not r.json()["user_known"]
        metrics_text = httpx.get(f"{base}/metrics").text
        assert "driftline_serving_feature_store_emptied 1.0" in metrics_text
        assert 'driftline_serving_feature_logs_withheld_total{reason="feature-store-emptied"} 1.0' in metrics_text

    with running(create_app(fast)) as base:  # a restart while the store is still empty
        wait_ready(base)
        assert _ranked(base, "emptied-after-restart").headers["X-Driftline-Degraded"] == "feature-store-emptied"

        async def reload() -> None:
            store = FeatureStore(fast.redis, prefix)
            await store.put(USERS, ITEMS)
            await store.close()

        asyncio.run(reload())
        _until(lambda: not httpx.get(f"{base}/readyz").json()["feature_store_emptied"], "reload not seen")
        r = _ranked(base, "reloaded")
        assert r.json()["user_known"] and "X-Driftline-Degraded" not in r.headers
    logs = asyncio.run(read_feature_logs(serving_settings, 3, timeout=10))
    assert sorted(fl.request_id for fl in logs) == ["reloaded", "whole"]


def test_a_redis_that_evicts_keys_marks_answers_and_withholds_their_feature_logs(
        serving_settings: Settings, options: Settings, tmp_path) -> None:
    """Redis as a cache (``maxmemory`` with ``allkeys-lru``) evicts keys once it is full: any user or
    item may then have lost its features without a word. Once Redis evicted keys since the load,
    answers are marked, /readyz says so and their feature logs are withheld; a load after the fix
    (no memory bound) ends it."""
    import subprocess

    import redis
    from serving_helpers import ITEMS, USERS

    from driftline.embedded import redis_binary, wait_for_port
    from services.ports import free_port
    from serving.feature_store import LOADED_MARKER, FeatureStore, marker_key

    port = free_port()
    server = subprocess.Popen([str(redis_binary()), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", str(tmp_path), "--maxmemory", "8mb",
                               "--maxmemory-policy", "allkeys-lru"], stdout=subprocess.DEVNULL)
    wait_for_port("127.0.0.1", port, 20, "redis", server)
    fast = options.model_copy(update={"redis_url": f"redis://127.0.0.1:{port}/0"}).updated(
        serving=dict(feature_store_check_s=0.1))
    client = redis.Redis(port=port)

    async def load() -> None:
        store = FeatureStore(fast.redis, fast.serving.redis_prefix)
        await store.put(USERS, ITEMS)
        await store.close()

    try:
        asyncio.run(load())
        with running(create_app(fast)) as base:
            wait_ready(base)
            r = _ranked(base, "whole")
            assert r.json()["user_known"] and "X-Driftline-Degraded" not in r.headers
            assert httpx.get(f"{base}/readyz").json()["feature_store_evicted"] is False
            loaded = marker_key(fast.serving.redis_prefix, LOADED_MARKER)
            i = 0
            while client.info("stats")["evicted_keys"] == 0:  # (another writer fills it up)
                client.set(f"cache:{i}", "x" * 10_000)
                client.get(loaded)  # (kept recently used: LRU evicts the features, not the marker)
                i += 1
            _until(lambda: httpx.get(f"{base}/readyz").json()["feature_store_evicted"], "evictions not seen")
            ready = httpx.get(f"{base}/readyz").json()
            assert ready["feature_store"] is False and ready["feature_store_emptied"] is False
            assert _ranked(base, "evicted").headers["X-Driftline-Degraded"] == "feature-store-evicted"
            metrics_text = httpx.get(f"{base}/metrics").text
            assert "driftline_serving_feature_store_evicted 1.0" in metrics_text
            assert 'driftline_serving_feature_logs_withheld_total{reason="feature-store-evicted"} 1.0' in metrics_text

            client.config_set("maxmemory", 0)  # the fix, then the load again
            asyncio.run(load())
            _until(lambda: not httpx.get(f"{base}/readyz").json()["feature_store_evicted"], "reload not seen")
            r = _ranked(base, "reloaded")
            assert r.json()["user_known"] and "X-Driftline-Degraded" not in r.headers
    finally:
        server.kill()
        server.wait()
    logs = asyncio.run(read_feature_logs(serving_settings, 3, timeout=10))
    assert sorted(fl.request_id for fl in logs) == ["reloaded", "whole"]
