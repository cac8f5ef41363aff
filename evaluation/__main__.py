"""``python -m evaluation ...`` = ``driftline eval ...``."""

import sys

from .cli import main

sys.exit(main())
