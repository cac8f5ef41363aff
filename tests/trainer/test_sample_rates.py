"""The trainer's sample-rate tracker: effective negative keep rates per slice and globally."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trainer.sample_rates import SampleRateError, SampleRateTracker


def _batch(rng: np.random.Generator, n: int, slice_rates: dict[str, float], ctr: float = 0.1):
    """``(slice_ids, names, sample_rate, labels)`` as the joiner emits them: positives at 1.0,
    negatives that survived sampling at their slice's rate (only the survivors are in a batch)."""
    names = tuple(slice_rates)
    ids = rng.integers(0, len(names), n).astype(np.int32)
    labels = (rng.random(n) < ctr).astype(np.float32)
    rates = np.array([slice_rates[s] for s in names], np.float32)[ids]
    return ids, names, np.where(labels == 1, 1.0, rates).astype(np.float32), labels


def test_per_slice_and_global_rates() -> None:
    rng = np.random.default_rng(0)
    t = SampleRateTracker(half_life=1e12)
    for _ in range(5):
        t.update(*_batch(rng, 2000, {"a": 0.1, "b": 0.5}))
    r = t.rates()
    assert r["slices"] == pytest.approx({"a": 0.1, "b": 0.5}, rel=1e-6)
    # global: negatives learned / negatives that occurred, over both slices
    assert 0.1 < r["global"] < 0.5


def test_global_rate_is_learned_over_occurred() -> None:
    t = SampleRateTracker(half_life=1e12)
    # 3 negatives kept at 0.25 (12 occurred) and 1 at 1.0 (e.g. a like-negative that was a click)
    t.update(np.zeros(5, np.int32), ("m",), np.array([0.25, 0.25, 0.25, 1.0, 1.0], np.float32),
             np.array([0, 0, 0, 0, 1], np.float32))
    assert t.rates() == {"global": pytest.approx(4 / 13), "slices": {"m": pytest.approx(4 / 13)}}


def test_no_negatives_means_no_correction() -> None:
    t = SampleRateTracker(half_life=100)
    assert t.rates() == {"global": 1.0, "slices": {}}
    t.update(np.zeros(3, np.int32), ("m",), np.ones(3, np.float32), np.ones(3, np.float32))  # positives only
    assert t.rates() == {"global": 1.0, "slices": {}}
    t.update(np.zeros(0, np.int32), ("m",), np.zeros(0, np.float32), np.zeros(0, np.float32))  # empty batch
    assert t.rates() == {"global": 1.0, "slices": {}}
    # NaN labels (absent) are not negatives; negatives all kept: rate exactly 1.0 (never above)
    t.update(np.zeros(4, np.int32), ("m",), np.ones(4, np.float32), np.array([np.nan, 0, 0, 0], np.float32))
    assert t.rates() == {"global": 1.0, "slices": {"m": 1.0}}


def test_slices_unknown_update_the_global_rate_only() -> None:
    t = SampleRateTracker(half_life=100)
    t.update(None, (), np.full(4, 0.2, np.float32), np.zeros(4, np.float32))
    assert t.rates() == {"global": pytest.approx(0.2), "slices": {}}


def test_decay_follows_a_changed_setting() -> None:
    rng = np.random.default_rng(1)
    half = 5_000
    t = SampleRateTracker(half_life=half)
    for _ in range(20):
        t.update(*_batch(rng, 2000, {"a": 0.5}))
    assert t.rates()["slices"]["a"] == pytest.approx(0.5)
    # the joiner's rate changes to 0.1: after one half-life of negatives, half the weight (in
    # negatives learned) is new: n/w = (h + h) / (h/0.5 + h/0.1) = 1/6 (the old weight had not quite
    # saturated: within 0.5%)
    t.update(np.zeros(half, np.int32), ("a",), np.full(half, 0.1, np.float32), np.zeros(half, np.float32))
    assert t.rates()["slices"]["a"] == pytest.approx(1 / 6, rel=5e-3)
    for _ in range(20):  # 20 more half-lives: the old rate is gone
        t.update(np.zeros(half, np.int32), ("a",), np.full(half, 0.1, np.float32), np.zeros(half, np.float32))
    assert t.rates()["slices"]["a"] == pytest.approx(0.1, rel=1e-5)


def test_decay_is_per_negative_of_the_slice() -> None:
    """A busy slice does not age out a quiet one: each slice's sums decay by its own negatives."""
    t = SampleRateTracker(half_life=10)
    t.update(np.zeros(5, np.int32), ("quiet",), np.full(5, 0.2, np.float32), np.zeros(5, np.float32))
    for _ in range(50):
        t.update(np.zeros(100, np.int32), ("busy",), np.full(100, 0.8, np.float32), np.zeros(100, np.float32))
    r = t.rates()
    assert r["slices"] == {"quiet": pytest.approx(0.2), "busy": pytest.approx(0.8)}
    assert r["global"] == pytest.approx(0.8, rel=1e-6)  # the global rate follows all negatives


def test_one_batch_equals_the_same_negatives_one_at_a_time() -> None:
    rng = np.random.default_rng(2)
    ids, names, rates, labels = _batch(rng, 300, {"a": 0.1, "b": 0.3, "c": 1.0}, ctr=0.2)
    whole, single = SampleRateTracker(half_life=50), SampleRateTracker(half_life=50)
    whole.update(ids, names, rates, labels)
    for i in range(ids.size):
        single.update(ids[i:i + 1], names, rates[i:i + 1], labels[i:i + 1])
    a, b = whole.state(), single.state()
    assert a["global"] == pytest.approx(b["global"])
    assert a["slices"] == pytest.approx(b["slices"])
    np.testing.assert_allclose(a["sums"]["global"], b["sums"]["global"], rtol=1e-9)


def test_state_round_trip_through_json() -> None:
    rng = np.random.default_rng(3)
    t = SampleRateTracker(half_life=1000)
    t.update(*_batch(rng, 2000, {"a": 0.1, "b": 0.5}))
    u = SampleRateTracker(half_life=1000)
    u.load(json.loads(json.dumps(t.state())))  # as the snapshot manifest stores it
    assert u.rates() == t.rates()
    batch = _batch(rng, 2000, {"a": 0.2, "b": 0.5})
    t.update(*batch)
    u.update(*batch)
    assert u.state() == t.state()
    empty = SampleRateTracker(half_life=1000)
    empty.load({})  # a snapshot that recorded none
    assert empty.rates() == {"global": 1.0, "slices": {}}


@pytest.mark.parametrize("bad", [{"sums": {"global": [1.0]}}, {"sums": {"global": [2.0, 1.0], "slices": {}}},
                                 {"sums": {"global": [0.0, 0.0], "slices": {"a": [float("nan"), 1.0]}}},
                                 {"sums": "x"}])
def test_bad_state_is_a_typed_error(bad: dict) -> None:
    with pytest.raises(SampleRateError):
        SampleRateTracker(half_life=10).load(bad)


def test_half_life_must_be_positive() -> None:
    for h in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            SampleRateTracker(half_life=h)
