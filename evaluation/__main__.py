"""``python -m evaluation ...`` = ``driftline eval ...``."""

import sys

from services.cli_args import run_main

from .cli import main

sys.exit(run_main(main, "python -m evaluation"))
