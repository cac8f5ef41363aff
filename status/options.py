"""Which ``/metrics`` endpoints the status page scrapes. Its settings are
:class:`services.settings.StatusSettings` (``DRIFTLINE_STATUS__<FIELD>``).

>>> s = StatusSettings()
>>> s.port, s.scrape_interval_s, s.history_points
(8500, 2.0, 900)
>>> parse_target("trainer=http://127.0.0.1:9103/metrics")
Target(name='trainer', url='http://127.0.0.1:9103/metrics')
>>> parse_target("http://127.0.0.1:8000/metrics")
Target(name='127.0.0.1:8000', url='http://127.0.0.1:8000/metrics')
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

from services.api_keys import client_headers
from services.settings import Settings, StatusSettings


def status_settings(settings: Settings) -> StatusSettings:
    """The status page's section of the settings."""
    return settings.status


@dataclass(frozen=True)
class Target:
    """One ``/metrics`` endpoint to scrape; ``name`` labels its badge and its series."""

    name: str
    url: str
    #: request headers of its scrape: serving's API key (see :func:`with_serving_key`)
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)


def parse_target(spec: str) -> Target:
    """``name=url`` or a bare URL (then named by its host:port)."""
    name, sep, url = spec.partition("=")
    if not sep or "://" in name:
        url = spec
        name = urlsplit(url).netloc or url
    return Target(name.strip(), url.strip())


def default_targets(settings: Settings) -> list[Target]:
    """Every service ``make up`` starts that exports /metrics, at the URL the stack prints."""
    from driftline.stack import APP_SERVICES

    targets = []
    for service in APP_SERVICES:
        if service.name == "status":
            continue
        metrics_url = getattr(service, "metrics_url", None)  # /metrics on the service's own port
        if service.metrics_port is not None:
            port = service.metrics_port(settings)
            targets.append(Target(service.name, f"http://127.0.0.1:{port}/metrics"))
            if service.name == "trainer":  # rank r > 0 of a distributed trainer: its own port
                stride = settings.trainer.rank_metrics_port_stride
                targets += [Target(f"trainer-rank-{r}", f"http://127.0.0.1:{port + r * stride}/metrics")
                            for r in range(1, settings.trainer.nproc)]
        elif metrics_url is not None:
            targets.append(Target(service.name, metrics_url(settings)))
        else:
            targets += [Target(service.name, url) for label, url in service.urls(settings).items()
                        if label.endswith("metrics") and url.endswith("/metrics")]
    return targets


def resolve_targets(settings: Settings, opts: StatusSettings) -> list[Target]:
    """The configured targets, or the stack's when none are configured."""
    return [parse_target(t) for t in opts.targets] if opts.targets else default_targets(settings)


def with_serving_key(targets: list[Target], settings: Settings) -> list[Target]:
    """``targets`` with serving's API key (:mod:`services.api_keys`) on the scrape of serving:
    the target named ``serving``, or at ``serving.host:serving.port``. Its ``/metrics`` asks for
    the key when ``serving.protect_metrics`` is set; no other service sees it.

    >>> s = Settings().updated(serving={"api_keys": ["k"]})
    >>> [t.headers for t in with_serving_key([parse_target("http://127.0.0.1:8000/metrics"),
    ...                                       parse_target("http://127.0.0.1:9101/metrics")], s)]
    [(('Authorization', 'Bearer k'),), ()]
    """
    headers = tuple(client_headers(settings.serving).items())
    if not headers:
        return targets
    serving = f"{settings.serving.host}:{settings.serving.port}"
    return [replace(t, headers=headers) if t.name == "serving" or urlsplit(t.url).netloc == serving else t
            for t in targets]
