"""Fixtures of the serving tests (helpers live in serving_helpers.py)."""

from serving_helpers import filled_store, options, serving_settings  # noqa: F401 - fixtures
