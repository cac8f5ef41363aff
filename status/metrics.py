"""The status page's own Prometheus metrics (``driftline_status_*``), one registry per app."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class StatusMetrics:
    """Scrape counts, errors, durations and the up state of every target."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.scrapes = Counter("driftline_status_scrapes_total", "Scrapes of a target's /metrics.", ["target"], registry=r)
        self.errors = Counter("driftline_status_scrape_errors_total",
                              "Failed scrapes, by kind (connect, timeout, http_status, parse).",
                              ["target", "kind"], registry=r)
        self.seconds = Histogram("driftline_status_scrape_seconds", "Duration of one scrape.", ["target"],
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5), registry=r)
        self.up = Gauge("driftline_status_target_up", "1 when the last scrape of the target succeeded.",
                        ["target"], registry=r)

    def observe(self, target: str, seconds: float, error_kind: str | None) -> None:
        self.scrapes.labels(target).inc()
        self.seconds.labels(target).observe(seconds)
        self.up.labels(target).set(0 if error_kind else 1)
        if error_kind:
            self.errors.labels(target, error_kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
