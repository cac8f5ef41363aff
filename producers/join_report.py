"""What the joiner made of a replay: ``driftline traffic`` reads the joiner's counters before and
after it, and prints what became of the actions it sent.

A replay runs event time far faster than the wall clock (``--speed 0``: as fast as serving
answers; ~36k event-seconds a second on one user's log), and the joiner's limits are in event
time: an action whose feature log is more than ``joiner.orphan_grace_seconds`` behind it is an
orphan, one behind the action watermark by more than ``joiner.allowed_lateness_seconds`` is late,
and a feature log whose window, lateness and retention the watermark has passed is refused
(expired; the actions on it then wait for nothing and become orphans). A fraction of a wall second
between serving's feature log and the actions is then minutes of event time, and clicks are lost
while every request answered 200. The report counts the lost actions (orphans and late ones) and
warns, naming the settings, when they pass ``WARN_FRACTION`` of the actions sent.

The counters are the joiner workers' ``/metrics`` (summed over workers): by default the one the
local stack runs (``driftline up``), else each ``--joiner-metrics URL``. After the replay the report
waits (up to ``settle_s``) until the joiner has read every action sent and its counts stop moving.
A joiner restarted during the replay (its counters begin again at 0) is reported as such, uncounted.

>>> r = JoinReport(before={"actions": 10, "joined": 8}, after={"actions": 1010, "joined": 990,
...                "orphan_actions": 6, "late_actions": 4, "expired_impressions": 0, "pending_actions": 0})
>>> r.counts()["joined"], r.lost(), r.warning(1000) is not None
(982, 10, True)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.cli_args import at_least
from services.settings import Settings

__all__ = ["WARN_FRACTION", "JoinReport", "report_arguments", "default_urls", "read_counts", "report_after",
           "with_join_report"]

log = logging.getLogger(__name__)

#: lost actions (orphans, late) above this fraction of those sent: a warning
WARN_FRACTION = 0.001

#: report key -> the joiner's counter (summed over its labels and workers)
COUNTERS = {
    "actions": "driftline_joiner_actions_total",
    "joined": "driftline_joiner_joined_actions_total",
    "orphan_actions": "driftline_joiner_orphan_actions_total",
    "late_actions": "driftline_joiner_late_actions_total",
    "expired_impressions": "driftline_joiner_expired_impressions_total",
}
PENDING = "driftline_joiner_pending_actions"
# (an expired impression's actions are among the orphans: they wait for features that were refused)
LOST = ("orphan_actions", "late_actions")


def default_urls(settings: Settings) -> list[str]:
    """The joiner's ``/metrics`` in the stack ``driftline up`` runs."""
    return [f"http://127.0.0.1:{settings.embedded.metrics_port('joiner')}/metrics"]


async def read_counts(client: httpx.AsyncClient, urls: Sequence[str]) -> dict[str, float] | None:
    """The counters of :data:`COUNTERS` and the pending actions, summed over ``urls``; None when
    one of them cannot be read."""
    out = dict.fromkeys([*COUNTERS, "pending_actions"], 0.0)
    names = {v: k for k, v in COUNTERS.items()}
    for url in urls:
        try:
            r = await client.get(url, timeout=5.0)
            r.raise_for_status()
        except httpx.HTTPError:
            return None
        for family in text_string_to_metric_families(r.text):
            for sample in family.samples:
                if sample.name in names:
                    out[names[sample.name]] += sample.value
                elif sample.name == PENDING:
                    out["pending_actions"] += sample.value
    return out


@dataclass
class JoinReport:
    before: dict[str, float]
    after: dict[str, float]

    def counts(self) -> dict[str, int]:
        """What the joiner counted during the replay (and the actions still waiting at its end)."""
        out = {k: int(self.after.get(k, 0) - self.before.get(k, 0)) for k in COUNTERS}
        out["pending_actions"] = int(self.after.get("pending_actions", 0))
        return out

    def lost(self) -> int:
        c = self.counts()
        return sum(c[k] for k in LOST)

    def warning(self, actions_sent: int) -> str | None:
        """A line naming what was lost and the settings that decide it, or None when within bounds."""
        c = self.counts()
        if not actions_sent or self.lost() <= WARN_FRACTION * actions_sent:
            return None
        return (f"the joiner lost {self.lost()} of the {actions_sent} actions sent "
                f"({100 * self.lost() / actions_sent:.2f}%, over {100 * WARN_FRACTION:.1f}%): "
                f"{c['orphan_actions']} orphans (their feature log came more than joiner.orphan_grace_seconds "
                f"after them in event time, or was refused: {c['expired_impressions']} impressions came past "
                "joiner.window_seconds + allowed_lateness_seconds + late_retention_seconds behind their partition), "
                f"{c['late_actions']} late (behind the action watermark by more than "
                "joiner.allowed_lateness_seconds). A replay runs event time faster than the wall clock: replay "
                "slower (--speed) or widen those settings.")


async def report_after(client: httpx.AsyncClient, urls: Sequence[str], before: dict[str, float] | None,
                       actions_sent: int, settle_s: float = 60.0, quiet_s: float = 3.0) -> dict:
    """Wait for the joiner to read the replay's actions and settle, then report (a dict for the
    traffic's summary line; a warning logged when too many were lost)."""
    if before is None:
        log.warning("could not read the joiner's counts at %s before the replay: no check of what it joined",
                    ", ".join(urls))
        return {"joiner_metrics": list(urls), "unavailable": True}
    deadline = time.monotonic() + settle_s
    last, still_since = None, time.monotonic()
    after = before
    while time.monotonic() < deadline:
        got = await read_counts(client, urls)
        if got is not None and any(got[k] < before[k] for k in COUNTERS):
            # a worker restarted (its counters began again at 0): what it counted before is gone
            log.warning("the joiner restarted during the replay (its counters began again): no count of what "
                        "it joined")
            return {"joiner_metrics": list(urls), "restarted": True, "actions_sent": actions_sent}
        if got is not None:
            after = got
            read_all = after["actions"] - before["actions"] >= actions_sent
            if got != last:
                last, still_since = got, time.monotonic()
            elif read_all and (not after["pending_actions"] or time.monotonic() - still_since >= quiet_s):
                break
        await asyncio.sleep(0.5)
    report = JoinReport(before, after)
    out = {**report.counts(), "actions_sent": actions_sent, "lost": report.lost()}
    warning = report.warning(actions_sent)
    if warning:
        log.warning("%s", warning)
        out["warning"] = warning
    else:
        log.info("the joiner joined the replay: %s", out)
    return out


async def with_join_report(replay: Awaitable[dict | None], urls: Sequence[str], settle_s: float) -> dict | None:
    """Run ``replay`` (a traffic driver's, returning its stats with ``actions`` sent) between two
    reads of the joiner's counts; its stats gain ``join`` (:func:`report_after`)."""
    async with httpx.AsyncClient() as client:
        before = await read_counts(client, urls)
        stats = await replay
        if stats is not None:
            stats["join"] = await report_after(client, urls, before, int(stats["actions"]), settle_s)
    return stats


def report_arguments(p: argparse.ArgumentParser) -> None:
    """The report's flags (every traffic driver takes them: :func:`producers.drivers.add_arguments`)."""
    p.add_argument("--joiner-metrics", action="append", default=None, metavar="URL",
                   help="a joiner worker's /metrics, once per worker (default: the joiner `driftline up` runs)")
    p.add_argument("--join-settle-s", type=at_least(0, float), default=60.0,
                   help="after the replay, wait at most this long for the joiner to read its actions")
    p.add_argument("--no-join-report", action="store_true", help="do not read the joiner's counts")
