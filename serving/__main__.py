"""``python -m serving``: run the ranking API under uvicorn on settings.serving.host/port.

SIGTERM or SIGINT stops it cleanly: uvicorn stops accepting, finishes the requests in flight and
runs the app's shutdown, which ships the feature-log spool for up to
``serving.spool_drain_timeout_s`` (what is left stays on disk for the next start); then the
process exits 0.
"""

from __future__ import annotations

import argparse

from serving.app import create_app
from services.log import setup_logging
from services.settings import get_settings
from services.uvicorn_server import serve


def main(argv: list[str] | None = None) -> int:
    settings = get_settings()
    parser = argparse.ArgumentParser(prog="python -m serving", description=__doc__)
    parser.add_argument("--host", default=settings.serving.host)
    parser.add_argument("--port", type=int, default=settings.serving.port)
    args = parser.parse_args(argv)
    settings = settings.updated(serving={"host": args.host, "port": args.port})
    setup_logging("serving", settings.log_level)
    # One request's tensors are small: intra-op threads only contend with the event loop and
    # other replicas. Scale out with processes (one per core), not torch threads.
    import torch

    torch.set_num_threads(1)
    app = create_app(settings)
    # uvicorn reports a failed start-up (e.g. the spool is locked by another replica) by exiting
    # the server without serving; the log says why.
    return 0 if serve(app, args.host, args.port, settings.log_level) else 3


if __name__ == "__main__":
    raise SystemExit(main())
