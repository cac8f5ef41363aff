"""Fixtures of the client tests: a real serving (uvicorn in a thread) on the session broker and Redis,
from the serving tests' helpers."""

import sys
from pathlib import Path

# The serving tests' helpers are a plain module of their folder (no package): reach it the same way.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))

from serving_helpers import options, serving_settings  # noqa: F401 - fixtures
