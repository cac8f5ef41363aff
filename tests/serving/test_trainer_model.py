"""Serving the trainer's DeepFM: deltas published by a training model reach replicas exactly."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np

from serving.deltas import DeltaFeed
from serving.model import TrainerModel, parameters
from services.settings import Settings
from trainer import snapshots
from trainer.batch import SparseBatch
from trainer.config import deepfm_config
from trainer.model import SparseModel
from trainer.sync import encode_dense, encode_sparse_tables

from serving_helpers import publish


def _rows(rng: np.random.Generator, n: int) -> list[dict[str, list[int]]]:
    return [{"user_id": [int(rng.integers(1, 50))], "gender": [int(rng.integers(0, 2))],
             "item_id": [int(rng.integers(1, 200))], "genres": list(map(int, rng.integers(0, 18, 2)))}
            for _ in range(n)]


def _train(model: SparseModel, rng: np.random.Generator, steps: int, t0: int) -> None:
    for s in range(steps):
        rows = _rows(rng, 64)
        batch = SparseBatch.from_slot_dicts(rows, slots=model.cfg.all_slots,
                                            labels=rng.integers(0, 2, 64).astype(np.float32),
                                            event_time_ms=np.full(64, t0 + s, np.int64))
        model.train_step(batch)


async def _until(feeds: list[DeltaFeed], sparse: int, dense: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(f.model.sparse.version >= sparse and f.model.dense.version >= dense for f in feeds):
        assert time.monotonic() < deadline, [(f.model.sparse.version, f.model.dense.version) for f in feeds]
        await asyncio.sleep(0.05)


async def test_trainer_deltas_and_snapshot_bootstrap(settings: Settings, tmp_path: Path) -> None:
    cfg = deepfm_config(dim=4, mlp=[8])
    rng = np.random.default_rng(5)
    trainer = SparseModel(cfg, train=True)
    a = DeltaFeed(settings, TrainerModel(config=cfg), retry_s=0.2)
    a.start()
    published = 0
    for version in (1, 2):
        _train(trainer, rng, 5, 1_700_000_000_000 + version * 1000)
        msgs = [m for _t, m in encode_sparse_tables(cfg.model_id, version, trainer.tables)]
        msgs.append(encode_dense(cfg.model_id, version, trainer.head))
        published = await publish(settings, msgs)
    await _until([a], 2, 2)

    def trainer_params() -> dict[str, np.ndarray]:
        out = {}
        for name, t in trainer.tables.items():
            k, v, _s, _t = t.items()
            out[f"{name}.keys"], out[f"{name}.values"] = k, v
        out.update({f"dense.{k}": v.detach().numpy() for k, v in trainer.head.state_dict().items()})
        return out

    expected, got = trainer_params(), parameters(a.model)
    assert expected.keys() == got.keys()
    for k in expected:
        np.testing.assert_array_equal(expected[k], got[k], err_msg=k)
    rows = _rows(rng, 30)
    want = trainer.predict(SparseBatch.from_slot_dicts(rows, slots=cfg.all_slots))
    user = {"user_id": rows[0]["user_id"], "gender": rows[0]["gender"]}
    items = [{"item_id": r["item_id"], "genres": r["genres"]} for r in rows]
    want = trainer.predict(SparseBatch.from_slot_dicts([{**user, **i} for i in items], slots=cfg.all_slots))
    np.testing.assert_allclose(a.model.score(user, items), want, rtol=1e-6)

    # A trainer snapshot at this point + the deltas after its offset = the same parameters.
    root = tmp_path / "snapshots"
    snapshots.save(root / cfg.model_id, cfg, trainer.tables, {"head": trainer.head.state_dict()},
                   {"sparse_version": 2, "dense_version": 2, "param_deltas_offset": published})
    b = DeltaFeed(settings, TrainerModel(config=cfg), snapshot_dir=root, retry_s=0.2)
    b.load_snapshot()
    assert b.loaded and b.resume_offset == published
    b.start()
    _train(trainer, rng, 5, 1_800_000_000_000)
    await publish(settings, [m for _t, m in encode_sparse_tables(cfg.model_id, 3, trainer.tables)])
    await _until([a, b], 3, 2)
    pa, pb = parameters(a.model), parameters(b.model)
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)
    assert b.skipped == 0  # it started at the snapshot's offset: nothing re-read
    await a.stop()
    await b.stop()
