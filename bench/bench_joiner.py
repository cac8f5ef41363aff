"""Joiner benchmark: joined impressions/s of one joiner worker (Faust) through a real tansu
broker vs a plain aiokafka passthrough of the same messages, changelog bytes per impression, the
takeover time of a second worker, spill-store lookups/s, and memory as waiting impressions grow.

    .venv/bin/python bench/bench_joiner.py          # full
    QUICK=1 .venv/bin/python bench/bench_joiner.py  # < 1 min

The last line of output is one JSON object. Rates are medians over alternating rounds (joiner
with a fresh state store, passthrough to a fresh topic); ``ratio_vs_passthrough`` is the median
of the same-round ratios. Both sides are timed over the same phase: from the first poll (after
start-up) to the last batch acknowledged (the joiner: committed, plus its drain).

``changelog_bytes_per_impression`` (median over the rounds, each round's in
``changelog_bytes_per_round``) depends on how the consumer's fetches interleave the two inputs,
not on the join: an impression joined and closed within the batch that read it reaches the
changelog as its closed record only, one still waiting at the batch's end with its whole
payload. When aiokafka's fetch buffer hands out the features partitions before the actions (the
order its fetch results came in), batches hold one input each and every impression waits across
a batch: about 210 bytes against about 29 when they interleave (measured with a count of each
batch's records by topic; the examples are the same either way). The fetch loop now adds what the
buffer holds of the other input to a one-sided fetch (:func:`joiner.faust_fetch._both_inputs`):
about 74 in such a round. Pausing the input that runs ahead in event time was tried instead: it
made every batch one-sided, about 65 in every round.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from aiokafka import AIOKafkaConsumer, TopicPartition

from driftline.embedded import tansu_command, wait_for_port
from joiner import faust_app
from joiner.config import JoinConfig
from joiner.core import JoinCore
from joiner.stores.rocksdb import RocksDBStore
from joiner.tiered import TieredState
from proto import Action, Candidate, FeatureLog, Features, SparseSlot
from services import tansu_quirks
from services.kafka import create_topics, producer, start_client
from services.ports import free_port
from services.settings import Settings
from tests.joiner.helpers import produce
from tests.joiner.synth import ml_events

QUICK = os.environ.get("QUICK") == "1"


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def passthrough(settings: Settings, n_messages: int, round_no: int) -> dict[str, float]:
    """Consume every input message (features and actions) and produce each one unchanged (no
    decoding, no re-encoding) to another topic, awaiting the acks of each batch like the joiner.

    Timed exactly like the joiner (see :func:`joiner_round`): from the first poll, after start-up
    and seeking, to the last batch's acks. Start-up is reported separately for both."""
    t = settings.topics
    out_topic = f"{t.examples}-passthrough-{round_no}"
    await create_topics(settings, {out_topic: t.partitions})
    t_start = time.perf_counter()
    c = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap_servers, enable_auto_commit=False,
                         group_id=None, max_poll_records=settings.kafka.max_poll_records)
    p = producer(settings)
    await c.start()
    await start_client(p, settings)
    try:
        await c.topics()
        tps = [TopicPartition(topic, i) for topic in (t.features, t.actions) for i in range(t.partitions)]
        c.assign(tps)
        for tp in tps:
            await c.seek_to_beginning(tp)
        loop_start = time.perf_counter()
        seen = 0
        while seen < n_messages:
            batch = await c.getmany(timeout_ms=int(settings.joiner.batch_timeout_s * 1000),
                                    max_records=settings.joiner.batch_size)
            futures = [await p.send(out_topic, r.value, key=r.key) for recs in batch.values() for r in recs]
            seen += len(futures)
            if futures:
                await asyncio.gather(*futures)
        end = time.perf_counter()
        return {"steady_s": end - loop_start, "total_s": end - t_start}
    finally:
        await c.stop()
        await p.stop()


def _changelog_bytes_written() -> float:
    """The worker's count of the key + value bytes it wrote to its changelog (this process)."""
    from prometheus_client import REGISTRY
    return REGISTRY.get_sample_value("driftline_joiner_changelog_bytes_total") or 0.0


async def joiner_round(settings: Settings, var: Path, round_no: int) -> tuple[dict[str, float], dict[str, int]]:
    """One joiner run from offset 0 with a fresh state store. ``steady_s`` is from the first poll
    (after start-up) to the last input batch committed, plus the drain's own work (closing the
    windows still open at the end), without the idle wait that detects the end of input."""
    idle = 0.5
    timings: dict[str, float] = {}
    t_start = time.perf_counter()
    settings = settings.updated(joiner={"store_url": f"rocksdb://{var / f'joiner-state-{round_no}'}",
                                        "group_id": f"bench-joiner-{round_no}"})
    written = _changelog_bytes_written()
    counts = await faust_app.run(settings, until_idle_s=idle, timings=timings)
    counts["changelog_bytes"] = _changelog_bytes_written() - written
    steady = timings["last_batch_end"] - timings["loop_start"] + timings.get("drain_s", 0.0)
    total = steady + (timings["loop_start"] - t_start)
    return {"steady_s": steady, "total_s": total}, counts


async def broker_bench(bootstrap: str, var: Path, n_requests: int, rounds: int) -> dict:
    os.environ["KAFKA_BOOTSTRAP_SERVERS"] = bootstrap
    settings = Settings(var_dir=var)
    events = ml_events(n_requests, seed=7)
    n_imp = sum(len(FeatureLog.FromString(v).candidates) for k, _, v in events if k == "features")
    n_msg = len(events)
    await create_topics(settings)
    await produce(settings, events)
    print(f"broker: {n_msg} messages (features + actions), {n_imp} impressions; "
          f"rates over the same phase: first poll -> last output acked (+ drain for the joiner)")
    pts, joins, changelog = [], [], []
    for i in range(rounds):  # alternate, so both see the same background load
        pt = await passthrough(settings, n_msg, i)
        j, counts = await joiner_round(settings, var, i)
        assert counts["impressions"] == n_imp, counts
        changelog.append(counts["changelog_bytes"] / n_imp)
        examples = counts.get("positives", 0) + counts.get("negatives", 0)
        pts.append(pt)
        joins.append(j)
        print(f"  round {i}: joiner {j['steady_s']:5.2f} s = {n_imp / j['steady_s']:7.0f} imp/s "
              f"({n_msg / j['steady_s']:6.0f} msg/s, {examples} examples; incl. start-up {j['total_s']:.2f} s)  "
              f"passthrough {pt['steady_s']:5.2f} s = {n_imp / pt['steady_s']:7.0f} imp/s "
              f"({n_msg / pt['steady_s']:6.0f} msg/s; incl. start-up {pt['total_s']:.2f} s)  "
              f"ratio {pt['steady_s'] / j['steady_s']:.3f}")
    # Same-round ratios (both sides under the same background load), median over the rounds.
    ratios = sorted(pt["steady_s"] / j["steady_s"] for pt, j in zip(pts, joins))
    j_s = statistics.median(j["steady_s"] for j in joins)
    pt_s = statistics.median(pt["steady_s"] for pt in pts)
    return {"joined_per_s": round(n_imp / j_s), "passthrough_per_s": round(n_imp / pt_s),
            "passthrough_msg_per_s": round(n_msg / pt_s), "joiner_msg_per_s": round(n_msg / j_s),
            "ratio_vs_passthrough": round(statistics.median(ratios), 3),
            "ratio_per_round": [round(r, 3) for r in ratios],
            "ratio_incl_startup": round(statistics.median(pt["total_s"] / j["total_s"] for pt, j in zip(pts, joins)), 3),
            "impressions": n_imp, "messages": n_msg, "examples": examples, "rounds": rounds,
            "changelog_bytes_per_impression": round(statistics.median(changelog), 1),
            "changelog_bytes_per_round": [round(c, 1) for c in changelog]}


async def takeover_bench(bootstrap: str, var: Path, n_waiting: int) -> dict:
    """``takeover_s``: a worker holding one partition with ``n_waiting`` waiting impressions is
    killed (-9); a fresh worker (empty disk) is started and one action for a waiting impression
    produced: the seconds from that start to the first example on ``examples``. That includes
    the process start, the group join (which waits out the dead member's session timeout), the
    rebuild from the changelog and the join. ``takeover_rebuild_s`` / ``_records`` / ``_records_per_s``:
    the rebuild alone, as the fresh worker logs it (:mod:`joiner.faust_restore`)."""
    names = {f"DRIFTLINE_TOPICS__{k.upper()}": f"tk-{k}" for k in ("features", "actions", "examples", "dead_letters")}
    env = {**os.environ, **names, "KAFKA_BOOTSTRAP_SERVERS": bootstrap, "DRIFTLINE_VAR_DIR": str(var),
           "DRIFTLINE_TOPICS__PARTITIONS": "1", "DRIFTLINE_JOINER__GROUP_ID": "bench-takeover",
           "DRIFTLINE_JOINER__WINDOW_SECONDS": "3600", "DRIFTLINE_LOG_LEVEL": "WARNING", "PYTHONPATH": str(ROOT)}
    settings = Settings(var_dir=var, kafka_bootstrap_servers=bootstrap)
    settings = settings.updated(topics={"partitions": 1, **{k.split("__")[1].lower(): v for k, v in names.items()}})
    await create_topics(settings)
    t0_ms, per_log = 1_700_000_000_000, 10
    events = []
    for i in range(n_waiting // per_log):
        fl = FeatureLog(request_id=f"tk{i}", event_time_ms=t0_ms + i, user_id=i % 5000)
        for j in range(per_log):
            fl.candidates.add(item_id=j + 1, features=Features(dense={"x": float(j)}))
        events.append(("features", fl.request_id.encode(), fl.SerializeToString()))
    await produce(settings, events)
    var.mkdir(parents=True, exist_ok=True)
    log = open(var / "takeover.log", "ab")

    def worker(name: str, level: str = "WARNING") -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "joiner", "--store", f"rocksdb://{var / name}"],
                                cwd=ROOT, env={**env, "DRIFTLINE_LOG_LEVEL": level}, stdout=log, stderr=subprocess.STDOUT)

    tps = [TopicPartition(settings.topics.features, 0)]
    end = (await tansu_quirks.log_end_offsets(settings, tps))[tps[0]]
    a = worker("takeover-a")
    while (await tansu_quirks.committed_offsets(settings, "bench-takeover", tps))[tps[0]] < end:
        assert a.poll() is None, "worker a exited"
        await asyncio.sleep(0.5)
    a.kill()
    a.wait()
    started = time.perf_counter()
    b = worker("takeover-b", "INFO")  # (its rebuild's line: joiner.faust_restore)
    action = Action(request_id="tk0", item_id=1, action_type="click", event_time_ms=t0_ms + 1000)
    await produce(settings, [("actions", b"tk0", action.SerializeToString())])
    out = [TopicPartition(settings.topics.examples, p) for p in range(settings.topics.partitions)]
    try:
        while sum((await tansu_quirks.log_end_offsets(settings, out)).values()) == 0:
            assert b.poll() is None and time.perf_counter() - started < 300, "worker b exited or never emitted"
            await asyncio.sleep(0.1)
        took = time.perf_counter() - started
    finally:
        b.terminate()
        b.wait(timeout=30)
    log.close()
    rebuilt = re.findall(r"rebuilt partitions from (\d+) changelog records in ([\d.]+) s", (var / "takeover.log").read_text())
    records, rebuild_s = (int(rebuilt[-1][0]), float(rebuilt[-1][1])) if rebuilt else (0, None)
    print(f"takeover: a fresh worker took over a partition with {n_waiting:,} waiting impressions "
          f"and emitted its first example in {took:.1f} s (its rebuild: {records:,} changelog records in {rebuild_s} s)")
    return {"takeover_s": round(took, 1), "takeover_waiting": n_waiting, "takeover_rebuild_s": rebuild_s,
            "takeover_rebuild_records": records,
            "takeover_rebuild_records_per_s": round(records / rebuild_s) if rebuild_s else None}


def memory_and_spill_bench(var: Path, target: int, cache_size: int) -> dict:
    """Grow the waiting state to ``target`` impressions (no actions: nothing closes)."""
    store = RocksDBStore(f"rocksdb://{var / 'spill'}")
    state = TieredState(store, cache_size)
    core = JoinCore(state, JoinConfig.from_settings(Settings().joiner))
    core.load(0)
    rss: dict[int, float] = {}
    checkpoints = [cp for cp in (10_000, 100_000, 1_000_000) if cp <= target]
    per_request = 10
    base_t = 1_700_000_000_000
    n = 0
    req = 0
    started = time.perf_counter()
    while n < target:
        for _ in range(200):  # one batch of 200 requests x 10 candidates
            fl = FeatureLog(request_id=f"m{req}", event_time_ms=base_t + req, user_id=req % 6040,
                            context=Features(sparse={"user": SparseSlot(ids=[req % 6040])}))
            for j in range(per_request):
                fl.candidates.append(Candidate(item_id=j, features=Features(
                    sparse={"item": SparseSlot(ids=[j])}, dense={"pop": 0.5})))
            core.on_features(0, fl)
            req += 1
            n += per_request
        core.advance(0)
        state.commit()
        state.evict()
        for cp in checkpoints:
            if n >= cp and cp not in rss:
                rss[cp] = rss_mb()
                print(f"  waiting {cp:>9,}  cache {len(state.cache):>7,}  rss {rss[cp]:7.1f} MB")
    fill_s = time.perf_counter() - started
    # Lookups on the disk tier: random waiting impressions, cache emptied.
    state.cache.clear()
    keys = [f"I m{random.randrange(req)}/{random.randrange(per_request)}".replace(" ", "").encode() for _ in range(200_000)]
    t0 = time.perf_counter()
    for k in keys:
        assert state.get(k) is not None
    single = len(keys) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for i in range(0, len(keys), 1000):
        store.get_many(keys[i:i + 1000])
    batched = len(keys) / (time.perf_counter() - t0)
    store.close()
    print(f"spill: filled {n:,} waiting impressions in {fill_s:.1f} s ({n / fill_s:,.0f}/s); "
          f"disk lookups {single:,.0f}/s one by one, {batched:,.0f}/s batched")
    return {"spill_lookups_per_s": round(single), "spill_lookups_batched_per_s": round(batched),
            **{f"rss_mb_at_{name}_waiting": round(rss[cp], 1) if cp in rss else None  # (QUICK stops short of 1M)
               for name, cp in (("10k", 10_000), ("100k", 100_000), ("1m", 1_000_000))},
            "cache_size": cache_size}


def main() -> None:
    var = Path(tempfile.mkdtemp(prefix="bench-joiner-"))
    port = free_port()
    proc = subprocess.Popen(tansu_command("127.0.0.1", port), stdout=open(var / "tansu.log", "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_port("127.0.0.1", port, 20, "broker", proc)
        result = asyncio.run(broker_bench(f"127.0.0.1:{port}", var / "var", 20_000 if QUICK else 100_000,
                                           rounds=3 if QUICK else 5))
        result.update(asyncio.run(takeover_bench(f"127.0.0.1:{port}", var / "takeover", 10_000 if QUICK else 100_000)))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    result.update(memory_and_spill_bench(var, 200_000 if QUICK else 1_000_000, 50_000))
    result["quick"] = QUICK
    shutil.rmtree(var, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
