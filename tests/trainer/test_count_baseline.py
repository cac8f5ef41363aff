"""The trainer's counting baseline knows where items were shown when its model does (a model with a
``position_slot``): otherwise the model would beat counting clicks by the places alone."""

from __future__ import annotations

import numpy as np
from prometheus_client import REGISTRY

from ps import AdagradConfig, InitializerConfig, TableConfig
from services.settings import Settings
from status.options import Target
from status.problems import problems
from status.targets import TargetState
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


def _shifted_stream(n: int, seed: int = 0) -> tuple[SparseBatch, np.ndarray, np.ndarray]:
    """Clicks by the item's appeal, redrawn for every item halfway: ``(stream, appeal before,
    appeal after)`` as click probabilities per example."""
    rng = np.random.default_rng(seed)
    items = rng.integers(0, 100, n)
    before, after = rng.normal(-2, 1, 100), rng.normal(-2, 1, 100)
    p0, p1 = 1 / (1 + np.exp(-before[items])), 1 / (1 + np.exp(-after[items]))
    truth = np.where(np.arange(n) < n // 2, p0, p1)
    rows = [{"user_id": [int(u)], "item_id": [int(i)]} for u, i in zip(rng.integers(0, 1000, n), items)]
    labels = (rng.random(n) < truth).astype(np.float32)
    return SparseBatch.from_slot_dicts(rows, labels=labels, sample_rate=np.ones(n, np.float32)), p0, truth


def test_counting_recent_clicks_follows_a_change_that_lifetime_counts_do_not_and_is_saved() -> None:
    stream, _, _ = _shifted_stream(200_000)
    recent, lifetime = CountBaseline(10.0, half_life=10_000), CountBaseline(10.0)
    after = {}
    for a in range(0, stream.size, 2048):
        b = stream.select(np.arange(a, min(a + 2048, stream.size)))
        for name, c in (("recent", recent), ("lifetime", lifetime)):
            p = c.score_batch(b)
            if a >= 120_000:  # 20,000 examples after the change
                after.setdefault(name, []).append((p, b.labels))
    auc = {name: StreamingAUC() for name in after}
    for name, parts in after.items():
        for p, y in parts:
            auc[name].update(p, y)
    assert auc["recent"].value() > auc["lifetime"].value() + 0.05, {k: a.value() for k, a in auc.items()}

    restored = CountBaseline(10.0, half_life=10_000)
    restored.load(recent.state())
    users, items = np.arange(5), np.arange(5)
    np.testing.assert_array_equal(restored.score(users, items), recent.score(users, items))
    b = stream.select(np.arange(0, 2048))
    np.testing.assert_array_equal(restored.score_batch(b), recent.score_batch(b))


def test_a_model_that_keeps_to_the_old_appeal_is_flagged_behind_recent_counts() -> None:
    """The live trainer's recent AUCs: a model that keeps scoring the items' appeal before the change
    trails counting recent clicks (exported); one that knows the new appeal does not."""
    n, half = 160_000, 10_000
    stream, stale, truth = _shifted_stream(n)
    for name, scores in (("stale-model", stale), ("fresh-model", truth)):
        book = Learned(name, StreamingAUC(), SampleRateTracker(1e6), baseline=CountBaseline(10.0),
                       recent_baseline=CountBaseline(10.0, half_life=half))
        gap = []
        for a in range(0, n, 2048):
            rows = np.arange(a, min(a + 2048, n))
            book.batch(stream.select(rows), 0.5, scores[rows], None)
            gap.append(REGISTRY.get_sample_value("driftline_trainer_trails_recent_counts", {"model": name}))
        at = {"model": name}
        recent = {s: REGISTRY.get_sample_value("driftline_trainer_recent_auc", {**at, "scorer": s})
                  for s in ("model", "counts", "recent_counts")}
        if name == "stale-model":
            assert max(gap[: (n // 2) // 2048]) == 0  # before the change it ranks as well as it ever will
            assert gap[-1] > 0.1 and recent["model"] < 0.6 < recent["recent_counts"], (gap[-1], recent)
            assert book.auc.value() > recent["model"] + 0.05  # the lifetime AUC hides how bad it is now
            trainer = TargetState(Target("trainer", "http://t/metrics"), up=True)
            trainer.history.append((1.0, {"driftline_trainer_trails_recent_counts": [(at, gap[-1])]}))
            said = [p["problem"] for p in problems([trainer], now=1.0, window_s=30.0)]
            assert len(said) == 1 and said[0].startswith("the model's AUC on the recent examples is 0.") and \
                "below that of counting their recent clicks (stale-model)" in said[0], said
        else:
            assert max(gap) == 0 and recent["model"] > recent["recent_counts"], recent
