"""Prometheus metrics every service shares, and the ``/metrics`` endpoint for non-HTTP services.

Service-specific metrics live next to the code that updates them; the ones here are about the
plumbing that every service has: consuming, producing and rejecting messages.
"""

from __future__ import annotations

import errno

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server

from services.ports import Listen, PortInUse

MESSAGES_CONSUMED = Counter(
    "driftline_messages_consumed_total",
    "Messages consumed and decoded, by service and topic.",
    ["service", "topic"],
)
MESSAGES_PRODUCED = Counter(
    "driftline_messages_produced_total",
    "Messages produced, by service and topic.",
    ["service", "topic"],
)
DEAD_LETTERS = Counter(
    "driftline_dead_letters_total",
    "Malformed messages rejected and written to the dead-letter topic, by reason kind.",
    ["service", "topic", "kind"],
)
CONSUMER_LAG = Gauge(
    "driftline_consumer_lag_messages",
    "High watermark minus position, per consumed partition.",
    ["service", "topic", "partition"],
    multiprocess_mode="mostrecent",  # a serving replica's one delta consumer (serving.replica_metrics)
)
COMMIT_SECONDS = Histogram(
    "driftline_offset_commit_seconds",
    "Time to commit consumer offsets.",
    ["service"],
)
BROKER_RESETS = Counter(
    "driftline_broker_resets_total",
    "Resets of the broker's data (a new broker epoch) noticed by a running service.",
    ["service"],
)
BROKER_RESET_LOST = Counter(
    "driftline_broker_reset_lost_total",
    "Records that lived only in the broker when its data was reset (not yet consumed by this "
    "service, by the consumer's last known high watermark), by service and topic.",
    ["service", "topic"],
)
KAFKA_CONNECT_FAILURES = Counter(
    "driftline_kafka_connect_failures_total",
    "Kafka clients that could not connect (unreachable, TLS refused, SASL login failed), by "
    "kafka.security_protocol: each also logs why.",
    ["security_protocol"],
)
SERVICE_UP = Gauge("driftline_service_up", "1 while the service runs.", ["service"], multiprocess_mode="livemax")


def serve_metrics(port: int, host: str | None = None) -> int:
    """Expose the default registry on ``http://host:port/metrics``; port 0 picks a free one.

    The host defaults to ``settings.metrics_host``. Returns the bound port. A taken port is a
    :class:`~services.ports.PortInUse` (one line; the ``driftline`` command exits with
    ``IN_USE_EXIT``, which the supervisor does not restart).
    """
    if host is None:
        from services.settings import get_settings

        host = get_settings().metrics_host
    try:
        server, _thread = start_http_server(port, addr=host, registry=REGISTRY)
    except OSError as err:
        if err.errno != errno.EADDRINUSE:
            raise
        raise PortInUse(Listen(host, port, "this service's /metrics", "metrics_port").explained("is in use")) from None
    return int(server.server_address[1])
