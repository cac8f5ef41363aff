"""``driftline traffic``: MovieLens replayed *through the serving tier*, as a product's clients would.

Where ``driftline replay`` writes FeatureLogs and Actions straight to Kafka, this driver is the
client: for each request of the plan (:func:`producers.replay.make_plan`: the ratings one user
gave in one second) it calls ``POST /rank`` with the user and the request's items as candidates,
so the FeatureLog the joiner sees is the one *serving* logged: serving's request id, serving's
features (Redis), serving's model version. After the data's delay (the plan's log-normal action
delay plus transport jitter, paced at ``speed``× event time) it posts the clicks the data says
happened to ``POST /actions`` with the request id serving returned.

Event time follows the data, not the wall clock: each ``/rank`` carries ``event_time_ms`` (the
rating's timestamp) and each action its planned event time, so the joiner's windows (event time)
close as fast as the replay runs. A serving build whose ``RankRequest`` has no ``event_time_ms``
(checked in ``/openapi.json``) stamps FeatureLogs with the wall clock; the driver then sends actions
without an event time too (serving stamps them "now"), so both streams share one clock. In that
mode a 900 s join window is 900 *wall* seconds and negatives only appear after it: say so loudly.

Bounded concurrency: at most ``concurrency`` HTTP calls in flight on one keep-alive
:class:`httpx.AsyncClient`; the plan waits when serving falls behind (no unbounded queue).
Clicks due in the same pacing step go out as one ``/actions`` call (up to 500 per call).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import numpy as np
from prometheus_client import Counter, Gauge, Histogram
from tqdm import tqdm

from movielens.data import load
from producers.drivers import ReplayStats, add_arguments, driver_settings
from producers.join_report import default_urls, with_join_report
from producers.replay import ReplayPlan, make_plan
from services.api_keys import client_headers
from services.cli_args import at_least, fraction, run_main, tcp_port
from services.settings import Settings

log = logging.getLogger(__name__)

SERVICE = "traffic"
ACTIONS_PER_CALL = 500

CALLS = Counter("driftline_traffic_calls_total", "HTTP calls the traffic driver made to serving, by endpoint and outcome.",
                ["endpoint", "outcome"])
CALL_SECONDS = Histogram("driftline_traffic_call_seconds", "Client-side latency of the driver's calls, by endpoint.",
                         ["endpoint"], buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5))
EVENT_TIME = Gauge("driftline_traffic_event_time_ms", "Event time (data time) the driver has reached.")
SERVED_VERSION = Gauge("driftline_traffic_served_sparse_version", "Sparse model version in the latest /rank response.")


class ServingUnavailable(RuntimeError):
    """Serving did not become ready in time (one line for the CLI)."""


@dataclass
class _Stats(ReplayStats):
    rank_latency_s: list[float] = field(default_factory=list)
    first_version: int | None = None
    last_version: int = 0
    event_time_ms: int = 0


def plan_after(settings: Settings, dataset: str, start_fraction: float = 0.0,
               limit: int | None = None, start_rating: int | None = None) -> tuple[ReplayPlan, int]:
    """The replay plan of the ratings after the first ``start_fraction`` (in time order; or from
    index ``start_rating``), at most ``limit`` of them, and the index of the first one.
    ``trainer batch --limit <that index>`` trains on exactly the ratings before it."""
    ratings = load(dataset, settings.data_dir).ratings
    start = int(len(ratings) * start_fraction) if start_rating is None else start_rating
    ratings = ratings.slice(start, limit)
    plan = make_plan(ratings["user_id"].to_numpy(), ratings["item_id"].to_numpy(),
                     ratings["timestamp"].to_numpy(), ratings["label"].to_numpy(), settings.replay)
    return plan, start


async def wait_ready(client: httpx.AsyncClient, timeout_s: float) -> dict:
    """Poll ``/readyz`` until serving has a model; returns its body."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        with contextlib.suppress(httpx.TransportError):
            r = await client.get("/readyz")
            if r.status_code == 200:
                return r.json()
            last = f"HTTP {r.status_code} {r.text[:200]}"
        if time.monotonic() > deadline:
            raise ServingUnavailable(f"serving at {client.base_url} not ready after {timeout_s:.0f} s ({last})")
        await asyncio.sleep(0.25)


async def rank_accepts_event_time(client: httpx.AsyncClient) -> bool:
    """Whether this serving build's ``RankRequest`` has an ``event_time_ms`` field."""
    try:
        r = await client.get("/openapi.json")
        schema = r.json()["components"]["schemas"]["RankRequest"]
    except (httpx.HTTPError, KeyError, ValueError):
        return False
    return "event_time_ms" in schema.get("properties", {})


async def _post(client: httpx.AsyncClient, endpoint: str, body: dict, retries: int) -> httpx.Response | None:
    """POST with retries on 503 and connection errors (a serving restart); None when it gave up."""
    for attempt in range(retries + 1):
        t0 = time.perf_counter()
        try:
            r = await client.post(endpoint, json=body)
        except httpx.TransportError as err:
            outcome, detail = "transport_error", repr(err)
        else:
            CALL_SECONDS.labels(endpoint).observe(time.perf_counter() - t0)
            if r.status_code < 300:
                CALLS.labels(endpoint, "ok").inc()
                return r
            outcome, detail = f"http_{r.status_code}", r.text[:200]
            if r.status_code != 503:
                CALLS.labels(endpoint, outcome).inc()
                log.warning("%s -> %s", endpoint, detail)
                return None
        CALLS.labels(endpoint, outcome).inc()
        if attempt < retries:
            await asyncio.sleep(min(0.25 * 2**attempt, 4.0))
    log.warning("%s failed after %d attempts: %s", endpoint, retries + 1, detail)
    return None


async def drive(
    settings: Settings,
    dataset: str | None = None,
    speed: float | None = None,
    limit: int | None = None,
    start_fraction: float = 0.0,
    concurrency: int = 16,
    *,
    base_url: str | None = None,
    start_rating: int | None = None,
    progress: bool = False,
    ready_timeout_s: float = 180.0,
    # ~2.5 minutes of back-off (capped at 4 s): a serving restart or a broker restart under it.
    retries: int = 40,
    report_every_s: float = 10.0,
) -> dict:
    """Replay ``dataset`` after ``start_fraction`` through serving; returns stats (see :func:`main`)."""
    dataset = dataset or settings.replay.dataset
    speed = settings.replay.speed if speed is None else speed
    base_url = base_url or f"http://{settings.serving.host}:{settings.serving.port}"
    plan, start = plan_after(settings, dataset, start_fraction, limit, start_rating)
    stats = _Stats()
    sem = asyncio.Semaphore(concurrency)
    # A request's id is known once its /rank answered; only requests that get clicks need it.
    clicks_left = np.bincount(plan.action_request, minlength=plan.n_requests)
    request_ids: dict[int, asyncio.Future[str | None]] = {}
    tasks: set[asyncio.Task] = set()
    answered = open(settings.replay.answered_log, "a", buffering=1) if settings.replay.answered_log else None
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=httpx.Timeout(30.0),
                                 headers=client_headers(settings.serving)) as client:  # serving's API key, if set
        ready = await wait_ready(client, ready_timeout_s)
        data_time = await rank_accepts_event_time(client)
        if data_time:
            log.info("serving ready (model %s); event time follows the data", ready.get("model_version"))
        else:
            log.warning("serving's RankRequest has no event_time_ms: FeatureLogs get wall-clock event time, "
                        "so actions are sent without one too; join windows then close in wall time")

        async def rank(v: int) -> None:
            try:
                user = int(plan.request_user[v])
                items = plan.item_id[plan.request_start[v]:plan.request_start[v + 1]].tolist()
                body: dict = {"user_id": user, "candidates": [{"item_id": i} for i in items]}
                if data_time:
                    body["event_time_ms"] = int(plan.request_time_ms[v])
                t0 = time.perf_counter()
                r = await _post(client, "/rank", body, retries)
                rid = None
                if r is not None:
                    stats.rank_latency_s.append(time.perf_counter() - t0)
                    out = r.json()
                    rid = out["request_id"]
                    if answered is not None:
                        answered.write(rid + "\n")
                    version = int(out["model_version"]["sparse_version"])
                    if stats.first_version is None:
                        stats.first_version = version
                    stats.last_version = version
                    SERVED_VERSION.set(version)
                    stats.requests += 1
                    stats.impressions += len(items)
                else:
                    stats.rank_errors += 1
                fut = request_ids.get(v)
                if fut is not None:
                    fut.set_result(rid)
            finally:
                sem.release()

        async def post_actions(batch: list[int]) -> None:
            rids = await asyncio.gather(*(request_ids[int(plan.action_request[a])] for a in batch))
            actions = []
            for a, rid in zip(batch, rids):
                r = int(plan.action_request[a])
                clicks_left[r] -= 1
                if clicks_left[r] == 0:
                    del request_ids[r]
                if rid is None:
                    stats.actions_skipped += 1
                    continue
                action = {"request_id": rid, "item_id": int(plan.action_item[a]), "action_type": "click",
                          "user_id": int(plan.request_user[r])}
                if data_time:
                    action["event_time_ms"] = int(plan.action_time_ms[a])
                actions.append(action)
            for i in range(0, len(actions), ACTIONS_PER_CALL):
                chunk = actions[i:i + ACTIONS_PER_CALL]
                async with sem:
                    ok = await _post(client, "/actions", {"actions": chunk}, retries)
                if ok is None:
                    stats.action_errors += len(chunk)
                else:
                    stats.actions += len(chunk)

        def spawn(coro) -> None:
            t = asyncio.create_task(coro)
            tasks.add(t)
            t.add_done_callback(tasks.discard)

        due: list[int] = []

        def flush() -> None:
            if due:
                spawn(post_actions(list(due)))
                due.clear()

        n_requests = plan.n_requests
        first_emit = int(plan.emit_time_ms[0]) if plan.n_messages else 0
        started = time.perf_counter()
        next_report = started + report_every_s
        bar = tqdm(total=plan.n_messages, unit="msg", disable=not progress, smoothing=0.05, mininterval=0.5)
        try:
            for position, v in enumerate(plan.order.tolist()):
                emit = int(plan.emit_time_ms[position])
                if speed > 0:
                    ahead = (emit - first_emit) / 1000.0 / speed - (time.perf_counter() - started)
                    if ahead > 0.002:
                        flush()
                        await asyncio.sleep(ahead)
                if v < n_requests:
                    if clicks_left[v]:
                        request_ids[v] = asyncio.get_running_loop().create_future()
                    await sem.acquire()
                    spawn(rank(v))
                    stats.event_time_ms = int(plan.request_time_ms[v])
                    EVENT_TIME.set(stats.event_time_ms)
                else:
                    due.append(v - n_requests)
                    if len(due) >= ACTIONS_PER_CALL:
                        flush()
                if position % 256 == 0:
                    bar.update(position + 1 - bar.n)
                if speed > 0 or position % 256 == 0:
                    now = time.perf_counter()
                    if now >= next_report:
                        next_report = now + report_every_s
                        log.info("event time %s: %d requests, %d actions, %d errors, served sparse version %d",
                                 time.strftime("%Y-%m-%d %H:%M", time.gmtime(stats.event_time_ms / 1000)),
                                 stats.requests, stats.actions, stats.rank_errors + stats.action_errors,
                                 stats.last_version)
            flush()
            while tasks:
                await asyncio.gather(*list(tasks))
            bar.update(plan.n_messages - bar.n)
        finally:
            bar.close()
            for t in list(tasks):
                t.cancel()
            if answered is not None:
                answered.close()
    seconds = time.perf_counter() - started
    lat = np.array(stats.rank_latency_s) if stats.rank_latency_s else np.zeros(1)
    return {
        "start_rating": start,
        "event_time": "data" if data_time else "wall",
        "requests": stats.requests,
        "impressions": stats.impressions,
        "actions": stats.actions,
        "rank_errors": stats.rank_errors,
        "action_errors": stats.action_errors,
        "actions_skipped": stats.actions_skipped,
        "seconds": round(seconds, 3),
        "requests_per_s": round(stats.requests / seconds, 1) if seconds else 0.0,
        "rank_p50_ms": round(float(np.percentile(lat, 50)) * 1000, 2),
        "rank_p99_ms": round(float(np.percentile(lat, 99)) * 1000, 2),
        "served_sparse_version_first": stats.first_version or 0,
        "served_sparse_version_last": stats.last_version,
    }


def after_learned(settings, dataset: str) -> int | None:  # type: ignore[no-untyped-def]
    """The first rating after the newest event time the online trainer's snapshot learned (None:
    no snapshot it learned into): where a restarted replay resumes (``up``, ``--after-learned``)."""
    from driftline.project import named_config
    from movielens.data import first_rating_after
    from trainer.manifest import learned_online

    root = settings.model_snapshots(named_config(settings.trainer.model).model_id)
    learned = learned_online(root)
    if learned is None:
        return None
    start = first_rating_after(dataset, settings.data_dir, learned.max_event_time_ms)
    log.info("%s holds the online trainer's model (%d examples learned, up to %s): the replay resumes at "
             "rating %d", root, learned.examples_applied,
             time.strftime("%Y-%m-%d %H:%M", time.gmtime(learned.max_event_time_ms / 1000)), start)
    return start


async def _until_sigterm(coro):  # type: ignore[no-untyped-def]
    """``await coro``, or None once a SIGTERM cancels it (an exit raised from a plain signal handler
    inside the event loop can be swallowed on its way out: the stop then waited for the SIGKILL)."""
    import signal

    task = asyncio.ensure_future(coro)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        return await task
    except asyncio.CancelledError:
        return None
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="driftline traffic", description="Replay MovieLens through serving: "
                                "POST /rank per request, then POST /actions for the clicks the data has.")
    p.add_argument("--dataset", choices=["ml-1m", "ml-100k"], default=None)
    p.add_argument("--speed", type=at_least(0, float), default=None, help="event-time speed-up; 0 = as fast as serving answers")
    p.add_argument("--limit", type=at_least(1), default=None, help="replay at most N ratings (after --start-fraction)")
    p.add_argument("--start-fraction", type=fraction, default=0.0,
                   help="skip the first fraction of ratings (the warm-start's training data)")
    p.add_argument("--start-rating", type=at_least(0), default=None, help="skip the first N ratings (overrides --start-fraction)")
    p.add_argument("--after-learned", action="store_true",
                   help="start after the newest event time the online trainer's snapshot learned, when there is "
                        "one (a replay restarted with the stack: docker compose); else at --start-rating")
    p.add_argument("--metrics-port", type=tcp_port, default=None, help="/metrics port (default: settings.metrics_port)")
    p.add_argument("--stay", action="store_true",
                   help="after the replay, keep /metrics up until stopped (so its totals stay scrapeable)")
    add_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from services.metrics import SERVICE_UP, serve_metrics

    args = build_parser().parse_args(argv)
    settings = driver_settings(SERVICE)
    port = settings.metrics_port if args.metrics_port is None else args.metrics_port
    if port:
        try:
            serve_metrics(port)
        except OSError as err:  # the traffic still matters more than its own metrics
            log.warning("no /metrics on port %d: %s", port, err)
    SERVICE_UP.labels(SERVICE).set(1)
    import signal

    # A stop (docker compose stop, the supervisor's) ends the replay cleanly, at once: as a
    # container's PID 1 a process without a SIGTERM handler ignores it and is killed after the
    # grace period instead.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if args.after_learned:
        resume = after_learned(settings, args.dataset or settings.replay.dataset)
        args.start_rating = args.start_rating if resume is None else resume
    replay = drive(settings, args.dataset, args.speed, args.limit, args.start_fraction, args.concurrency,
                   base_url=args.url, start_rating=args.start_rating, progress=not args.no_progress,
                   ready_timeout_s=args.ready_timeout)
    if not args.no_join_report:
        replay = with_join_report(replay, args.joiner_metrics or default_urls(settings), args.join_settle_s)
    try:
        stats = asyncio.run(_until_sigterm(replay))
    except ServingUnavailable as err:
        print(f"driftline traffic: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if stats is None:
        log.info("stopped")
        return 0
    print(json.dumps(stats), flush=True)
    if args.stay:
        log.info("replay done; /metrics stays up until stopped")
        try:
            while True:
                signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, "python -m producers.traffic"))
