"""Serving adds and logs only the features the served model declares; a model without users works."""

from __future__ import annotations

import asyncio
import time

import httpx

from proto import FeatureLog
from ps import AdagradConfig, InitializerConfig, TableConfig
from serving.app import create_app
from serving.feature_store import FeatureStore
from serving.model import TrainerModel
from services.kafka import TypedConsumer
from services.settings import Settings
from trainer.config import ModelConfig

from serving_helpers import running, wait_ready


def lr_model(model_id: str, slots: list[str], dense: list[str] | None = None) -> ModelConfig:
    table = TableConfig(name="w", dim=1, optimizer=AdagradConfig(lr=0.05), initializer=InitializerConfig(kind="zeros"))
    return ModelConfig(model_id=model_id, kind="lr", linear={s: "w" for s in slots}, tables=[table], mlp=[],
                       dense_features=dense or [])


async def read_logs(settings: Settings, want: set[str], timeout: float = 20.0) -> dict[str, FeatureLog]:
    consumer = TypedConsumer(settings, "test", FeatureLog, [settings.topics.features], None)
    out: dict[str, FeatureLog] = {}
    async with consumer:
        deadline = time.monotonic() + timeout
        while not want <= out.keys() and time.monotonic() < deadline:
            out.update({r.value.request_id: r.value for r in await consumer.poll(timeout_ms=300)})
    return out


def test_a_model_without_users_gets_only_its_features(filled_store: Settings) -> None:
    """The store holds the demo's user and item slots and the user's recent clicks; the model reads
    ``item_id`` and a per-candidate ``pos`` only: that is all it is given, and all that is logged."""
    async def click() -> None:
        store = FeatureStore(filled_store.redis, filled_store.serving.redis_prefix)
        await store.record_clicks([(1, 5), (1, 6)])
        await store.close()

    asyncio.run(click())
    model = TrainerModel(config=lr_model("nousers", ["item_id", "pos"]))
    with running(create_app(filled_store, model)) as base:
        wait_ready(base)
        post = lambda body: httpx.post(f"{base}/rank", json=body, timeout=30)  # noqa: E731
        r = post({"request_id": "known-user", "user_id": 1, "candidates": [
            {"item_id": 1, "features": {"sparse": {"pos": [0]}}}, {"item_id": 2}, {"item_id": 999}]})
        assert r.status_code == 200, r.text
        r = post({"request_id": "no-user", "candidates": [{"item_id": 3}]})
        assert r.status_code == 200, r.text

        r = post({"user_id": 1, "context": {"sparse": {"genres": [1]}}, "candidates": [{"item_id": 1}]})
        assert r.status_code == 422 and "context.sparse: the model has no sparse feature 'genres'" in r.json()["message"]
        r = post({"candidates": [{"item_id": 1}, {"item_id": 2, "features": {"sparse": {"user_id": [1]}}}]})
        assert r.status_code == 422 and "candidates[1].features.sparse" in r.json()["message"]
        assert "'user_id' (its sparse features: item_id, pos)" in r.json()["message"]
        r = post({"candidates": [{"item_id": 1}], "context": {"dense": {"hour": 1.0}}})
        assert r.status_code == 422 and "no dense feature 'hour'" in r.json()["message"]

    logs = asyncio.run(read_logs(filled_store, {"known-user", "no-user"}))
    known = logs["known-user"]
    assert dict(known.context.sparse) == {}  # no user_id, gender, age, recent_items
    assert [{s: list(v.ids) for s, v in c.features.sparse.items()} for c in known.candidates] == [
        {"item_id": [1], "pos": [0]}, {"item_id": [2]}, {"item_id": [999]}]  # stored genres, year left out
    assert dict(logs["no-user"].context.sparse) == {} and logs["no-user"].user_id == 0


def test_a_model_with_users_gets_user_id_and_recent_clicks(filled_store: Settings) -> None:
    async def click() -> None:
        store = FeatureStore(filled_store.redis, filled_store.serving.redis_prefix)
        await store.record_clicks([(77, 5)])
        await store.close()

    asyncio.run(click())
    model = TrainerModel(config=lr_model("users", ["user_id", "item_id", "recent_items"]))
    with running(create_app(filled_store, model)) as base:
        wait_ready(base)
        r = httpx.post(f"{base}/rank", json={"request_id": "u77", "user_id": 77, "candidates": [{"item_id": 4}]})
        assert r.status_code == 200, r.text
    log = asyncio.run(read_logs(filled_store, {"u77"}))["u77"]
    assert {s: list(v.ids) for s, v in log.context.sparse.items()} == {"user_id": [77], "recent_items": [5]}
    assert {s: list(v.ids) for s, v in log.candidates[0].features.sparse.items()} == {"item_id": [4]}
