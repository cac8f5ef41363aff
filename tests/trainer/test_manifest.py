"""trainer.manifest.Manifest reads every manifest written before it and writes the same JSON."""

from __future__ import annotations

import math

from trainer.manifest import Manifest

# as trainer/online.py wrote it (plus the file fields trainer/snapshots.py adds)
ONLINE = {"offsets": {"0": 120, "1": 98}, "topic": "examples", "broker_epoch": None, "from_start": False,
          "sparse_version": 7, "dense_version": 3, "param_deltas_offset": 41, "examples_applied": 2000,
          "max_event_time_ms": 975_000_000_000, "next_snapshot_at": None, "auc": 0.71,
          "sample_rates": {"global": 1.0, "slices": {}}, "source": "online", "format": "driftline-trainer-snapshot/2",
          "seq": 4, "name": "snap-000000004", "model_id": "deepfm", "created_at_ms": 1, "rows": {"item_id": 5},
          "config": {"model_id": "deepfm"}}
# as the ranks' manifest_of (trainer/dist/rank_snapshots.py) and snapshots.commit_ranks wrote it
RANKS = dict(ONLINE, sparse_versions={"0": 6, "1": 7}, shard_count=2, broker_epoch="e1", next_snapshot_at=976)
# as `trainer batch --snapshot` wrote it
BATCH = {"offsets": {}, "sparse_version": 0, "dense_version": 0, "param_deltas_offset": 0, "examples_applied": 0,
         "max_event_time_ms": 5, "source": "batch", "batch_examples": 100, "sample_rates": {}}


def test_stream_manifests_round_trip_to_the_same_json() -> None:
    for raw in (ONLINE, RANKS):
        man = Manifest.from_dict(raw)
        assert man.to_dict() == raw
        assert dict(man) == raw  # read as a mapping: the JSON as written
    man = Manifest.from_dict(RANKS)
    assert man.offsets == {0: 120, 1: 98} and man.sparse_versions == {0: 6, 1: 7} and man.shards == 2


def test_a_batch_manifest_keeps_its_keys_and_gains_the_stream_fields_as_defaults() -> None:
    man = Manifest.from_dict(BATCH)
    assert man.source == "batch" and man.batch_examples == 100 and man.param_deltas_offset == 0 and man.shards == 0
    out = man.to_dict()
    assert {k: out[k] for k in BATCH} == BATCH
    assert out["topic"] is None and out["broker_epoch"] is None and out["from_start"] is False


def test_an_old_manifest_gets_defaults_and_unknown_keys_survive() -> None:
    man = Manifest.from_dict({"offsets": {"3": 9}, "sparse_version": 2, "param_deltas_offset": None, "later": [1]})
    assert man.topic is None and man.offsets_for("examples") == {3: 9}  # no topic recorded: the reader's
    assert man.param_deltas_offset is None  # unrecorded, not 0 (serving tells them apart)
    assert (man.dense_version, man.examples_applied, man.max_event_time_ms, man.sample_rates) == (0, 0, 0, {})
    assert man.broker_epoch is None and man.from_start is False and man.source == "online"
    assert man.to_dict()["later"] == [1]
    assert Manifest.from_dict(dict(ONLINE, topic="other")).offsets_for("examples") == {}


def test_nan_auc_is_written_as_json_writes_it() -> None:
    man = Manifest(auc=float("nan"))
    assert math.isnan(Manifest.from_dict(man.to_dict()).auc)
