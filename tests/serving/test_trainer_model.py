"""Serving the trainer's DeepFM: deltas published by a training model reach replicas exactly."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from serving_helpers import dead_letters, parameters, publish

from proto import ParameterDelta
from services.settings import Settings
from serving.deltas import DeltaFeed
from serving.model import TrainerModel
from trainer import snapshots
from trainer.batch import SparseBatch
from trainer.config import deepfm_config
from trainer.model import SparseModel
from trainer.sync import NonFiniteDelta, encode_dense, encode_sparse_tables


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


def _poisoned(msg: ParameterDelta) -> ParameterDelta:
    """``msg`` with its first value NaN, as a foreign or broken producer would send it (the
    trainer's own encoder refuses to)."""
    poisoned = ParameterDelta()
    poisoned.CopyFrom(msg)
    payload = poisoned.dense.tensors[0] if msg.HasField("dense") else poisoned.sparse
    values = np.frombuffer(payload.values, "<f4").copy()
    values[0] = np.nan
    payload.values = values.tobytes()
    return poisoned


async def test_a_nan_delta_is_refused_dead_lettered_once_and_the_last_good_model_serves(
        settings: Settings) -> None:
    cfg = deepfm_config(dim=4, mlp=[8])
    rng = np.random.default_rng(6)
    trainer = SparseModel(cfg, train=True)
    _train(trainer, rng, 5, 1_700_000_000_000)
    good = [m for _t, m in encode_sparse_tables(cfg.model_id, 1, trainer.tables)]
    good.append(encode_dense(cfg.model_id, 1, trainer.head))
    user, items = {"user_id": [3], "gender": [1]}, [{"item_id": [i], "genres": [1, 2]} for i in range(1, 40)]
    want = trainer.predict(SparseBatch.from_slot_dicts([{**user, **i} for i in items], slots=cfg.all_slots))
    with pytest.raises(NonFiniteDelta):  # the trainer never publishes one
        encode_dense(cfg.model_id, 2, {"w": torch.tensor([1.0, float("nan")])})
    bad_sparse = _poisoned(next(m for _t, m in encode_sparse_tables(cfg.model_id, 2, _trained(trainer, rng))))
    bad_dense = _poisoned(encode_dense(cfg.model_id, 2, trainer.head))
    await publish(settings, [*good, bad_sparse, bad_dense])
    for _ in range(2):  # a restart re-reads the refused records: they are not dead-lettered again
        feed = DeltaFeed(settings, TrainerModel(config=cfg), retry_s=0.2)
        feed.start()
        try:
            await _until([feed], 1, 1)
            deadline = time.monotonic() + 20
            while feed.skipped < 2:
                assert time.monotonic() < deadline, feed.skipped
                await asyncio.sleep(0.05)
            assert (feed.model.sparse.version, feed.model.dense.version) == (1, 1)
            np.testing.assert_allclose(feed.model.score(user, items), want, rtol=1e-6)
        finally:
            await feed.stop()
    letters = await dead_letters(settings, 3, timeout=5.0)
    assert sorted(letter.offset for letter in letters) == [len(good), len(good) + 1], letters
    assert all(letter.reason.startswith("refused: non_finite") for letter in letters), letters


def _trained(model: SparseModel, rng: np.random.Generator) -> dict:
    _train(model, rng, 2, 1_700_000_100_000)
    return model.tables
