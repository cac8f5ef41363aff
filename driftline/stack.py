"""``driftline up``: the whole loop as supervised local processes.

Two modes. **The MovieLens demo** (no ``--model``, no ``--no-replay``): everything below. **Your
own model** (``up --model FILE``, or ``--no-replay``): broker, Redis, topics and the services only;
no MovieLens download, no warm start on it, no MovieLens features in Redis, no replay: the model
starts from its own snapshot (or its initial weights) and learns from the traffic you send. **A
project file** (``up --config driftline.toml``, :mod:`driftline.project`): the same, with the
file's settings in every service's environment (under any variable already set), the MovieLens
features only if its ``[store]`` asks, and its own warm start (``[warm_start]``).

Order: broker and Redis (unless ``KAFKA_BOOTSTRAP_SERVERS`` / ``REDIS_URL`` point elsewhere),
topics and the broker epoch, the data, the warm start (``trainer batch`` on the first
:data:`WARM_START_FRACTION` of ml-1m, written as the snapshot that the online trainer and serving
start from; skipped when a snapshot the online trainer learned into exists, which is never
replaced: the replay then resumes after it), every service in :data:`APP_SERVICES`, then the traffic: ``producers.traffic``
replays the rest of ml-1m *through serving* (``POST /rank``, then ``POST /actions`` for the
clicks), so the loop closes on serving's own feature log. Each later service registers itself by
adding a :class:`AppService` to :data:`APP_SERVICES`.

(Near 500 lines, one module: the services' registry, the start order and the ports and status
targets derived from the registry read one set of settings and change together.)
"""

from __future__ import annotations

import asyncio
import functools
import logging
import shutil
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from driftline.embedded import redis_command, repair_redis_aof, tansu_command, wait_for_port
from driftline.supervisor import ServiceSpec, Supervisor
from services.broker_reset import ensure_broker_epoch, keep_epoch_record
from services.in_use import InUse, own_dir
from services.kafka import create_topics
from services.ports import Listen, check_ports_free, http_answers, port_is_open
from services.redis_client import redacted
from services.settings import Settings
from status.options import Target
from trainer.manifest import own_snapshots

if TYPE_CHECKING:
    from driftline.project import Project

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AppService:
    """A driftline service ``make up`` runs: a ``driftline`` subcommand plus what to print."""

    name: str
    args: tuple[str, ...]
    metrics_port: Callable[[Settings], int] | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    urls: Callable[[Settings], dict[str, str]] = lambda s: {}
    ready: Callable[[Settings], bool] | None = None
    blocking: bool = False  # a one-shot job the services after it need
    timeout_s: float = 60.0  # readiness (or, for a blocking job, completion) deadline
    metrics_url: Callable[[Settings], str] | None = None  # /metrics served on the service's own port
    #: settings the service must see as this process resolved them (its environment, by name)
    settings_env: Callable[[Settings], dict[str, str]] = lambda s: {}
    #: runs where ``up`` keeps a feature store loaded: the MovieLens features (the demo, or a project
    #: file's ``[store] movielens``: ``--movielens`` is added to its arguments) or the project file's
    #: ``[store] users_file`` / ``items_file`` (``features load`` reads them from the project file)
    store_features: bool = False
    #: what the supervisor's liveness check GETs (None: the service's /metrics where it has a port)
    alive_url: Callable[[Settings], str] | None = None
    #: environment for the demo and ``--model`` runs only: with a project file (``up --config``)
    #: the file decides these settings (the environment it was applied to carries them)
    legacy_env: Mapping[str, str] = field(default_factory=dict)
    #: how long a stop waits for it after SIGTERM (None: ``ServiceSpec``'s own)
    stop_timeout_s: Callable[[Settings], float] | None = None


def _alive_url(service: AppService, settings: Settings) -> str | None:
    """What the supervisor's liveness check of ``service`` GETs (None: no check)."""
    if service.blocking:
        return None
    if service.alive_url is not None:
        return service.alive_url(settings)
    if service.metrics_port is None:
        return None
    host = settings.metrics_host if settings.metrics_host not in ("", "0.0.0.0", "::") else "127.0.0.1"
    return f"http://{host}:{service.metrics_port(settings)}/metrics"


def _serving_url(s: Settings) -> str:
    return f"http://{s.serving.host}:{s.serving.port}"


def _metrics(service: str) -> Callable[[Settings], int]:
    return lambda s: s.embedded.metrics_port(service)


# In start order. Each long-running service exports /metrics on its own port.
APP_SERVICES: list[AppService] = [
    AppService("features-load", ("features", "load"), blocking=True, store_features=True),
    # ... and whenever Redis loses them (serving/feature_keeper.py): restarted without its data (its
    # append-only file cut at damage: driftline.embedded.repair_redis_aof), flushed, or an external
    # Redis (REDIS_URL) restarted; serving marks its answers degraded until they are back
    AppService("feature-keeper", ("features", "load", "--watch"),
               metrics_port=_metrics("feature-keeper"), store_features=True),
    # live traffic, demo or not: sparse clicks leave an actions partition idle, and its watermark
    # must still advance for windows to close
    # (a project file says so itself: [windows] idle_advance_seconds)
    AppService("joiner", ("joiner",), metrics_port=_metrics("joiner"),
               legacy_env={"DRIFTLINE_JOINER__IDLE_ADVANCE_SECONDS": "30"}),
    AppService("dumper", ("dumper",), metrics_port=_metrics("dumper")),
    # trainer.nproc > 1: that many ranks under torch's elastic launcher (trainer/dist/launch.py); rank
    # r > 0 exports metrics on the trainer's port + r * trainer.rank_metrics_port_stride
    AppService("trainer", ("trainer", "online"), metrics_port=_metrics("trainer"),
               settings_env=lambda s: {"DRIFTLINE_TRAINER__NPROC": str(s.trainer.nproc)},
               # a stop applies what each rank holds and writes its last snapshot: that took 10.9 s
               # on a loaded machine, past the 10 s default, and a SIGKILLed trainer restarts from
               # the snapshot before (docker-compose.yml's stop_grace_period is the same)
               stop_timeout_s=lambda s: 60.0),
    # serving serves the trainer's model (DRIFTLINE_SERVING__MODEL unset) and bootstraps from its snapshots;
    # it opens its port in ~15 s on 2 idle cores (its PS and two workers import torch while the
    # joiner, dumper and trainer start too) and took 58-62 s on a loaded one: a busy laptop is no failure
    AppService("serving", ("serve", "--workers", "2"),  # one serving PS, two workers
               ready=lambda s: port_is_open(s.serving.host, s.serving.port), timeout_s=180.0,
               alive_url=lambda s: f"{_serving_url(s)}/healthz",
               urls=lambda s: {"ranking API docs": f"{_serving_url(s)}/docs"},
               metrics_url=lambda s: f"{_serving_url(s)}/metrics",
               # its PS gives each worker the spool's drain + 10 s, then stops its own consumer
               stop_timeout_s=lambda s: s.serving.spool_drain_timeout_s + 20.0),
    AppService("status", ("status",),
               ready=lambda s: port_is_open(s.status.host, s.status.port),
               alive_url=lambda s: f"http://{s.status.host}:{s.status.port}/healthz",
               urls=lambda s: {"status page": f"http://{s.status.host}:{s.status.port}/"}),
]


# The warm start trains on this leading fraction of the ratings (time order: ml-1m up to
# 2000-06-10, 100k ratings, a few seconds of training); the traffic replays the rest through serving.
WARM_START_FRACTION = 0.1
# The warm start's own hold-out (the last part of its slice, in time order): it reports a test AUC
# in var/log/warm-start.log, and the traffic starts right at it, so no rating is skipped.
WARM_START_TEST_FRACTION = 0.05
# HTTP calls the traffic driver keeps in flight.
TRAFFIC_CONCURRENCY = 16


def warm_start_cut(settings: Settings, fraction: float = WARM_START_FRACTION) -> tuple[int, int]:
    """``(trained, start)``: the warm start trains on ratings ``[0, trained)`` and holds out
    ``[trained, start)``; the traffic replays from ``trained`` (the hold-out is new to the model)."""
    import pyarrow.parquet as pq

    from movielens.data import DatasetPaths

    n = pq.read_metadata(DatasetPaths.under(settings.replay.dataset, settings.data_dir).ratings).num_rows
    start = int(n * fraction)
    return int(start * (1 - WARM_START_TEST_FRACTION)), start


def demo_event_time_env(settings: Settings) -> dict[str, str]:
    """The demo replays MovieLens ratings from years ago with their own event times: every
    service's edge gets the replay's past bound (``event_time.max_past_s`` widened to the data's
    age, :func:`producers.replay.replay_event_time_bounds`), unless the environment set it."""
    import os

    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from movielens.data import DatasetPaths
    from producers.replay import PAST_BOUND_VAR, replay_event_time_bounds

    if PAST_BOUND_VAR in os.environ:
        return {}
    ts = pq.read_table(DatasetPaths.under(settings.replay.dataset, settings.data_dir).ratings,
                       columns=["timestamp"])["timestamp"]
    past, _ = replay_event_time_bounds(settings, pc.min(ts).as_py() * 1000, int(time.time() * 1000))
    return {PAST_BOUND_VAR: str(int(past))}


def _driftline(*args: str) -> list[str]:
    return [sys.executable, "-m", "driftline.cli", *args]


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def _warm_start(settings: Settings, supervisor: Supervisor, epoch: str, external_broker: bool,
                fraction: float) -> int | None:
    """Train the batch model the loop starts from, unless a snapshot the loop can go on from exists;
    return the rating the replay resumes at (None: the warm start's cut).

    * A snapshot the online trainer learned into (``examples_applied`` > 0) is never replaced: the
      warm start is skipped and the replay resumes after the newest event time it learned (its
      ``max_event_time_ms``), whatever the broker. On a new broker (the embedded one is new on every
      ``up``: memory storage) the trainer restores its parameters, not its offsets, and writes this
      epoch's snapshot before its first batch, which serving reloads from (trainer/online.py).
    * With an external Kafka, a snapshot of this broker's data is kept as well (its offsets hold).
    * Otherwise (none, or only a warm start's) the warm start trains a new one.
    """
    from driftline.project import named_config
    from producers.traffic import after_learned

    resume = after_learned(settings, settings.replay.dataset)
    if resume is not None:
        log.info("warm start skipped: the online trainer's snapshot is kept")
        return resume
    snap = settings.model_snapshots(named_config(settings.trainer.model).model_id)
    marker = snap / "broker-epoch"
    if external_broker and (snap / "LATEST").exists() and marker.exists() and marker.read_text().strip() == epoch:
        log.info("warm start skipped: %s holds a snapshot of this broker's data", snap)
        return None
    with own_snapshots(snap):  # (not while a trainer started by hand writes there)
        shutil.rmtree(snap, ignore_errors=True)  # nothing learned online in it: the warm start's own
    _trained, start = warm_start_cut(settings, fraction)  # trainer batch holds out the same rows
    supervisor.start(ServiceSpec(
        "warm-start",
        _driftline("trainer", "batch", "--movielens", "--model", settings.trainer.model,
                   "--dataset", settings.replay.dataset, "--data-dir", str(settings.data_dir),
                   "--limit", str(start), "--test-fraction", str(WARM_START_TEST_FRACTION),
                   "--snapshot", "--quiet"),
        oneshot=True, blocking=True, ready_timeout_s=600.0,
    ))
    return None


def _project_start(settings: Settings, supervisor: Supervisor, project: Project, epoch: str,
                   external_broker: bool) -> list[tuple[str, str]]:
    """What a project file asks of ``up`` before the services: the MovieLens dataset its features
    come from (``[store] movielens``: the services marked ``store_features`` load them) and its
    warm start (``[warm_start]``: ``trainer batch`` on the user's Parquet examples, written as the
    snapshot the online trainer and serving start from)."""
    rows = [("project", str(project.path))]
    files = [p for p in project.feature_files if p is not None]  # (``driftline up`` checked they are files)
    if files:  # (the services marked store_features load them, and again whenever Redis loses them)
        rows.append(("features", " and ".join(map(str, files)) + " (kept loaded)"))
    if project.store.movielens and project.demo is None:  # (the demo loads them itself)
        from movielens.data import fetch

        fetch(settings.replay.dataset, settings.data_dir, progress=True)
    ws = project.warm_start
    if ws.kind == "examples":
        path = project.resolve(ws.examples_dir)
        snap = settings.model_snapshots(project.name)
        marker = snap / "broker-epoch"
        if external_broker and (snap / "LATEST").exists() and marker.exists() and marker.read_text().strip() == epoch:
            log.info("warm start skipped: %s holds a snapshot of this broker's data", snap)
        else:
            with own_snapshots(snap):  # (not while a trainer started by hand writes there)
                shutil.rmtree(snap, ignore_errors=True)  # a snapshot of another broker's offsets
            supervisor.start(ServiceSpec(
                "warm-start", _driftline("trainer", "batch", "--model", settings.trainer.model,
                                         "--examples-dir", str(path), "--test-fraction", "0", "--snapshot", "--quiet"),
                oneshot=True, blocking=True, ready_timeout_s=600.0))
            rows.append(("warm start", str(path)))
    return rows


def up(settings: Settings, replay_limit: int | None, speed: float | None, demo: bool = True,
       warm_start_fraction: float = WARM_START_FRACTION, project: Project | None = None) -> int:
    """Run the stack until Ctrl-C. Returns the exit code.

    ``demo``: the MovieLens demo (download, warm start, its features, the replay); False runs the
    services of ``settings.trainer.model`` alone (every service sees that model: it is passed in
    their environment). ``replay_limit`` bounds the ratings the traffic replays (after the warm
    start's); ``warm_start_fraction`` 0 skips the warm start (serving then waits for the first deltas).
    ``project`` (``up --config FILE``, already applied to the environment and ``settings``): its own
    features and warm start (:func:`_project_start`), the services see only its settings; the demo
    only if the file says ``demo = "movielens"`` (``examples/movielens/driftline.toml``, ``make up``).
    """
    # One stack per var dir, before anything in it is touched: a second one (other ports, the same
    # directory) would run a second Redis on the same append-only file and a second trainer in the
    # same snapshots, and write its supervisor state over this one's.
    with own_dir(settings.var_dir, "the var dir", "var_dir"):
        return _up(settings, replay_limit, speed, demo, warm_start_fraction, project)


def _start_infra(settings: Settings, supervisor: Supervisor) -> list[tuple[str, str]]:
    """The embedded broker and Redis, unless external ones are configured; their table rows."""
    e = settings.embedded
    infra: list[tuple[str, str]] = []
    if settings.kafka_bootstrap_servers is None:
        supervisor.start(ServiceSpec(
            "broker", tansu_command(e.host, e.broker_port),
            ready=lambda: port_is_open(e.host, e.broker_port), ready_timeout_s=e.start_timeout_s,
            infra=True,
            # A restarted tansu has lost every topic (memory storage): recreate them with their
            # partition counts before a producer's auto-creation picks its own, and write the
            # new epoch the running services compare against (broker_reset.EpochWatch).
            on_restart=lambda: asyncio.run(_prepare_broker_epoch(settings)),
        ))
        wait_for_port(e.host, e.broker_port, e.start_timeout_s, "broker")
    infra.append(("kafka", settings.bootstrap_servers))
    if settings.redis_url is None:
        supervisor.start(ServiceSpec(
            "redis", redis_command(e.host, e.redis_port, settings.var_dir / "redis"),
            ready=lambda: port_is_open(e.host, e.redis_port), ready_timeout_s=e.start_timeout_s,
            infra=True, prestart=functools.partial(repair_redis_aof, settings.var_dir / "redis"),
        ))
    infra.append(("redis", redacted(settings.redis)))
    return infra


def _start_services(settings: Settings, supervisor: Supervisor, common_env: dict[str, str], store_features: bool,
                    movielens_features: bool, from_project: bool) -> tuple[list[tuple[str, str]], list[str]]:
    """Every service of :data:`APP_SERVICES` the stack runs; their table rows and metrics ports."""
    rows: list[tuple[str, str]] = []
    metrics: list[str] = []
    for service in APP_SERVICES:
        if service.store_features and not store_features:
            continue
        ready = service.ready
        legacy = {} if from_project else service.legacy_env
        env = {**common_env, **service.env, **legacy, **service.settings_env(settings)}
        if service.metrics_port is not None:
            port = service.metrics_port(settings)
            env["DRIFTLINE_METRICS_PORT"] = str(port)
            metrics.append(f":{port} {service.name}")
            if service.name == "trainer" and settings.trainer.nproc > 1:
                stride = settings.trainer.rank_metrics_port_stride
                metrics += [f":{port + r * stride} trainer rank {r}" for r in range(1, settings.trainer.nproc)]
        if service.metrics_url is not None:
            metrics.insert(0, f"{service.metrics_url(settings)} ({service.name})")
        alive = _alive_url(service, settings)
        args = (*service.args, "--movielens") if service.store_features and movielens_features else service.args
        spec = ServiceSpec(
            service.name, _driftline(*args), env=env,
            ready=(lambda r=ready: r(settings)) if ready else None,
            oneshot=service.blocking, blocking=service.blocking, ready_timeout_s=service.timeout_s,
            alive=(lambda u=alive: http_answers(u)) if alive else None,
            liveness_timeout_s=settings.embedded.liveness_timeout_s,
            **({"stop_timeout_s": service.stop_timeout_s(settings)} if service.stop_timeout_s else {}),
        )
        supervisor.start(spec)
        rows += list(service.urls(settings).items())
    return rows, metrics


def _up(settings: Settings, replay_limit: int | None, speed: float | None, demo: bool,
        warm_start_fraction: float, project: Project | None) -> int:
    demo = demo or (project is not None and project.demo == "movielens")
    movielens_features = demo or (project is not None and project.store.movielens)
    store_features = movielens_features or (project is not None and project.feature_files != (None, None))
    supervisor = Supervisor(settings.log_dir)

    def on_signal(signum: int, _frame: object) -> None:
        log.info("stopping (signal %d)", signum)
        supervisor.request_stop()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    rows: list[tuple[str, str]] = []
    infra: list[tuple[str, str]] = []
    try:
        check_ports_free(stack_ports(settings, demo, store_features))  # before anything starts
        infra = _start_infra(settings, supervisor)
        created, epoch = asyncio.run(_prepare_broker_epoch(settings))
        log.info("topics ready (created: %s)", ", ".join(created) or "none")
        common_env = {"DRIFTLINE_TRAINER__MODEL": settings.trainer.model}
        replay_start: int | None = None  # the warm start's cut
        if demo:
            from movielens.data import fetch

            fetch(settings.replay.dataset, settings.data_dir, progress=True)
            common_env.update(demo_event_time_env(settings))
            if warm_start_fraction > 0:
                replay_start = _warm_start(settings, supervisor, epoch, settings.kafka_bootstrap_servers is not None,
                                           warm_start_fraction)
        if project is not None:
            rows += _project_start(settings, supervisor, project, epoch, settings.kafka_bootstrap_servers is not None)
        rows.append(("model", settings.trainer.model + ("" if demo else " (no MovieLens demo: send your own traffic)")))

        service_rows, metrics = _start_services(settings, supervisor, common_env, store_features,
                                                movielens_features, project is not None)
        rows += service_rows
        if demo:
            port = settings.embedded.metrics_port("traffic")
            metrics.append(f":{port} traffic")
            supervisor.start(ServiceSpec(
                # The replay of ml-1m, now through serving (producers.traffic); its log stays replay.log.
                "replay", traffic_command(settings, replay_limit, speed, warm_start_fraction, replay_start),
                env={**common_env, "DRIFTLINE_METRICS_PORT": str(port)}, oneshot=True,
            ))
        if metrics:  # one line: serving's URL first, then the other services' ports (same path)
            first, rest = (metrics[0], metrics[1:]) if metrics[0].startswith("http") else ("", metrics)
            rows.append(("metrics", "; ".join(x for x in (first, ("/metrics on " + ", ".join(rest)) if rest else "") if x)))
        rows += infra
        rows.append(("logs", f"{settings.log_dir}/<service>.log"))
        print("\ndriftline is up. Ctrl-C stops everything.\n" + _table(rows) + "\n", flush=True)
        supervisor.run_forever()
    finally:
        failed = supervisor.stop_all()
        print("driftline stopped." if not failed else
              "driftline stopped; not cleanly: " + ", ".join(f"{n} (exit {c})" for n, c in failed.items())
              + f"; see {settings.log_dir}/", flush=True)
    if supervisor.cannot_start:
        raise InUse("; ".join(f"{name}: {why}" for name, why in supervisor.cannot_start.items()))
    return 0 if not failed else 1


def stack_ports(settings: Settings, demo: bool, store_features: bool | None = None) -> list[Listen]:
    """Every port ``up`` will listen on, each with the setting that moves it (``store_features``:
    whether it keeps a feature store loaded, by default with the demo).

    >>> [(p.port, p.what) for p in stack_ports(Settings(), demo=True)][:4]  # doctest: +NORMALIZE_WHITESPACE
    [(9092, 'the embedded broker'), (6379, 'the embedded Redis'), (9105, "the feature-keeper's /metrics"),
     (9101, "the joiner's /metrics")]
    """
    e, mhost = settings.embedded, settings.metrics_host
    ports = []
    if settings.kafka_bootstrap_servers is None:
        ports.append(Listen(e.host, e.broker_port, "the embedded broker", "embedded.broker_port"))
    if settings.redis_url is None:
        ports.append(Listen(e.host, e.redis_port, "the embedded Redis", "embedded.redis_port"))
    for service in APP_SERVICES:
        if service.store_features and not (demo if store_features is None else store_features):
            continue
        if service.metrics_port is not None:
            port = service.metrics_port(settings)
            ports.append(Listen(mhost, port, f"the {service.name}'s /metrics", "embedded.metrics_port_base"))
            if service.name == "trainer":
                stride = settings.trainer.rank_metrics_port_stride
                ports += [Listen(mhost, port + r * stride, f"the trainer rank {r}'s /metrics",
                                 "trainer.rank_metrics_port_stride") for r in range(1, settings.trainer.nproc)]
    ports.append(Listen(settings.serving.host, settings.serving.port, "serving's API", "serving.port"))
    ports.append(Listen(settings.status.host, settings.status.port, "the status page", "status.port"))
    if demo:
        ports.append(Listen(mhost, settings.embedded.metrics_port("traffic"), "the traffic's /metrics", "embedded.metrics_port_base"))
    return ports


def status_targets(settings: Settings) -> list[Target]:
    """Every service ``make up`` starts that exports /metrics, at the URL the stack prints: what
    ``driftline status`` scrapes when no target is configured."""
    targets = []
    for service in APP_SERVICES:
        if service.name in ("status", "feature-keeper"):  # (the keeper of the demo's features: no pipeline stage)
            continue
        metrics_url = getattr(service, "metrics_url", None)  # /metrics on the service's own port
        if service.metrics_port is not None:
            port = service.metrics_port(settings)
            targets.append(Target(service.name, f"http://127.0.0.1:{port}/metrics"))
            if service.name == "trainer":  # rank r > 0 of a distributed trainer: its own port
                stride = settings.trainer.rank_metrics_port_stride
                targets += [Target(f"trainer-rank-{r}", f"http://127.0.0.1:{port + r * stride}/metrics")
                            for r in range(1, settings.trainer.nproc)]
        elif metrics_url is not None:
            targets.append(Target(service.name, metrics_url(settings)))
        else:
            targets += [Target(service.name, url) for label, url in service.urls(settings).items()
                        if label.endswith("metrics") and url.endswith("/metrics")]
    return targets


def traffic_command(settings: Settings, limit: int | None, speed: float | None,
                    warm_start_fraction: float = WARM_START_FRACTION, start: int | None = None) -> list[str]:
    """The traffic driver's command line: the ratings from ``start`` (by default the first after the
    warm start's), through serving."""
    if start is None:
        start = warm_start_cut(settings, warm_start_fraction)[0] if warm_start_fraction > 0 else 0
    args = [sys.executable, "-m", "producers.traffic", "--dataset", settings.replay.dataset,
            "--start-rating", str(start), "--concurrency", str(TRAFFIC_CONCURRENCY), "--no-progress", "--stay",
            "--url", f"http://{settings.serving.host}:{settings.serving.port}"]
    if speed is not None:
        args += ["--speed", str(speed)]
    if limit is not None:
        args += ["--limit", str(limit)]
    return args


async def _prepare_broker_epoch(settings: Settings) -> tuple[list[str], str]:
    created = await create_topics(settings)
    epoch = await ensure_broker_epoch(settings)
    await keep_epoch_record(settings)
    return created, epoch


async def _prepare_broker(settings: Settings) -> list[str]:
    return (await _prepare_broker_epoch(settings))[0]
