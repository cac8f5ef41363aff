"""``python -m serving``: run the ranking API under uvicorn on settings.serving.host/port."""

from __future__ import annotations

import argparse

import uvicorn

from serving.app import create_app
from serving.options import ServingOptions
from services.log import setup_logging
from services.settings import get_settings


def main(argv: list[str] | None = None) -> int:
    settings = get_settings()
    opts = ServingOptions.from_settings(settings)
    parser = argparse.ArgumentParser(prog="python -m serving", description=__doc__)
    parser.add_argument("--host", default=opts.host)
    parser.add_argument("--port", type=int, default=opts.port)
    args = parser.parse_args(argv)
    setup_logging("serving", settings.log_level)
    # One request's tensors are small: intra-op threads only contend with the event loop and
    # other replicas. Scale out with processes (one per core), not torch threads.
    import torch

    torch.set_num_threads(1)
    app = create_app(settings, opts)
    uvicorn.run(app, host=args.host, port=args.port, log_level=settings.log_level.lower(), access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
