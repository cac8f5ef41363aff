"""Where the online trainer resumes after a restart: what its snapshots record and how they are used.

(:mod:`trainer.snapshots` is the file format; this is the online trainer's use of it.)

Every ``snapshot_interval_event_s`` of event time (and on a clean stop) a snapshot records tables,
optimizer state, dense params, the next offsets of everything applied, the broker epoch they belong
to, the sync versions, the ``param-deltas`` offset after the last publish, the AUC histograms, the
dedup window and the sample-rate tracker (manifest ``sample_rates``). It is written with no batch in flight, after the touched rows were published.

Crash semantics (kill -9): the restart loads the latest snapshot and *seeks to its offsets*
(committed group offsets are ahead of it and are ignored while a snapshot exists). So:
* nothing is lost: every example after the snapshot is re-consumed (needs topic retention >= T);
* nothing is applied twice to the restored state: the examples re-consumed were applied only to
  the state that died. The work redone is bounded by one snapshot interval T of event time
  (plus one batch), i.e. at most the examples with event time in [snapshot, crash].
* serving may have received deltas from the lost work; the redone training republishes those rows
  with higher versions, so replicas converge. A serving replica restarting from this snapshot
  skips to its ``param_deltas_offset``: deltas of the dead run after it are applied and then
  superseded - a transient, bounded by T as well.
* duplicates from the joiner (at-least-once) are dropped within ``dedup_window`` example ids
  (compared as the shipped 128-bit BLAKE2b ``id_hash``), and the window is saved in the snapshot so
  it survives restarts (a window restored from a snapshot written before example batches holds
  MurmurHash3 hashes: it misses the duplicates of its last window once, see :mod:`trainer.dedup`).
  The window learns a batch's ids only once the batch is applied, so a snapshot never marks as seen
  an example it did not train on.
Without a snapshot the group's committed offsets are used (a fresh model starting from there).

After a broker reset (the snapshots live outside the broker, see :mod:`trainer.online`) the newest
snapshot is restored even if written in another broker epoch, but its offsets are not used: every
partition is read from its start (``from_start``, recorded in the snapshots until every partition
has an offset of the new epoch), and the dedup window drops the examples the snapshot had learned.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from services.atomic import write_bytes_atomic
from services.in_use import DirInUse

from . import metrics as M
from . import snapshots
from .config import ModelConfig
from .head import DenseHead
from .manifest import Manifest
from .model import SparseModel

log = logging.getLogger(__name__)
EPOCH_MARKER = "broker-epoch"  # broker_reset.state_matches_broker's marker file


class SnapshotsOfAnotherModel(DirInUse):
    """The newest snapshot under a root was written by a configuration of the model this one cannot
    restore (:func:`check_same_model`). Not damage: skipping to older snapshots would find the same,
    and training on would lose what they learned; a person decides (the trainer exits with
    :data:`services.in_use.IN_USE_EXIT`, not restarted)."""


def restore_blockers(saved: ModelConfig, cfg: ModelConfig) -> list[str]:
    """What keeps a snapshot written by ``saved`` from restoring into ``cfg`` ([]: nothing): an
    embedding table both have, of another width, or a dense head of other layers. A table added
    since starts empty and one removed is left out, as a restore does; another dense optimizer
    starts fresh (:func:`trainer.head.load_dense_optimizer`)."""
    out = []
    before = {t.name: t for t in saved.tables}
    for t in cfg.tables:
        o = before.get(t.name)
        if o is not None and (o.dim, o.slot_width, o.shards) != (t.dim, t.slot_width, t.shards):
            out.append(f"table {t.name}: dim/slot width/shards {o.dim}/{o.slot_width}/{o.shards}, now "
                       f"{t.dim}/{t.slot_width}/{t.shards}")
    if _head_shapes(saved) != _head_shapes(cfg):
        out.append("the dense head's layers (its slots, dense features, MLP or content encoder changed)")
    if saved.dense_features and saved.dense_scaling != cfg.dense_scaling:  # (log and standard: equal shapes)
        out.append(f"dense scaling {saved.dense_scaling}, now {cfg.dense_scaling} ([model] dense_scaling)")
    return out


def _head_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The head's parameter shapes, but for the first-order factors (a head restores whether they
    were on or not: :class:`trainer.head.DenseHead` starts missing ones at 1)."""
    with torch.random.fork_rng(devices=[]):  # (the head seeds torch's generator as it is built)
        return {k: tuple(v.shape) for k, v in DenseHead(cfg).state_dict().items() if k != "linear_scale"}


def check_same_model(root: Path, cfg: ModelConfig) -> None:
    """Raise :class:`SnapshotsOfAnotherModel` when the newest snapshot under ``root`` (its manifest)
    cannot restore into ``cfg`` (:func:`restore_blockers`): a project file whose model changed
    under the same name. Asked before anything else, since neither a restart nor the snapshots
    before it can help (they are no damage)."""
    manifest = snapshots.latest(root)
    if manifest is None or not manifest.config:
        return
    try:
        saved = manifest.model_config()
    except ValueError:
        return  # (a writer of another version: the restore itself says what it cannot read)
    blockers = restore_blockers(saved, cfg)
    if blockers:
        raise SnapshotsOfAnotherModel(
            f"the trainer's snapshot directory {root} holds snapshots of another configuration of model "
            f"{cfg.model_id!r} ({'; '.join(blockers)}): put that configuration back, or move them aside to "
            "start this one from scratch, or give it its own with trainer.snapshot_dir (DRIFTLINE_TRAINER__SNAPSHOT_DIR)")


@dataclass
class Restored:
    """The newest snapshot, read for a restart."""

    tables: dict
    dense: dict  # head, optimizer (absent in a warm start's), auc_pos/auc_neg, dedup
    manifest: Manifest
    #: it was written in another broker epoch: its offsets are not used
    reset: bool
    offsets: dict[int, int]  # partition -> next offset, where to resume ({}: the group's, or the start)
    from_start: bool  # a partition without an offset starts at its earliest record


def _ranks_stream_state(snap: Path, n: int) -> dict:
    """The stream state of a snapshot written by ``n`` ranks (:mod:`trainer.dist.rank_trainer`), as one process
    keeps it: the ranks' AUC histograms summed, their dedup windows together (each read other
    partitions; the window keeps its newest ``dedup_window`` ids). A 1-process trainer resuming
    from it (N -> 1) then loses neither; the sample rates are the manifest's, merged by rank 0."""
    import numpy as np

    parts = [snapshots.rank_state(snap, r) for r in range(n)]
    return {"auc_pos": sum(p["auc_pos"] for p in parts), "auc_neg": sum(p["auc_neg"] for p in parts),
            "dedup": np.concatenate([np.asarray(p["dedup"], np.uint64).reshape(-1, 2) for p in parts])}


class SnapshotStore:
    """The online trainer's snapshots of one model under ``root`` (``settings.model_snapshots(model_id)``)."""

    def __init__(self, root: Path, cfg: ModelConfig, topic: str):
        self.root, self.cfg, self.topic = root, cfg, topic

    def load(self, epoch: str | None) -> Restored | None:
        """The newest readable snapshot (:func:`trainer.snapshots.newest_readable`: a damaged one is
        skipped for the one before it), whatever broker epoch it was written in (its state lives outside the
        broker). Its offsets only count on the broker data they were read from: after a broker reset
        (``epoch`` differs from the snapshot's) every partition is read from its start instead."""
        skipped = M.SNAPSHOTS_UNREADABLE.labels(self.cfg.model_id)
        got = snapshots.newest_readable(self.root, self._read, lambda _name, _err: skipped.inc())
        if got is None:
            return None
        tables, dense, man = got
        # snapshots written before manifests named their epoch: the marker beside them
        marker = self.root / EPOCH_MARKER
        snap_epoch = man.broker_epoch or (marker.read_text().strip() if marker.exists() else None)
        reset = epoch is not None and snap_epoch is not None and snap_epoch != epoch
        # A `trainer batch --snapshot` warm start has no stream state: no offsets (the group's
        # committed ones, or the earliest, apply), no streaming AUC (the online AUC starts from the
        # stream, not from the batch's training passes) and no dedup window.
        if reset:
            log.warning("the broker's data was reset since snapshot %s (epoch %s, now %s): keeping its "
                        "state, reading every partition of %s from its start", man.name, snap_epoch,
                        epoch, self.topic)
            offsets, from_start = {}, True
        else:
            offsets, from_start = man.offsets_for(self.topic), man.from_start
        return Restored(tables, dense, man, reset, offsets, from_start)

    def _read(self, name: str):
        """Snapshot ``name`` as this process keeps it: N ranks' stream state merged."""
        tables, dense, man = snapshots.load_named(self.root, name, self.cfg, serving=False)
        if man.shards:
            dense = dict(dense, **_ranks_stream_state(self.root / name, man.shards))
        return tables, dense, man

    def save(self, model: SparseModel, dense: dict, manifest: Manifest | Mapping) -> Path:
        """Write a snapshot of ``model`` (tables, :meth:`SparseModel.dense_state`) with more ``dense`` state and the
        ``manifest``'s stream state."""
        dense = {**model.dense_state(), **dense}
        path = snapshots.save(self.root, self.cfg, model.tables, dense, replace(Manifest.from_dict(manifest), source="online"))
        M.SNAPSHOTS.labels(self.cfg.model_id).inc()
        return path

    def record_epoch(self, epoch: str | None) -> None:
        """The broker epoch the trainer's state now follows, beside the snapshots (what ``driftline
        up`` compares with an external broker's before it skips the warm start)."""
        if epoch is not None:
            write_bytes_atomic(self.root / EPOCH_MARKER, epoch.encode())
