"""Prometheus metrics of the serving tier (default registry, names prefixed ``driftline_serving_``).

A gauge's ``multiprocess_mode`` says how a replica of several processes reports it
(:mod:`serving.replica_metrics`): the model's versions, staleness and rate are whatever a process
set last (the PS applies; a worker refreshes them from the shared tables on a scrape); a spool's
backlog is per worker, so the live workers' values add up. A single process ignores it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)

REQUESTS = Counter(
    "driftline_serving_requests_total", "HTTP requests, by endpoint and status code.", ["endpoint", "status"]
)
LATENCY = Histogram(
    "driftline_serving_request_seconds", "HTTP request latency, by endpoint.", ["endpoint"],
    buckets=_LATENCY_BUCKETS,
)
CANDIDATES = Histogram(
    "driftline_serving_candidates_per_request", "Candidates scored per /rank request.",
    buckets=(1, 5, 10, 20, 50, 100, 200, 500, 1000, 2000),
)


def _model_gauge(name: str, doc: str, *labels: str) -> Gauge:
    """A gauge of the served model, by ``model_id`` and ``labels``: whatever a process set last."""
    return Gauge(name, doc, ["model_id", *labels], multiprocess_mode="mostrecent")


MODEL_VERSION = _model_gauge(
    "driftline_serving_model_version", "Version of the model being served, by kind (sparse/dense).", "kind")
SPARSE_VERSION = _model_gauge(
    "driftline_serving_sparse_version",
    "Sparse version served of each shard of the trainer's current layout (shard 0 alone for a "
    "one-process trainer); driftline_serving_model_version{kind=\"sparse\"} is their minimum.", "shard")
SHARD_COUNT = _model_gauge(
    "driftline_serving_sparse_shard_count", "Shard count of the sparse deltas served (0: a one-process trainer).")
DELTA_STALENESS = _model_gauge(
    "driftline_serving_model_staleness_seconds",
    "Now minus the publish time of the newest applied version, by kind.", "kind")
SAMPLE_RATE = _model_gauge(
    "driftline_serving_sample_rate",
    "Negative sample rate of the log-odds correction: the served model's rate for its slice (source "
    "slice), else over all slices (global), else 1.0 (unrecorded: its trainer recorded none).", "source")
DELTA_LAG = Histogram(
    "driftline_serving_delta_apply_lag_seconds",
    "Publish-to-applied delay of each parameter-delta chunk, by kind.", ["kind"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0),
)
DELTA_APPLY_SECONDS = Histogram(
    "driftline_serving_delta_apply_seconds", "Time to apply one parameter-delta chunk, by kind.",
    ["kind"], buckets=_LATENCY_BUCKETS,
)
DELTAS_APPLIED = Counter(
    "driftline_serving_deltas_applied_total", "Parameter-delta chunks applied, by kind.", ["kind"]
)
DELTAS_SKIPPED = Counter(
    "driftline_serving_deltas_skipped_total",
    "Parameter-delta chunks ignored, by reason (stale: older than the snapshot; other_model; "
    "unknown_table; bad_shape; bad_sample_rate; bad_shard: a shard outside its shard_count; "
    "wrong_shard: rows another shard owns; non_finite: a NaN or infinite value; failed: an error "
    "while applying). All but stale and other_model are dead-lettered.", ["reason"],
)
FEATURE_STORE_SECONDS = Histogram(
    "driftline_serving_feature_store_seconds", "Redis feature-store round trip, by operation.",
    ["op"], buckets=_LATENCY_BUCKETS,
)
FEATURE_STORE_ERRORS = Counter(
    "driftline_serving_feature_store_errors_total", "Failed feature-store operations, by operation.",
    ["op"],
)
FEATURE_LOG_SPOOLED = Counter(
    "driftline_serving_feature_log_spooled_total",
    "FeatureLogs written to the local spool (each one answered 200 after it).",
)
FEATURE_LOG_SHIPPED = Counter(
    "driftline_serving_feature_log_shipped_total",
    "FeatureLogs acknowledged by Kafka (re-shipped ones included).",
)
FEATURE_LOG_RESHIPPED = Counter(
    "driftline_serving_feature_log_reshipped_total",
    "Already shipped FeatureLogs sent again after a broker reset (they may have lived only in it).",
)
FEATURE_LOG_PENDING = Gauge(
    "driftline_serving_feature_log_pending", "FeatureLogs spooled and not yet acknowledged by Kafka.", multiprocess_mode="livesum"
)
FEATURE_LOG_UNSHIPPED_AGE = Gauge(
    "driftline_serving_feature_log_unshipped_age_seconds",
    "Wall seconds the oldest FeatureLog not yet acknowledged by Kafka has waited (0: none waits). "
    "Past the joiner's orphan grace (joiner.orphan_grace_seconds) it comes too late: its clicks are lost.",
    multiprocess_mode="max",
)
CLOCK_OFFSET = Gauge(
    "driftline_serving_clock_offset_seconds",
    "This replica's clock minus the feature store's (Redis TIME), in seconds: the event times serving stamps "
    "come from it, and a replica whose clock runs ahead closes the other replicas' join windows that much "
    "early (serving.clock_offset).",
    multiprocess_mode="mostrecent",
)
FEATURE_LOG_LATE = Gauge(
    "driftline_serving_feature_log_late",
    "1 while the oldest FeatureLog waiting to ship has waited past the joiner's orphan grace (the clicks on "
    "the feature logs that ship that late are lost), else 0 (the status page lists it).",
    multiprocess_mode="max",
)
FEATURE_LOG_SPOOL_BYTES = Gauge(
    "driftline_serving_feature_log_spool_bytes",
    "Bytes (keys + values) in the feature-log spool: unshipped and retained entries.",
    multiprocess_mode="livesum",
)
FEATURE_LOG_REFUSED = Counter(
    "driftline_serving_feature_log_refused_total",
    "/rank requests refused because their FeatureLog could not be kept, by reason (too_large: "
    "over serving.feature_log_max_bytes, 413; SpoolFull; SpoolError: 503).", ["reason"],
)
FEATURE_LOG_SPOOL_RECOVERIES = Counter(
    "driftline_serving_feature_log_spool_recoveries_total",
    "Times the feature-log spool was found damaged (at start or by the shipper) and went on in a fresh one "
    "with its readable unshipped entries (services.spool; the loss is logged).",
)
FEATURE_LOG_SEND_ERRORS = Counter(
    "driftline_serving_feature_log_send_errors_total",
    "Failed attempts to ship spooled FeatureLogs to Kafka (each is retried).",
)
FEATURE_LOG_UNSHIPPABLE = Counter(
    "driftline_serving_feature_log_unshippable_total",
    "Spooled FeatureLogs the broker refused for their size and that were skipped (a broker limit "
    "below serving.feature_log_max_bytes).",
)
SNAPSHOT_RELOADS = Counter(
    "driftline_serving_snapshot_reloads_total",
    "Models reloaded from a snapshot while serving (after a broker reset: the trainer's new-epoch "
    "snapshot).",
)
ACTIONS_PRODUCED = Counter(
    "driftline_serving_actions_produced_total", "Actions accepted by POST /actions."
)
ACTIONS_RESHIPPED = Counter(
    "driftline_serving_actions_reshipped_total",
    "Actions sent again after a broker reset (kept in the spool's retention: they may have lived only in it).",
)
REALTIME_UPDATES = Counter(
    "driftline_serving_realtime_updates_total", "Actions folded into real-time user features."
)
REALTIME_WITHOUT_USER = Counter(
    "driftline_serving_realtime_clicks_without_user_total",
    "Clicks read from actions without a user_id: they label their impression, but cannot be among any "
    "user's recent clicks (recent_items). Traffic without users has only these; otherwise send user_id.",
)
REALTIME_WAITS = Counter(
    "driftline_serving_realtime_store_refusals_total",
    "Times the recent-clicks reader found Redis taking no writes (full at maxmemory under noeviction, a "
    "replica, unable to persist) and waited to record its clicks again.",
)
UNKNOWN_FEATURES = Counter(
    "driftline_serving_unknown_features_total",
    "Features a /rank named that the model does not read, dropped (serving.unknown_features = "
    "ignore), by kind (sparse/dense).", ["kind"],
)
FEATURE_STORE_REFUSED = Counter(
    "driftline_serving_feature_store_unavailable_total",
    "/rank requests answered 503 because the feature store could not answer in time (down or overloaded)."
)
FEATURE_STORE_EMPTIED = Gauge(
    "driftline_serving_feature_store_emptied",
    "1 while the feature store has lost the features loaded into it (Redis restarted empty or was "
    "flushed: serving.store_watch); /rank answers are then marked degraded.",
    multiprocess_mode="livemax",
)
FEATURE_LOADS = Counter(
    "driftline_serving_feature_loads_total",
    "Features loads a watching load command (driftline features load --watch) ran, by reason: absent at "
    "its start, or lost (Redis restarted without them, or was flushed: serving.feature_keeper).", ["reason"],
)
FEATURE_LOAD_FAILURES = Counter(
    "driftline_serving_feature_load_failures_total",
    "Features loads of a watching load command that failed (tried again at its next read of the marker).",
)
FEATURES_LOADED = Gauge(
    "driftline_serving_features_loaded",
    "1 while a watching load command reads the features' load marker in the store, 0 while it is gone.",
    multiprocess_mode="livemax",
)
FEATURE_STORE_EVICTED = Gauge(
    "driftline_serving_feature_store_evicted",
    "1 while Redis has evicted keys since the features were loaded (maxmemory with an allkeys-* policy: "
    "serving.store_watch); /rank answers are then marked degraded.",
    multiprocess_mode="livemax",
)
SCORE_ONLY = Counter(
    "driftline_serving_score_only_total",
    "/rank answers asked for with \"log\": false: scored, no feature log written.",
)
FEATURE_LOGS_WITHHELD = Counter(
    "driftline_serving_feature_logs_withheld_total",
    "/rank answers whose feature log was not written because their features were defaults, by reason "
    "(feature-store: unreachable and the request allowed defaults; feature-store-emptied; "
    "feature-store-evicted).", ["reason"],
)
UNKNOWN_USERS = Counter(
    "driftline_serving_unknown_users_total", "/rank requests for users absent from the feature store."
)
AUTH = Counter(
    "driftline_serving_auth_total",
    "API-key checks of the endpoints that ask for a key (serving/auth.py), by outcome: ok, missing "
    "(401), wrong (403), anonymous (no key configured).", ["outcome"],
)


class RequestMetrics:
    """Pure-ASGI middleware: request count and latency per route template."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = {"code": 500}

        async def send_wrapper(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "other"
            REQUESTS.labels(endpoint, str(status["code"])).inc()
            LATENCY.labels(endpoint).observe(time.perf_counter() - started)
