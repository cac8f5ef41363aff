"""The trainer's counting baseline knows where items were shown when its model does (a model with a
``position_slot``): otherwise the model would beat counting clicks by the places alone."""

from __future__ import annotations

import numpy as np
from prometheus_client import REGISTRY

from ps import AdagradConfig, InitializerConfig, TableConfig
from services.settings import Settings
from trainer.batch import SparseBatch
from trainer.config import ModelConfig
from trainer.count_baseline import CountBaseline
from trainer.learned import Learned
from trainer.metrics import StreamingAUC
from trainer.online import OnlineTrainer
from trainer.sample_rates import SampleRateTracker


def _placed_stream(n: int = 20_000, seed: int = 0) -> SparseBatch:
    """Clicks that depend on the place alone (1 / (1 + place)), any item at any place."""
    rng = np.random.default_rng(seed)
    places = rng.integers(0, 10, n)
    rows = [{"user_id": [int(u)], "item_id": [int(i)], "pos": [int(p)]}
            for u, i, p in zip(rng.integers(0, 500, n), rng.integers(0, 200, n), places)]
    labels = (rng.random(n) < 0.5 / (1 + places)).astype(np.float32)
    return SparseBatch.from_slot_dicts(rows, labels=labels, sample_rate=np.ones(n, np.float32))


def test_counting_the_places_is_what_a_model_with_places_must_beat_and_it_is_saved() -> None:
    stream = _placed_stream()
    with_places, without = CountBaseline(10.0, "pos"), CountBaseline(10.0)
    for a in range(0, stream.size, 512):
        rows = np.arange(a, min(a + 512, stream.size))
        with_places.score_batch(stream.select(rows))
        without.score_batch(stream.select(rows))
    assert with_places.auc.value() > 0.65 > 0.55 > without.auc.value()

    saved = with_places.state()
    restored = CountBaseline(10.0, "pos")
    restored.load(saved)
    users, items, places = np.array([1, 1]), np.array([5, 5]), np.array([0, 9])
    np.testing.assert_array_equal(restored.score(users, items, places), with_places.score(users, items, places))
    assert restored.score(users, items, places)[0] > 2 * restored.score(users, items, places)[1]

    older = CountBaseline(10.0, "pos")  # a snapshot saved before its model read places
    older.load(without.state())
    assert older.positions is not None and older.positions.n == 0 and older.examples == without.examples


def test_the_click_ratio_of_each_place_is_exported() -> None:
    """Clicks at place k fall as 1 / (1 + k): the exported ratios to the first place follow."""
    book = Learned("placed-ratio", StreamingAUC(), SampleRateTracker(1e6), baseline=CountBaseline(10.0, "pos"))
    stream = _placed_stream(n=60_000)
    for a in range(0, stream.size, 4096):
        b = stream.select(np.arange(a, min(a + 4096, stream.size)))
        book.batch(b, 0.5, np.full(b.size, 0.1), None)
    ratio = {k: REGISTRY.get_sample_value("driftline_trainer_place_click_ratio", {"model": "placed-ratio", "place": str(k)})
             for k in range(10)}
    assert ratio[0] == 1.0 and all(abs(ratio[k] - 1 / (1 + k)) < 0.15 for k in range(1, 10)), ratio
    assert REGISTRY.get_sample_value("driftline_trainer_place_click_ratio", {"model": "placed-ratio", "place": "10"}) is None


def test_the_online_trainer_counts_the_places_of_its_model(settings: Settings) -> None:
    def table(name: str) -> TableConfig:
        return TableConfig(name=name, dim=1, optimizer=AdagradConfig(lr=0.05), initializer=InitializerConfig(kind="zeros"))

    cfg = ModelConfig(model_id="placed", kind="lr", linear={"item_id": "item_w", "pos": "pos_w"},
                      tables=[table("item_w"), table("pos_w")], mlp=[], position_slot="pos")
    baseline = OnlineTrainer(settings, cfg).learned.baseline
    assert baseline is not None and baseline.position_slot == "pos"
