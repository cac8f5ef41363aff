"""Admission filters and event-time TTL expiry with explicit event times."""

import numpy as np

from ps import AdmissionConfig, EmbeddingTable, InitializerConfig, SGDConfig, TableConfig
from ps.admission import CountMinSketch


def table(**kw):
    kw.setdefault("initializer", InitializerConfig(kind="uniform", scale=1.0))
    return EmbeddingTable(TableConfig(name="a", dim=4, optimizer=SGDConfig(lr=1.0), **kw))


def test_min_count_threshold_and_zero_default():
    t = table(admission=AdmissionConfig(min_count=3))
    ids = np.array([7], np.int64)
    for i in range(2):
        assert (t.gather(ids, insert=True, event_time=i) == 0).all()  # unadmitted: zeros
        assert len(t) == 0  # and no memory in the table
    # gradients for unadmitted ids are dropped, not stored anywhere
    assert t.apply_gradients(ids, np.ones((1, 4), np.float32), event_time=2) == 0
    assert (t.gather(ids, insert=True, event_time=3) != 0).any()  # third occurrence admits
    assert len(t) == 1


def test_min_count_counts_occurrences_within_batch():
    t = table(admission=AdmissionConfig(min_count=4))
    t.gather(np.array([1, 1, 1, 2], np.int64), insert=True, event_time=0)
    assert len(t) == 0
    t.gather(np.array([2, 1], np.int64), insert=True, event_time=0)
    assert t.contains(np.array([1, 2], np.int64)).tolist() == [True, False]


def test_large_thresholds_do_not_saturate():
    s = CountMinSketch(width=4096, depth=4)
    counts = s.add(np.full(5000, 42, np.int64))
    assert counts[999] == 1000 and counts[-1] == 5000
    t = table(admission=AdmissionConfig(min_count=1000))
    ids = np.full(999, 3, np.int64)
    t.gather(ids, insert=True, event_time=0)
    assert len(t) == 0
    t.gather(ids[:1], insert=True, event_time=0)
    assert len(t) == 1


def test_probabilistic_admission_rate_and_seeded():
    def admitted(seed):
        t = table(admission=AdmissionConfig(probability=0.25, seed=seed))
        ids = np.arange(20000, dtype=np.int64)
        t.gather(ids, insert=True, event_time=0)
        return t.contains(ids)
    a = admitted(1)
    assert 0.23 < a.mean() < 0.27
    assert (admitted(1) == a).all()
    assert (admitted(2) != a).any()


def test_probabilistic_admission_is_per_occurrence():
    t = table(admission=AdmissionConfig(probability=0.5, seed=0))
    ids = np.arange(2000, dtype=np.int64)
    for _ in range(10):
        t.gather(ids, insert=True, event_time=0)
    assert t.contains(ids).mean() > 0.99  # 1 - 0.5**10


def test_ttl_expiry_in_event_time():
    t = table(ttl_seconds=10, expire_on_update=False, initializer=InitializerConfig(kind="zeros"))
    old, new = np.array([1, 2], np.int64), np.array([3], np.int64)
    t.gather(old, insert=True, event_time=0)
    t.gather(new, insert=True, event_time=5_000)
    t.apply_gradients(np.array([2]), np.ones((1, 4), np.float32), event_time=8_000)  # refreshes 2
    assert t.expire(now=10_000) == 0  # 1 is exactly 10 s old: not yet expired
    assert t.expire(now=10_001) == 1
    assert t.contains(np.array([1, 2, 3])).tolist() == [False, True, True]
    assert t.expire(now=18_001) == 2
    assert len(t) == 0


def test_expiry_reclaims_rows_and_is_incremental():
    t = table(ttl_seconds=1, expire_on_update=False, track_updates=False)
    ids = np.arange(10_000, dtype=np.int64)
    t.gather(ids, insert=True, event_time=0)
    shard = t.shards[0]
    high = int(shard.meta[1])
    evicted = [t.expire(now=5_000, max_scan=1_000) for _ in range(10)]
    assert evicted == [1_000] * 10 and len(t) == 0
    t.gather(ids + 10**6, insert=True, event_time=6_000)  # reuses freed rows, no growth
    assert int(shard.meta[1]) == high and len(t) == 10_000


def test_expire_on_update_sweeps_with_watermark():
    t = table(ttl_seconds=1)
    t.gather(np.arange(100), insert=True, event_time=0)
    ids = np.array([1000], np.int64)
    t.gather(ids, insert=True, event_time=60_000)
    t.apply_gradients(ids, np.ones((1, 4), np.float32), event_time=60_000)
    assert len(t) == 1 and t.contains(ids)[0]


def test_admitted_and_evicted_counters():
    """Per-shard process counters: rows created by training inserts, rows removed by TTL expiry
    (packed multi-slot gathers, several shards; replica upserts and deletes count as neither)."""
    from ps import ParameterServer, SyncChunk

    t = EmbeddingTable(TableConfig(name="a", dim=2, shards=3, optimizer=SGDConfig(lr=1.0),
                                   admission=AdmissionConfig(min_count=2), ttl_seconds=1,
                                   expire_on_update=False))
    ps_ = ParameterServer([t], slots={"b": "a"})
    assert (t.admitted, t.evicted) == (0, 0)
    ps_.gather({"a": np.array([1, 2, 3], np.int64), "b": np.array([1, 4], np.int64)}, insert=True, event_time=0)
    assert t.admitted == 1 == len(t)  # id 1 seen twice; 2, 3, 4 not admitted yet
    t.gather(np.array([2, 3, 1, 9], np.int64), insert=True, event_time=500)
    assert t.admitted == 3 == len(t)
    t.gather(np.array([2, 3], np.int64), insert=False)  # reads admit nothing
    assert t.admitted == 3
    assert t.expire(now=1_200) == 1 and t.evicted == 1  # id 1 (t=0) is past the 1 s TTL
    t.delete(np.array([2], np.int64))
    assert t.evicted == 1 and sum(s.evicted for s in t.shards) == 1
    assert t.expire(now=10_000) == 1 and t.evicted == 2
    replica = EmbeddingTable(t.config.serving())
    replica.apply_sync(SyncChunk(np.array([5], np.int64), np.ones((1, 2), np.float32), np.zeros(1, np.int64),
                                 np.zeros(0, np.int64)))
    assert (replica.admitted, replica.evicted) == (0, 0)
