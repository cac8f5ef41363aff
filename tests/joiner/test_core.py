"""The pure join logic, no broker: the state machine against the offline reference, under random
interleavings of the two input topics, random batch boundaries, simulated crashes and a tiny cache."""

from __future__ import annotations

import dataclasses
import random

import pytest
from aiokafka.partitioner import DefaultPartitioner

from joiner import sampling
from joiner.core import EXPIRED, JOIN, LATE, ORPHAN, OUT_OF_WINDOW, JoinCore
from joiner.stores.memory import MemoryStore
from joiner.tiered import TieredState
from proto import Action, Candidate, FeatureLog
from tests.joiner.helpers import emitted_examples, join_config, take_examples
from tests.joiner.reference import offline_join
from tests.joiner.synth import ml_events

CFG = join_config()
# The single-event tests below: with no outliers tolerated the watermark is the max time seen,
# so one action moves it.
MAX_WM = dataclasses.replace(CFG, watermark_outliers=0)
NP = 3


def simulate(events, cfg=CFG, *, seed=0, cache_size=1_000_000, crash_p=0.0, max_batch=50, store=None):
    """Run JoinCore like the app does, with a random consumer interleaving; return emitted Examples."""
    rng = random.Random(seed)
    part = DefaultPartitioner()
    parts = list(range(NP))
    queues = {(k, p): [] for k in ("features", "actions") for p in parts}
    for kind, key, value in events:
        p = part(key, parts, parts)
        queues[(kind, p)].append(FeatureLog.FromString(value) if kind == "features" else Action.FromString(value))
    store = store or MemoryStore()
    committed = {q: 0 for q in queues}

    def boot():
        state = TieredState(store, cache_size)
        core = JoinCore(state, cfg)
        for p in parts:
            core.load(p)
        return state, core

    state, core = boot()
    pos = dict(committed)
    out: list = []
    crashes = 0
    while any(pos[q] < len(queues[q]) for q in queues):
        budget = rng.randint(1, max_batch)
        touched = set()
        while budget > 0:
            live = [q for q in queues if pos[q] < len(queues[q])]
            if not live:
                break
            q = rng.choice(live)
            n = min(budget, rng.randint(1, 10), len(queues[q]) - pos[q])
            for m in queues[q][pos[q]:pos[q] + n]:
                (core.on_features if q[0] == "features" else core.on_action)(q[1], m)
            pos[q] += n
            budget -= n
            touched.add(q[1])
        for p in sorted(touched):
            core.advance(p)
        out += core.take()  # "produced" before the commit
        if rng.random() < crash_p:
            crashes += 1
            state, core = boot()  # lose dirty state and cache; rewind to committed offsets
            pos = dict(committed)
            continue
        state.commit()
        state.evict()
        committed = dict(pos)
    for p in parts:
        core.advance(p, drain=True)
    out += core.take()
    state.commit()
    return emitted_examples(out, cfg.labels), crashes, state


def as_map(examples):
    got = {}
    for e in examples:
        value = (dict(e.labels), round(e.sample_rate, 6), e.user_id)
        if e.example_id in got:
            assert got[e.example_id] == value, f"re-emission of {e.example_id} differs"
        got[e.example_id] = value
    return got


def ref_map(events, cfg=CFG):
    return {k: (lbl, round(r, 6), u) for k, (lbl, r, u) in offline_join(events, cfg, NP).items()}


@pytest.fixture(scope="module")
def events():
    return ml_events(1500, seed=5)


def test_judge_rules():
    core = JoinCore(TieredState(MemoryStore(), 10), CFG)
    W, L, G, R = 120_000, 5_000, 300_000, 120_000
    assert core.judge(1000, 0, 2000, 0) == JOIN
    assert core.judge(1000, 0, 1000 + W + 1, 0) == OUT_OF_WINDOW
    assert core.judge(1000, 0, 2000, 1000 + W + L + 1) == LATE
    assert core.judge(1000, 0, 2000, 1000 + W + L + R + 1) == EXPIRED
    assert core.judge(1000, 2000 + G + 1, 2000, 0) == ORPHAN


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_reference_under_any_interleaving(events, seed):
    examples, _, _ = simulate(events, seed=seed)
    assert len(examples) == len({e.example_id for e in examples}), "no duplicates without crashes"
    assert as_map(examples) == ref_map(events)


def test_exercises_every_path(events):
    examples, _, _ = simulate(events, seed=5)
    rng_core = _counts(events)
    for name in ("positives", "negatives", "negatives_sampled_out", "duplicate_actions", "late_late",
                 "late_out_of_window", "pending_actions"):
        assert rng_core[name] > 0, name
    assert sum(1 for e in examples if e.sample_rate == 1.0) == rng_core["positives"]


def _counts(events):
    store = MemoryStore()
    state = TieredState(store, 10**6)
    core = JoinCore(state, CFG)
    part = DefaultPartitioner()
    parts = list(range(NP))
    for p in parts:
        core.load(p)
    for kind, key, value in events:
        p = part(key, parts, parts)
        if kind == "features":
            core.on_features(p, FeatureLog.FromString(value))
        else:
            core.on_action(p, Action.FromString(value))
        core.advance(p)
    for p in parts:
        core.advance(p, drain=True)
    return core.counts


@pytest.mark.parametrize("seed", [0, 1])
def test_crashes_replay_to_the_same_examples(events, seed):
    examples, crashes, _ = simulate(events, seed=seed, crash_p=0.15)
    assert crashes > 3
    assert as_map(examples) == ref_map(events)


def test_tiny_cache_serves_from_disk_with_identical_results(events):
    examples, _, state = simulate(events, seed=4, cache_size=20)
    assert as_map(examples) == ref_map(events)
    assert state.lookups["disk"] > state.lookups["cache"] > 0


def test_duplicate_and_early_actions():
    state = TieredState(MemoryStore(), 100)
    core = JoinCore(state, MAX_WM)
    core.load(0)
    click = Action(request_id="r", item_id=1, action_type="click", event_time_ms=10_000)
    core.on_action(0, click)  # before its features
    core.on_action(0, click)  # duplicate while pending
    core.on_features(0, FeatureLog(request_id="r", event_time_ms=5_000, user_id=9,
                                   candidates=[Candidate(item_id=1), Candidate(item_id=2)]))
    core.on_action(0, click)  # duplicate after the join
    core.on_action(0, Action(request_id="r", item_id=1, action_type="view", event_time_ms=10_000))
    out = take_examples(core)
    assert [(e.example_id, dict(e.labels), e.sample_rate) for e in out] == [("r/1", {"click": 1.0, "like": 0.0}, 1.0)]
    assert core.counts["duplicate_actions"] == 2 and core.counts["unmapped_actions"] == 1
    # Closing the window: r/2 becomes a negative (or is sampled out), never r/1 again.
    core.on_action(0, Action(request_id="x", item_id=0, action_type="click", event_time_ms=131_000))
    core.advance(0)
    out = take_examples(core)
    expect = ["r/2"] if sampling.keep("r/2", CFG.negative_sample_rate, CFG.seed) else []
    assert [e.example_id for e in out] == expect
    assert all(e.sample_rate == pytest.approx(0.3) for e in out)
    # A late click for r/2: dropped and counted.
    core.on_action(0, Action(request_id="r", item_id=2, action_type="click", event_time_ms=6_000))
    assert core.take() == [] and core.counts["late_late"] == 1


def test_a_request_id_another_user_used_is_told_from_a_re_sent_feature_log():
    """A client reusing request ids in /rank (a counter per app launch, say): another user's
    impression under the same request id and item is no re-sent feature log. It is dropped as one
    is (the first user's stays as it was, so no example id gets a second content), but counted
    apart (the status page says it), also once the first one's window has closed."""
    core = JoinCore(TieredState(MemoryStore(), 100), MAX_WM)
    core.load(0)

    def fl(user: int, t: int, *items: int) -> FeatureLog:
        return FeatureLog(request_id="r-1", event_time_ms=t, user_id=user, candidates=[Candidate(item_id=i) for i in items])
    core.on_features(0, fl(7, 5_000, 1, 2))
    core.on_features(0, fl(7, 5_000, 1, 2))  # re-sent (at least once)
    core.on_features(0, fl(8, 9_000, 2, 3))  # another user, the same request id: item 2 taken, item 3 new
    assert (core.counts["duplicate_impressions"], core.counts["reused_request_ids"]) == (2, 1)
    core.on_action(0, Action(request_id="x", item_id=0, action_type="click", event_time_ms=140_000))
    core.advance(0)  # (the windows close: tombstones)
    core.on_features(0, fl(9, 9_500, 1))
    assert (core.counts["duplicate_impressions"], core.counts["reused_request_ids"]) == (2, 2)
    assert sorted(e.user_id for e in take_examples(core)) == sorted(
        u for u, eid in ((7, "r-1/1"), (7, "r-1/2"), (8, "r-1/3")) if sampling.keep(eid, CFG.negative_sample_rate, CFG.seed))


def test_late_policy_correction_emits_a_correction():
    cfg = join_config(window_ms=1000, lateness_ms=0, late_policy="correction", negative_sample_rate=1.0,
                      watermark_outliers=0)
    core = JoinCore(TieredState(MemoryStore(), 100), cfg)
    core.load(0)
    core.on_features(0, FeatureLog(request_id="r", event_time_ms=1000, user_id=1, candidates=[Candidate(item_id=1)]))
    core.on_action(0, Action(request_id="z", item_id=1, action_type="click", event_time_ms=5000))
    core.advance(0)
    core.on_action(0, Action(request_id="r", item_id=1, action_type="click", event_time_ms=1500))
    ids = [e.example_id for e in take_examples(core)]
    assert ids == ["r/1", "r/1#late-click"]


def test_emitted_columns_hold_the_merged_example():
    from proto import Features, SparseSlot

    ctx = Features(sparse={"u": SparseSlot(ids=[1])}, dense={"a": 1.0, "b": 2.0})
    cand = Features(sparse={"i": SparseSlot(ids=[7])}, dense={"b": 3.0})
    core = JoinCore(TieredState(MemoryStore(), 100), MAX_WM)
    core.load(0)
    core.on_features(0, FeatureLog(request_id="r", event_time_ms=1000, user_id=1, context=ctx,
                                   model_version={"model_id": "m"},
                                   candidates=[Candidate(item_id=7, features=cand)]))
    core.on_action(0, Action(request_id="r", item_id=7, action_type="click", event_time_ms=1500))
    [e] = take_examples(core)
    merged = Features()
    merged.CopyFrom(ctx)
    merged.MergeFrom(cand)
    assert e.features == merged and dict(e.features.dense) == {"a": 1.0, "b": 3.0}
    assert dict(e.labels) == {"click": 1.0, "like": 0.0} and e.sample_rate == 1.0
    assert (e.example_id, e.request_id, e.item_id, e.user_id, e.event_time_ms, e.model_id) == ("r/7", "r", 7, 1, 1000, "m")


def test_idle_advance_closes_windows_the_features_stream_left_behind():
    cfg = join_config(window_ms=10_000, lateness_ms=1_000, negative_sample_rate=1.0, watermark_outliers=0)
    core = JoinCore(TieredState(MemoryStore(), 100), cfg)
    core.load(0)
    for rid, t in (("a", 1_000), ("b", 50_000), ("c", 100_000)):
        core.on_features(0, FeatureLog(request_id=rid, event_time_ms=t, user_id=1, candidates=[Candidate(item_id=1)]))
    core.advance(0)
    assert core.take() == []  # no action: the windows stay open
    assert core.idle_advance(0, margin_ms=200_000)  # wa -> -100_000: closes nothing
    core.advance(0)
    assert core.take() == []
    assert core.idle_advance(0, margin_ms=45_000)  # wa -> 55_000
    assert core.wa[0] == 55_000
    core.advance(0)
    assert [e.example_id for e in take_examples(core)] == ["a/1"]  # b closes at 61_000
    assert not core.idle_advance(0, margin_ms=45_000)  # idempotent
    # An action that comes later is judged against the raised watermark: late for a, joins b.
    core.on_action(0, Action(request_id="a", item_id=1, action_type="click", event_time_ms=2_000))
    core.on_action(0, Action(request_id="b", item_id=1, action_type="click", event_time_ms=51_000))
    assert [e.example_id for e in take_examples(core)] == ["b/1"]
    assert core.counts["late_late"] == 1 and core.counts["idle_advances"] == 2


def test_a_bad_example_is_left_out_of_its_batch_and_counted():
    """What example_batch would reject never reaches a record; the rest of the batch does."""
    import math

    from joiner import batches
    from joiner.kafka_io import BatchedSender
    from proto import Features
    from services import example_batch

    ok = batches.payload("m", b"", Features(dense={"pop": 0.5}).SerializeToString())
    nan = batches.payload("m", b"", Features(dense={"pop": math.nan}).SerializeToString())
    emitted = [(1, 1000, b"r/1", ok, 1, 1.0, 0, ""), (1, 0, b"r/2", ok, 0, 0.3, 0, ""),
               (1, 1000, b"r/3", ok, 0, 1.5, 0, ""), (1, 1000, b"r/4", nan, 0, 0.3, 0, ""),
               (1, 1000, b"r/5", ok, 0, 0.3, 0, "")]
    sender = BatchedSender(None, "examples", [0, 1, 2], ["click"])
    records, bad = sender.encode(emitted)
    assert bad == {"event_time": 1, "sample_rate": 1, "non_finite": 1}
    [(p, raw, n)] = records
    assert p == sender.partition(b"1") and n == 2
    assert list(example_batch.decode(raw).example_ids) == ["r/1", "r/5"]


def test_a_batch_record_over_the_size_limit_is_split_in_order():
    from joiner import batches
    from joiner.kafka_io import BatchedSender
    from proto import Features, SparseSlot
    from services import example_batch

    pl = batches.payload("m", b"", Features(sparse={"i": SparseSlot(ids=list(range(100)))}).SerializeToString())
    emitted = [(7, 1000, f"r/{i}".encode(), pl, 0, 1.0, 0, "") for i in range(40)]
    records, bad = BatchedSender(None, "examples", [0, 1], [], max_record_bytes=10_000).encode(emitted)
    assert not bad and len(records) > 2 and {p for p, _, _ in records} == {BatchedSender(None, "", [0, 1]).partition(b"7")}
    ids = [i for _, raw, _ in records for i in example_batch.decode(raw).example_ids]
    assert ids == [f"r/{i}" for i in range(40)]
