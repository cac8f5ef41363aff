"""`make chaos-faults`: the faults an operator meets that `make chaos` does not rehearse (issue 30).
(Over 500 lines, one module: nine faults on one running stack, each a function with its own
checks, in the order :func:`run` applies them; the helpers they share come from ``chaos.py``.)

It runs ``driftline up --replay-limit N --speed 0`` (``tests.loopstack``) with its var dir on a
tmpfs of its own (so the disk can be filled; without the right to mount one, that fault is
skipped and its key is null), the liveness bound at 20 s, and then, one after the other while the
replay runs:

1. **wall-clock requests** into the replaying stack: the README's curl examples (``/rank`` and
   ``/actions`` without ``event_time_ms``); ``watermark_moved_by_wall_clock`` counts the joiner's
   features partitions whose watermark then lies within a year of now (the data is from 2000-2003);
2. **a NaN dense delta** (the served model's own head, one value NaN) on ``param-deltas``;
   ``nan_scores_served`` counts non-finite scores of the ``/rank`` answers after it (and
   ``status_page_after_nan_delta``: what the status page lists then);
3. **500 concurrent ``/rank``** for 3 s; ``unmarked_degraded_answers`` counts 200s scored on default
   features (``user_known: false``: every ml-1m user is in the store) without the degraded header;
4. **kill -9 of Redis**; ``features_restored_after_redis_restart``: the restarted one holds the
   loaded features (its key count within 1% of before, a known user present) and ``/rank`` knows
   the users again, without the degraded header;
5. **Redis as a cache**: a memory bound just above what it holds, ``allkeys-lru``, another writer
   filling it until it evicts; ``unmarked_answers_while_evicting`` counts ``/rank`` answers for
   unknown users without the degraded header (every ml-1m user is loaded); then ``noeviction``,
   full: ``clicks_dead_lettered_while_full`` counts the clicks dead-lettered while Redis refuses
   every write (they wait); then the fix (no bound, the load's marker deleted):
   ``redis_cache_fixed_and_reloaded``: the recent-clicks reader waited, and the feature keeper
   loaded the features again (``/rank`` whole);
6. **SIGSTOP of the trainer** past the liveness bound; ``hung_service_restarted``: the supervisor
   killed and restarted it (``hung`` in supervisor.json) and the new one trains;
7. **disk full**: the var dir's tmpfs filled to below the pause threshold for 30 s, then freed;
   ``stack_survived_disk_full``: ``up`` still runs, nothing crash-looped, and afterwards the joiner,
   the dumper and the trainer make progress again by themselves (serving answers ``/rank`` 503
   while its spool's disk is full: ``rank_codes_while_full``, ``disk_paused_while_full``; the
   status page's "what is wrong now" at that moment: ``status_page_while_full``, and the paused
   services it does not name: ``disk_full_paused_but_not_on_status_page``);
8. **damaged stores**: ``CURRENT`` garbled (RocksDB cannot open them) in the joiner's partition
   stores, the dumper's store and serving's feature-log spools, and bytes garbled early in Redis's
   append-only file (inside the features load), then kill -9 of the four; ``stores_rebuilt_after_damage``: each
   restart set its store aside and went on by itself (the joiner's partitions rebuilt from the
   changelog, the dumper's ids from Parquet, the spool repaired, Redis's file cut at the damage
   and the features loaded again by the feature keeper if that lost them: ``/rank`` knows
   users, unmarked), nothing crash-looped, and new traffic reaches Parquet with no example
   written twice;
9. once the replay is done (its event time, hours per wall second, would close a click's window
   before it arrives), **another Kafka client's partitioner**: impressions through ``/rank``, their
   clicks produced straight to ``actions`` on the partition librdkafka's default partitioner
   (``consistent_random``: CRC32 of the key) picks, as confluent-kafka would;
   ``orphaned_by_partitioner`` counts the clicks that never became a positive example in Parquet.

Then Ctrl-C; the last line printed is one JSON object with those keys and the numbers behind them.
``QUICK=1``: a shorter replay (the whole run under 6 minutes).
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from chaos import _kill, _metric, _metric_sum, _parquet_ids, _supervisor_state, _wait, log, run_main

from tests.loopstack import LoopStack

REPO = Path(__file__).resolve().parent.parent
LIVENESS_S = 20
YEAR_MS = 365 * 86_400_000
PAUSE_BELOW = 64 << 20


def _post(stack: LoopStack, path: str, body: dict, timeout: float = 10.0) -> tuple[int, dict, dict]:
    import httpx

    from services.api_keys import client_headers

    # serving's API key when the environment sets one (the stack's services inherit it)
    r = httpx.post(stack.serving_url + path, json=body, timeout=timeout,
                   headers=client_headers(stack.settings().serving))
    try:
        data = r.json()
    except ValueError:
        data = {}
    return r.status_code, dict(r.headers), data


def _status_problems(stack: LoopStack) -> list[str]:
    """What the stack's status page lists as wrong now (``status.problems``), one "target: problem" each."""
    import json

    code, body = stack.get(f"http://127.0.0.1:{stack.status_port}/api/series?since={time.time()}")
    return [f"{p['target']}: {p['problem']}" for p in json.loads(body)["problems"]] if code == 200 else [f"HTTP {code}"]


def _watermarks(stack: LoopStack, stream: str) -> dict[int, int]:
    from prometheus_client.parser import text_string_to_metric_families

    try:
        _, body = stack.get(stack.metrics_urls()["joiner"])
    except OSError:
        return {}
    return {int(s.labels["partition"]): int(s.value) for fam in text_string_to_metric_families(body)
            for s in fam.samples if s.name == "driftline_joiner_watermark_ms" and s.labels.get("stream") == stream}


def wall_clock_requests(stack: LoopStack) -> dict:
    """The README's curl examples, as a user would paste them against the running demo."""
    before = _watermarks(stack, "features")
    for i in range(12):
        _post(stack, "/rank", {"user_id": 1 + i, "candidates": [{"item_id": 10 + i}, {"item_id": 20 + i}],
                               "request_id": f"curl-{i}"})
        _post(stack, "/actions", {"actions": [{"request_id": f"curl-{i}", "item_id": 10 + i, "action_type": "click",
                                               "user_id": 1 + i}]})
    time.sleep(15)  # the joiner reads them
    now_ms = time.time() * 1000
    after = _watermarks(stack, "features")
    moved = sum(1 for wm in after.values() if wm > now_ms - YEAR_MS)
    log(f"wall-clock requests: feature watermarks {before} -> {after}; {moved} within a year of now")
    return {"watermark_moved_by_wall_clock": moved, "feature_watermarks_after": after}


def partitioner_clicks(stack: LoopStack, n: int = 10) -> list[str]:
    """Impressions through /rank, their clicks produced the way confluent-kafka's default
    partitioner places them (CRC32 of the key, librdkafka's consistent_random). Returns the
    example ids the clicks should make positive."""
    from aiokafka import AIOKafkaProducer

    from proto import Action

    settings = stack.settings()
    t = max(_watermarks(stack, "features").values()) + 1_000
    eids, actions = [], []
    for i in range(n):
        rid = f"confluent-{i}-{time.time_ns()}"
        item = 100 + i
        code, _, _ = _post(stack, "/rank", {"user_id": 10 + i, "candidates": [{"item_id": item}, {"item_id": item + 50}],
                                            "request_id": rid, "event_time_ms": t})
        if code != 200:
            log(f"partitioner: /rank answered {code}")
            continue
        eids.append(f"{rid}/{item}")
        actions.append((rid, Action(request_id=rid, item_id=item, action_type="click", event_time_ms=t + 2_000,
                                    user_id=10 + i)))

    async def produce() -> int:
        p = AIOKafkaProducer(bootstrap_servers=settings.bootstrap_servers)
        await p.start()
        moved = 0
        try:
            for rid, a in actions:
                key = rid.encode()
                part = zlib.crc32(key) % settings.topics.partitions  # librdkafka: rd_crc32(key) % n
                moved += part != _murmur2_partition(key, settings.topics.partitions)
                await p.send_and_wait(settings.topics.actions, a.SerializeToString(), key=key, partition=part)
        finally:
            await p.stop()
        return moved

    moved = asyncio.run(produce())
    log(f"partitioner: {len(actions)} clicks produced, {moved} on another partition than murmur2's")
    return eids


def _murmur2_partition(key: bytes, n: int) -> int:
    from aiokafka.partitioner import DefaultPartitioner

    parts = list(range(n))
    return DefaultPartitioner()(key, parts, parts)


def nan_dense_delta(stack: LoopStack) -> dict:
    """The served head with one value NaN, as the next dense version."""
    import numpy as np

    from proto import ParameterDelta
    from services.kafka import producer, start_client
    from trainer.snapshots import load_latest
    from trainer.sync import encode_dense

    settings = stack.settings()
    version = stack.json("/readyz")["model_version"]
    _tables, head, manifest = load_latest(settings.model_snapshots(version["model_id"]))
    msg = encode_dense(version["model_id"], int(version["dense_version"]) + 1, head)
    poisoned = ParameterDelta()
    poisoned.CopyFrom(msg)
    values = np.frombuffer(poisoned.dense.tensors[0].values, "<f4").copy()
    values[0] = np.nan
    poisoned.dense.tensors[0].values = values.tobytes()

    async def publish() -> None:
        p = producer(settings)
        await start_client(p, settings)
        try:
            await p.send_and_wait(settings.topics.param_deltas, poisoned.SerializeToString(),
                                  key=f"{version['model_id']}/dense".encode())
        finally:
            await p.stop()

    def refused() -> float:  # dense chunks serving skipped: as non-finite, or as stale (its number was taken)
        return sum(stack.metric("serving", "driftline_serving_deltas_skipped_total", {"reason": r}) or 0.0
                   for r in ("non_finite", "stale"))

    before = refused()
    asyncio.run(publish())
    time.sleep(5)
    bad = answered = 0
    for i in range(20):
        code, _, body = _post(stack, "/rank", {"user_id": 1 + i, "candidates": [{"item_id": j} for j in range(1, 30)]})
        if code == 200:
            answered += 1
            bad += sum(1 for it in body["items"] if not math.isfinite(it["score"]))
    after = stack.json("/readyz")["model_version"]
    n_refused = refused() - before
    shown = _status_problems(stack)
    log(f"NaN dense delta v{version['dense_version'] + 1}: {bad} non-finite scores in {answered} answers; "
        f"serving at dense v{after['dense_version']}; {n_refused:.0f} chunk(s) refused (non-finite or stale)")
    # kept: serving still at the version it had, or (the trainer may publish its own next dense
    # version in those seconds, with the poisoned one's number) it refused the poisoned chunk
    return {"nan_scores_served": bad, "nan_answers_checked": answered, "nan_delta_refused": n_refused >= 1,
            "dense_version_kept": after["dense_version"] == version["dense_version"] or n_refused >= 1,
            "status_page_after_nan_delta": shown}


def overload(stack: LoopStack) -> dict:
    from bench_overload import level
    from bench_serving import rank_requests

    got = asyncio.run(level("127.0.0.1", stack.serving_port, rank_requests(512, 100, seed=3), 500))
    log(f"500 concurrent /rank: {got}")
    return {"unmarked_degraded_answers": int(got["unmarked_degraded"]), "overload": got}


def redis_restart(stack: LoopStack, killed: set[int]) -> dict:
    import redis

    client = redis.Redis(host="127.0.0.1", port=stack.redis_port, socket_timeout=5)
    before = client.dbsize()
    time.sleep(1.5)  # (the append-only file is fsynced every second)
    _kill(stack, "redis", killed)
    started = time.monotonic()

    def back() -> bool:
        try:
            return client.ping()
        except redis.RedisError:
            return False

    _wait(stack, "redis restarted", back, 60)
    after = client.dbsize()
    known = client.exists("driftline:u:1") == 1
    restored_s = time.monotonic() - started
    answers = [_post(stack, "/rank", {"user_id": 1 + i, "candidates": [{"item_id": 1}, {"item_id": 2}]})
               for i in range(20)]
    ok = [a for a in answers if a[0] == 200]
    unknown = sum(1 for _, h, b in ok if not b.get("user_known") or "x-driftline-degraded" in {k.lower() for k in h})
    log(f"redis kill -9: {before} keys before, {after} after ({restored_s:.1f} s), user 1 present: {known}; "
        f"{len(ok)}/20 answered, {unknown} without the user's features")
    restored = bool(after >= 0.99 * before and known and ok and unknown == 0)
    return {"features_restored_after_redis_restart": restored, "redis_keys_before": before,
            "redis_keys_after": after, "redis_answers_without_features": unknown,
            "redis_503s_after_restart": sum(1 for a in answers if a[0] == 503)}


def redis_as_a_cache(stack: LoopStack) -> dict:
    """Redis given a memory bound just above what it holds, as an operator sets up a cache: first
    ``allkeys-lru`` while another writer fills it (it evicts), then ``noeviction`` (full: every
    write refused), then the fix (no bound, the fillers gone, the load's marker deleted so the
    feature keeper loads the features again)."""
    import redis

    from serving.feature_store import LOADED_MARKER, marker_key

    client = redis.Redis(host="127.0.0.1", port=stack.redis_port, socket_timeout=5)
    policy = client.config_get("maxmemory-policy")["maxmemory-policy"]
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + (4 << 20))
    client.config_set("maxmemory-policy", "allkeys-lru")
    evicted, i = int(client.info("stats")["evicted_keys"]), 0
    while int(client.info("stats")["evicted_keys"]) == evicted:  # (another writer fills it up)
        client.set(f"chaos:cache:{i}", "x" * 10_000)
        i += 1

    def marked(answer: tuple[int, dict, dict]) -> bool:
        return any(k.lower() == "x-driftline-degraded" and v.startswith("feature-store-") for k, v in answer[1].items())

    _wait(stack, "answers marked once Redis evicted", lambda: marked(
        _post(stack, "/rank", {"user_id": 1, "candidates": [{"item_id": 1}]})), 30)
    answers = [_post(stack, "/rank", {"user_id": 1 + u, "candidates": [{"item_id": 1}, {"item_id": 2}]})
               for u in range(20)]
    unmarked = sum(1 for a in answers if a[0] == 200 and not a[2].get("user_known") and not marked(a))
    letters = _metric_sum(stack, "serving", "driftline_dead_letters_total")
    refusals = _metric(stack, "serving", "driftline_serving_realtime_store_refusals_total")
    client.config_set("maxmemory-policy", "noeviction")
    while True:  # (full: until Redis refuses a write)
        try:
            client.set(f"chaos:cache:{i}", "x" * 10_000)
            i += 1
        except redis.exceptions.OutOfMemoryError:
            break
    for u in range(10):  # clicks the recent-clicks reader cannot record while Redis is full
        _post(stack, "/actions", {"actions": [{"request_id": f"full-{u}", "item_id": 1, "action_type": "click",
                                               "user_id": 1 + u}]})
    waited = _wait(stack, "the recent-clicks reader waits for Redis", lambda: _metric(
        stack, "serving", "driftline_serving_realtime_store_refusals_total") > refusals, 60)
    lettered = _metric_sum(stack, "serving", "driftline_dead_letters_total") - letters
    client.config_set("maxmemory", 0)  # the fix: no bound, the cache's keys gone, the features loaded again
    client.config_set("maxmemory-policy", policy)
    for keys in iter(lambda: client.keys("chaos:cache:*")[:10_000], []):
        client.delete(*keys)
    client.delete(marker_key(stack.settings().serving.redis_prefix, LOADED_MARKER))

    def whole() -> bool:
        code, headers, body = _post(stack, "/rank", {"user_id": 7, "candidates": [{"item_id": 1}]})
        return code == 200 and bool(body.get("user_known")) and "x-driftline-degraded" not in {k.lower() for k in headers}

    back = _wait(stack, "the features loaded again after the fix", whole, 120)
    log(f"redis as a cache: {i} filler keys; {sum(marked(a) for a in answers)}/20 answers marked while it "
        f"evicted, {unmarked} unknown users unmarked; full: the clicks' reader waited {waited}, {lettered:.0f} "
        f"dead letters; features whole after the fix {back}")
    return {"unmarked_answers_while_evicting": unmarked, "clicks_dead_lettered_while_full": int(lettered),
            "redis_cache_fixed_and_reloaded": bool(waited and back),
            "answers_marked_while_evicting": sum(marked(a) for a in answers)}


def hung_trainer(stack: LoopStack) -> dict:
    pid = _supervisor_state(stack).get("trainer", {}).get("pid")
    trained = _metric_sum(stack, "trainer", "driftline_trainer_examples_total")
    os.killpg(pid, signal.SIGSTOP)
    log(f"SIGSTOP trainer (pid {pid}), liveness bound {LIVENESS_S} s")
    restarted = _wait(stack, "the hung trainer restarted", lambda: (
        _supervisor_state(stack).get("trainer", {}).get("hung", 0) >= 1
        and _supervisor_state(stack).get("trainer", {}).get("pid") not in (None, pid)), LIVENESS_S + 60)
    trains = _wait(stack, "the new trainer trains", lambda: _metric_sum(
        stack, "trainer", "driftline_trainer_examples_total") > 0 and _supervisor_state(stack)["trainer"]["pid"] != pid, 120)
    with_stopped_gone = not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    log(f"hung trainer: restarted {restarted}, new one trains {trains} (examples before {trained:.0f})")
    return {"hung_service_restarted": bool(restarted and trains and with_stopped_gone)}


def damaged_stores(stack: LoopStack, killed: set[int]) -> dict:
    from joiner.faust_app import state_dir
    from joiner.faust_store import partition_stores

    settings = stack.settings()
    stores = {"joiner": list(partition_stores(state_dir(settings) / "v1" / "tables", "state").values()),
              "dumper": [stack.var_dir / "examples" / "_state"],
              "serving": [p for p in (stack.var_dir / "serving").glob("spool-*") if ".damaged-" not in p.name]}
    before_state = _supervisor_state(stack)
    produced = _metric(stack, "joiner", "driftline_joiner_examples_produced_total")
    for paths in stores.values():
        for path in paths:
            (path / "CURRENT").write_text("garbage\n")  # (read at the next open only)
    aof = stack.var_dir / "redis" / "appendonly.aof"
    raw = bytearray(aof.read_bytes())
    # An argument's length header early in the file (inside the features load's first MSET, which
    # comes first: the cut loses the load's marker); Redis would refuse to start on it. (Bytes
    # inside a value it would load unnoticed: the file has no checksums.)
    at = raw.index(b"\r\n$", len(raw) // 100) + 2
    raw[at:at + 16] = b"#" * 16
    aof.write_bytes(bytes(raw))
    for name in [*stores, "redis"]:
        _kill(stack, name, killed)
    log(f"damaged stores: CURRENT garbled in {sum(map(len, stores.values()))} stores, Redis's append-only file "
        f"at byte {at} of {len(raw)}; their services killed")
    joiner_back = _wait(stack, "the joiner rebuilt its partitions", lambda: _metric(
        stack, "joiner", "driftline_joiner_stores_set_aside_total") >= len(stores["joiner"]), 180)
    serving_back = _wait(stack, "serving repaired its spool", lambda: _metric(
        stack, "serving", "driftline_serving_feature_log_spool_recoveries_total") >= 1, 120)

    def features_back() -> bool:  # (Redis started, its features whole or loaded again)
        import httpx

        try:
            code, headers, body = _post(stack, "/rank", {"user_id": 7, "candidates": [{"item_id": 1}]})
        except httpx.HTTPError:
            return False  # (serving restarting)
        return code == 200 and bool(body.get("user_known")) and "x-driftline-degraded" not in {
            k.lower() for k in headers}

    features = _wait(stack, "Redis back with its features", features_back, 180)
    for i in range(30):  # new traffic through the restarted services
        _post(stack, "/rank", {"user_id": 1 + i, "candidates": [{"item_id": 60 + i}], "request_id": f"after-damage-{i}"})
        _post(stack, "/actions", {"actions": [{"request_id": f"after-damage-{i}", "item_id": 60 + i,
                                               "action_type": "click", "user_id": 1 + i}]})
    flows = _wait(stack, "examples after the damage reach Parquet", lambda: any(
        e.startswith("after-damage-") for e in _parquet_ids(stack)), 180)
    ids = _parquet_ids(stack)
    twice = sum(1 for rows in ids.values() if len(rows) > 1)
    set_aside = {name: sorted(p.name for path in paths for p in path.parent.glob(f"{path.name}.damaged-*"))
                 for name, paths in stores.items()}
    after_state = _supervisor_state(stack)
    crash_loops = sum(v.get("crash_loops", 0) for v in after_state.values()) - sum(
        v.get("crash_loops", 0) for v in before_state.values())
    redis_aside = sorted(p.name for p in aof.parent.glob("appendonly.aof.damaged-*"))
    ok = bool(joiner_back and serving_back and features and flows and all(set_aside.values()) and redis_aside
              and twice == 0 and crash_loops == 0)
    log(f"damaged stores: set aside {set_aside} and {redis_aside}; joiner back {joiner_back}, serving back "
        f"{serving_back}, Redis's features {features}, new examples in Parquet {flows}, written twice {twice}, "
        f"crash loops {crash_loops}")
    return {"stores_rebuilt_after_damage": ok,
            "damaged_stores_set_aside": {**{k: len(v) for k, v in set_aside.items()}, "redis": len(redis_aside)},
            "redis_features_after_aof_damage": features,
            # (whether the cut lost the load's marker, so the feature keeper loaded them again)
            "redis_features_reloaded": _metric(stack, "feature-keeper", "driftline_serving_feature_loads_total",
                                               {"reason": "lost"}) >= 1,
            "parquet_examples_written_twice": twice, "joiner_produced_before_damage": produced,
            "crash_loops_after_damage": crash_loops}


def disk_full(stack: LoopStack, mount: Path | None, hold_s: float) -> dict:
    if mount is None:
        return {"stack_survived_disk_full": None, "disk_full": "skipped: no tmpfs (needs root to mount one)"}
    st = os.statvfs(mount)
    free = st.f_bavail * st.f_frsize
    fill = mount / "fill"
    before_state = _supervisor_state(stack)
    progress = {"joiner": lambda: _metric(stack, "joiner", "driftline_joiner_examples_produced_total"),
                "dumper": lambda: sum(len(v) for v in _parquet_ids(stack).values()),
                "trainer": lambda: _metric_sum(stack, "trainer", "driftline_trainer_examples_total")}
    with open(fill, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, max(0, free - (PAUSE_BELOW // 2)))
    log(f"disk full: {free / 1e6:.0f} MB filled to {os.statvfs(mount).f_bavail * st.f_frsize / 1e6:.0f} MB free")
    time.sleep(hold_s)
    from joiner.dumper import SERVICE as DUMPER

    label = {"joiner": "joiner", "dumper": DUMPER, "trainer": "trainer", "serving": "serving"}
    paused = {s: _metric(stack, s, "driftline_disk_paused", {"service": label[s]}) for s in label}
    codes = [_post(stack, "/rank", {"user_id": 5, "candidates": [{"item_id": 1}]})[0] for _ in range(5)]
    shown = _status_problems(stack)
    alive_while_full = stack.proc.poll() is None
    at_freeing = {name: f() for name, f in progress.items()}
    fill.unlink()
    freed_at = time.monotonic()
    log(f"disk freed; paused gauges while full {paused}, /rank codes {codes}, up alive {alive_while_full}")
    # New input for the services to show they resumed: on a fast machine the replay is over by
    # now (45,000 impressions took 53 s), and a joiner with nothing left to join produces nothing.
    # Without event_time_ms serving stamps the stream's own event time, so these join as usual.
    for i in range(50):
        _post(stack, "/rank", {"user_id": 1 + i, "candidates": [{"item_id": 30 + i}], "request_id": f"after-disk-{i}"})
        _post(stack, "/actions", {"actions": [{"request_id": f"after-disk-{i}", "item_id": 30 + i,
                                               "action_type": "click", "user_id": 1 + i}]})
    resumed = {name: _wait(stack, f"{name} progresses after the disk was freed",
                           lambda f=f, v=at_freeing[name]: f() > v, 150) for name, f in progress.items()}
    after_state = _supervisor_state(stack)
    crash_loops = sum(v.get("crash_loops", 0) for v in after_state.values()) - sum(
        v.get("crash_loops", 0) for v in before_state.values())
    restarts = {k: v.get("restarts", 0) - before_state.get(k, {}).get("restarts", 0) for k, v in after_state.items()}
    survived = alive_while_full and stack.proc.poll() is None and all(resumed.values()) and crash_loops == 0
    log(f"disk full: resumed {resumed} within {time.monotonic() - freed_at:.0f} s; restarts {restarts}")
    named = [s for s in label if paused[s] and not any(p.startswith(f"{s}: the disk under ") for p in shown)]
    return {"stack_survived_disk_full": survived, "disk_paused_while_full": paused, "rank_codes_while_full": codes,
            "disk_full_paused_but_not_on_status_page": named, "status_page_while_full": shown,
            "resumed_after_freeing": resumed, "restarts_during_disk_full": restarts,
            "crash_loops_during_disk_full": crash_loops}


def _mount_tmpfs(path: Path, size_mb: int) -> Path | None:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return None
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        log(f"no tmpfs ({r.stderr.strip()}): the disk-full fault is skipped")
        return None
    return path


def run(work: Path, quick: bool) -> dict:
    started = time.monotonic()
    limit = int(os.environ.get("CHAOS_LIMIT", 45_000 if quick else 150_000))
    mount = _mount_tmpfs(work / "var", 3072)
    stack = LoopStack.start(work, REPO, "--replay-limit", str(limit), "--speed", "0", env={
        "DRIFTLINE_EMBEDDED__LIVENESS_TIMEOUT_S": str(LIVENESS_S),
        "DRIFTLINE_DUMPER__FLUSH_INTERVAL_S": "5",
        "DRIFTLINE_SERVING__SPOOL_RETENTION_S": "120",
        "DRIFTLINE_DISK__PAUSE_BELOW_BYTES": str(PAUSE_BELOW),
    })
    result: dict = {}
    killed: set[int] = set()
    try:
        _wait(stack, "examples flowing", lambda: _metric(stack, "joiner", "driftline_joiner_examples_produced_total") > 500, 240)
        result.update(wall_clock_requests(stack))
        result.update(nan_dense_delta(stack))
        result.update(overload(stack))
        result.update(redis_restart(stack, killed))
        result.update(redis_as_a_cache(stack))
        result.update(hung_trainer(stack))
        result.update(disk_full(stack, mount, 10.0 if quick else 30.0))
        result.update(damaged_stores(stack, killed))
        # Last, once the replay is done: its event time runs hours per wall second (a click a second
        # after its impression would find the window long closed); frozen, it leaves the join alone.
        _wait(stack, "the replay done", lambda: '"requests"' in (stack.log_dir / "replay.log").read_text(), 600)
        eids = partitioner_clicks(stack)
        _wait(stack, "the clicks of the partitioner test in Parquet", lambda: all(
            e in _parquet_ids(stack) for e in eids), 90)
        ids = _parquet_ids(stack)
        positives = sum(1 for e in eids if e in ids and any(any(lab[1:]) for lab in ids[e]))
        result["orphaned_by_partitioner"] = len(eids) - positives
        result["partitioner_clicks"] = len(eids)
        result["rerouted_by_joiner"] = _metric(stack, "joiner", "driftline_joiner_rerouted_total")
    finally:
        code = stack.stop()
        if mount is not None:
            subprocess.run(["umount", "-l", str(mount)], check=False)
    result.update(stop_exit_code=code, seconds=round(time.monotonic() - started, 1), quick=quick)
    keys = ("stack_survived_disk_full", "features_restored_after_redis_restart", "unmarked_degraded_answers",
            "nan_scores_served", "orphaned_by_partitioner", "watermark_moved_by_wall_clock", "hung_service_restarted",
            "stores_rebuilt_after_damage", "unmarked_answers_while_evicting", "clicks_dead_lettered_while_full",
            "redis_cache_fixed_and_reloaded")
    return {k: result.get(k) for k in keys} | {k: v for k, v in result.items() if k not in keys}


def main() -> int:
    return run_main(run, "driftline-chaos-faults-")


if __name__ == "__main__":
    raise SystemExit(main())
