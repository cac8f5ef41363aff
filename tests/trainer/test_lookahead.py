"""The lookahead (trainer/prefetch.py): a trainer that reads batch k+1 while batch k trains equals
the sequential one bit for bit (rows, optimizer state, last-update times, the rows a delta would
carry, the dense head and its Adam state, every step's probabilities), over a stream whose
consecutive batches share half their examples, with and without the MixCache, with admission gates."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from ps.config import AdmissionConfig
from tests.trainer.test_mixcache import _assert_same, _cfg, assert_deltas_rebuild
from trainer.data import MovieLensData, produce_examples
from trainer.model import SparseModel
from trainer.online import OnlineTrainer


@pytest.fixture(scope="module")
def overlapping():
    """Batches of 512 examples, each sharing 256 with the one before it: most ids of batch k+1 were
    stepped by batch k, the case the re-read exists for."""
    data = MovieLensData(limit=12_000)
    rows = np.concatenate([np.arange(i * 256, i * 256 + 512) for i in range(40)])
    return list(data.batches(512, rows))


def _plain(model: SparseModel, batches) -> list[np.ndarray]:
    return [model.train_step(b)[1] for b in batches]


def _ahead(model: SparseModel, batches) -> list[np.ndarray]:
    assert model.lookahead is not None
    return [probs for _, (_, probs) in model.train_steps(batches)]


def _assert_equal(plain: SparseModel, ahead: SparseModel, pa, pb) -> None:
    assert len(pa) == len(pb)
    assert all(np.array_equal(x, y) for x, y in zip(pa, pb, strict=True))
    plain.write_back()  # the sequential trainer may have its cache too
    _assert_same(plain, ahead)
    sa, sb = plain.optimizer.state_dict()["state"], ahead.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        for name in sa[k]:
            assert torch.equal(sa[k][name], sb[k][name]), (k, name)


@pytest.mark.parametrize("cache_rows", [0, 64, 4096])
def test_the_lookahead_trainer_equals_the_sequential_one_bit_for_bit(overlapping, cache_rows):
    plain = SparseModel(_cfg(), cache_rows=cache_rows)
    ahead = SparseModel(_cfg(), cache_rows=cache_rows, lookahead=True)
    pa, pb = _plain(plain, overlapping), _ahead(ahead, overlapping)
    _assert_equal(plain, ahead, pa, pb)
    la = ahead.lookahead
    assert la.reads == len(overlapping) - 1
    # the re-read is what made it exact: ids batch k stepped were read again for batch k+1
    assert la.rows_reread > 0
    if cache_rows == 64:
        assert ahead.cache.stats.evicted > 100, ahead.cache.stats
    assert np.array_equal(plain.predict(overlapping[0]), ahead.predict(overlapping[0]))


@pytest.mark.parametrize("admission", [AdmissionConfig(min_count=3), AdmissionConfig(probability=0.5)])
def test_admission_gates_admit_the_same_rows(overlapping, admission):
    """An id of batch k not admitted there must not be admitted before batch k's update (which
    would then step it): the read does not insert, the re-read admits in the sequential order."""
    def cfg():
        c = _cfg()
        return c.model_copy(update={"tables": [t.model_copy(update={"admission": admission}) for t in c.tables]})

    plain, ahead = SparseModel(cfg(), cache_rows=64), SparseModel(cfg(), cache_rows=64, lookahead=True)
    _assert_equal(plain, ahead, _plain(plain, overlapping), _ahead(ahead, overlapping))


def test_a_read_of_a_batch_not_trained_next_is_dropped(overlapping):
    """``then`` is a promise the caller may break (a failing step bisected, a batch dropped): the
    step that comes instead looks its batch up itself, and a later use of the read re-reads what
    every step in between changed."""
    b = overlapping
    plain, ahead = SparseModel(_cfg(), cache_rows=64), SparseModel(_cfg(), cache_rows=64, lookahead=True)
    pa = _plain(plain, [b[0], b[2], b[1], b[3]])
    pb = [ahead.train_step(b[0], then=b[1])[1],
          ahead.train_step(b[2])[1],             # not the batch read ahead: looked up as without lookahead
          ahead.train_step(b[1], then=b[3])[1],  # its read was dropped
          ahead.train_step(b[3], then=b[4])[1]]
    ahead.train_step(b[1].select(np.arange(4)), then=b[4])  # steps between a read and its use
    plain.train_step(b[1].select(np.arange(4)))
    pa.append(plain.train_step(b[4])[1])
    pb.append(ahead.train_step(b[4])[1])
    _assert_equal(plain, ahead, pa, pb)


def test_models_that_cannot_look_ahead_say_why():
    with pytest.raises(ValueError, match="sequential"):
        SparseModel(_cfg().model_copy(update={"sequential": True}), lookahead=True)
    ttl = _cfg(ttl_seconds=3600.0)
    with pytest.raises(ValueError, match="TTL"):
        SparseModel(ttl, lookahead=True)
    # None: on where it helps and can (CUDA), off here
    assert SparseModel(ttl, lookahead=None).lookahead is None
    assert SparseModel(_cfg(), lookahead=None).lookahead is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cache_rows", [0, 4096])
def test_on_cuda_the_lookahead_trainer_equals_the_cuda_one(overlapping, cache_rows):
    """On CUDA (the read copied on a second stream): equal to the CUDA trainer without lookahead.
    Without a cache the rows are bit for bit (the same kernels in the same order); the cache steps
    its hits with atomics, so there the rows agree to float32 rounding."""
    plain = SparseModel(_cfg(), device="cuda", cache_rows=cache_rows, lookahead=False)
    ahead = SparseModel(_cfg(), device="cuda", cache_rows=cache_rows)
    assert ahead.lookahead is not None  # on by default on CUDA
    pa, pb = _plain(plain, overlapping), _ahead(ahead, overlapping)
    if cache_rows:
        assert all(np.allclose(x, y, atol=1e-5) for x, y in zip(pa, pb, strict=True))
    else:
        _assert_equal(plain, ahead, pa, pb)
    assert ahead.lookahead.io.h2d_bytes > 0 or cache_rows


async def test_online_reads_the_queued_batch_ahead(settings):
    """On the real broker, the online loop hands the training thread the batch queued behind the
    one it trains (``max_in_flight`` 2): read ahead, every example applied once, and the deltas it
    published rebuild its tables (the cache written back before each, the reads re-read after)."""
    n = 6_000
    cfg = _cfg()
    await produce_examples(settings, MovieLensData(limit=n).examples())
    s = settings.updated(trainer=dict(sync_interval_s=0.5, snapshot_interval_event_s=0, batch_size=512,
                                      cache_rows=256, lookahead=True))
    tr = OnlineTrainer(s, cfg)
    tr.publisher.keep_last_sync_copy = True
    res = await asyncio.wait_for(asyncio.create_task(tr.run(stop_when_idle_s=3)), 120)
    assert res["examples_applied"] == n
    assert tr.model.lookahead is not None  # its reads depend on the timing: a batch queued or not
    await assert_deltas_rebuild(settings, tr, cfg)
    # the training thread's step reads the batch queued behind its own
    x, y = list(MovieLensData(limit=1024).batches(512, np.arange(1024)))
    tr._queued.extend([x, y])
    tr._train(x)
    assert tr.model.lookahead._next is not None and tr.model.lookahead._next[0] is y
    reads = tr.model.lookahead.reads
    tr._train(y)
    assert tr.model.lookahead.reads == reads + 1 and not tr._queued
