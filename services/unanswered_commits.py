"""Offset commits the broker may never answer, bounded so that a consumer goes on without them.

aiokafka retries a commit for as long as the broker answers with a retriable error, inside one
``commit()``; tansu answers UnknownTopicOrPartition for ever once a topic the consumer reads was
deleted under it (:mod:`services.tansu_quirks`, quirk 11). A consumer that awaits that commit while
holding its work (the joiner's lock, the recent-clicks reader's loop) stops for good, and so does
its clean stop. Each commit through :class:`UnansweredCommits` is bounded by ``timeout_s``; after
one that timed out, commits are skipped for ``pause_s`` (the work goes on; each later commit
carries the newest offsets), the service says so once and shows it
(``driftline_offset_commits_unanswered{service}``, on the status page), and says when the broker
answers again. What a skipped commit costs is what any uncommitted offset costs: a restart reads
again from the last commit taken (the services here are at-least-once or keep their offsets in
their own state). The trainer's commits have their own rules (:mod:`trainer.commits`).

>>> import asyncio
>>> async def never() -> None:
...     await asyncio.sleep(3600)
>>> async def taken() -> None:
...     pass
>>> gate = UnansweredCommits("doc", timeout_s=0.01, pause_s=0.05)
>>> async def demo() -> list[bool]:
...     first = await gate.commit(never)     # not answered within 10 ms: given up
...     skipped = await gate.commit(taken)   # within the pause: not even tried
...     await asyncio.sleep(0.06)
...     return [first, skipped, await gate.commit(taken), gate.stalled]
>>> asyncio.run(demo())
[False, False, True, False]
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from prometheus_client import Gauge

__all__ = ["UNANSWERED", "UnansweredCommits"]

log = logging.getLogger(__name__)

UNANSWERED = Gauge(
    "driftline_offset_commits_unanswered",
    "1 while a consumer's offset commits get no answer from the broker (a topic it reads deleted under "
    "it: tansu quirk 11; or the broker unreachable): it goes on without them.",
    ["service"],
    multiprocess_mode="livemax",  # (a serving replica's recent-clicks reader)
)


class UnansweredCommits:
    """Bounded offset commits of one consumer of ``service`` (see the module docstring)."""

    def __init__(self, service: str, timeout_s: float, pause_s: float = 30.0) -> None:
        self.service, self.timeout_s, self.pause_s = service, timeout_s, pause_s
        self.stalled = False
        self._since = 0.0  # (monotonic) the first commit not answered
        self._next_try = 0.0  # (monotonic) no commit is tried before
        UNANSWERED.labels(service).set(0)

    async def commit(self, call: Callable[[], Awaitable[None]]) -> bool:
        """``await call()`` (a commit) within ``timeout_s``: whether the broker took it (False: not
        answered, or skipped in the pause after one that was not)."""
        now = time.monotonic()
        if now < self._next_try:
            return False
        try:
            await asyncio.wait_for(call(), self.timeout_s)
        except TimeoutError:
            self._next_try = time.monotonic() + self.pause_s
            if not self.stalled:
                self.stalled, self._since = True, now
                UNANSWERED.labels(self.service).set(1)
                log.warning("%s: an offset commit got no answer from the broker within %.0f s (a topic it reads "
                            "deleted under it: tansu quirk 11; or the broker unreachable): going on without commits, "
                            "tried again every %.0f s", self.service, self.timeout_s, self.pause_s)
            return False
        if self.stalled:
            self.stalled = False
            UNANSWERED.labels(self.service).set(0)
            log.warning("%s: the broker takes offset commits again (none taken for %.0f s)", self.service,
                        time.monotonic() - self._since)
        return True
