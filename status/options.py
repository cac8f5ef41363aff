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

from collections.abc import Sequence
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


def resolve_targets(opts: StatusSettings, default: Sequence[Target] = ()) -> list[Target]:
    """The configured targets (``status.targets``), else ``default``: ``driftline status`` gives
    every service of the stack ``driftline up`` runs (:func:`driftline.stack.status_targets`)."""
    return [parse_target(t) for t in opts.targets] if opts.targets else list(default)


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
