"""What one process must hold alone, a port or a state directory, and what a second one is told.

A state directory has one writer: ``up``'s var dir (its Redis append-only file, the supervisor's
state, every service's logs), a joiner worker's RocksDB, the dumper's Parquet root, the one-process
trainer's snapshots. A second writer damages the first's files (a second ``up`` with other ports on
the same var dir: its trainer restores the first's snapshot, takes it for a broker reset and writes
its own beside it), or crash-loops on RocksDB's lock with a traceback that names neither the holder
nor the fix. :func:`own_dir` takes an exclusive ``flock`` on ``<dir>/.owner`` for the life of
the process, before anything in the directory is touched, and a second process gets
:class:`DirInUse` naming the holder and the setting that gives it a directory of its own. The
kernel drops the lock when its process dies, kill -9 included, so a crash leaves nothing to clean
up. Both refusals exit with :data:`IN_USE_EXIT`, which the supervisor does not restart: a restart
cannot help.

>>> import tempfile
>>> d = Path(tempfile.mkdtemp())
>>> first = own_dir(d, "the joiner worker's state directory", "joiner.store_url")
>>> try:
...     own_dir(d, "the joiner worker's state directory", "joiner.store_url")
... except DirInUse as err:
...     print(str(err).replace(str(d), "D").replace(str(os.getpid()), "PID"))
the joiner worker's state directory D is in use by pid PID (...): stop that process, or give this one its own with joiner.store_url (DRIFTLINE_JOINER__STORE_URL)
>>> first.release()
>>> own_dir(d, "the joiner worker's state directory", "joiner.store_url").release()  # free again
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import sys
import time
from pathlib import Path

__all__ = ["IN_USE_EXIT", "OWNER_FILE", "DirInUse", "InUse", "OwnedDir", "own_dir"]

log = logging.getLogger(__name__)

#: a process's exit status when a port or a directory it must hold alone is taken (sysexits'
#: EX_CONFIG): the supervisor does not restart it, since a restart cannot help (it used to crash-loop)
IN_USE_EXIT = 78

OWNER_FILE = ".owner"  # (a dot file: pyarrow's dataset discovery and the snapshot listing skip it)


class InUse(RuntimeError):
    """Something this process must hold alone is held by another. The message is one line: what,
    who holds it where known, and the setting that moves this process elsewhere."""


class DirInUse(InUse):
    """A state directory is owned by another process (:func:`own_dir`)."""


class OwnedDir:
    """An exclusive lock on a directory, held until :meth:`release` or the process ends."""

    def __init__(self, fd: int | None) -> None:
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # (closing the file drops its flock)

    def __enter__(self) -> OwnedDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def own_dir(directory: Path, what: str, setting: str) -> OwnedDir:
    """Hold ``directory`` (created if missing) for this process alone, or raise :class:`DirInUse`.

    ``what`` names the directory for a person, ``setting`` (dotted, as in the project file) is the
    one that gives a second process a directory of its own. A file system without locks (some
    network mounts refuse ``flock``) is warned about and not held: the check must never be what
    stops a service.
    """
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / OWNER_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            os.close(fd)
            log.warning("%s %s cannot be locked (%s): a second process on it would not be stopped", what,
                        directory, err)
            return OwnedDir(None)
        holder = _holder(fd)
        os.close(fd)
        env = "DRIFTLINE_" + setting.upper().replace(".", "__")
        raise DirInUse(f"{what} {directory} is in use by {holder}: stop that process, or give this one its "
                       f"own with {setting} ({env})") from None
    try:  # who holds it, for a second process's message; a full disk only loses that
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n{time.strftime('%Y-%m-%d %H:%M:%S')}\n{' '.join(sys.argv)}\n".encode())
    except OSError as err:
        log.warning("%s %s: who holds it is not written (%s); it is held all the same", what, directory, err)
    return OwnedDir(fd)


def _holder(fd: int) -> str:
    """Who holds the lock, as its owner wrote it: ``pid N (command, since time)``."""
    try:
        pid, since, command = (os.pread(fd, 4096, 0).decode(errors="replace").split("\n") + ["", "", ""])[:3]
    except OSError:
        pid = ""
    if not pid.strip().isdigit():
        return "another process"
    return f"pid {pid.strip()} ({command.strip() or '?'}, since {since.strip()})"
