"""``python -m trainer batch|online``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from driftline.project import named_config
from services import metrics as service_metrics
from services.cli_args import at_least, run_main
from services.settings import get_settings

from . import metrics as M
from .device import DeviceError, resolve_device
from .model import SparseModel
from .sample_rates import SampleRateTracker


def run_batch(args) -> dict:
    """Passes over the examples, less the last ``--test-fraction`` of them (the MovieLens ratings'
    latest, or the dumper's Parquet files' last rows in their hourly order), scored after each
    pass: ``test_auc``, ``test_log_loss`` and the mean score against the click rate."""
    from movielens.features import ITEM_CONTENT

    from .data import MovieLensData, parquet_batches, parquet_files, parquet_rows, rows_of

    if not 0 <= args.test_fraction < 1:
        raise SystemExit(f"trainer batch: --test-fraction {args.test_fraction} is not in [0, 1)")
    cfg = named_config(args.model)
    ts = get_settings().trainer
    model = SparseModel(cfg, device=args.device, cache_rows=ts.cache_rows if args.cache_rows is None else args.cache_rows,
                        cache_admit_after=ts.cache_admit_after, lookahead=ts.lookahead)
    ps_counts = M.PSCounts(cfg.model_id, model.tables, model)
    files = parquet_files(Path(args.examples_dir))
    # the items' content when the model's encoder reads MovieLens's (what the demo loads into Redis)
    content = cfg.content is not None and cfg.content.slot == ITEM_CONTENT
    data = (None if files and not args.movielens
            else MovieLensData(args.dataset, Path(args.data_dir), limit=args.limit, content=content))
    if data is None:
        rows = parquet_rows(files)
        n_train = rows - int(rows * args.test_fraction)

        def examples(start: int, stop: int | None = None, batch_size: int = args.batch_size):
            return rows_of(parquet_batches(files, batch_size, cfg.all_slots, cfg.label, cfg.dense_features),
                           start, stop)
    results = []
    max_event_time = 0
    # the rates of the last pass (every pass sees the same examples): recorded in the snapshot
    sample_rates = SampleRateTracker(get_settings().trainer.sample_rate_half_life)
    for p in range(args.passes):
        if data is not None:
            train_rows, test_rows = data.split(args.test_fraction)
            batches = data.batches(args.batch_size, train_rows)
            total = -(-train_rows.size // args.batch_size)
        else:
            batches, total = examples(0, n_train), None
        auc, losses, n, t0 = M.StreamingAUC(), [], 0, time.perf_counter()
        sample_rates = SampleRateTracker(sample_rates.half_life)
        mark, mark_n = t0, 0
        steps = model.train_steps(tqdm(batches, total=total, desc=f"pass {p + 1}/{args.passes}", disable=args.quiet))
        for b, (loss, probs) in steps:
            auc.update(probs, b.labels)
            if b.sample_rate is not None:
                sample_rates.update(b.slice_ids, b.slice_names, b.sample_rate, b.labels)
            losses.append(loss)
            n += b.size
            max_event_time = max(max_event_time, b.max_event_time)
            M.EXAMPLES.labels(cfg.model_id, "batch").inc(b.size)
            now = time.perf_counter()
            if now - mark >= 1.0:
                M.EXAMPLES_PER_S.labels(cfg.model_id, "batch").set((n - mark_n) / (now - mark))
                mark, mark_n = now, n
                ps_counts.update()
        dt = time.perf_counter() - t0
        M.EXAMPLES_PER_S.labels(cfg.model_id, "batch").set(n / dt)
        r = {"pass": p + 1, "examples": n, "ex_per_s": n / dt, "train_loss": float(np.mean(losses)),
             "train_auc": auc.value()}
        if data is not None:
            r.update(_scored(model, data.batches(8192, test_rows) if test_rows.size else []))
        else:
            r.update(_scored(model, examples(n_train, batch_size=8192)))
        ps_counts.update()
        for name, t in model.tables.items():
            M.TABLE_SIZE.labels(cfg.model_id, name).set(len(t))
        M.AUC.labels(cfg.model_id, "batch").set(r.get("test_auc", r["train_auc"]))
        M.LOSS.labels(cfg.model_id, "batch").set(r["train_loss"])
        results.append(r)
        print(json.dumps(r), flush=True)
    for stage, seconds in model.timings.items():
        M.STAGE_SECONDS.labels(cfg.model_id, stage).inc(seconds)
    print(json.dumps({"timings_s": dict(model.timings)}), flush=True)
    if args.snapshot:
        write_batch_snapshot(model, max_event_time, sum(r["examples"] for r in results), sample_rates=sample_rates)
    return results[-1] if results else {}


def _scored(model: SparseModel, batches) -> dict:
    """The held-out examples' AUC, log loss, mean score and click rate (none: nothing held out)."""
    auc, loss, n, p_sum, y_sum = M.StreamingAUC(), 0.0, 0, 0.0, 0.0
    for b in batches:
        known = ~np.isnan(b.labels)
        p = np.clip(model.predict(b)[known].astype(np.float64), 1e-7, 1 - 1e-7)
        y = b.labels[known].astype(np.float64)
        auc.update(p, y)
        loss -= float((y * np.log(p) + (1 - y) * np.log1p(-p)).sum())
        n, p_sum, y_sum = n + y.size, p_sum + float(p.sum()), y_sum + float(y.sum())
    if not n:
        return {}
    return {"test_examples": n, "test_auc": auc.value(), "test_log_loss": loss / n,
            "test_mean_score": p_sum / n, "test_click_rate": y_sum / n}


def write_batch_snapshot(model: SparseModel, max_event_time_ms: int, examples: int,
                         root: Path | None = None, *, sample_rates: SampleRateTracker) -> Path:
    """The warm start ``trainer online`` (and serving) resume from: tables with optimizer state,
    dense head and optimizer, no stream state - no topic offsets, no streaming AUC, no dedup window
    (:meth:`trainer.online.OnlineTrainer.restore` starts those fresh) - under the same root the
    online trainer reads (``settings.snapshot_root``). ``sample_rates``: the rates the examples were
    sampled at (``sample_rates`` in the manifest, as the online trainer records them: serving
    corrects with them, and ``trainer online`` continues the tracker from them)."""
    from . import snapshots
    from .manifest import Manifest

    cfg = model.cfg
    model.write_back()
    if root is None:
        root = get_settings().snapshot_root
    return snapshots.save(Path(root) / cfg.model_id, cfg, model.tables,
                          model.dense_state(),
                          Manifest(param_deltas_offset=0, max_event_time_ms=int(max_event_time_ms), source="batch",
                                   batch_examples=int(examples), sample_rates=sample_rates.state()))


def _online_settings(args):
    flags = {"batch_size": args.batch_size, "sync_interval_s": args.sync_interval_s,
             "snapshot_interval_event_s": args.snapshot_interval_event_s, "nproc": args.nproc,
             "device": args.device}
    return get_settings().updated(trainer={k: v for k, v in flags.items() if v is not None})


async def _run_online(args, ranks: bool = False) -> dict:
    settings = _online_settings(args)
    cfg = named_config(args.model)
    if ranks:
        from .dist.rank_trainer import RankTrainer
        tr = RankTrainer(settings, cfg)
    else:
        from .online import OnlineTrainer
        tr = OnlineTrainer(settings, cfg)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, tr.stop_event.set)
    return await tr.run(stop_when_idle_s=args.stop_when_idle_s, max_examples=args.max_examples)


def _without_nproc(argv: list[str]) -> list[str]:
    """The worker's command line: the launcher's, less ``--nproc`` (a worker is one rank).

    >>> _without_nproc(["online", "--nproc", "2", "--batch-size", "64", "--nproc=3"])
    ['--batch-size', '64']
    """
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out[1:] if out and out[0] == "online" else out


def main(argv: list[str] | None = None) -> int:
    settings = get_settings()
    ap = argparse.ArgumentParser(prog="python -m trainer")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("batch", help="train from Parquet example dumps (or MovieLens directly)")
    b.add_argument("--passes", type=at_least(1), default=1)
    b.add_argument("--model", default=settings.trainer.model,
                   help="deepfm | lr | a ModelConfig JSON or project file (default: trainer.model)")
    b.add_argument("--batch-size", type=at_least(1), default=settings.trainer.batch_size)
    b.add_argument("--examples-dir", default=str(settings.var_dir / "examples"))
    b.add_argument("--movielens", action="store_true", help="use MovieLens even if Parquet dumps exist")
    b.add_argument("--dataset", default="ml-1m")
    b.add_argument("--data-dir", default=str(settings.data_dir))
    b.add_argument("--limit", type=at_least(1), default=None)
    b.add_argument("--test-fraction", type=float, default=0.1,
                   help="hold out the last fraction of the examples (in time order) and score the model on them")
    b.add_argument("--snapshot", action="store_true", help="write a snapshot at the end")
    b.add_argument("--unless-learned", action="store_true",
                   help="do nothing when the snapshot folder holds a snapshot the online trainer learned into "
                        "(a warm start that runs on every start: docker compose)")
    b.add_argument("--quiet", action="store_true")
    b.add_argument("--device", default=settings.trainer.device,
                   help="where the dense head trains: cpu, cuda or cuda:N (trainer.device); the PS stays on the host")
    b.add_argument("--cache-rows", type=at_least(0), default=None,
                   help="rows per embedding table cached on the device (trainer.cache_rows; 0: none)")
    o = sub.add_parser("online", help="train from the examples topic")
    o.add_argument("--model", default=None)
    o.add_argument("--batch-size", type=int, default=None)
    o.add_argument("--device", default=None, help="cpu, cuda or cuda:N (trainer.device)")
    o.add_argument("--sync-interval-s", type=float, default=None)
    o.add_argument("--snapshot-interval-event-s", type=float, default=None)
    o.add_argument("--stop-when-idle-s", type=at_least(0, float), default=None)
    o.add_argument("--max-examples", type=at_least(1), default=None)
    o.add_argument("--nproc", type=int, default=None,
                   help="ranks on this machine (default trainer.nproc); > 1 starts them through torch's elastic launcher")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    try:  # a GPU this machine lacks is a usage error, said before anything starts
        device = resolve_device(args.device or settings.trainer.device)
    except DeviceError as err:
        ap.error(str(err))
    if args.cmd == "online" and _online_settings(args).trainer.nproc > 1:
        ts = _online_settings(args).trainer
        from .dist.gba import MODES as GBA_MODES
        if ts.dist_mode in GBA_MODES and (device.type != "cpu" or ts.cache_rows):
            ap.error(f"trainer.dist_mode = {ts.dist_mode!r} trains on the CPU without the cache; "
                     "sync and hybrid run N ranks on GPUs (trainer.device) and with trainer.cache_rows")
        if device.type == "cuda" and device.index is not None:
            ap.error(f"trainer.device = {str(device)!r} would put all {ts.nproc} ranks on one GPU (NCCL refuses "
                     "that): \"cuda\" gives each rank its own, cuda:LOCAL_RANK")
    torch.set_num_threads(2)
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    rank = world = None
    if args.cmd == "online":
        from .dist import launch
        nproc = _online_settings(args).trainer.nproc
        if launch.under_launcher():
            import faulthandler  # a rank stuck in a collective: `kill -USR1` prints every thread's stack
            faulthandler.register(signal.SIGUSR1, all_threads=True)
            if int(os.environ["WORLD_SIZE"]) > 1:
                rank, world = launch.init_rank(settings.trainer)
        elif nproc > 1:  # this process only launches the ranks (each serves its own metrics)
            if settings.metrics_port:  # a rank on a taken port would be restarted by the launcher
                from services.ports import Listen, check_ports_free

                stride = settings.trainer.rank_metrics_port_stride
                check_ports_free([Listen(settings.metrics_host, settings.metrics_port + r * stride,
                                         f"trainer rank {r}'s /metrics", "metrics_port" if r == 0 else
                                         "trainer.rank_metrics_port_stride") for r in range(nproc)])
            from .snapshot_store import check_same_model  # (each rank would fail on it, and be restarted)

            cfg = named_config(args.model or settings.trainer.model)
            check_same_model(settings.model_snapshots(cfg.model_id), cfg)
            launch.launch(nproc, [a for a in _without_nproc(argv)], settings.trainer)
            return 0
    if settings.metrics_port:
        # each rank exports its metrics on its own port (rank 0 on metrics_port): a rank's
        # examples/s, step and communication times are its own
        service_metrics.serve_metrics(settings.metrics_port + (rank or 0) * settings.trainer.rank_metrics_port_stride)
    service_metrics.SERVICE_UP.labels("trainer").set(1)
    if args.cmd == "batch":
        from . import snapshots
        from .manifest import own_snapshots

        root = settings.model_snapshots(named_config(args.model).model_id)
        if args.unless_learned and (learned := snapshots.learned_online(root)) is not None:
            print(json.dumps({"skipped": f"{root} holds the online trainer's model "
                                         f"({learned.examples_applied} examples learned): kept"}), flush=True)
            return 0  # (before the lock: compose runs this on every `up`, its online trainer running)
        with own_snapshots(root) if args.snapshot else contextlib.nullcontext():
            run_batch(args)
    else:
        args.model = args.model or settings.trainer.model
        try:
            result = asyncio.run(_run_online(args, ranks=world is not None))
        finally:
            if world is not None:
                import torch.distributed as dist
                dist.destroy_process_group()
        print(json.dumps(result), flush=True)
        if result.get("regroup"):
            from .dist.rank_trainer import EXIT_REGROUP
            return EXIT_REGROUP
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, "python -m trainer"))
