"""Fuzz the API from its own OpenAPI spec with schemathesis: no input may cause a 5xx."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from schemathesis.generation import GenerationMode
from serving_helpers import ITEMS, USERS, running, wait_ready

from services.settings import Settings
from serving.app import create_app
from serving.feature_store import FeatureStore


@pytest.fixture(scope="module")
def api(broker, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[schemathesis.BaseSchema]:
    suffix = f"fuzz{time.time_ns()}"
    s = Settings(kafka_bootstrap_servers=broker.bootstrap, redis_url=redis_url,
                 var_dir=tmp_path_factory.mktemp("fuzz"))
    for name in ("features", "actions", "examples", "param_deltas", "dead_letters"):
        setattr(s.topics, name, f"{name}-{suffix}")
    s = s.updated(serving=dict(redis_prefix=suffix, kafka_retry_s=0.5, max_candidates=50))

    async def fill() -> None:
        store = FeatureStore(redis_url, suffix)
        await store.put(USERS, ITEMS)
        await store.close()

    asyncio.run(fill())
    with running(create_app(s)) as base:
        wait_ready(base)
        yield schemathesis.openapi.from_url(f"{base}/openapi.json")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisDeprecationWarning")
def test_no_server_errors(api: schemathesis.BaseSchema) -> None:
    operations = [result.ok() for result in api.get_all_operations()]
    assert {op.path for op in operations} >= {"/rank", "/actions", "/healthz", "/readyz"}
    calls: dict[int, int] = {}
    for op, mode in [(op, mode) for op in operations for mode in GenerationMode
                     if mode is GenerationMode.POSITIVE or op.method.upper() == "POST"]:
        @given(case=op.as_strategy(mode))
        @hsettings(max_examples=60 if op.method.upper() == "POST" else 5, deadline=None,
                   suppress_health_check=list(HealthCheck), database=None)
        def check(case: schemathesis.Case) -> None:
            response = case.call(timeout=10)
            calls[response.status_code] = calls.get(response.status_code, 0) + 1
            assert response.status_code < 500, (
                f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}")

        check()
    # Both valid (2xx) and invalid (4xx) inputs were exercised.
    assert sum(calls.values()) > 200 and any(c < 300 for c in calls) and any(400 <= c < 500 for c in calls), calls
