"""The multi-machine form of docs/scale-out.md ("Several machines"), run as two torchrun agents on
this machine: each agent is one "machine" (``--nnodes 2 --nproc-per-node 1``, a c10d rendezvous
on the first one's endpoint), both see the same snapshot root, as the docs ask. The ranks are the
same ``python -m trainer online`` as under ``--nproc``; what differs is that no launcher of ours
is involved, and that a machine can die alone: its agent and its rank with it. ``--nnodes 2``
waits for a lost machine; ``--nnodes 1:2`` goes on without it and grows again when it is back.
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

from services.ports import free_port
from trainer import snapshots
from trainer.data import produce_examples

from .test_ranks import REPO, N, _env, _manifest, small_cfg

RDZV_ID = "driftline-trainer"


def _machine(settings, tmp: Path, name: str, endpoint: str, host: bool, nnodes: str = "2",
             idle_s: int = 5) -> subprocess.Popen:
    """One machine's ``torchrun`` as docs/scale-out.md writes it (1 rank per machine here).
    ``host``: this machine serves the rendezvous store. On real machines torchrun tells by the
    endpoint's hostname; here every agent's address matches 127.0.0.1, so it is said
    (``is_host``), or the first agent to bind would host it, which may be the one killed."""
    (tmp / "model.json").write_text(small_cfg().model_dump_json())
    env = _env(settings, tmp)
    del env["DRIFTLINE_TRAINER__NPROC"]  # torchrun's RANK / WORLD_SIZE make the worker a rank
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # docs/scale-out.md: a machine that rejoins
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", RDZV_ID,
           # a lost machine's rendezvous entry goes after 3 missed heartbeats: 1 s apart (5 s by default)
           # an elastic range waits 3 s for more machines (last_call: 30 s by default)
           "--rdzv-conf", f"is_host={int(host)},keep_alive_interval=1,last_call_timeout=3",
           "--max-restarts", "3", "--monitor-interval", "0.5",
           "-m", "trainer", "online", "--sync-interval-s", "1", "--snapshot-interval-event-s", "1800",
           "--stop-when-idle-s", str(idle_s), "--batch-size", "512"]
    return subprocess.Popen(cmd, env=env, stdout=open(tmp / f"{name}.log", "ab"), stderr=subprocess.STDOUT,
                            cwd=REPO, start_new_session=True)


def _last_result(log: Path) -> dict:
    """The result line the machine's last rank printed (its rank may differ from the first's)."""
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith('{"rank"')][-1]


def _processes(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    out = [pid]
    for child in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split():
        out += _processes(int(child))
    return out


def _kill(p: subprocess.Popen) -> None:
    """kill -9 of a whole machine: its agent and every process below it, at once."""
    for pid in _processes(p.pid) if p.poll() is None else []:
        os.kill(pid, signal.SIGKILL)
    p.wait(timeout=10)


def _logs(tmp: Path):
    """What the failure message shows: the tail of every machine's log."""
    return lambda: "\n".join(f"--- {log.name}\n" + log.read_text()[-3000:] for log in sorted(tmp.glob("*.log")))


async def _logged(log: Path, text: str, logs) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if log.exists() and text in log.read_text():
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"{text!r} not in {log.name}\n{logs()}")


async def test_a_machine_lost_and_started_again_resumes_the_group_from_the_last_manifest(
        settings, ml_examples, tmp_path):
    """Two machines train the stream, and machine b is lost twice, started again each time with
    the same command:

    1. its agent alone is killed (kill -9): its rank finds its launcher gone; the group writes a
       last snapshot and machine a's rank exits with ``EXIT_REGROUP``, so a's agent restarts it
       and waits in the rendezvous (a clean exit would have ended the job on machine a);
    2. the whole machine dies (its agent and its rank at once): a's rank fails in a collective,
       its agent restarts it and waits.

    Each time the group restores the last manifest, and every example is learned once:
    ``examples_applied`` equals the stream, the committed offsets its records."""
    third = N // 3
    records = await produce_examples(settings, ml_examples[:third], chunk=250)
    endpoint = f"127.0.0.1:{free_port()}"
    root = settings.var_dir / "snapshots" / "deepfm"
    a = _machine(settings, tmp_path, "a", endpoint, host=True)  # the endpoint's machine
    b = _machine(settings, tmp_path, "b", endpoint, host=False)
    logs = _logs(tmp_path)
    try:
        first = await _manifest(root, 500, -1, logs)
        assert _processes(b.pid)[1:], "machine b's rank runs under its agent"
        os.kill(b.pid, signal.SIGKILL)  # the agent alone: its rank lives on, orphaned
        b.wait(timeout=10)
        # the group's last snapshot: written before a's rank exits for its agent to restart it (any
        # manifest after the first could be one of the group's own, written before it noticed)
        await _logged(tmp_path / "a.log", "(exitcode: 75)", logs)
        regrouped = snapshots.read_manifest(root)
        assert regrouped["seq"] > first["seq"], logs()
        b = _machine(settings, tmp_path, "b", endpoint, host=False)
        records += await produce_examples(settings, ml_examples[third:2 * third], chunk=250)
        second = await _manifest(root, regrouped["examples_applied"] + 500, regrouped["seq"], logs)
        _kill(b)
        records += await produce_examples(settings, ml_examples[2 * third:], chunk=250)
        b = _machine(settings, tmp_path, "b", endpoint, host=False)
        assert a.wait(timeout=300) == 0, logs()
        assert b.wait(timeout=60) == 0, logs()
    finally:
        _kill(a)
        _kill(b)
    text = (tmp_path / "a.log").read_text()
    assert text.count("restored snapshot") >= 2, logs()
    assert "exit 75: this launcher restarts us" in text, logs()
    final = snapshots.read_manifest(root)
    assert final["shard_count"] == 2 and final["seq"] > second["seq"]
    assert final["examples_applied"] == N, (first, second, final)
    assert sum(final["offsets"].values()) == records
    # each machine's last result line: its last rank's (a re-rendezvous may swap the machines' ranks,
    # so a log's earlier lines can hold the other rank's older counts)
    res = [_last_result(tmp_path / f"{m}.log") for m in "ab"]
    assert sorted(r["rank"] for r in res) == [0, 1] and sum(r["examples_applied"] for r in res) == N, res


async def test_with_an_elastic_range_the_survivor_goes_on_alone_and_the_machine_rejoins(
        settings, ml_examples, tmp_path):
    """``--nnodes 1:2``: when machine b dies, machine a does not wait for it. Its agent restarts
    its rank alone, as a group of one: the 1-process trainer, which restores the 2-rank snapshot
    (rows resharded on load). When b is started again, a's agent sees it waiting, stops its
    trainer (SIGTERM: a last snapshot) and the two form a group of 2 ranks again, which restores
    the 1-process snapshot. Every example is learned once."""
    third = N // 3
    records = await produce_examples(settings, ml_examples[:third], chunk=250)
    endpoint = f"127.0.0.1:{free_port()}"
    root = settings.var_dir / "snapshots" / "deepfm"
    # idle 15 s: machine a alone must not finish the job before b is back
    a = _machine(settings, tmp_path, "a", endpoint, host=True, nnodes="1:2", idle_s=15)
    b = _machine(settings, tmp_path, "b", endpoint, host=False, nnodes="1:2", idle_s=15)
    logs = _logs(tmp_path)
    try:
        first = await _manifest(root, 500, -1, logs)
        _kill(b)
        records += await produce_examples(settings, ml_examples[third:2 * third], chunk=250)
        alone = await _manifest(root, first["examples_applied"] + 1, first["seq"], logs, shards=0)
        b = _machine(settings, tmp_path, "b2", endpoint, host=False, nnodes="1:2", idle_s=15)
        # the group of 2 again (either rank: a re-rendezvous may give machine b rank 0)
        await _logged(tmp_path / "b2.log", "/2 reads", logs)
        records += await produce_examples(settings, ml_examples[2 * third:], chunk=250)
        assert a.wait(timeout=300) == 0, logs()
        assert b.wait(timeout=60) == 0, logs()
    finally:
        _kill(a)
        _kill(b)
    final = snapshots.read_manifest(root)
    # the group of 2 started from the snapshot machine a wrote alone when it was stopped for b
    assert "(1 ranks wrote it)" in (tmp_path / "b2.log").read_text(), logs()
    assert final["shard_count"] == 2 and final["seq"] > alone["seq"]
    assert final["examples_applied"] == N, (first, alone, final)
    assert sum(final["offsets"].values()) == records
