"""The N-rank snapshot layout (trainer.snapshots): a snapshot of N ranks restores into M (2 -> 1,
1 -> 2, rows with their PS optimizer state), ``snapshots.load`` gives serving the union, and a
part damaged on one rank makes every rank restore the snapshot before it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ps import EmbeddingTable
from trainer import snapshots
from trainer.config import deepfm_config
from trainer.data import MovieLensData
from trainer.model import SparseModel
from trainer.sharding import shard_of, whole_tables


def small_cfg():
    return deepfm_config(dim=8, mlp=[32])


def _trained(cfg) -> SparseModel:
    m = SparseModel(cfg)
    d = MovieLensData(limit=2000)
    for b in d.batches(500, np.arange(2000)):
        m.train_step(b)
    return m


def _items(tables) -> dict:
    return {n: t.items() for n, t in tables.items()}


def _same(a: dict, b: dict) -> None:
    for n in a:
        for x, y in zip(a[n], b[n]):
            assert np.array_equal(x, y), n


def test_one_rank_snapshot_restores_into_two(tmp_path):
    cfg = small_cfg()
    m = _trained(cfg)
    snapshots.save(tmp_path, cfg, m.tables, {"head": m.head.state_dict(), "optimizer": m.optimizer.state_dict()},
                   {"offsets": {"0": 5, "1": 7}, "sparse_version": 3})
    parts = [snapshots.load_rank(tmp_path, cfg, r, 2, snapshots.candidates(tmp_path)[0]) for r in range(2)]
    for r, (tables, _, _, state) in enumerate(parts):
        assert state is None  # written by another number of ranks: the caller splits the stream state
        for name, t in tables.items():
            k = t.items()[0]  # a sequential model's first-order tables go wholly to rank 0
            own = np.zeros(k.size, np.int64) if name in whole_tables(cfg) else shard_of(k, 2)
            assert (own == r).all(), name
    union = {n: tuple(np.concatenate([p[0][n].items()[i] for p in parts]) for i in range(4)) for n in m.tables}
    for n, u in union.items():
        o = np.argsort(u[0])
        for x, y in zip(m.tables[n].items(), (c[o] for c in u)):
            assert np.array_equal(x, y), n  # rows, PS optimizer state and times moved intact


def test_two_rank_snapshot_restores_into_one_and_serving_gets_the_union(tmp_path):
    cfg = small_cfg()
    m = _trained(cfg)
    full = _items(m.tables)
    for r in range(2):  # each rank's shard, as the ranks hold them (one local shard per table)
        tables = {}
        for t in cfg.tables:
            lt = snapshots.local_config(t)
            tables[t.name] = EmbeddingTable(lt)
            k, v, s, ti = full[t.name]
            sel = shard_of(k, 2) == r
            tables[t.name].load_rows(k[sel], v[sel], s[sel], ti[sel])
        snapshots.save_rank(tmp_path, 1, r, tables, {"offsets": {r: 10 + r}})
    # no manifest yet: nothing is in force
    assert snapshots.read_manifest(tmp_path) is None
    snapshots.commit_ranks(tmp_path, cfg, 1, 2, {"head": m.head.state_dict(), "optimizer": m.optimizer.state_dict()},
                           {"offsets": {"0": 10, "1": 11}, "sparse_versions": {"0": 4, "1": 6}, "sparse_version": 6},
                           {n: len(t) for n, t in m.tables.items()})
    man = snapshots.read_manifest(tmp_path)
    assert man["shard_count"] == 2 and man["sparse_versions"] == {"0": 4, "1": 6}
    tables, dense, _ = snapshots.load(tmp_path, cfg, serving=False)
    _same(full, _items(tables))  # 2 -> 1: one process gets every row with its optimizer state
    one, _, _, state = snapshots.load_rank(tmp_path, cfg, 0, 1, snapshots.candidates(tmp_path)[0])
    for n in full:
        assert np.array_equal(full[n][0], one[n].items()[0]) and np.array_equal(full[n][2], one[n].items()[2])
    served, dense, _ = snapshots.load(tmp_path, cfg, serving=True)
    for n in full:  # serving: read-only replicas of the union
        k, v, _, _ = served[n].items()
        assert np.array_equal(k, full[n][0]) and np.array_equal(v, full[n][1])
    two, _, _, state = snapshots.load_rank(tmp_path, cfg, 1, 2, snapshots.candidates(tmp_path)[0])
    assert state == {"offsets": {1: 11}}  # same number of ranks: its own part


def _damaged_part(rank: int, world: int, root: str) -> tuple[int, int]:
    """Two 2-rank snapshots; rank 1's part of the newer one damaged: every rank restores the older."""
    import torch.distributed as dist

    from trainer.dist import rank_snapshots

    cfg = small_cfg()
    m = _trained(cfg)
    full = _items(m.tables)
    tables = {}
    for t in cfg.tables:
        tables[t.name] = EmbeddingTable(snapshots.local_config(t))
        k, v, s, ti = full[t.name]
        sel = shard_of(k, world) == rank
        tables[t.name].load_rows(k[sel], v[sel], s[sel], ti[sel])
    for seq in (1, 2):
        snapshots.save_rank(root, seq, rank, tables, {"offsets": {rank: 10 * seq + rank}, "dedup": [], "auc_pos": 0,
                                                      "auc_neg": 0, "sample_rates": {}, "examples_applied": seq})
        dist.barrier()
        if rank == 0:
            snapshots.commit_ranks(root, cfg, seq, world, {"head": m.head.state_dict()},
                                   {"offsets": {"0": 10 * seq, "1": 10 * seq + 1}, "examples_applied": seq},
                                   {n: len(t) for n, t in m.tables.items()})
        dist.barrier()
    if rank == 1:  # a bit flipped in its biggest table file: the checksum fails on this rank alone
        f = max(Path(root, "snap-000000002", "rank-1").rglob("*.bin"), key=lambda p: p.stat().st_size)
        b = bytearray(f.read_bytes())
        b[len(b) // 2] ^= 1
        f.write_bytes(bytes(b))
    dist.barrier()
    got = rank_snapshots.newest_every_rank_reads(Path(root), cfg, "examples", rank, world, None)
    return got.manifest.seq, got.offsets[rank]


def test_a_part_damaged_on_one_rank_makes_every_rank_restore_the_snapshot_before(rank_pool, tmp_path):
    assert rank_pool.run(_damaged_part, str(tmp_path), timeout_s=90) == [(1, 10), (1, 11)]
