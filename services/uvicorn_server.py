"""uvicorn for driftline's HTTP services (serving, the status page): SIGTERM or SIGINT is a clean
stop that exits 0.

The loop is uvloop and the HTTP parser httptools, both in C (uvicorn's "standard" choice, named
here so a missing install fails at start instead of falling back to pure Python): they halve
uvicorn's own cost per request (``/ping`` 0.19 -> 0.11 ms of server CPU, ``/rank`` 2.20 -> 1.97 ms;
``bench/profile_serving.py``).

uvicorn re-raises the signal that stopped it once it has shut down, so a process would die of
SIGTERM (or raise KeyboardInterrupt) after a complete, clean stop, and the supervisor would count
an unclean exit. Here a signal means "stop", and once the stop is done it is forgotten.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn

GRACEFUL_SHUTDOWN_S = 5


class Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            self._captured_signals.clear()


def serve(app: Any, host: str, port: int, log_level: str, sock: socket.socket | None = None) -> bool:
    """Run ``app`` until SIGTERM/SIGINT; False when it never started (the log says why).
    ``sock``: a listening socket to accept on (a worker of a shared serving PS binds its own with
    SO_REUSEPORT). Passed as a socket, not ``fd=``: uvicorn takes an fd for a unix socket and would
    leave TCP_NODELAY off (Nagle + delayed ACKs: 40 ms stalls). A stop waits at most
    ``GRACEFUL_SHUTDOWN_S`` for requests in flight (uvicorn's default waits for ever: one stuck
    client would hold the stop until the supervisor's SIGKILL)."""
    server = Server(uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(), access_log=False,
                                   loop="uvloop", http="httptools",
                                   timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    server.run(sockets=[sock] if sock is not None else None)
    return bool(server.started)
