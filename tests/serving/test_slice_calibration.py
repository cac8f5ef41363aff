"""A model trained with per-slice negative sample rates is calibrated per slice at serving.

Two slices (the serving model_ids that served the impressions) with different true CTRs and
different joiner keep rates for negatives (0.1 and 0.5), told apart by their features (disjoint
user ids). The examples are subsampled as the joiner does and learned by a real ``SparseModel``
with the trainer's :class:`trainer.sample_rates.SampleRateTracker` fed per batch as
``OnlineTrainer._apply`` feeds it. Serving's own path then supplies the rates: the snapshot
manifest ``trainer batch --snapshot`` writes (``write_batch_snapshot``) bootstraps a
``TrainerModel``, a dense delta from ``trainer.sync.encode_dense`` updates it, and each slice's
score is ``serving.correction.correct(raw, model.sample_rates.rate_for(slice)[0])``: what ``/rank``
computes for a replica serving that slice.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from serving.correction import correct
from serving.model import TrainerModel
from trainer.__main__ import write_batch_snapshot
from trainer.batch import SparseBatch
from trainer.config import lr_config
from trainer.model import SparseModel
from trainer.sample_rates import SampleRateTracker
from trainer.sync import encode_dense

SLICES = {"a": dict(users=range(0, 200), ctr_logit=-3.0, rate=0.1),   # ~5% CTR, 10% of negatives kept
          "b": dict(users=range(1000, 1200), ctr_logit=-1.4, rate=0.5)}  # ~20% CTR, half kept
ITEMS = 50
PER_SLICE = 100_000


def _impressions(rng: np.random.Generator):
    """Every impression before sampling: ``(slice code, user, item, label)`` and each slice's
    user/item effects' true click probabilities."""
    item_eff = rng.normal(scale=0.5, size=ITEMS)
    out = []
    for code, spec in enumerate(SLICES.values()):
        users = np.array(spec["users"])
        user_eff = dict(zip(users.tolist(), rng.normal(scale=0.5, size=users.size)))
        u = rng.choice(users, PER_SLICE)
        i = rng.integers(0, ITEMS, PER_SLICE)
        z = spec["ctr_logit"] + np.vectorize(user_eff.get)(u) + item_eff[i]
        y = (rng.random(PER_SLICE) < 1 / (1 + np.exp(-z))).astype(np.float32)
        out.append((np.full(PER_SLICE, code, np.int32), u, i, y))
    return [np.concatenate(c) for c in zip(*out)]


def _sampled(rng: np.random.Generator, code, u, i, y):
    """The joiner's sampling: every positive (rate 1.0), negatives kept at their slice's rate."""
    rate = np.array([s["rate"] for s in SLICES.values()], np.float32)[code]
    keep = (y == 1) | (rng.random(y.size) < rate)
    return code[keep], u[keep], i[keep], y[keep], np.where(y == 1, 1.0, rate)[keep].astype(np.float32)


def _batches(rng: np.random.Generator, code, u, i, y, rate, size: int = 1024):
    order = rng.permutation(y.size)
    for a in range(0, y.size, size):
        r = order[a:a + size]
        n = r.size
        ar = np.arange(n + 1, dtype=np.int64)
        yield SparseBatch(n, {"user_id": u[r].astype(np.int64), "item_id": i[r].astype(np.int64)},
                          {"user_id": ar, "item_id": ar.copy()}, y[r], np.full(n, 1_700_000_000_000, np.int64),
                          rate[r], slice_ids=code[r], slice_names=tuple(SLICES))


def _mean_ctr(model: TrainerModel, rate: float, u: np.ndarray, i: np.ndarray) -> float:
    """Mean corrected score over a slice's impressions, scored as /rank scores: one user, all items."""
    total = 0.0
    for user in np.unique(u):
        items = i[u == user]
        raw = model.score({"user_id": [int(user)]}, [{"item_id": [int(x)]} for x in range(ITEMS)])
        total += float(correct(raw, rate)[items].sum())
    return total / u.size


def test_per_slice_rates_calibrate_each_slice_at_serving(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    code, u, i, y = _impressions(rng)
    cfg = lr_config(model_id="ranker", lr=0.2, slots=("user_id", "item_id"), recent_items=False)
    model = SparseModel(cfg)
    sampled = _sampled(rng, code, u, i, y)
    for _ in range(4):
        tracker = SampleRateTracker(half_life=50_000)  # the last pass's, as `trainer batch` records
        for b in _batches(rng, *sampled):
            model.train_step(b)
            tracker.update(b.slice_ids, b.slice_names, b.sample_rate, b.labels)
    rates = tracker.rates()
    assert rates["slices"] == pytest.approx({"a": 0.1, "b": 0.5}, rel=1e-6)

    # serving: bootstrap from the manifest, then a dense delta with the rates (as the trainer sends)
    write_batch_snapshot(model, 1_700_000_000_000, int(sampled[0].size), root=tmp_path, sample_rates=tracker)
    served = TrainerModel(config=cfg)
    assert served.bootstrap(tmp_path) is not None
    got = served.sample_rates.as_dict()
    assert got["global"] == pytest.approx(rates["global"]) and got["slices"] == pytest.approx(rates["slices"])
    served.apply_delta(encode_dense(cfg.model_id, 1, model.head, sample_rates=rates))
    assert served.sample_rates.rate_for("a") == (pytest.approx(0.1), "slice")

    for code_, name in enumerate(SLICES):
        mask = code == code_
        observed = float(y[mask].mean())  # the true CTR, before sampling
        rate, source = served.sample_rates.rate_for(name)
        assert source == "slice"
        predicted = _mean_ctr(served, rate, u[mask], i[mask])
        assert abs(predicted / observed - 1) < 0.05, (name, predicted, observed)
        # the copied joiner default (0.25) misses both slices, and so does the pooled rate
        for wrong in (0.25, served.sample_rates.global_rate):
            assert abs(_mean_ctr(served, wrong, u[mask], i[mask]) / observed - 1) > 0.15, (name, wrong)
