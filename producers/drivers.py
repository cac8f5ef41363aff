"""What the two traffic drivers share (``driftline traffic``: MovieLens, :mod:`producers.traffic`;
your own log, :mod:`producers.csv_traffic`): their common flags, their start, and their counts."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field

from producers.join_report import report_arguments
from services.cli_args import at_least
from services.settings import Settings

__all__ = ["ReplayStats", "add_arguments", "driver_settings"]

log = logging.getLogger(__name__)


@dataclass
class ReplayStats:
    """What a replay did; the first few errors kept for its summary."""

    requests: int = 0
    impressions: int = 0
    actions: int = 0
    rank_errors: int = 0
    action_errors: int = 0
    actions_skipped: int = 0  # their /rank failed, so there is no request id to send them with
    errors: list[str] = field(default_factory=list)

    def error(self, message: str) -> None:
        if len(self.errors) < 5:
            self.errors.append(message)
            log.warning("%s", message)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags both traffic drivers take: how they reach serving, and the join report's."""
    p.add_argument("--url", default=None, help="serving base URL (default: settings.serving host and port)")
    p.add_argument("--concurrency", type=at_least(1), default=16, help="HTTP calls in flight at most")
    p.add_argument("--ready-timeout", type=at_least(0, float), default=180.0, help="seconds to wait for serving's /readyz")
    p.add_argument("--no-progress", action="store_true")
    report_arguments(p)


def driver_settings(service: str) -> Settings:
    """A traffic driver's start: the settings, and logging set up (httpx's one line per call muted)."""
    from services.log import setup_logging
    from services.settings import get_settings

    settings = get_settings()
    setup_logging(service, settings.log_level)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return settings
