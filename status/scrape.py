"""Scrape every service's ``/metrics`` on an interval and keep bounded in-memory time series.

One round fetches all targets concurrently (httpx), parses the Prometheus text with
``prometheus_client``'s parser, keeps a short per-target history of the raw samples (enough for
rates over ``rate_window_s``) and appends one point of derived key series (see
:mod:`status.series`) to a bounded history. A target that is down, slow or returns garbage only
marks itself down for that round: its series get a gap (``None``), nothing raises.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Iterable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from status.metrics import StatusMetrics
from status.options import StatusSettings, Target
from status.problems import problems
from status.series import derive
from status.targets import Samples, TargetState

log = logging.getLogger(__name__)


def parse_metrics(text: str, prefix: str = "driftline_") -> Samples:
    """The samples of a Prometheus text exposition whose names start with ``prefix``.

    >>> s = parse_metrics('# TYPE driftline_x_total counter\\ndriftline_x_total{a="1"} 3\\nother 1\\n')
    >>> s
    {'driftline_x_total': [({'a': '1'}, 3.0)]}
    """
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(prefix):
                out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def _finite(v: float | None) -> float | None:
    return v if v is not None and math.isfinite(v) else None


class Scraper:
    """Scrapes ``targets`` every ``opts.scrape_interval_s``; :meth:`snapshot` is the JSON the page reads."""

    def __init__(self, targets: Iterable[Target], opts: StatusSettings, metrics: StatusMetrics | None = None,
                 client: httpx.AsyncClient | None = None) -> None:
        self.opts = opts
        self.states = [TargetState(t) for t in targets]
        self.metrics = metrics
        self._client = client
        self._own_client = client is None
        self.times: deque[float] = deque(maxlen=opts.history_points)
        self.points: deque[dict[str, float | None]] = deque(maxlen=opts.history_points)
        self.meta: dict[str, str] = {}
        self.problems: list[dict[str, str]] = []  # what is wrong as of the last round (status.problems)
        # Raw samples are kept long enough for the slowest window (sync delay: 3x the rate window).
        self.keep_s = 3 * opts.rate_window_s + 2 * opts.scrape_interval_s

    async def __aenter__(self) -> Scraper:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.opts.scrape_timeout_s)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._own_client and self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _fetch(self, state: TargetState, now: float) -> None:
        assert self._client is not None
        name = state.target.name
        started = time.perf_counter()
        kind = None
        try:
            resp = await self._client.get(state.target.url, timeout=self.opts.scrape_timeout_s,
                                          headers=dict(state.target.headers))
            resp.raise_for_status()
            samples = parse_metrics(resp.text)
        except httpx.TimeoutException as err:
            kind, detail = "timeout", f"timeout: {err!r}"
        except httpx.HTTPStatusError as err:
            kind, detail = "http_status", f"HTTP {err.response.status_code}"
        except httpx.HTTPError as err:
            kind, detail = "connect", f"{type(err).__name__}: {err}"
        except Exception as err:  # noqa: BLE001 - a body that does not parse counts as a failed scrape
            kind, detail = "parse", f"{type(err).__name__}: {err}"
        state.last_duration_s = time.perf_counter() - started
        state.scrapes += 1
        if kind is None:
            state.up, state.last_ok, state.last_error = True, now, None
            state.history.append((now, samples))
        else:
            state.up, state.last_error = False, detail
            state.errors += 1
        while state.history and state.history[0][0] < now - self.keep_s:
            state.history.popleft()
        if self.metrics is not None:
            self.metrics.observe(name, state.last_duration_s, kind)

    async def scrape_once(self, now: float | None = None) -> dict[str, float | None]:
        """One round: fetch every target, derive the key series, append one point. Returns it."""
        if self._client is None:
            await self.__aenter__()
        now = time.time() if now is None else now
        await asyncio.gather(*(self._fetch(s, now) for s in self.states))
        try:
            point, meta = derive(self.states, now, self.opts.rate_window_s)
        except Exception:
            log.exception("deriving the status series failed")
            point, meta = {}, {}
        try:
            self.problems = problems(self.states, now, self.opts.rate_window_s)
        except Exception:
            log.exception("reading the services' fault flags failed")
        point = {k: _finite(v) for k, v in point.items()}
        self.times.append(now)
        self.points.append(point)
        self.meta.update(meta)
        return point

    async def run(self) -> None:
        """Scrape forever, one round per interval (a slow round delays the next one, never overlaps)."""
        async with self:
            while True:
                started = time.monotonic()
                try:
                    await self.scrape_once()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("scrape round failed")
                await asyncio.sleep(max(0.05, self.opts.scrape_interval_s - (time.monotonic() - started)))

    def snapshot(self, since: float | None = None) -> dict:
        """The JSON of ``GET /api/series``: badges, what is wrong now, the time axis and one column per series."""
        idx = [i for i, t in enumerate(self.times) if since is None or t > since]
        keys = sorted({k for i in idx for k in self.points[i]})
        return {
            "now": time.time(),
            "interval_s": self.opts.scrape_interval_s,
            "rate_window_s": self.opts.rate_window_s,
            "meta": dict(self.meta),
            "targets": [s.badge() for s in self.states],
            "problems": self.problems,
            "t": [round(self.times[i], 3) for i in idx],
            "series": {k: [self.points[i].get(k) for i in idx] for k in keys},
        }
