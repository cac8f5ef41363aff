"""The key series of the status page, derived from the services' raw Prometheus samples.

Each scrape round yields one point: ``{series key: value or None}``. ``None`` (a gap) means the
services that export the metric are down or have not exported it yet. Keys with a ``:`` carry a
label after it (``auc:deepfm``, ``table_rows:movie_id``); the page draws every key of a prefix as
one line of a chart.

Metrics used (all exported today):

=====================  =====================================================================
key                    source
=====================  =====================================================================
auc:<model>            driftline_trainer_auc{mode="online"}
baseline_auc:<model>   driftline_trainer_baseline_auc{baseline="counts"}: counting clicks, same examples
recent_auc:<model>     driftline_trainer_recent_auc{scorer="model"}: the same AUC over the recent examples
recent_counts_auc:<model>  driftline_trainer_recent_auc{scorer="recent_counts"}: counting recent clicks, there
loss:<model>           driftline_trainer_loss{mode="online"}
place_ratio:<place>    driftline_trainer_place_click_ratio, places 0-4 (a model with a position
                       feature: each place's click rate over the first place's; max over models)
event_time_s           driftline_trainer_event_time_ms (max), else the joiner's
                       driftline_joiner_watermark_ms{stream="actions"} (max over partitions)
train_rate:<model>     rate(driftline_trainer_examples_total{mode="online"})
rank_train_rate:<r>    rate(driftline_trainer_rank_examples_total), per rank of a distributed trainer
rank_comm_ms:<r>       rate(driftline_trainer_rank_comm_seconds_total) / rate(..._rank_steps_total):
                       ms per step in collectives, per rank
join_rate              rate(driftline_joiner_examples_produced_total)
rank_rps               rate(driftline_serving_requests_total{endpoint="/rank"}), all replicas
rank_error_rps         the same, status >= 500
rank_p50_ms/p99_ms     histogram quantile of driftline_serving_request_seconds{endpoint="/rank"}
sync_delay_p50_s/p99_s histogram quantile of driftline_trainer_sync_delay_seconds (3x window)
sync_bytes_per_s       rate(driftline_trainer_sync_bytes_sum), by kind (sparse/dense)
table_rows:<table>     driftline_trainer_table_rows (summed over models)
consumer_lag:<svc/topic>  driftline_consumer_lag_messages, summed over partitions
watermark_lag_s:<stream>  driftline_joiner_watermark_lag_seconds, max over partitions
model_version:<kind>   driftline_serving_model_version (min over replicas: what all serve)
staleness_s:<kind>     driftline_serving_model_staleness_seconds (max over replicas)
=====================  =====================================================================
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

from status.targets import Samples, TargetState

Labels = dict[str, str]
Match = Callable[[Labels], bool]

RANK = "/rank"
#: the places the page draws (the first five: where most of the clicks are)
PLACES_DRAWN = ("0", "1", "2", "3", "4")


def _all(_: Labels) -> bool:
    return True


def _values(samples: Samples, name: str, match: Match = _all) -> list[tuple[Labels, float]]:
    return [(lab, v) for lab, v in samples.get(name, ()) if match(lab)]


def _current(states: Iterable[TargetState]) -> list[Samples]:
    return [s for s in (st.current for st in states) if s is not None]


def _baseline(state: TargetState, now: float, window_s: float) -> tuple[float, Samples] | None:
    """The oldest successful scrape of ``state`` within ``window_s`` before ``now`` (not now's)."""
    if not state.up or len(state.history) < 2:
        return None
    for t, samples in state.history:
        if t >= now - window_s - 1e-6 and t < now:
            return t, samples
    return None


def increases(states: Iterable[TargetState], now: float, window_s: float, name: str,
              match: Match = _all, key: Callable[[Labels], str] = lambda _: "") -> tuple[dict[str, float], float] | None:
    """Increase of counter ``name`` per ``key(labels)``, summed over targets, and the longest span
    it covers. None when no target has two scrapes in the window. A counter that went down (a
    restarted service) counts from zero."""
    out: dict[str, float] = {}
    span = 0.0
    seen = False
    for st in states:
        base = _baseline(st, now, window_s)
        if base is None:
            continue
        t0, old = base
        cur = st.history[-1][1]
        if name not in cur:
            continue
        seen = True
        span = max(span, now - t0)
        before: dict[tuple, float] = {tuple(sorted(lab.items())): v for lab, v in _values(old, name, match)}
        for lab, v in _values(cur, name, match):
            prev = before.get(tuple(sorted(lab.items())), 0.0)
            k = key(lab)
            out[k] = out.get(k, 0.0) + (v - prev if v >= prev else v)
    return (out, span) if seen and span > 0 else None


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' ``histogram_quantile`` over cumulative bucket counts ``{le: count}``.

    >>> histogram_quantile(0.5, {1.0: 0, 2.0: 10, math.inf: 10})  # linear within (1, 2]
    1.5
    >>> histogram_quantile(0.99, {0.1: 5, 1.0: 5, math.inf: 10})  # in +Inf: the highest finite bound
    1.0
    >>> histogram_quantile(0.5, {0.1: 0, math.inf: 0}) is None
    True
    """
    les = sorted(buckets)
    if not les or les[-1] != math.inf:
        return None
    total = buckets[math.inf]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le in les:
        count = buckets[le]
        if count >= rank:
            if le == math.inf:
                finite = [x for x in les if x != math.inf]
                return finite[-1] if finite else None
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return None


def _window_quantiles(states: Sequence[TargetState], now: float, window_s: float, name: str,
                      match: Match, qs: Sequence[float]) -> list[float | None]:
    got = increases(states, now, window_s, f"{name}_bucket", match, key=lambda lab: lab.get("le", ""))
    if got is None:
        return [None] * len(qs)
    buckets = {float(le): v for le, v in got[0].items() if le}
    return [histogram_quantile(q, buckets) for q in qs]


def _rate(states: Sequence[TargetState], now: float, window_s: float, name: str, match: Match = _all,
          key: Callable[[Labels], str] = lambda _: "") -> dict[str, float] | None:
    got = increases(states, now, window_s, name, match, key)
    if got is None:
        return None
    deltas, span = got
    return {k: v / span for k, v in deltas.items()}


def _by(samples: list[Samples], name: str, key: Callable[[Labels], str], agg: Callable[[list[float]], float],
        match: Match = _all) -> dict[str, float]:
    groups: dict[str, list[float]] = {}
    for s in samples:
        for lab, v in _values(s, name, match):
            groups.setdefault(key(lab), []).append(v)
    return {k: agg(vs) for k, vs in groups.items()}


def _online(lab: Labels) -> bool:
    return lab.get("mode") == "online"


def _rank(lab: Labels) -> bool:
    return lab.get("endpoint") == RANK


def derive(states: Sequence[TargetState], now: float, window_s: float) -> tuple[dict[str, float | None], dict[str, str]]:
    """One point of every key series from the targets' current samples, and notes for the page."""
    cur = _current(states)
    point: dict[str, float | None] = {}
    meta: dict[str, str] = {}

    def put(prefix: str, values: dict[str, float] | None) -> None:
        for k, v in (values or {}).items():
            point[f"{prefix}:{k}" if k else prefix] = v

    model = lambda lab: lab.get("model", "")  # noqa: E731
    put("auc", _by(cur, "driftline_trainer_auc", model, max, _online))
    put("baseline_auc", _by(cur, "driftline_trainer_baseline_auc", model, max, lambda lab: lab.get("baseline") == "counts"))
    put("recent_auc", _by(cur, "driftline_trainer_recent_auc", model, max, lambda lab: lab.get("scorer") == "model"))
    put("recent_counts_auc", _by(cur, "driftline_trainer_recent_auc", model, max,
                                 lambda lab: lab.get("scorer") == "recent_counts"))
    put("loss", _by(cur, "driftline_trainer_loss", model, max, _online))
    put("place_ratio", _by(cur, "driftline_trainer_place_click_ratio", lambda lab: lab.get("place", ""), max,
                           lambda lab: lab.get("place", "") in PLACES_DRAWN))

    # Event time: the trainer's own progress when it exports it, else the joiner's action watermark.
    trainer_et = _by(cur, "driftline_trainer_event_time_ms", lambda _: "", max)
    joiner_et = _by(cur, "driftline_joiner_watermark_ms", lambda _: "", max, lambda lab: lab.get("stream") == "actions")
    if trainer_et:
        point["event_time_s"] = trainer_et[""] / 1000.0
        meta["event_time_source"] = "driftline_trainer_event_time_ms"
    elif joiner_et:
        point["event_time_s"] = joiner_et[""] / 1000.0
        meta["event_time_source"] = 'driftline_joiner_watermark_ms{stream="actions"}'

    put("train_rate", _rate(states, now, window_s, "driftline_trainer_examples_total", _online, model))
    put("join_rate", _rate(states, now, window_s, "driftline_joiner_examples_produced_total"))
    rank = lambda lab: lab.get("rank", "")  # noqa: E731
    put("rank_train_rate", _rate(states, now, window_s, "driftline_trainer_rank_examples_total", _all, rank))
    comm = _rate(states, now, window_s, "driftline_trainer_rank_comm_seconds_total", _all, rank) or {}
    steps = _rate(states, now, window_s, "driftline_trainer_rank_steps_total", _all, rank) or {}
    put("rank_comm_ms", {r: 1000 * c / steps[r] for r, c in comm.items() if steps.get(r)})

    reqs = _rate(states, now, window_s, "driftline_serving_requests_total", _rank,
                 lambda lab: "error" if lab.get("status", "").startswith("5") else "ok")
    if reqs is not None:
        point["rank_rps"] = sum(reqs.values())
        point["rank_error_rps"] = reqs.get("error", 0.0)
    p50, p99 = _window_quantiles(states, now, window_s, "driftline_serving_request_seconds", _rank, (0.5, 0.99))
    point["rank_p50_ms"] = None if p50 is None else 1000 * p50
    point["rank_p99_ms"] = None if p99 is None else 1000 * p99

    # The trainer observes sync delays only at each sync (every ~10 s): a longer window.
    d50, d99 = _window_quantiles(states, now, 3 * window_s, "driftline_trainer_sync_delay_seconds", _all, (0.5, 0.99))
    point["sync_delay_p50_s"], point["sync_delay_p99_s"] = d50, d99
    put("sync_bytes_per_s", _rate(states, now, 3 * window_s, "driftline_trainer_sync_bytes_sum", _all,
                                  lambda lab: lab.get("kind", "")))

    put("table_rows", _by(cur, "driftline_trainer_table_rows", lambda lab: lab.get("table", ""), sum))
    put("consumer_lag", _by(cur, "driftline_consumer_lag_messages",
                            lambda lab: f"{lab.get('service', '')}/{lab.get('topic', '')}", sum))
    put("watermark_lag_s", _by(cur, "driftline_joiner_watermark_lag_seconds", lambda lab: lab.get("stream", ""), max))

    kind = lambda lab: lab.get("kind", "")  # noqa: E731
    put("model_version", _by(cur, "driftline_serving_model_version", kind, min))
    put("staleness_s", _by(cur, "driftline_serving_model_staleness_seconds", kind, max))
    return point, meta
