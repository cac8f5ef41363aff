"""N ranks with ``trainer.device`` and the owner-side cache (trainer/dist/placement.py,
trainer/dist/owner_cache.py), with the CPU standing in for the device: 2 gloo ranks, tiny DeepFM.

With the cache on (4 rows a table: eviction all along) the ranks equal 2 ranks without it bit for
bit: losses, every step's probabilities, scores, rows, PS optimizer state, row times, the rows a
delta would carry, the dense head and Adam's state; in ``sync`` and ``hybrid``, through the packed
owner path and (count admission) the per-table one. Both equal 1 process on the concatenated
global batch up to float summation order (the head's gradients are summed over the ranks), as
tests/trainer/distributed/test_distributed.py checks without the cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.trainer.distributed.rank_local import run_local
from tests.trainer.distributed.test_distributed import _batch, _cfg, _state
from trainer.batch import SparseBatch
from trainer.dist.model import DistributedModel
from trainer.model import SparseModel

#: examples per rank per step: an idle rank and an all-idle step on the way
SIZES = [(16, 16), (16, 0), (0, 0)] + [(16, 12)] * 9
CACHE_ROWS = 4  # per table and owner: far fewer than the hot ids, so rows are evicted all along


def _rows(step: int, rank: int, n: int) -> list[dict]:
    # items 0-7 are hot (hits), users 0-59 many (evictions)
    rng = np.random.default_rng(1000 + 100 * step + rank)
    return [{"user_id": [int(rng.integers(0, 60))], "item_id": [int(rng.integers(0, 8))],
             "genres": rng.integers(0, 5, int(rng.integers(0, 3))).tolist(),
             "recent_items": rng.integers(0, 8, int(rng.integers(0, 3))).tolist()} for _ in range(n)]


def _batches(rank: int) -> list[SparseBatch]:
    return [_batch(_rows(s, rank, SIZES[s][rank]), s, rank) for s in range(len(SIZES))]


def _deltas(tables) -> dict:
    """The rows a sparse delta would carry now (each table's change marks, popped)."""
    out = {}
    for name, t in tables.items():
        chunks = list(t.pop_updates())
        out[name] = (np.concatenate([c.keys for c in chunks]) if chunks else np.zeros(0, np.int64),
                     np.concatenate([c.values for c in chunks]) if chunks else np.zeros(0, np.float32))
    return out


def _run(rank: int, mode: str, cache_rows: int, min_count: int = 1, one_at_a_time: bool = False) -> dict:
    dm = DistributedModel(_cfg(min_count), mode=mode, device="cpu", cache_rows=cache_rows, cache_admit_after=1)
    batches = _batches(rank)
    if one_at_a_time:  # as the online ranks step; flush() writes the cache back
        out = [dm.step(b) for b in batches]
        dm.flush()
    else:
        out = list(dm.train(batches))
    pred = dm.predict(_batch(_rows(99, rank, 10), 99, rank))  # reads hits from the cache
    stats = dict(vars(dm.cache.stats)) if dm.cache is not None else None
    res = {"losses": [v for v, _ in out], "probs": [p for _, p in out], "pred": pred,
           **_state(dm.tables, dm.head, dm.optimizer), "deltas": _deltas(dm.tables), "stats": stats}
    # two more steps after the write-back: the cache goes on from the rows it holds
    for b in _batches(rank)[3:5]:
        res["losses"].append(dm.step(b)[0])
    dm.flush()
    res["after"] = _state(dm.tables, dm.head, dm.optimizer)["tables"]
    dm.close()
    return res


def _groups(rank: int) -> dict:
    dm = DistributedModel(_cfg(), device="cpu")
    out = {"dense_is_lookup": dm.dense_group is dm._lookup_group,
           "dense_backend": str(dist.get_backend(dm.dense_group)),
           "lookup_backend": str(dist.get_backend(dm._lookup_group)),
           "head_device": {str(p.device) for p in dm.head.parameters()}}
    dm.close()
    return out


def _metrics(rank: int) -> dict:
    from prometheus_client import REGISTRY

    from trainer.metrics import PSCounts

    cfg = _cfg().model_copy(update={"model_id": "rank-cache-metrics"})
    dm = DistributedModel(cfg, device="cpu", cache_rows=CACHE_ROWS, cache_admit_after=1)
    counts = PSCounts(cfg.model_id, dm.tables, dm, rank)
    for b in _batches(rank):
        dm.step(b)
    dm.flush()
    counts.update()
    got = {e: REGISTRY.get_sample_value("driftline_trainer_cache_rows_total",
                                        {"model": cfg.model_id, "rank": str(rank), "event": e})
           for e in ("lookup", "hit", "written_back", "admitted", "evicted")}
    dm.close()
    return {"exported": got, "stats": dict(vars(dm.cache.stats))}


def _worker(rank: int, world: int) -> dict:
    out = {}
    for mode, min_count, one in (("sync", 1, False), ("sync", 2, False), ("hybrid", 1, False), ("hybrid", 1, True)):
        key = f"{mode}-{min_count}-{'step' if one else 'train'}"
        out[key] = (_run(rank, mode, 0, min_count, one), _run(rank, mode, CACHE_ROWS, min_count, one))
    out["groups"] = _groups(rank)
    out["metrics"] = _metrics(rank)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_local(_worker, 2, timeout_s=120)


def _equal(a, b, path: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{path}[{i}]")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), path
    else:
        assert a == b, path


@pytest.mark.parametrize("case", ["sync-1-train", "sync-2-train", "hybrid-1-train", "hybrid-1-step"])
def test_two_ranks_with_the_cache_equal_two_ranks_without_it_bit_for_bit(ranks, case):
    for r in ranks:
        plain, cached = dict(r[case][0]), dict(r[case][1])
        st = cached.pop("stats")
        assert plain.pop("stats") is None
        _equal(plain, cached, case)
        # the owner's cache really served and stepped rows, and evicted under pressure
        assert st["hits"] > 50 and st["evicted"] > 20 and st["written_back"] > 0, st
    # both shards hold rows: both owners' caches took part
    assert all(len(r[case][1]["tables"]["item_id"][0]) for r in ranks)


def _global(s: int) -> SparseBatch | None:
    parts = [_batch(_rows(s, r, SIZES[s][r]), s, r) for r in range(2)]
    rows = [x for r in range(2) for x in _rows(s, r, SIZES[s][r])]
    if not rows:
        return None
    return SparseBatch.from_slot_dicts(rows, np.concatenate([p.dense for p in parts]), slots=_cfg().all_slots,
                                       labels=np.concatenate([p.labels for p in parts]),
                                       event_time_ms=np.concatenate([p.event_time_ms for p in parts]))


def test_two_cached_ranks_equal_one_uncached_process_up_to_summation_order(ranks):
    torch.set_num_threads(1)
    m = SparseModel(_cfg())
    for b in map(_global, range(len(SIZES))):
        if b is not None:
            m.train_step(b)
    ref = _state(m.tables, m.head, m.optimizer)
    parts = [r["sync-1-train"][1] for r in ranks]
    for name, (keys, vals, state, times) in ref["tables"].items():
        cat = [np.concatenate([p["tables"][name][i] for p in parts]) for i in range(4)]
        o = np.argsort(cat[0], kind="stable")
        assert cat[0][o].tolist() == keys.tolist(), name
        np.testing.assert_allclose(cat[1][o], vals, rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(cat[2][o], state, rtol=1e-5, atol=1e-7, err_msg=name)
        assert cat[3][o].tolist() == times.tolist(), name
    for k, v in ref["head"].items():
        np.testing.assert_allclose(parts[0]["head"][k], v, rtol=1e-5, atol=1e-7, err_msg=k)


def test_the_dense_sum_has_a_process_group_of_its_own(ranks):
    """On the CPU the dense sum stays on the default gloo group, apart from the lookups' group (the
    sparse exchange, gloo); on CUDA it is an NCCL group (test_two_ranks_on_two_gpus)."""
    for r in ranks:
        g = r["groups"]
        assert not g["dense_is_lookup"] and g["dense_backend"] == g["lookup_backend"] == "gloo", g
        assert g["head_device"] == {"cpu"}


def test_each_ranks_cache_is_exported_with_its_rank(ranks):
    for rank, r in enumerate(ranks):
        got, st = r["metrics"]["exported"], r["metrics"]["stats"]
        assert got == {"lookup": st["lookups"], "hit": st["hits"], "written_back": st["written_back"],
                       "admitted": st["admitted"], "evicted": st["evicted"]}, (rank, got, st)
        assert got["hit"] > 0


def _cuda_worker(rank: int, world: int) -> dict:
    cfg = _cfg()
    out = {}
    for name, device, rows in (("cpu", "cpu", 0), ("cuda", "cuda", CACHE_ROWS)):
        dm = DistributedModel(cfg, device=device, cache_rows=rows, cache_admit_after=1)
        losses = [dm.step(b)[0] for b in _batches(rank)]
        dm.flush()
        out[name] = {"losses": losses, "tables": {n: t.items() for n, t in dm.tables.items()},
                     "head": {k: v.detach().cpu().numpy() for k, v in dm.head.state_dict().items()},
                     "backend": str(dist.get_backend(dm.dense_group)),
                     "device": {str(p.device) for p in dm.head.parameters()}}
        dm.close()
    return out


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA devices (NCCL wants one GPU per rank)")
def test_two_ranks_on_two_gpus_follow_the_cpu():
    """2 ranks, each on its GPU (cuda:rank), the dense sum on NCCL, the owners' caches on their GPU:
    within float tolerance of the same 2 ranks on the CPU (CUDA's atomics and matmuls differ in
    the last bits)."""
    for rank, r in enumerate(run_local(_cuda_worker, 2, timeout_s=180)):
        cpu, gpu = r["cpu"], r["cuda"]
        assert gpu["backend"] == "nccl" and gpu["device"] == {f"cuda:{rank}"} and cpu["backend"] == "gloo"
        np.testing.assert_allclose(gpu["losses"], cpu["losses"], rtol=1e-3, atol=1e-4)
        for name, items in cpu["tables"].items():
            assert np.array_equal(gpu["tables"][name][0], items[0]), name
            np.testing.assert_allclose(gpu["tables"][name][1], items[1], atol=1e-3, err_msg=name)
        for k, v in cpu["head"].items():
            np.testing.assert_allclose(gpu["head"][k], v, atol=1e-3, rtol=1e-3, err_msg=k)
