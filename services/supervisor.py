"""The local process supervisor behind ``make up``.

Each service is a child process with its own log file under ``var/log/``. A long-running service
that exits is restarted with exponential back-off; a one-shot job (a replay) runs once. On
Ctrl-C or SIGTERM every child's process group is stopped (SIGTERM, then SIGKILL after a grace
period), and each child is also told by the kernel to die if the supervisor itself is killed
(``PR_SET_PDEATHSIG``), so nothing is left behind either way.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child before exec: ask the kernel for SIGTERM when the supervisor dies."""
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: Ctrl-C still stops everything, only kill -9 of the supervisor leaks


@dataclass
class ServiceSpec:
    """One process to run. ``ready`` returns True once the service can take work."""

    name: str
    argv: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)
    ready: Callable[[], bool] | None = None
    ready_timeout_s: float = 60.0
    oneshot: bool = False
    restart: bool = True
    # A one-shot job others need (a data load): start() waits for it to exit successfully.
    blocking: bool = False


@dataclass
class _Running:
    spec: ServiceSpec
    proc: subprocess.Popen
    log_path: Path
    started_at: float
    restarts: int = 0


class Supervisor:
    """Start services in order, keep them running, stop them all on request."""

    def __init__(self, log_dir: Path, max_backoff_s: float = 30.0) -> None:
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.max_backoff_s = max_backoff_s
        self.running: dict[str, _Running] = {}
        self._stopping = threading.Event()
        self._lock = threading.Lock()

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def _spawn(self, spec: ServiceSpec) -> subprocess.Popen:
        path = self.log_path(spec.name)
        out = open(path, "ab", buffering=0)  # noqa: SIM115 - the child owns it from here
        out.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting {' '.join(spec.argv)}\n".encode())
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
        try:
            return subprocess.Popen(
                list(spec.argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, preexec_fn=_die_with_parent, close_fds=True,
            )
        finally:
            out.close()

    def start(self, spec: ServiceSpec) -> None:
        """Start a service and wait until it is ready (or its ready check times out)."""
        if self._stopping.is_set():
            return
        proc = self._spawn(spec)
        with self._lock:
            self.running[spec.name] = _Running(spec, proc, self.log_path(spec.name), time.monotonic())
        log.info("started %s (pid %d), log %s", spec.name, proc.pid, self.log_path(spec.name))
        if spec.blocking:
            try:
                code = proc.wait(timeout=spec.ready_timeout_s)
            except subprocess.TimeoutExpired:
                raise RuntimeError(
                    f"{spec.name} did not finish within {spec.ready_timeout_s:.0f} s; see {self.log_path(spec.name)}"
                ) from None
            if code != 0:
                raise RuntimeError(f"{spec.name} failed with code {code}; see {self.log_path(spec.name)}")
            return
        if spec.ready is None:
            return
        deadline = time.monotonic() + spec.ready_timeout_s
        while not spec.ready():
            if proc.poll() is not None and not spec.oneshot:
                raise RuntimeError(
                    f"{spec.name} exited with code {proc.returncode} while starting; "
                    f"see {self.log_path(spec.name)}"
                )
            if time.monotonic() > deadline or self._stopping.is_set():
                raise RuntimeError(
                    f"{spec.name} was not ready within {spec.ready_timeout_s:.0f} s; "
                    f"see {self.log_path(spec.name)}"
                )
            time.sleep(0.1)

    def poll_once(self) -> None:
        """Restart long-running services that exited; forget finished one-shot jobs."""
        with self._lock:
            items = list(self.running.items())
        for name, r in items:
            code = r.proc.poll()
            if code is None or self._stopping.is_set():
                continue
            if r.spec.oneshot or not r.spec.restart:
                log.info("%s finished with code %d", name, code)
                with self._lock:
                    self.running.pop(name, None)
                continue
            # Back off exponentially, but forget old crashes after a quiet minute.
            uptime = time.monotonic() - r.started_at
            restarts = 0 if uptime > 60 else r.restarts + 1
            backoff = min(self.max_backoff_s, 0.5 * 2 ** min(restarts, 10))
            log.warning("%s exited with code %d; restarting in %.1f s (see %s)", name, code, backoff, r.log_path)
            if self._stopping.wait(backoff):
                return
            proc = self._spawn(r.spec)
            with self._lock:
                self.running[name] = _Running(r.spec, proc, r.log_path, time.monotonic(), restarts)

    def run_forever(self, poll_interval_s: float = 0.5) -> None:
        while not self._stopping.wait(poll_interval_s):
            self.poll_once()

    def request_stop(self) -> None:
        self._stopping.set()

    def stop_all(self, grace_s: float = 10.0) -> None:
        """Stop every child, newest first: SIGTERM to its group, SIGKILL after the grace period."""
        self._stopping.set()
        with self._lock:
            items = list(self.running.values())[::-1]
        for r in items:
            if r.proc.poll() is None:
                try:
                    os.killpg(r.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for r in items:
            try:
                r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s; killing it", r.spec.name, grace_s)
                try:
                    os.killpg(r.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                r.proc.wait()
        with self._lock:
            self.running.clear()
