"""`driftline up` as a subprocess on free ports: :class:`LoopStack`, shared by the loop tests,
the dashboards test, the status screenshot and ``make chaos`` (bench/chaos.py).

``LoopStack.start(tmp_path, repo_root, "--replay-limit", "30000", "--speed", "0")`` runs
``python -m driftline.cli up ...`` on free ports (broker, Redis, serving, the services' metrics
ports), waits for its "driftline is up" banner and returns; ``stop()`` sends Ctrl-C (SIGINT) and
waits for "driftline stopped.".
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.ports import free_port
from services.settings import LOCAL_METRICS_OFFSETS, Settings


def free_port_block(n: int) -> int:
    """A base port with ``n`` consecutive free ports, below the ephemeral range (where outgoing
    connections would otherwise take them before the services bind). Each xdist worker draws from
    its own slice of the range: two workers checking the same block at once both found it free, and
    the later stack's service could not bind (a trainer's /metrics, exit 78)."""
    import random
    import socket

    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    lo = 20000 + (index % 8) * 1500

    def free(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
        return True

    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(lo, lo + 1500 - n)
        if all(free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no block of free ports")


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Running (neither gone nor a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def poll_until(what: str, check: Callable[[], Any], timeout_s: float, context: Callable[[], str],
               gone: Callable[[], str | None] = lambda: None, every_s: float = 1.0) -> Any:
    """Poll ``check`` (an OSError counts as not yet) until it returns something truthy and return
    it; fail with ``context()`` after ``timeout_s``, or with ``gone()``'s message once it has one."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got = check()
        except OSError:
            got = None
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s\n{context()}")
        if (message := gone()) is not None:
            raise AssertionError(message)
        time.sleep(every_s)


@dataclass
class LoopStack:
    """A running ``driftline up`` (a subprocess), its ports and its output so far."""

    proc: subprocess.Popen
    var_dir: Path
    broker_port: int
    redis_port: int
    serving_port: int
    metrics_base: int
    status_port: int
    output: list[str] = field(default_factory=list)
    _reader: threading.Thread | None = None

    @classmethod
    def start(cls, tmp_path: Path, repo_root: Path, *args: str, env: dict[str, str] | None = None,
              timeout_s: float = 240.0) -> LoopStack:
        """Start ``driftline up *args`` on free ports under ``tmp_path`` and wait for its banner."""
        broker_port, redis_port, serving_port, status_port = free_port(), free_port(), free_port(), free_port()
        metrics_base = free_port_block(8)
        full_env = {k: v for k, v in os.environ.items() if k not in ("KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL")}
        full_env.update(
            DRIFTLINE_VAR_DIR=str(tmp_path / "var"),
            DRIFTLINE_DATA_DIR=str(repo_root / "var" / "data"),
            DRIFTLINE_EMBEDDED__BROKER_PORT=str(broker_port),
            DRIFTLINE_EMBEDDED__REDIS_PORT=str(redis_port),
            DRIFTLINE_SERVING__PORT=str(serving_port),
            DRIFTLINE_STATUS__PORT=str(status_port),
            DRIFTLINE_EMBEDDED__METRICS_PORT_BASE=str(metrics_base),
            NUMBA_CACHE_DIR=str(repo_root / "var" / "numba-cache"),
        )
        full_env.update(env or {})  # a test's own values win over these
        proc = subprocess.Popen(
            [sys.executable, "-m", "driftline.cli", "up", *args],
            env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=repo_root,
        )
        stack = cls(proc, tmp_path / "var", broker_port, redis_port, serving_port, metrics_base, status_port)
        up = threading.Event()

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                stack.output.append(line)
                if "driftline is up" in line:
                    up.set()
            up.set()

        stack._reader = threading.Thread(target=read, daemon=True)
        stack._reader.start()
        up.wait(timeout_s)
        if not any("driftline is up" in line for line in stack.output):
            stack.stop()
            raise AssertionError(f"no banner within {timeout_s:.0f} s:\n{stack.text()}\n{stack.logs_tail()}")
        return stack

    # -------------------------------------------------------------- where things are
    def text(self) -> str:
        return "".join(self.output)

    @property
    def serving_url(self) -> str:
        return f"http://127.0.0.1:{self.serving_port}"

    @property
    def log_dir(self) -> Path:
        return self.var_dir / "log"

    def metrics_urls(self) -> dict[str, str]:
        """Every service's /metrics, by service name."""
        urls = {name: f"http://127.0.0.1:{self.metrics_base + off}/metrics" for name, off in LOCAL_METRICS_OFFSETS.items()}
        urls["serving"] = f"{self.serving_url}/metrics"
        return urls

    def settings(self) -> Settings:
        return Settings(kafka_bootstrap_servers=f"127.0.0.1:{self.broker_port}", var_dir=self.var_dir)

    def logs_tail(self, lines: int = 15) -> str:
        out = []
        for path in sorted(self.log_dir.glob("*.log")) if self.log_dir.exists() else []:
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(out)

    # -------------------------------------------------------------- probing
    def get(self, url: str, timeout: float = 5.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    def json(self, path: str) -> Any:
        return json.loads(self.get(self.serving_url + path)[1])

    def metric(self, service: str, name: str, labels: dict[str, str] | None = None) -> float | None:
        """The value of one sample of ``name`` on ``service``'s /metrics (None when absent)."""
        from prometheus_client.parser import text_string_to_metric_families

        try:
            _, body = self.get(self.metrics_urls()[service])
        except OSError:
            return None
        for family in text_string_to_metric_families(body):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                    return float(sample.value)
        return None

    def wait_for(self, what: str, check: Callable[[], Any], timeout_s: float, every_s: float = 1.0) -> Any:
        """Poll ``check`` until it returns something truthy; fail with the logs after ``timeout_s``."""

        def gone() -> str | None:
            if self.proc.poll() is None:
                return None
            return f"driftline up exited ({self.proc.returncode}) waiting for {what}\n{self.text()}"

        return poll_until(what, check, timeout_s, self.logs_tail, gone, every_s)

    # -------------------------------------------------------------- stopping
    def stop(self, timeout_s: float = 60.0) -> int:
        """Ctrl-C, then wait; returns the exit code (kills after ``timeout_s``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5)
        return int(self.proc.returncode)
