"""One ``/metrics`` for a replica of several processes: the serving PS and its N workers.

With ``driftline serve --workers N`` a scrape of ``/metrics`` reaches one worker, chosen by the
kernel (``SO_REUSEPORT``). Each process's own registry would then show that worker's share of the
requests and none of the PS's delta feed. So the replica runs ``prometheus_client`` in its
multiprocess mode: every process writes its samples to memory-mapped files in one directory
(beside the shared tables), and whichever worker answers the scrape sums them (counters,
histograms) or takes the newest value (the gauges say how: ``multiprocess_mode``). A single
serving process keeps the plain registry.

prometheus_client picks its value store when it is first imported, so :func:`prepare` must run
before anything imports it; the workers inherit the directory through their environment.

>>> directory_for(Path("/dev/shm/driftline-ps-8000")).name
'driftline-ps-8000-metrics'
>>> enabled()
False
>>> exposition()[:6]   # the plain registry of this process
b'# HELP'
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

ENV = "PROMETHEUS_MULTIPROC_DIR"

__all__ = ["ENV", "directory_for", "enabled", "exposition", "prepare", "remove"]


def directory_for(ps_dir: Path) -> Path:
    """Where a replica's processes write their samples: beside its shared tables (``/dev/shm`` when
    there is one), so a sample write costs a memory store."""
    return ps_dir.with_name(f"{ps_dir.name}-metrics")


def prepare(directory: Path) -> None:
    """Start the replica's metrics afresh in ``directory`` (this process and the workers it starts).

    Raises RuntimeError when prometheus_client is already imported here: its samples would go
    to a private registry no scrape sums.
    """
    if "prometheus_client" in sys.modules:
        raise RuntimeError("replica metrics must be prepared before prometheus_client is imported")
    shutil.rmtree(directory, ignore_errors=True)  # a previous run's files would be summed in
    directory.mkdir(parents=True)
    os.environ[ENV] = str(directory)


def enabled() -> bool:
    return bool(os.environ.get(ENV))


def exposition() -> bytes:
    """The text exposition of the whole replica (multiprocess mode), else of this process."""
    from prometheus_client import REGISTRY, generate_latest

    if not enabled():
        return generate_latest(REGISTRY)
    return generate_latest(_Replica())


class _Replica:
    """The replica's samples, summed from every process's files, plus the description of each
    metric no process has a sample of yet (a labelled counter before its first event): the plain
    registry lists those too, and dashboards and users find a metric by its HELP line."""

    def collect(self):  # type: ignore[no-untyped-def]
        from prometheus_client import REGISTRY, Metric
        from prometheus_client.multiprocess import MultiProcessCollector

        families = list(MultiProcessCollector(None).collect())
        sampled = {f.name for f in families}
        for family in REGISTRY.collect():
            if not family.samples and family.name not in sampled:
                families.append(Metric(family.name, family.documentation, family.type, family.unit))
        return families


def remove() -> None:
    """Delete the replica's sample files (the PS, on its way out)."""
    if enabled():
        shutil.rmtree(os.environ[ENV], ignore_errors=True)
