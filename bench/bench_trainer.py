"""Trainer throughput and freshness. ``QUICK=1`` for a < 1 min run. Last line: JSON.

* batch: DeepFM (8 slots, dim 16, MLP 256-128, batch 1024) on PS tables, ml-1m: one packed
  ``ParameterServer.gather`` + one ``apply_gradients`` per step.
* dense baseline: the same head (same ``DenseHead``, same dense optimizer) over one
  ``nn.EmbeddingBag(sparse=True)`` per field with hashed ids (2^18 buckets), torch's sparse Adagrad
  (the paper's collision baseline).
* Both in this process, after ``import trainer`` (libgomp in passive wait mode: see
  ``trainer/__init__.py``); ``OMP_WAIT_POLICY=ACTIVE make bench-trainer`` shows the default.
* The two run in alternating rounds over the same batches in one process, so load from other
  jobs hits both; rates are medians over rounds and the ratio is the median of per-round ratios.
  Done with 2 torch threads (both cores) and with 1.
* decode: example-batch records (:mod:`services.example_batch`, 1000 examples each) -> checked,
  deduplicated ``SparseBatch`` (what the online path pays per batch), next to a per-example
  protobuf-object path; ``record_bytes_per_example``: the records' bytes per example.
* online: the same model trained from a real (embedded tansu) broker (example batches of 1000
  per record, ``trainer.data.produce_examples``), compared with batch. The trainer's own consumer fetches (``loader`` in the JSON: ``inline``,
  kept for comparison with older runs, which used a loader process).
* freshness: live examples (event time = now, stamped as each tick's batches are produced) -> their sparse delta
  published (``OnlineTrainer.publisher.event_delays``: event time to publish, which here is the issue's
  "action as produced -> delta published"; ``sync_delay_seconds`` counts from arrival), sync every 1 s,
  measured after the consumer group joined and a warm-up (steady state; the first join on tansu
  takes ~5 s and is reported apart as ``group_join_s``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trainer  # noqa: F401  - before torch: sets OMP_WAIT_POLICY=PASSIVE (see trainer/__init__.py)

# isort: split
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from trainer.config import deepfm_config
from trainer.data import MovieLensData, produce_examples
from trainer.model import DenseHead, SparseModel, make_dense_optimizer

warnings.filterwarnings("ignore", message="Sparse invariant")
QUICK = os.environ.get("QUICK") == "1"
ROUNDS = 5 if QUICK else 9
ROUND_BATCHES = 10 if QUICK else 40
N_ONLINE = 30_000 if QUICK else 200_000
LIVE_S = 4.0 if QUICK else 10.0
LIVE_RATE = 2_000  # examples/s produced in the freshness phase


class DenseBaseline(nn.Module):
    """The same DeepFM head over hashed, fixed-size ``nn.EmbeddingBag`` tables (one per field)."""

    def __init__(self, cfg, buckets=1 << 18):
        super().__init__()
        self.cfg, self.buckets = cfg, buckets
        self.emb = nn.ModuleDict({s: nn.EmbeddingBag(buckets, cfg.embed_dim, mode=cfg.pooling.get(s, "sum"), sparse=True)
                                  for s in cfg.slots})
        self.lin = nn.ModuleDict({s: nn.EmbeddingBag(buckets, 1, mode=cfg.pooling.get(s, "sum"), sparse=True)
                                  for s in cfg.linear})
        for e in self.emb.values():
            nn.init.normal_(e.weight, std=0.01)
        for e in self.lin.values():
            nn.init.zeros_(e.weight)
        self.head = DenseHead(cfg)

    def forward(self, b):
        def bag(mod, s):
            return mod(torch.from_numpy(b.ids[s] % self.buckets), torch.from_numpy(b.offsets[s][:-1]))
        emb = torch.stack([bag(self.emb[s], s) for s in self.cfg.slots], 1)
        lin = torch.cat([bag(self.lin[s], s) for s in self.cfg.linear], 1)
        return self.head(emb, lin, None)


def dense_stepper(cfg):
    m = DenseBaseline(cfg)
    opt_s = torch.optim.Adagrad(list(m.emb.parameters()) + list(m.lin.parameters()), lr=0.05)
    opt_d = make_dense_optimizer(cfg, m.head)  # the PS model's dense optimizer, exactly

    def step(b):
        loss = F.binary_cross_entropy_with_logits(m(b), torch.from_numpy(b.labels))
        opt_s.zero_grad()
        opt_d.zero_grad()
        loss.backward()
        opt_s.step()
        opt_d.step()
    return step


def bench_batch(data, cfg, threads):
    """Alternating rounds: PS model, then dense baseline, on the same batches."""
    torch.set_num_threads(threads)
    ps_model = SparseModel(cfg)
    steppers = {"ps": ps_model.train_step, "dense": dense_stepper(cfg)}
    n = ROUNDS * ROUND_BATCHES + 3
    batches = list(data.batches(1024, np.arange(min(n * 1024, len(data)))))
    for f in steppers.values():  # warm-up: numba, allocator, optimizer state
        for b in batches[:3]:
            f(b)
    ps_model.timings.clear()
    rates = {k: [] for k in steppers}
    for r in range(ROUNDS):
        chunk = batches[3 + r * ROUND_BATCHES: 3 + (r + 1) * ROUND_BATCHES]
        order = list(steppers) if r % 2 == 0 else list(steppers)[::-1]
        for k in order:
            t0 = time.perf_counter()
            for b in chunk:
                steppers[k](b)
            rates[k].append(sum(b.size for b in chunk) / (time.perf_counter() - t0))
    ratio = float(np.median(np.array(rates["ps"]) / np.array(rates["dense"])))
    per_step = {k: round(v / (ROUNDS * ROUND_BATCHES) * 1000, 3) for k, v in ps_model.timings.items()}
    return float(np.median(rates["ps"])), float(np.median(rates["dense"])), ratio, per_step, rates


def bench_decode(data, cfg):
    """Example-batch records -> checked, deduplicated ``SparseBatch`` per second, one thread: the
    online path (``example_batch.decode``, ``trainer.ingest.refusals``, the dedup window,
    ``example_batch.to_sparse_batch_arrays``) over records of 1000 examples, and, for comparison,
    the per-example protobuf path (parse, slot check, ``SparseBatch.from_examples``; unvalidated: the
    per-example validator went with the one-example-per-record format, so this flatters it a little).
    Also the bytes per example on the topic (the records' values)."""
    from proto import Example
    from services import example_batch
    from trainer import ingest
    from trainer.batch import SparseBatch
    from trainer.data import example_records
    from trainer.dedup import DedupWindow, duplicates

    examples = data.examples(np.arange(8192))
    records = [v for _, v in example_records(examples, [0], 1000)]
    raw = [e.SerializeToString() for e in examples]
    known = set(cfg.all_slots)
    duplicates(DedupWindow(8), np.zeros((0, 2), np.uint64), example_batch.hash_ids(["a"]))  # numba cache

    def batch_path():
        window = DedupWindow(200_000)
        for v in records:
            c = example_batch.decode(v)
            keep = ingest.refusals(c, known, cfg.label, cfg.dense_features, now_ms=2**62, max_future_ms=0) == 0
            arrays = example_batch.to_sparse_batch_arrays([c], cfg.all_slots, cfg.label, cfg.dense_features)
            h = arrays.pop("meta")["id_hash"]
            rows = np.flatnonzero(keep)
            rows = rows[~duplicates(window, np.zeros((0, 2), np.uint64), h[rows])]
            b = SparseBatch(**arrays)
            if rows.size < b.size:
                b = b.select(rows)
            window.add_many(h[rows])

    def protobuf_path():
        for a in range(0, len(raw), 1024):
            msgs = [Example.FromString(r) for r in raw[a:a + 1024]]
            msgs = [m for m in msgs if known.issuperset(m.features.sparse.keys())]
            SparseBatch.from_examples(msgs, cfg.all_slots, cfg.label)

    best = {}
    for name, f in (("batch", batch_path), ("protobuf", protobuf_path)):
        for _ in range(3):
            t0 = time.perf_counter()
            f()
            best[name] = max(best.get(name, 0.0), len(raw) / (time.perf_counter() - t0))
    return best["batch"], best["protobuf"], sum(map(len, records)) / len(examples)


async def bench_online(data, cfg, bootstrap):
    from services.kafka import create_topics, producer, start_client
    from services.settings import Settings
    from trainer.data import example_records
    from trainer.online import OnlineTrainer

    os.environ["KAFKA_BOOTSTRAP_SERVERS"] = bootstrap
    sfx = uuid.uuid4().hex[:8]
    s = Settings(var_dir=Path(tempfile.mkdtemp()))
    for t in ("examples", "param_deltas", "dead_letters"):
        setattr(s.topics, t, f"{t}-{sfx}")
    await produce_examples(s, data.examples(np.arange(min(N_ONLINE, len(data)))))
    tr = OnlineTrainer(s.updated(trainer=dict(sync_interval_s=10, snapshot_interval_event_s=0, group_id=f"bench-{sfx}")), cfg)
    res = await tr.run(stop_when_idle_s=2.0)
    online_rate = res["examples_applied"] / max(1e-9, tr.last_batch_at - tr.first_batch_at)

    # freshness: live examples (event time = now) at LIVE_RATE/s, sync every 1 s, steady state
    s.topics.examples = f"examples-live-{sfx}"
    await create_topics(s, {s.topics.examples: s.topics.partitions})
    tr2 = OnlineTrainer(s.updated(trainer=dict(sync_interval_s=1.0, snapshot_interval_event_s=0, group_id=f"live-{sfx}", snapshot_dir=s.var_dir / "snapshots-live")), cfg)
    n_live = int(LIVE_RATE * (LIVE_S + 2))
    live = data.examples(np.arange(n_live) % len(data))
    t_join = time.monotonic()
    run = asyncio.create_task(tr2.run())  # stopped below, once the last examples were published
    await asyncio.wait_for(tr2.ready.wait(), 60)
    join_s = time.monotonic() - t_join
    p = producer(s)
    await start_client(p, s)
    partitions = sorted(await p.partitions_for(s.topics.examples))
    pos = 0

    async def produce_for(seconds):
        nonlocal pos
        tick, per_tick = 0.05, int(LIVE_RATE * 0.05)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t0 = time.monotonic()
            now = int(time.time() * 1000)
            for e in live[pos:pos + per_tick]:
                e.event_time_ms = now
            # a tick's examples as example batches, one per partition (what a joiner batching its
            # output every 50 ms sends)
            for part, value in example_records(live[pos:pos + per_tick], partitions):
                await p.send(s.topics.examples, value, partition=part)
            pos = (pos + per_tick) % (n_live - per_tick)
            await asyncio.sleep(max(0.0, tick - (time.monotonic() - t0)))

    await produce_for(1.0)       # warm-up: first fetches, first syncs
    await asyncio.sleep(1.5)     # let the warm-up examples be published
    tr2.publisher.event_delays.clear()
    await produce_for(LIVE_S)    # measured
    await p.flush()
    await p.stop()
    await asyncio.sleep(2.5)  # > 2 sync intervals: the last examples are trained on and published
    tr2.stop_event.set()
    await run
    d = np.array(tr2.publisher.event_delays)  # event time (= when produced) -> delta published
    fresh = {"p50": float(np.percentile(d, 50)), "p95": float(np.percentile(d, 95)), "max": float(d.max()),
             "n": int(d.size)} if d.size else {"p50": float("nan"), "p95": float("nan"), "max": float("nan"), "n": 0}
    res["loader"] = "inline"
    return online_rate, res, fresh, join_s


def main():
    import subprocess

    from driftline.embedded import tansu_command, wait_for_port
    from services.ports import free_port

    t_start = time.time()
    cfg = deepfm_config(dim=16, mlp=[256, 128], recent_items=False)  # the 8 slots
    data = MovieLensData(limit=max(N_ONLINE, (ROUNDS * ROUND_BATCHES + 3) * 1024, 60_000))
    out = {}
    for threads in (2, 1):
        ps_rate, dense_rate, ratio, per_step, rates = bench_batch(data, cfg, threads)
        print(f"[{threads} torch threads] batch (PS) {ps_rate:,.0f} ex/s  dense EmbeddingBag {dense_rate:,.0f} ex/s  "
              f"ratio {ratio:.2f} (per round: {', '.join(f'{a / b:.2f}' for a, b in zip(rates['ps'], rates['dense']))})"
              f"  PS step ms {json.dumps(per_step)}", flush=True)
        out[threads] = (ps_rate, dense_rate, ratio, per_step)
    torch.set_num_threads(2)
    decode_rate, decode_pb_rate, record_bytes = bench_decode(data, cfg)
    print(f"decode (example-batch records -> SparseBatch, one thread) {decode_rate:,.0f} ex/s "
          f"(per-example protobuf objects: {decode_pb_rate:,.0f} ex/s); {record_bytes:.0f} bytes/example "
          f"on the topic", flush=True)
    port = free_port()
    proc = subprocess.Popen(tansu_command("127.0.0.1", port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_for_port("127.0.0.1", port, 20, "broker", proc)
        online_rate, res, fresh, join_s = asyncio.run(bench_online(data, cfg, f"127.0.0.1:{port}"))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    batch_rate = out[2][0]
    stages = {k: round(v, 2) for k, v in res["stages"].items()}
    print(f"online {online_rate:,.0f} ex/s (ratio to batch {online_rate / batch_rate:.2f}; "
          f"{res['examples_applied']} examples); stage seconds {json.dumps(stages)}", flush=True)
    print(f"freshness (S=1 s, steady state, {fresh['n']} examples): p50 {fresh['p50']:.2f} s  p95 {fresh['p95']:.2f} s  "
          f"max {fresh['max']:.2f} s; first group join {join_s:.1f} s", flush=True)
    print(json.dumps({
        "batch_ex_per_s": round(batch_rate), "dense_baseline_ex_per_s": round(out[2][1]),
        "batch_vs_dense_ratio": round(out[2][2], 3),
        "batch_ex_per_s_1thread": round(out[1][0]), "dense_baseline_ex_per_s_1thread": round(out[1][1]),
        "batch_vs_dense_ratio_1thread": round(out[1][2], 3),
        "decode_ex_per_s": round(decode_rate), "decode_protobuf_ex_per_s": round(decode_pb_rate),
        "record_bytes_per_example": round(record_bytes, 1),
        "online_ex_per_s": round(online_rate), "online_vs_batch_ratio": round(online_rate / batch_rate, 3),
        "loader": res["loader"],
        "freshness_p50_s": round(fresh["p50"], 3), "freshness_p95_s": round(fresh["p95"], 3),
        "freshness_max_s": round(fresh["max"], 3), "group_join_s": round(join_s, 2),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "quick": QUICK, "wall_s": round(time.time() - t_start, 1)}))


if __name__ == "__main__":
    main()
