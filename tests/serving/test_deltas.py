"""Serving PS: replicas consuming the same deltas converge; bootstrap = snapshot + later deltas."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
from serving_helpers import dense_delta, parameters, publish, sparse_delta

from services.settings import Settings
from serving.deltas import DeltaFeed
from serving.fm_model import FMModel

DIM = 4


def _stream(rng: np.random.Generator, versions: int, start: int = 1) -> list:
    """Sparse versions in 3 chunks over two tables with overwrites and tombstones, plus dense ones."""
    out = []
    for v in range(start, start + versions):
        for c in range(3):
            keys = rng.choice(500, size=60, replace=False).astype(np.int64)
            tomb = rng.choice(np.setdiff1d(np.arange(500), keys), size=5, replace=False).astype(np.int64)
            table = "item_id" if c % 2 == 0 else "user_id"
            out.append(sparse_delta(table, keys, rng.normal(size=(60, DIM + 1)).astype(np.float32), v, c, 3, tomb))
        if v % 2 == 0:
            out.append(dense_delta(float(rng.normal()), v // 2))
    return out


async def _until(feeds: list[DeltaFeed], sparse: int, dense: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(f.model.sparse.version >= sparse and f.model.dense.version >= dense for f in feeds):
        assert time.monotonic() < deadline, [(f.model.sparse.version, f.model.dense.version) for f in feeds]
        await asyncio.sleep(0.05)


def _assert_same(a: FMModel, b: FMModel) -> None:
    pa, pb = parameters(a), parameters(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)


async def test_replicas_converge_and_bootstrap_from_snapshot(settings: Settings, tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    first = _stream(rng, 6)
    # Replica A starts before anything is published; B starts in the middle of the stream.
    a = DeltaFeed(settings, FMModel(dim=DIM), retry_s=0.2)
    a.start()
    await publish(settings, first[:10])
    b = DeltaFeed(settings, FMModel(dim=DIM), retry_s=0.2)
    b.start()
    await publish(settings, first[10:])
    await _until([a, b], 6, 3)
    assert a.caught_up.is_set() and b.caught_up.is_set()
    _assert_same(a.model, b.model)
    assert len(a.model.tables["item_id"]) > 0
    # Unknown ids read as the default (zeros): score is sigmoid(bias).
    bias = float(a.model.dense_params["bias"][0])
    assert a.model.score({"user_id": [10**12]}, [{"item_id": [10**12]}])[0] == np.float64(1 / (1 + np.exp(-bias)))

    # C bootstraps from A's snapshot, skips the deltas the snapshot holds, and applies later ones.
    snap_dir = tmp_path / "snapshots"
    a.model.save_snapshot(snap_dir)
    c = DeltaFeed(settings, FMModel(dim=DIM), snapshot_dir=snap_dir, retry_s=0.2)
    c.load_snapshot()
    assert c.loaded and (c.model.sparse.version, c.model.dense.version) == (6, 3)
    c.start()
    await publish(settings, _stream(rng, 2, start=7))
    await _until([a, b, c], 8, 4)
    _assert_same(a.model, b.model)
    _assert_same(a.model, c.model)
    assert c.skipped > 0  # the deltas already in the snapshot were not re-applied
    for f in (a, b, c):
        await f.stop()


async def test_sample_rates_follow_dense_deltas_without_restart(settings: Settings, tmp_path: Path) -> None:
    """The correction's rate is the served model's: each dense delta that carries rates replaces
    them (a changed joiner setting reaches serving with the parameters trained under it), one
    without rates keeps them, a snapshot carries them to a replica that bootstraps from it, and
    bad rates are skipped (the dense tensors with them)."""
    feed = DeltaFeed(settings, FMModel(dim=DIM), retry_s=0.2)
    assert feed.model.sample_rates.rate_for("deepfm") == (1.0, "unrecorded")
    feed.start()
    await publish(settings, [dense_delta(0.1, 1, sample_rates={"global": 0.3, "slices": {"deepfm": 0.25}})])
    await _until([feed], 0, 1)
    assert feed.model.sample_rates.rate_for("deepfm") == (0.25, "slice")
    assert feed.model.sample_rates.rate_for("other") == (pytest.approx(0.3), "global")
    await publish(settings, [dense_delta(0.2, 2, sample_rates={"global": 0.5, "slices": {"deepfm": 0.5}})])
    await _until([feed], 0, 2)
    assert feed.model.sample_rates.rate_for("deepfm") == (0.5, "slice")
    await publish(settings, [dense_delta(0.3, 3)])  # no rates: the model's stay
    await _until([feed], 0, 3)
    assert feed.model.sample_rates.rate_for("deepfm") == (0.5, "slice")
    skipped = feed.skipped
    await publish(settings, [dense_delta(0.4, 4, sample_rates={"global": 0.0, "slices": {}}),
                             dense_delta(0.5, 5, sample_rates={"global": 0.5, "slices": {"deepfm": 0.125}})])
    await _until([feed], 0, 5)
    assert feed.skipped == skipped + 1 and feed.model.sample_rates.rate_for("deepfm") == (0.125, "slice")
    snap_dir = tmp_path / "snapshots"
    feed.model.save_snapshot(snap_dir)
    await feed.stop()
    other = DeltaFeed(settings, FMModel(dim=DIM), snapshot_dir=snap_dir, retry_s=0.2)
    other.load_snapshot()
    assert other.model.sample_rates == feed.model.sample_rates
