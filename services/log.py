"""Logging set-up shared by every service: one line per record, service name first."""

from __future__ import annotations

import logging
import sys


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
