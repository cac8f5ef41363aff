"""What is wrong now, in words: the fault flags the services export, for the top of the status page.

Each service says in a metric when it stopped doing its job or does it worse: a disk nearly full
pauses its input (:mod:`services.disk`), another consumer in the trainer's group pauses the trainer
(:mod:`trainer.group_share`), a feature store that lost its features or evicts keys makes serving
mark its answers degraded (:mod:`serving.store_watch`), serving's feature logs wait to ship past
the joiner's orphan grace (:mod:`serving.feature_log`), the joiner's or the trainer's output waits
for a broker that does not answer (:func:`services.kafka.send_until_answered`), a serving replica's
clock is off the others' (:mod:`serving.clock_offset`), the model follows a change in the traffic
slower than counting recent clicks does (:mod:`trainer.learned`), a joiner worker that took partitions over
rebuilds their state before it joins them (:mod:`joiner.faust_restore`), a parameter delta with
NaNs is refused (:mod:`serving.refused_deltas`), a record is dead-lettered, the broker's data was reset
(:mod:`services.broker_reset`). A chart does not show any of it: a flat line looks the same whether
its service is idle or stuck. :func:`problems` reads the latest scrape of every target (the
gauges) and the rate window (the counters' increase) and returns one line per problem and target,
and one for a target that answered before and stopped (one that never answered is starting);
``/api/series`` carries them and the page lists them above its charts.

>>> from status.options import Target
>>> trainer = TargetState(Target("trainer", "http://t/metrics"), up=True)
>>> trainer.history.append((10.0, {"driftline_trainer_group_partitions_elsewhere": [({}, 2.0)],
...                                "driftline_disk_paused": [({"service": "trainer"}, 0.0)]}))
>>> for p in problems([trainer], now=10.0, window_s=30.0):
...     print(p["target"], "|", p["problem"])
trainer | another consumer in the trainer's group holds 2 partitions of the examples: the trainer learns and publishes nothing until it leaves
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from status.series import Labels, Match, increases
from status.targets import TargetState

__all__ = ["problems"]


def _all(_: Labels) -> bool:
    return True


@dataclass(frozen=True)
class Flag:
    """A gauge that means trouble while ``bad(value)``; ``text`` is formatted with the sample's
    labels and ``n``, its value."""

    metric: str
    text: str
    bad: Callable[[float], bool] = lambda v: v > 0


@dataclass(frozen=True)
class Surge:
    """A counter whose increase over the rate window means trouble; ``text`` is formatted with
    ``n`` (the increase), ``window`` (seconds) and ``what`` (``key`` of the labels that grew)."""

    metric: str
    text: str
    match: Match = _all
    key: Callable[[Labels], str] = lambda _: ""


FLAGS = (
    Flag("driftline_disk_paused", "the disk under {service}'s data is nearly full: it takes no input until "
         "space is freed"),
    Flag("driftline_trainer_group_partitions_elsewhere", "another consumer in the trainer's group holds {n:.0f} "
         "partitions of the examples: the trainer learns and publishes nothing until it leaves"),
    Flag("driftline_trainer_claim_partitions_elsewhere", "another trainer reads the same examples under the "
         "same trainer group (a one-process trainer beside a set of ranks, or two sets) and claims {n:.0f} "
         "partitions: both learn and publish nothing until one leaves"),
    Flag("driftline_trainer_offset_commits_refused", "the broker refuses the trainer's offset commits: the "
         "ranks' group has a member (a consumer that is no trainer, or one gone without leaving), or the broker "
         "does not answer them; training goes on, the snapshots hold the offsets"),
    Flag("driftline_offset_commits_unanswered", "{service}'s offset commits get no answer from the broker (a "
         "topic it reads deleted under it, or the broker unreachable): it goes on without them"),
    Flag("driftline_serving_feature_store_emptied", "the feature store lost the loaded features (Redis "
         "restarted empty or was flushed): answers are marked degraded and not logged for training"),
    Flag("driftline_serving_feature_store_evicted", "Redis evicted keys since the features were loaded: "
         "answers are marked degraded and not logged for training"),
    Flag("driftline_serving_feature_log_late", "feature logs have waited to ship past the joiner's orphan grace "
         "(Kafka unreachable from a serving replica, or too slow): the clicks on those that ship that late are lost"),
    Flag("driftline_joiner_send_waiting_seconds", "examples and join state have waited {n:.0f} s for the broker to "
         "answer (hung, or unreachable from the joiner): they are sent again until it does",
         bad=lambda v: v >= 5),
    Flag("driftline_trainer_publish_waiting_seconds", "parameter deltas have waited {n:.0f} s for the broker to "
         "answer (hung, or unreachable from the trainer): serving gets them once it does", bad=lambda v: v >= 5),
    Flag("driftline_serving_clock_offset_seconds", "this replica's clock is {n:.0f} s off the feature store's "
         "(ahead: it closes the other replicas' join windows that much early, their later clicks learned as "
         "negatives; behind: its own impressions come late for the join): set the clocks right (NTP)",
         bad=lambda v: abs(v) >= 60),
    Flag("driftline_trainer_trails_recent_counts", "the model's AUC on the recent examples is {n:.3f} below that "
         "of counting their recent clicks ({model}): it follows the change in the traffic slower than counting "
         "does; a cap on its tables' Adagrad accumulators (optimizer max_accumulator) makes it follow faster",
         bad=lambda v: v >= 0.01),
    Flag("driftline_joiner_changelog_rebuild_remaining", "rebuilding the join state of partitions it took over "
         "from the changelog: {n:.0f} records left; those partitions join nothing until it is done"),
)
SURGES = (
    Surge("driftline_serving_deltas_skipped_total", "parameter-delta chunks refused in the last {window:.0f} s: "
          "{n:.0f} ({what}), dead-lettered; the served model keeps its last good version",
          match=lambda lab: lab.get("reason") not in ("stale", "other_model"), key=lambda lab: lab.get("reason", "")),
    Surge("driftline_serving_feature_store_unavailable_total", "/rank requests answered 503 in the last {window:.0f} s "
          "because the feature store did not answer in time: {n:.0f}"),
    Surge("driftline_trainer_non_finite_deltas_total", "parameter versions not published in the last {window:.0f} s "
          "because a value was NaN or infinite: {n:.0f}"),
    Surge("driftline_trainer_snapshots_unreadable_total", "damaged snapshots a restore skipped for older ones in the "
          "last {window:.0f} s: {n:.0f}"),
    Surge("driftline_dead_letters_total", "records dead-lettered in the last {window:.0f} s: {n:.0f} ({what})",
          key=lambda lab: f"{lab.get('topic', '?')}: {lab.get('kind', '?')}"),
    Surge("driftline_joiner_reused_request_ids_total", "impressions under request ids another user's /rank already "
          "used, in the last {window:.0f} s: {n:.0f}; they are dropped and a click on one joins the first user's "
          "features: leave request_id out of /rank (serving names each request) or make it unique"),
    Surge("driftline_broker_resets_total", "the broker's data was reset (a new epoch): the services follow it"),
    Surge("driftline_broker_reset_lost_total", "records that lived only in the broker when it was reset: "
          "{n:.0f} ({what})",
          key=lambda lab: lab.get("topic", "?")),
)


class _Fill(dict):
    """Labels for a sentence; one the sample lacks reads ``?`` (a service of another version)."""

    def __missing__(self, key: str) -> str:
        return "?"


def problems(states: Sequence[TargetState], now: float, window_s: float) -> list[dict[str, str]]:
    """``[{"target": name, "problem": sentence}]`` for every flag up and every surge in the window,
    target by target; a target that answered before and does not now is one line (its flags are
    not read)."""
    out = []
    for st in states:
        cur = st.current
        if cur is None:
            if st.up is False and st.last_ok is not None:  # (one that never answered yet is starting: its badge)
                out.append({"target": st.target.name, "problem": f"stopped answering {now - st.last_ok:.0f} s ago "
                                                                  f"({st.last_error})"})
            continue
        for flag in FLAGS:
            for labels, v in cur.get(flag.metric, ()):
                if flag.bad(v):
                    out.append({"target": st.target.name, "problem": flag.text.format_map(_Fill(labels, n=v))})
        for surge in SURGES:
            got = increases([st], now, window_s, surge.metric, surge.match, surge.key)
            grown = {k: n for k, n in (got[0] if got else {}).items() if n > 0}
            if grown:
                text = surge.text.format(n=sum(grown.values()), window=window_s, what=", ".join(sorted(grown)))
                out.append({"target": st.target.name, "problem": text})
    return out
