"""Switching the online ranks between sync and gba (issue 34 item 2, :mod:`trainer.dist.mode_switch`):
the decision rule alone (no torch), and 2 ranks on the real broker with ``dist_mode = "auto"`` and a
straggler that comes and goes: sync -> gba -> sync in one run, every example applied once."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

from aiokafka import TopicPartition

from services.tansu_quirks import committed_offsets
from trainer import snapshots
from trainer.config import deepfm_config
from trainer.data import produce_examples
from trainer.dist.mode_switch import AutoSwitch, FileMode, straggling

from .test_ranks import REPO, N, _env, _results


# ---------------------------------------------------------------------------- the rule
def test_a_straggler_is_the_slowest_rank_over_ratio_x_the_others_median():
    assert straggling([10, 25], 2.0) and not straggling([10, 19], 2.0)   # 2 ranks: against the other
    assert straggling([10, 11, 12, 40], 3.0) and not straggling([10, 11, 18, 20], 2.0)
    assert straggling([0, 40], 2.0) is None     # a rank with nothing to learn: no evidence
    assert straggling([40], 2.0) is None


def test_auto_switches_on_the_median_work_of_the_last_switch_after_s():
    a = AutoSwitch(2.0, after_s=5.0)
    slow, even, idle = [10, 50], [10, 11], [0, 50]
    assert [a.observe(t, "sync", slow) for t in (0.0, 4.9)] == [None, None]   # not 5 s of rounds yet
    assert a.observe(5.0, "sync", idle) is None           # no evidence: not even a round
    assert a.observe(5.5, "sync", even) is None           # 3 rounds: 2 slow, 1 even; but not 5 s ...
    assert a.observe(6.0, "sync", slow) == "gba"          # ... now: the medians are slow
    # in gba: a fresh window; one slow round among even ones flips nothing, most even ones do
    got = [a.observe(t, "gba", slow if t == 8.0 else even) for t in (7.0, 8.0, 9.0, 11.0, 12.0)]
    assert got == [None, None, None, None, "sync"]
    # a slow round in 2 of 5: not enough to leave sync
    b = AutoSwitch(2.0, after_s=2.0)
    assert {b.observe(t * 0.5, "sync", slow if t % 5 in (1, 3) else even) for t in range(40)} == {None}
    # the ranks feed it the same agreed numbers, so they decide alike: replay one sequence twice
    seq = [(t * 0.5, slow if 10 <= t < 30 else even) for t in range(60)]
    runs = []
    for _ in range(2):
        c, mode, switched = AutoSwitch(2.0, 3.0), "sync", []
        for t, w in seq:
            if (to := c.observe(t, mode, w)) is not None:
                mode = to
                switched.append((t, to))
        runs.append(switched)
    assert runs[0] == runs[1] and [to for _, to in runs[0]] == ["gba", "sync"], runs
    assert 5.0 <= runs[0][0][0] < 15.0 <= runs[0][1][0], runs   # while slow (5-15 s), then after


def test_the_project_files_mode_counts_when_it_changes(tmp_path: Path):
    f = tmp_path / "driftline.toml"
    head = 'name = "shop"\n[[features]]\nname = "item"\nsource = "item"\n[settings.trainer]\n'
    f.write_text(head + 'dist_mode = "sync"\n')
    m = FileMode(f)
    assert m.changed() is None                    # as at the start: the environment's mode stands
    f.write_text(head + 'dist_mode = "gba"\n')
    assert m.changed() == "gba" and m.changed() is None
    assert FileMode(None).changed() is None


# ---------------------------------------------------------------------------- on the broker
def _spawn_auto(settings, tmp: Path, log: Path, slow: str, after_s: float) -> subprocess.Popen:
    cfg = deepfm_config(dim=8, mlp=[32], sequential=False)   # gba: no sequential model
    (tmp / "model.json").write_text(cfg.model_dump_json())
    env = dict(_env(settings, tmp), DRIFTLINE_TRAINER__DIST_MODE="auto", DRIFTLINE_TRAINER__DEBUG_SLOW_RANK=slow,
               DRIFTLINE_TRAINER__GBA__SWITCH_AFTER_S=str(after_s), DRIFTLINE_TRAINER__GBA__STRAGGLER_RATIO="2.0",
               # a rank out of examples waits this long for them each round: the other one's last rounds
               DRIFTLINE_TRAINER__BATCH_TIMEOUT_S="0.05")
    # never stopped by idleness: the test stops it once it learned every record (the second half of
    # the stream is produced while the ranks wait for it; under a fresh-clone run's load that took
    # over 3 s, and once over 9 s: a group stopping after 10 idle seconds had learned half)
    return subprocess.Popen([sys.executable, "-m", "trainer", "online", "--sync-interval-s", "1",
                             "--snapshot-interval-event-s", "0", "--stop-when-idle-s", "600", "--batch-size", "32"],
                            env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)


async def test_auto_switches_sync_gba_sync_with_a_straggler_that_comes_and_goes(settings, ml_examples, tmp_path):
    """Rank 0 slowed 5x in its steps 10-24 (batches of 32, records of 16): the group switches to
    gba while it straggles and back to sync after, both ranks in the same round; every example is
    applied exactly once (the ranks' counts, no duplicate, the final manifest's count and offsets).
    In gba the rounds do not wait (trainer.dist.rounds): the fast rank runs ahead, and the
    recovered straggler must still have batches to show its speed. So half the stream is there at
    the start and the other half is produced once the group is in gba and the straggler's slowed
    steps are over. The fast rank drains its share of that half in a round or two: the rounds after
    judge its speed as last measured (a fresh-clone run, which sent 0 for it, stayed in gba)."""
    first = N // 2
    records = await produce_examples(settings, ml_examples[:first], chunk=16)
    log = tmp_path / "trainer.log"
    t0 = time.monotonic()
    p = _spawn_auto(settings, tmp_path, log, "0:5:10-25", 0.2)
    # the rest arrives once the group is in gba and the straggler has recovered, so both ranks
    # have batches then, however far the other ran ahead meanwhile
    deadline = time.monotonic() + 150
    while p.poll() is None and time.monotonic() < deadline:
        text = log.read_text()
        if "dist_mode sync -> gba" in text and "the slowed steps are over" in text:
            break
        await asyncio.sleep(0.05)
    records += await produce_examples(settings, ml_examples[first:], chunk=16)
    tps = [TopicPartition(settings.topics.examples, i) for i in range(settings.topics.partitions)]
    deadline = time.monotonic() + 180
    while sum(max(0, o) for o in (await committed_offsets(settings, settings.trainer.group_id, tps)).values()) < records:
        assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        await asyncio.sleep(0.5)
    p.send_signal(signal.SIGTERM)  # (learned and committed: a clean stop writes the last manifest)
    assert p.wait(timeout=120) == 0, log.read_text()[-4000:]
    print(f"ran in {time.monotonic() - t0:.1f} s")
    res = _results(log)
    assert sorted(res) == [0, 1], log.read_text()[-3000:]
    for r in res.values():
        # to gba while it straggles and back after; later switches are the rule at work too: with
        # the cores oversubscribed (a fresh-clone run, two busy loops beside the test) a rank's work
        # read 2x the other's for the 0.2 s window once more, and the group may end in either mode
        tos = [s["to"] for s in r["switches"]]
        assert tos[:2] == ["gba", "sync"] and all(a != b for a, b in zip(tos, tos[1:])), \
            (r["switches"], log.read_text()[-3000:])
        assert r["dist_mode"] == "auto" and r["mode"] == tos[-1], r
    assert res[0]["switches"] == [dict(s, at_s=res[0]["switches"][i]["at_s"]) for i, s in enumerate(res[1]["switches"])]
    text = log.read_text()
    tos = [s["to"] for s in res[0]["switches"]]  # (each rank logs each switch)
    assert text.count("dist_mode sync -> gba") == 2 * tos.count("gba"), text[-3000:]
    assert text.count("dist_mode gba -> sync") == 2 * tos.count("sync"), text[-3000:]
    assert sum(r["examples_applied"] for r in res.values()) == N
    assert all(r["duplicates"] == 0 and r["bad"] == 0 for r in res.values())
    man = snapshots.read_manifest(settings.var_dir / "snapshots" / "deepfm")
    assert man["shard_count"] == 2 and man["examples_applied"] == N
    assert sum(man["offsets"].values()) == records


async def test_a_changed_project_file_switches_the_running_group_at_a_snapshot(settings, ml_examples, tmp_path):
    """Started in sync (the environment's mode and the file's agree); the file's ``dist_mode`` set
    to gba after the first snapshot: the group switches at a later snapshot, and every example is
    applied once across the switch."""
    cfg = deepfm_config(dim=8, mlp=[32], sequential=False)
    (tmp_path / "model.json").write_text(cfg.model_dump_json())
    project = tmp_path / "driftline.toml"
    head = 'name = "shop"\n[[features]]\nname = "item"\nsource = "item"\n[settings.trainer]\n'
    project.write_text(head + 'dist_mode = "sync"\n')
    records = await produce_examples(settings, ml_examples[:N // 2], chunk=250)
    log = tmp_path / "trainer.log"
    env = dict(_env(settings, tmp_path), DRIFTLINE_TRAINER__DIST_MODE="sync", DRIFTLINE_PROJECT=str(project))
    p = subprocess.Popen([sys.executable, "-m", "trainer", "online", "--sync-interval-s", "1",
                          "--snapshot-interval-event-s", "1800", "--stop-when-idle-s", "8", "--batch-size", "512"],
                         env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    root = settings.var_dir / "snapshots" / "deepfm"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not ((m := snapshots.read_manifest(root)) and m.get("shard_count") == 2
                                               and m["examples_applied"] >= 500):
        await asyncio.sleep(0.2)
    project.write_text(head + 'dist_mode = "gba"\n')
    records += await produce_examples(settings, ml_examples[N // 2:], chunk=250)
    assert p.wait(timeout=180) == 0, log.read_text()[-4000:]
    res = _results(log)
    assert sorted(res) == [0, 1], log.read_text()[-3000:]
    for r in res.values():
        assert r["mode"] == "gba" and [s["to"] for s in r["switches"]] == ["gba"], (r, log.read_text()[-3000:])
    assert sum(r["examples_applied"] for r in res.values()) == N
    man = snapshots.read_manifest(root)
    assert man["shard_count"] == 2 and man["examples_applied"] == N
    assert sum(man["offsets"].values()) == records
