"""Profile of one /rank (100 candidates) by stage, in process: ms per stage, median over 1200 requests.

Starts its own redis-server, loads the ml-1m features, builds the replica (:class:`serving.replica.Serving`,
the trainer's DeepFM, no snapshot, no broker: the spool takes the logs) and runs the stages of the
``/rank`` route one after the other, as the route does (keep the two in step). HTTP (uvicorn, h11,
FastAPI routing) is not in it: ``bench/bench_serving.py`` measures the whole request.
``python bench/profile_rank.py``; the last line is JSON.

Measured (100 candidates, the trainer's DeepFM, ml-1m features,
``python bench/profile_rank.py``: in process, median ms per stage, median of 3 runs, 2 shared cores;
HTTP itself — uvicorn's h11, FastAPI routing — comes on top, see ``bench/bench_serving.py``):

================  ======  =====  ==============================================================
stage             before  after  what changed
================  ======  =====  ==============================================================
json parse        0.045   0.040
validate          0.105   0.086
checks            0.029   0.023
redis fetch       1.113   0.994  (already one pipelined MGET + LRANGE; pure-Python RESP parsing)
assemble slots    0.106   0.092
score             1.465   1.134  user's fields looked up and pooled once, ``inference_mode``
correct+sort      0.025   0.017
log encode        0.329   0.167  candidate encodings cached up to the score
spool put         0.090   0.067
response          0.287   0.085  pydantic-core JSON, items from arrays (no per-item models)
total             3.606   2.737
================  ======  =====  ==============================================================

Then ``hiredis`` (redis-py's reply parser in C, pinned): redis fetch 0.943 -> 0.576 ms, total
2.545 -> 2.151 ms (one run each, same session). What is left: the DeepFM head (~0.3 ms; its first layer could take the
user's part once per request).

Second pass (issue #17): the head takes the user's part once (``serving/split_head.py``), pooling's
bag lengths are one array, the fetch is packed by hiredis on one pooled connection, no row copy per
candidate. In process these medians moved little under the load of the day (load average 3-5:
total 2.38/2.27 -> 2.06/2.24 ms, two alternating runs); CPU time per request, which moves less,
is in ``bench/profile_serving.py`` and docs/scale-out.md ("The cost of one /rank").
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import pydantic_core
import torch

from driftline.embedded import redis_command, wait_for_port
from proto import ModelVersion
from services.ports import free_port
from services.settings import Settings
from serving.correction import correct
from serving.feature_files import load_dataset
from serving.feature_log import features_message
from serving.model import warm_up
from serving.replica import Serving
from serving.request_features import slots_for
from serving.schemas import RankRequest

STAGES = ("json parse", "validate", "checks", "redis fetch", "assemble slots", "score", "correct+sort",
          "log encode", "spool put", "response", "total")


async def profile(settings: Settings, bodies: list[bytes], requests: int, warm: int) -> dict[str, list[float]]:
    s = Serving(settings)
    warm_up(s.model)
    times: dict[str, list[float]] = {k: [] for k in STAGES}
    try:
        for it in range(warm + requests):
            t0 = time.perf_counter()
            obj = json.loads(bodies[it % len(bodies)])
            t1 = time.perf_counter()
            body = RankRequest.model_validate(obj)
            t2 = time.perf_counter()
            event_time_ms = s.event_time("event_time_ms", body.event_time_ms, int(time.time() * 1000))
            request_id = body.request_id or uuid.uuid4().hex
            item_ids = [c.item_id for c in body.candidates]
            t3 = time.perf_counter()
            feats = await s.store.fetch(body.user_id, item_ids)
            t4 = time.perf_counter()
            user_slots, item_slots, raws = slots_for(s.model.declared, body.user_id, feats.user,
                                                     feats.recent_items, feats.items, item_ids, feats.items_raw)
            for i, c in enumerate(body.candidates):
                if c.features is not None:
                    item_slots[i] = {**item_slots[i], **c.features.sparse}
            version = s.version()
            t5 = time.perf_counter()
            raw = s.model.score(user_slots, item_slots)
            t6 = time.perf_counter()
            rate, _ = s.model.sample_rates.rate_for(s.model.model_id)
            scores = correct(raw, rate)
            order = np.argsort(-scores, kind="stable")
            t7 = time.perf_counter()
            context = features_message(user_slots, None)
            mv = ModelVersion(model_id=version.model_id, sparse_version=version.sparse_version,
                              dense_version=version.dense_version)
            encoded = s.log_encoder.encode(request_id, event_time_ms, body.user_id, context, mv, item_ids, raws,
                                           item_slots, scores.tolist())
            t8 = time.perf_counter()
            s.feature_log.submit(request_id, encoded)
            t9 = time.perf_counter()
            ranked = zip(np.asarray(item_ids, np.int64)[order].tolist(), scores[order].tolist(),
                         raw[order].tolist())
            pydantic_core.to_json({
                "request_id": request_id, "user_known": feats.user is not None,
                "model_version": version.model_dump(),
                "items": [{"item_id": i, "score": p, "raw_score": r} for i, p, r in ranked]})
            t10 = time.perf_counter()
            if it >= warm:
                for k, a, b in zip(STAGES, (t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, t0),
                                   (t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t10)):
                    times[k].append((b - a) * 1000)
    finally:
        await s.store.close()
        s.feature_log.spool.close()
    return times


def main() -> None:
    torch.set_num_threads(1)  # as python -m serving
    tmp = Path(tempfile.mkdtemp(prefix="profile-rank-"))
    port = free_port()
    redis = subprocess.Popen(redis_command("127.0.0.1", port, tmp), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_port("127.0.0.1", port, 20, "redis", redis)
        url = f"redis://127.0.0.1:{port}/0"
        asyncio.run(load_dataset(url, "ml-1m", ROOT / "var" / "data"))
        rng = np.random.default_rng(0)
        bodies = [json.dumps({"user_id": int(rng.integers(1, 6041)),
                              "candidates": [{"item_id": int(i)} for i in rng.integers(1, 3953, 100)]}).encode()
                  for _ in range(256)]
        times = asyncio.run(profile(Settings(redis_url=url, var_dir=tmp / "var"), bodies, 1200, 300))
    finally:
        redis.terminate()
        redis.wait(10)
    result = {k: round(float(np.median(v)), 3) for k, v in times.items()}
    for k, v in result.items():
        print(f"{k:>16}: {v:.3f} ms")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
