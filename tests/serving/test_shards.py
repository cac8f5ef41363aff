"""Serving the deltas of an N-rank trainer: each rank publishes its own shard with its own versions
(``ParameterDelta.shard`` / ``shard_count``), interleaved on the one partition in any order.

The shards are real PS tables of the trainer's config, each holding only the ids
``trainer.sharding.owners`` gives its rank, and the deltas are ``trainer.sync.encode_sparse_tables``'s.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY
from serving_helpers import parameters, publish

from proto import ParameterDelta
from ps import EmbeddingTable, SyncChunk
from services.settings import Settings
from serving.deltas import DeltaFeed
from serving.model import TrainerModel
from serving.replica import model_version
from serving.versions import DeltaRejected
from trainer import snapshots
from trainer.config import ModelConfig, deepfm_config
from trainer.sharding import owners, shard_of, whole_tables
from trainer.sync import encode_sparse_tables

#: the tables the fake ranks train (a version is one chunk per touched table a rank owns: 3 on rank 0,
#: 2 on the others, since item_id_w, a first-order table of this sequential model, is rank 0's whole)
TOUCHED = ("user_id", "item_id", "item_id_w")
T0 = 1_700_000_000_000


@pytest.fixture(scope="module")
def cfg() -> ModelConfig:
    # embedding tables sharded over the ranks, what these tests are about (sequential embeddings
    # put every table on rank 0: tests/trainer/distributed/test_ranks.py runs that layout on the broker)
    return deepfm_config(dim=4, mlp=[8], sequential_embeddings=False)


class Rank:
    """Rank ``rank`` of ``n``: trainer PS tables holding only the ids it owns, versions of its own."""

    def __init__(self, cfg: ModelConfig, rank: int, n: int, seed: int) -> None:
        self.cfg, self.rank, self.n = cfg, rank, n
        self.tables = {t.name: EmbeddingTable(t) for t in cfg.tables}
        self.rng = np.random.default_rng(seed)
        self.version = 0

    def step(self) -> list[ParameterDelta]:
        """Train the touched tables (new rows, updates of old ones, a few deletions), then publish
        one version of this shard."""
        self.version += 1
        t = T0 + self.version * 1000
        for name in TOUCHED:
            table = self.tables[name]
            ids = np.unique(self.rng.integers(-300, 300, 120)).astype(np.int64)
            # as the trainer owns them: a sequential model's first-order tables whole on rank 0
            ids = ids[owners(ids, max(1, self.n), np.full(ids.size, name in whole_tables(self.cfg))) == self.rank]
            table.gather(ids, insert=True, event_time=t)
            table.apply_gradients(ids, self.rng.normal(size=(ids.size, table.dim)).astype(np.float32), t)
            if self.version > 1:
                table.delete(ids[:3])
        return [m for _t, m in encode_sparse_tables(self.cfg.model_id, self.version, self.tables,
                                                    max_event_time_ms=t, shard=self.rank,
                                                    shard_count=self.n)]


def union(ranks: list[Rank]) -> dict[str, np.ndarray]:
    """Every table's rows over the ranks' shards, sorted by id (as ``parameters`` gives them)."""
    out = {}
    for name in ranks[0].tables:
        parts = [r.tables[name].items() for r in ranks]
        keys = np.concatenate([p[0] for p in parts])
        values = np.concatenate([p[1] for p in parts])
        order = np.argsort(keys, kind="stable")
        out[f"{name}.keys"], out[f"{name}.values"] = keys[order], values[order]
    return out


def restored(cfg: ModelConfig, rows: dict[str, np.ndarray]) -> dict[str, EmbeddingTable]:
    """Trainer tables holding ``rows`` (as a snapshot restores them: not news for the deltas)."""
    tables = {t.name: EmbeddingTable(t) for t in cfg.tables}
    for name, table in tables.items():
        keys = rows[f"{name}.keys"]
        table.apply_sync(SyncChunk(keys, rows[f"{name}.values"], np.full(keys.size, T0, np.int64),
                                   np.empty(0, np.int64)))
        for _ in table.pop_updates():
            pass
    return tables


def assert_holds(model: TrainerModel, want: dict[str, np.ndarray]) -> None:
    """The model's sparse rows are bit-identical to ``want``, row by row."""
    got = parameters(model)
    for name in {k.rsplit(".", 1)[0] for k in want}:
        keys, values = got[f"{name}.keys"], got[f"{name}.values"]
        order = np.argsort(keys, kind="stable")
        np.testing.assert_array_equal(keys[order], want[f"{name}.keys"], err_msg=name)
        assert values.dtype == np.float32
        np.testing.assert_array_equal(values[order].view(np.int32), want[f"{name}.values"].view(np.int32),
                                      err_msg=name)


def interleave(streams: list[list[ParameterDelta]], rng: np.random.Generator) -> list[ParameterDelta]:
    """A random merge of the streams, each one's order kept (chunk by chunk, as one partition does)."""
    pos = [0] * len(streams)
    out = []
    while any(p < len(s) for p, s in zip(pos, streams)):
        i = int(rng.choice([i for i, s in enumerate(streams) if pos[i] < len(s)]))
        out.append(streams[i][pos[i]])
        pos[i] += 1
    return out


def test_interleaved_shards_converge_to_the_union(cfg: ModelConfig) -> None:
    ranks = [Rank(cfg, 0, 2, seed=1), Rank(cfg, 1, 2, seed=2)]
    streams = [[m for _ in range(4) for m in ranks[0].step()],
               [m for _ in range(3) for m in ranks[1].step()]]
    # a chunk per touched table: rank 1 touches no first-order table (rank 0 owns them whole)
    assert [{m.chunk_count for m in s} for s in streams] == [{3}, {2}]
    rng = np.random.default_rng(7)
    orders = [streams[1] + streams[0], streams[0] + streams[1], interleave(streams, rng), interleave(streams, rng)]
    want = union(ranks)
    assert all(want[f"{t}.keys"].size > 50 for t in TOUCHED)
    models = []
    for order in orders:
        model = TrainerModel(config=cfg)
        for m in order:
            model.apply_delta(m)
        assert_holds(model, want)
        assert model.sparse.shard_count == 2 and model.sparse.versions() == {"0": 4, "1": 3}
        v = model_version(model)
        assert (v.shard_count, v.sparse_versions, v.sparse_version) == (2, {"0": 4, "1": 3}, 3)
        models.append(model)
    # The replicas are bit-identical to each other as well (every parameter, dense included).
    for other in models[1:]:
        for k, a in parameters(models[0]).items():
            np.testing.assert_array_equal(a, parameters(other)[k], err_msg=k)


def test_chunks_count_per_shard(cfg: ModelConfig) -> None:
    """Shard 1's version 1 completes while shard 0's version 1 is still missing chunks."""
    ranks = [Rank(cfg, 0, 2, seed=3), Rank(cfg, 1, 2, seed=4)]
    s0, s1 = ranks[0].step(), ranks[1].step()
    model = TrainerModel(config=cfg)
    for m in s0[:2] + s1:
        model.apply_delta(m)
    assert model.sparse.versions() == {"0": 0, "1": 1} and model.sparse.version == 0
    model.apply_delta(s0[2])
    assert model.sparse.versions() == {"0": 1, "1": 1} and model.sparse.version == 1


def test_shard_layout_change_supersedes(cfg: ModelConfig) -> None:
    """2 -> 1 ranks (the trainer restarted with another rank count): the new layout's deltas are
    applied although their versions are lower, and the versions restart in the new layout."""
    ranks = [Rank(cfg, 0, 2, seed=5), Rank(cfg, 1, 2, seed=6)]
    model = TrainerModel(config=cfg)
    for m in [m for _ in range(3) for r in ranks for m in r.step()]:
        model.apply_delta(m)
    assert model.sparse.versions() == {"0": 3, "1": 3}
    # The one-rank trainer resumes from the union (a resharded snapshot) and numbers afresh.
    one = Rank(cfg, 0, 1, seed=7)
    one.tables = restored(cfg, union(ranks))
    first = one.step()
    model.apply_delta(first[0])
    assert (model.sparse.shard_count, model.sparse.versions()) == (1, {"0": 0})  # v1 not complete yet
    for m in first[1:] + one.step():
        model.apply_delta(m)
    assert (model.sparse.shard_count, model.sparse.versions(), model.sparse.version) == (1, {"0": 2}, 2)
    # The one rank started from what serving held: serving now holds exactly the one rank's rows.
    assert_holds(model, union([one]))


def test_rows_of_another_shard_are_rejected(cfg: ModelConfig) -> None:
    ranks = [Rank(cfg, 0, 2, seed=8)]
    msgs = ranks[0].step()
    model = TrainerModel(config=cfg)
    wrong = ParameterDelta()
    wrong.CopyFrom(msgs[0])
    wrong.shard = 1
    with pytest.raises(DeltaRejected) as err:
        model.apply_delta(wrong)
    assert err.value.reason == "wrong_shard"
    wrong.shard = 2
    with pytest.raises(DeltaRejected) as err:
        model.apply_delta(wrong)
    assert err.value.reason == "bad_shard"
    assert model.sparse.versions() == {"0": 0} and len(model.tables[wrong.sparse.table]) == 0


def test_rank_0_owns_every_row_of_a_whole_table(cfg: ModelConfig) -> None:
    """A sequential model's first-order tables live whole on rank 0 (``trainer.sharding.whole_tables``):
    serving takes their rows of every shard from shard 0 and none from another shard (it refused
    them all as ``wrong_shard``: compose's 2-rank trainer never moved the served first-order weights)."""
    assert "item_id_w" in whole_tables(cfg)
    table = EmbeddingTable(next(t for t in cfg.tables if t.name == "item_id_w"))
    ids = np.arange(-50, 50, dtype=np.int64)  # ids of both shards
    assert set(shard_of(ids, 2).tolist()) == {0, 1}
    table.gather(ids, insert=True, event_time=T0)
    table.apply_gradients(ids, np.ones((ids.size, table.dim), np.float32), T0)
    msgs = [m for _t, m in encode_sparse_tables(cfg.model_id, 1, {"item_id_w": table}, max_event_time_ms=T0,
                                                shard=0, shard_count=2)]
    model = TrainerModel(config=cfg)
    for m in msgs:
        model.apply_delta(m)
    assert len(model.tables["item_id_w"]) == ids.size
    msgs[0].shard = 1
    with pytest.raises(DeltaRejected) as err:
        model.apply_delta(msgs[0])
    assert err.value.reason == "wrong_shard"


async def _until(feeds: list[DeltaFeed], versions: dict[str, int], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(f.model.sparse.versions() == versions for f in feeds):
        assert time.monotonic() < deadline, [f.model.sparse.versions() for f in feeds]
        await asyncio.sleep(0.05)


async def test_replicas_and_snapshot_bootstrap_on_the_broker(settings: Settings, tmp_path: Path,
                                                             cfg: ModelConfig) -> None:
    """Two replicas read an interleaved 2-shard stream from the real broker and hold the union of
    the trainer's shards bit-identically; a third bootstraps from a snapshot whose manifest holds
    shard 0 up to version 2 and shard 1 up to 1, reads the topic from its beginning and skips
    exactly those versions (shard 0's version 2 skipped while shard 1's version 2 is applied)."""
    ranks = [Rank(cfg, 0, 2, seed=11), Rank(cfg, 1, 2, seed=12)]
    rng = np.random.default_rng(13)
    a = DeltaFeed(settings, TrainerModel(config=cfg), retry_s=0.2)
    a.start()
    # v1 and v2 of shard 0, v1 of shard 1: then the snapshot.
    await publish(settings, interleave([ranks[0].step() + ranks[0].step(), ranks[1].step()], rng))
    root = tmp_path / "snapshots"
    head = TrainerModel(config=cfg).scorer.head.state_dict()
    # written as two ranks write one (each its shard, then rank 0's manifest): load gives the union
    seq = snapshots.next_seq(root / cfg.model_id)
    for r in ranks:
        snapshots.save_rank(root / cfg.model_id, seq, r.rank, restored(cfg, union([r])), {})
    rows = {t.name: sum(len(r.tables[t.name]) for r in ranks) for t in cfg.tables}
    snapshots.commit_ranks(root / cfg.model_id, cfg, seq, 2, {"head": head},
                           {"sparse_versions": {"0": 2, "1": 1}, "dense_version": 0}, rows)
    # Then shard 1's v2, v3 and shard 0's v3, interleaved with shard 1 first.
    await publish(settings, ranks[1].step() + interleave([ranks[0].step(), ranks[1].step()], rng))
    b = DeltaFeed(settings, TrainerModel(config=cfg), retry_s=0.2)
    b.start()
    c = DeltaFeed(settings, TrainerModel(config=cfg), snapshot_dir=root, retry_s=0.2)
    c.load_snapshot()
    assert c.resume_offset is None  # no offset: it reads from the beginning, the versions gate
    assert (c.model.sparse.shard_count, c.model.sparse.versions()) == (2, {"0": 2, "1": 1})
    c.start()
    want_versions = {"0": 3, "1": 3}
    await _until([a, b, c], want_versions)
    want = union(ranks)
    for f in (a, b, c):
        assert_holds(f.model, want)
    assert c.skipped == 3 + 3 + 2  # the chunks of shard 0's v1, v2 and shard 1's v1
    assert a.skipped == b.skipped == 0
    c.publish_metrics()
    for shard, v in want_versions.items():
        assert REGISTRY.get_sample_value("driftline_serving_sparse_version",
                                         {"model_id": cfg.model_id, "shard": shard}) == v
    assert REGISTRY.get_sample_value("driftline_serving_model_version",
                                     {"model_id": cfg.model_id, "kind": "sparse"}) == 3
    for f in (a, b, c):
        await f.stop()


def _delta(version: int, shard: int, shard_count: int) -> ParameterDelta:
    return ParameterDelta(model_id="deepfm", version=version, chunk_count=1, shard=shard,
                          shard_count=shard_count, sparse={"table": "item_id", "dim": 4})


def test_snapshot_gate_per_shard_and_layout(settings: Settings) -> None:
    """Which deltas a snapshot of a 2-rank trainer (shard 0 at version 2, shard 1 at 1) holds:
    read from the topic's beginning, another layout before any delta of the snapshot's own is
    older than the snapshot (skipped); a later layout supersedes the snapshot's versions."""
    from serving.versions import Bootstrap

    feed = DeltaFeed(settings, TrainerModel(config=deepfm_config(dim=4, mlp=[8])))
    boot = Bootstrap(Path("snap"), 1, 0, shard_count=2, sparse_versions={0: 2, 1: 1})
    feed._adopt(boot)
    held = lambda v, s, n: feed._held(_delta(v, s, n), "sparse")  # noqa: E731
    assert held(9, 0, 0)  # a one-process trainer's, before the 2-rank trainer took over
    assert held(2, 0, 2) and held(1, 1, 2) and not held(2, 1, 2) and not held(3, 0, 2)
    assert not held(1, 0, 1) and feed.gate is None  # restarted with one rank: supersedes
    assert not held(1, 0, 2)  # versions of the old layout gate nothing any more
    # Resumed at the snapshot's offset, every other layout is a later one.
    feed._adopt(boot)
    feed.past_snapshot = True
    assert not held(1, 0, 0) and feed.gate is None
    # A one-process snapshot (only "sparse_version") gates today's stream exactly as before.
    feed._adopt(Bootstrap(Path("snap"), 5, 0, shard_count=0, sparse_versions={0: 5}))
    assert held(5, 0, 0) and not held(6, 0, 0)


async def test_an_n_rank_trainer_after_a_warm_start(settings: Settings, tmp_path: Path, cfg: ModelConfig) -> None:
    """docker compose's stack: serving boots from the warm start's snapshot (``trainer batch``: one
    process, ``param_deltas_offset`` 0) and a 2-rank trainer publishes: every delta on the topic is
    after that snapshot, so both shards' versions are served (read as "no offset", every 2-rank delta
    was skipped as older than the snapshot and serving stayed at sparse version 0)."""
    from trainer.__main__ import write_batch_snapshot
    from trainer.model import SparseModel
    from trainer.sample_rates import SampleRateTracker

    root = tmp_path / "snapshots"
    write_batch_snapshot(SparseModel(cfg), T0, 0, root, sample_rates=SampleRateTracker(settings.trainer.sample_rate_half_life))
    ranks = [Rank(cfg, 0, 2, seed=21), Rank(cfg, 1, 2, seed=22)]
    await publish(settings, interleave([ranks[0].step() + ranks[0].step(), ranks[1].step()], np.random.default_rng(3)))
    feed = DeltaFeed(settings, TrainerModel(config=cfg), snapshot_dir=root, retry_s=0.2)
    feed.load_snapshot()
    assert feed.resume_offset == 0
    feed.start()
    await _until([feed], {"0": 2, "1": 1})
    assert_holds(feed.model, union(ranks))
    assert feed.skipped == 0
    await feed.stop()
