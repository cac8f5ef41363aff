"""``driftline replay``: MovieLens replayed in event-time order, as a live product would emit it.

Each rating is an impression. The ratings one user gave in the same second form one request: one
``FeatureLog`` on topic ``features`` whose candidates are those items. Every positive (rating >= 4)
also produces an ``Action`` ("click") on topic ``actions``, a seeded log-normal delay after its
impression (median ~20 s, tail to minutes), and reaches the broker after a further small
transport jitter, so actions arrive interleaved with later impressions and out of event-time
order among themselves, as real client logs do.

Both topics are keyed by request id: with equal partition counts, a request's features and
actions land on the same partition number, which lets the joiner scale by partitions.

Event times are checked at this edge like at serving's (``settings.event_time``): an event outside
``[now - max_past_s, now + max_future_s]`` goes to ``dead-letters`` with the reason instead of the
topics. The data is years old by design, so the replay widens the past bound to the data's age
(:func:`replay_event_time_bounds`) unless ``DRIFTLINE_EVENT_TIME__MAX_PAST_S`` sets it.

The whole plan is computed with numpy (a few arrays of the dataset's length), and messages are
encoded lazily while producing, so memory stays bounded by the dataset's arrays, not by messages.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from movielens.data import load
from movielens.features import MovieLensFeatures
from proto import Action, DeadLetter, FeatureLog, ModelVersion
from services import metrics
from services.codecs import event_time_error
from services.kafka import create_topics, producer, start_client
from services.settings import ReplaySettings, Settings

REPLAY_MODEL_ID = "replay"


@dataclass(frozen=True)
class ReplayPlan:
    """Requests and actions of a dataset slice, in emission order.

    Requests: ``request_start[i]:request_start[i+1]`` index the candidates (``item_id``) of
    request i, made by ``request_user[i]`` at ``request_time_ms[i]``. Actions: ``action_request``
    and ``action_item`` name the impression clicked at ``action_time_ms``. ``order`` interleaves
    both: a value v < n_requests is request v, else action v - n_requests.
    """

    request_start: np.ndarray
    request_user: np.ndarray
    request_time_ms: np.ndarray
    item_id: np.ndarray
    action_request: np.ndarray
    action_item: np.ndarray
    action_time_ms: np.ndarray
    order: np.ndarray
    emit_time_ms: np.ndarray

    @property
    def n_requests(self) -> int:
        return len(self.request_user)

    @property
    def n_actions(self) -> int:
        return len(self.action_request)

    @property
    def n_messages(self) -> int:
        return len(self.order)


def request_id(user_id: int, time_ms: int) -> str:
    """Deterministic request ids make replays reproducible and joins checkable offline."""
    return f"u{user_id}-t{time_ms}"


def make_plan(
    user_id: np.ndarray,
    item_id: np.ndarray,
    timestamp_s: np.ndarray,
    label: np.ndarray,
    config: ReplaySettings,
) -> ReplayPlan:
    """Group ratings into requests and schedule the positives' actions (all vectorized)."""
    time_ms = timestamp_s.astype(np.int64) * 1000
    # Stable: ratings of one request keep their dataset order.
    by_request = np.lexsort((user_id, time_ms))
    user_id, item_id, time_ms, label = user_id[by_request], item_id[by_request], time_ms[by_request], label[by_request]
    new_request = np.ones(len(user_id), dtype=bool)
    new_request[1:] = (user_id[1:] != user_id[:-1]) | (time_ms[1:] != time_ms[:-1])
    starts = np.flatnonzero(new_request)
    request_of_row = np.cumsum(new_request) - 1

    rng = np.random.default_rng(config.seed)
    positive = np.flatnonzero(label > 0)
    delay_ms = np.minimum(
        rng.lognormal(np.log(config.action_delay_median_s), config.action_delay_sigma, len(positive)),
        config.action_delay_max_s,
    ) * 1000
    action_time = time_ms[positive] + np.maximum(delay_ms, 1).astype(np.int64)
    transport_jitter = rng.exponential(2000.0, len(positive)).astype(np.int64)

    emit = np.concatenate([time_ms[starts], action_time + transport_jitter])
    order = np.argsort(emit, kind="stable")  # requests first on ties: they were concatenated first
    return ReplayPlan(
        request_start=np.append(starts, len(user_id)),
        request_user=user_id[starts],
        request_time_ms=time_ms[starts],
        item_id=item_id,
        action_request=request_of_row[positive],
        action_item=item_id[positive],
        action_time_ms=action_time,
        order=order,
        emit_time_ms=emit[order],
    )


PAST_BOUND_VAR = "DRIFTLINE_EVENT_TIME__MAX_PAST_S"


def replay_event_time_bounds(settings: Settings, oldest_ms: int, now_ms: int) -> tuple[float, float]:
    """``(max_past_s, max_future_s)`` for replaying data whose oldest event is at ``oldest_ms``:
    the past bound grows to the data's age plus a day, unless the environment set it.

    >>> s = Settings()
    >>> replay_event_time_bounds(s, oldest_ms=0, now_ms=10 * 86_400_000)
    (950400.0, 300.0)
    """
    past = settings.event_time.max_past_s
    if PAST_BOUND_VAR not in os.environ:
        past = max(past, (now_ms - oldest_ms) / 1000 + 86_400)
    return past, settings.event_time.max_future_s


@dataclass(frozen=True)
class Refused:
    """Events of a plan refused at the edge, as masks over its requests and its actions."""

    requests: np.ndarray
    actions: np.ndarray

    @classmethod
    def check(cls, plan: ReplayPlan, now_ms: int, max_past_s: float, max_future_s: float) -> Refused:
        lo, hi = now_ms - max_past_s * 1000, now_ms + max_future_s * 1000
        requests = (plan.request_time_ms < lo) | (plan.request_time_ms > hi)
        # An action of a refused request has nothing to join: refused with it.
        actions = (plan.action_time_ms < lo) | (plan.action_time_ms > hi) | requests[plan.action_request]
        return cls(requests, actions)


def _dead_letter(topic: str, key: bytes, value: bytes, reason: str) -> bytes:
    return DeadLetter(source_topic=topic, partition=-1, offset=-1, key=key, value=value, reason=reason,
                      consumer="replay", rejected_at_ms=int(time.time() * 1000)).SerializeToString()


def load_plan(dataset: str, data_dir: Path, config: ReplaySettings, limit: int | None = None) -> tuple[ReplayPlan, MovieLensFeatures]:
    ratings, users, items = load(dataset, data_dir)
    if limit is not None:
        ratings = ratings.slice(0, limit)
    plan = make_plan(
        ratings["user_id"].to_numpy(),
        ratings["item_id"].to_numpy(),
        ratings["timestamp"].to_numpy(),
        ratings["label"].to_numpy(),
        config,
    )
    return plan, MovieLensFeatures(users, items)


def encode_messages(
    plan: ReplayPlan, features: MovieLensFeatures, topics: tuple[str, str],
    refused: Refused | None = None, dead_letters: str = "dead-letters", now_ms: int = 0,
    bounds: tuple[float, float] = (0.0, 0.0),
) -> Iterator[tuple[str, bytes, bytes, int]]:
    """Yield ``(topic, key, value, emit_time_ms)`` in emission order; a ``refused`` event is
    yielded on ``dead_letters`` as a DeadLetter with its reason."""
    features_topic, actions_topic = topics
    bad_requests = refused.requests if refused is not None else None
    bad_actions = refused.actions if refused is not None else None
    version = FeatureLog(model_version=ModelVersion(model_id=REPLAY_MODEL_ID)).SerializeToString()
    n_requests = plan.n_requests
    starts = plan.request_start
    for position, v in enumerate(plan.order.tolist()):
        emit = int(plan.emit_time_ms[position])
        if v < n_requests:
            user = int(plan.request_user[v])
            t = int(plan.request_time_ms[v])
            rid = request_id(user, t)
            head = FeatureLog(request_id=rid, event_time_ms=t, user_id=user).SerializeToString()
            # Protobuf merges concatenated fields: pre-encoded context and candidates just append.
            parts = [head, version, features.context_field_bytes(user)]
            parts += [features.candidate_field_bytes(i) for i in plan.item_id[starts[v] : starts[v + 1]].tolist()]
            if bad_requests is not None and bad_requests[v]:
                reason = f"invalid: {event_time_error(t, now_ms, *bounds)}"
                yield dead_letters, rid.encode(), _dead_letter(features_topic, rid.encode(), b"".join(parts), reason), emit
                continue
            yield features_topic, rid.encode(), b"".join(parts), emit
        else:
            a = v - n_requests
            r = int(plan.action_request[a])
            user = int(plan.request_user[r])
            rid = request_id(user, int(plan.request_time_ms[r]))
            action = Action(
                request_id=rid,
                item_id=int(plan.action_item[a]),
                action_type="click",
                event_time_ms=int(plan.action_time_ms[a]),
                user_id=user,
            )
            if bad_actions is not None and bad_actions[a]:
                why = event_time_error(action.event_time_ms, now_ms, *bounds) or "its request was refused"
                yield dead_letters, rid.encode(), _dead_letter(actions_topic, rid.encode(),
                                                               action.SerializeToString(), f"invalid: {why}"), emit
                continue
            yield actions_topic, rid.encode(), action.SerializeToString(), emit


def replay_events(
    settings: Settings, dataset: str = "ml-1m", limit: int | None = None, seed: int | None = None
) -> Iterator[tuple[str, bytes, bytes]]:
    """The replay's messages as ``(topic, key, value)``, without a broker (for tests and references)."""
    config = settings.replay if seed is None else settings.replay.model_copy(update={"seed": seed})
    plan, features = load_plan(dataset, settings.data_dir, config, limit)
    for topic, key, value, _ in encode_messages(plan, features, (settings.topics.features, settings.topics.actions)):
        yield topic, key, value


async def replay(
    settings: Settings,
    dataset: str | None = None,
    speed: float | None = None,
    limit: int | None = None,
    progress: bool = True,
) -> dict[str, float]:
    """Produce the dataset to Kafka, paced at ``speed``× event time (0 = as fast as possible)."""
    config = settings.replay
    dataset = dataset or config.dataset
    speed = config.speed if speed is None else speed
    limit = config.limit if limit is None else limit
    plan, features = load_plan(dataset, settings.data_dir, config, limit)
    now_ms = int(time.time() * 1000)
    oldest = int(min(plan.request_time_ms.min(initial=now_ms), plan.action_time_ms.min(initial=now_ms)))
    bounds = replay_event_time_bounds(settings, oldest, now_ms)
    refused = Refused.check(plan, now_ms, *bounds)
    await create_topics(settings)
    p = producer(settings)
    await start_client(p, settings)
    topics = (settings.topics.features, settings.topics.actions)
    dead_letters = settings.topics.dead_letters
    produced = {topics[0]: 0, topics[1]: 0, dead_letters: 0}
    pending: list[asyncio.Future] = []
    started = time.perf_counter()
    first_emit = int(plan.emit_time_ms[0]) if plan.n_messages else 0
    bar = tqdm(total=plan.n_messages, unit="msg", disable=not progress, smoothing=0.05, mininterval=0.5)
    try:
        messages = encode_messages(plan, features, topics, refused, dead_letters, now_ms, bounds)
        for n, (topic, key, value, emit) in enumerate(messages):
            if speed > 0 and n % 64 == 0:
                ahead = (emit - first_emit) / 1000.0 / speed - (time.perf_counter() - started)
                if ahead > 0:
                    await asyncio.sleep(ahead)
            # Record timestamps stay wall-clock: event time (years ago) would trip retention on Kafka.
            pending.append(await p.send(topic, value, key=key))
            produced[topic] += 1
            if len(pending) >= 5000:
                await asyncio.gather(*pending)
                bar.update(len(pending))
                bar.set_postfix_str(time.strftime("%Y-%m-%d %H:%M", time.gmtime(emit / 1000)), refresh=False)
                pending.clear()
        await asyncio.gather(*pending)
        bar.update(len(pending))
    finally:
        bar.close()
        await p.stop()
    seconds = time.perf_counter() - started
    for topic, count in produced.items():
        metrics.MESSAGES_PRODUCED.labels("replay", topic).inc(count)
    if produced[dead_letters]:
        metrics.DEAD_LETTERS.labels("replay", topics[0], "invalid").inc(int(refused.requests.sum()))
        metrics.DEAD_LETTERS.labels("replay", topics[1], "invalid").inc(int(refused.actions.sum()))
    total = produced[topics[0]] + produced[topics[1]]
    return {
        "requests": plan.n_requests,
        "impressions": int(plan.request_start[-1]),
        "feature_logs": produced[topics[0]],
        "actions": produced[topics[1]],
        "refused": produced[dead_letters],
        "messages": total,
        "seconds": round(seconds, 3),
        "messages_per_s": round(total / seconds, 1) if seconds else 0.0,
    }
