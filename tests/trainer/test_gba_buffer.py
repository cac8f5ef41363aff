"""trainer.dist.gba's token buffer on its own: releases, decay, drops, async, errors."""

from __future__ import annotations

import numpy as np
import pytest

from trainer.dist.gba import GBAError, TokenBuffer, combine, decay


def test_one_push_per_rank_per_token_is_syncs_sum():
    """N ranks pushing once each against the same token: one release, the plain sum, scale 1."""
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=5).astype(np.float32) for _ in range(3)]
    buf: TokenBuffer = TokenBuffer(global_batch=3 * 8, max_staleness=4)
    rel = [buf.push(0, 8, g) for g in grads]
    assert rel[:2] == [None, None] and rel[2] is not None
    np.testing.assert_array_equal(combine(rel[2], lambda p: p), grads[0] + grads[1] + grads[2])
    assert buf.token == 1 and buf.stats.decayed == 0 and buf.stats.mean_staleness == 0.0


def test_decay_drop_and_counters():
    buf: TokenBuffer = TokenBuffer(global_batch=100, max_staleness=3)
    for _ in range(5):  # five global steps
        buf.push(buf.token, 1, np.ones(1, np.float32))
        assert buf.flush() is not None
    for s in (0, 1, 2, 3, 4):  # staleness s: held (under the global batch) or dropped
        assert buf.push(5 - s, 2, np.ones(1, np.float32)) is None
    r = buf.flush()
    assert r is not None and [w for w, _ in r.parts] == [1.0, 1.0, 0.5, decay(3)] and r.examples == 8
    st = buf.stats
    assert (st.applied, st.decayed, st.dropped, st.dropped_examples) == (6, 2, 1, 2)
    assert st.mean_staleness == (0 + 1 + 2 + 3 + 4) / 10


def test_flush_scales_to_the_mean_and_async_applies_each_push():
    buf: TokenBuffer = TokenBuffer(global_batch=10, max_staleness=1)
    assert buf.push(0, 4, np.full(2, 4.0, np.float32)) is None
    r = buf.flush()
    assert r is not None and r.scale == 2.5 and combine(r, lambda p: p).tolist() == [10.0, 10.0]
    assert buf.flush() is None and buf.pending_examples == 0
    a: TokenBuffer = TokenBuffer(global_batch=10, max_staleness=0, mode="async")
    assert all(a.push(0, 5, i) is not None for i in range(4))  # stale ones too: no drop, no decay
    assert a.stats.dropped == 0 and a.stats.decayed == 0 and a.stats.staleness_sum == 0 + 1 + 2 + 3


@pytest.mark.parametrize("kw", [{"global_batch": 0, "max_staleness": 1}, {"global_batch": 1, "max_staleness": -1},
                                {"global_batch": 1, "max_staleness": 1, "mode": "sync"}])
def test_bad_settings_raise(kw):
    with pytest.raises(GBAError):
        TokenBuffer(**kw)


def test_a_token_from_the_future_raises():
    with pytest.raises(GBAError):
        TokenBuffer(global_batch=1, max_staleness=1).push(1, 1, None)
