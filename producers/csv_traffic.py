"""``driftline traffic --csv FILE --map FILE``: *your* impression log replayed through serving.

The log is a CSV (``--csv``) or a Parquet file (``--parquet``) with one row per impression (an
item shown in a request). Rows sharing a request id form one ``POST /rank`` whose candidates are
their items; after its answer, the rows whose action columns are set become one ``POST /actions``
with the request id serving returned (serving names the requests: replaying a log twice never
collides with the first run in the joiner). It
goes through :class:`driftline.client.AsyncRankClient`, so values are checked and strings hashed
as any client's are, and paced by event time like the MovieLens driver (:mod:`producers.traffic`):
``--speed`` times the log's own pace, 0 as fast as serving answers.

The log and its map file (TOML: which column is what) are read by :mod:`producers.csv_log`.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from driftline.client import AsyncRankClient, InvalidInput, ServingError
from driftline.project import FeatureSpec, load_project
from producers.csv_log import Request, load_map, parquet_rows, rebase, requests_of, too_old
from producers.drivers import ReplayStats, add_arguments, driver_settings
from producers.join_report import default_urls, with_join_report
from services.cli_args import at_least, run_main
from services.settings import Settings

log = logging.getLogger(__name__)

SERVICE = "traffic"


async def _replay_one(client: AsyncRankClient, r: Request, stats: ReplayStats) -> None:
    try:
        ranking = await client.rank(user_id=r.user, candidates=r.candidates, context=r.context,
                                    event_time_ms=r.event_time_ms)
    except (ServingError, InvalidInput) as err:
        stats.rank_errors += 1
        stats.actions_skipped += len(r.actions)
        stats.error(f"request {r.key}: {err}")
        return
    stats.requests += 1
    stats.impressions += len(r.candidates)
    if not r.actions:
        return
    actions = [{"request_id": ranking.request_id, "item_id": item, "action_type": kind, "user_id": r.user,
                "event_time_ms": when if when is not None else r.event_time_ms} for item, kind, when in r.actions]
    try:
        accepted = await client.actions(actions)  # not `+= await`: that reads the total before awaiting
    except (ServingError, InvalidInput) as err:
        stats.action_errors += len(actions)
        stats.error(f"actions of request {r.key}: {err}")
        return
    stats.actions += accepted


async def drive(settings: Settings, requests: Sequence[Request], client: AsyncRankClient, *,
                speed: float | None = None, concurrency: int = 16, progress: bool = False,
                ready_timeout_s: float = 180.0) -> dict:
    """Replay ``requests`` through serving (at most ``concurrency`` in flight); returns the stats."""
    speed = settings.replay.speed if speed is None else speed
    await client.wait_ready(ready_timeout_s)
    stats = ReplayStats()
    sem = asyncio.Semaphore(concurrency)
    tasks: set[asyncio.Task] = set()
    first = next((r.event_time_ms for r in requests if r.event_time_ms is not None), None)
    started = time.perf_counter()

    async def one(r: Request) -> None:
        try:
            await _replay_one(client, r, stats)
        finally:
            sem.release()
            bar.update(1)

    bar = tqdm(total=len(requests), unit="req", disable=not progress, smoothing=0.05, mininterval=0.5)
    try:
        for r in requests:
            if speed > 0 and first is not None and r.event_time_ms is not None:
                # the log's own pace, sped up: request i goes out (t_i - t_0) / speed after the start
                ahead = (r.event_time_ms - first) / 1000.0 / speed - (time.perf_counter() - started)
                if ahead > 0.002:
                    await asyncio.sleep(ahead)
            await sem.acquire()
            task = asyncio.create_task(one(r))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        while tasks:
            await asyncio.gather(*list(tasks))
    finally:
        bar.close()
        for t in list(tasks):
            t.cancel()
    seconds = time.perf_counter() - started
    return {"requests": stats.requests, "impressions": stats.impressions, "actions": stats.actions,
            "rank_errors": stats.rank_errors, "action_errors": stats.action_errors,
            "actions_skipped": stats.actions_skipped, "seconds": round(seconds, 3),
            "requests_per_s": round(stats.requests / seconds, 1) if seconds else 0.0, "first_errors": stats.errors}


def project_of(config: Path | None) -> tuple[list[FeatureSpec] | None, list[str] | None]:
    """The project file's features and labelled action types (None, None without one)."""
    if config is None:
        return None, None
    project = load_project(config)
    return list(project.features), list(project.labels)


async def replay_csv(settings: Settings, log_path: Path, map_path: Path, config: Path | None = None, *,
                     url: str | None = None, speed: float | None = None, limit: int | None = None,
                     rebase_time: bool = False, concurrency: int = 16, progress: bool = False,
                     ready_timeout_s: float = 180.0, parquet: bool = False) -> dict:
    """Read the log (a CSV, or Parquet with ``parquet``) and its map, then :func:`drive` it;
    ``limit``: the first N requests (in time order)."""
    spec = load_map(map_path)
    project, action_types = project_of(config)
    features = spec.feature_specs(project)
    if parquet:
        requests = requests_of(parquet_rows(log_path, spec), spec, features)[:limit]
    else:
        with open(log_path, newline="") as f:
            requests = requests_of(csv.DictReader(f), spec, features)[:limit]
    if rebase_time:
        rebase(requests, int(time.time() * 1000))
    limits = (load_project(config).resolved_settings() if config is not None else settings).event_time
    refused = too_old(requests, int(time.time() * 1000), limits.max_past_s)
    if refused:
        raise ValueError(refused)
    # The client checks against the project's features when there is one (a mapped subset is fine),
    # else against the features the map declares.
    specs = project if project is not None else [f for f, _ in features]
    async with AsyncRankClient(specs, url, action_types=action_types, retries=40,
                               max_connections=concurrency) as client:
        stats = await drive(settings, requests, client, speed=speed, concurrency=concurrency,
                            progress=progress, ready_timeout_s=ready_timeout_s)
    return {"parquet" if parquet else "csv": str(log_path), **stats}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="driftline traffic", description="Replay your impression log (CSV or "
                                "Parquet) through serving: POST /rank per request, then POST /actions for its actions.")
    log_file = p.add_mutually_exclusive_group(required=True)
    log_file.add_argument("--csv", type=Path, help="the impression log: one row per impression")
    log_file.add_argument("--parquet", type=Path, help="the same log as a Parquet file (typed cells)")
    p.add_argument("--map", type=Path, required=True, help="TOML naming the log's columns (see producers/csv_log.py)")
    p.add_argument("--config", type=Path, default=None, help="the project file (driftline.toml): the features' specs")
    p.add_argument("--speed", type=at_least(0, float), default=None,
                   help="event-time speed-up; 0 = as fast as serving answers (default: settings.replay.speed)")
    p.add_argument("--limit", type=at_least(1), default=None, help="replay at most the first N requests")
    p.add_argument("--rebase", action="store_true", help="shift event times so the log's last event is now")
    add_arguments(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = driver_settings(SERVICE)
    try:
        replay = replay_csv(settings, args.csv or args.parquet, args.map, args.config, url=args.url,
                            speed=args.speed, limit=args.limit, rebase_time=args.rebase, concurrency=args.concurrency,
                            progress=not args.no_progress, ready_timeout_s=args.ready_timeout,
                            parquet=args.parquet is not None)
        if not args.no_join_report:
            replay = with_join_report(replay, args.joiner_metrics or default_urls(settings), args.join_settle_s)
        stats = asyncio.run(replay)
    # a bad map, log or project file (InvalidInput and pydantic's errors are ValueErrors), serving not ready
    except (ValueError, ServingError, OSError) as err:
        print(f"driftline traffic: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print(json.dumps(stats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, "python -m producers.csv_traffic"))
