import numpy as np
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ps", deadline=None, suppress_health_check=[HealthCheck.too_slow],
                          derandomize=False)
settings.load_profile("ps")


def assert_tables_identical(a, b):
    """Same keys -> same values, optimizer state and times, bit for bit."""
    for x, y in zip(a.items(), b.items()):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


@pytest.fixture
def rng():
    return np.random.default_rng(12345)
