"""The feature-log spool on a real RocksDB: order, the shipped cursor across restarts, retention,
the size bound, and the lock that keeps two processes off one spool."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from services.kafka import create_topics
from services.settings import ServingSettings, Settings
from services.spool import Spool, SpoolDamaged, SpoolFull, SpoolLocked
from serving.broker_epoch import SharedEpoch
from serving.feature_log import FeatureLogger


def spool_at(path: Path, max_bytes: int = 1 << 20, **overrides: object) -> Spool:
    """A spool with serving's spool settings (services/settings.py), some replaced."""
    s = ServingSettings()
    return Spool(path, max_bytes, **{"sync": s.spool_sync, "retention_s": s.spool_retention_s,
                                     "name": "feature-log spool", "knobs": "serving.spool", **overrides})


def _fill(spool: Spool, n: int, start: int = 0, size: int = 100) -> None:
    for i in range(start, start + n):
        spool.append(f"r{i}".encode(), bytes([i % 256]) * size)


def test_restart_keeps_the_unshipped_tail_in_order(tmp_path: Path) -> None:
    spool = spool_at(tmp_path / "s")
    _fill(spool, 10)
    spool.mark_shipped(spool.read(spool.shipped, 4, 1 << 20))
    assert (spool.pending, spool.shipped) == (6, spool.read(0, 10, 1 << 20)[4].position)
    spool.close()

    again = spool_at(tmp_path / "s")
    assert again.pending == 6 and again.bytes == spool.bytes
    tail = again.read(again.shipped, 100, 1 << 20)
    assert [e.key for e in tail] == [f"r{i}".encode() for i in range(4, 10)]
    assert all(e.value == bytes([i]) * 100 for i, e in zip(range(4, 10), tail))
    _fill(again, 1, start=10)  # appends continue after the tail
    assert again.read(tail[-1].end, 10, 1 << 20)[0].key == b"r10"
    again.close()


def test_shipped_entries_are_retained_then_deleted(tmp_path: Path) -> None:
    spool = spool_at(tmp_path / "s", retention_s=60)
    _fill(spool, 5)
    spool.mark_shipped(spool.read(0, 5, 1 << 20))
    spool.trim_expired()
    assert spool.pending == 0 and len(spool.read(0, 100, 1 << 20)) == 5  # kept: a reset may need them
    spool.trim_expired(now=10**9)
    assert spool.read(0, 100, 1 << 20) == [] and spool.bytes == 0
    spool.close()


def test_full_spool_drops_the_oldest_retained_entries_first_then_refuses(tmp_path: Path) -> None:
    entry = 8 + 2 + 100
    spool = spool_at(tmp_path / "s", 5 * entry)
    _fill(spool, 5)
    with pytest.raises(SpoolFull, match="unshipped"):
        _fill(spool, 1, start=5)
    for _ in range(2):  # two shipped batches of one entry each
        spool.mark_shipped(spool.read(spool.shipped, 1, 1 << 20))
    _fill(spool, 1, start=5)  # room made by dropping the oldest shipped entry only
    assert [e.key for e in spool.read(0, 10, 1 << 20)] == [b"r1", b"r2", b"r3", b"r4", b"r5"]
    _fill(spool, 1, start=6)
    assert spool.bytes == 5 * entry and spool.pending == 5 and spool.low == spool.shipped
    with pytest.raises(SpoolFull):
        _fill(spool, 1, start=7)
    spool.close()


def test_a_second_process_cannot_open_the_same_spool(tmp_path: Path) -> None:
    spool = spool_at(tmp_path / "s")
    code = ("import sys; from pathlib import Path; from services.spool import Spool, SpoolLocked\n"
            "from tests.serving.test_spool import spool_at\ntry: spool_at(Path(sys.argv[1]))\n"
            "except SpoolLocked as e: print(e); sys.exit(7)\n")
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "s")], capture_output=True, text=True,
                       cwd=root, timeout=60)
    assert r.returncode == 7, r.stderr
    assert "in use by another process" in r.stdout and str(tmp_path / "s") in r.stdout
    spool.close()
    spool_at(tmp_path / "s").close()  # free again once closed


def test_same_process_second_open_is_refused_too(tmp_path: Path) -> None:
    spool = spool_at(tmp_path / "s")
    with pytest.raises(SpoolLocked):
        spool_at(tmp_path / "s")
    spool.close()


def _flip_a_block(spool_dir: Path) -> None:
    """A bit flipped in the middle of the spool's table file (a disk's error): that block fails
    its checksum."""
    sst = max(spool_dir.glob("*.sst"), key=lambda p: p.stat().st_size)
    b = bytearray(sst.read_bytes())
    b[len(b) // 3] ^= 0xFF
    sst.write_bytes(bytes(b))


def test_a_damaged_spool_goes_on_with_its_readable_unshipped_entries(tmp_path: Path, caplog) -> None:
    """Before: the spool opened and its reads ended at the damaged block without a word (the
    entries after it never shipped, their bytes counted as unshipped for ever). Now the
    damage is found at start: the readable unshipped entries, before and after the damaged block,
    go on in order in a fresh spool, the damaged directory is kept aside, and the loss is logged."""
    import os

    spool = spool_at(tmp_path / "s", sync=True)
    for i in range(100):
        spool.append(f"r{i:03d}".encode(), os.urandom(100))  # (random: RocksDB cannot compress them into one block)
    spool.mark_shipped(spool.read(spool.shipped, 10, 1 << 20))
    spool.close()
    _flip_a_block(tmp_path / "s")
    with caplog.at_level("ERROR", "services.spool"):
        again = spool_at(tmp_path / "s")
    assert "is damaged: Corruption" in caplog.text and "readable unshipped entries" in caplog.text
    kept = [e.key for e in again.read(again.shipped, 1000, 1 << 30)]
    assert again.pending == len(kept) and 10 < len(kept) < 90, kept
    numbers = [int(k[1:]) for k in kept]
    assert numbers == sorted(numbers) and numbers[0] == 10 and numbers[-1] == 99  # the head and the tail
    assert [p.name.split("-")[0] for p in tmp_path.glob("s.damaged-*")] == ["s.damaged"]
    _fill(again, 1, start=100)
    again.close()
    assert spool_at(tmp_path / "s").pending == len(kept) + 1  # a fresh spool, reopened as any


def test_a_read_that_meets_damage_raises_instead_of_ending_early(tmp_path: Path) -> None:
    from services.spool import SpoolDamaged

    spool = spool_at(tmp_path / "s", sync=True)
    _fill(spool, 300, size=100)
    spool._db.flush()  # (into a table file, as a long-running spool's entries are)
    b = max((tmp_path / "s").glob("*.sst"), key=lambda p: p.stat().st_size)
    data = bytearray(b.read_bytes())
    data[len(data) // 3] ^= 0xFF
    b.write_bytes(bytes(data))
    with pytest.raises(SpoolDamaged, match="is damaged"):
        while spool.read(spool.shipped, 1000, 1 << 30):  # (the block cache may have the first blocks)
            spool.mark_shipped(spool.read(spool.shipped, 1000, 1 << 30))
    spool.close()


def test_a_spool_damaged_while_running_goes_on_with_its_readable_unshipped_entries(tmp_path: Path) -> None:
    """The read that meets the damage raises; :meth:`Spool.recover` (what its reader calls then)
    goes on in a fresh spool with the readable unshipped entries, in order, from position 0, and
    takes appends as any."""
    spool = spool_at(tmp_path / "s", sync=True)
    _fill(spool, 300, size=100)
    spool._db.flush()
    _flip_a_block(tmp_path / "s")
    damage, shipped = None, 0
    try:
        while batch := spool.read(spool.shipped, 20, 1 << 30):
            spool.mark_shipped(batch)
            shipped += len(batch)
    except SpoolDamaged as err:
        damage = str(err)
    assert damage is not None and 0 < shipped
    spool.recover(damage)
    kept = [e.key for e in spool.read(spool.shipped, 1000, 1 << 30)]
    numbers = [int(k[1:]) for k in kept]
    assert spool.shipped == 0 and spool.pending == len(kept) and numbers == sorted(numbers) and numbers[-1] == 299
    assert numbers[0] == shipped and len(kept) < 300 - shipped  # (the damaged block's entries are gone)
    assert spool.recoveries == 1
    assert [p.name.split("-")[0] for p in tmp_path.glob("s.damaged-*")] == ["s.damaged"]
    _fill(spool, 1, start=300)
    assert spool.read(spool.shipped, 1000, 1 << 30)[-1].key == b"r300"
    spool.close()


async def test_the_shipper_recovers_a_spool_damaged_while_running(settings: Settings) -> None:
    """Serving's shipper, on the real broker, meets the damage in its spool: it goes on in a
    fresh spool (counted) and ships the readable entries and the ones /rank appends after, with no
    restart."""
    from serving_helpers import read_keys  # (here: a test above imports this module in a subprocess)

    def recoveries() -> float:
        return REGISTRY.get_sample_value("driftline_serving_feature_log_spool_recoveries_total") or 0.0

    await create_topics(settings)
    epochs = SharedEpoch(settings)
    log = FeatureLogger(settings, epochs)
    before = recoveries()
    for i in range(300):  # (not shipped yet: the shipper starts below)
        log.submit(f"r{i}", bytes([i % 256]) * 100)
    log.spool._db.flush()
    _flip_a_block(log.spool.path)
    log.start()
    try:
        deadline = time.monotonic() + 30
        while log.spool.pending or recoveries() == before:
            assert time.monotonic() < deadline, (log.spool.pending, recoveries() - before)
            await asyncio.sleep(0.05)
        log.submit("after", b"x")
        seen = await read_keys(settings, settings.topics.features, {"r0", "r299", "after"})
    finally:
        await log.stop()
        await epochs.stop()
    assert recoveries() - before == 1
    assert {"r0", "r299", "after"} <= seen and 10 < len(seen - {"after"}) < 300


def test_a_spool_that_does_not_open_is_repaired_with_its_entries(tmp_path: Path, caplog) -> None:
    """A garbled ``CURRENT`` (the spool would not open: serving could not start, again on every
    restart): the damaged directory is kept aside and RocksDB's repair of a copy goes on with the
    entries and the shipped cursor."""
    spool = spool_at(tmp_path / "s", sync=True)
    _fill(spool, 50)
    spool.mark_shipped(spool.read(spool.shipped, 10, 1 << 20))
    spool._db.flush()
    _fill(spool, 10, start=50)  # (these only in the log)
    spool.close()
    (tmp_path / "s" / "CURRENT").write_text("garbage\n")
    with caplog.at_level("ERROR", "services.spool"):
        again = spool_at(tmp_path / "s")
    assert "CURRENT file corrupted" in caplog.text and "a repaired copy goes on" in caplog.text
    assert again.pending == 50 and [e.key for e in again.read(again.shipped, 100, 1 << 20)] == \
        [f"r{i}".encode() for i in range(10, 60)]
    assert [p.name.split("-")[0] for p in tmp_path.glob("s.damaged-*")] == ["s.damaged"]
    again.close()


async def test_the_age_of_the_oldest_unshipped_feature_log_is_measured_and_warned_past_the_grace(
        settings: Settings, caplog) -> None:
    """Serving's shipper held back (as a replica cut off from the broker is): the oldest unshipped
    feature log's age grows, past the joiner's orphan grace a warning says its clicks are lost,
    and once the real broker has them the age is 0."""
    def age() -> float:
        return REGISTRY.get_sample_value("driftline_serving_feature_log_unshipped_age_seconds") or 0.0

    await create_topics(settings)
    settings = settings.updated(joiner={"orphan_grace_seconds": 1.0})
    epochs = SharedEpoch(settings)
    log = FeatureLogger(settings, epochs)
    try:
        log.submit("first", b"x")
        assert age() < 0.5
        await asyncio.sleep(1.2)
        log.submit("second", b"y")  # (a submit updates the gauges)
        assert 1.0 <= age() < 3.0 and "past the joiner's orphan grace (1 s)" in caplog.text
        assert REGISTRY.get_sample_value("driftline_serving_feature_log_late") == 1.0  # (the status page's flag)
        log.start()
        deadline = time.monotonic() + 30
        while log.spool.pending:
            assert time.monotonic() < deadline, log.spool.pending
            await asyncio.sleep(0.05)
        log.submit("third", b"z")
        assert age() < 0.5 and REGISTRY.get_sample_value("driftline_serving_feature_log_late") == 0.0
    finally:
        await log.stop()
        await epochs.stop()
