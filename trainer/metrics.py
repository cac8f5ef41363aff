"""The trainer's Prometheus metrics (prefix ``driftline_trainer_``) and streaming AUC (the bookkeeping
that updates them per batch learned: :mod:`trainer.learned`)."""

from __future__ import annotations

import numpy as np
from prometheus_client import Counter, Gauge, Histogram

EXAMPLES = Counter("driftline_trainer_examples_total", "Examples trained on.", ["model", "mode"])
EXAMPLES_PER_S = Gauge("driftline_trainer_examples_per_second", "Recent training rate.", ["model", "mode"])
AUC = Gauge("driftline_trainer_auc", "Progressive-validation (online) or per-pass AUC.", ["model", "mode"])
LOSS = Gauge("driftline_trainer_loss", "Recent mean log loss.", ["model", "mode"])
LOG_LOSS = Gauge("driftline_trainer_log_loss", "Progressive mean log loss since the stream began: the model's scores "
                 "before it learned each example (scorer=model), and the counting baseline's on the same examples "
                 "(scorer=counts).", ["model", "scorer"])
BASELINE_AUC = Gauge("driftline_trainer_baseline_auc", "Progressive AUC of a naive baseline on the examples the model "
                     "learns, in the same order: per-user + per-item click-rate counts, and per place for a model "
                     "with a position feature (baseline=counts, "
                     "trainer/count_baseline.py). A model below it has not learned its features yet.",
                     ["model", "baseline"])
RECENT_AUC = Gauge("driftline_trainer_recent_auc", "Progressive AUC over the recent examples: each example's weight "
                   "halves every trainer.recent_half_life examples after it (driftline_trainer_auc counts every "
                   "example alike, and hardly moves once the stream is long). scorer=model: the model; counts: the "
                   "lifetime click-rate counts (driftline_trainer_baseline_auc's); recent_counts: click rates "
                   "counted with the same half-life, a baseline that follows a change in the traffic at once.",
                   ["model", "scorer"])
TRAILS_RECENT_COUNTS = Gauge("driftline_trainer_trails_recent_counts", "How far the model's recent AUC is below that "
                             "of counting recent clicks (0 when it is not, or before two half-lives of examples): the "
                             "model follows a change in the traffic slower than counting does (trainer/learned.py).",
                             ["model"])
PLACE_CLICK_RATIO = Gauge("driftline_trainer_place_click_ratio", "For a model with a position feature: the click "
                          "rate of the examples shown at each place (0 = first; the first 20 places) over that of "
                          "the first place, since the stream began (trainer/count_baseline.py): how much less an item "
                          "is clicked further down the list.", ["model", "place"])
BAD_EXAMPLES = Counter("driftline_trainer_bad_examples_total", "Examples rejected and dead-lettered.", ["model", "reason"])
DUPLICATES = Counter("driftline_trainer_duplicate_examples_total", "Examples skipped as duplicates.", ["model"])
SYNC_BYTES = Histogram("driftline_trainer_sync_bytes", "Bytes per parameter sync.", ["model", "kind"],
                       buckets=(1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9))
SYNC_SECONDS = Histogram("driftline_trainer_sync_seconds", "Duration of a parameter sync.", ["model", "kind"])
PUBLISH_WAITING = Gauge("driftline_trainer_publish_waiting_seconds",
                        "How long the parameter deltas being published have waited for the broker to answer "
                        "(0 when not waiting).", ["model"])
NON_FINITE_DELTAS = Counter("driftline_trainer_non_finite_deltas_total",
                            "Parameter versions not published because a value was NaN or infinite.", ["model", "kind"])
_DELAY_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 30, 60, 300)
SYNC_DELAY = Histogram("driftline_trainer_sync_delay_seconds",
                       "Wall delay from an example's arrival on the examples topic (its Kafka record timestamp; "
                       "the trainer's poll time when the record has none) to its update being published as a "
                       "delta. Observed per sync: the p50, p95 and max of that sync's examples.",
                       ["model"], buckets=_DELAY_BUCKETS)
EVENT_FRESHNESS = Histogram("driftline_trainer_event_freshness_seconds",
                            "Wall delay from an example's event time to its update being published as a delta "
                            "(freshness end to end for live traffic; in a replay of old data it is the data's "
                            "age). Observed per sync: the p50, p95 and max of that sync's examples.",
                            ["model"], buckets=_DELAY_BUCKETS)
EVENT_TIME = Gauge("driftline_trainer_event_time_ms",
                   "Event time (ms since the epoch) of the newest example applied to the model.", ["model"])
GROUP_ELSEWHERE = Gauge("driftline_trainer_group_partitions_elsewhere",
                        "Partitions of the examples topic that another member of the one-process trainer's "
                        "consumer group holds: above 0, it trains and publishes nothing (one trainer per group).")
COMMITS_REFUSED = Gauge("driftline_trainer_offset_commits_refused",
                        "1 while the broker refuses the trainer's offset commits: the ranks commit as no member of "
                        "the trainer's group, which is accepted only while the group has no member (another consumer "
                        "in it, or one gone without leaving), or a commit did not come back (the examples topic "
                        "deleted under the trainer, or the broker unreachable); "
                        "training goes on, the snapshots hold the offsets.")
CLAIM_ELSEWHERE = Gauge("driftline_trainer_claim_partitions_elsewhere",
                        "Partitions of the examples topic that another trainer (a one-process trainer, or rank 0 "
                        "of another set of ranks) with the same trainer.group_id holds in the trainers' claim group "
                        "<group_id>.claim.<topic>: above 0, this trainer trains and publishes nothing (trainer.claim).")
TABLE_SIZE = Gauge("driftline_trainer_table_rows", "Rows per PS table.", ["model", "table"])
PS_ADMITTED = Counter("driftline_ps_admitted_total", "Ids admitted into a PS table (rows created by training).",
                      ["model", "table"])
PS_EVICTED = Counter("driftline_ps_evicted_total", "PS table rows removed by TTL expiry.", ["model", "table"])
SNAPSHOTS = Counter("driftline_trainer_snapshots_total", "Snapshots written.", ["model"])
SNAPSHOTS_UNREADABLE = Counter("driftline_trainer_snapshots_unreadable_total",
                               "Snapshots a restore found damaged and skipped for an older one.", ["model"])
# the MixCache (trainer.cache_rows): written_back counts rows copied to the host PS before deltas, snapshots,
# evictions. Per process: rank "" for the 1-process trainer (as no label in PromQL), a rank's number on N ranks
CACHE_ROWS = Counter("driftline_trainer_cache_rows_total", "MixCache rows by event: lookup, hit, written_back, admitted, evicted.",
                     ["model", "rank", "event"])
COPY_BYTES = Counter("driftline_trainer_device_copy_bytes_total", "Bytes copied host to device and back (trainer.device), by "
                     "direction: h2d, d2h.", ["model", "rank", "direction"])
STAGE_SECONDS = Counter("driftline_trainer_stage_seconds_total",
                        "Time per training stage: online poll/prepare (validate, dedup, assemble)/train/"
                        "wait_train/commit/sync/snapshot; batch lookup/forward/backward/update.",
                        ["model", "stage"])

# One rank of a distributed trainer (trainer.dist.rank_trainer) each: every rank exports on its own port
RANK_EXAMPLES = Counter("driftline_trainer_rank_examples_total", "Examples trained on by one rank.", ["model", "rank"])
RANK_STEPS = Counter("driftline_trainer_rank_steps_total",
                     "Distributed training steps of one rank (steps where every rank was idle excluded).",
                     ["model", "rank"])
RANK_COMM_SECONDS = Counter("driftline_trainer_rank_comm_seconds_total",
                            "Seconds one rank's steps spent in collectives: the all_to_all of ids, rows and "
                            "gradients and the dense all_reduce (waiting for slower ranks included).", ["model", "rank"])
RANK_ALLTOALL_BYTES = Counter("driftline_trainer_rank_alltoall_bytes_total",
                              "Bytes one rank sent to other ranks through all_to_all (ids, rows, gradients).",
                              ["model", "rank"])

DIST_MODE_SWITCHES = Counter("driftline_trainer_dist_mode_switches_total",
                             "Switches of the online ranks' distributed mode (dist_mode auto, or the project file's "
                             "dist_mode changed), by the mode switched to; counted by rank 0 (the group switches as one).", ["model", "to"])
META_TASKS = Counter("driftline_trainer_meta_tasks_total", "model.meta (trainer/meta.py): tasks (new ids of the task "
                     "slot) opened, filled (support + query seen) and dropped unfilled past max_open_tasks.",
                     ["model", "event"])
META_STEPS = Counter("driftline_trainer_meta_outer_steps_total", "model.meta's outer steps, taken or skipped "
                     "(a non-finite gradient, or the step raised).", ["model", "outcome"])
DENSE_INPUT = Gauge("driftline_trainer_dense_input", "The dense inputs' running statistics as published (after the "
                    "model's dense_scaling transform: trainer.dense_scaling): mean, std and the examples they weigh; a "
                    "feature whose mean moves is a stream whose unit or traffic changed.", ["model", "feature", "stat"])


def dense_input(model_id: str, features: list[str], head: object) -> None:
    """Export the head's dense scaler statistics (:data:`DENSE_INPUT`; nothing without a scaler)."""
    s = getattr(head, "scaler", None)
    if s is None:
        return
    count = float(s.count.detach()[0])
    for name, mean, var in zip(features, s.mean.detach().cpu().tolist(), s.var.detach().cpu().tolist(), strict=True):
        DENSE_INPUT.labels(model_id, name, "mean").set(mean)
        DENSE_INPUT.labels(model_id, name, "std").set(var ** 0.5)
        DENSE_INPUT.labels(model_id, name, "examples").set(count)


def rank_steps(model_id: str, rank: int, steps: int, comm_s: float, alltoall_bytes: int) -> None:
    """Count a rank's steps since the last call: how many, their seconds in collectives, bytes sent."""
    r = str(rank)
    RANK_STEPS.labels(model_id, r).inc(steps)
    RANK_COMM_SECONDS.labels(model_id, r).inc(comm_s)
    RANK_ALLTOALL_BYTES.labels(model_id, r).inc(alltoall_bytes)


def ps_admitted(model_id: str) -> int:
    """What :data:`PS_ADMITTED` counted for ``model_id`` in this process, over its tables."""
    return int(sum(s.value for m in PS_ADMITTED.collect() for s in m.samples
                   if s.name.endswith("_total") and s.labels.get("model") == model_id))


class PSCounts:
    """Exports the PS tables' admission/eviction counts as :data:`PS_ADMITTED` / :data:`PS_EVICTED`:
    ``update()`` after a step or an expiry pass adds what each table counted since the last call.
    The counts are the tables' own (since their shards were built: restored tables start at 0), so
    make a new one for new tables. ``model``: its device copies and cache too (:data:`COPY_BYTES`,
    :data:`CACHE_ROWS`; a :class:`trainer.model.SparseModel` or a rank's
    :class:`trainer.dist.model.DistributedModel`, labelled ``rank``)."""

    def __init__(self, model_id: str, tables: dict, model=None, rank: int | None = None):
        self.model_id = model_id
        self.rank = "" if rank is None else str(rank)
        self._seen: dict[str, tuple[int, int]] = {}
        self._device_seen: dict[str, int] = {}
        self.tables = tables
        self.model = model
        for name in tables:  # the series exist (at 0) from the start
            PS_ADMITTED.labels(model_id, name)
            PS_EVICTED.labels(model_id, name)

    def update(self) -> None:
        for name, t in self.tables.items():
            a0, e0 = self._seen.get(name, (0, 0))
            a, e = t.admitted, t.evicted
            if a > a0:
                PS_ADMITTED.labels(self.model_id, name).inc(a - a0)
            if e > e0:
                PS_EVICTED.labels(self.model_id, name).inc(e - e0)
            self._seen[name] = (a, e)
        if self.model is not None:
            self._device()

    def _device(self) -> None:
        ios, cache = self.model.transfers, self.model.cache
        counts = [(COPY_BYTES, "h2d", sum(io.h2d_bytes for io in ios)), (COPY_BYTES, "d2h", sum(io.d2h_bytes for io in ios))]
        if cache is not None:
            st = cache.stats
            counts += [(CACHE_ROWS, event, n) for event, n in (
                ("lookup", st.lookups), ("hit", st.hits), ("written_back", st.written_back),
                ("admitted", st.admitted), ("evicted", st.evicted))]
        for metric, label, n in counts:  # the labels differ across the two metrics
            seen = self._device_seen.get(label, 0)
            if n > seen:
                metric.labels(self.model_id, self.rank, label).inc(n - seen)
            self._device_seen[label] = n


class StreamingAUC:
    """AUC from fixed-bin histograms of scores (exact up to the bin width): O(1) memory, mergeable,
    snapshot-able. ``half_life`` (examples; None: every example counts alike) weighs recent examples
    more: each example's weight halves every ``half_life`` labelled examples that come after it
    (per batch: a batch's examples share one weight).

    >>> recent, always = StreamingAUC(half_life=50), StreamingAUC()
    >>> for a in (recent, always):  # a model that ranked 1,000 examples well, then 200 badly
    ...     a.update(np.array([0.9, 0.1] * 500), np.array([1.0, 0.0] * 500))
    ...     a.update(np.array([0.1, 0.9] * 100), np.array([1.0, 0.0] * 100))
    >>> round(always.value(), 3), round(recent.value(), 3)
    (0.833, 0.238)
    """

    def __init__(self, bins: int = 4096, half_life: float | None = None):
        self.bins = bins
        self.half_life = half_life
        self.pos = np.zeros(bins, np.float64)
        self.neg = np.zeros(bins, np.float64)

    def update(self, scores: np.ndarray, labels: np.ndarray) -> None:
        """Count a batch (NaN labels: not counted)."""
        labels = np.asarray(labels, np.float64)
        known = ~np.isnan(labels)
        b = np.clip((np.asarray(scores, np.float64)[known] * self.bins).astype(np.int64), 0, self.bins - 1)
        y = labels[known] > 0.5
        if self.half_life is not None:
            keep = 0.5 ** (b.size / self.half_life)
            self.pos *= keep
            self.neg *= keep
        self.pos += np.bincount(b[y], minlength=self.bins)
        self.neg += np.bincount(b[~y], minlength=self.bins)

    def value(self) -> float:
        p, n = self.pos.sum(), self.neg.sum()
        if p == 0 or n == 0:
            return float("nan")
        neg_below = np.cumsum(self.neg) - self.neg
        return float((self.pos * (neg_below + 0.5 * self.neg)).sum() / (p * n))

    def state(self) -> dict:
        return {"pos": self.pos, "neg": self.neg}

    def load(self, pos, neg) -> None:
        self.pos, self.neg = np.asarray(pos, np.float64).copy(), np.asarray(neg, np.float64).copy()


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    a = StreamingAUC(1 << 16)
    a.update(scores, labels)
    return a.value()
