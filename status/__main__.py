"""``python -m status``: the live status page."""

from services.cli_args import run_main
from status.app import main

if __name__ == "__main__":
    raise SystemExit(run_main(main, "python -m status"))
