"""What `make chaos` (``bench/chaos.py``) works out from its capture after a run: why an example
is missing, what the join's own rules give on what the broker served, and where the broker served
two records under one offset (tansu quirk 8).

``capture`` is chaos's ``Capture``: ``topic_log`` (every input record read: topic ``"f"``/``"a"``,
broker epoch, partition, offset, request id (an action: ``request/item``), event time, an
action's type), ``features`` (request id -> (key, first copy stripped to the join's fields, event
time)), ``actions``, ``feature_epoch``, ``action_epoch`` and ``epochs``.

>>> offsets_with_two_records([("a", 1, 0, 5, "r/1", 10, "click"), ("a", 1, 0, 5, "r/2", 11, "click"),
...                           ("a", 1, 0, 6, "r/3", 12, "click"), ("a", 1, 0, 6, "r/3", 12, "click")])
1
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

from joiner.config import JoinConfig
from joiner.core import JoinCore
from joiner.stores.memory import MemoryStore
from joiner.tiered import TieredState
from joiner.worker import OPENED
from proto import Action, FeatureLog

_OPENED = re.compile(re.escape(OPENED).replace("%d", r"(-?\d+)").replace("%s", r"(\{.*?\})"))


def restored_watermarks(joiner_log: str) -> dict[int, dict[int, tuple[int, int]]]:
    """``epoch -> partition -> (features, actions)``: the event-time watermarks a joiner worker
    restored at each broker reset, from the lines it logs when it opens a partition
    (:data:`joiner.worker.OPENED`). Per partition, the distinct watermarks of the opens with no
    input offsets (a state that has read nothing from the broker it runs on), in order: the first
    is the empty state of the stack's first start, the (n+1)-th what the worker re-seeded at the
    n-th reset. Those include what the worker read from the killed broker and the capture never
    did: a replay that starts the new epoch from them judges lateness as the worker could.

    >>> text = "\\n".join([OPENED % (0, {}, -9, -9), OPENED % (0, {"features": 9}, 50, 40),
    ...                     OPENED % (0, {}, 70, 60), OPENED % (0, {}, 70, 60), OPENED % (1, {}, -9, -9)])
    >>> restored_watermarks(text)
    {1: {0: (70, 60)}}
    """
    seen: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for m in _OPENED.finditer(joiner_log):
        p, offsets, wf, wa = int(m[1]), m[2], int(m[3]), int(m[4])
        if offsets == "{}" and (wf, wa) not in seen[p]:
            seen[p].append((wf, wa))
    out: dict[int, dict[int, tuple[int, int]]] = defaultdict(dict)
    for p, marks in seen.items():
        for epoch, mark in enumerate(marks[1:], start=1):
            out[epoch][p] = mark
    return dict(out)


def replay_join(capture: Any, cfg: JoinConfig,
                restored: dict[int, dict[int, tuple[int, int]]] | None = None) -> dict[str, bool]:
    """``example id -> positive`` for every example :class:`joiner.core.JoinCore` emits when the
    captured input topics are replayed through it: per partition, the first broker's records then
    the new one's, each topic in offset order (the first record read at an offset), the two
    topics in alternating chunks (the join's decisions do not depend on that interleaving), every
    window drained at the end. Unlike the reference (``offline_join``: each record's first copy
    only), it sees every copy, as the worker does, so it tells the worker's losses apart from the
    broker's (tansu quirk 8).

    ``restored`` (:func:`restored_watermarks`) raises the watermarks at the start of each new
    epoch to those the worker restored: the capture tails the topics a little behind, and what
    the killed broker served the worker and not yet the capture moved the worker's watermarks
    (its clicks then judged late, its feature logs expired) without reaching the replay."""
    streams: dict[tuple, dict[int, object]] = defaultdict(dict)
    for row in capture.topic_log:
        topic, epoch, p, offset, rid_item = row[:5]
        if offset in streams[(epoch, p, topic)]:
            continue
        if topic == "f":
            value = FeatureLog.FromString(capture.features[rid_item][1])
        else:
            rid, item = rid_item.rsplit("/", 1)
            value = Action(request_id=rid, item_id=int(item), action_type=row[6], event_time_ms=row[5])
        streams[(epoch, p, topic)][offset] = value
    marks = {(epoch, p): mark for epoch, parts in (restored or {}).items() for p, mark in parts.items()}
    out: dict[str, bool] = {}
    for p in sorted({key[1] for key in streams}):
        core = JoinCore(TieredState(MemoryStore(), 1 << 30), cfg)
        core.load(p)
        for epoch in range(capture.epochs + 1):
            if (epoch, p) in marks:
                wf, wa = marks[(epoch, p)]
                core.wmf[p].raise_to(wf)
                core.wma[p].raise_to(wa)
                core.wf[p], core.wa[p] = core.wmf[p].value, core.wma[p].value
                core.advance(p)
            fls = [v for _, v in sorted(streams.get((epoch, p, "f"), {}).items())]
            acts = [v for _, v in sorted(streams.get((epoch, p, "a"), {}).items())]
            for i in range(0, max(len(fls), len(acts)), 50):
                for fl in fls[i:i + 50]:
                    core.on_features(p, fl)
                for a in acts[i:i + 50]:
                    core.on_action(p, a)
                core.advance(p)
        core.advance(p, drain=True)
        for e in core.take():
            if not e[7]:  # (not a late-action correction)
                out.setdefault(e[2].decode(), bool(e[4]))
    return out


def offsets_with_two_records(topic_log: list[tuple]) -> int:
    """How many (topic, epoch, partition, offset) the capture read two different records at."""
    ids: dict[tuple, set] = defaultdict(set)
    for row in topic_log:
        ids[row[:4]].add(row[4:6])
    return sum(1 for v in ids.values() if len(v) > 1)


def at_two_record_offsets(topic_log: list[tuple], eids: set[str]) -> set[str]:
    """The example ids among ``eids`` whose feature log or action the capture first read at an
    offset where it also read another record (tansu quirk 8): a reader that tracks offsets, as the
    joiner does, got one of the two, so the broker lost the other for it.

    >>> log = [("f", 1, 0, 3, "r", 10, ""), ("a", 1, 0, 4, "r/7", 12, "click"), ("a", 1, 0, 4, "q/2", 9, "click"),
    ...        ("f", 1, 0, 5, "s", 11, ""), ("a", 1, 0, 6, "s/1", 13, "click")]
    >>> sorted(at_two_record_offsets(log, {"r/7", "s/1"}))
    ['r/7']
    """
    ids: dict[tuple, set] = defaultdict(set)
    first: dict[tuple, tuple] = {}
    for row in topic_log:
        ids[row[:4]].add(row[4:6])
        first.setdefault((row[0], row[4]), row[:4])
    two = {k for k, v in ids.items() if len(v) > 1}
    return {e for e in eids if first.get(("f", e.rsplit("/", 1)[0])) in two or first.get(("a", e)) in two}


def missing_detail(capture: Any, ref: dict, missing: set[str], t_of: dict) -> dict[str, dict]:
    """Per missing example id: the reference's labels, where its feature log and actions came
    from (broker epochs) and their event times; the run's work dir keeps it (chaos-missing.json)."""
    acts: dict[str, list] = defaultdict(list)
    for k in capture.actions:
        acts[f"{k[0]}/{k[1]}"].append(k)
    out = {}
    for eid in sorted(missing):
        rid = eid.rsplit("/", 1)[0]
        labels = ref[eid][0]
        a = acts.get(eid, [])
        label = "positive" if any(labels.values()) else "negative"
        out[eid] = {
            "labels": labels, "sample_rate": ref[eid][1], "feature_epoch": capture.feature_epoch.get(rid),
            "event_time_ms": t_of[rid][0], "partition": t_of[rid][1],
            "actions": [{"type": k[2], "event_time_ms": k[3], "epoch": capture.action_epoch[k]} for k in a],
            "origin": f"{label} f{capture.feature_epoch.get(rid)} a{sorted({capture.action_epoch[k] for k in a})}",
        }
    return out
