"""The touched-key stream loses nothing, and replicas apply it in place."""

import threading
import time

import numpy as np

from ps import EmbeddingTable, InitializerConfig, SGDConfig, TableConfig


def test_millions_of_distinct_keys_all_in_stream():
    n = 2_500_000
    cfg = TableConfig(name="big", dim=2, optimizer=SGDConfig(lr=1.0), shards=2,
                      initializer=InitializerConfig(kind="zeros"), initial_capacity=n)
    t = EmbeddingTable(cfg)
    ids = np.random.default_rng(0).permutation(np.arange(n, dtype=np.int64) * 7_777_777_777 - 2**62)
    for start in range(0, n, 250_000):
        b = ids[start:start + 250_000]
        t.gather(b, insert=True, event_time=1)
        g = np.stack([b.astype(np.float32) * 0 + 1, (b % 1000).astype(np.float32)], axis=1)
        t.apply_gradients(b, g, event_time=2)
    # second update of a subset: only the latest value must appear, once
    sub = ids[:1000]
    t.apply_gradients(sub, np.ones((1000, 2), np.float32), event_time=3)
    assert t.pending_updates == n
    keys, vals, times = [], [], []
    for c in t.pop_updates(max_rows=300_000):
        assert c.tombstones.size == 0
        keys.append(c.keys), vals.append(c.values), times.append(c.times)
    keys, vals, times = np.concatenate(keys), np.concatenate(vals), np.concatenate(times)
    assert keys.size == n and np.unique(keys).size == n
    o = np.argsort(keys)
    k2, v2, _, t2 = t.items()
    assert (keys[o] == k2).all() and (vals[o] == v2).all() and (times[o] == t2).all()
    assert t.pending_updates == 0 and list(t.pop_updates()) == []


def test_tombstones_for_delete_and_expiry_and_reinsert():
    cfg = TableConfig(name="s", dim=1, optimizer=SGDConfig(lr=1.0), ttl_seconds=1, expire_on_update=False,
                      initializer=InitializerConfig(kind="zeros"))
    t = EmbeddingTable(cfg)
    replica = EmbeddingTable(cfg.serving())
    t.gather(np.arange(10), insert=True, event_time=0)
    for c in t.pop_updates():
        replica.apply_sync(c)
    assert len(replica) == 10
    t.delete(np.array([0, 1]))
    t.gather(np.array([1]), insert=True, event_time=5_000)  # deleted then re-inserted: upsert wins
    t.gather(np.array([3]), insert=True, event_time=5_000)  # existing: a lookup is not an update
    t.apply_gradients(np.array([2]), np.ones((1, 1), np.float32), event_time=5_000)  # an update is
    t.expire(now=5_000)  # everything but 1 and 2 expires
    chunks = list(t.pop_updates(max_rows=3))
    tomb = np.concatenate([c.tombstones for c in chunks])
    ups = np.concatenate([c.keys for c in chunks])
    assert sorted(tomb.tolist()) == [0, 3, 4, 5, 6, 7, 8, 9]
    assert sorted(ups.tolist()) == [1, 2]
    for c in chunks:
        replica.apply_sync(c)
    assert replica.items()[0].tolist() == [1, 2]
    # tombstoned rows were only freed after the drain, and are reused now
    high = int(t.shards[0].meta[1])
    t.gather(np.arange(100, 108), insert=True, event_time=5_000)
    assert int(t.shards[0].meta[1]) == high


def test_replica_applies_while_lookups_continue():
    cfg = TableConfig(name="r", dim=8, optimizer=SGDConfig(lr=0.1), shards=2)
    t = EmbeddingTable(cfg)
    replica = EmbeddingTable(cfg.serving())
    ids = np.arange(200_000, dtype=np.int64)
    t.gather(ids, insert=True, event_time=0)
    stop = threading.Event()
    seen = []

    def reader():
        probe = ids[:1000]
        while not stop.is_set():
            seen.append(int(replica.contains(probe).sum()))

    th = threading.Thread(target=reader)
    th.start()
    time.sleep(0.01)
    for c in t.pop_updates(max_rows=10_000):
        replica.apply_sync(c)
    stop.set()
    th.join()
    assert len(seen) > 1 and seen == sorted(seen)  # reads went on, never saw a torn state go back
    assert (replica.gather(ids) == t.gather(ids)).all()
