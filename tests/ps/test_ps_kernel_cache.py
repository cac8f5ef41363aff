"""ps._kernel_cache: a kernel's cached overloads stay its own when processes compile together.

numba's cache numbers a kernel's overloads by their place in its index; two processes saving two
overloads of one kernel at once can leave the index naming one overload's key with the other's
code, which numba then runs for that key with no check (numba issue 10128). These tests build that
state both ways: by the race itself (real processes, numba's index write slowed so that their
saves overlap), and directly (an index with two entries swapped)."""

from __future__ import annotations

import errno
import importlib
import multiprocessing as mp
import pickle
import sys
import time
from pathlib import Path

import numba
import numpy as np
import pytest

from ps._kernel_cache import LockedCacheFile, cached

KERNEL = """
import numba
from ps._jit import njit

def weighted(a, s):
    t = 0.0
    for i in range(a.shape[0]):
        for j in range(a.shape[1]):
            t += a[i, j] * (i + 1) * s
    return t

safe = njit(weighted)
"""

M = np.arange(12.0).reshape(3, 4)
C_ORDER, F_ORDER = np.ascontiguousarray(M), np.asfortranarray(M)
WANT = float(np.sum(M * np.arange(1, 4)[:, None] * 2.5))  # 410.0, whichever the layout


def _module(folder: Path, name: str):
    """The kernel's module, written to ``folder`` (on ``sys.path``: numba imports it by name)."""
    if not (folder / f"{name}.py").exists():
        (folder / f"{name}.py").write_text(KERNEL)
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    return importlib.import_module(name)


def _run(folder: str, order: str, slow_s: tuple[float, float], ready, out) -> None:
    """Spawned: call the kernel with one layout, numba's index and code writes slowed by
    ``slow_s``, once every process of ``ready`` (a barrier, or None) is there; put
    ``(order, result, the kernel's overload signatures)``."""
    from numba.core import caching

    save_index, save_data = caching.IndexDataCacheFile._save_index, caching.IndexDataCacheFile._save_data

    def slow_index(self, overloads):
        time.sleep(slow_s[0])
        return save_index(self, overloads)

    def slow_data(self, name, data):
        time.sleep(slow_s[1])
        return save_data(self, name, data)

    caching.IndexDataCacheFile._save_index, caching.IndexDataCacheFile._save_data = slow_index, slow_data
    mod = _module(Path(folder), "kernels_raced")
    if ready is not None:
        ready.wait()
    out.put((order, float(mod.safe(C_ORDER if order == "C" else F_ORDER, 2.5)), [sig[0].layout for sig in mod.safe.signatures]))


def test_two_processes_compiling_two_overloads_at_once_each_cache_its_own(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    out, ready = ctx.Queue(), ctx.Barrier(2)
    procs = []

    def start(*args) -> None:
        procs.append(ctx.Process(target=_run, args=(str(tmp_path), *args, out)))
        procs[-1].start()

    try:
        # both compile at once; the F-order process numbers its overload first and writes its index
        # last, the C-order one writes its code last: unlocked, the index names F's key with C's code
        start("F", (2.0, 0.0), ready)
        start("C", (1.0, 2.0), ready)
        first = sorted(out.get(timeout=120) for _ in range(2))
        later = []  # fresh processes: each layout from the cache
        for order in ("F", "C"):
            start(order, (0.0, 0.0), None)
            later.append(out.get(timeout=120))
    finally:
        for p in procs:
            p.join(timeout=10)
            p.kill()
    assert [r for _, r, _ in first] == [WANT, WANT]
    assert later == [("F", WANT, ["F"]), ("C", WANT, ["C"])], later


def _swap_index(index: Path) -> None:
    """Swap the code files the index names for its two overloads (what the race leaves)."""
    with open(index, "rb") as f:
        version = pickle.load(f)
        stamp, overloads = pickle.loads(f.read())
    (k1, v1), (k2, v2) = overloads.items()
    with open(index, "wb") as f:
        pickle.dump(version, f, protocol=-1)
        f.write(pickle.dumps((stamp, {k1: v2, k2: v1}), protocol=-1))


def test_an_index_naming_another_overloads_code_is_a_miss_not_wrong_numbers(tmp_path: Path) -> None:
    mod = _module(tmp_path, "kernels_swapped")
    first = numba.njit(cache=True)(mod.weighted)
    assert first(C_ORDER, 2.5) == first(F_ORDER, 2.5) == WANT  # both overloads saved
    (index,) = Path(first._cache._cache_path).glob("kernels_swapped.weighted-*.nbi")
    _swap_index(index)

    plain = numba.njit(cache=True)(mod.weighted)  # numba's own cache runs the C code for F
    assert plain(F_ORDER, 2.5) != WANT
    safe = cached(numba.njit(cache=True)(mod.weighted))
    assert safe(F_ORDER, 2.5) == WANT and safe.stats.cache_misses  # compiled afresh, saved over
    again = cached(numba.njit(cache=True)(mod.weighted))
    assert again(F_ORDER, 2.5) == WANT and not again.stats.cache_misses and again.stats.cache_hits


def test_a_kernel_whose_cache_cannot_be_written_runs(tmp_path: Path, monkeypatch, caplog) -> None:
    mod = _module(tmp_path, "kernels_disk_full")

    def full(self, *args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(LockedCacheFile, "_save_data", full)  # (numba writes the code through it)
    kernel = cached(numba.njit(cache=True)(mod.weighted))
    assert kernel(C_ORDER, 2.5) == WANT  # numba's own cache raises OSError here
    assert "compiled but not cached" in caplog.text


def test_a_damaged_code_file_is_compiled_again(tmp_path: Path) -> None:
    mod = _module(tmp_path, "kernels_damaged")
    first = numba.njit(cache=True)(mod.weighted)
    assert first(C_ORDER, 2.5) == WANT
    (code,) = Path(first._cache._cache_path).glob("kernels_damaged.weighted-*.nbc")
    code.write_bytes(code.read_bytes()[:100])  # (a crash mid-write)
    with pytest.raises(Exception):  # noqa: B017 - numba's own cache: whatever unpickling raises
        numba.njit(cache=True)(mod.weighted)(C_ORDER, 2.5)
    assert cached(numba.njit(cache=True)(mod.weighted))(C_ORDER, 2.5) == WANT


def test_the_lock_file_sits_beside_the_index(tmp_path: Path) -> None:
    f = LockedCacheFile(str(tmp_path), "k.f-1.py311", "stamp")
    f.save("key", b"code")
    assert f.load("key") == b"code"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.f-1.py311.1.nbc", "k.f-1.py311.nbi", "k.f-1.py311.nbi.lock"]
    assert sys.platform != "win32"  # (flock: the stack runs on Linux and macOS)


def test_a_lock_file_that_cannot_be_opened_leaves_the_cache_working_unlocked(tmp_path: Path) -> None:
    (tmp_path / "k.f-1.py311.nbi.lock").mkdir()  # (as a full disk or a folder not ours would refuse it)
    f = LockedCacheFile(str(tmp_path), "k.f-1.py311", "stamp")
    f.save("key", b"code")
    assert f.load("key") == b"code"


pytestmark = pytest.mark.filterwarnings("ignore::numba.NumbaWarning")
