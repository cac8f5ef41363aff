"""The joiner's Prometheus metrics (all ``driftline_joiner_*``), updated once per batch."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

NEGATIVES = Counter("driftline_joiner_negatives_total", "Windows closed without a positive, by outcome.", ["outcome"])
LATE = Counter("driftline_joiner_late_actions_total", "Actions for a closed window, by reason.", ["reason"])
LOOKUPS = Counter("driftline_joiner_lookups_total", "Waiting-state lookups by tier: cache, disk, miss.", ["tier"])
SPILLED = Counter("driftline_joiner_spilled_total", "Impressions evicted from the memory cache (they stay on disk).")
WAITING = Gauge("driftline_joiner_waiting_impressions", "Impressions whose window is open, by tier.", ["tier"])
PENDING = Gauge("driftline_joiner_pending_actions", "Actions waiting for their features.")
WATERMARK = Gauge("driftline_joiner_watermark_ms", "Event-time watermark, by stream and partition.", ["stream", "partition"])
WATERMARK_LAG = Gauge(
    "driftline_joiner_watermark_lag_seconds",
    "Wall clock minus event-time watermark (large during replays; growth means the joiner falls behind).",
    ["stream", "partition"],
)
JOIN_LATENCY = Histogram(
    "driftline_joiner_join_latency_seconds",
    "From the broker timestamp of the record that completed a join to the positive being acknowledged.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
BATCH_SECONDS = Histogram("driftline_joiner_batch_seconds", "Wall time per batch (join + produce + commit).")
IDLE_ADVANCES = Counter(
    "driftline_joiner_idle_advances_total",
    "Action watermarks raised because an actions partition was idle (idle_advance_seconds).",
)
EXAMPLES = Counter("driftline_joiner_examples_produced_total",
                   "Examples produced, in batch records (incl. re-emissions after a crash).")
BAD_EXAMPLES = Counter("driftline_joiner_bad_examples_total",
                       "Examples left out of their batch record as invalid (services.example_batch rules), by reason.",
                       ["reason"])
CHANGELOG_BYTES = Counter("driftline_joiner_changelog_bytes_total",
                          "Key + value bytes written to the state changelog (uncompressed, acknowledged).")
SEND_WAITING = Gauge("driftline_joiner_send_waiting_seconds",
                     "How long the examples or state changes being sent have waited for the broker to answer "
                     "(0 when not waiting).")
OUTPUT_SPOOL_BYTES = Gauge("driftline_joiner_output_spool_bytes",
                           "Bytes of produced example records kept to produce again after a broker reset.")
CHANGELOG_RESTORED = Counter("driftline_joiner_changelog_restored_total",
                             "State changelog records applied to the local stores: rebuilding a partition "
                             "(active: a takeover, a lost disk) or following one as its standby.", ["kind"])
REBUILD_REMAINING = Gauge("driftline_joiner_changelog_rebuild_remaining",
                         "State changelog records left to apply before the partitions this worker took "
                         "(a takeover, a lost disk) are rebuilt and join again; 0 when none is rebuilding.")
STORES_SET_ASIDE = Counter("driftline_joiner_stores_set_aside_total",
                           "Partition stores found damaged at start, moved aside and rebuilt from the changelog.")
OUTPUT_RESENT = Counter("driftline_joiner_output_resent_total",
                        "Example records produced again into a broker whose data was reset.")

# what the consumer found wrong with an input partition, by input topic
REROUTED, INPUT_GAPS, INPUT_UNREAD = (Counter(f"driftline_joiner_{name}_total", doc, ["topic"]) for name, doc in (
    ("rerouted", "Input records found on another partition than murmur2 of their key (a producer with "
     "another partitioner, e.g. librdkafka's default), forwarded to that partition."),
    ("input_gaps", "Input records the consumer went past unread: sought back and read."),
    ("input_offsets_unread", "Input offsets the broker returns no record at (retention, a hole: tansu quirk 8)."),
))

#: a batch's count -> its counter (:func:`publish` adds a batch's counts)
_COUNTERS = {name: Counter(metric, doc) for name, metric, doc in (
    ("impressions", "driftline_joiner_impressions_total", "Impressions (candidates of feature logs) consumed."),
    ("duplicate_impressions", "driftline_joiner_duplicate_impressions_total", "Impressions seen again and ignored."),
    ("reused_request_ids", "driftline_joiner_reused_request_ids_total",
     "Impressions under a request id and item another user's feature log already used (a client reusing "
     "request ids in /rank): dropped, and a click on one joins the first user's impression."),
    ("expired_impressions", "driftline_joiner_expired_impressions_total",
     "Impressions refused: the features watermark had passed them by more than W + L + R, so their "
     "tombstone may be gone and they cannot be told from a repeat (a re-sent or re-read feature log)."),
    ("actions", "driftline_joiner_actions_total", "Actions consumed."),
    ("unmapped_actions", "driftline_joiner_unmapped_actions_total", "Actions whose type maps to no label."),
    ("joins", "driftline_joiner_joined_actions_total", "Actions joined to their impression."),
    ("duplicate_actions", "driftline_joiner_duplicate_actions_total", "Repeated actions, ignored (idempotent)."),
    ("positives", "driftline_joiner_positives_total", "Positive examples emitted."),
    ("orphan_actions", "driftline_joiner_orphan_actions_total", "Actions whose features never came (dropped)."),
    ("corrections", "driftline_joiner_corrections_total", "Correction examples for late actions (late_policy=correction)."),
    ("extra_labels", "driftline_joiner_extra_labels_total", "Second action types after an immediate positive (dropped)."),
)}


def publish(counts: dict[str, int]) -> None:
    """Add a batch's counts to the counters."""
    for name, metric in _COUNTERS.items():
        n = counts.get(name)
        if n:
            metric.inc(n)
    for outcome, name in (("emitted", "negatives"), ("sampled_out", "negatives_sampled_out")):
        if counts.get(name):
            NEGATIVES.labels(outcome).inc(counts[name])
    for name, n in counts.items():
        if n and name.startswith("bad_examples_"):
            BAD_EXAMPLES.labels(name[len("bad_examples_"):]).inc(n)
    for reason in ("late", "expired", "out_of_window"):
        if counts.get(f"late_{reason}"):
            LATE.labels(reason).inc(counts[f"late_{reason}"])
