"""A damaged newest snapshot (a disk's error, a file cut short outside the atomic write, a
directory gone) restores the one before it instead of failing every restart
(:func:`trainer.snapshots.newest_readable`); the next snapshot is numbered past every directory
there. The trainer on the real broker, and the ranks' agreement: the tests at the end."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ps import SnapshotError
from trainer import snapshots
from trainer.config import deepfm_config
from trainer.data import MovieLensData, produce_examples
from trainer.model import SparseModel

REPO = Path(__file__).resolve().parents[2]


def small_cfg():
    return deepfm_config(dim=8, mlp=[32])


def _three_snapshots(root: Path):
    """Snapshots 1-3 of a model learning 1000, 2000, 3000 examples, offsets to match."""
    cfg = small_cfg()
    m = SparseModel(cfg)
    d = MovieLensData(limit=3000)
    for k in range(3):
        m.train_step(d.batch(np.arange(k * 1000, (k + 1) * 1000)))
        snapshots.save(root, cfg, m.tables, m.dense_state(), {"offsets": {"0": (k + 1) * 1000}, "examples_applied": (k + 1) * 1000})
    return cfg


def damage(snap: Path, how: str) -> None:
    """What a disk or an operator does to a snapshot directory."""
    if how == "table_bit":  # a bit flipped in a table's data: its checksum fails
        f = max((p for p in snap.rglob("*.bin")), key=lambda p: p.stat().st_size)
        b = bytearray(f.read_bytes())
        b[len(b) // 2] ^= 1
        f.write_bytes(bytes(b))
    elif how == "dense_cut":
        f = snap / "dense.pt"
        os.truncate(f, f.stat().st_size // 2)
    elif how == "manifest_garbage":
        (snap / "manifest.json").write_text("{\"seq\": ")
    elif how == "gone":
        shutil.rmtree(snap)
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["table_bit", "dense_cut", "manifest_garbage", "gone"])
def test_a_damaged_newest_snapshot_restores_the_one_before_it(tmp_path, caplog, how):
    cfg = _three_snapshots(tmp_path)
    assert snapshots.candidates(tmp_path) == ["snap-000000003", "snap-000000002", "snap-000000001"]
    damage(tmp_path / "snap-000000003", how)
    skipped = []

    def read(name: str):
        return snapshots.load_named(tmp_path, name, cfg, serving=False)

    with caplog.at_level(logging.ERROR, "trainer.snapshots"):
        tables, dense, man = snapshots.newest_readable(tmp_path, read, lambda name, err: skipped.append(name))
    assert man.seq == 2 and man.offsets == {0: 2000} and man.examples_applied == 2000
    assert skipped == ["snap-000000003"] and "snap-000000003" in caplog.text and "unreadable" in caplog.text
    assert snapshots.load(tmp_path, cfg, serving=False)[2].seq == 2
    assert len(tables["item_id"]) > 0 and "head" in dense
    _, _, served = snapshots.load_latest(tmp_path)  # serving's catch-up takes the same one
    assert served.seq == 2


@pytest.mark.parametrize("how", ["manifest_garbage", "gone"])
def test_what_up_asks_of_a_root_skips_a_newest_snapshot_without_a_manifest(tmp_path, how):
    """``driftline up`` asks, with no torch, whether the online trainer learned into the root
    (then it keeps it instead of a warm start): a newest snapshot whose manifest is damaged or gone
    is passed over for the one before, as a restore does. It used to stop ``up`` with a traceback."""
    _three_snapshots(tmp_path)
    damage(tmp_path / "snap-000000003", how)
    learned = snapshots.learned_online(tmp_path)
    assert learned is not None and learned.seq == 2 and learned.examples_applied == 2000


def test_every_snapshot_damaged_raises_naming_each(tmp_path):
    cfg = _three_snapshots(tmp_path)
    for seq, how in ((3, "table_bit"), (2, "dense_cut"), (1, "manifest_garbage")):
        damage(tmp_path / f"snap-{seq:09d}", how)
    with pytest.raises(SnapshotError, match="no snapshot under .* is readable") as e:
        snapshots.load(tmp_path, cfg, serving=False)
    assert all(f"snap-{s:09d}" in str(e.value) for s in (1, 2, 3))
    assert snapshots.load(tmp_path / "none", cfg) is None  # no snapshot at all: none, as before


def test_the_next_snapshot_is_numbered_past_every_directory(tmp_path):
    """Past a damaged newest one that a restore skipped, and past one a crash moved into place
    before ``LATEST`` named it: written over, either would fail (a directory not empty) on every
    restart."""
    cfg = _three_snapshots(tmp_path)
    shutil.copytree(tmp_path / "snap-000000003", tmp_path / "snap-000000004")  # never pointed at
    m = json.loads((tmp_path / "snap-000000004" / "manifest.json").read_text())
    (tmp_path / "snap-000000004" / "manifest.json").write_text(json.dumps(dict(m, seq=4, name="snap-000000004")))
    assert snapshots.candidates(tmp_path)[0] == "snap-000000003"  # LATEST's: 4 was never in force
    tables, dense, _ = snapshots.load(tmp_path, cfg, serving=False)
    path = snapshots.save(tmp_path, cfg, tables, dense, {"offsets": {"0": 3000}})
    assert path.name == "snap-000000005" and snapshots.latest(tmp_path).seq == 5


# ---------------------------------------------------------------------------- the trainer
async def test_the_trainer_restarts_from_the_snapshot_before_a_damaged_one(settings, tmp_path):
    """``trainer online`` stops after learning half the stream (a snapshot at the stop); its newest
    snapshot is damaged; restarted with the other half on the topic, it restores the one before
    (the error logged), reads the stream again from that one's offsets and ends
    with every example applied once (the final manifest's count and offsets)."""
    n = 4000
    examples = MovieLensData(limit=n).examples()
    (tmp_path / "model.json").write_text(small_cfg().model_dump_json())
    env = dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=settings.bootstrap_servers, DRIFTLINE_VAR_DIR=str(settings.var_dir),
               DRIFTLINE_TOPICS__EXAMPLES=settings.topics.examples, DRIFTLINE_TOPICS__PARAM_DELTAS=settings.topics.param_deltas,
               DRIFTLINE_TOPICS__DEAD_LETTERS=settings.topics.dead_letters, DRIFTLINE_TRAINER__MODEL=str(tmp_path / "model.json"),
               DRIFTLINE_METRICS_PORT="0")
    log = tmp_path / "trainer.log"
    cmd = [sys.executable, "-m", "trainer", "online", "--sync-interval-s", "1", "--snapshot-interval-event-s", "86400",
           "--stop-when-idle-s", "3", "--batch-size", "256"]
    root = settings.var_dir / "snapshots" / "deepfm"
    records = 0
    for part in (examples[: n // 4], examples[n // 4: n // 2]):  # two runs: two snapshots at least
        records += await produce_examples(settings, part)
        p = await asyncio.to_thread(subprocess.run, cmd, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                                    cwd=REPO, timeout=180)
        assert p.returncode == 0, log.read_text()[-3000:]
    newest = snapshots.read_manifest(root)
    assert newest["examples_applied"] == n // 2 and len(snapshots.candidates(root)) >= 2, newest
    before = snapshots.manifest_of(root, snapshots.candidates(root)[1])
    assert before.examples_applied < n // 2
    damage(root / newest["name"], "table_bit")
    records += await produce_examples(settings, examples[n // 2:])
    p = await asyncio.to_thread(subprocess.run, cmd, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                                cwd=REPO, timeout=180)
    text = log.read_text()
    assert p.returncode == 0, text[-3000:]
    assert f"snapshot {newest['name']} under" in text and "unreadable" in text, text[-3000:]
    assert f"restored snapshot {before.name}" in text, text[-3000:]
    final = snapshots.read_manifest(root)
    assert final["seq"] > newest["seq"] and final["examples_applied"] == n, final
    assert sum(final["offsets"].values()) == records
