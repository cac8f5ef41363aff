"""A snapshot's manifest (``snap-<seq>/manifest.json``), typed: what every writer records and every
reader (the trainers restoring, serving bootstrapping, the tools) reads, one field per key.

Why a class: the keys were string literals spread over the trainers, serving and the tools, each
reader with its own default for a key an older writer left out. Here each key has one type and one
default, and :meth:`Manifest.from_dict` is the one place an old or foreign manifest is read:

* a key missing gets its default (``param_deltas_offset`` stays None: serving tells "unrecorded"
  from offset 0, see :meth:`serving.model.Model.bootstrap`; ``topic`` None: the snapshot's topic is
  unknown, taken as the reader's);
* a key this class does not know is kept in :attr:`Manifest.extra` and written back as it was.

On disk it stays the JSON it was (:meth:`Manifest.to_dict`): offsets and per-shard versions keyed
by strings, the stream fields always present, the fields only some writers record (``shard_count``
and ``sparse_versions`` of N ranks, ``batch_examples`` of a warm start, the file layer's ``seq``,
``name``, ``rows``, ``config`` ...) only when set. As a read-only mapping (``man["seq"]``) it reads
as that JSON, for tools and tests that look at the file as written.

The newest snapshot's manifest under a snapshot root is read here too (:func:`latest`,
:func:`read_manifest`, :func:`learned_online`), with no torch: ``driftline up`` asks whether the
online trainer learned (then the warm start is skipped and the replay resumes after it), and a
root is held for one writer (:func:`own_snapshots`).

>>> m = Manifest.from_dict({"offsets": {"0": 5}, "sparse_version": 3, "source": "online", "future_key": 1})
>>> m.offsets, m.sparse_version, m.dense_version, m.param_deltas_offset, m.extra
({0: 5}, 3, 0, None, {'future_key': 1})
>>> d = m.to_dict(); d["offsets"], d["future_key"], "shard_count" in d
({'0': 5}, 1, False)
>>> Manifest.from_dict(d) == m, m["offsets"]
(True, {'0': 5})
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.in_use import OwnedDir, own_dir

if TYPE_CHECKING:
    from trainer.config import ModelConfig

log = logging.getLogger(__name__)

#: the fields written even when None (every stream writer recorded them, null or not)
_ALWAYS = ("offsets", "topic", "broker_epoch", "from_start", "sparse_version", "dense_version", "param_deltas_offset",
           "examples_applied", "max_event_time_ms", "next_snapshot_at", "auc", "sample_rates", "source")


@dataclass
class Manifest(Mapping):
    """One snapshot's manifest. The stream state (offsets, versions, clocks) is the trainer's; the
    file fields (``format`` .. ``config``) are filled in by :mod:`trainer.snapshots` when it writes."""

    #: partition -> next offset of ``topic`` to read (everything before it is in the snapshot)
    offsets: dict[int, int] = field(default_factory=dict)
    topic: str | None = None  # None: unknown (written before manifests named it): the reader's
    broker_epoch: str | None = None  # the broker epoch the offsets belong to (None: no epochs)
    from_start: bool = False  # a partition without an offset starts at its earliest record
    sparse_version: int = 0  # the newest sparse version included (N ranks: the max of sparse_versions)
    dense_version: int = 0
    #: where serving resumes ``param-deltas`` (None: unrecorded, an old or foreign writer)
    param_deltas_offset: int | None = None
    examples_applied: int = 0
    max_event_time_ms: int = 0
    next_snapshot_at: int | None = None  # the event time the next snapshot falls due at (EventClock)
    auc: float | None = None  # the streaming AUC when written
    sample_rates: dict = field(default_factory=dict)  # a SampleRateTracker state ({}: none recorded)
    source: str = "online"  # "online" (a trainer's stream) or "batch" (a warm start)
    #: N ranks: shard -> that shard's newest sparse version
    sparse_versions: dict[int, int] | None = None
    shard_count: int | None = None  # N ranks wrote it (None: one process)
    batch_examples: int | None = None  # a warm start's examples
    # written by the file layer (trainer.snapshots)
    format: str | None = None
    seq: int | None = None
    name: str | None = None
    model_id: str | None = None
    created_at_ms: int | None = None
    rows: dict[str, int] | None = None
    config: dict | None = None
    #: keys this class does not know, kept as they were
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping) -> Manifest:
        """Read a manifest as written by any version (missing keys: their defaults)."""
        if isinstance(d, Manifest):
            return d
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kw: dict[str, Any] = {k: v for k, v in d.items() if k in known}
        kw["offsets"] = {int(k): int(v) for k, v in (d.get("offsets") or {}).items()}
        if d.get("sparse_versions") is not None:
            kw["sparse_versions"] = {int(k): int(v) for k, v in d["sparse_versions"].items()}
        for k in ("sparse_version", "dense_version", "examples_applied", "max_event_time_ms"):
            kw[k] = int(d.get(k, 0) or 0)
        if d.get("param_deltas_offset") is not None:
            kw["param_deltas_offset"] = int(d["param_deltas_offset"])
        kw["from_start"] = bool(d.get("from_start", False))
        kw["sample_rates"] = dict(d.get("sample_rates") or {})
        if d.get("shard_count") is not None:
            kw["shard_count"] = int(d["shard_count"])
        return cls(**kw, extra={k: v for k, v in d.items() if k not in known})

    def to_dict(self) -> dict:
        """The JSON the manifest is written as (offsets and shards keyed by strings)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "extra" or (v is None and f.name not in _ALWAYS):
                continue
            if f.name in ("offsets", "sparse_versions"):
                v = {str(k): int(x) for k, x in v.items()}
            out[f.name] = v
        out.update(self.extra)
        return out

    @property
    def shards(self) -> int:
        """How many ranks wrote the snapshot (0: one process)."""
        return int(self.shard_count or 0)

    def model_config(self) -> ModelConfig:
        """The model the snapshot was written with (``config``), read as its writer meant it: one
        written before dense scaling existed fed its dense inputs raw (``dense_scaling`` "none").

        >>> from trainer.config import deepfm_config
        >>> old = deepfm_config().model_dump(exclude={"dense_scaling"})  # (a writer without the key)
        >>> Manifest(config=old).model_config().dense_scaling, Manifest(config=deepfm_config().model_dump()).model_config().dense_scaling
        ('none', 'log')
        """
        from trainer.config import ModelConfig  # (lazy: reading a manifest needs no model)

        return ModelConfig.model_validate({"dense_scaling": "none", **(self.config or {})})

    def offsets_for(self, topic: str) -> dict[int, int]:
        """The offsets to resume ``topic`` at ({} when the snapshot read another topic)."""
        return dict(self.offsets) if (self.topic or topic) == topic else {}

    # a read-only mapping: the JSON as written
    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())


def learned_online(root: Path) -> Manifest | None:
    """The manifest of the newest snapshot under ``root`` when the online trainer learned into it
    (``examples_applied`` > 0; a warm start's batch snapshot has 0), else None. Such a snapshot is
    never replaced by a warm start (``driftline up``, ``trainer batch --unless-learned``)."""
    manifest = latest(root)
    return manifest if manifest is not None and manifest.examples_applied > 0 else None


def read_manifest(root: Path) -> dict | None:
    """The newest snapshot's manifest as the JSON written (for tools and tests reading the file;
    code reads :func:`latest`'s typed one)."""
    pointer = Path(root) / "LATEST"
    if not pointer.exists():
        return None
    return json.loads((Path(root) / pointer.read_text().strip() / "manifest.json").read_text())


def candidates(root: Path) -> list[str]:
    """The snapshots to restore from, newest first: the one ``LATEST`` names, then the older ones
    still kept (those newer than it were never pointed at); [] when there is none."""
    pointer = Path(root) / "LATEST"
    if not pointer.exists():
        return []
    head = pointer.read_text().strip()
    return [head, *sorted((p.name for p in Path(root).glob("snap-*") if p.is_dir() and p.name < head), reverse=True)]


def manifest_of(root: Path, name: str) -> Manifest:
    """Snapshot ``name``'s manifest."""
    return Manifest.from_dict(json.loads((Path(root) / name / "manifest.json").read_text()))


def latest(root: Path) -> Manifest | None:
    """The manifest of the newest snapshot under ``root`` whose manifest reads, or None when there
    is none. A newest one whose manifest is damaged or gone is skipped for the one before, as the
    trainer's restore skips it (:func:`trainer.snapshots.newest_readable`): ``driftline up`` must
    neither stop on it nor take a root the online trainer learned into for a warm start's."""
    for name in candidates(root):
        try:
            return manifest_of(root, name)
        except (OSError, ValueError) as err:
            log.warning("snapshot %s under %s has no readable manifest (%s): looking at the one before", name, root, err)
    return None


def own_snapshots(root: Path) -> OwnedDir:
    """Hold a model's snapshot root for this process alone (:func:`services.in_use.own_dir`):
    snapshots have one writer, the one-process trainer or ``trainer batch --snapshot``, and ``up``
    clears a root only while it holds it. (A set of ranks writes its shards from every rank, on
    every machine of a shared root: not held.)"""
    return own_dir(root, "the trainer's snapshot directory", "trainer.snapshot_dir")
