"""``make bench-<part>`` is a way users run the project: every bench module still imports against
the code it measures, and a bench that takes a second runs whole (the rest take 7-60 s each with
``QUICK=1``: too long for the suite; their code paths are the tested ones they time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# a script that starts a whole stack when imported (no ``__main__`` guard: it is run, never imported)
SCRIPTS = {"demo_status_shot.py"}


def test_every_bench_module_imports_and_its_examples_hold(repo_root: Path) -> None:
    """(bench/ is no installed package, so tests/test_doctests.py's walk does not reach it.)"""
    names = sorted(p.name for p in (repo_root / "bench").glob("*.py") if p.name not in SCRIPTS)
    code = ("import doctest, importlib.util, sys\n"
            "sys.path.insert(0, 'bench')  # (as running a bench puts its folder first)\n"
            "failed = 0\n"
            "for name in sys.argv[1:]:\n"
            "    spec = importlib.util.spec_from_file_location('bench_' + name[:-3], 'bench/' + name)\n"
            "    sys.modules[spec.name] = module = importlib.util.module_from_spec(spec)  # (dataclasses look it up)\n"
            "    spec.loader.exec_module(module)\n"
            "    failed += doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed\n"
            "sys.exit(1 if failed else 0)\n")
    r = subprocess.run([sys.executable, "-c", code, *names], cwd=repo_root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]


def test_the_example_format_bench_prints_its_json_line(repo_root: Path) -> None:
    r = subprocess.run([sys.executable, "bench/bench_example_format.py"], cwd=repo_root, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "QUICK": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["decode_ex_per_s"] > result["baseline_protobuf_decode_ex_per_s"] > 0
    assert set(result["all"]) >= {"protobuf_per_example", "protobuf_packed_batch"}
