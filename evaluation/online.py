"""Monolith's Algorithm 1 on ml-1m, and the stale-snapshot restore (fault tolerance).

Per seed:

1. **batch**: a :class:`trainer.model.SparseModel` trains on the first ``online_batch_fraction``
   of ratings in time order, then writes a real trainer snapshot (:func:`trainer.snapshots.save`:
   PS tables with optimizer state, dense head and optimizer).
2. **batch-only**: a serving :class:`trainer.inference.Scorer` bootstrapped from that snapshot
   (:func:`trainer.snapshots.load_latest`) scores the rest of the stream, never updated.
3. **online, N shards**: the trainer is restored from the snapshot (:func:`trainer.snapshots.load`,
   ``serving=False``) and a separate serving Scorer is bootstrapped from it. The rest of the stream
   is cut into N chronological shards; for each: **sync** (every touched row drained by
   :func:`trainer.sync.encode_sparse_tables`, serialized to ``ParameterDelta`` bytes, parsed back,
   grouped by :func:`trainer.sync.complete_versions` and applied to the serving tables with
   :func:`trainer.sync.apply_delta`; the dense head through ``encode_dense`` -> bytes ->
   ``decode_dense`` -> ``Scorer.load_dense``), **evaluate** the Scorer on the shard, then **train**
   on it. After the last shard one more sync, and the Scorer must score exactly like the trainer
   (``sync_max_abs_diff``).
4. **staleness**: in a run with ``stale_shards`` shards, the trainer "dies" before shard
   ``f = N // 2``; it restores the snapshot it took before shard ``f - k`` (the updates of shards
   ``f - k .. f - 1`` are lost, not replayed, as in the paper's argument), serving re-bootstraps
   from the same snapshot, and online training goes on from shard ``f``. The AUC lost is the
   mean per-shard AUC over shards ``f ..`` against the run without failure.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from proto import ParameterDelta
from trainer import snapshots
from trainer.inference import Scorer
from trainer.manifest import Manifest
from trainer.model import SparseModel
from trainer.sync import apply_delta, complete_versions, decode_dense, encode_dense, encode_sparse_tables

from .common import EvalSettings, auc, data, mean_std, model_config, pmap, predict_rows, train_rows

MODEL_ID = "online"


def stream(s: EvalSettings):
    """``(data, batch rows, online rows)`` in time order."""
    d = data(s, s.online_limit)
    cut = int(len(d) * s.online_batch_fraction)
    return d, np.arange(cut), np.arange(cut, len(d))


def _manifest(version: int, max_t: int) -> Manifest:
    return Manifest(sparse_version=version, dense_version=version, param_deltas_offset=0, max_event_time_ms=max_t)


def _save(root: Path, model: SparseModel, version: int, max_t: int) -> Path:
    return snapshots.save(root, model.cfg, model.tables,
                          model.dense_state(),
                          _manifest(version, max_t), keep=1)


def _restore(s: EvalSettings, seed: int, root: Path) -> tuple[SparseModel, Scorer, Manifest]:
    """Trainer restored from a snapshot (tables with optimizer state, head, dense optimizer) and a
    serving Scorer bootstrapped from the same snapshot."""
    cfg = model_config(s, seed, MODEL_ID)
    tables, dense, manifest = snapshots.load(root, cfg, serving=False)
    model = SparseModel(cfg, tables)
    model.load_dense_state(dense)
    serve_tables, head_state, _ = snapshots.load_latest(root)
    return model, Scorer(cfg, serve_tables, head_state), manifest


def batch_phase(s: EvalSettings, seed: int, work: Path) -> dict:
    """Batch-train on the first part, snapshot it, and score the rest with the frozen model."""
    d, brows, orows = stream(s)
    model = SparseModel(model_config(s, seed, MODEL_ID))
    secs = 0.0
    for _ in range(s.online_batch_epochs):
        _, dt = train_rows(model, d, brows, s.batch_size)
        secs += dt
    root = work / f"seed{seed}" / "batch"
    _save(root, model, 0, int(d.time_ms[brows[-1]]))
    tables, head_state, _ = snapshots.load_latest(root)
    scorer = Scorer(model.cfg, tables, head_state)
    scores = predict_rows(scorer.predict, d, orows)
    return {"seed": seed, "snapshot": str(root), "scores": scores, "batch_ex_per_s": brows.size * s.online_batch_epochs / secs}


class _Sync:
    """Trainer -> serving through serialized ParameterDelta messages."""

    def __init__(self, model: SparseModel, scorer: Scorer, version: int):
        self.model, self.scorer, self.version = model, scorer, version
        self.bytes = self.rows = self.messages = 0

    def __call__(self, max_t: int) -> dict:
        self.version += 1
        wire = [m.SerializeToString() for _, m in
                encode_sparse_tables(MODEL_ID, self.version, self.model.tables, max_event_time_ms=max_t)]
        dense_wire = encode_dense(MODEL_ID, self.version, self.model.head, max_event_time_ms=max_t).SerializeToString()
        n_bytes, n_rows = sum(map(len, wire)) + len(dense_wire), 0
        for version in complete_versions(ParameterDelta.FromString(w) for w in wire):
            for msg in version:
                apply_delta(self.scorer.tables, msg)
                n_rows += len(msg.sparse.keys) // 8
        self.scorer.load_dense(decode_dense(ParameterDelta.FromString(dense_wire)))
        self.bytes += n_bytes
        self.rows += n_rows
        self.messages += len(wire) + 1
        return {"bytes": n_bytes, "rows": n_rows}


def online_run(s: EvalSettings, seed: int, n_shards: int, snap: Path, start: int = 0,
               save_before: dict[int, Path] | None = None) -> dict:
    """Algorithm 1 over shards ``start ..`` of the online part, from snapshot ``snap``."""
    d, _, orows = stream(s)
    shards = np.array_split(orows, n_shards)
    model, scorer, manifest = _restore(s, seed, snap)
    sync = _Sync(model, scorer, manifest.sparse_version)
    aucs, sync_rows = [float("nan")] * n_shards, [0] * n_shards
    scores = np.full(orows.size, np.nan, np.float32)
    base = int(orows[0]) if orows.size else 0
    train_s = n_train = 0.0
    max_t = manifest.max_event_time_ms
    for i in range(start, n_shards):
        rows = shards[i]
        if save_before and i in save_before:
            _save(save_before[i], model, sync.version, max_t)
        sync_rows[i] = sync(max_t)["rows"]
        p = predict_rows(scorer.predict, d, rows)
        scores[rows - base] = p
        aucs[i] = auc(p, d.label[rows])
        _, dt = train_rows(model, d, rows, s.batch_size)
        train_s += dt
        n_train += rows.size
        max_t = int(d.time_ms[rows[-1]]) if rows.size else max_t
    sync(max_t)
    probe = shards[-1][:4096]
    diff = float(np.abs(predict_rows(scorer.predict, d, probe) - predict_rows(model.predict, d, probe)).max()) if probe.size else 0.0
    return {"seed": seed, "N": n_shards, "start": start, "shard_auc": aucs, "scores": scores,
            "sync_rows": sync_rows, "sync_bytes": sync.bytes, "sync_messages": sync.messages,
            "sync_max_abs_diff": diff, "train_ex_per_s": n_train / train_s if train_s else float("nan")}


def shard_aucs(scores: np.ndarray, labels: np.ndarray, n_shards: int) -> list[float]:
    idx = np.array_split(np.arange(scores.size), n_shards)
    return [auc(scores[i], labels[i]) for i in idx]


def _batch_all(s: EvalSettings, work: Path) -> dict[int, dict]:
    """The batch phase per seed, once per (settings, work dir) in this process."""
    key = (s, str(work))
    cache = _BATCH_CACHE.setdefault(key, {})
    todo = [seed for seed in s.seeds if seed not in cache]
    for r in pmap(batch_phase, [(s, seed, work) for seed in todo], s.workers, "online: batch phase"):
        cache[r["seed"]] = r
    return {seed: cache[seed] for seed in s.seeds}


_BATCH_CACHE: dict[tuple, dict[int, dict]] = {}


def run(s: EvalSettings, work: Path) -> dict:
    d, brows, orows = stream(s)
    labels = d.label[orows]
    batch = _batch_all(s, work)
    tasks = [(s, seed, n, Path(batch[seed]["snapshot"])) for n in s.online_shards for seed in s.seeds]
    runs = pmap(online_run, tasks, s.workers, "online: Algorithm 1")
    out: dict = {"setup": {"ratings": len(d), "batch_part": int(brows.size), "online_part": int(orows.size),
                           "batch_epochs": s.online_batch_epochs, "seeds": list(s.seeds),
                           "online_new_user_share": float(np.isin(d.user_id[orows], d.user_id[brows], invert=True).mean()),
                           "online_span_days": float((d.time_ms[orows[-1]] - d.time_ms[orows[0]]) / 86_400_000) if orows.size else 0.0,
                           "batch_ex_per_s": float(np.mean([b["batch_ex_per_s"] for b in batch.values()]))}}
    bo_by_n = {}
    for n in s.online_shards:
        per_seed = [shard_aucs(batch[seed]["scores"], labels, n) for seed in s.seeds]
        bo_by_n[n] = per_seed
    # batch-only: the paper's "average AUC" per setting is the mean of per-shard AUCs
    bo_avg = {n: [float(np.nanmean(a)) for a in v] for n, v in bo_by_n.items()}
    allavg = [float(np.mean([bo_avg[n][i] for n in s.online_shards])) for i in range(len(s.seeds))]
    m, sd = mean_std(allavg)
    out["batch_only"] = {"auc_mean": m, "auc_std": sd,
                         "by_N": {f"N{n}": dict(zip(("auc_mean", "auc_std"), mean_std(bo_avg[n]))) for n in s.online_shards},
                         "pooled_auc": dict(zip(("mean", "std"), mean_std(auc(batch[seed]["scores"], labels) for seed in s.seeds)))}
    for n in s.online_shards:
        rs = [r for r in runs if r["N"] == n]
        avg = [float(np.nanmean(r["shard_auc"])) for r in rs]
        m, sd = mean_std(avg)
        gain = [a - b for a, b in zip(avg, bo_avg[n])]
        gm, gsd = mean_std(gain)
        out[f"N{n}"] = {"auc_mean": m, "auc_std": sd, "gain_vs_batch_only_mean": gm, "gain_vs_batch_only_std": gsd,
                        "pooled_auc": dict(zip(("mean", "std"), mean_std(auc(r["scores"], labels) for r in rs))),
                        "shard_auc_mean": np.nanmean([r["shard_auc"] for r in rs], 0).tolist(),
                        "batch_only_shard_auc_mean": np.nanmean(bo_by_n[n], 0).tolist(),
                        "sync_bytes_per_shard": float(np.mean([r["sync_bytes"] for r in rs])) / (n + 1),
                        "sync_rows_per_shard": float(np.mean([np.mean(r["sync_rows"][1:]) if n > 1 else 0 for r in rs])),
                        "sync_max_abs_diff": float(max(r["sync_max_abs_diff"] for r in rs)),
                        "train_ex_per_s": float(np.mean([r["train_ex_per_s"] for r in rs]))}
    means = [out[f"N{n}"]["auc_mean"] for n in sorted(s.online_shards)]
    out["checks"] = {"online_beats_batch_only_every_N": bool(all(out[f"N{n}"]["auc_mean"] > out["batch_only"]["by_N"][f"N{n}"]["auc_mean"]
                                                                  for n in s.online_shards)),
                     "auc_rises_as_interval_shrinks": bool(all(a <= b for a, b in zip(means, means[1:])))}
    return out


# -------------------------------------------------------------------------------- staleness

def stale_baseline(s: EvalSettings, seed: int, snap: Path, work: Path) -> dict:
    n, f = s.stale_shards, s.stale_shards // 2
    saves = {f - k: work / f"seed{seed}" / f"stale-k{k}" for k in s.stale_k if 0 <= f - k}
    r = online_run(s, seed, n, snap, save_before=saves)
    r.pop("scores")
    return r


def stale_failure(s: EvalSettings, seed: int, k: int, work: Path) -> dict:
    f = s.stale_shards // 2
    r = online_run(s, seed, s.stale_shards, work / f"seed{seed}" / f"stale-k{k}", start=f)
    r.pop("scores")
    r["k"] = k
    return r


def run_staleness(s: EvalSettings, work: Path) -> dict:
    warnings.filterwarnings("ignore", message="Mean of empty slice")
    batch = _batch_all(s, work)
    n, f = s.stale_shards, s.stale_shards // 2
    ks = [k for k in s.stale_k if 0 <= f - k]
    base = pmap(stale_baseline, [(s, seed, Path(batch[seed]["snapshot"]), work) for seed in s.seeds],
                s.workers, "staleness: no failure")
    fails = pmap(stale_failure, [(s, seed, k, work) for k in ks for seed in s.seeds], s.workers, "staleness: restore")
    ok = {r["seed"]: float(np.nanmean(r["shard_auc"][f:])) for r in base}
    out: dict = {"setup": {"N": n, "failure_before_shard": f, "k": ks, "seeds": list(s.seeds),
                           "lost_updates_replayed": False, "serving_rebootstrapped_from_snapshot": True},
                 "no_failure": {"auc_mean_after_failure": mean_std(ok.values())[0],
                                "shard_auc_mean": np.nanmean([r["shard_auc"] for r in base], 0).tolist()}}
    for k in ks:
        rs = [r for r in fails if r["k"] == k]
        after = [float(np.nanmean(r["shard_auc"][f:])) for r in rs]
        lost = [ok[r["seed"]] - a for r, a in zip(rs, after)]
        first = [ok_s - a for ok_s, a in zip([base_r["shard_auc"][f] for base_r in sorted(base, key=lambda x: x["seed"])],
                                               [r["shard_auc"][f] for r in sorted(rs, key=lambda x: x["seed"])])]
        lm, lsd = mean_std(lost)
        fm, fsd = mean_std(first)
        out[f"k{k}"] = {"auc_mean_after_failure": mean_std(after)[0], "auc_lost_mean": lm, "auc_lost_std": lsd,
                        "first_shard_auc_lost_mean": fm, "first_shard_auc_lost_std": fsd,
                        "shard_auc_mean": np.nanmean([[np.nan] * f + r["shard_auc"][f:] for r in rs], 0).tolist()}
    return out
