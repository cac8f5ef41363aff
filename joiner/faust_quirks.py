"""Every faust-streaming (0.15.3, on mode-streaming 0.7.1) behaviour driftline works around,
here only, numbered like :mod:`services.tansu_quirks` and :mod:`services.aiokafka_quirks`.

1. A Faust consumer runs in its own thread (a ``mode.threads.ServiceThread``). Stopped in its
   first moments (a SIGTERM while it still starts), its stop waits for the thread's shutdown
   event for ``mode.Service.shutdown_timeout``, 60 s, which nothing sets: longer than a
   supervisor waits before SIGKILL (the joiner watchdog test's SIGTERM, in one CI run). There is
   no setting for it. :func:`bound_consumer_thread_stop` shortens that wait for one app; call it
   once the offsets are committed, when nothing is left for the thread to do but close.
2. Faust delivers fetched records to its streams one at a time (an ``Event`` and two tasks per
   record: two thirds of the joiner's time on its bench). :mod:`joiner.faust_fetch` replaces the
   consumer's fetch loop for the input topics; it is large enough to be its own module.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CONSUMER_THREAD_STOP_S", "bound_consumer_thread_stop"]

#: quirk 1: how long a stopping consumer thread may take (mode's default: 60 s)
CONSUMER_THREAD_STOP_S = 5.0


def bound_consumer_thread_stop(app: Any, seconds: float = CONSUMER_THREAD_STOP_S) -> None:
    """Quirk 1: make ``app``'s consumer thread stop within ``seconds`` (no-op before Faust made
    the thread).

    >>> class App: _consumer = type("Consumer", (), {"_thread": type("Thread", (), {"shutdown_timeout": 60.0})()})()
    >>> app = App(); bound_consumer_thread_stop(app); app._consumer._thread.shutdown_timeout
    5.0
    >>> bound_consumer_thread_stop(type("Fresh", (), {"_consumer": None})())
    """
    thread = getattr(getattr(app, "_consumer", None), "_thread", None)
    if thread is not None:
        thread.shutdown_timeout = seconds
