"""Meta-learned starting points on 2 gloo ranks (trainer.dist.meta): with each user's examples on
one rank, the ranks equal 1 process on the concatenated batches up to float summation order
(the starting point, its outer steps, the tables with their optimizer state, the head), plain and
sequential models; an idle rank takes part in every outer step; what the ranks refuse; the
online ranks on the broker."""

from __future__ import annotations

import numpy as np
import pytest

from tests.trainer.distributed.rank_local import refusals
from trainer.batch import SparseBatch, concat_batches
from trainer.config import MetaConfig, ModelConfig, deepfm_config, lr_config
from trainer.dist.model import DistributedModel
from trainer.model import SparseModel

META = MetaConfig(task_slot="user_id", support=2, query=2, tasks_per_step=3, outer_lr=0.1)
#: examples per rank per step: rank 1 idle at step 3 (it still takes part in the outer steps)
SIZES = [(10, 10), (10, 10), (10, 10), (10, 0), (10, 10), (10, 10), (10, 10), (10, 10)]


def _cfg(sequential: str = "") -> ModelConfig:
    # sequential "linear": the first-order tables whole on rank 0, learned in its pass; "all": the
    # embedding tables too (sequential_embeddings)
    cfg = deepfm_config(dim=4, mlp=[8], slots=("user_id", "genres", "item_id"), sequential=bool(sequential),
                        sequential_embeddings=sequential == "all")
    return ModelConfig.model_validate({**cfg.model_dump(), "meta": META.model_dump()})


def _batch(step: int, rank: int, n: int) -> SparseBatch:
    """Rank ``r``'s users are the ids ``= r mod 2``, from a window that moves on each step: new
    users keep arriving, each with a few examples over a few steps."""
    rng = np.random.default_rng(100 * step + rank)
    users = 2 * rng.integers(2 * step, 2 * step + 6, n) + rank
    rows = [{"user_id": [int(u)], "item_id": [int(rng.integers(0, 8))],
             "genres": rng.integers(0, 5, int(rng.integers(0, 3))).tolist()} for u in users]
    return SparseBatch.from_slot_dicts(rows, slots=_cfg().all_slots, labels=rng.integers(0, 2, n),
                                       event_time_ms=np.full(n, 1_000 * step))


def _state(model) -> dict:
    return {"tables": {n: t.items() for n, t in model.tables.items()},
            "head": {k: v.detach().numpy().copy() for k, v in model.head.state_dict().items()},
            "log_acc": model.meta.log_acc.detach().numpy().copy(),
            "steps": (model.meta.outer_steps, model.meta.skipped_steps, model.meta.tasks.opened, model.meta.tasks.filled)}


def _worker(rank: int, world: int, sequential: str) -> dict:
    dm = DistributedModel(_cfg(sequential))
    losses = [dm.train_step(_batch(s, rank, sizes[rank]))[0] for s, sizes in enumerate(SIZES)]
    out = {"losses": losses, **_state(dm.model)}
    dm.close()
    return out


def _reference(sequential: str):
    m = SparseModel(_cfg(sequential))
    losses = []
    for s, sizes in enumerate(SIZES):
        losses.append(m.train_step(concat_batches([_batch(s, r, n) for r, n in enumerate(sizes) if n]))[0])
    return losses, _state(m)


@pytest.mark.parametrize("sequential", ["", "linear", "all"], ids=["plain", "sequential", "sequential_embeddings"])
def test_two_ranks_equal_one_process_when_each_users_examples_stay_on_one_rank(sequential, rank_pool):
    res = rank_pool.run(_worker, sequential, timeout_s=90)
    ref_losses, ref = _reference(sequential)
    outer, skipped, opened, filled = ref["steps"]
    assert outer >= 3 and skipped == 0, ref["steps"]
    for r in res:
        np.testing.assert_allclose(r["losses"], ref_losses, rtol=1e-5)
        # the same starting point on every replica, stepped as often as in 1 process
        np.testing.assert_allclose(r["log_acc"], ref["log_acc"], rtol=1e-5, atol=1e-6)
        assert r["steps"][:2] == (outer, 0)
        for k, v in ref["head"].items():
            np.testing.assert_allclose(r["head"][k], v, rtol=1e-5, atol=1e-6, err_msg=k)
    # each rank opened and filled its own users' tasks: together, 1 process's
    assert sum(r["steps"][2] for r in res) == opened and sum(r["steps"][3] for r in res) == filled
    for name, items in ref["tables"].items():
        cat = [np.concatenate([r["tables"][name][i] for r in res]) for i in range(4)]
        o = np.argsort(cat[0], kind="stable")
        keys, vals, state, times = (c[o] for c in cat)
        assert keys.tolist() == items[0].tolist(), name
        np.testing.assert_allclose(vals, items[1], rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(state, items[2], rtol=1e-5, atol=1e-6, err_msg=name)  # the starts included
        assert times.tolist() == items[3].tolist(), name


def _meta_cfg(**kw) -> ModelConfig:
    cfg = deepfm_config(dim=4, mlp=[8], slots=("user_id", "item_id"), **{"sequential": False, **kw})
    return ModelConfig.model_validate({**cfg.model_dump(), "meta": META.model_dump()})


def _refused(rank: int, world: int) -> list[str]:
    lr = lr_config(slots=("user_id",), recent_items=False, sequential=True)
    lr = ModelConfig.model_validate({**lr.model_dump(), "meta": META.model_dump()})
    return refusals(lambda cfg=cfg, mode=mode: DistributedModel(cfg, mode=mode)
                    for cfg, mode in ((_meta_cfg(), "hybrid"), (lr, "sync")))


def test_the_ranks_refuse_meta_in_hybrid_and_a_sequential_model_without_the_task_slots_embedding(rank_pool):
    res = rank_pool.run(_refused, timeout_s=60)
    assert "trains in sync" in res[0][0] and "needs the task slot's embedding" in res[0][1]


async def test_two_online_ranks_learn_it_and_one_process_resumes_from_their_snapshot(settings, ml_examples, tmp_path):
    """`trainer online --nproc 2` with `model.meta` on the real broker (the served model, whose
    rows all learn in rank 0's pass): every example of the first half applied once, outer steps
    taken, the starting point in the ranks' snapshot; the 1-process trainer restores it and goes
    on with the second half."""
    import torch

    from tests.trainer.distributed.test_ranks import N, _spawn
    from trainer import snapshots
    from trainer.data import produce_examples

    cfg = deepfm_config(dim=8, mlp=[32])  # the served model: sequential, its embeddings too
    cfg = ModelConfig.model_validate({**cfg.model_dump(),
                                      "meta": MetaConfig(task_slot="user_id", tasks_per_step=8).model_dump()})
    root = settings.var_dir / "snapshots" / cfg.model_id
    half, records, steps = N // 2, 0, []
    for k, nproc in enumerate((2, 1)):
        records += await produce_examples(settings, ml_examples[k * half:(k + 1) * half], chunk=250)
        log = tmp_path / f"trainer-{k}.log"
        p = _spawn(settings, tmp_path, log, cfg=cfg, nproc=nproc)
        assert p.wait(timeout=240) == 0, log.read_text()[-4000:]
        assert k == 0 or "restored snapshot" in log.read_text()
        man = snapshots.read_manifest(root)
        assert man["examples_applied"] == (k + 1) * half and sum(man["offsets"].values()) == records
        _, dense, _ = snapshots.load(root, cfg, serving=False)
        steps.append((dense["meta"]["outer_steps"], dense["meta"]["log_acc"]))
    (ranks, start), (one, _) = steps
    assert ranks > 0 and one > ranks, steps  # the 1-process trainer went on from the ranks' steps
    assert not torch.allclose(start, SparseModel(cfg).meta.log_acc.detach())  # the ranks learned a start
