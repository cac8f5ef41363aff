"""What the status page knows about each scrape target: its badge and its recent raw samples
(:class:`TargetState`, filled by :mod:`status.scrape`, read by :mod:`status.series`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from status.options import Target

__all__ = ["Samples", "TargetState"]

# sample name -> [(labels, value), ...]
Samples = dict[str, list[tuple[dict[str, str], float]]]


@dataclass
class TargetState:
    """What the status page knows about one target: its badge and its recent raw samples."""

    target: Target
    up: bool | None = None  # None until the first scrape finished
    last_ok: float | None = None
    last_error: str | None = None
    last_duration_s: float | None = None
    scrapes: int = 0
    errors: int = 0
    # (wall time, samples) of the recent successful scrapes, oldest first.
    history: deque[tuple[float, Samples]] = field(default_factory=deque)

    @property
    def current(self) -> Samples | None:
        """This round's samples, or None when the target is down."""
        return self.history[-1][1] if self.up and self.history else None

    def badge(self) -> dict:
        return {
            "name": self.target.name, "url": self.target.url, "up": self.up,
            "last_ok": self.last_ok, "last_error": self.last_error,
            "last_duration_s": self.last_duration_s, "scrapes": self.scrapes, "errors": self.errors,
        }
