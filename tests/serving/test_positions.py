"""A model that reads where its items are shown (``source = "position"``): ``/rank`` scores every
candidate at the first place and logs each at the place it answered it at (serving/positions.py)."""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
from serving_helpers import publish, running, sparse_delta, wait_ready
from test_declared_features import read_logs

from ps import AdagradConfig, InitializerConfig, TableConfig
from services.settings import Settings
from serving.app import create_app
from serving.model import TrainerModel
from trainer.config import ModelConfig

ITEM_W = {1: 1.0, 2: 2.0, 3: 0.5}
POSITION_W = {0: 2.0, 1: 1.0, 2: 0.0, 5: -2.0}


def _model() -> ModelConfig:
    def table(name: str) -> TableConfig:
        return TableConfig(name=name, dim=1, optimizer=AdagradConfig(lr=0.05), initializer=InitializerConfig(kind="zeros"))

    return ModelConfig(model_id="placed", kind="lr", linear={"item_id": "item_w", "pos": "pos_w"},
                       tables=[table("item_w"), table("pos_w")], mlp=[], position_slot="pos")


def _publish_weights(settings: Settings, base: str) -> None:
    def delta(table: str, weights: dict[int, float]) -> object:
        return sparse_delta(table, np.array(list(weights), np.int64), np.array([[w] for w in weights.values()]),
                            version=1, model_id="placed")

    asyncio.run(publish(settings, [delta("item_w", ITEM_W), delta("pos_w", POSITION_W)]))
    deadline = time.monotonic() + 20
    while httpx.get(f"{base}/readyz").json()["model_version"]["sparse_version"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_candidates_are_scored_at_the_first_place_and_logged_where_they_were_answered(filled_store: Settings) -> None:
    """Three candidates without a position are each scored at place 0 (their order is the items'
    own), and logged at the place they were answered at; one that gives its place is scored and
    logged at it; the same items in another order are logged at their new places (the feature
    log's cached encodings name the place); a later page (``first_position``) is scored at its first
    place and logged from it on; of a request whose client shows two (``shown``) only those two are
    logged; a request-wide position is a 422."""
    sigmoid = lambda z: 1 / (1 + np.exp(-np.asarray(z)))  # noqa: E731
    with running(create_app(filled_store, TrainerModel(config=_model()))) as base:
        wait_ready(base)
        _publish_weights(filled_store, base)
        post = lambda body: httpx.post(f"{base}/rank", json=body, timeout=30)  # noqa: E731
        r = post({"request_id": "placed-1", "candidates": [
            {"item_id": 1}, {"item_id": 3}, {"item_id": 4, "features": {"sparse": {"pos": [5]}}}, {"item_id": 2}]})
        assert r.status_code == 200, r.text
        items = r.json()["items"]
        assert [i["item_id"] for i in items] == [2, 1, 3, 4]
        np.testing.assert_allclose([i["raw_score"] for i in items], sigmoid([4.0, 3.0, 2.5, -2.0]), rtol=1e-6)

        r = post({"request_id": "placed-2", "candidates": [{"item_id": 3}, {"item_id": 1}]})
        assert [i["item_id"] for i in r.json()["items"]] == [1, 3]
        r = post({"request_id": "placed-3", "candidates": [{"item_id": 3}]})  # 3 answered first now
        assert r.status_code == 200, r.text
        # the second page of a list of 2: scored at its first place, logged from there on
        r = post({"request_id": "placed-page-2", "first_position": 2, "candidates": [{"item_id": 1}, {"item_id": 2}]})
        np.testing.assert_allclose([i["raw_score"] for i in r.json()["items"]], sigmoid([2.0, 1.0]), rtol=1e-6)
        assert post({"first_position": -1, "candidates": [{"item_id": 1}]}).status_code == 422
        # four ranked, two shown: the answer has all four, the feature log the two shown
        r = post({"request_id": "placed-shown", "shown": 2,
                  "candidates": [{"item_id": 3}, {"item_id": 1}, {"item_id": 4}, {"item_id": 2}]})
        assert [i["item_id"] for i in r.json()["items"]] == [2, 1, 3, 4], r.text
        assert post({"shown": 0, "candidates": [{"item_id": 1}]}).status_code == 422

        r = post({"context": {"sparse": {"pos": [1]}}, "candidates": [{"item_id": 1}]})
        assert r.status_code == 422, r.text
        assert "'pos' is the position a candidate is shown at: give it in a candidate's features" in r.json()["message"]
        for bad in ([-1], [1, 2], []):
            r = post({"candidates": [{"item_id": 1}, {"item_id": 2, "features": {"sparse": {"pos": bad}}}]})
            assert r.status_code == 422, r.text
            assert f"candidates[1].features.sparse: 'pos' is the place the candidate is shown at: one id, 0 or more " \
                   f"(0 = first), got {bad}" == r.json()["message"]

    logs = asyncio.run(read_logs(filled_store, {"placed-1", "placed-2", "placed-3", "placed-page-2", "placed-shown"}))
    placed = {rid: {c.item_id: list(c.features.sparse["pos"].ids) for c in log.candidates} for rid, log in logs.items()}
    assert placed == {"placed-1": {2: [0], 1: [1], 3: [2], 4: [5]}, "placed-2": {1: [0], 3: [1]}, "placed-3": {3: [0]},
                      "placed-page-2": {2: [2], 1: [3]}, "placed-shown": {1: [1], 2: [0]}}
    assert [c.item_id for c in logs["placed-shown"].candidates] == [1, 2]  # the request's order
    assert [round(c.score, 4) for c in logs["placed-shown"].candidates] == [round(1 / (1 + np.exp(-3.0)), 4),
                                                                            round(1 / (1 + np.exp(-4.0)), 4)]
    assert "pos" not in logs["placed-1"].context.sparse
    assert [c.item_id for c in logs["placed-1"].candidates] == [1, 3, 4, 2]  # the request's order, as ever
