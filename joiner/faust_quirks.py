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
3. Faust gives a partition's high watermark (``Consumer.highwater``) but not when a fetch last
   renewed it (aiokafka's ``last_poll_timestamp``). While the broker hangs or is cut off, fetches
   fail and the last high watermark stays: a reader that has read up to it looks caught up with a
   broker it has not heard from, and the joiner's idle advance closed windows whose clicks were
   waiting on the hung broker (a 60 s hang in a ``make chaos`` run: 9 clicked impressions never
   emitted, 3 emitted as negatives). :func:`highwater_and_age` gives the high watermark with how
   long ago a fetch renewed it: "idle" is then judged as of that fetch, not as of now.
4. That consumer thread is not a daemon, and a stop bounded by quirk 1 leaves it running where it
   was: in a broker call such as a group join, which tansu holds for half the session timeout
   (:mod:`services.tansu_quirks` quirk 3) or, for a join that never completes, for ever. The
   interpreter's exit waits for every thread that is not a daemon, so a worker that had logged its
   exit (the join watchdog's code 4, a SIGTERM's 0) lived on until the broker answered, so the
   join watchdog could not restart the very worker it is for (its test, with the join held 30 s:
   the worker logged its code 4 at 5.5 s and had not exited 20 s later).
   :func:`exit_past_stuck_threads` ends the process with its code instead; its offsets were
   committed before the stop, so nothing waits on the thread.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any

__all__ = ["CONSUMER_THREAD_STOP_S", "bound_consumer_thread_stop", "exit_past_stuck_threads", "highwater_and_age"]

log = logging.getLogger(__name__)

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


def highwater_and_age(app: Any, tp: Any, now: float | None = None) -> tuple[int, float] | None:
    """Quirk 3: ``app``'s consumer's high watermark of ``tp`` and the seconds since a fetch last
    renewed it (as of ``now``, wall clock, as aiokafka stamps it); None before the first fetch
    of ``tp`` or while it is not assigned.

    >>> class Aio:  # an aiokafka consumer whose last fetch of the partition was at 100.0 s
    ...     def highwater(self, tp): return 42
    ...     def last_poll_timestamp(self, tp): return 100_000
    >>> thread = type("Thread", (), {"_ensure_consumer": lambda self: Aio()})()
    >>> app = type("App", (), {"_consumer": type("Consumer", (), {"_thread": thread})()})()
    >>> highwater_and_age(app, "tp", now=105.5)
    (42, 5.5)
    >>> highwater_and_age(type("Fresh", (), {"_consumer": None})(), "tp") is None
    True
    """
    try:
        consumer = app._consumer._thread._ensure_consumer()
        stamped_ms, hw = consumer.last_poll_timestamp(tp), consumer.highwater(tp)
    except (AttributeError, AssertionError, KeyError):  # (no consumer yet; tp not assigned)
        return None
    if stamped_ms is None or hw is None:
        return None
    return int(hw), max(0.0, (time.time() if now is None else now) - stamped_ms / 1000)


def exit_past_stuck_threads(code: int, grace_s: float = 1.0) -> None:
    """Quirk 4: end the process with ``code`` at once if threads that are not daemons are still
    running ``grace_s`` seconds from now (a Faust consumer thread in a broker call); return when
    there are none. Only for a process's last step: nothing after it runs.

    >>> exit_past_stuck_threads(0)  # (no thread but this one: nothing to wait past)
    """
    stuck = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    deadline = time.monotonic() + grace_s
    for t in stuck:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [t for t in stuck if t.is_alive()]
    if not stuck:
        return
    log.warning("exiting past %d thread(s) still in a broker call (%s)", len(stuck), ", ".join(t.name for t in stuck))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
