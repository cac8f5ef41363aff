"""trainer.dist.model in real processes (2 gloo ranks, 1 torch thread each, tiny DeepFM).

``sync``: 2 ranks == 1 process on the concatenated global batch (rows, PS optimizer state, row
times, dense head, Adam state, losses), with an idle rank and an all-idle step on the way.
``hybrid``: finishes, replicas stay equal, same rows as ``sync``; with staleness 1 it equals a
1-process run that applies each step's sparse update one step late (after the next step's
lookup), through :meth:`DistributedModel.train` and through :meth:`DistributedModel.step`; with
staleness 0 (:meth:`DistributedModel.step`) it equals ``sync``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.batch import SparseBatch
from trainer.config import ModelConfig, deepfm_config
from trainer.dist.model import DistributedError, DistributedModel
from trainer.isolate import train_isolating_ranks
from trainer.model import SparseModel

#: examples per rank per step: an idle rank (step 1) and an all-idle step (step 2) included
SIZES = [(12, 12), (12, 0), (0, 0), (6, 12)]
PRED = 9  # the rows of "step 9" are scored after training (DistributedModel.predict): new ids read zeros


def _cfg(min_count: int = 1, sequential: str = "") -> ModelConfig:
    # recent_items shares the item table unsalted: one row per (table, id) across slots.
    # min_count 2: the owners must count occurrences as the 1-process PS does.
    # sequential "linear": the first-order tables live whole on rank 0, which runs their
    # per-example pass; "all": the embedding tables too (sequential_embeddings).
    # A dense "amount" in cents: the dense scaler's statistics are summed over the ranks
    # (trainer.dense_scaling), equal to one process' on the global batch.
    return deepfm_config(dim=4, mlp=[8], min_count=min_count, slots=("user_id", "genres", "item_id"),
                         sequential=bool(sequential), sequential_embeddings=sequential == "all"
                         ).model_copy(update={"dense_features": ["amount"]})


def _rows(step: int, rank: int, n: int) -> list[dict]:
    rng = np.random.default_rng(100 * step + rank)
    return [{"user_id": [int(rng.integers(0, 40))], "item_id": [int(rng.integers(0, 8))],
             "genres": rng.integers(0, 5, int(rng.integers(0, 3))).tolist(),
             "recent_items": rng.integers(0, 8, int(rng.integers(0, 3))).tolist()} for _ in range(n)]


def _amounts(rng: np.random.Generator, n: int) -> np.ndarray:
    return (100 * rng.lognormal(3, 1, (n, 1))).astype(np.float32)


def _batch(rows: list[dict], step: int, rank: int) -> SparseBatch:
    rng = np.random.default_rng(7 + 100 * step + rank)
    n = len(rows)
    return SparseBatch.from_slot_dicts(rows, _amounts(rng, n), slots=_cfg().all_slots, labels=rng.integers(0, 2, n),
                                       event_time_ms=1_000 * step + rng.integers(0, 500, n))


def _state(tables, head, opt) -> dict:
    st = opt.state_dict()["state"]
    return {"tables": {n: t.items() for n, t in tables.items()},
            "head": {k: v.detach().numpy().copy() for k, v in head.state_dict().items()},
            "adam": {i: {k: v.numpy().copy() for k, v in s.items()} for i, s in st.items()}}


def _run(rank: int, mode: str, min_count: int, one_at_a_time: bool = False, staleness: int = 1,
         sequential: str = "") -> dict:
    dm = DistributedModel(_cfg(min_count, sequential), mode=mode, staleness=staleness)
    batches = [_batch(_rows(s, rank, SIZES[s][rank]), s, rank) for s in range(len(SIZES))]
    if one_at_a_time:  # as the online ranks step: one batch per call, then a flush
        out = [dm.step(b) for b in batches]
        dm.flush()
    else:
        out = list(dm.train(batches))
    wire = dm.alltoall_bytes
    pred = dm.predict(_batch(_rows(PRED, rank, SIZES[1][0]), PRED, rank))  # after training, nothing learned
    dm.close()
    return {"losses": [v for v, _ in out], "probs": [p for _, p in out], "pred": pred,
            **_state(dm.tables, dm.head, dm.optimizer), "wire_bytes": wire}


def _worker(rank: int, world: int, mode: str, sequential: str = "") -> list[dict]:
    # both admission settings in one process group: one spawn per test
    return [_run(rank, mode, 1, sequential=sequential), _run(rank, mode, 2, sequential=sequential)]


def _global_batch(s: int, sizes: tuple[int, int] | None = None) -> SparseBatch | None:
    sizes = SIZES[s] if sizes is None else sizes
    rows = [r for rank in range(2) for r in _rows(s, rank, sizes[rank])]
    if not rows:
        return None
    b = [_batch(_rows(s, rank, sizes[rank]), s, rank) for rank in range(2)]
    return SparseBatch.from_slot_dicts(rows, np.concatenate([x.dense for x in b]), slots=_cfg().all_slots,
                                       labels=np.concatenate([x.labels for x in b]),
                                       event_time_ms=np.concatenate([x.event_time_ms for x in b]))


def _reference(min_count: int = 1, sequential: str = "") -> tuple[list, dict]:
    torch.set_num_threads(1)
    m = SparseModel(_cfg(min_count, sequential))
    losses = [m.train_step(b)[0] for b in map(_global_batch, range(len(SIZES))) if b is not None]
    pred = m.predict(_global_batch(PRED, (SIZES[1][0],) * 2))
    return losses, {**_state(m.tables, m.head, m.optimizer), "pred": pred}


def _reference_one_step_late() -> tuple[list, dict]:
    """1 process, global batches; step s's sparse update lands after step s + 1's lookup (an
    all-idle step s + 1 included): what hybrid with staleness 1 promises."""
    torch.set_num_threads(1)
    m = SparseModel(_cfg())
    losses, late = [], None
    for s in range(len(SIZES)):
        b = _global_batch(s)
        if b is not None:
            m.head.start_bias(float(b.labels.sum()), b.size)  # (before the batch is scored, as the engines)
            logits, (pb, leaves) = m.forward(b, insert=True, event_time=b.max_event_time)
        if late is not None:
            m.ps.apply_packed_gradients(*late)
            late = None
        if b is None:
            continue
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.from_numpy(b.labels))
        m.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        m.head.stage_moments()
        late = (pb, np.concatenate([w.grad.numpy().reshape(-1) for _, w in leaves]), b.max_event_time)
        m.head.hold_bias()
        m.optimizer.step()
        losses.append(float(loss.detach()))
    m.ps.apply_packed_gradients(*late)
    return losses, _state(m.tables, m.head, m.optimizer)


def _hybrid_worker(rank: int, world: int) -> list[dict]:
    return [_run(rank, "hybrid", 1), _run(rank, "hybrid", 1, one_at_a_time=True),
            _run(rank, "hybrid", 1, one_at_a_time=True, staleness=0)]


def _merged(parts: list[dict], name: str):
    cat = [np.concatenate([p["tables"][name][i] for p in parts]) for i in range(4)]
    o = np.argsort(cat[0], kind="stable")
    return [c[o] for c in cat]


@pytest.mark.parametrize("sequential", ["", "linear", "all"], ids=["plain", "sequential", "sequential_embeddings"])
def test_sync_two_ranks_equal_one_process_on_the_global_batch(sequential, rank_pool):
    both = rank_pool.run(_worker, "sync", sequential, timeout_s=60)
    res = [r[0] for r in both]
    ref_losses, ref = _reference(sequential=sequential)
    # an all-idle step is skipped by every rank together (loss 0.0, no probabilities)
    assert [len(p) for p in res[1]["probs"]] == [12, 0, 0, 12] and res[0]["losses"][2] == 0.0
    for r in res:
        got = [v for v, (a, b) in zip(r["losses"], SIZES) if a + b]
        np.testing.assert_allclose(got, ref_losses, rtol=1e-5)
    for name, items in ref["tables"].items():
        keys, vals, state, times = _merged(res, name)
        assert keys.tolist() == items[0].tolist(), name       # same ids admitted
        np.testing.assert_allclose(vals, items[1], rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(state, items[2], rtol=1e-5, atol=1e-7, err_msg=name)  # Adagrad sums
        assert times.tolist() == items[3].tolist(), name
    # both shards hold rows: the ids really are split over the owners (sequential embeddings:
    # every table is rank 0's)
    assert all(len(r["tables"]["item_id"][0]) for r in res) == (sequential != "all")
    assert ref["head"]["scaler.count"].tolist() == [sum(map(sum, SIZES))]  # every example's dense amount, once
    assert (ref["head"]["linear_scale"] != 1.0).all()  # the first-order factors learned (rank 0's pass sums theirs)
    for r in res:
        for k, v in ref["head"].items():
            np.testing.assert_allclose(r["head"][k], v, rtol=1e-5, atol=1e-7, err_msg=k)
        assert r["adam"].keys() == ref["adam"].keys()
        for i, s in ref["adam"].items():
            for k, v in s.items():
                np.testing.assert_allclose(r["adam"][i][k], v, rtol=1e-4, atol=1e-9, err_msg=f"{i}.{k}")
    assert all(r["wire_bytes"] > 0 for r in res)
    np.testing.assert_allclose(np.concatenate([r["pred"] for r in res]), ref["pred"], rtol=1e-5, atol=1e-7)
    if sequential:  # the first-order tables are rank 0's alone
        assert len(res[0]["tables"]["user_id_w"][0]) and not len(res[1]["tables"]["user_id_w"][0])
    # count admission: the owners admit exactly the ids the 1-process PS admits
    _, ref2 = _reference(2, sequential)
    for name, items in ref2["tables"].items():
        assert _merged([r[1] for r in both], name)[0].tolist() == items[0].tolist(), name
    assert sum(len(items[0]) for items in ref2["tables"].values()) < sum(len(i[0]) for i in ref["tables"].values())


@pytest.mark.parametrize("sequential", ["", "all"], ids=["plain", "sequential_embeddings"])
def test_hybrid_finishes_and_keeps_replicas_equal(sequential, rank_pool):
    res = [r[0] for r in rank_pool.run(_worker, "hybrid", sequential, timeout_s=60)]
    a, b = res
    assert [len(p) for p in a["probs"]] == [12, 12, 0, 6]
    assert all(np.isfinite(a["losses"])) and a["losses"] == b["losses"]
    for k in a["head"]:
        assert (a["head"][k] == b["head"][k]).all(), k     # same all-reduced gradients
    ref_losses, ref = _reference(sequential=sequential)
    assert a["losses"][0] == pytest.approx(ref_losses[0], rel=1e-5)  # nothing stale at step 0
    for name, items in ref["tables"].items():              # admission does not depend on timing
        assert _merged(res, name)[0].tolist() == items[0].tolist(), name


def test_hybrid_staleness_1_equals_updates_applied_one_step_late_and_0_equals_sync(rank_pool):
    ref_losses, ref = _reference_one_step_late()
    sync_losses, sync = _reference()
    *late, fresh = zip(*rank_pool.run(_hybrid_worker, timeout_s=60))
    # staleness 0 (step(): each update queued ahead of the next lookup) is sync, rows and all
    for r in fresh:
        got = [v for v, (a, b) in zip(r["losses"], SIZES) if a + b]
        np.testing.assert_allclose(got, sync_losses, rtol=1e-5)
    for name, items in sync["tables"].items():
        keys, vals, state, times = _merged(fresh, name)
        assert keys.tolist() == items[0].tolist(), name
        np.testing.assert_allclose(vals, items[1], rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(state, items[2], rtol=1e-5, atol=1e-7, err_msg=name)
    for res in late:  # staleness 1: train(), then step()
        for r in res:
            got = [v for v, (a, b) in zip(r["losses"], SIZES) if a + b]
            np.testing.assert_allclose(got, ref_losses, rtol=1e-5)
        # not sync's: the last step really looked up rows that missed the step before's update
        assert abs(got[-1] - sync_losses[-1]) > 1e-4
        for name, items in ref["tables"].items():
            keys, vals, state, times = _merged(res, name)
            assert keys.tolist() == items[0].tolist(), name
            np.testing.assert_allclose(vals, items[1], rtol=1e-5, atol=1e-6, err_msg=name)
            np.testing.assert_allclose(state, items[2], rtol=1e-5, atol=1e-7, err_msg=name)
            assert times.tolist() == items[3].tolist(), name
        for k, v in ref["head"].items():
            np.testing.assert_allclose(res[0]["head"][k], v, rtol=1e-5, atol=1e-7, err_msg=k)


def test_needs_a_process_group():
    with pytest.raises(DistributedError, match="not initialized"):
        DistributedModel(_cfg())


HUGE = 3e38  # a finite float32: with a dense weight of 2 the logit overflows


def _poisoned(rank: int, world: int, bad_rows: list[list[int]], mode: str) -> dict:
    """Rank ``rank`` steps a batch of 12 whose rows ``bad_rows[rank]`` overflow, isolating in lockstep."""
    # raw dense inputs: a scaled x could not overflow (trainer.dense_scaling)
    cfg = ModelConfig.model_validate({**_cfg().model_dump(), "dense_features": ["x"], "dense_scaling": "none"})
    dm = DistributedModel(cfg, mode=mode)
    with torch.no_grad():
        dm.head.dense_linear.weight.fill_(2.0)
    rows = _rows(0, rank, 12)
    dense = np.zeros((12, 1), np.float32)
    dense[bad_rows[rank], 0] = HUGE
    b = SparseBatch.from_slot_dicts(rows, dense, slots=cfg.all_slots, labels=[0.0] * 12, event_time_ms=[1] * 12)
    res = train_isolating_ranks(dm, b)
    after = dm.step(b.select(np.array([1, 2])))  # the group still steps together afterwards
    dm.flush()
    dm.close()
    return {"overlapped": dm.overlapped_updates, "failed": [(r, type(e).__name__) for r, e in res.failed],
            "applied": res.applied.tolist(),
            "probs": len(res.probs), "steps": dm.steps, "loss": after[0],
            "head": {k: v.detach().numpy().copy() for k, v in dm.head.state_dict().items()}}


@pytest.mark.parametrize("mode", ["sync", "hybrid"])
def test_a_failing_example_on_one_rank_is_isolated_in_lockstep(mode, rank_pool):
    """Rank 1's row 5 and rank 0's rows 0 and 11 make the step non-finite: every rank raises
    together, each halves its own batch to the failing rows while the other retries, and every
    other row is learned once; the replicas stay equal and the group goes on stepping (hybrid:
    the retries' sparse updates deferred and overlapped like any step's)."""
    a, b = rank_pool.run(_poisoned, [[0, 11], [5]], mode, timeout_s=60)
    assert (a["overlapped"] > 0) == (mode == "hybrid")
    assert b["failed"] == [(5, "NonFiniteStepError")] and b["applied"] == [r for r in range(12) if r != 5]
    assert a["failed"] == [(0, "NonFiniteStepError"), (11, "NonFiniteStepError")]
    assert a["applied"] == list(range(1, 11)) and a["probs"] == 10 and b["probs"] == 11
    assert a["steps"] == b["steps"] > 1 and np.isfinite(a["loss"])
    for k in a["head"]:
        assert (a["head"][k] == b["head"][k]).all(), k


POISON_ID, POISON_UPDATE = 777, 778  # user ids no other row has


def _failing(method, poison: int):
    def call(ids, *args, **kw):
        if (np.asarray(ids) == poison).any():
            raise MemoryError(f"injected owner failure on {poison}")
        return method(ids, *args, **kw)
    return call


def _failing_packed(method, poison: int):
    def call(pb, *args, **kw):
        if (pb.ids == poison).any():
            raise MemoryError(f"injected owner failure on {poison}")
        return method(pb, *args, **kw)
    return call


def _owner_fails(rank: int, world: int, mode: str) -> dict:
    """Every owner's gather raises on ``POISON_ID``, its update on ``POISON_UPDATE`` (fault
    injection: no input makes a real PS call raise today; a bug or a MemoryError there would).
    Rank 0's row 3 holds the first; rank 1's row 0 of the next step the second."""
    dm = DistributedModel(_cfg(), mode=mode)
    for t in dm.tables.values():
        t.gather, t.apply_gradients = _failing(t.gather, POISON_ID), _failing(t.apply_gradients, POISON_UPDATE)
    ps = dm.model.ps  # the owners' packed calls (all tables at once) fail on the same ids
    ps.gather_packed = _failing_packed(ps.gather_packed, POISON_ID)
    ps.apply_packed_gradients = _failing_packed(ps.apply_packed_gradients, POISON_UPDATE)
    rows = _rows(0, rank, 8)
    if rank == 0:
        rows[3]["user_id"] = [POISON_ID]
    res = train_isolating_ranks(dm, _batch(rows, 0, rank))
    rows = _rows(1, rank, 4)
    if rank == 1:
        rows[0]["user_id"] = [POISON_UPDATE]
    after = dm.step(_batch(rows, 1, rank))  # the group still steps together afterwards
    dm.flush()
    dm.close()
    return {"failed": [(r, type(e).__name__) for r, e in res.failed], "applied": res.applied.tolist(),
            "loss": after[0], "head": {k: v.detach().numpy().copy() for k, v in dm.head.state_dict().items()},
            "failed_updates": dm.failed_updates, "steps": dm.steps}


@pytest.mark.parametrize("mode", ["sync", "hybrid"])
def test_an_owner_lookup_failing_on_one_ranks_ids_is_isolated_in_lockstep(mode, rank_pool):
    """The owner of the poisoned id raises inside its lookup: it names the requester whose ids
    failed (retrying requester by requester), every rank fails the step together, only rank 0
    bisects, its row 3 alone is failed, and nobody waits in a collective. An owner's update that
    raises (after the step is agreed) is skipped and counted: its two tables (user_id and its
    first-order weight), once."""
    a, b = rank_pool.run(_owner_fails, mode, timeout_s=60)
    assert a["failed_updates"] + b["failed_updates"] == 2 and a["steps"] == b["steps"]
    assert a["failed"] == [(3, "OwnerLookupError")] and a["applied"] == [0, 1, 2, 4, 5, 6, 7]
    assert b["failed"] == [] and b["applied"] == list(range(8))
    assert np.isfinite(a["loss"]) and a["loss"] == b["loss"]
    for k in a["head"]:
        assert (a["head"][k] == b["head"][k]).all(), k
