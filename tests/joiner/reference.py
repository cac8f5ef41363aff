"""The offline reference join: the joiner's rules applied to whole streams, with no state machine.

Given the events in the order they were produced, it computes for every impression the example
the joiner must emit (or that sampling drops). Tests compare the online joiner against it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from aiokafka.partitioner import DefaultPartitioner

from joiner import sampling
from joiner.config import JoinConfig
from joiner.core import JOIN, JoinCore
from joiner.watermark import Watermark
from proto import Action, FeatureLog


def offline_join(
    events: Iterable[tuple[str, bytes, bytes]], cfg: JoinConfig, n_partitions: int
) -> dict[str, tuple[dict[str, float], float, int]]:
    """``example_id -> (labels, sample_rate, user_id)`` for every example the joiner emits.

    ``events`` are ``(kind, key, value)`` in production order with the default partitioner.
    Watermarks follow the joiner's rule (:mod:`joiner.watermark`); a feature log the features
    watermark had passed by more than W + L + R is refused (``expired_impressions``), and only
    the first feature log of an example id counts.
    """
    part = DefaultPartitioner()
    all_parts = list(range(n_partitions))
    k = cfg.watermark_outliers
    wf: dict[int, Watermark] = defaultdict(lambda: Watermark(k))
    wa: dict[int, Watermark] = defaultdict(lambda: Watermark(k))
    horizon = cfg.window_ms + cfg.lateness_ms + cfg.retention_ms
    impressions: dict[str, tuple[int, int, int, float]] = {}  # eid -> t, wf_before, user, rate
    actions: dict[str, list[tuple[int, int, str]]] = defaultdict(list)  # eid -> (time, wa_before, label)
    for kind, key, value in events:
        p = part(key, all_parts, all_parts)
        if kind == "features":
            fl = FeatureLog.FromString(value)
            rate = cfg.slice_sample_rates.get(fl.model_version.model_id, cfg.negative_sample_rate)
            wf_before = wf[p].value
            if wf_before <= fl.event_time_ms + horizon:
                for c in fl.candidates:
                    impressions.setdefault(f"{fl.request_id}/{c.item_id}", (fl.event_time_ms, wf_before, fl.user_id, rate))
            wf[p].observe(fl.event_time_ms)
        else:
            a = Action.FromString(value)
            if a.action_type in cfg.label_map:
                actions[f"{a.request_id}/{a.item_id}"].append((a.event_time_ms, wa[p].value, cfg.label_map[a.action_type]))
            wa[p].observe(a.event_time_ms)
    judge = JoinCore.judge.__get__(_Rules(cfg))
    out: dict[str, tuple[dict[str, float], float, int]] = {}
    labels = cfg.labels
    for eid, (t, wf_before, user, rate) in impressions.items():
        joined = {lbl for a_time, wa_before, lbl in actions.get(eid, ()) if judge(t, wf_before, a_time, wa_before) == JOIN}
        if joined:
            out[eid] = ({n: 1.0 if n in joined else 0.0 for n in labels}, 1.0, user)
        elif sampling.keep(eid, rate, cfg.seed):
            out[eid] = ({n: 0.0 for n in labels}, float(rate), user)
    return out


class _Rules:
    def __init__(self, cfg: JoinConfig) -> None:
        self.W, self.L, self.G, self.R = cfg.window_ms, cfg.lateness_ms, cfg.orphan_grace_ms, cfg.retention_ms
