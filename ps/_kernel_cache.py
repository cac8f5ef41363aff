"""numba's on-disk kernel cache, made safe to trust: :func:`cached` gives a kernel a cache that
processes compiling together cannot mix up, in a folder whose kernels match today's sources.

Two faults of numba's own cache (``numba.core.caching``), both met here:

* **Processes that compile together.** numba names a kernel's compiled overloads by their place
  in its index (``f-12.py311.1.nbc``, ``.2.nbc``, ...) and saves by reading the index, taking the
  first free number, writing the index, then the code: two processes compiling two overloads of
  one kernel at once (a trainer's ranks, serving's workers, the test suite's processes, all
  started on a fresh install) can both take number 1, and the index can end up naming one
  overload's key with the other's code. numba checks nothing when it loads, so every later
  process runs the wrong machine code for that key: an array of another layout read as
  contiguous, silently wrong numbers (numba issue 10128; measured here, an F-ordered array's
  kernel loaded as the C-ordered one's summed 375 for 410; and a GBA test whose tables differed
  from sync's by up to 0.16 in fresh-clone runs). :class:`LockedCacheFile` holds an ``flock`` on
  the kernel's index around each save (read, number, write) and load, and :class:`SafeCache` only
  uses loaded code whose signature is the one asked for (a cache written without the lock).
* **Code from other files.** numba trusts a cached kernel while its own source file is unchanged,
  but a kernel compiles in the kernels it calls from other files (every PS kernel steps through
  :mod:`ps.optimizers`): after a change there (a ``git pull``) it would go on running the old
  code. So a cache folder is trusted only for the sources it was written from, those of ``ps/``
  and of the kernels' own folder (:func:`drop_stale_kernels`), and emptied otherwise.

Caching is on only when numba can write its cache (beside the sources, or in
``NUMBA_CACHE_DIR``, :data:`CACHE`); a read-only checkout still works, it just compiles each run.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import tempfile
from collections.abc import Iterator
from typing import Any

from numba.core import sigutils
from numba.core.caching import FunctionCache, IndexDataCacheFile

__all__ = ["CACHE", "STAMP", "LockedCacheFile", "SafeCache", "cached", "drop_stale_kernels"]

log = logging.getLogger(__name__)


def _cache_writable() -> bool:
    target = os.environ.get("NUMBA_CACHE_DIR") or os.path.join(os.path.dirname(__file__), "__pycache__")
    try:
        os.makedirs(target, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target):
            return True
    except OSError:
        return False


#: whether kernels are cached on disk (numba can write its cache folder)
CACHE = _cache_writable()
_PS_DIR = os.path.dirname(os.path.abspath(__file__))
#: cache folders this process has checked (:func:`drop_stale_kernels`)
_CHECKED: set[str] = set()
STAMP = "numba-sources.sha256"


@functools.cache
def _folder_digest(folder: str) -> str:
    """A digest of the ``.py`` sources of ``folder`` (read once per process: every kernel folder's
    check includes ``ps/``)."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), "rb") as f:
                h.update(name.encode() + b"\0" + f.read())
    return h.hexdigest()


def drop_stale_kernels(cache_dir: str, source_dir: str) -> bool:
    """Empty numba's cache folder ``cache_dir`` of kernels compiled from other sources than those of
    ``ps/`` and ``source_dir`` now (its stamp file says which); True when it did. Once per folder and
    process. Processes starting together may each empty it: they then compile again, no more.

    >>> d = tempfile.mkdtemp()
    >>> open(os.path.join(d, "k.f-1.py311.nbi"), "w").close()
    >>> drop_stale_kernels(d, _PS_DIR), os.listdir(d) == [STAMP]
    (True, True)
    >>> _CHECKED.discard(d); drop_stale_kernels(d, _PS_DIR)  # the same sources: kept
    False
    """
    if cache_dir in _CHECKED:
        return False
    _CHECKED.add(cache_dir)
    digest = " ".join(_folder_digest(d) for d in dict.fromkeys([_PS_DIR, source_dir]))
    stamp = os.path.join(cache_dir, STAMP)
    try:
        with open(stamp) as old:
            if old.read() == digest:
                return False
    except OSError:
        pass
    try:
        for name in os.listdir(cache_dir):
            if name.endswith((".nbi", ".nbc")):
                with contextlib.suppress(FileNotFoundError):  # (another process emptying it too)
                    os.unlink(os.path.join(cache_dir, name))
        with tempfile.NamedTemporaryFile("w", dir=cache_dir, delete=False) as f:
            f.write(digest)
        os.replace(f.name, stamp)
    except OSError:
        return False  # (numba writes there too: it would fail the same way, and compile each run)
    return True


class LockedCacheFile(IndexDataCacheFile):
    """numba's index and data files of one kernel, each save (read the index, number the overload,
    write the index and the code) under an exclusive ``flock`` of ``<index>.lock`` and each load
    (read the index, then the code it names) under a shared one."""

    @contextlib.contextmanager
    def _locked(self, how: int) -> Iterator[None]:
        try:
            fd: int | None = os.open(self._index_path + ".lock", os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:  # (a full disk, a folder not ours): unlocked, as numba; SafeCache still checks
            fd = None
        try:
            if fd is not None:
                fcntl.flock(fd, how)
            yield
        finally:
            if fd is not None:
                os.close(fd)  # (closing releases the lock)

    def save(self, key: Any, data: Any) -> None:
        with self._locked(fcntl.LOCK_EX):
            super().save(key, data)

    def load(self, key: Any) -> Any:
        with self._locked(fcntl.LOCK_SH):
            return super().load(key)


class SafeCache(FunctionCache):
    """numba's per-kernel cache on :class:`LockedCacheFile`, which returns a loaded overload only
    when its signature is the one asked for and it could be read (else a miss: numba compiles it and
    saves it over), and whose save failing (a full disk) is a warning: the kernel runs compiled in memory (numba
    would raise out of the kernel's first call, which ran nothing)."""

    def __init__(self, py_func: Any):
        super().__init__(py_func)
        f = self._cache_file
        self._cache_file = LockedCacheFile(f._cache_path, f._index_name[:-len(".nbi")], f._source_stamp)

    def _load_overload(self, sig: Any, target_context: Any) -> Any:
        try:
            cres = super()._load_overload(sig, target_context)
        except Exception as err:  # noqa: BLE001 - a damaged file (a crash mid-write): compiled again
            log.warning("numba kernel %s: its cached code could not be read (%r): compiled again", self._name, err)
            return None
        if cres is not None and tuple(cres.signature.args) != tuple(sigutils.normalize_signature(sig)[0]):
            return None
        return cres

    def save_overload(self, sig: Any, data: Any) -> None:
        try:
            super().save_overload(sig, data)
        except OSError as err:
            log.warning("numba kernel %s compiled but not cached (%s): the next process compiles it again", self._name, err)


def cached(kernel: Any) -> Any:
    """``kernel`` (a numba dispatcher made with ``cache=True``) on a :class:`SafeCache`, after its
    cache folder is checked against today's sources (:func:`drop_stale_kernels`). numba reads the
    cache at a kernel's first call, after this."""
    kernel._cache = SafeCache(kernel.py_func)
    drop_stale_kernels(kernel._cache._cache_path, os.path.dirname(os.path.abspath(kernel.py_func.__code__.co_filename)))
    return kernel
