"""Serving adds and logs only the features the served model declares (a model without users works),
and the dense ones reach the scorer."""

from __future__ import annotations

import asyncio
import time
from typing import Literal

import httpx
import numpy as np
import pytest
import torch
from serving_helpers import publish, running, wait_ready

from proto import FeatureLog
from ps import AdagradConfig, InitializerConfig, TableConfig
from services.kafka import TypedConsumer
from services.settings import Settings
from serving.app import create_app
from serving.feature_store import Click, FeatureStore
from serving.model import TrainerModel
from trainer.config import ModelConfig, deepfm_config
from trainer.model import DenseHead
from trainer.sync import encode_dense


def lr_model(model_id: str, slots: list[str], dense: list[str] | None = None,
             scaling: Literal["log", "standard", "none"] = "none") -> ModelConfig:
    """An LR; its dense inputs raw unless ``scaling`` says otherwise (trainer.dense_scaling)."""
    table = TableConfig(name="w", dim=1, optimizer=AdagradConfig(lr=0.05), initializer=InitializerConfig(kind="zeros"))
    return ModelConfig(model_id=model_id, kind="lr", linear={s: "w" for s in slots}, tables=[table], mlp=[],
                       dense_features=dense or [], dense_scaling=scaling)


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
        await store.record_clicks([Click(1, 5, b"a"), Click(1, 6, b"b")])
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
        await store.record_clicks([Click(77, 5, b"a")])
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


def _scores(r: httpx.Response) -> dict[int, float]:
    assert r.status_code == 200, r.text
    return {i["item_id"]: i["raw_score"] for i in r.json()["items"]}


def _with_dense_weights(settings: Settings, base: str, cfg: ModelConfig, weights: list[float],
                        scale: tuple[list[float], list[float]] | None = None) -> None:
    """Publish an LR head whose dense weights are ``weights`` (and its dense scaler's mean and
    variance ``scale``); wait until serving applied them."""
    head = DenseHead(cfg)
    with torch.no_grad():
        head.dense_linear.weight.copy_(torch.tensor([weights]))
        if scale is not None:
            head.scaler.count.fill_(100.0)
            head.scaler.mean.copy_(torch.tensor(scale[0]))
            head.scaler.var.copy_(torch.tensor(scale[1]))
    asyncio.run(publish(settings, [encode_dense(cfg.model_id, 1, head)]))
    deadline = time.monotonic() + 20
    while httpx.get(f"{base}/readyz").json()["model_version"]["dense_version"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.parametrize("scaling", ["none", "log"])
def test_dense_features_reach_the_scorer(filled_store: Settings, scaling: str) -> None:
    """An LR with dense weights published: a candidate's dense value (over the context's) moves its
    score by exactly its weight (``log``: times its value scaled by the published statistics,
    trainer.dense_scaling); a dense feature missing is a 422 naming it."""
    cfg = lr_model(f"dense-{scaling}", ["item_id"], dense=["hour", "price"], scaling=scaling)
    mean, var = [0.5, 1.0], [4.0, 0.25]
    with running(create_app(filled_store, TrainerModel(config=cfg))) as base:
        wait_ready(base)
        _with_dense_weights(filled_store, base, cfg, [1.0, -0.5], (mean, var) if scaling == "log" else None)
        post = lambda body: httpx.post(f"{base}/rank", json=body, timeout=30)  # noqa: E731
        scores = _scores(post({"request_id": f"dense-{scaling}", "context": {"dense": {"hour": 0.0, "price": 2.0}},
                               "candidates": [{"item_id": 1}, {"item_id": 2, "features": {"dense": {"hour": 3.0}}},
                                              {"item_id": 3, "features": {"dense": {"hour": 3.0, "price": 0.0}}}]}))
        sigmoid = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
        x = np.array([[0.0, 2.0], [3.0, 2.0], [3.0, 0.0]])
        if scaling == "log":
            x = (np.log1p(x) - mean) / np.sqrt(var)
        np.testing.assert_allclose([scores[1], scores[2], scores[3]], sigmoid(x @ [1.0, -0.5]), rtol=1e-6)

        r = post({"context": {"dense": {"hour": 1.0}}, "candidates": [{"item_id": 1, "features": {"dense": {"price": 1.0}}},
                                                                      {"item_id": 2}]})
        assert r.status_code == 422 and "candidates[1]: dense feature 'price' missing" in r.json()["message"], r.text
        # extreme float32 values are scored, not a 5xx
        assert post({"context": {"dense": {"hour": 3.4e38, "price": -3.4e38}}, "candidates": [{"item_id": 1}]}).status_code == 200

    # logged as given: the trainer scales them as serving does
    log = asyncio.run(read_logs(filled_store, {f"dense-{scaling}"}))[f"dense-{scaling}"]
    assert dict(log.context.dense) == {"hour": 0.0, "price": 2.0}
    assert [dict(c.features.dense) for c in log.candidates] == [{}, {"hour": 3.0}, {"hour": 3.0, "price": 0.0}]


def test_dense_features_from_the_store_are_scored_and_logged(filled_store: Settings) -> None:
    """A user's and the items' dense values loaded into the store (``features load`` of a dense
    ``user`` / ``item`` feature) are scored and logged like the request's own; a request's value
    overrides the store's; a value neither gives is a 422 naming it."""
    user, items = 900_077, [900_001, 900_002, 900_003]

    async def load() -> None:
        store = FeatureStore(filled_store.redis, filled_store.serving.redis_prefix)
        await store.put({user: {}}, {i: {} for i in items}, users_dense={user: {"ctr": 0.25}},
                        items_dense={items[0]: {"price": 2.0}, items[1]: {"price": 4.0}})
        await store.close()

    asyncio.run(load())
    cfg = lr_model("stored-dense", ["item_id"], dense=["ctr", "price"])
    sigmoid = lambda z: 1 / (1 + np.exp(-np.asarray(z)))  # noqa: E731
    with running(create_app(filled_store, TrainerModel(config=cfg))) as base:
        wait_ready(base)
        _with_dense_weights(filled_store, base, cfg, [1.0, -0.5])
        post = lambda body: httpx.post(f"{base}/rank", json=body, timeout=30)  # noqa: E731
        for _ in range(2):  # the second time from the decoded-value caches
            scores = _scores(post({"request_id": "stored", "user_id": user,
                                   "candidates": [{"item_id": items[0]}, {"item_id": items[1]}]}))
            np.testing.assert_allclose([scores[items[0]], scores[items[1]]], sigmoid([-0.75, -1.75]), rtol=1e-6)
        scores = _scores(post({"request_id": "over", "user_id": user, "context": {"dense": {"ctr": 1.0}},
                               "candidates": [{"item_id": items[0]},
                                              {"item_id": items[1], "features": {"dense": {"price": 0.0}}}]}))
        np.testing.assert_allclose([scores[items[0]], scores[items[1]]], sigmoid([0.0, 1.0]), rtol=1e-6)
        r = post({"user_id": user, "candidates": [{"item_id": items[2]}]})
        assert r.status_code == 422 and "candidates[0]: dense feature 'price' missing" in r.json()["message"], r.text
        assert "load it into the feature store" in r.json()["message"]

    logs = asyncio.run(read_logs(filled_store, {"stored", "over"}))
    assert dict(logs["stored"].context.dense) == {"ctr": 0.25}
    assert [dict(c.features.dense) for c in logs["stored"].candidates] == [{"price": 2.0}, {"price": 4.0}]
    assert dict(logs["over"].context.dense) == {"ctr": 1.0}
    assert [dict(c.features.dense) for c in logs["over"].candidates] == [{"price": 2.0}, {"price": 0.0}]


def test_a_deepfm_with_a_dense_feature_starts_and_scores_with_it(filled_store: Settings) -> None:
    """Its MLP reads the dense feature beside the fields (start-up once failed on the shapes)."""
    base_cfg = deepfm_config("deepfm-dense", dim=4, mlp=[8], slots=("item_id",), recent_items=False)
    cfg = ModelConfig.model_validate({**base_cfg.model_dump(), "dense_features": ["age_days"]})
    with running(create_app(filled_store, TrainerModel(config=cfg))) as base:
        wait_ready(base)
        scores = [_scores(httpx.post(f"{base}/rank", json={"context": {"dense": {"age_days": v}},
                                                          "candidates": [{"item_id": 1}]}))[1] for v in (0.0, 5.0)]
    assert scores[0] != scores[1]


def test_unknown_features_ignored_and_counted_when_the_settings_say_so(filled_store: Settings) -> None:
    """``serving.unknown_features = "ignore"`` (a project file's ``unknown_features``): a feature the
    model does not read is dropped, not logged, counted; the request answers 200."""
    from serving import metrics

    def counted(kind: str) -> float:
        return metrics.UNKNOWN_FEATURES.labels(kind)._value.get()

    settings = filled_store.updated(serving={"unknown_features": "ignore"})
    model = TrainerModel(config=lr_model("ignoring", ["item_id", "pos"]))
    before = counted("sparse"), counted("dense")
    with running(create_app(settings, model)) as base:
        wait_ready(base)
        r = httpx.post(f"{base}/rank", timeout=30, json={
            "request_id": "ignored", "context": {"sparse": {"device": [1]}, "dense": {"hour": 3.0}},
            "candidates": [{"item_id": 1, "features": {"sparse": {"pos": [0], "colour": [2]}}}]})
        assert r.status_code == 200, r.text
    assert (counted("sparse") - before[0], counted("dense") - before[1]) == (2, 1)
    log = asyncio.run(read_logs(settings, {"ignored"}))["ignored"]
    assert dict(log.context.sparse) == {} and dict(log.context.dense) == {}
    assert set(log.candidates[0].features.sparse) == {"item_id", "pos"}
