"""Local TCP ports: finding a free one and asking whether one answers.

Shared by the stack, the trainer's local launcher and the tests.

>>> port = free_port()
>>> 1024 <= port <= 65535 and not port_is_open("127.0.0.1", port)
True
"""

from __future__ import annotations

import socket

__all__ = ["free_port", "port_is_open"]


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
        with urllib.request.urlopen(url, timeout=timeout):  # noqa: S310 - our own local endpoints
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False
