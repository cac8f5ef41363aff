"""``docker compose up`` without Docker: every driftline service of ``docker-compose.yml`` run as a
local process, as its container would run it (:class:`ComposeProcesses`).

Each driftline service runs its own ``command`` behind the image's ``ENTRYPOINT`` (the
Dockerfile's), with the image's ``ENV`` and its own ``environment`` (``<<:`` merges are YAML's,
as compose reads them), started in ``depends_on`` order and stopped as ``docker compose stop``
does (SIGTERM to the container's main process, dependents first, SIGKILL of the whole container
after its ``stop_grace_period``, 10 s by default). Only addresses are rewritten:

* ``kafka:<port>`` is an embedded tansu broker, ``redis:6379`` a redis-server run with the compose
  service's own flags; both on free ports; ``<service>:<port>`` (``http://serving-0:8000``) the
  process standing in for that container;
* every container binds the same ports (metrics 9100, serving 8000, a trainer rank's 9100 + 100 r):
  each (service, container port) gets its own free port (:attr:`ComposeProcesses.ports`, the same
  across restarts, as published ports are);
* a named volume is a folder under the test's tmp dir, ``WORKDIR`` (``/app``: the copied sources)
  the repository.

Kafka, Redis, Prometheus and Grafana are not run as compose runs them: the broker and Redis are the
embedded stand-ins above, Prometheus and Grafana are checked through their config files.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from driftline.embedded import redis_binary, tansu_command, wait_for_port
from services.ports import port_is_open
from tests.loopstack import alive, descendants

#: point the test at another compose file / Dockerfile (an older commit's, for instance)
COMPOSE_FILE_VAR = "DRIFTLINE_TEST_COMPOSE_FILE"
DOCKERFILE_VAR = "DRIFTLINE_TEST_DOCKERFILE"
#: compose's stop_grace_period when a service sets none
DEFAULT_STOP_GRACE_S = 10.0
#: the container port a trainer rank r > 0 binds: DRIFTLINE_METRICS_PORT + r * this (settings default)
RANK_METRICS_STRIDE = 100
#: what a process inherits from the test's own environment (a container has none of it): where
#: Python and the sources are, and the shared numba cache (the image compiles on first use)
_INHERITED = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "NUMBA_CACHE_DIR")


def duration_s(value: str | int | float | None, default: float) -> float:
    """A compose duration (``10s``, ``1m30s``, ``500ms``) in seconds.

    >>> duration_s("1m30s", 10), duration_s(None, 10), duration_s("500ms", 10)
    (90.0, 10, 0.5)
    """
    if value is None:
        return default
    if isinstance(value, (int, float)):
        return float(value)
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", value))


@dataclass(frozen=True)
class Image:
    """What the Dockerfile gives every container: entrypoint, environment, working directory."""

    entrypoint: list[str]
    env: dict[str, str]
    workdir: str

    @classmethod
    def parse(cls, dockerfile: Path) -> Image:
        import json

        from dockerfile_parse import DockerfileParser

        parsed = DockerfileParser(fileobj=dockerfile.open("rb"))
        entrypoint: list[str] = []
        workdir = "/"
        for step in parsed.structure:
            if step["instruction"] == "ENTRYPOINT":
                entrypoint = json.loads(step["value"])  # exec form: what compose's SIGTERM reaches
            elif step["instruction"] == "WORKDIR":
                workdir = os.path.join(workdir, step["value"])
        assert entrypoint, f"{dockerfile}: no exec-form ENTRYPOINT"
        return cls(entrypoint, dict(parsed.envs), workdir)


def compose_file(repo_root: Path) -> Path:
    return Path(os.environ.get(COMPOSE_FILE_VAR) or repo_root / "docker-compose.yml")


def dockerfile(repo_root: Path) -> Path:
    return Path(os.environ.get(DOCKERFILE_VAR) or repo_root / "Dockerfile")


_VARIABLE = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def interpolate(value: Any, host_env: dict[str, str]) -> Any:
    """Compose's variable interpolation over every string of the parsed file: ``$$``, ``$VAR``,
    ``${VAR}``, ``${VAR:-default}`` / ``${VAR-default}``, ``${VAR:?error}`` / ``${VAR?error}`` and
    ``${VAR:+alt}`` / ``${VAR+alt}``, with ``host_env`` the environment ``docker compose`` runs in.

    >>> interpolate({"k": '${KEYS:-["demo"]}', "l": ["$$1", "${A}-$A"]}, {"A": "x"})
    {'k': '["demo"]', 'l': ['$1', 'x-x']}
    >>> interpolate("${KEYS:-d}|${KEYS-d}|${KEYS:+alt}", {"KEYS": ""})
    'd||'
    """
    if isinstance(value, dict):
        return {k: interpolate(v, host_env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, host_env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        escaped, name, op, arg, bare = m.groups()
        if escaped:
            return "$"
        if bare:
            return host_env.get(bare, "")
        current = host_env.get(name)
        set_ = current is not None and (current != "" or not (op or "").startswith(":"))
        if op in (":-", "-"):
            return current if set_ else arg
        if op in (":?", "?"):
            if not set_:
                raise ValueError(f"compose: {name} is required: {arg}")
            return current
        if op in (":+", "+"):
            return arg if set_ else ""
        return current or ""

    return _VARIABLE.sub(one, value)


def driftline_services(compose: dict) -> dict[str, dict]:
    """The services built from the repository's image (the rest are Kafka, Redis, Prometheus...)."""
    return {n: s for n, s in compose["services"].items() if "build" in s or s.get("image") == "driftline:latest"}


def depends_on(spec: dict) -> dict[str, str]:
    """Dependency -> condition (compose's short list form means ``service_started``)."""
    deps = spec.get("depends_on") or {}
    if isinstance(deps, list):
        return {d: "service_started" for d in deps}
    return {d: (c or {}).get("condition", "service_started") for d, c in deps.items()}


def _low_free_port(taken: set[int], rng: random.Random) -> int:
    """A free port below the ephemeral range: an outgoing connection cannot take it between now and
    a restart's bind (the ports are kept across restarts)."""
    while True:
        port = rng.randrange(20000, 32000)
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


@dataclass
class Container:
    """One compose service as a local process (one start of it)."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    proc: subprocess.Popen | None = None
    killed: bool = False  # SIGKILLed at the end of its stop grace period
    stop_s: float | None = None  # SIGTERM to exit

    @property
    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()


@dataclass
class ComposeProcesses:
    """The driftline services of a compose file as local processes, on an embedded broker and Redis."""

    repo_root: Path
    tmp: Path
    compose: dict
    image: Image
    #: environment on top of compose's own (each a setting the services already read), one place
    overrides: dict[str, str] = field(default_factory=dict)
    broker_port: int = 0
    redis_port: int = 0
    #: (service, container port) -> host port
    ports: dict[tuple[str, int], int] = field(default_factory=dict)
    containers: dict[str, Container] = field(default_factory=dict)
    #: every start, in order: (service, Container), across restarts
    history: list[Container] = field(default_factory=list)
    _infra: list[subprocess.Popen] = field(default_factory=list)
    starts: int = 0

    @classmethod
    def create(cls, repo_root: Path, tmp: Path, overrides: dict[str, str] | None = None) -> ComposeProcesses:
        # as `docker compose up` on a host that sets none of the file's variables (their defaults)
        compose = interpolate(yaml.safe_load(compose_file(repo_root).read_text()), {})
        stack = cls(repo_root, tmp, compose, Image.parse(dockerfile(repo_root)), dict(overrides or {}))
        stack._assign_ports()
        (tmp / "logs").mkdir(parents=True, exist_ok=True)
        return stack

    # ------------------------------------------------------------------ the compose file, localized
    @property
    def services(self) -> dict[str, dict]:
        return driftline_services(self.compose)

    def _env_of(self, spec: dict) -> dict[str, str]:
        env = spec.get("environment") or {}
        if isinstance(env, list):
            env = dict(e.split("=", 1) for e in env)
        return {k: str(v) for k, v in env.items()}

    def _container_ports(self, name: str) -> list[int]:
        """The ports a service's container binds (the same in every container: hence the mapping)."""
        spec = self.services[name]
        env = {**self.image.env, **self._env_of(spec)}
        ports = set()
        if "DRIFTLINE_METRICS_PORT" in env:
            base = int(env["DRIFTLINE_METRICS_PORT"])
            nproc = int(env.get("DRIFTLINE_TRAINER__NPROC", "1")) if spec["command"][:2] == ["trainer", "online"] else 1
            ports |= {base + r * RANK_METRICS_STRIDE for r in range(nproc)}
        command = spec.get("command") or []
        ports |= {int(command[i + 1]) for i, a in enumerate(command[:-1]) if a == "--port"}
        ports |= {int(str(p).split(":")[-1]) for p in spec.get("ports", [])}
        return sorted(ports)

    def _assign_ports(self) -> None:
        rng = random.Random()
        taken: set[int] = set()
        self.broker_port = _low_free_port(taken, rng)
        taken.add(self.broker_port)
        self.redis_port = _low_free_port(taken, rng)
        taken.add(self.redis_port)
        for name in self.services:
            cports = self._container_ports(name)
            if not cports:
                continue
            # one offset for all of a container's ports, so a rank's "9100 + 100 r" stays true
            for _ in range(1000):
                offset = _low_free_port(taken, rng) - cports[0]
                hosts = [c + offset for c in cports]
                if all(1024 < h < 65000 and h not in taken for h in hosts) and all(
                        not port_is_open("127.0.0.1", h) for h in hosts):
                    break
            else:
                raise RuntimeError(f"no free ports for {name}")
            for c, h in zip(cports, hosts):
                self.ports[(name, c)] = h
                taken.add(h)

    def host_port(self, service: str, container_port: int) -> int:
        return self.ports[(service, container_port)]

    def url(self, service: str, container_port: int, path: str = "") -> str:
        return f"http://127.0.0.1:{self.host_port(service, container_port)}{path}"

    def _volumes(self, spec: dict) -> dict[str, Path]:
        """Container path -> host path: named volumes under tmp, bind mounts in the repository."""
        out = {self.image.workdir: self.repo_root}  # the copied sources
        for volume in spec.get("volumes", []):
            source, target = str(volume).split(":")[:2]
            out[target] = (self.repo_root / source) if source.startswith((".", "/")) else self.tmp / "volumes" / source
        return out

    def localize(self, name: str, value: str) -> str:
        """A compose value with the container's addresses and paths made this machine's."""
        spec = self.services[name]
        hosts = {"kafka": self.broker_port, "redis": self.redis_port}

        def host(m: re.Match) -> str:
            svc, port = m.group(1), int(m.group(2))
            if svc in hosts:
                return f"127.0.0.1:{hosts[svc]}"
            return f"127.0.0.1:{self.ports[(svc, port)]}"

        names = sorted({*hosts, *(s for s, _ in self.ports)}, key=len, reverse=True)
        value = re.sub(rf"(?<![\w.-])({'|'.join(map(re.escape, names))}):(\d+)\b", host, value)
        volumes = self._volumes(spec)
        paths = sorted(volumes, key=len, reverse=True)
        return re.sub(rf"(?<![\w.-])({'|'.join(map(re.escape, paths))})(?=/|$|[^\w.-])",
                      lambda m: str(volumes[m.group(1)]), value)

    def api_key(self, name: str) -> str | None:
        """The first serving API key compose gives ``name`` (what its clients send), if any."""
        keys = self.environment(name).get("DRIFTLINE_SERVING__API_KEYS")
        return json.loads(keys)[0] if keys and json.loads(keys) else None

    def command(self, name: str) -> list[str]:
        spec = self.services[name]
        entry = spec.get("entrypoint") or self.image.entrypoint
        # the image's `driftline` (pip install .) is this venv's console script; `python` its python
        entry = [str(Path(sys.executable).with_name(e)) if e == "driftline" else sys.executable if e == "python" else e
                 for e in entry]
        args = [self.localize(name, a) for a in spec.get("command") or []]
        for i, a in enumerate(args[:-1]):  # --port N: the container's port, mapped
            if a == "--port" and (name, int(args[i + 1])) in self.ports:
                args[i + 1] = str(self.ports[(name, int(args[i + 1]))])
        return [*entry, *args]

    def environment(self, name: str) -> dict[str, str]:
        spec = self.services[name]
        env = {k: os.environ[k] for k in _INHERITED if k in os.environ}
        env["PYTHONPATH"] = str(self.repo_root)  # the image's installed sources
        for key, value in {**self.image.env, **self._env_of(spec)}.items():
            env[key] = self.localize(name, value)
        if "DRIFTLINE_METRICS_PORT" in env and (name, int(env["DRIFTLINE_METRICS_PORT"])) in self.ports:
            env["DRIFTLINE_METRICS_PORT"] = str(self.ports[(name, int(env["DRIFTLINE_METRICS_PORT"]))])
        env.update(self.overrides)
        return env

    # ------------------------------------------------------------------ Kafka and Redis stand-ins
    def start_infra(self) -> None:
        """The embedded broker for ``kafka`` and a redis-server with compose's own ``redis`` flags."""
        from tests.conftest import _start

        logs = self.tmp / "logs"
        self._infra.append(_start(tansu_command("127.0.0.1", self.broker_port), logs / "kafka.log"))
        self._infra.append(_start(self.redis_argv(), logs / "redis.log", self.redis_env()))
        wait_for_port("127.0.0.1", self.broker_port, 30, "broker", self._infra[0])
        wait_for_port("127.0.0.1", self.redis_port, 30, "redis", self._infra[1])

    def redis_data(self) -> Path:
        """The Redis container's working directory (the image's ``/data``): its volume here."""
        return self._volumes(self.compose["services"]["redis"]).get("/data", self.tmp / "redis")

    def redis_argv(self) -> list[str]:
        """The compose service's command (its start script, mounted from the repository, with
        redis-server's flags), listening here and working in its volume (:meth:`redis_data`)."""
        spec = self.compose["services"]["redis"]
        volumes = {target: str(path) for target, path in self._volumes(spec).items()}
        self.redis_data().mkdir(parents=True, exist_ok=True)
        return [volumes.get(str(a), str(a)) for a in spec.get("command") or ["redis-server"]] + [
            "--bind", "127.0.0.1", "--port", str(self.redis_port), "--dir", str(self.redis_data()),
            "--protected-mode", "no"]

    def redis_env(self) -> dict[str, str]:
        """The image's ``redis-server`` and ``redis-check-aof`` on the PATH: the embedded binary
        under both names (it acts as the name it is run by)."""
        bin_dir = self.tmp / "redis-bin"
        bin_dir.mkdir(exist_ok=True)
        for name in ("redis-server", "redis-check-aof"):
            if not (bin_dir / name).exists():
                (bin_dir / name).symlink_to(redis_binary())
        return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}

    def kill_redis(self, before_start: Callable[[Path], None] | None = None) -> None:
        """kill -9 of the Redis container and its restart (``restart: always`` or ``docker compose
        up``): the same command and volume; ``before_start`` is given the volume in between."""
        from tests.conftest import _start

        self._infra[1].kill()
        self._infra[1].wait()
        if before_start is not None:
            before_start(self.redis_data())
        self._infra[1] = _start(self.redis_argv(), self.tmp / "logs" / "redis.log", self.redis_env())
        wait_for_port("127.0.0.1", self.redis_port, 30, "redis", self._infra[1])

    def stop_infra(self) -> None:
        from tests.conftest import _stop

        for proc in reversed(self._infra):
            _stop(proc)
        self._infra.clear()

    # ------------------------------------------------------------------ up and stop
    def _healthy_infra(self, name: str) -> bool:
        if name == "kafka":
            return port_is_open("127.0.0.1", self.broker_port)
        if name == "redis":
            return port_is_open("127.0.0.1", self.redis_port)
        return True  # prometheus, grafana: not run here, nothing of ours waits on them

    def _satisfied(self, dep: str, condition: str) -> bool:
        if dep not in self.services:
            return self._healthy_infra(dep)
        c = self.containers.get(dep)
        if c is None:
            return False
        if condition == "service_started":
            return True
        if condition == "service_completed_successfully":
            code = c.exit_code
            if code not in (None, 0):
                raise AssertionError(f"{dep} exited {code}, which compose's depends_on refuses:\n{self.log_tail(dep)}")
            return code == 0
        raise AssertionError(f"depends_on {dep}: {condition} is not handled here (no healthcheck on our services)")

    def _start(self, name: str) -> None:
        log_path = self.tmp / "logs" / f"{name}.log"
        c = Container(name, self.command(name), self.environment(name), log_path)
        with log_path.open("ab") as out:
            out.write(f"=== start {self.starts}: {' '.join(c.argv)}\n".encode())
            out.flush()
            c.proc = subprocess.Popen(c.argv, env=c.env, cwd=self.repo_root, stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        self.containers[name] = c
        self.history.append(c)

    def up(self, timeout_s: float = 600.0) -> None:
        """Start every driftline service once its ``depends_on`` conditions hold (as ``docker compose
        up``: in parallel, each as soon as it may); returns when all are started."""
        self.starts += 1
        self.containers = {}
        pending = list(self.services)
        deadline = time.monotonic() + timeout_s
        while pending:
            for name in list(pending):
                if all(self._satisfied(d, cond) for d, cond in depends_on(self.services[name]).items()):
                    self._start(name)
                    pending.remove(name)
            if time.monotonic() > deadline:
                raise AssertionError(f"not started within {timeout_s:.0f} s: {pending}\n{self.logs_tail()}")
            time.sleep(0.2)

    def wait_completed(self, name: str, timeout_s: float) -> int:
        c = self.containers[name]
        assert c.proc is not None
        try:
            return c.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} still running after {timeout_s:.0f} s\n{self.log_tail(name)}") from None

    def stop(self) -> dict[str, Container]:
        """``docker compose stop``: dependents first; each SIGTERM to the main process, SIGKILL of the
        whole container after its stop_grace_period. Returns the containers that were running."""
        running = {n: c for n, c in self.containers.items() if c.exit_code is None}
        stopped: dict[str, Container] = {}
        while running:
            # a service whose running dependents are all stopped may stop now
            level = [n for n in running if not any(n in depends_on(self.services[o]) for o in running if o != n)]
            level = level or list(running)
            families = {n: descendants(running[n].proc.pid) for n in level}  # type: ignore[union-attr]
            t0 = time.monotonic()
            for n in level:
                running[n].proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
            for n in level:
                c = running.pop(n)
                grace = duration_s(self.services[n].get("stop_grace_period"), DEFAULT_STOP_GRACE_S)
                try:
                    c.proc.wait(timeout=max(0.0, t0 + grace - time.monotonic()))  # type: ignore[union-attr]
                except subprocess.TimeoutExpired:
                    c.killed = True
                    c.proc.kill()  # type: ignore[union-attr]
                    c.proc.wait()  # type: ignore[union-attr]
                c.stop_s = time.monotonic() - t0
                if c.proc.returncode == -signal.SIGTERM:  # type: ignore[union-attr]
                    # no handler: as a container's PID 1 it would have ignored the SIGTERM until the SIGKILL
                    c.killed = True
                # the container ends with its main process: whatever it left goes with it
                for pid in families[n] | descendants(c.proc.pid):  # type: ignore[union-attr]
                    if alive(pid):
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                stopped[n] = c
        return stopped

    def close(self) -> None:
        self.stop()
        self.stop_infra()

    # ------------------------------------------------------------------ what went on
    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.tmp / "logs" / f"{name}.log"
        text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []
        return f"--- {name}\n" + "\n".join(text)

    def logs_tail(self, lines: int = 12) -> str:
        return "\n".join(self.log_tail(n, lines) for n in self.services)

    def exited(self) -> dict[str, int]:
        """Services of the current start that exited, and their codes."""
        return {n: c.exit_code for n, c in self.containers.items() if c.exit_code is not None}


def get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def samples(body: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample of a /metrics body."""
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.name, s.labels, float(s.value)) for f in text_string_to_metric_families(body) for s in f.samples]


def metric(url: str, name: str, labels: dict[str, Any] | None = None) -> float | None:
    """One sample's value from a /metrics URL (None: absent or not answering)."""
    try:
        status, body = get(url)
    except OSError:
        return None
    if status != 200:
        return None
    for n, lab, value in samples(body):
        if n == name and all(lab.get(k) == str(v) for k, v in (labels or {}).items()):
            return value
    return None
