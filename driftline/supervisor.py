"""The local process supervisor behind ``make up``.

Each service is a child process with its own log file under ``var/log/``. A long-running service
that exits is restarted with exponential back-off; a one-shot job (a replay) runs once. On
Ctrl-C or SIGTERM every child's process group is stopped (SIGTERM, then SIGKILL after a grace
period), and each child is also told by the kernel to die if the supervisor itself is killed
(``PR_SET_PDEATHSIG``), so nothing is left behind either way.

The stop is staged: the application services first, all at once, so each can drain into the
broker (serving ships its spool, the trainer commits and writes its final snapshot), then the
infrastructure they drain into (``ServiceSpec.infra``: the broker, Redis). :meth:`Supervisor.stop_all`
returns the children that did not exit 0, so ``driftline up`` can exit 0 only on a clean stop.

A service that exits within a minute of its start :data:`CRASH_LOOP_EXITS` times in a row is
*crash-looping* (an exit with ``broker_reset.RESET_EXIT_CODE``, a restart the service asks for to
follow a broker reset, does not count): logged as such, counted, and written with every restart count to
``<log_dir>/../run/supervisor.json`` (what ``make chaos`` and the status of a run read).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from services.broker_reset import RESET_EXIT_CODE
from services.in_use import IN_USE_EXIT, InUse

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# Quick exits in a row (each within a minute of its start) that make a service crash-looping.
CRASH_LOOP_EXITS = 3


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
    # Infrastructure the services drain into on a stop (broker, Redis): stopped after them.
    infra: bool = False
    # Runs (in a thread) once a *restarted* process is ready: e.g. recreate a fresh broker's topics.
    on_restart: Callable[[], object] | None = None
    # Runs before every start of the process, the first and each restart: e.g. repair a damaged file
    # the process would refuse to start on (a failure is logged; the process starts anyway).
    prestart: Callable[[], object] | None = None
    # Liveness: True while the process does its work (answers HTTP within a bound, say; an open
    # port is no proof: a stopped process's kernel still accepts connections). A process whose
    # check has not passed for liveness_timeout_s since its start or its last pass is killed (-9)
    # and restarted like a crashed one: a hung service is never left in place.
    alive: Callable[[], bool] | None = None
    liveness_timeout_s: float = 120.0
    # How long a stop waits after SIGTERM before SIGKILL: at least as long as the service's own
    # drain (serving ships its spool, then stops its workers), or a clean stop is counted unclean.
    stop_timeout_s: float = 10.0


@dataclass
class _Running:
    spec: ServiceSpec
    proc: subprocess.Popen
    log_path: Path
    started_at: float
    restarts: int = 0  # quick exits in a row
    last_alive: float = 0.0  # when its liveness check last passed (its start until then)
    last_checked: float = 0.0


class Supervisor:
    """Start services in order, keep them running, stop them all on request."""

    def __init__(self, log_dir: Path, max_backoff_s: float = 30.0) -> None:
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.max_backoff_s = max_backoff_s
        self.running: dict[str, _Running] = {}
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self.restarts: dict[str, int] = {}  # every restart, by service
        self.crash_loops: dict[str, int] = {}  # times a service reached CRASH_LOOP_EXITS quick exits
        self.hung: dict[str, int] = {}  # times a service was killed for failing its liveness check
        #: services that exited with IN_USE_EXIT: their one-line reason; the stack stops
        self.cannot_start: dict[str, str] = {}
        self.state_path = log_dir.parent / "run" / "supervisor.json"

    def log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def _spawn(self, spec: ServiceSpec) -> subprocess.Popen:
        """Start ``spec`` with its output appended to its log; where the log cannot be written
        (a full disk), to this process's stderr instead: a failed log write never stops a service
        from starting, nor the supervisor (issue: a full disk used to take the whole stack down)."""
        path = self.log_path(spec.name)
        header = f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting {' '.join(spec.argv)}\n".encode()
        out = None
        try:
            out = open(path, "ab", buffering=0)
            out.write(header)
        except OSError as err:
            if out is not None:
                out.close()
                out = None
            log.warning("cannot write %s (%s): %s writes to this terminal until its next start", path, err, spec.name)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
        if spec.prestart is not None:
            try:
                spec.prestart()
            except Exception as err:  # noqa: BLE001 - logged: the process starts and says what is wrong itself
                log.error("%s: its pre-start step failed (%r); starting it anyway", spec.name, err)
        try:
            return subprocess.Popen(
                list(spec.argv), stdout=out if out is not None else sys.stderr, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=env, preexec_fn=_die_with_parent, close_fds=True,
            )
        finally:
            if out is not None:
                out.close()

    def start(self, spec: ServiceSpec) -> None:
        """Start a service and wait until it is ready (or its ready check times out)."""
        if self._stopping.is_set():
            return
        proc = self._spawn(spec)
        with self._lock:
            self.running[spec.name] = _Running(spec, proc, self.log_path(spec.name), time.monotonic())
        log.info("started %s (pid %d), log %s", spec.name, proc.pid, self.log_path(spec.name))
        self._write_state()
        if spec.blocking:
            try:
                code = proc.wait(timeout=spec.ready_timeout_s)
            except subprocess.TimeoutExpired:
                raise RuntimeError(
                    f"{spec.name} did not finish within {spec.ready_timeout_s:.0f} s; see {self.log_path(spec.name)}"
                ) from None
            if code == IN_USE_EXIT:
                raise InUse(f"{spec.name}: {self._reason(spec.name)}")
            if code != 0:
                raise RuntimeError(f"{spec.name} failed with code {code}; see {self.log_path(spec.name)}")
            return
        if spec.ready is None:
            return
        deadline = time.monotonic() + spec.ready_timeout_s
        while not spec.ready():
            if proc.poll() is not None and not spec.oneshot:
                if proc.returncode == IN_USE_EXIT:
                    raise InUse(f"{spec.name}: {self._reason(spec.name)}")
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
            if code is None and not self._stopping.is_set():
                self._check_liveness(name, r)
            if code is None or self._stopping.is_set():
                continue
            if r.spec.oneshot or not r.spec.restart:
                log.info("%s finished with code %d", name, code)
                with self._lock:
                    self.running.pop(name, None)
                continue
            if code == IN_USE_EXIT:  # a restart cannot help (it used to crash-loop)
                self.cannot_start[name] = self._reason(name)
                log.error("%s cannot start: %s; stopping", name, self.cannot_start[name])
                self.request_stop()
                return
            # Back off exponentially, but forget old crashes after a quiet minute.
            uptime = time.monotonic() - r.started_at
            if code == RESET_EXIT_CODE:
                restarts = r.restarts  # (asked for: following a broker reset, not a crash)
            else:
                restarts = 0 if uptime > 60 else r.restarts + 1
            backoff = min(self.max_backoff_s, 0.5 * 2 ** min(restarts, 10))
            log.warning("%s exited with code %d; restarting in %.1f s (see %s)", name, code, backoff, r.log_path)
            self.restarts[name] = self.restarts.get(name, 0) + 1
            if restarts == CRASH_LOOP_EXITS:
                self.crash_loops[name] = self.crash_loops.get(name, 0) + 1
                log.error("%s is crash-looping: %d exits within a minute of starting; see %s",
                          name, restarts, r.log_path)
            self._write_state()
            if self._stopping.wait(backoff):
                return
            try:
                proc = self._spawn(r.spec)
            except OSError as err:  # no memory or no process slot now: try again at the next poll
                log.error("restarting %s failed (%s); trying again", name, err)
                with self._lock:
                    self.running[name] = _Running(r.spec, r.proc, r.log_path, time.monotonic(), restarts)
                continue
            with self._lock:
                self.running[name] = _Running(r.spec, proc, r.log_path, time.monotonic(), restarts)
            self._write_state()
            if r.spec.on_restart is not None:
                threading.Thread(target=self._after_restart, args=(r.spec,), daemon=True,
                                 name=f"{name}-restarted").start()

    def _reason(self, name: str) -> str:
        """The last line a service wrote (its one-line reason for exiting), without the prefix."""
        try:
            with open(self.log_path(name), "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
                lines = f.read().decode(errors="replace").strip().splitlines()
        except OSError:
            return f"see {self.log_path(name)}"
        return lines[-1].removeprefix("driftline: ") if lines else f"see {self.log_path(name)}"

    def _check_liveness(self, name: str, r: _Running, every_s: float = 5.0) -> None:
        if r.spec.alive is None:
            return
        now = time.monotonic()
        if now - r.last_checked < every_s:
            return
        r.last_checked = now
        if r.spec.alive():
            r.last_alive = now
            return
        silent = now - max(r.last_alive, r.started_at)
        if silent > r.spec.liveness_timeout_s:
            log.error("%s (pid %d) failed its liveness check for %.0f s: killing it to restart it", name,
                      r.proc.pid, silent)
            self.hung[name] = self.hung.get(name, 0) + 1
            try:
                os.killpg(r.proc.pid, signal.SIGKILL)  # (a stopped process dies of it too)
            except ProcessLookupError:
                pass

    def _after_restart(self, spec: ServiceSpec) -> None:
        deadline = time.monotonic() + spec.ready_timeout_s
        while spec.ready is not None and not spec.ready():
            if time.monotonic() > deadline or self._stopping.is_set():
                log.warning("%s was not ready after its restart; its restart hook did not run", spec.name)
                return
            time.sleep(0.1)
        try:
            assert spec.on_restart is not None
            spec.on_restart()
        except Exception:
            log.exception("%s: restart hook failed", spec.name)

    def _write_state(self) -> None:
        with self._lock:
            pids = {name: r.proc.pid for name, r in self.running.items()}
        state = {name: {"pid": pids.get(name), "restarts": self.restarts.get(name, 0),
                        "crash_loops": self.crash_loops.get(name, 0), "hung": self.hung.get(name, 0)}
                 for name in sorted(set(pids) | set(self.restarts))}
        try:
            self.state_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.state_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(state, indent=1))
            tmp.replace(self.state_path)
        except OSError as err:
            log.warning("cannot write %s: %s", self.state_path, err)

    def run_forever(self, poll_interval_s: float = 0.5) -> None:
        while not self._stopping.wait(poll_interval_s):
            self.poll_once()

    def request_stop(self) -> None:
        self._stopping.set()

    def stop_all(self, grace_s: float | None = None) -> dict[str, int]:
        """Stop every child: the services first, then the infrastructure (``ServiceSpec.infra``).
        Each stage sends SIGTERM to every group at once and SIGKILLs what is left after its
        ``stop_timeout_s`` (or ``grace_s`` for all, when given). Returns ``{name: exit code}`` of
        the children that did not exit 0 (a SIGKILL'd one as -9); a child that had already exited
        is judged by its own code."""
        self._stopping.set()
        with self._lock:
            items = list(self.running.values())[::-1]
        failed: dict[str, int] = {}
        for stage in ([r for r in items if not r.spec.infra], [r for r in items if r.spec.infra]):
            failed.update(self._stop_stage(stage, grace_s))
        with self._lock:
            self.running.clear()
        self._write_state()
        return failed

    def _stop_stage(self, items: list[_Running], grace_s: float | None) -> dict[str, int]:
        for r in items:
            if r.proc.poll() is None:
                try:
                    os.killpg(r.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        signalled = time.monotonic()
        failed: dict[str, int] = {}
        for r in items:
            grace = r.spec.stop_timeout_s if grace_s is None else grace_s
            try:
                code = r.proc.wait(timeout=max(0.0, signalled + grace - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s; killing it", r.spec.name, grace)
                try:
                    os.killpg(r.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                r.proc.wait()
                code = -signal.SIGKILL
            # A one-shot job's own failure was reported when it ended, and a server we do not own
            # (broker, Redis) may simply die of SIGTERM: for those, SIGTERM's exit is the stop's.
            if code != 0 and not ((r.spec.oneshot or r.spec.infra) and code == -signal.SIGTERM):
                log.warning("%s exited with code %d on stop; see %s", r.spec.name, code, r.log_path)
                failed[r.spec.name] = code
        return failed
