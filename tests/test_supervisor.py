"""The supervisor restarts crashed services and leaves no process behind when stopped."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from driftline.supervisor import ServiceSpec, Supervisor


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
    _until_restarted(sup, "crasher")
    time.sleep(0.5)
    group = sup.running["sleeper"].proc.pid
    members = [int(p) for p in os.listdir("/proc") if p.isdigit() and _pgid(int(p)) == group]
    assert len(members) >= 2
    sup.stop_all(grace_s=5)
    time.sleep(0.2)
    assert not [pid for pid in members if _alive(pid)]
    assert (tmp_path / "log" / "crasher.log").read_text().count("starting") >= 2


def _until_restarted(sup: Supervisor, name: str, timeout_s: float = 10.0) -> None:
    first_pid = sup.running[name].proc.pid
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and sup.running[name].proc.pid == first_pid:
        sup.poll_once()
        time.sleep(0.05)
    assert sup.running[name].proc.pid != first_pid, f"{name} was not restarted"


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


def test_crash_loop_is_counted_and_written(tmp_path: Path) -> None:
    """Three exits within a minute of starting in a row make a crash loop, in supervisor.json."""
    import json

    sup = Supervisor(tmp_path / "log", max_backoff_s=0.05)
    sup.start(ServiceSpec("crasher", [sys.executable, "-c", "raise SystemExit(1)"]))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not sup.crash_loops:
        sup.poll_once()
        time.sleep(0.05)
    sup.stop_all(grace_s=5)
    state = json.loads((tmp_path / "run" / "supervisor.json").read_text())
    assert state["crasher"]["crash_loops"] == 1 and state["crasher"]["restarts"] >= 3


def test_the_pre_start_step_runs_before_every_start_and_its_failure_does_not_stop_one(tmp_path: Path) -> None:
    """``prestart`` (the embedded Redis's: repair a damaged append-only file) runs before the first
    start and before each restart; one that raises is logged and the process starts anyway."""
    calls: list[float] = []

    def prestart() -> None:
        calls.append(time.monotonic())
        if len(calls) == 2:
            raise OSError("cannot repair")

    sup = Supervisor(tmp_path / "log", max_backoff_s=0.05)
    sup.start(ServiceSpec("crasher", [sys.executable, "-c", "import time; time.sleep(0.1); raise SystemExit(1)"],
                          prestart=prestart))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and sup.restarts.get("crasher", 0) < 3:
        sup.poll_once()
        time.sleep(0.05)
    sup.stop_all(grace_s=5)
    assert sup.restarts["crasher"] >= 3 and len(calls) >= 4  # (the one that raised did not stop the restarts)


def test_a_restart_asked_for_after_a_broker_reset_is_no_crash(tmp_path: Path) -> None:
    """Exits with RESET_EXIT_CODE (the joiner following a broker reset) are restarted and
    counted as restarts, never as a crash loop."""
    from services.broker_reset import RESET_EXIT_CODE

    sup = Supervisor(tmp_path / "log", max_backoff_s=0.05)
    sup.start(ServiceSpec("resetter", [sys.executable, "-c", f"raise SystemExit({RESET_EXIT_CODE})"]))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and sup.restarts.get("resetter", 0) < 4:
        sup.poll_once()
        time.sleep(0.05)
    sup.stop_all(grace_s=5)
    assert sup.restarts["resetter"] >= 4 and not sup.crash_loops


def test_stop_drains_services_before_infra_and_reports_unclean_exits(tmp_path: Path) -> None:
    """Services get SIGTERM first and may still use the infrastructure while they drain; the
    infra is stopped after them. A child that dies on SIGTERM is reported, a clean one is not."""
    marker = tmp_path / "infra-alive-when-service-stopped"
    infra = ServiceSpec("infra", [sys.executable, "-c", "import time; time.sleep(60)"], infra=True)
    sup = Supervisor(tmp_path / "log")
    sup.start(infra)
    infra_pid = sup.running["infra"].proc.pid
    drains = ServiceSpec("drains", [sys.executable, "-c", (
        "import os, signal, sys, time\n"
        "def stop(*_):\n"
        f"    time.sleep(0.5); os.kill({infra_pid}, 0); open({str(marker)!r}, 'w').close(); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "time.sleep(60)\n")])
    dies = ServiceSpec("dies", [sys.executable, "-c", "import time; time.sleep(60)"])
    sup.start(drains)
    sup.start(dies)
    time.sleep(0.5)
    failed = sup.stop_all(grace_s=10)
    assert marker.exists(), "the infrastructure was stopped before the service had drained"
    assert failed == {"dies": -15}


def test_restart_hook_runs_once_the_restarted_service_is_ready(tmp_path: Path) -> None:
    flag = tmp_path / "ready"
    calls: list[int] = []
    spec = ServiceSpec("flaky", [sys.executable, "-c",
                                 f"import pathlib, time; pathlib.Path({str(flag)!r}).touch(); time.sleep(0.3)"],
                       ready=flag.exists, on_restart=lambda: calls.append(1))
    sup = Supervisor(tmp_path / "log", max_backoff_s=0.05)
    sup.start(spec)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not calls:
        sup.poll_once()
        time.sleep(0.05)
    sup.stop_all(grace_s=5)
    assert calls, "the restart hook never ran"


def test_a_log_it_cannot_write_neither_stops_a_service_nor_the_supervisor(tmp_path: Path, capfd) -> None:
    """A full disk (the log is /dev/full: every write fails with ENOSPC): the crashing service is
    still started and restarted, its output going to the supervisor's stderr."""
    log_dir = tmp_path / "log"
    log_dir.mkdir()
    (log_dir / "crasher.log").symlink_to("/dev/full")
    sup = Supervisor(log_dir, max_backoff_s=0.2)
    sup.start(ServiceSpec("crasher", [sys.executable, "-c",
                                      "import time; print('crasher says hi'); time.sleep(0.2); raise SystemExit(3)"]))
    _until_restarted(sup, "crasher")
    sup.stop_all(grace_s=5)
    assert "crasher says hi" in capfd.readouterr().err


def test_a_hung_service_is_killed_and_restarted(tmp_path: Path) -> None:
    """SIGSTOP of a service that answers HTTP: its liveness check fails (the port still accepts
    connections, nothing answers) and past the bound it is killed and restarted."""
    import signal

    from services.ports import free_port, http_answers

    port = free_port()
    spec = ServiceSpec("web", [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                       alive=lambda: http_answers(f"http://127.0.0.1:{port}/", timeout=0.5), liveness_timeout_s=2.0)
    sup = Supervisor(tmp_path / "log", max_backoff_s=0.2)
    sup.start(spec)
    first = sup.running["web"].proc.pid
    deadline = time.monotonic() + 10
    while not http_answers(f"http://127.0.0.1:{port}/", timeout=0.5):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    os.kill(first, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while sup.running["web"].proc.pid == first:
        assert time.monotonic() < deadline, "a hung service was left in place"
        sup.poll_once()
        sup.running["web"].last_checked = 0.0  # (check at every poll here, not every 5 s)
        time.sleep(0.1)
    assert sup.hung == {"web": 1}
    sup.stop_all(grace_s=5)


def test_each_service_gets_its_own_stop_timeout(tmp_path: Path) -> None:
    """A service whose drain takes 3 s stops cleanly when its spec allows 8 s; one allowed 1 s is
    killed and reported (-9). Both are signalled together: the waits overlap."""
    drain = ("import signal, sys, time\n"
             "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(3), sys.exit(0)))\n"
             "time.sleep(60)\n")
    sup = Supervisor(tmp_path / "log")
    sup.start(ServiceSpec("patient", [sys.executable, "-c", drain], stop_timeout_s=8.0))
    sup.start(ServiceSpec("hurried", [sys.executable, "-c", drain], stop_timeout_s=1.0))
    time.sleep(0.5)
    started = time.monotonic()
    assert sup.stop_all() == {"hurried": -9}
    assert time.monotonic() - started < 7.0


def test_a_service_that_cannot_start_is_not_restarted_and_stops_the_stack(tmp_path: Path) -> None:
    """IN_USE_EXIT (a taken port: a restart cannot help) stops the stack with the service's
    own one-line reason, instead of a restart every 30 s."""
    from services.in_use import IN_USE_EXIT

    sup = Supervisor(tmp_path / "log", max_backoff_s=0.05)
    line = "driftline: port 127.0.0.1:9101 (this service's /metrics) is in use: move it"
    sup.start(ServiceSpec("joiner", [sys.executable, "-c",
                                     f"import sys, time; time.sleep(0.3); print({line!r}); sys.exit({IN_USE_EXIT})"]))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not sup.cannot_start:
        sup.poll_once()
        time.sleep(0.05)
    assert sup.cannot_start == {"joiner": line.removeprefix("driftline: ")}
    assert sup._stopping.is_set() and not sup.restarts
    sup.stop_all(grace_s=5)
