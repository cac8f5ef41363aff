"""The committed generated code must match proto/*.proto: regenerate and compare."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def test_generated_python_is_not_stale(repo_root: Path, tmp_path: Path) -> None:
    (tmp_path / "proto").mkdir()
    protos = sorted((repo_root / "proto").glob("*.proto"))
    for p in protos:
        shutil.copy(p, tmp_path / "proto" / p.name)
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--pyi_out=.",
         *[f"proto/{p.name}" for p in protos]],
        cwd=tmp_path, check=True,
    )
    for p in protos:
        for suffix in ("_pb2.py", "_pb2.pyi"):
            name = p.stem + suffix
            fresh = (tmp_path / "proto" / name).read_text()
            committed = (repo_root / "proto" / name).read_text()
            assert committed == fresh, f"proto/{name} is stale: run `make proto`"
