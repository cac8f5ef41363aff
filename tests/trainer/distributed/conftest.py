"""The N-rank tests' shared stream."""

import pytest

from trainer.data import MovieLensData

from .test_ranks import N


@pytest.fixture(scope="module")
def ml_examples():
    """The first N MovieLens examples (tests/trainer/distributed/test_ranks.N)."""
    return MovieLensData(limit=N).examples()
