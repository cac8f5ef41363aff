"""A model whose configuration changed under the same name (a project file edited: a wider
embedding, another MLP) meets the old configuration's snapshots. Not damage: the trainer says what
differs and how to go on, in one line, and exits ``IN_USE_EXIT`` (not restarted) with the snapshots
untouched. It used to count each as damaged, find none readable and crash-loop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from services.in_use import IN_USE_EXIT
from services.ports import free_port
from serving.model import TrainerModel
from trainer import snapshots
from trainer.config import deepfm_config
from trainer.model import SparseModel
from trainer.snapshot_store import SnapshotsOfAnotherModel, SnapshotStore, check_same_model, restore_blockers

SAVED = deepfm_config(dim=8, mlp=[32])


def test_what_keeps_a_snapshot_from_restoring_into_another_configuration() -> None:
    assert restore_blockers(SAVED, deepfm_config(dim=8, mlp=[32])) == []
    wider = restore_blockers(SAVED, deepfm_config(dim=16, mlp=[32]))
    assert wider[0].startswith("table user_id: dim/slot width/shards 8/") and ", now 16/" in wider[0]
    assert wider[-1].startswith("the dense head's layers")  # (its input is slots x dim)
    assert restore_blockers(SAVED, deepfm_config(dim=8, mlp=[64])) == [
        "the dense head's layers (its slots, dense features, MLP or content encoder changed)"]
    # dense statistics of another space (log and standard: one shape); a snapshot written before
    # dense scaling existed (its config without the key) fed its dense inputs raw
    priced = SAVED.model_copy(update={"dense_features": ["price"]})
    assert restore_blockers(priced, priced.model_copy(update={"dense_scaling": "standard"})) == [
        "dense scaling log, now standard ([model] dense_scaling)"]
    assert restore_blockers(priced.model_copy(update={"dense_scaling": "none"}), priced)[-1] == \
        "dense scaling none, now log ([model] dense_scaling)"
    assert restore_blockers(SAVED, SAVED.model_copy(update={"dense_scaling": "none"})) == []  # (no dense input)
    # rates are how to learn on, not what was learned: a restore takes the configuration's
    # (tests/trainer/test_model.py, test_content.py)
    assert restore_blockers(SAVED, SAVED.model_copy(update={"dense_lr": 0.01, "linear_scale_lr": None})) == []


def test_a_snapshot_from_before_dense_scaling_is_of_another_configuration(tmp_path: Path) -> None:
    priced = SAVED.model_copy(update={"dense_features": ["price"]})
    old = priced.model_copy(update={"dense_scaling": "none"})
    root = tmp_path / old.model_id
    SnapshotStore(root, old, "examples").save(SparseModel(old), {}, {"topic": "examples", "offsets": {}, "examples_applied": 0})
    man = root / snapshots.latest(root).name / "manifest.json"
    data = json.loads(man.read_text())
    del data["config"]["dense_scaling"]  # as such a snapshot was written
    man.write_text(json.dumps(data))
    with pytest.raises(SnapshotsOfAnotherModel, match="dense scaling none, now log"):
        check_same_model(root, priced)
    check_same_model(root, old)  # the old configuration restores it
    # serving reads the snapshot's own configuration as it was meant: raw dense inputs, no scaler
    served = TrainerModel(config=priced)
    assert served.bootstrap(tmp_path) is not None and served.config.dense_scaling == "none"
    assert served.scorer.head.scaler is None
    assert np.isfinite(served.score({}, [{s: [1] for s in old.all_slots}], np.array([[12.5]], np.float32))).all()


@pytest.mark.parametrize("nproc", ["1", "2"], ids=["one-process", "launcher"])
def test_the_trainer_refuses_the_snapshots_of_another_configuration_once(nproc: str, tmp_path: Path,
                                                                         repo_root: Path) -> None:
    """No broker answers here: a trainer that got past the check would fail on Kafka with another
    exit status (and a launcher would first start its ranks)."""
    var = tmp_path / "var"
    root = var / "snapshots" / SAVED.model_id
    m = SparseModel(SAVED)
    snapshots.save(root, SAVED, m.tables, m.dense_state(), {"examples_applied": 500, "source": "online"})
    before = sorted(p.name for p in root.iterdir())
    changed = tmp_path / "model.json"
    changed.write_text(deepfm_config(dim=8, mlp=[64]).model_dump_json())
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRIFTLINE_")}
    env.update(DRIFTLINE_VAR_DIR=str(var), KAFKA_BOOTSTRAP_SERVERS=f"127.0.0.1:{free_port()}",
               DRIFTLINE_METRICS_PORT=str(free_port()), DRIFTLINE_KAFKA__CONNECT_TIMEOUT_S="3")
    done = subprocess.run([sys.executable, "-m", "driftline.cli", "trainer", "online", "--model", str(changed),
                           "--nproc", nproc], env=env, capture_output=True, text=True, timeout=120, cwd=repo_root)
    assert done.returncode == IN_USE_EXIT, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"driftline: the trainer's snapshot directory {root} holds snapshots of another "
                           f"configuration of model '{SAVED.model_id}' (the dense head's layers"), last
    assert "Traceback" not in done.stderr and "unreadable" not in done.stderr
    assert sorted(p.name for p in root.iterdir() if p.name != ".owner") == before
