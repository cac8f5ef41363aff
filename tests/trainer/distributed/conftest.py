"""The N-rank tests' shared stream."""

import pytest

from trainer.data import MovieLensData

from .rank_local import RankPool
from .test_ranks import N


@pytest.fixture(scope="module")
def ml_examples():
    """The first N MovieLens examples (tests/trainer/distributed/test_ranks.N)."""
    return MovieLensData(limit=N).examples()


@pytest.fixture(scope="module")
def rank_pool():
    """Two gloo ranks that a test file's calls share (rank_local.RankPool: one spawn, not one a call)."""
    pool = RankPool(2)
    yield pool
    pool.close()
