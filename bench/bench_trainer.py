"""Trainer throughput and freshness. ``QUICK=1`` for a < 1 min run. Last line: JSON.

* batch: DeepFM (8 slots, dim 16, MLP 256-128, batch 1024) on PS tables, ml-1m.
* dense baseline: the same head over ``nn.EmbeddingBag(sparse=True)`` with hashed ids, sparse Adagrad.
* online: the same model trained from a real (embedded tansu) broker.
* freshness: live examples (event time = now) -> their sparse delta published, sync every 1 s.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import warnings  # noqa: E402
warnings.filterwarnings("ignore", message="Sparse invariant")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from trainer.config import deepfm_config  # noqa: E402
from trainer.data import MovieLensData, produce_examples  # noqa: E402
from trainer.model import DenseHead, SparseModel  # noqa: E402

QUICK = os.environ.get("QUICK") == "1"
N_BATCH = 60_000 if QUICK else 400_000
N_ONLINE = 30_000 if QUICK else 200_000
torch.set_num_threads(2)


def bench_batch(data, cfg):
    m = SparseModel(cfg)
    rows = np.arange(min(N_BATCH, len(data)))
    batches = list(data.batches(1024, rows))
    m.train_step(batches[0])  # warm-up (numba, allocator)
    m.timings.clear()
    t0 = time.perf_counter()
    for b in batches[1:]:
        m.train_step(b)
    dt = time.perf_counter() - t0
    return (rows.size - batches[0].size) / dt, dict(m.timings)


class DenseBaseline(nn.Module):
    def __init__(self, cfg, buckets=1 << 18):
        super().__init__()
        self.cfg, self.buckets = cfg, buckets
        self.emb = nn.ModuleDict({s: nn.EmbeddingBag(buckets, cfg.embed_dim, mode=cfg.pooling.get(s, "sum"), sparse=True)
                                  for s in cfg.slots})
        self.lin = nn.ModuleDict({s: nn.EmbeddingBag(buckets, 1, mode=cfg.pooling.get(s, "sum"), sparse=True)
                                  for s in cfg.linear})
        for e in list(self.emb.values()):
            nn.init.normal_(e.weight, std=0.01)
        for e in self.lin.values():
            nn.init.zeros_(e.weight)
        self.head = DenseHead(cfg)

    def forward(self, b):
        def bag(mod, s):
            ids = torch.from_numpy(b.ids[s] % self.buckets)
            return mod(ids, torch.from_numpy(b.offsets[s][:-1]))
        emb = torch.stack([bag(self.emb[s], s) for s in self.cfg.slots], 1)
        lin = torch.cat([bag(self.lin[s], s) for s in self.cfg.linear], 1)
        return self.head(emb, lin, None)


def bench_dense(data, cfg):
    m = DenseBaseline(cfg)
    sparse_params = list(m.emb.parameters()) + list(m.lin.parameters())
    opt_s = torch.optim.Adagrad(sparse_params, lr=0.05)
    opt_d = torch.optim.Adam(m.head.parameters(), lr=1e-3)
    rows = np.arange(min(N_BATCH, len(data)))
    batches = list(data.batches(1024, rows))

    def step(b):
        loss = F.binary_cross_entropy_with_logits(m(b), torch.from_numpy(b.labels))
        opt_s.zero_grad()
        opt_d.zero_grad()
        loss.backward()
        opt_s.step()
        opt_d.step()
    step(batches[0])
    t0 = time.perf_counter()
    for b in batches[1:]:
        step(b)
    return (rows.size - batches[0].size) / (time.perf_counter() - t0)


async def bench_online(data, cfg, bootstrap):
    from services.settings import Settings
    from trainer.online import OnlineTrainer

    os.environ["KAFKA_BOOTSTRAP_SERVERS"] = bootstrap
    sfx = uuid.uuid4().hex[:8]
    import tempfile
    s = Settings(var_dir=Path(tempfile.mkdtemp()))
    for t in ("examples", "param_deltas", "dead_letters"):
        setattr(s.topics, t, f"{t}-{sfx}")
    ex = data.examples(np.arange(min(N_ONLINE, len(data))))
    await produce_examples(s, ex)
    tr = OnlineTrainer(s, cfg, sync_interval_s=10, snapshot_interval_event_s=0)
    res = await tr.run(stop_when_idle_s=2.0)
    online_rate = res["examples_applied"] / max(1e-9, tr.last_batch_at - tr.first_batch_at)

    # freshness: live examples at ~2k/s for a few seconds, sync every 1 s
    s.topics.examples = f"examples-live-{sfx}"
    tr2 = OnlineTrainer(s, cfg, sync_interval_s=1.0, snapshot_interval_event_s=0, group_id=f"live-{sfx}",
                        snapshot_root=s.var_dir / "snapshots-live")
    run = asyncio.create_task(tr2.run(stop_when_idle_s=3.0))
    from services.kafka import producer, start_client
    from services.kafka import create_topics
    await create_topics(s, {s.topics.examples: s.topics.partitions})
    p = producer(s)
    await start_client(p, s)
    live = data.examples(np.arange(20_000, 20_000 + (6_000 if QUICK else 20_000)))
    for a in range(0, len(live), 200):
        now = int(time.time() * 1000)
        for e in live[a:a + 200]:
            e.event_time_ms = now
            await p.send(s.topics.examples, e.SerializeToString(), key=str(e.user_id).encode())
        await asyncio.sleep(0.1)
    await p.flush()
    await p.stop()
    await run
    fresh = float(np.percentile(np.array(tr2.delays), 95)) if tr2.delays else float("nan")
    return online_rate, fresh, res["stages"]


def main():
    from services.embedded import free_port, tansu_command, wait_for_port
    import subprocess

    cfg = deepfm_config(dim=16, mlp=[256, 128])
    data = MovieLensData(limit=max(N_BATCH, N_ONLINE, 60_000))
    batch_rate, timings = bench_batch(data, cfg)
    print(f"batch (PS) {batch_rate:,.0f} ex/s  stage seconds {json.dumps({k: round(v, 2) for k, v in timings.items()})}")
    dense_rate = bench_dense(data, cfg)
    print(f"dense EmbeddingBag baseline {dense_rate:,.0f} ex/s  ratio {batch_rate / dense_rate:.2f}")
    port = free_port()
    proc = subprocess.Popen(tansu_command("127.0.0.1", port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_for_port("127.0.0.1", port, 20, "broker", proc)
        online_rate, fresh, stages = asyncio.run(bench_online(data, cfg, f"127.0.0.1:{port}"))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    print(f"online {online_rate:,.0f} ex/s (ratio to batch {online_rate / batch_rate:.2f}); "
          f"stage seconds {json.dumps({k: round(v, 2) for k, v in stages.items()})}")
    print(f"freshness p95 {fresh:.2f} s")
    print(json.dumps({"batch_ex_per_s": round(batch_rate), "dense_baseline_ex_per_s": round(dense_rate),
                      "online_ex_per_s": round(online_rate), "freshness_p95_s": round(fresh, 3)}))


if __name__ == "__main__":
    main()
