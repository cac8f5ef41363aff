"""``python -m serving``: run the ranking API under uvicorn on settings.serving.host/port.

SIGTERM or SIGINT stops it cleanly: uvicorn stops accepting, finishes the requests in flight and
runs the app's shutdown, which ships the feature-log spool for up to
``serving.spool_drain_timeout_s`` (what is left stays on disk for the next start); then the
process exits 0.

``--workers N`` (default ``serving.workers``, the number of cores): above 1, this process becomes the
machine's serving PS and starts N uvicorn workers that read its shared tables
(:mod:`serving.serving_ps`); 1, or the built-in "fm" model, runs today's single process (its own
tables and delta feed), which is what the tests use unless they ask for workers.

On a host that is not loopback with no API key set (:mod:`services.api_keys`), or with a key file
that cannot be read, it starts nothing: one line on stderr says what to set, exit code 2.
"""

from __future__ import annotations

import argparse
import sys

from services.api_keys import startup_refusal
from services.cli_args import at_least, run_main, tcp_port
from services.log import setup_logging
from services.settings import get_settings


def main(argv: list[str] | None = None) -> int:
    settings = get_settings()
    parser = argparse.ArgumentParser(prog="python -m serving", description=__doc__)
    parser.add_argument("--host", default=settings.serving.host)
    parser.add_argument("--port", type=tcp_port, default=settings.serving.port)
    parser.add_argument("--workers", type=at_least(1), default=settings.serving.workers)
    parser.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ps-pid", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    settings = settings.updated(serving={"host": args.host, "port": args.port, "workers": args.workers})
    refusal = startup_refusal(settings.serving)
    if refusal is not None:  # before anything starts: no PS, no worker, no port
        print(f"driftline serve: {refusal}", file=sys.stderr)
        return 2
    shared = settings.serving.workers > 1 and settings.serving_model != "fm"
    if args.worker_index is None:  # (a worker shares the port its siblings hold)
        from services.ports import Listen, check_ports_free

        check_ports_free([Listen(args.host, args.port, "serving's API", "serving.port")])
    if args.worker_index is None and shared:
        from serving import replica_metrics

        replica_metrics.prepare(replica_metrics.directory_for(settings.serving_ps_dir))  # before the imports below
        from serving.serving_ps import main as serving_ps

        setup_logging("serving-ps", settings.log_level)
        return serving_ps(settings)
    # imported here, not above: the serving PS must set up its metrics before prometheus_client loads
    from services.uvicorn_server import serve
    from serving.app import create_app

    model, sock = None, None
    if args.worker_index is not None:  # a worker of this machine's serving PS
        from serving.serving_ps import listen, worker_spool
        from serving.shared_model import SharedModel

        settings = settings.updated(serving={"spool_dir": worker_spool(settings, args.worker_index)})
        options = settings.serving
        model = SharedModel(settings.serving_model, settings.serving_ps_dir, options.ps_max_shards,
                            options.ps_state_bytes, ps_pid=args.ps_pid)
        sock = listen(args.host, args.port)
    setup_logging("serving" if args.worker_index is None else f"serving-w{args.worker_index}", settings.log_level)
    # One request's tensors are small: intra-op threads only contend with the event loop and
    # other replicas. Scale out with processes (one per core), not torch threads.
    import torch

    torch.set_num_threads(1)
    app = create_app(settings, model)
    # uvicorn reports a failed start-up (e.g. the spool is locked by another replica) by exiting
    # the server without serving; the log says why.
    return 0 if serve(app, args.host, args.port, settings.log_level, sock) else 3


if __name__ == "__main__":
    raise SystemExit(run_main(main, "python -m serving"))
