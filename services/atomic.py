"""Crash-safe file writes: write beside the target, fsync, rename over it, fsync the directory.

A reader sees the old file or the new one, never a half-written one, and after a crash (even a
power loss) the rename is durable.

>>> import tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> write_bytes_atomic(d / "a.bin", b"hello")
>>> (d / "a.bin").read_bytes(), sorted(p.name for p in d.iterdir())
(b'hello', ['a.bin'])
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_target(path: Path) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces ``path`` durably, else vanishes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    with atomic_target(path) as tmp:
        tmp.write_bytes(data)


def write_parquet_atomic(table: pa.Table, path: Path, **options: object) -> None:
    with atomic_target(path) as tmp:
        pq.write_table(table, tmp, **options)
