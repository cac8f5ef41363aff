"""``driftline eval tune|collisions|online|staleness|baselines|coldstart|all [--smoke] [--out docs]``, and
``driftline eval data`` (your own project's examples against naive baselines: :mod:`evaluation.own_data`).

``tune`` picks the collisions model and the baselines' learning rates on validation data (never
the test split; see :mod:`evaluation.tune`); its section is ``tuning``.

Each experiment writes its section of ``<out>/results.json`` (other sections are kept), then
``<out>/results.md`` and the plots are regenerated from the JSON.

>>> build_parser().parse_args(["online", "--smoke"]).experiment
'online'
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from services.cli_args import at_least, run_main
from services.settings import get_settings

from .common import EvalSettings, full, set_threads, smoke

EXPERIMENTS = ("tune", "collisions", "online", "staleness", "baselines", "coldstart")
SECTION = {"tune": "tuning"}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="driftline eval",
                                 description="Reproduce the Monolith paper's experiments on ml-1m (see docs/results.md).")
    ap.add_argument("experiment", choices=[*EXPERIMENTS, "all", "report", "data"],
                    help="an experiment, all of them, `report`: re-render results.md and plots from results.json, "
                         "or `data`: your project's dumped examples against naive baselines (`data --help`)")
    ap.add_argument("--smoke", action="store_true", help="tiny settings (seconds; what the tests run)")
    ap.add_argument("--out", default="docs", help="where results.json, results.md and the plots go (default docs)")
    ap.add_argument("--seeds", type=at_least(0), nargs="+", default=None, help="override the seeds")
    ap.add_argument("--workers", type=at_least(1), default=None, help="processes (default 2, 1 with --smoke)")
    ap.add_argument("--data-dir", default=None, help="MovieLens cache (as DRIFTLINE_DATA_DIR; default <var>/data)")
    ap.add_argument("--work-dir", default="var/eval", help="scratch space for snapshots (removed after)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    return ap


def settings_from(args) -> EvalSettings:
    if args.data_dir:  # the one setting of the cache (settings.data_dir), for this process
        os.environ["DRIFTLINE_DATA_DIR"] = str(args.data_dir)
        get_settings.cache_clear()
    s = smoke() if args.smoke else full()
    if args.seeds:
        s = s.model_copy(update=dict(seeds=tuple(args.seeds), coll_seeds=None))
    if args.workers is not None:
        s = s.model_copy(update=dict(workers=args.workers))
    return s


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=5).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def run(experiments: list[str], s: EvalSettings, out: Path, work_root: Path, plots: bool = True,
        command: str = "all") -> dict:
    """Run ``experiments`` with settings ``s``; write ``out/results.*``; returns the merged JSON."""
    import torch

    from . import baselines, coldstart, collisions, online, report, tune

    set_threads(1 if s.workers > 1 else 2)
    work_root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="eval-", dir=work_root))
    results: dict = {}
    seconds: dict = {}
    try:
        for e in experiments:
            t0 = time.perf_counter()
            if e == "tune":
                results[SECTION[e]] = tune.run(s)
            elif e == "collisions":
                results[e] = collisions.run(s)
            elif e == "online":
                results[e] = online.run(s, work)
            elif e == "staleness":
                results[e] = online.run_staleness(s, work)
            elif e == "baselines":
                results[e] = baselines.run(s)
            elif e == "coldstart":
                results[e] = coldstart.run(s)
            seconds[e] = time.perf_counter() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)
    prev = report.load(out).get("meta", {})
    cmd = "driftline eval " + command + (" --smoke" if s.name == "smoke" else "")
    stamp = {"command": cmd, "git_commit": _git_commit(), "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
             "settings": s.name, "seeds": list(s.seeds)}
    results["meta"] = {"command": command + (" --smoke" if s.name == "smoke" else ""), "settings": s.model_dump(),
                       "git_commit": stamp["git_commit"], "torch": torch.__version__, "python": platform.python_version(),
                       "cpus": os.cpu_count(), "finished_at": stamp["finished_at"],
                       "seconds": {**prev.get("seconds", {}), **seconds},
                       "sections": {**prev.get("sections", {}), **{e: dict(stamp, seconds=seconds[e]) for e in seconds}}}
    return report.write(out, results, plots=plots)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["data"]:
        from . import own_data

        return own_data.main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.quiet:
        os.environ["DRIFTLINE_EVAL_NO_PROGRESS"] = "1"
    if args.experiment == "report":
        from . import report

        out = Path(args.out)
        if not (out / "results.json").exists():
            print(f"driftline eval: no {out / 'results.json'} to render", file=sys.stderr)
            return 2
        report.write(out, {}, plots=not args.no_plots)
        print(f"wrote {out / 'results.md'}", file=sys.stderr)
        return 0
    s = settings_from(args)
    exps = list(EXPERIMENTS) if args.experiment == "all" else [args.experiment]
    t0 = time.perf_counter()
    r = run(exps, s, Path(args.out), Path(args.work_dir), plots=not args.no_plots, command=args.experiment)
    out = Path(args.out)
    print(f"wrote {out / 'results.md'}, {out / 'results.json'} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    from . import report

    for line in report.summary_lines(r, exps):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main, "python -m evaluation"))
