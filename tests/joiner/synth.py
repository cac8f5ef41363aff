"""Test and benchmark traffic from real ml-1m rows: FeatureLog and Action streams in emission order.

Each ml-1m rating row becomes one /rank request at its real timestamp, scored with
``candidates`` items: the rated item plus random others. A rating >= 4 becomes a click on the
rated item after a seeded log-normal delay (median 20 s, long tail), so actions land behind later
impressions; a few other candidates get clicks too. To exercise every path of the joiner some
events are disturbed, all seeded: serving logs some feature logs late (their actions arrive
first), some actions are sent twice, and a few "stragglers" are delivered long after their event
time (late by the watermark). Until ``producers/replay.py`` lands this is the replay for tests.
"""

from __future__ import annotations

import heapq
from pathlib import Path

import numpy as np

from proto import Action, Candidate, FeatureLog, Features, ModelVersion, SparseSlot


def ml_events(
    n_requests: int,
    *,
    start: int = 0,
    candidates: int = 5,
    seed: int = 7,
    delay_median_s: float = 20.0,
    delay_sigma: float = 1.2,
    delay_max_s: float = 900.0,
    late_features_p: float = 0.05,
    late_features_s: float = 30.0,
    straggler_p: float = 0.02,
    straggler_s: float = 600.0,
    duplicate_p: float = 0.05,
    extra_click_p: float = 0.02,
    n_items: int = 3883,
    data_dir: Path = Path("var/data"),
) -> list[tuple[str, bytes, bytes]]:
    """``(kind, key, value)`` with kind ``"features"`` or ``"actions"``, key = request id."""
    from movielens.data import load

    ratings = load("ml-1m", data_dir).ratings.slice(start, n_requests)
    users = ratings.column("user_id").to_numpy()
    items = ratings.column("item_id").to_numpy()
    labels = ratings.column("label").to_numpy()
    ts = ratings.column("timestamp").to_numpy() * 1000
    rng = np.random.default_rng(seed)
    heap: list[tuple[int, int, str, bytes, bytes]] = []
    seq = 0

    def emit(at_ms: int, kind: str, key: bytes, value: bytes) -> None:
        nonlocal seq
        heapq.heappush(heap, (int(at_ms), seq, kind, key, value))
        seq += 1

    def delay_ms() -> int:
        d = min(rng.lognormal(np.log(delay_median_s), delay_sigma), delay_max_s)
        return int(d * 1000) + 1

    for row in range(len(users)):
        rid = f"q{start + row}"
        key = rid.encode()
        t = int(ts[row]) + row % 1000  # unique-ish millisecond times, same order
        uid = int(users[row])
        others = rng.integers(1, n_items + 1, size=candidates - 1)
        cand_items = [int(items[row])] + [int(x) for x in others if int(x) != int(items[row])]
        fl = FeatureLog(
            request_id=rid, event_time_ms=t, user_id=uid,
            context=Features(
                sparse={"user": SparseSlot(ids=[uid]), "hour": SparseSlot(ids=[(t // 3_600_000) % 24])},
                dense={"recency": float(row % 97) / 97.0},
            ),
            model_version=ModelVersion(model_id="deepfm", sparse_version=row // 100, dense_version=1),
            candidates=[
                Candidate(item_id=it, score=float(rng.random()),
                          features=Features(sparse={"item": SparseSlot(ids=[it])},
                                            dense={"pop": float(it % 101) / 101.0}))
                for it in cand_items
            ],
        )
        features_at = t + (int(late_features_s * 1000) if rng.random() < late_features_p else 0)
        emit(features_at, "features", key, fl.SerializeToString())
        clicked = [cand_items[0]] if labels[row] else []
        clicked += [it for it in cand_items[1:] if rng.random() < extra_click_p]
        for it in clicked:
            a_time = t + delay_ms()
            action = Action(request_id=rid, item_id=it, action_type="click", event_time_ms=a_time, user_id=uid)
            raw = action.SerializeToString()
            at = a_time + (int(straggler_s * 1000) if rng.random() < straggler_p else 0)
            emit(at, "actions", key, raw)
            if rng.random() < duplicate_p:
                emit(at + int(rng.integers(0, 5000)), "actions", key, raw)
    return [(kind, key, value) for _, _, kind, key, value in sorted(heap)]
