"""GBA's online rounds do not wait for a straggler (:mod:`trainer.dist.rounds`): 2 ranks on the real
broker, rank 1 slowed 20x (``trainer.debug_slow_rank = "1:20"``: its steps of 32 examples are
short against a round's poll and RPCs, so 4x barely shows, and under load not at all). The group
stops at half the stream
(``--max-examples``): the fast rank applied more of it than the straggler; a second run drains the
rest, and every example is applied exactly once across the two. Free-running GBA (``fresh_wait``
0): with the fresh pull a rank of this small model waits for the straggler's pushes in its pulls
(its step is short against the RPCs), which is the engine's choice, not the rounds'."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from trainer import snapshots
from trainer.config import deepfm_config
from trainer.data import produce_examples

from .test_ranks import REPO, N, _env, _results


def _spawn_gba(settings, tmp: Path, log: Path, slow: str, max_examples: int | None, mode: str = "gba"):
    cfg = deepfm_config(dim=8, mlp=[32], sequential=False)   # gba: no sequential model
    (tmp / "model.json").write_text(cfg.model_dump_json())
    env = dict(_env(settings, tmp), DRIFTLINE_TRAINER__DIST_MODE=mode, DRIFTLINE_TRAINER__DEBUG_SLOW_RANK=slow,
               # the paper's free-running GBA: the fresh pull (trainer.gba.fresh_wait) makes a rank wait
               # for the others' pushes when its own step is short, whatever the rounds do
               DRIFTLINE_TRAINER__GBA__FRESH_WAIT="0", DRIFTLINE_TRAINER__BATCH_TIMEOUT_S="0.05")
    argv = [sys.executable, "-m", "trainer", "online", "--sync-interval-s", "1", "--snapshot-interval-event-s", "0",
            "--stop-when-idle-s", "3", "--batch-size", "32"]
    if max_examples is not None:
        argv += ["--max-examples", str(max_examples)]
    return subprocess.Popen(argv, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT, cwd=REPO,
                            start_new_session=True)


async def test_with_a_straggler_the_fast_gba_rank_applies_more_and_every_example_once(settings, ml_examples,
                                                                                     tmp_path):
    records = await produce_examples(settings, ml_examples, chunk=16)
    root = settings.var_dir / "snapshots" / "deepfm"
    log = tmp_path / "trainer.log"
    t0 = time.monotonic()
    p = _spawn_gba(settings, tmp_path, log, "1:20", N // 2)
    assert p.wait(timeout=180) == 0, log.read_text()[-4000:]
    first = _results(log)
    assert sorted(first) == [0, 1], log.read_text()[-3000:]
    fast, slow = first[0]["examples_applied"], first[1]["examples_applied"]
    print(f"half the stream in {time.monotonic() - t0:.1f} s: fast rank {fast}, straggler {slow} examples")
    # each rank reads half the partitions: in lockstep both would have applied about N / 4
    assert fast > 1.5 * slow > 0, (fast, slow)
    assert all(r["mode"] == "gba" and r["duplicates"] == 0 and r["bad"] == 0 for r in first.values())
    man = snapshots.read_manifest(root)
    assert man["shard_count"] == 2 and man["examples_applied"] == fast + slow >= N // 2
    log2 = tmp_path / "trainer-2.log"
    p = _spawn_gba(settings, tmp_path, log2, "1:20", None)
    assert p.wait(timeout=240) == 0, log2.read_text()[-4000:]
    res = _results(log2)
    assert sorted(res) == [0, 1], log2.read_text()[-3000:]
    assert sum(r["examples_applied"] for r in res.values()) == N
    assert all(r["duplicates"] == 0 and r["bad"] == 0 for r in res.values())
    man = snapshots.read_manifest(root)
    assert man["shard_count"] == 2 and man["examples_applied"] == N
    assert sum(man["offsets"].values()) == records
