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
