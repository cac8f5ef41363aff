import sys

from joiner.faust_app import main
from services.cli_args import run_main

sys.exit(run_main(main, "python -m joiner"))
