"""The online ranks with a straggler: ``trainer online --nproc 2`` on a real (embedded tansu) broker,
``dist_mode`` sync against gba, rank 1 slowed ``SLOW`` (``trainer.debug_slow_rank``, default
``"1:4"``: it sleeps 3x its step after each step). Each run trains a fresh topic of ``N`` MovieLens
examples (records of ``CHUNK``) and stops at half of it (``--max-examples``): with a backlog on
every rank the whole time, the group's rate is its capacity (each rank reads half the partitions,
so a drained stream would end at the straggler's pace in any mode).

``ex_per_s_{mode}``: the examples both ranks applied over the longer rank's ``elapsed_s`` (the
loop, the final syncs and snapshot included; process start-up, RPC, the restore and the wait for the
trainers' claim not);
``fast_share_{mode}``: rank 0's share of them. ``MODES``: the modes (default ``sync,gba``);
``BATCH``: examples per rank and step (default 64). Last line: JSON.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from driftline.embedded import tansu_command, wait_for_port
from services.ports import free_port
from services.settings import Settings
from trainer.config import deepfm_config
from trainer.data import MovieLensData, produce_examples

N = int(os.environ.get("N", "24000"))
CHUNK = int(os.environ.get("CHUNK", "32"))
BATCH = int(os.environ.get("BATCH", "64"))
SLOW = os.environ.get("SLOW", "1:4")
# a mode, or gba@FRESH_WAIT (trainer.gba.fresh_wait; gba alone: the setting's default, 1.5)
MODES = tuple(os.environ.get("MODES", "sync,gba,gba@0").split(","))
DIM = int(os.environ.get("DIM", "16"))                     # bench_distributed's DeepFM: dim 16, MLP 256-128
MLP = [int(x) for x in os.environ.get("MLP", "256,128").split(",")]


def _results(text: str) -> dict[int, dict]:
    out, dec = {}, json.JSONDecoder()
    for line in text.splitlines():
        i = 0
        while line.startswith("{", i) and '"rank"' in line:
            r, i = dec.raw_decode(line, i)
            out[r["rank"]] = r
    return out


def run(name: str, bootstrap: str, examples) -> dict:
    mode, _, fresh = name.partition("@")
    sfx = uuid.uuid4().hex[:8]
    var = Path(tempfile.mkdtemp(prefix=f"gba-online-{mode}-"))
    os.environ["KAFKA_BOOTSTRAP_SERVERS"] = bootstrap
    s = Settings(var_dir=var)
    for t in ("examples", "param_deltas", "dead_letters"):
        setattr(s.topics, t, f"{t}-{sfx}")
    asyncio.run(produce_examples(s, examples, chunk=CHUNK))
    (var / "model.json").write_text(deepfm_config(dim=DIM, mlp=MLP, sequential=False).model_dump_json())
    env = dict(os.environ, DRIFTLINE_VAR_DIR=str(var), DRIFTLINE_TOPICS__EXAMPLES=s.topics.examples,
               DRIFTLINE_TOPICS__PARAM_DELTAS=s.topics.param_deltas, DRIFTLINE_TOPICS__DEAD_LETTERS=s.topics.dead_letters,
               DRIFTLINE_TRAINER__MODEL=str(var / "model.json"), DRIFTLINE_METRICS_PORT="0", DRIFTLINE_TRAINER__NPROC="2",
               DRIFTLINE_TRAINER__DIST_MODE=mode, DRIFTLINE_TRAINER__DEBUG_SLOW_RANK=SLOW,
               DRIFTLINE_TRAINER__BATCH_TIMEOUT_S="0.05")
    if fresh:
        env["DRIFTLINE_TRAINER__GBA__FRESH_WAIT"] = fresh
    argv = [sys.executable, "-m", "trainer", "online", "--sync-interval-s", "1", "--snapshot-interval-event-s", "0",
            "--stop-when-idle-s", "3", "--batch-size", str(BATCH), "--max-examples", str(len(examples) // 2)]
    p = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    res = _results(p.stdout + p.stderr)
    if p.returncode != 0 or sorted(res) != [0, 1]:
        raise SystemExit(f"{mode}: exit {p.returncode}\n{(p.stdout + p.stderr)[-4000:]}")
    applied = [res[r]["examples_applied"] for r in (0, 1)]
    wall = max(res[r]["elapsed_s"] for r in (0, 1))
    rate = sum(applied) / wall
    stages = {r: {k: round(v, 2) for k, v in res[r]["stages"].items()} for r in (0, 1)}
    print(f"{name:6s} slow {SLOW}: {sum(applied)} examples ({applied[0]} + {applied[1]}) in {wall:.1f} s: "
          f"{rate:,.0f} ex/s; stage seconds {json.dumps(stages)}", flush=True)
    if res[0].get("gba"):
        print(f"      gba per rank: {json.dumps({r: res[r]['gba'] for r in (0, 1)})}", flush=True)
    return {"rate": rate, "fast_share": applied[0] / sum(applied), "wall_s": wall}


def main() -> None:
    examples = MovieLensData(limit=N).examples()
    port = free_port()
    proc = subprocess.Popen(tansu_command("127.0.0.1", port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    out: dict = {"n": N, "batch": BATCH, "slow": SLOW}
    try:
        wait_for_port("127.0.0.1", port, 20, "broker", proc)
        for mode in MODES:
            got = run(mode, f"127.0.0.1:{port}", examples)
            out[f"ex_per_s_{mode}"] = round(got["rate"])
            out[f"fast_share_{mode}"] = round(got["fast_share"], 3)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    for name in MODES:
        if name.startswith("gba") and "ex_per_s_sync" in out:
            out[f"{name}_over_sync"] = round(out[f"ex_per_s_{name}"] / out["ex_per_s_sync"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
