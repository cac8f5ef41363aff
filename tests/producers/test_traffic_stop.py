"""``driftline traffic`` stops cleanly on SIGTERM (docker compose stop, ``up``'s supervisor)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from services.ports import free_port


def _catches_sigterm(pid: int) -> bool:
    """Whether the process has a handler for SIGTERM (its SigCgt mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False


def test_sigterm_ends_the_replay_cleanly_at_once(repo_root: Path) -> None:
    """Waiting for serving (nothing listens), SIGTERM exits 0 within a second or two: as a
    container's PID 1 a process without a SIGTERM handler would ignore it until compose's SIGKILL."""
    proc = subprocess.Popen([sys.executable, "-m", "driftline.cli", "traffic", "--dataset", "ml-1m", "--limit", "10",
                             "--url", f"http://127.0.0.1:{free_port()}", "--ready-timeout", "120", "--no-progress",
                             "--metrics-port", "0"], cwd=repo_root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 120
        while not _catches_sigterm(proc.pid):  # its handler is installed (then it waits for /readyz)
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-2000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        code = proc.wait(timeout=30)
        assert code == 0 and time.monotonic() - t0 < 10, (code, proc.communicate()[0][-2000:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
