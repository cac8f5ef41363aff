"""Logging set-up shared by every service: one line per record, service name first."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable


def setup_logging(service: str, level: str = "INFO") -> logging.Logger:
    """Configure the root logger once for this process and return the service's logger."""
    root = logging.getLogger()
    if not any(getattr(h, "_driftline", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")
        )
        handler._driftline = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(level.upper())
    # aiokafka logs every coordinator step at INFO; keep our own lines readable.
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, root.level))
    return logging.getLogger(service)


class Throttled:
    """``warning(msg, *args)`` on ``logger`` at most once per ``interval_s``; the next line that
    gets through says how many were held back (an overload would otherwise log every request).

    >>> import io
    >>> out = io.StringIO(); logger = logging.getLogger("throttled-doctest")
    >>> logger.addHandler(logging.StreamHandler(out)); logger.propagate = False
    >>> clock = iter([0.0, 1.0, 2.0, 61.0]).__next__
    >>> t = Throttled(logger, 60.0, clock=clock)
    >>> for i in range(4):
    ...     t.warning("spool full (%d)", i)
    >>> print(out.getvalue(), end="")
    spool full (0)
    spool full (3) (2 more like it held back in the last 60 s)
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.interval_s, self._clock = logger, interval_s, clock
        self._next = float("-inf")
        self._held = 0

    def warning(self, msg: str, *args: object) -> None:
        now = self._clock()
        if now < self._next:
            self._held += 1
            return
        if self._held:
            msg = f"{msg} ({self._held} more like it held back in the last {self.interval_s:.0f} s)"
        self._next, self._held = now + self.interval_s, 0
        self.logger.warning(msg, *args)
