"""Outlier-robust watermarks and expired impressions, in the pure core (no broker).

One far-future feature log or action must not move a partition's watermark (it would orphan or
late every later action and close every window), and an impression whose tombstone has gone must
never be emitted a second time with different content."""

from __future__ import annotations

import dataclasses
import random

import pytest
from aiokafka.partitioner import DefaultPartitioner

from joiner.core import JoinCore
from joiner.stores.memory import MemoryStore
from joiner.tiered import TieredState
from joiner.watermark import NO_WATERMARK, Watermark
from proto import Action, Candidate, FeatureLog
from tests.joiner.helpers import take_examples
from tests.joiner.synth import ml_events
from tests.joiner.test_core import CFG, NP, as_map, ref_map, simulate

FAR = 2**63 - 1  # the poison value of issue 12


def _partition(key: bytes) -> int:
    parts = list(range(NP))
    return DefaultPartitioner()(key, parts, parts)


def _with_outlier(events: list, kind: str, at: int) -> tuple[list, str]:
    """``events`` with one far-future record inserted at index ``at`` on the partition of the
    record there; returns the events and the outlier's request id."""
    key = events[at][1]
    rid = f"outlier-{_partition(key)}"
    while _partition(rid.encode()) != _partition(key):
        rid += "x"
    if kind == "features":
        value = FeatureLog(request_id=rid, event_time_ms=FAR, user_id=1,
                           candidates=[Candidate(item_id=1), Candidate(item_id=2)]).SerializeToString()
    else:
        value = Action(request_id=rid, item_id=1, action_type="click", event_time_ms=FAR).SerializeToString()
    return events[:at] + [(kind, rid.encode(), value)] + events[at:], rid


@pytest.fixture(scope="module")
def events() -> list:
    return ml_events(1500, seed=5)


@pytest.mark.parametrize("kind", ["features", "actions"])
def test_one_far_future_record_does_not_move_the_watermark(events, kind):
    bad, rid = _with_outlier(events, kind, len(events) // 10)
    examples, _, _ = simulate(bad, seed=1)
    got = {k: v for k, v in as_map(examples).items() if not k.startswith(rid)}
    # Exactly the join without it: the outlier shifts its partition's watermark by one distinct
    # time at most (the next test), which decides nothing differently in this stream.
    assert got == ref_map(events), "the join equals the one without the outlier"
    # The same stream under the old rule (watermark = max time seen) loses most later joins.
    old, _, _ = simulate(bad, dataclasses.replace(CFG, watermark_outliers=0), seed=1)
    positives = sum(1 for e in old if e.sample_rate == 1.0 and e.labels["click"] == 1.0)
    expected_positives = sum(1 for lbl, rate, _ in ref_map(events).values() if lbl["click"] == 1.0)
    assert positives < 0.95 * expected_positives


def test_each_outlier_uses_up_one_tolerated_outlier_even_with_crashes(events):
    """A far-future feature log and a far-future action on *every* partition, crashes and replays
    on top: the join equals the one without them at k - 1 (each outlier takes one of the k
    places), exactly, and the reference join of the stream with them (the same rule)."""
    bad, rids = events, []
    for p in range(NP):
        at = next(i for i in range(100 + 200 * p, len(bad)) if _partition(bad[i][1]) == p)
        for kind in ("features", "actions"):
            bad, rid = _with_outlier(bad, kind, at)
            rids.append(rid)
    examples, crashes, _ = simulate(bad, seed=2, crash_p=0.1)
    assert crashes > 2
    got = {k: v for k, v in as_map(examples).items() if not k.startswith(tuple(rids))}
    assert got == ref_map(events, dataclasses.replace(CFG, watermark_outliers=CFG.watermark_outliers - 1))
    assert got == {k: v for k, v in ref_map(bad).items() if not k.startswith(tuple(rids))}


def test_watermark_is_the_k_plus_first_largest_distinct_time():
    rng = random.Random(3)
    for k in (0, 1, 2, 5):
        w = Watermark(k)
        seen: set[int] = set()
        for _ in range(300):
            t = rng.randrange(1000)
            w.observe(t)
            seen.add(t)
            expect = sorted(seen)[-(k + 1)] if len(seen) > k else NO_WATERMARK
            assert w.value == expect
        w2 = Watermark.decode(w.encode(), k)
        assert w2 == w
    w = Watermark(2)
    assert w.raise_to(50) and not w.raise_to(40) and w.value == 50
    w.observe(10), w.observe(20), w.observe(30)
    assert w.value == 50  # a raised watermark never goes back


def _fl(rid: str, t: int, *items: int) -> FeatureLog:
    return FeatureLog(request_id=rid, event_time_ms=t, user_id=7, candidates=[Candidate(item_id=i) for i in items])


def _click(rid: str, item: int, t: int) -> Action:
    return Action(request_id=rid, item_id=item, action_type="click", event_time_ms=t)


def test_a_resent_feature_log_after_its_tombstone_expired_is_refused_not_re_emitted():
    cfg = dataclasses.replace(CFG, negative_sample_rate=1.0)
    W, L, R = cfg.window_ms, cfg.lateness_ms, cfg.retention_ms
    core = JoinCore(TieredState(MemoryStore(), 100), cfg)
    core.load(0)
    fl = _fl("r", 1_000, 1, 2)
    core.on_features(0, fl)
    core.on_action(0, _click("r", 1, 2_000))
    first = {e.example_id: e for e in take_examples(core)}
    assert list(first) == ["r/1"]
    # Both streams move on well past r's tombstone.
    for i in range(4):
        t = 1_000 + W + L + R + 10_000 * (i + 1)
        core.on_features(0, _fl(f"n{i}", t, 1))
        core.on_action(0, _click("zz", 0, t))
    core.advance(0)
    core.advance(0)  # (the tombstones made by one advance expire at the next)
    closed = {e.example_id: e for e in take_examples(core)}
    assert "r/2" in closed and "r/1" not in closed
    assert core.state.get(b"Ir/1") is None, "the tombstone expired"
    core.on_features(0, fl)  # re-sent (a client retry, a re-read after a broker reset)
    core.on_action(0, _click("r", 2, 3_000))
    core.advance(0, drain=True)
    again = [e.example_id for e in take_examples(core)]
    assert not any(e.startswith("r/") for e in again), again
    assert core.counts["expired_impressions"] == 2


def test_a_tombstone_stays_until_the_features_watermark_passes_it_too():
    """Actions far ahead of features: the tombstone must stay (the features stream could still
    deliver the same feature log again), so the duplicate is recognised."""
    cfg = dataclasses.replace(CFG, negative_sample_rate=1.0)
    W, L, R = cfg.window_ms, cfg.lateness_ms, cfg.retention_ms
    core = JoinCore(TieredState(MemoryStore(), 100), cfg)
    core.load(0)
    fl = _fl("r", 1_000, 1)
    for i in range(3):
        core.on_features(0, _fl(f"a{i}", 900 + i, 1))
    core.on_features(0, fl)
    for i in range(4):  # the action stream runs far ahead
        core.on_action(0, _click("zz", 0, 1_000 + W + L + R + 10_000 * (i + 1)))
    core.advance(0)
    assert [e.example_id for e in take_examples(core)] == ["a0/1", "a1/1", "a2/1", "r/1"]
    assert core.state.get(b"Ir/1") is not None, "kept: the features watermark has not passed it"
    core.on_features(0, fl)
    core.advance(0, drain=True)
    assert core.take() == [] and core.counts["duplicate_impressions"] == 1
    # Once the features stream passes too, the tombstone goes.
    for i in range(3):
        core.on_features(0, _fl(f"b{i}", 1_000 + W + L + R + 1 + i, 1))
    core.advance(0)
    assert core.state.get(b"Ir/1") is None
