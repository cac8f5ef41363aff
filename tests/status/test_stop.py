"""The status page stops cleanly: SIGTERM (what the supervisor sends) exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from services.ports import free_port, port_is_open


def test_sigterm_exits_zero(repo_root) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "status", "--port", str(port),
                             "--target", "x=http://127.0.0.1:9/metrics"],
                            cwd=repo_root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not port_is_open("127.0.0.1", port):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
