"""Distributed online training: N ranks under torch's elastic launcher, on the real broker.

The snapshot layout alone: tests/trainer/distributed/test_rank_snapshots.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from driftline.stack import APP_SERVICES
from proto import ParameterDelta
from trainer import snapshots
from trainer.config import deepfm_config
from trainer.data import produce_examples
from trainer.dist.rank_trainer import my_partitions
from trainer.sharding import shard_of, whole_tables
from trainer.sync import decode_sparse

N = 8_000
REPO = Path(__file__).parents[3]


def small_cfg(sequential_embeddings: bool = True):
    """The served model, small; ``sequential_embeddings=False``: its embedding tables sharded over
    the ranks (with them, every table is rank 0's: trainer.sharding.whole_tables)."""
    return deepfm_config(dim=8, mlp=[32], sequential_embeddings=sequential_embeddings)


def test_partition_rule():
    assert my_partitions(4, 0, 2) == [0, 2] and my_partitions(4, 1, 2) == [1, 3]
    assert sorted(p for r in range(3) for p in my_partitions(4, r, 3)) == [0, 1, 2, 3]


# ---------------------------------------------------------------------------- ranks on the broker
def _env(settings, tmp: Path) -> dict:
    return dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=settings.bootstrap_servers,
                DRIFTLINE_VAR_DIR=str(settings.var_dir),
                DRIFTLINE_TOPICS__EXAMPLES=settings.topics.examples,
                DRIFTLINE_TOPICS__PARAM_DELTAS=settings.topics.param_deltas,
                DRIFTLINE_TOPICS__DEAD_LETTERS=settings.topics.dead_letters,
                DRIFTLINE_TRAINER__MODEL=str(tmp / "model.json"), DRIFTLINE_METRICS_PORT="0",
                DRIFTLINE_TRAINER__NPROC="2")


def _spawn(settings, tmp: Path, log: Path, snapshot_s: str = "0", idle_s: str = "4",
           mode: str = "sync", staleness: int = 1, cfg=None, nproc: int = 2, cache_rows: int = 0,
           env: dict | None = None) -> subprocess.Popen:
    (tmp / "model.json").write_text((cfg or small_cfg()).model_dump_json())
    return subprocess.Popen([sys.executable, "-m", "trainer", "online", "--sync-interval-s", "1",
                             "--snapshot-interval-event-s", snapshot_s, "--stop-when-idle-s", idle_s,
                             "--batch-size", "512"],
                            env=dict(_env(settings, tmp), DRIFTLINE_TRAINER__DIST_MODE=mode,
                                     DRIFTLINE_TRAINER__STALENESS=str(staleness), DRIFTLINE_TRAINER__NPROC=str(nproc),
                                     DRIFTLINE_TRAINER__CACHE_ROWS=str(cache_rows), **(env or {})),
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, cwd=REPO,
                            start_new_session=True)


def _results(log: Path) -> dict[int, dict]:
    """The last result line of each rank (a restarted group prints again). Ranks print with
    ``python -u`` (a line's text and its newline are two writes) at about the same moment (gba's
    ranks leave RPC's shutdown together), so two results can share a line: each is decoded."""
    out = {}
    dec = json.JSONDecoder()
    for line in log.read_text().splitlines():
        i = 0
        while line.startswith("{", i) and '"rank"' in line:
            r, i = dec.raw_decode(line, i)
            out[r["rank"]] = r
    return out


async def _deltas(settings) -> list[ParameterDelta]:
    from tests.trainer.test_online import read_topic
    out = []
    for raw in await read_topic(settings, settings.topics.param_deltas):
        m = ParameterDelta()
        m.ParseFromString(raw)
        out.append(m)
    return out


async def _manifest(root: Path, examples: int, seq: int, logs, shards: int = 2) -> dict:
    """The first manifest of ``shards`` ranks (0: the 1-process trainer) past ``seq`` with at
    least ``examples`` applied."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        m = snapshots.read_manifest(root)
        if m and int(m.get("shard_count", 0) or 0) == shards and m["seq"] > seq and m["examples_applied"] >= examples:
            return m
        await asyncio.sleep(0.2)
    raise AssertionError(f"no manifest past seq {seq} with {examples} examples\n{logs()}")


# hybrid at staleness 0 (each update queued ahead of the next lookup) is checked in process, equal
# to sync rows and all: tests/trainer/distributed/test_distributed.py; on the broker, the publication and
# snapshot path it shares with staleness 1 is checked here
@pytest.mark.parametrize("mode,staleness,seq_emb", [("sync", 1, False), ("hybrid", 1, False), ("sync", 1, True),
                                                    ("gba", 1, False)],
                         ids=["sync-sharded", "hybrid-sharded", "sync-sequential_embeddings", "gba-sharded"])
async def test_two_ranks_train_the_stream_and_deltas_reproduce_the_union(settings, ml_examples, tmp_path, mode,
                                                                        staleness, seq_emb):
    """Every mode; ``hybrid``'s deferred sparse updates and ``gba``'s buffers are applied before
    each publication and snapshot, so their deltas too reproduce the snapshot's rows exactly. With sequential embeddings
    every row is rank 0's: rank 1's versions carry none."""
    # gba: no sequential model (its first-order pass is a collective of sync's steps)
    cfg = deepfm_config(dim=8, mlp=[32], sequential=False) if mode == "gba" else small_cfg(seq_emb)
    owning = {0} if seq_emb else {0, 1}
    await produce_examples(settings, ml_examples)
    log = tmp_path / "trainer.log"
    p = _spawn(settings, tmp_path, log, mode=mode, staleness=staleness, cfg=cfg)
    assert p.wait(timeout=240) == 0, log.read_text()[-4000:]
    res = _results(log)
    assert sorted(res) == [0, 1], log.read_text()[-3000:]
    assert {r["mode"] for r in res.values()} == {mode}
    # hybrid: the rounds' sparse updates really ran on the lookup thread, behind the next lookup
    assert all((r["overlapped_updates"] > 0) == (mode == "hybrid") for r in res.values())
    assert sum(r["examples_applied"] for r in res.values()) == N
    assert all(r["examples_applied"] > 0 for r in res.values())  # both ranks read partitions
    # driftline_ps_admitted_total counts each rank's shard (compose's Grafana admission panel had no series)
    assert {r for r, x in res.items() if x["ps_admitted"] > 0} == owning, res
    root = settings.var_dir / "snapshots" / "deepfm"
    man = snapshots.read_manifest(root)
    assert man["shard_count"] == 2 and man["examples_applied"] == N
    assert sorted(man["offsets"]) == ["0", "1", "2", "3"]
    tables, dense, _ = snapshots.load(root, cfg, serving=True)
    # replay: per (shard, table) the last value of each key; dense from rank 0 only
    msgs = await _deltas(settings)
    sparse = [m for m in msgs if m.WhichOneof("payload") == "sparse"]
    # every shard makes versions (a rank owning no row confirms its shard with an empty delta)
    assert {m.shard for m in sparse} == {0, 1} and {m.shard_count for m in sparse} == {2}
    assert {m.shard for m in sparse if len(m.sparse.keys)} == owning
    assert {int(v) for v in man["sparse_versions"].values()} == {max(m.version for m in sparse if m.shard == s)
                                                                 for s in (0, 1)}
    rows: dict = {}
    for m in sorted(sparse, key=lambda m: (m.shard, m.version)):
        t, k, v, tomb = decode_sparse(m)
        # a shard publishes its own rows only; the sequential model's first-order tables are rank 0's
        own = np.zeros(k.size, np.int64) if t in whole_tables(cfg) else shard_of(k, 2)
        assert (own == m.shard).all(), t
        for key, val in zip(k.tolist(), v):
            rows[(t, key)] = val
    for name, t in tables.items():
        k, v, _, _ = t.items()
        got = np.stack([rows[(name, key)] for key in k.tolist()]) if k.size else v
        assert np.array_equal(got, v), name
    assert len(rows) == sum(len(t) for t in tables.values())
    dense_msgs = [m for m in msgs if m.WhichOneof("payload") == "dense"]
    assert dense_msgs and {m.shard_count for m in dense_msgs} == {0}


@pytest.mark.parametrize("mode", ["sync", "gba", "sync-cache"])
async def test_kill_9_of_one_rank_restarts_the_group_from_the_last_manifest(settings, ml_examples, tmp_path, mode):
    """gba: the survivor may be waiting on the dead rank's RPC; the launcher restarts both, and the
    examples held in an owner's buffer at the kill are read again (their offsets are past the manifest).
    sync-cache: each owner caches 64 rows a table (trainer.cache_rows; written back before every
    snapshot): every example is applied once across the kill too."""
    mode, cache_rows = ("sync", 64) if mode == "sync-cache" else (mode, 0)
    half = N // 2
    # records of 250 examples: a batch of 512 takes 3, so a first snapshot comes mid-stream
    records = await produce_examples(settings, ml_examples[:half], chunk=250)
    root = settings.var_dir / "snapshots" / "deepfm"
    log = tmp_path / "trainer.log"
    # idle 10 s before stopping: the group is still up when the first snapshot is seen
    p = _spawn(settings, tmp_path, log, snapshot_s="1800", idle_s="10", mode=mode, cache_rows=cache_rows,
               cfg=deepfm_config(dim=8, mlp=[32], sequential=False) if mode == "gba" or cache_rows else None)
    deadline = time.monotonic() + 120
    first = None
    while time.monotonic() < deadline:
        m = snapshots.read_manifest(root)
        if m and m.get("shard_count") == 2 and m["examples_applied"] >= 500:
            first = m
            break
        await asyncio.sleep(0.2)
    assert first is not None, log.read_text()[-3000:]
    ranks = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
    assert len(ranks) >= 2, ranks
    os.kill(int(ranks[-1]), signal.SIGKILL)
    records += await produce_examples(settings, ml_examples[half:], chunk=250)
    assert p.wait(timeout=300) == 0, log.read_text()[-4000:]
    text = log.read_text()
    assert "restored snapshot" in text, text[-3000:]
    # one failure (the kill), one restart: the restarted ranks found each other at once (they read
    # a dead peer's address from the launcher's store before trainer.dist.launch.init_rank separated attempts)
    assert text.count("failed (exitcode") == 1, text[-4000:]
    final = snapshots.read_manifest(root)
    assert final["shard_count"] == 2
    assert final["examples_applied"] == N, (first, final)
    assert sum(r["examples_applied"] for r in _results(log).values()) == N
    assert sum(final["offsets"].values()) == records
    assert final["seq"] > first["seq"]
    # the restarted ranks' owner caches served rows
    assert all((r["cache"] is not None and r["cache"]["hits"] > 0) == bool(cache_rows)
               for r in _results(log).values()), _results(log)


async def test_a_gba_snapshot_restores_into_sync_and_into_one_process(settings, ml_examples, tmp_path):
    """The stream in thirds: 2 GBA ranks, then 2 sync ranks on their snapshot, then the 1-process
    trainer on theirs; every example applied once across the three."""
    cfg = deepfm_config(dim=8, mlp=[32], sequential=False)
    root = settings.var_dir / "snapshots" / "deepfm"
    third = N // 3
    records = 0
    for k, (mode, nproc) in enumerate([("gba", 2), ("sync", 2), ("sync", 1)]):
        part = ml_examples[k * third:(k + 1) * third] if k < 2 else ml_examples[2 * third:]
        records += await produce_examples(settings, part, chunk=250)
        log = tmp_path / f"trainer-{k}.log"
        p = _spawn(settings, tmp_path, log, mode=mode, cfg=cfg, nproc=nproc)
        assert p.wait(timeout=240) == 0, log.read_text()[-4000:]
        text = log.read_text()
        assert k == 0 or "restored snapshot" in text, text[-3000:]
        man = snapshots.read_manifest(root)
        assert man["examples_applied"] == (k + 1) * third if k < 2 else N, (k, man["examples_applied"])
        assert int(man.get("shard_count", 0) or 0) == (2 if nproc == 2 else 0), man.get("shard_count")
    assert sum(man["offsets"].values()) == records


async def test_sigterm_of_the_launcher_stops_every_rank_cleanly(settings, ml_examples, tmp_path):
    """``driftline up``'s supervisor stops the trainer with SIGTERM: every rank applies what it
    has, publishes, writes the last snapshot and commits; the launcher exits 0 within the
    supervisor's wait for the trainer (60 s; a stop took 10.9 s with the whole suite running)."""
    trainer_stop_s = next(a.stop_timeout_s(settings) for a in APP_SERVICES if a.name == "trainer")
    records = await produce_examples(settings, ml_examples[:N // 2])
    log = tmp_path / "trainer.log"
    p = _spawn(settings, tmp_path, log, snapshot_s="1800", idle_s="600")
    root = settings.var_dir / "snapshots" / "deepfm"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not ((m := snapshots.read_manifest(root)) and m.get("shard_count") == 2):
        await asyncio.sleep(0.2)
    await asyncio.sleep(3)  # the rest of the stream is trained by then (it is idle; snapshots are due by event time)
    p.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    assert p.wait(timeout=trainer_stop_s) == 0, log.read_text()[-4000:]
    print(f"stopped in {time.monotonic() - t0:.1f} s")
    man = snapshots.read_manifest(root)
    assert man["shard_count"] == 2 and man["examples_applied"] == N // 2
    assert sum(man["offsets"].values()) == records
    assert sorted(_results(log)) == [0, 1]


async def test_kill_9_of_the_launcher_stops_the_ranks_after_a_last_snapshot(settings, ml_examples, tmp_path):
    """The launcher killed with -9 (``driftline up``'s supervisor then starts a new one): its ranks,
    which nobody would restart, find it gone, write a last snapshot together and exit; the new
    launcher's group resumes from it, and every example is learned once."""
    records = await produce_examples(settings, ml_examples[:N // 2], chunk=250)
    root = settings.var_dir / "snapshots" / "deepfm"
    log = tmp_path / "trainer.log"
    p = _spawn(settings, tmp_path, log, snapshot_s="1800", idle_s="600")
    await _manifest(root, 0, -1, lambda: log.read_text()[-4000:])
    ranks = [int(r) for r in subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()]
    assert len(ranks) >= 2, ranks
    p.kill()
    p.wait()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(Path(f"/proc/{r}").exists() for r in ranks):
        await asyncio.sleep(0.2)
    assert not any(Path(f"/proc/{r}").exists() for r in ranks), log.read_text()[-4000:]
    assert "is gone: stopping the group after a last snapshot" in log.read_text()
    last = snapshots.read_manifest(root)
    assert last["examples_applied"] == sum(r["examples_applied"] for r in _results(log).values())
    records += await produce_examples(settings, ml_examples[N // 2:], chunk=250)
    p = _spawn(settings, tmp_path, log)
    assert p.wait(timeout=240) == 0, log.read_text()[-4000:]
    final = snapshots.read_manifest(root)
    assert final["shard_count"] == 2 and final["examples_applied"] == N
    assert sum(final["offsets"].values()) == records
