"""Meta-learned starting points (trainer/meta.py, ``ModelConfig.meta``): new ids of the task slot
start from the learned optimizer state, the task buffer stays bounded when tasks never fill, the
outer loop learns from filled tasks, snapshots carry the starting point."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from trainer import snapshots
from trainer.batch import SparseBatch
from trainer.config import MetaConfig, deepfm_config
from trainer.data import MovieLensData
from trainer.manifest import Manifest
from trainer.meta import TaskBuffer
from trainer.model import SparseModel


@pytest.fixture(scope="module")
def batches():
    data = MovieLensData(limit=30_000)
    return list(data.batches(1024, np.arange(30_000)))


def _cfg(**meta):
    return deepfm_config(dim=8, mlp=[16], recent_items=False, seed=5).model_copy(
        update={"meta": MetaConfig(task_slot="user_id", **meta)})


def _run(batches, **meta) -> SparseModel:
    m = SparseModel(_cfg(**meta))
    for b in batches:
        m.train_step(b)
    return m


def test_new_ids_start_from_the_learned_optimizer_state(batches):
    m = _run(batches[:12], tasks_per_step=4)
    assert m.meta.outer_steps > 0 and m.meta.tasks.filled > 0
    acc = m.meta.start()
    assert not np.allclose(acc, np.exp(np.log(np.maximum(  # it moved from the tables' own
        np.r_[np.zeros(8), [m.cfg.table("user_id_w").optimizer.initial_accumulator_value]], 1e-3))))
    b = batches[12]
    ids = b.ids["user_id"]
    new = np.unique(ids[~m.tables["user_id"].contains(ids)])
    assert new.size
    m.meta.before(b)
    _, state = m.tables["user_id"].read_rows(new)
    assert np.array_equal(state, np.tile(acc[:8], (new.size, 1)))
    _, state_w = m.tables["user_id_w"].read_rows(new)
    assert np.array_equal(state_w[:, 0], np.full(new.size, acc[8], np.float32))


def test_the_same_stream_learns_the_same_starting_point(batches):
    a, b = _run(batches[:8], tasks_per_step=4), _run(batches[:8], tasks_per_step=4)
    assert torch.equal(a.meta.log_acc, b.meta.log_acc)
    assert a.meta.outer_steps == b.meta.outer_steps > 0


def test_tasks_that_never_fill_stay_bounded():
    """A stream where every example is a new task's first (support 5 + query 5 never fill): at
    most max_open tasks wait, the rest are dropped, and the chunks hold a bounded number of rows."""
    m = SparseModel(_cfg(max_open_tasks=300))
    rng = np.random.default_rng(0)
    n, held = 256, []
    for step in range(40):
        users = np.arange(step * n, (step + 1) * n, dtype=np.int64) + 10**9  # each user once
        ids = {"user_id": users, "item_id": rng.integers(0, 500, n)}
        for s in ("gender", "age", "occupation", "zip", "genres", "year"):
            ids[s] = rng.integers(0, 5, n)
        offs = {s: np.arange(n + 1, dtype=np.int64) for s in ids}
        b = SparseBatch(n, ids, offs, rng.integers(0, 2, n).astype(np.float32), np.full(n, step, np.int64))
        m.train_step(b)
        held.append(sum(c.size for c in m.meta.chunks.values()))
    t = m.meta.tasks
    assert len(list(t.keys())) == 300
    assert t.opened == 40 * n and t.dropped == 40 * n - 300 and t.filled == 0
    assert max(held) <= 2 * 300 + 4096
    assert sum(t.live.values()) == 300


def test_support_then_query_in_stream_order():
    tb = TaskBuffer(support=2, query=2, max_open=10)
    tb.open([1, 2])
    assert tb.add(0, [1, 2, 1]) == []
    filled = tb.add(1, [2, 1, 1, 2])
    assert filled == [(1, [(0, 0), (0, 2), (1, 1), (1, 2)])]
    assert tb.add(2, [2]) == [(2, [(0, 1), (1, 0), (1, 3), (2, 0)])]
    assert tb.filled == 2 and not list(tb.keys())
    assert sorted(tb.release([(0, 0), (0, 2), (1, 1), (1, 2), (0, 1), (1, 0), (1, 3), (2, 0)])) == [0, 1, 2]


def test_a_snapshot_carries_the_starting_point(batches, tmp_path):
    m = _run(batches[:8], tasks_per_step=4)
    path = snapshots.save(tmp_path, m.cfg, m.tables, m.dense_state(), Manifest(max_event_time_ms=1))
    assert path.exists()
    tables, dense, _ = snapshots.load(tmp_path, m.cfg, serving=False)
    r = SparseModel(m.cfg, tables)
    r.load_dense_state(dense)
    assert torch.equal(r.meta.log_acc, m.meta.log_acc)
    assert r.meta.outer_steps == m.meta.outer_steps
    # new ids of the restored trainer start where the original's would (the waiting tasks are not
    # kept: a restart opens tasks afresh, so the two learn on from different buffers)
    assert np.array_equal(r.meta.start(), m.meta.start())
    # the starting point's optimizer learns on at the configuration's rate, not the saved one
    slower = m.cfg.model_copy(update={"meta": m.cfg.meta.model_copy(update={"outer_lr": 0.05})})
    r = SparseModel(slower, snapshots.load(tmp_path, slower, serving=False)[0])
    r.load_dense_state(dense)
    assert [g["lr"] for g in r.meta.optimizer.param_groups] == [0.05] != [m.cfg.meta.outer_lr]


def test_meta_refuses_the_device_cache():
    with pytest.raises(ValueError, match="cache_rows"):
        SparseModel(_cfg(), cache_rows=64)


def test_the_task_slot_must_be_a_slot():
    with pytest.raises(ValueError, match="not a slot"):
        deepfm_config(recent_items=False).model_copy(update={"meta": None}).model_validate(
            {**deepfm_config(recent_items=False).model_dump(), "meta": {"task_slot": "nope"}})


def test_the_project_file_turns_it_on(tmp_path):
    from driftline.project import load_project
    from driftline.project_template import TEMPLATE

    path = tmp_path / "p.toml"
    path.write_text(TEMPLATE.replace('# meta = { task_slot = "item_id" }', 'meta = { task_slot = "item_id", support = 3 }'))
    meta = load_project(path).model_config().meta
    assert meta is not None and (meta.task_slot, meta.support, meta.query) == ("item_id", 3, 5)
    path.write_text(TEMPLATE.replace('# meta = { task_slot = "item_id" }', 'meta = { task_slot = "user" }'))
    with pytest.raises(ValueError, match="not a slot"):
        load_project(path).model_config()


def test_serving_scores_a_brand_new_user_from_the_same_start(batches, tmp_path):
    """A new user's rows start at zeros in training (the learned part is the optimizer state), and
    serving, which has no row for them, reads zeros: the trainer's first score of a brand-new user
    equals what serving answers from the trainer's snapshot, with no path of its own."""
    from trainer.inference import Scorer

    m = _run(batches[:8], tasks_per_step=4)
    snapshots.save(tmp_path, m.cfg, m.tables, m.dense_state(), Manifest(max_event_time_ms=1))
    tables, head, _ = snapshots.load_latest(tmp_path)
    b = batches[8].select(np.arange(64))
    b.ids["user_id"] = b.ids["user_id"] + 10**9  # brand-new users, known items
    served = Scorer(m.cfg, tables, head).predict(b)
    m.meta.before(b)
    assert np.allclose(m.predict(b), served, atol=1e-6)
    acc = m.meta.start()
    _, state = m.tables["user_id"].read_rows(np.unique(b.ids["user_id"]))
    assert np.array_equal(state[0], acc[:8])


async def test_the_online_trainer_learns_it_and_a_restart_restores_it(settings):
    """`trainer online` with `meta` on the real broker: every example applied, outer steps taken,
    the snapshot carries the starting point and a restarted trainer resumes from it."""
    from trainer.data import produce_examples
    from trainer.online import OnlineTrainer

    cfg = deepfm_config(dim=8, mlp=[32]).model_copy(
        update={"meta": MetaConfig(task_slot="user_id", tasks_per_step=4)})
    stream = MovieLensData(limit=6_000).examples()
    await produce_examples(settings, stream)
    s = settings.updated(trainer=dict(sync_interval_s=1.0, snapshot_interval_event_s=0, batch_size=512))
    tr = OnlineTrainer(s, cfg)
    res = await asyncio.wait_for(tr.run(stop_when_idle_s=3.0), 120)
    assert res["examples_applied"] == len(stream) and res["bad"] == 0, res
    meta = tr.model.meta
    assert meta.outer_steps > 0 and meta.tasks.filled >= 4 * meta.outer_steps
    from prometheus_client import REGISTRY
    labels = {"model": cfg.model_id}
    assert REGISTRY.get_sample_value("driftline_trainer_meta_tasks_total", {**labels, "event": "filled"}) >= meta.tasks.filled
    assert REGISTRY.get_sample_value("driftline_trainer_meta_outer_steps_total", {**labels, "outcome": "taken"}) >= meta.outer_steps
    _, dense, _ = snapshots.load(settings.var_dir / "snapshots" / cfg.model_id, cfg, serving=False)
    assert torch.equal(dense["meta"]["log_acc"], meta.log_acc.detach())
    again = OnlineTrainer(s, cfg)
    res2 = await asyncio.wait_for(again.run(stop_when_idle_s=2.0), 60)
    assert res2["examples_applied"] == len(stream)  # nothing new: restored, not retrained
    assert torch.equal(again.model.meta.log_acc, meta.log_acc) and again.model.meta.outer_steps == meta.outer_steps


def test_a_failing_outer_step_never_fails_the_training_step(batches, monkeypatch):
    """The outer step runs after the batch is applied: if it raised, the trainer's isolation would
    retry (and apply again) that batch. It is skipped and counted instead."""
    m = SparseModel(_cfg(tasks_per_step=2))

    def boom(tasks):
        raise RuntimeError("outer step")

    monkeypatch.setattr(m.meta, "_meta_step", boom)
    for b in batches[:8]:
        m.train_step(b)
    assert m.meta.skipped_steps > 0 and m.meta.outer_steps == 0
    assert not m.meta.chunks or sum(m.meta.tasks.live.values()) > 0  # the failed tasks' rows let go
