"""Shared pieces: the evaluation settings (smoke / full: ``services.settings.EvalSettings``), data, seeded model configs, train / score loops,
MD5 id hashing, AUC and a small process pool with a progress bar."""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import trainer  # noqa: F401  (before torch: OMP_WAIT_POLICY)

# isort: split
import numpy as np
import torch
from tqdm import tqdm

from services.settings import EvalSettings, get_settings
from trainer.batch import SparseBatch
from trainer.config import ModelConfig, deepfm_config, floored
from trainer.data import MovieLensData
from trainer.metrics import auc as _auc
from trainer.model import SparseModel


def full() -> EvalSettings:
    """The settings docs/results.* come from: ``settings.eval`` (``DRIFTLINE_EVAL__*`` overrides)."""
    return get_settings().eval


def smoke() -> EvalSettings:
    """Tiny settings for the tests (seconds): same code paths, same JSON keys."""
    return EvalSettings(name="smoke", seeds=(0, 1), workers=1, dim=4, mlp=(16,), batch_size=512,
                    coll_limit=20_000, coll_epochs=2, coll_seeds=None, coll_dim=4, coll_mlp=(16,), online_limit=20_000, stale_shards=10,
                    stale_k=(0, 2), base_limit=6_000, base_batch_size=256, hashed_buckets=1 << 10,
                    base_lr_batch=64, base_lr_curve=((64, 0.3), (256, 0.3)), base_lr_seq_batch=256,
                    tune_base_limit=3_000, base_other_limit=5_000)


# ---------------------------------------------------------------------------------------- data

_DATA: dict[tuple, MovieLensData] = {}


def data(s: EvalSettings, limit: int | None = None, offset: int = 0, content: bool = False) -> MovieLensData:
    """ml-1m ratings (time order) with their features, from the dataset cache
    (``settings.data_dir``); cached per process. ``content``: with the items' content tokens."""
    key = (s.dataset, get_settings().data_dir, limit, offset, content)
    if key not in _DATA:
        _DATA[key] = MovieLensData(s.dataset, Path(key[1]), limit=limit, offset=offset, content=content)
    return _DATA[key]


def model_config(s: EvalSettings, seed: int, model_id: str = "eval") -> ModelConfig:
    """:func:`trainer.config.deepfm_config` with ``seed`` in the dense head's and every table's
    initializer (the trainer's default fixes the table seed to 1), on the 8 MovieLens slots: the
    real-time ``recent_items`` slot is absent from ml-1m, so it stays out of the experiments. The
    paper's experiments compare tables, not update orders: every table steps once per batch at
    ``sparse_lr``, plain Adagrad (no initial accumulator), and every first-order field counts 1 (the
    served model's sequential first-order part, with its initial accumulators and learned factors,
    is :func:`served_model_config`)."""
    return deepfm_config(model_id=model_id, dim=s.dim, mlp=list(s.mlp), lr=s.sparse_lr, seed=seed,
                         recent_items=False, sequential=False, linear_lr=s.sparse_lr, linear_acc=0.0,
                         linear_scale_lr=None, acc=0.0)


def served_model_config(s: EvalSettings, seed: int, model_id: str = "served", size: tuple | None = None) -> ModelConfig:
    """The model ``make up`` serves (:func:`trainer.config.deepfm_config`'s defaults: sequential
    first-order weights and embeddings, its dim and MLP) with ``seed``, on the 8 MovieLens slots and the stream's (tuned) learning
    rates ``base_sparse_lr`` (embeddings) and ``base_linear_lr`` (first-order weights); ``size``: another
    ``(dim, MLP)`` (``driftline eval tune`` compares them)."""
    shape = {} if size is None else {"dim": size[0], "mlp": list(size[1])}
    return deepfm_config(model_id=model_id, lr=s.base_sparse_lr, seed=seed, recent_items=False,
                         linear_lr=s.base_linear_lr, **shape)


def served_batch() -> int:
    """The served model's mini-batch in the experiments: the live trainer's (``trainer.batch_size``)."""
    return get_settings().trainer.batch_size


def init_model_config(seed: int, model_id: str = "init") -> ModelConfig:
    """The model a new project gets from ``driftline init`` (the template's ``[model]`` and
    ``[tables.default]``, read from the template itself: dim, MLP, ``sequential``, the tables' and
    the first-order tables' optimizers) over the 8 MovieLens slots, with ``seed``."""
    import tomllib

    from driftline.project import ModelSpec
    from driftline.project_template import TEMPLATE

    t = tomllib.loads(TEMPLATE)
    m, default = ModelSpec.model_validate(t["model"]), t["tables"]["default"]["optimizer"]
    d = deepfm_config(model_id=model_id, dim=m.dim, mlp=m.mlp, seed=seed, recent_items=False,
                      sequential=m.sequential, sequential_embeddings=m.sequential_embeddings,
                      **({} if m.linear_scale else {"linear_scale_lr": None})).model_dump()
    linear = m.linear_optimizer.model_dump() if m.linear_optimizer is not None else default
    for tab in d["tables"]:
        tab["optimizer"] = dict(linear) if tab["dim"] == 1 else floored(default, d["sequential_embeddings"])
    return ModelConfig.model_validate(d)


def coll_model_config(s: EvalSettings, seed: int, model_id: str = "coll") -> ModelConfig:
    """The collisions DeepFM: :func:`trainer.config.deepfm_config` on ``coll_slots`` with the
    ``coll_*`` hyper-parameters (Adagrad ``initial_accumulator_value`` and the dense lr are not
    arguments of ``deepfm_config``, so they are set on its validated dump)."""
    cfg = deepfm_config(model_id=model_id, dim=s.coll_dim, mlp=list(s.coll_mlp), lr=s.coll_sparse_lr, seed=seed,
                        slots=tuple(s.coll_slots), recent_items=False, sequential=False, linear_lr=s.coll_sparse_lr,
                        linear_scale_lr=None)
    d = cfg.model_dump()
    for t in d["tables"]:
        t["optimizer"]["initial_accumulator_value"] = s.coll_init_acc
    d["dense_lr"] = s.coll_dense_lr
    return ModelConfig.model_validate(d)


def set_threads(n: int = 1) -> None:
    torch.set_num_threads(n)


# -------------------------------------------------------------------------------- id hashing

def md5_bucket(values: np.ndarray, buckets: int) -> np.ndarray:
    """``int(md5(str(id))) mod buckets`` per id (the paper's MD5 hashing of ids)."""
    return np.fromiter((int.from_bytes(hashlib.md5(str(int(v)).encode()).digest()[:8], "little") % buckets
                        for v in values), np.int64, len(values))


def collision_rate(ids: np.ndarray, buckets: int) -> dict:
    """Of the distinct ``ids``: the fraction that share their MD5 bucket with another id
    (``colliding``), and ``1 - buckets used / ids`` (``ids_lost``)."""
    ids = np.unique(ids)
    b = md5_bucket(ids, buckets)
    _, inv, counts = np.unique(b, return_inverse=True, return_counts=True)
    return {"ids": int(ids.size), "buckets": int(buckets), "colliding": float((counts[inv] > 1).mean()),
            "ids_lost": float(1 - counts.size / ids.size)}


def buckets_for_rate(ids: np.ndarray, target: float, tries: int = 400) -> dict:
    """The hash space whose measured ``colliding`` rate over ``ids`` is closest to ``target``
    (scanning around the birthday estimate ``n / target``)."""
    ids = np.unique(ids)
    est = max(2.0, ids.size / max(target, 1e-6))
    best = None
    for m in np.unique(np.geomspace(est / 1.6, est * 1.6, tries).astype(np.int64)):
        r = collision_rate(ids, int(m))
        if best is None or abs(r["colliding"] - target) < abs(best["colliding"] - target):
            best = r
    return dict(best, target=target)


class HashedIds:
    """Maps the raw ids of some slots through MD5 into ``buckets[slot]`` buckets (vectorized
    with a lookup table over the raw id range). Other slots pass through unchanged.

    With ``present`` (slot -> the ids that occur in the data), each bucket is *labelled* by the
    smallest present id in it instead of by its bucket number. Which ids share a row is exactly the
    same (it is the same hashing), but an id alone in its bucket then keeps its own row key, so the
    PS initializer (a function of seed and key) gives it the very row the collisionless model
    starts from: a hashed run differs from its paired collisionless run only in the ids that
    collide, not in the random start of every row."""

    def __init__(self, buckets: dict[str, int], max_ids: dict[str, int],
                 present: dict[str, np.ndarray] | None = None):
        self.buckets = dict(buckets)
        self.lut = {}
        for s, m in buckets.items():
            b = md5_bucket(np.arange(max_ids[s] + 1), m)
            if present is None:
                self.lut[s] = b
                continue
            ids = np.unique(present[s])
            label = np.full(m, np.iinfo(np.int64).max, np.int64)
            np.minimum.at(label, b[ids], ids)
            empty = label == np.iinfo(np.int64).max
            # buckets no present id falls in: keys above every raw id (never seen in the data)
            label[empty] = np.flatnonzero(empty) + max_ids[s] + 1
            self.lut[s] = label[b]

    def __call__(self, b: SparseBatch) -> SparseBatch:
        ids = dict(b.ids)
        for s, lut in self.lut.items():
            ids[s] = lut[ids[s]]
        return SparseBatch(b.size, ids, b.offsets, b.labels, b.event_time_ms, b.sample_rate, b.dense,
                           b.example_ids, b.meta, b.slice_ids, b.slice_names)


# ------------------------------------------------------------------------------ train / score

def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """AUC (trainer.metrics.auc: 65,536-bin histogram, exact to the bin width); NaN for one class."""
    labels = np.asarray(labels)
    if labels.size == 0 or labels.min() == labels.max():
        return float("nan")
    return _auc(scores, labels)


def train_rows(model: SparseModel, d: MovieLensData, rows: np.ndarray, batch_size: int,
               transform: Callable[[SparseBatch], SparseBatch] | None = None) -> tuple[np.ndarray, float]:
    """Train on ``rows`` in the given order; returns (progressive-validation scores, seconds)."""
    out = np.empty(rows.size, np.float32)
    t0 = time.perf_counter()
    for a in range(0, rows.size, batch_size):
        b = d.batch(rows[a:a + batch_size])
        if transform is not None:
            b = transform(b)
        _, p = model.train_step(b)
        out[a:a + b.size] = p
    return out, time.perf_counter() - t0


def predict_rows(predict: Callable[[SparseBatch], np.ndarray], d: MovieLensData, rows: np.ndarray,
                 batch_size: int = 8192, transform: Callable[[SparseBatch], SparseBatch] | None = None) -> np.ndarray:
    out = np.empty(rows.size, np.float32)
    for a in range(0, rows.size, batch_size):
        b = d.batch(rows[a:a + batch_size])
        if transform is not None:
            b = transform(b)
        out[a:a + b.size] = predict(b)
    return out


def mean_std(xs: Iterable[float]) -> tuple[float, float]:
    a = np.asarray(list(xs), np.float64)
    a = a[~np.isnan(a)]
    if a.size == 0:
        return float("nan"), float("nan")
    return float(a.mean()), float(a.std(ddof=1)) if a.size > 1 else 0.0


# ------------------------------------------------------------------------------------ pool

def _init_worker(threads: int) -> None:
    set_threads(threads)


def pmap(fn: Callable, tasks: Sequence[tuple], workers: int, desc: str) -> list:
    """``[fn(*t) for t in tasks]`` on ``workers`` spawned processes (1 torch thread each: on this
    machine two 1-thread processes train ~1.5x faster than one 2-thread process), in order, with
    a progress bar. ``workers <= 1`` runs in this process."""
    out: list = [None] * len(tasks)
    bar = tqdm(total=len(tasks), desc=desc, unit="run", dynamic_ncols=True,
               disable=os.environ.get("DRIFTLINE_EVAL_NO_PROGRESS") == "1")
    try:
        if workers <= 1 or len(tasks) <= 1:
            for i, t in enumerate(tasks):
                out[i] = fn(*t)
                bar.update()
            return out
        import multiprocessing as mp
        with ProcessPoolExecutor(min(workers, len(tasks)), mp_context=mp.get_context("spawn"),
                                 initializer=_init_worker, initargs=(1,)) as ex:
            futs = {ex.submit(fn, *t): i for i, t in enumerate(tasks)}
            for f in as_completed(futs):
                out[futs[f]] = f.result()
                bar.update()
        return out
    finally:
        bar.close()


def nan_to_none(x):
    """JSON-safe: NaN/inf -> None, numpy scalars -> Python, recursively."""
    if isinstance(x, dict):
        return {k: nan_to_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [nan_to_none(v) for v in x]
    if isinstance(x, np.ndarray):
        return nan_to_none(x.tolist())
    if isinstance(x, (np.floating, float)):
        x = float(x)
        return None if math.isnan(x) or math.isinf(x) else x
    if isinstance(x, np.integer):
        return int(x)
    return x


__all__ = ["EvalSettings", "full", "smoke", "data", "model_config", "served_model_config", "served_batch", "init_model_config", "coll_model_config", "md5_bucket",
           "collision_rate", "buckets_for_rate", "HashedIds", "auc", "train_rows", "predict_rows",
           "mean_std", "pmap", "nan_to_none", "set_threads"]
