"""Where the ranks of :mod:`trainer.dist.rank_trainer` resume, and what their snapshots record.

(:mod:`trainer.snapshots` is the file format, N-rank layout included; :mod:`trainer.snapshot_store` the
1-process trainer's use of it; this the ranks'.) Kept apart from the rank loop so that the loop
reads as the round it runs.

A rank's part of a snapshot (:func:`rank_part`) is its own stream state: its partitions' next
offsets, dedup window, AUC histograms, sample-rate sums and examples applied. Rank 0 gathers every
rank's summary and writes the manifest (:func:`manifest_of`): the union of the offsets, the
per-shard sparse versions (``sparse_versions``; ``sparse_version`` their max), the smallest
``param_deltas_offset`` (where serving resumes: every shard's deltas after its snapshot version lie
after it), the summed examples and AUC, the merged sample rates.

Restoring (:func:`load`) from a snapshot of as many ranks gives each rank its own part back
(bit-identical rows); from one of another number of ranks (or of the 1-process trainer), rows are
resharded by :func:`trainer.snapshots.load_rank`, every rank takes the offsets of its partitions
from the manifest's union and every window of ids seen, and rank 0 takes the global counts (the
examples applied, the AUC, the sample rates), so sums over ranks continue. A snapshot written in
another broker epoch (the broker's data was reset since, see :mod:`trainer.online`) is restored
whole but its offsets are not used: every partition is read from its start (``reset``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ps import SnapshotError

from .. import metrics as M
from .. import snapshots
from ..config import ModelConfig
from ..manifest import Manifest
from ..sample_rates import SampleRateTracker

log = logging.getLogger(__name__)


@dataclass
class RankRestored:
    """One rank's state, read from the latest complete snapshot."""

    tables: dict          # this rank's shard, one local shard per table
    dense: dict           # head, optimizer
    manifest: Manifest
    offsets: dict[int, int]   # partition -> next offset (of the partitions this snapshot names)
    sparse_version: int       # this rank's shard's last version
    dedup: object             # a DedupWindow state (or a list of example ids, old snapshots)
    auc: tuple | None         # (pos, neg) histograms, or None: start empty
    sample_rates: dict        # a SampleRateTracker state ({}: empty)
    examples_applied: int
    reset: bool = False       # written in another broker epoch: its offsets were dropped
    #: this rank's log loss sums and counting baseline (Learned.scores_state) when as many ranks
    #: wrote the snapshot; None (another world size: each rank's counts were of other partitions) starts them afresh
    scores: dict | None = None


def merged_rates(states: list[dict], half_life: float) -> SampleRateTracker:
    """One tracker holding the sums of every rank's (the rate of all ranks' negatives: each rank's
    sums decayed by its own negatives, an approximation of one tracker over the merged stream that
    is exact while the rates are constant).

    >>> a, b = SampleRateTracker(1e9), SampleRateTracker(1e9)
    >>> a.update(None, (), np.array([0.1, 0.1]), np.array([0.0, 0.0]))  # 2 negatives of 20
    >>> b.update(None, (), np.array([0.5]), np.array([0.0]))            # 1 of 2
    >>> round(merged_rates([a.state(), b.state()], 1e9).rates()["global"], 4)  # 3 of 22
    0.1364
    """
    out = SampleRateTracker(half_life)
    g = np.zeros(2)
    slices: dict[str, np.ndarray] = {}
    for st in states:
        sums = st.get("sums", {"global": [0.0, 0.0], "slices": {}})
        g += np.array(sums["global"], np.float64)
        for s, v in sums["slices"].items():
            slices[s] = slices.get(s, np.zeros(2)) + np.array(v, np.float64)
    out.load({"sums": {"global": g.tolist(), "slices": {s: v.tolist() for s, v in slices.items()}}})
    return out


def _rank_states(root: Path, name: str, shards: int) -> list[dict]:
    """Every rank's own state of an N-rank snapshot ([] for a 1-process one)."""
    return [snapshots.rank_state(Path(root) / name, r) for r in range(shards)]


def load(root: Path, cfg: ModelConfig, topic: str, rank: int, world: int, name: str,
         epoch: str | None = None) -> RankRestored:
    """Rank ``rank`` of ``world``'s state from snapshot ``name`` (``epoch``: the broker's now, None:
    unknown); raises what a damaged one does (:data:`trainer.snapshots.UNREADABLE`)."""
    got = snapshots.load_rank(root, cfg, rank, world, name)
    out = _load(root, name, topic, rank, got)
    snap_epoch = out.manifest.broker_epoch
    if epoch is not None and snap_epoch is not None and snap_epoch != epoch:
        out.offsets, out.reset = {}, True
    return out


def newest_every_rank_reads(root: Path, cfg: ModelConfig, topic: str, rank: int, world: int,
                            epoch: str | None) -> RankRestored | None:
    """Rank ``rank``'s state from the newest snapshot every rank reads its part of
    (:func:`trainer.snapshots.newest_readable`'s rule, agreed: a part damaged on one rank makes
    every rank take the one before it), or None when there is none. Collective (rank 0's list of
    snapshots, then one gather of the ranks' errors per snapshot tried)."""
    names: list = [snapshots.candidates(root) if rank == 0 else None]
    dist.broadcast_object_list(names, 0)
    errors: list[str] = []
    for name in names[0]:
        got, err = None, None
        try:
            got = load(root, cfg, topic, rank, world, name, epoch)
        except snapshots.UNREADABLE as e:
            err = f"rank {rank}: {type(e).__name__}: {e}"
        every: list = [None] * world
        dist.all_gather_object(every, err)
        failed = [e for e in every if e is not None]
        if not failed:
            if errors and rank == 0:
                log.warning("restoring snapshot %s: the newer ones were unreadable: %s", name, errors)
            return got
        if rank == 0:
            M.SNAPSHOTS_UNREADABLE.labels(cfg.model_id).inc()
            log.error("snapshot %s under %s is unreadable (%s): trying the one before it", name, root, failed)
        errors += [f"{name}: {e}" for e in failed]
    if errors:
        raise SnapshotError(f"no snapshot under {root} is readable by every rank: " + "; ".join(errors))
    return None


def _load(root: Path, name: str, topic: str, rank: int, got: tuple) -> RankRestored:
    tables, dense, man, state = got
    versions = dict(man.sparse_versions or {})
    same_topic = (man.topic or topic) == topic
    if state is not None:  # written by as many ranks: this rank's own part
        return RankRestored(tables, dense, man, dict(state["offsets"]) if same_topic else {},
                            versions.get(rank, 0), state["dedup"], (state["auc_pos"], state["auc_neg"]),
                            state["sample_rates"], int(state["examples_applied"]), scores=state.get("scores"))
    offsets = man.offsets_for(topic)
    parts = _rank_states(root, name, man.shards)
    # every rank's window (bounded by the window's size when loaded): a partition may have moved here
    windows = [p["dedup"] for p in parts] if parts else [dense.get("dedup", [])]
    arrays = [w.reshape(-1, 2) for w in windows if isinstance(w, np.ndarray)]
    window = np.concatenate(arrays) if arrays else windows[0]
    auc, rates, applied = None, {}, 0
    if rank == 0:
        applied = man.examples_applied
        if parts:
            auc = (sum(p["auc_pos"] for p in parts), sum(p["auc_neg"] for p in parts))
        elif "auc_pos" in dense:
            auc = (dense["auc_pos"], dense["auc_neg"])
        rates = man.sample_rates
    # a new (shard_count, shard) stream of versions: start above every version written before
    version = max([man.sparse_version, *versions.values()])
    return RankRestored(tables, dense, man, offsets, version, window, auc, rates, applied)


def rank_part(offsets: dict[int, int], dedup_state, auc: M.StreamingAUC, rates: SampleRateTracker,
              examples_applied: int, scores: dict | None = None) -> dict:
    """What a rank writes of its own into a snapshot (``state.pt``)."""
    return {"offsets": dict(offsets), "dedup": dedup_state, "auc_pos": auc.pos, "auc_neg": auc.neg,
            "sample_rates": rates.state(), "examples_applied": examples_applied, "scores": scores}


def summary(part: dict, sparse_version: int, param_deltas_offset: int, tables: dict) -> dict:
    """A rank's part as rank 0 needs it for the manifest (gathered: no dedup window)."""
    return {"offsets": part["offsets"], "sparse_version": sparse_version, "param_deltas_offset": param_deltas_offset,
            "examples_applied": part["examples_applied"], "rows": {n: len(t) for n, t in tables.items()},
            "sample_rates": part["sample_rates"], "auc_pos": part["auc_pos"], "auc_neg": part["auc_neg"]}


def manifest_of(parts: list[dict], base: Manifest, *, half_life: float) -> tuple[Manifest, dict]:
    """Rank 0's manifest and rows per table from every rank's :func:`summary`: ``base`` (rank 0's
    stream fields: topic, epoch, dense version, clocks) with the ranks' offsets, versions, counts,
    AUC and sample rates merged in."""
    auc = M.StreamingAUC()
    auc.load(sum(p["auc_pos"] for p in parts), sum(p["auc_neg"] for p in parts))
    versions = {r: int(p["sparse_version"]) for r, p in enumerate(parts)}
    man = replace(base, offsets={int(k): int(v) for p in parts for k, v in p["offsets"].items()}, from_start=False,
                  sparse_version=max(versions.values()), sparse_versions=versions,
                  param_deltas_offset=min(int(p["param_deltas_offset"]) for p in parts),
                  examples_applied=sum(int(p["examples_applied"]) for p in parts), auc=auc.value(), source="online",
                  sample_rates=merged_rates([p["sample_rates"] for p in parts], half_life).state())
    rows = {n: sum(int(p["rows"][n]) for p in parts) for n in parts[0]["rows"]}
    return man, rows
