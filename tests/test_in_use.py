"""A state directory has one owner (:mod:`services.in_use`): a second process on it is told who
holds it and exits ``IN_USE_EXIT`` (which the supervisor does not restart) before it touches
anything there, and the lock goes with its holder, kill -9 included. ``up`` twice on one var dir:
``tests/test_stack.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.in_use import IN_USE_EXIT, DirInUse, own_dir
from services.ports import free_port
from tests.conftest import fill_disk
from tests.loopstack import free_port_block

HOLDER = ("import sys, time; from pathlib import Path; from services.in_use import own_dir; "
          "own_dir(Path(sys.argv[1]), 'a directory', 'var_dir'); print('held', flush=True); time.sleep(600)")


def test_a_directory_whose_holder_is_killed_9_is_free_again(tmp_path: Path, repo_root: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              cwd=repo_root)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(DirInUse, match=f"is in use by pid {holder.pid} "):
            own_dir(tmp_path, "the test's directory", "var_dir")
    finally:
        holder.kill()
        holder.wait()
    own_dir(tmp_path, "the test's directory", "var_dir").release()  # nothing left to clean up


@pytest.mark.parametrize("command, held, setting", [
    (["joiner"], "joiner/faust", "joiner.store_url (DRIFTLINE_JOINER__STORE_URL)"),
    (["dumper"], "examples", "var_dir (DRIFTLINE_VAR_DIR)"),
    (["trainer", "online"], "snapshots/deepfm", "trainer.snapshot_dir (DRIFTLINE_TRAINER__SNAPSHOT_DIR)"),
    (["trainer", "batch", "--snapshot"], "snapshots/deepfm", "trainer.snapshot_dir (DRIFTLINE_TRAINER__SNAPSHOT_DIR)"),
], ids=["joiner", "dumper", "trainer-online", "trainer-batch"])
def test_a_second_service_on_a_held_directory_names_the_holder_and_exits(
        command: list[str], held: str, setting: str, tmp_path: Path, repo_root: Path) -> None:
    """Started by hand beside a running one (a second joiner worker on one machine without its own
    ``--store``, a ``trainer batch --snapshot`` beside the online trainer): one line, no traceback,
    and nothing written into the directory. No broker answers here: a service that got past its
    lock would fail on Kafka with another exit status."""
    var = tmp_path / "var"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRIFTLINE_")}
    env.update(DRIFTLINE_VAR_DIR=str(var), KAFKA_BOOTSTRAP_SERVERS=f"127.0.0.1:{free_port()}",
               DRIFTLINE_METRICS_PORT=str(free_port()), DRIFTLINE_KAFKA__CONNECT_TIMEOUT_S="3")
    with own_dir(var / held, "a directory", "var_dir"):
        done = subprocess.run([sys.executable, "-m", "driftline.cli", *command], env=env, capture_output=True,
                              text=True, timeout=120, cwd=repo_root)
    assert done.returncode == IN_USE_EXIT, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert f"{var / held} is in use by pid {os.getpid()} (" in last and last.endswith(f"its own with {setting}"), last
    assert "Traceback" not in done.stderr
    assert [p.name for p in (var / held).iterdir()] == [".owner"]


def test_up_does_not_clear_a_snapshot_directory_a_trainer_started_by_hand_holds(tmp_path: Path, repo_root: Path) -> None:
    """``up``'s demo clears the model's snapshot root for its warm start (nothing learned online in
    it); a trainer started by hand on the same var dir holds it: ``up`` stops with one line and its
    files stay."""
    var = tmp_path / "var"
    snap = var / "snapshots" / "deepfm"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRIFTLINE_") and k not in ("KAFKA_BOOTSTRAP_SERVERS",
                                                                                                  "REDIS_URL")}
    env.update(DRIFTLINE_VAR_DIR=str(var), DRIFTLINE_DATA_DIR=str(repo_root / "var" / "data"),
               DRIFTLINE_EMBEDDED__BROKER_PORT=str(free_port()), DRIFTLINE_EMBEDDED__REDIS_PORT=str(free_port()),
               DRIFTLINE_SERVING__PORT=str(free_port()), DRIFTLINE_STATUS__PORT=str(free_port()),
               DRIFTLINE_EMBEDDED__METRICS_PORT_BASE=str(free_port_block(8)))
    with own_dir(snap, "a directory", "var_dir"):
        (snap / "LATEST").write_text("snap-000000007\n")
        done = subprocess.run([sys.executable, "-m", "driftline.cli", "up"], env=env, capture_output=True, text=True,
                              timeout=120, cwd=repo_root)
    assert done.returncode == IN_USE_EXIT, done.stdout[-2000:] + done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert f"the trainer's snapshot directory {snap} is in use by pid {os.getpid()} (" in last, last
    assert (snap / "LATEST").read_text() == "snap-000000007\n"


def test_a_full_disk_does_not_stop_a_process_taking_its_directory(small_disk: Path) -> None:
    """A service restarted while its disk is full pauses (README: a full disk pauses, it does not
    tear down): taking its directory must not be what stops it. Who holds it goes unwritten."""
    (small_disk / "state").mkdir()
    fill = fill_disk(small_disk, 0)
    try:
        held = own_dir(small_disk / "state", "a directory", "var_dir")
        with pytest.raises(DirInUse, match="is in use by another process"):
            own_dir(small_disk / "state", "a directory", "var_dir")
        held.release()
    finally:
        fill.unlink()
