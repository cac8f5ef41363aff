"""The supervisor restarts crashed services and leaves no process behind when stopped."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from services.supervisor import ServiceSpec, Supervisor


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_restarts_a_crashed_service_and_stops_everything(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "log", max_backoff_s=0.2)
    crasher = ServiceSpec("crasher", [sys.executable, "-c", "import time; time.sleep(0.2); raise SystemExit(3)"])
    # A service that starts a grandchild: stopping must take the whole process group.
    sleeper = ServiceSpec("sleeper", [sys.executable, "-c",
        "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"])
    sup.start(crasher)
    sup.start(sleeper)
    first_pid = sup.running["crasher"].proc.pid
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and sup.running["crasher"].proc.pid == first_pid:
        sup.poll_once()
        time.sleep(0.05)
    assert sup.running["crasher"].proc.pid != first_pid, "crashed service was not restarted"
    time.sleep(0.5)
    group = sup.running["sleeper"].proc.pid
    members = [int(p) for p in os.listdir("/proc") if p.isdigit() and _pgid(int(p)) == group]
    assert len(members) >= 2
    sup.stop_all(grace_s=5)
    time.sleep(0.2)
    assert not [pid for pid in members if _alive(pid)]
    assert (tmp_path / "log" / "crasher.log").read_text().count("starting") >= 2


def _pgid(pid: int) -> int:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return -1


def test_oneshot_job_is_not_restarted(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "log")
    sup.start(ServiceSpec("job", [sys.executable, "-c", "print('done')"], oneshot=True))
    sup.running["job"].proc.wait()
    sup.poll_once()
    assert "job" not in sup.running
    assert "done" in (tmp_path / "log" / "job.log").read_text()
