"""Local TCP ports: finding a free one and asking whether one answers.

Shared by the stack, the trainer's local launcher, every service that listens, and the tests.

>>> port = free_port()
>>> 1024 <= port <= 65535 and not port_is_open("127.0.0.1", port)
True
>>> with socket.socket() as held:
...     held.bind(("127.0.0.1", 0)); held.listen()
...     wanted = [Listen("127.0.0.1", held.getsockname()[1], "the joiner's /metrics", "embedded.metrics_port_base")]
...     try:
...         check_ports_free(wanted)
...     except PortInUse as err:
...         print(str(err).replace(str(held.getsockname()[1]), "P"))
port 127.0.0.1:P (the joiner's /metrics) is in use: stop what listens there, or move it with embedded.metrics_port_base (DRIFTLINE_EMBEDDED__METRICS_PORT_BASE)
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterable
from typing import NamedTuple

from services.in_use import InUse

__all__ = ["Listen", "PortInUse", "check_ports_free", "free_port", "port_is_open", "port_taken"]


class PortInUse(InUse):
    """A port something must listen on is taken. The message is one line: the port, what wanted
    it, and the setting that moves it."""


class Listen(NamedTuple):
    """A port a process will listen on, and the setting (dotted, as in the project file) that moves it."""

    host: str
    port: int
    what: str
    setting: str

    def explained(self, problem: str) -> str:
        env = "DRIFTLINE_" + self.setting.upper().replace(".", "__")
        return (f"port {self.host}:{self.port} ({self.what}) {problem}: "
                f"stop what listens there, or move it with {self.setting} ({env})")


def port_taken(host: str, port: int) -> bool:
    """Whether binding ``host:port`` fails because something holds it. Bound as our servers bind
    (SO_REUSEADDR, so a closed connection in TIME_WAIT is no conflict), which also finds a server
    on another address of the same port, that a connect to ``host`` would miss."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as err:
            return err.errno == errno.EADDRINUSE
    return False


def check_ports_free(wanted: Iterable[Listen]) -> None:
    """Raise :class:`PortInUse` naming every port of ``wanted`` that is taken, or wanted twice,
    in one line: checked before anything starts, so a taken port never becomes a crash loop."""
    problems, seen = [], set()
    for listen in wanted:
        if listen.port == 0:
            continue  # the OS picks a free one
        if listen.port in seen:
            problems.append(listen.explained("is wanted by two services"))
        elif port_taken(listen.host, listen.port):
            problems.append(listen.explained("is in use"))
        seen.add(listen.port)
    if problems:
        raise PortInUse("; ".join(problems))


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_open(host: str, port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def http_answers(url: str, timeout: float = 2.0) -> bool:
    """Whether ``url`` answers an HTTP GET (any status) within ``timeout`` seconds: a liveness
    check (a stopped process's port still accepts connections; only a running one answers)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False
