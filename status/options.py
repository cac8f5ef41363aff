"""The status page's settings, and which ``/metrics`` endpoints it scrapes.

:class:`StatusSettings` is meant to move into :mod:`services.settings` as ``Settings.status``
(environment variables ``DRIFTLINE_STATUS__<FIELD>``). Until it does, :func:`status_settings`
reads the same variables itself, so nothing changes for a user when it moves.

>>> s = StatusSettings()
>>> s.port, s.scrape_interval_s, s.history_points
(8500, 2.0, 900)
>>> parse_target("trainer=http://127.0.0.1:9103/metrics")
Target(name='trainer', url='http://127.0.0.1:9103/metrics')
>>> parse_target("http://127.0.0.1:8000/metrics")
Target(name='127.0.0.1:8000', url='http://127.0.0.1:8000/metrics')
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.settings import Settings


class StatusSettings(BaseModel):
    """The live status page (``driftline status``): what it scrapes, how often, how much it keeps."""

    host: str = "127.0.0.1"
    port: int = 8500
    scrape_interval_s: float = 2.0
    # Per-target timeout of one scrape; a slower target counts as down for that round.
    scrape_timeout_s: float = 1.5
    # Points kept per series (900 at 2 s: the last 30 minutes).
    history_points: int = 900
    # Rates and latency quantiles are computed over this much wall time of counter history.
    rate_window_s: float = 10.0
    # "name=url" or "url" entries; empty means every service `make up` runs (services.stack).
    targets: list[str] = Field(default_factory=list)


class _EnvStatusSettings(StatusSettings, BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DRIFTLINE_STATUS__", extra="ignore")


def status_settings(settings: Settings) -> StatusSettings:
    """``settings.status`` once it exists; until then the defaults with DRIFTLINE_STATUS__* applied."""
    found = getattr(settings, "status", None)
    if isinstance(found, BaseModel):
        return StatusSettings(**found.model_dump())
    return StatusSettings(**_EnvStatusSettings().model_dump())


@dataclass(frozen=True)
class Target:
    """One ``/metrics`` endpoint to scrape; ``name`` labels its badge and its series."""

    name: str
    url: str


def parse_target(spec: str) -> Target:
    """``name=url`` or a bare URL (then named by its host:port)."""
    name, sep, url = spec.partition("=")
    if not sep or "://" in name:
        url = spec
        name = urlsplit(url).netloc or url
    return Target(name.strip(), url.strip())


def default_targets(settings: Settings) -> list[Target]:
    """Every service ``make up`` starts that exports /metrics, at the URL the stack prints."""
    from services.stack import APP_SERVICES

    targets = []
    for service in APP_SERVICES:
        if service.name == "status":
            continue
        metrics_url = getattr(service, "metrics_url", None)  # /metrics on the service's own port
        if service.metrics_port is not None:
            targets.append(Target(service.name, f"http://127.0.0.1:{service.metrics_port(settings)}/metrics"))
        elif metrics_url is not None:
            targets.append(Target(service.name, metrics_url(settings)))
        else:
            targets += [Target(service.name, url) for label, url in service.urls(settings).items()
                        if label.endswith("metrics") and url.endswith("/metrics")]
    return targets


def resolve_targets(settings: Settings, opts: StatusSettings) -> list[Target]:
    """The configured targets, or the stack's when none are configured."""
    return [parse_target(t) for t in opts.targets] if opts.targets else default_targets(settings)
