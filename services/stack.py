"""``driftline up``: the whole stack as supervised local processes.

Order: broker and Redis (unless ``KAFKA_BOOTSTRAP_SERVERS`` / ``REDIS_URL`` point elsewhere),
topics and the broker epoch, the data, every service in :data:`APP_SERVICES`, then the replay.
Each later service registers itself by adding a :class:`AppService` to :data:`APP_SERVICES`.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from services.embedded import (
    check_port_free,
    port_is_open,
    redis_command,
    tansu_command,
    wait_for_port,
)
from services.kafka import create_topics
from services.settings import Settings
from services.supervisor import ServiceSpec, Supervisor
from services.tansu_quirks import ensure_broker_epoch

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


def _serving_url(s: Settings) -> str:
    return f"http://{s.serving.host}:{s.serving.port}"


def _metrics(offset: int) -> Callable[[Settings], int]:
    return lambda s: s.embedded.metrics_port_base + offset


# In start order. Each long-running service exports /metrics on its own port.
APP_SERVICES: list[AppService] = [
    AppService("features-load", ("features", "load"), blocking=True),
    AppService("joiner", ("joiner",), metrics_port=_metrics(0),
               env={"DRIFTLINE_JOINER__IDLE_ADVANCE_SECONDS": "30"}),
    AppService("dumper", ("dumper",), metrics_port=_metrics(1)),
    AppService("trainer", ("trainer", "online"), metrics_port=_metrics(2)),
    AppService("serving", ("serve",),
               ready=lambda s: port_is_open(s.serving.host, s.serving.port),
               urls=lambda s: {"ranking API docs": f"{_serving_url(s)}/docs",
                               "serving metrics": f"{_serving_url(s)}/metrics"}),
]


def _driftline(*args: str) -> list[str]:
    return [sys.executable, "-m", "services.cli", *args]


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def up(settings: Settings, replay_limit: int | None, speed: float | None, replay: bool = True) -> int:
    """Run the stack until Ctrl-C. Returns the exit code."""
    from producers.movielens import fetch

    supervisor = Supervisor(settings.log_dir)
    e = settings.embedded

    def on_signal(signum: int, _frame: object) -> None:
        log.info("stopping (signal %d)", signum)
        supervisor.request_stop()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    rows: list[tuple[str, str]] = []
    try:
        if settings.kafka_bootstrap_servers is None:
            check_port_free(e.host, e.broker_port, "broker", "DRIFTLINE_EMBEDDED__BROKER_PORT")
            supervisor.start(ServiceSpec(
                "broker", tansu_command(e.host, e.broker_port),
                ready=lambda: port_is_open(e.host, e.broker_port), ready_timeout_s=e.start_timeout_s,
            ))
            wait_for_port(e.host, e.broker_port, e.start_timeout_s, "broker")
        rows.append(("kafka", settings.bootstrap_servers))
        if settings.redis_url is None:
            check_port_free(e.host, e.redis_port, "redis", "DRIFTLINE_EMBEDDED__REDIS_PORT")
            supervisor.start(ServiceSpec(
                "redis", redis_command(e.host, e.redis_port, settings.var_dir / "redis"),
                ready=lambda: port_is_open(e.host, e.redis_port), ready_timeout_s=e.start_timeout_s,
            ))
        rows.append(("redis", settings.redis))

        created = asyncio.run(_prepare_broker(settings))
        log.info("topics ready (created: %s)", ", ".join(created) or "none")
        fetch(settings.replay.dataset, settings.data_dir, progress=True)

        for service in APP_SERVICES:
            ready = service.ready
            env = dict(service.env)
            if service.metrics_port is not None:
                port = service.metrics_port(settings)
                env["DRIFTLINE_METRICS_PORT"] = str(port)
                rows.append((f"{service.name} metrics", f"http://127.0.0.1:{port}/metrics"))
            supervisor.start(ServiceSpec(
                service.name, _driftline(*service.args), env=env,
                ready=(lambda r=ready: r(settings)) if ready else None,
                oneshot=service.blocking, blocking=service.blocking,
            ))
            rows += list(service.urls(settings).items())
        if replay:
            args = ["replay", "--dataset", settings.replay.dataset]
            if speed is not None:
                args += ["--speed", str(speed)]
            if replay_limit is not None:
                args += ["--limit", str(replay_limit)]
            supervisor.start(ServiceSpec("replay", _driftline(*args, "--no-progress"), oneshot=True))
        rows.append(("logs", f"{settings.log_dir}/<service>.log"))
        print("\ndriftline is up. Ctrl-C stops everything.\n" + _table(rows) + "\n", flush=True)
        supervisor.run_forever()
        return 0
    finally:
        supervisor.stop_all()
        print("driftline stopped.", flush=True)


async def _prepare_broker(settings: Settings) -> list[str]:
    created = await create_topics(settings)
    await ensure_broker_epoch(settings)
    return created
