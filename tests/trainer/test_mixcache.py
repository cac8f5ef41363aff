"""The MixCache (trainer/mixcache.py) with the CPU as its device: the cached trainer equals the
uncached one bit for bit (rows, optimizer state, last-update times, the rows a delta would carry,
the dense head, every step's predictions), eviction under pressure included."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from proto import ParameterDelta
from ps import SGDConfig
from tests.trainer.test_online import read_topic
from trainer import snapshots
from trainer.config import deepfm_config
from trainer.data import MovieLensData, produce_examples
from trainer.mixcache import _CachedTable
from trainer.model import SparseModel, make_tables
from trainer.online import OnlineTrainer
from trainer.step_checks import NonFiniteStepError
from trainer.sync import apply_delta, complete_versions


async def assert_deltas_rebuild(settings, tr: OnlineTrainer, cfg) -> None:
    """The sparse deltas ``tr`` published rebuild, on serving replicas, the tables it last synced."""
    msgs = [ParameterDelta.FromString(v) for v in await read_topic(settings, settings.topics.param_deltas)]
    replicas = make_tables(cfg, serving=True)
    for version in complete_versions([m for m in msgs if m.WhichOneof("payload") == "sparse"]):
        for m in version:
            apply_delta(replicas, m)
    for name in tr.model.tables:
        k, v, _, _ = tr.publisher.last_sync_tables[name]
        rk, rv, _, _ = replicas[name].items()
        assert np.array_equal(k, rk) and np.array_equal(v, rv), name


@pytest.fixture(scope="module")
def batches():
    data = MovieLensData(limit=24_000)
    return list(data.batches(512, np.arange(24_000)))


def _cfg(**kw):
    return deepfm_config(dim=8, mlp=[16], recent_items=False, seed=3, sequential=False, **kw)


def _train(model: SparseModel, batches) -> list[np.ndarray]:
    return [model.train_step(b)[1] for b in batches]


def _assert_same(a: SparseModel, b: SparseModel) -> None:
    b.write_back()
    for name in a.tables:
        ka, va, sa, ta = a.tables[name].items()
        kb, vb, sb, tb = b.tables[name].items()
        assert np.array_equal(ka, kb), name
        assert np.array_equal(va, vb), name
        assert np.array_equal(sa, sb), name
        assert np.array_equal(ta, tb), name
        # the rows a sparse delta would carry now, and their values
        ca, cb = list(a.tables[name].pop_updates()), list(b.tables[name].pop_updates())
        assert [c.keys.tolist() for c in ca] == [c.keys.tolist() for c in cb], name
        assert all(np.array_equal(x.values, y.values) for x, y in zip(ca, cb, strict=True)), name
    for (na, pa), (nb, pb) in zip(a.head.state_dict().items(), b.head.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb), na


def test_admission_merges_keys_into_the_sorted_array():
    """_CachedTable.add merges (no full re-sort): the keys stay sorted, each with its slot."""
    part = _CachedTable(make_tables(_cfg())["user_id"], 0, 100, 64)
    rng = np.random.default_rng(0)
    want: dict[int, int] = {}
    for _ in range(20):
        keys = rng.choice(np.setdiff1d(np.arange(-500, 500), part.keys), 5, replace=False)
        slots = rng.integers(0, 100, 5)
        part.add(keys, slots)
        want.update(zip(keys.tolist(), slots.tolist()))
        assert np.array_equal(part.keys, np.sort(list(want)))
        assert part.slots.tolist() == [want[k] for k in part.keys.tolist()]


@pytest.mark.parametrize("rows", [64, 4096])
def test_the_cached_trainer_equals_the_uncached_one_bit_for_bit(batches, rows):
    plain = SparseModel(_cfg())
    cached = SparseModel(_cfg(), cache_rows=rows)
    pa, pb = _train(plain, batches), _train(cached, batches)
    assert all(np.array_equal(x, y) for x, y in zip(pa, pb, strict=True))
    stats = cached.cache.stats
    assert stats.hit_rate > (0.3 if rows == 64 else 0.7), stats
    if rows == 64:  # 64 rows a table: the cache evicts all along
        assert stats.evicted > 1000, stats
    _assert_same(plain, cached)
    # predictions read the cached rows; a write-back in between changes nothing
    assert np.array_equal(plain.predict(batches[0]), cached.predict(batches[0]))
    _train(plain, batches[:5])
    _train(cached, batches[:5])
    _assert_same(plain, cached)


@pytest.mark.parametrize("optimizer", ["sgd", "capped_adagrad"])
def test_other_optimizers_cache_too_and_equal(batches, optimizer):
    """SGD embedding tables, and Adagrad's ``max_accumulator`` (applied in the cache as on the host,
    bit for bit)."""
    def opt(t):
        if optimizer == "sgd":
            return SGDConfig(lr=0.05) if t.dim > 1 else t.optimizer
        return t.optimizer.model_copy(update={"max_accumulator": 0.001})

    def cfg():
        c = _cfg()
        return c.model_copy(update={"tables": [t.model_copy(update={"optimizer": opt(t)}) for t in c.tables]})

    plain, cached = SparseModel(cfg()), SparseModel(cfg(), cache_rows=256)
    _train(plain, batches[:20])
    _train(cached, batches[:20])
    assert cached.cache.stats.hits
    _assert_same(plain, cached)
    if optimizer == "capped_adagrad":
        assert (plain.tables["gender"].items()[2] == np.float32(0.001)).all()  # the cap was reached, and held


def test_a_non_finite_cached_gradient_applies_nothing(batches):
    m = SparseModel(_cfg(), cache_rows=4096)
    _train(m, batches[:10])
    m.write_back()
    before = {n: t.items() for n, t in m.tables.items()}
    head = {k: v.clone() for k, v in m.head.state_dict().items()}
    b = batches[10]
    orig = m.cache.split_gradients

    def poisoned(at, grad):
        grad = grad.clone()
        grad[at.hit[:1]] = float("nan")
        return orig(at, grad)

    m.cache.split_gradients = poisoned
    with pytest.raises(NonFiniteStepError):
        m.train_step(b)
    m.cache.split_gradients = orig
    m.write_back()
    for n, t in m.tables.items():
        keys = before[n][0]  # the lookup admitted the batch's new ids, as it does uncached
        assert np.array_equal(t.read_rows(keys)[0], before[n][1]), n
        assert np.array_equal(t.read_rows(keys)[1], before[n][2]), n
    assert all(torch.equal(head[k], v) for k, v in m.head.state_dict().items())


def test_a_sequential_model_says_the_cache_is_not_for_it():
    with pytest.raises(ValueError, match="sequential"):
        SparseModel(deepfm_config(dim=8, mlp=[16], recent_items=False), cache_rows=64)


async def test_online_with_the_cache_publishes_what_it_learned_and_resumes_after_kill_9(settings, tmp_path):
    """On the real broker: every delta carries the cached rows' values (written back before each
    sync), replayed deltas rebuild the trainer's tables; kill -9 with the cache on and a restart
    apply every example once."""
    n = 12_000
    examples = MovieLensData(limit=n).examples()
    cfg = _cfg()
    records = await produce_examples(settings, examples[:n // 2])
    s = settings.updated(trainer=dict(sync_interval_s=0.5, snapshot_interval_event_s=0, batch_size=512,
                                      cache_rows=256))
    tr = OnlineTrainer(s, cfg)
    tr.publisher.keep_last_sync_copy = True
    run = asyncio.create_task(tr.run(stop_when_idle_s=3))
    res = await asyncio.wait_for(run, 120)
    assert res["examples_applied"] == n // 2 and tr.model.cache.stats.hit_rate > 0.3, tr.model.cache.stats
    await assert_deltas_rebuild(settings, tr, cfg)

    # kill -9 mid-stream with the cache on, then a restart: every example applied once. The last
    # quarter is produced after the kill: the trainer cannot finish before it
    (tmp_path / "model.json").write_text(cfg.model_dump_json())
    records += await produce_examples(settings, examples[n // 2:3 * n // 4])
    root = settings.var_dir / "snapshots" / cfg.model_id
    log = tmp_path / "trainer.log"
    env = dict(os.environ, KAFKA_BOOTSTRAP_SERVERS=settings.bootstrap_servers, DRIFTLINE_VAR_DIR=str(settings.var_dir),
               DRIFTLINE_TOPICS__EXAMPLES=settings.topics.examples,
               DRIFTLINE_TOPICS__PARAM_DELTAS=settings.topics.param_deltas,
               DRIFTLINE_TOPICS__DEAD_LETTERS=settings.topics.dead_letters,
               DRIFTLINE_TRAINER__MODEL=str(tmp_path / "model.json"), DRIFTLINE_TRAINER__CACHE_ROWS="256",
               DRIFTLINE_TRAINER__GROUP_ID=s.trainer.group_id)

    def spawn() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "trainer", "online", "--sync-interval-s", "1",
                                 "--snapshot-interval-event-s", "600", "--stop-when-idle-s", "4",
                                 "--batch-size", "256"], env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                                cwd=Path(__file__).parents[2])

    p = spawn()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        m = snapshots.read_manifest(root)
        if m and m["examples_applied"] >= n // 2 + 1500:
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError(log.read_text()[-3000:])
    p.send_signal(signal.SIGKILL)
    p.wait()
    killed_at = snapshots.read_manifest(root)
    assert killed_at["examples_applied"] <= 3 * n // 4
    records += await produce_examples(settings, examples[3 * n // 4:])
    p = spawn()
    assert p.wait(timeout=120) == 0, log.read_text()[-3000:]
    final = snapshots.read_manifest(root)
    assert final["examples_applied"] == n, (killed_at, final)
    assert sum(final["offsets"].values()) == records


def test_the_cache_and_the_copies_are_exported(batches):
    from prometheus_client import REGISTRY

    from trainer.metrics import PSCounts

    m = SparseModel(_cfg(model_id="cache-metrics"), cache_rows=512)
    counts = PSCounts("cache-metrics", m.tables, m)
    _train(m, batches[:10])
    m.write_back()
    counts.update()

    def sample(event: str) -> float | None:
        return REGISTRY.get_sample_value("driftline_trainer_cache_rows_total", {"model": "cache-metrics", "rank": "",
                                                                               "event": event})

    st = m.cache.stats
    assert sample("lookup") == st.lookups > sample("hit") == st.hits > 0
    assert sample("written_back") == st.written_back > 0 and sample("admitted") == st.admitted > 0


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the device tool lends one)")


@cuda
def test_on_cuda_the_dense_path_and_the_cache_follow_the_cpu(batches):
    """CUDA sums with atomics and its matmuls differ from the CPU's in the last bits: the same
    stream trained on the GPU stays within float tolerance of the CPU, with and without the cache."""
    cpu = SparseModel(_cfg())
    gpu = SparseModel(_cfg(), device="cuda")
    gpu_cache = SparseModel(_cfg(), device="cuda", cache_rows=4096)
    pc, pg, pk = _train(cpu, batches[:20]), _train(gpu, batches[:20]), _train(gpu_cache, batches[:20])
    for a, b, c in zip(pc, pg, pk, strict=True):
        np.testing.assert_allclose(b, a, atol=2e-3)
        np.testing.assert_allclose(c, a, atol=2e-3)
    gpu_cache.write_back()
    assert gpu_cache.cache.stats.hit_rate > 0.5 and gpu_cache.io.h2d_bytes < gpu.io.h2d_bytes
    for name in cpu.tables:
        np.testing.assert_allclose(gpu_cache.tables[name].items()[1], cpu.tables[name].items()[1], atol=1e-3)
    for (k, a), b in zip(cpu.head.state_dict().items(), gpu.head.state_dict().values(), strict=True):
        torch.testing.assert_close(b.cpu(), a, atol=1e-3, rtol=1e-3, msg=k)
