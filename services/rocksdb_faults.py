"""RocksDB's errors, named: rocksdict raises a bare ``Exception`` carrying RocksDB's status, which
every store here (the joiner's, the dumper's, the spools) must tell apart from its callers' own
errors. Damage (a block failing its checksum, a garbled ``CURRENT`` or manifest: a disk's doing)
is :class:`StoreDamaged`, never a record's fault; a damaged store is moved aside, kept for a
post-mortem (its newest :data:`KEEP_SET_ASIDE` copies), and rebuilt from where its data also lives.
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

from rocksdict import Options, Rdict

log = logging.getLogger(__name__)

#: the exit code of a service that stopped on a damaged store (its restart sets the store aside)
STORE_DAMAGED_EXIT = 5
#: damaged copies of one store kept for a post-mortem (:func:`set_aside`)
KEEP_SET_ASIDE = 3
_STAMP = re.compile(r"\d+(-\d+)?")


class StoreDamaged(RuntimeError):
    """A durable store's files are damaged (a block failing its checksum, a file cut short: a
    disk's error, not the input's): reads raise it, and a scan raises it rather than end early,
    which would drop the keys after the damage without a word."""

    def __init__(self, path: str, damage: str) -> None:
        super().__init__(f"{path}: {damage}")
        self.path = path


def as_fault(err: Exception, path: str) -> Exception:
    """What a RocksDB error is: rocksdict raises a bare ``Exception`` carrying RocksDB's status,
    so ``Corruption`` (the files are damaged) becomes :class:`StoreDamaged` and ``IO error`` (a
    full or failing disk) ``OSError``: callers that set a poison record aside must not take either
    for the record's fault. Anything else is returned as it is.

    >>> as_fault(Exception("Corruption: block checksum mismatch"), "/s")
    StoreDamaged('/s: Corruption: block checksum mismatch')
    >>> as_fault(Exception("IO error: No space left on device"), "/s")
    OSError('/s: IO error: No space left on device')
    >>> as_fault(KeyError("k"), "/s")
    KeyError('k')
    """
    if type(err) is Exception and err.args and isinstance(err.args[0], str):
        status = err.args[0]
        if status.startswith("Corruption"):
            return StoreDamaged(path, status)
        if status.startswith("IO error"):
            return OSError(f"{path}: {status}")
    return err


def is_damage(err: BaseException | None) -> bool:
    """Whether ``err`` (or what it was raised from) is RocksDB finding its files damaged.

    >>> is_damage(RuntimeError("the Faust app stopped"))
    False
    >>> try:
    ...     raise RuntimeError("the Faust app stopped") from Exception("Corruption: bad block")
    ... except RuntimeError as err:
    ...     is_damage(err)
    True
    """
    for _ in range(10):  # (a cause chain, not a cycle)
        if err is None:
            break
        if isinstance(err, Exception) and isinstance(as_fault(err, ""), StoreDamaged):
            return True
        err = err.__cause__ or err.__context__
    return False


def exit_on_damage(err: Exception, what: str) -> int:
    """A service's ``main`` after ``err`` stopped it: :data:`STORE_DAMAGED_EXIT` when it is damage
    (logged, naming ``what`` the restart rebuilds it from), else ``err`` raised again.

    >>> exit_on_damage(RuntimeError("the Faust app stopped"), "the changelog")
    Traceback (most recent call last):
    ...
    RuntimeError: the Faust app stopped
    >>> exit_on_damage(StoreDamaged("/s", "Corruption: bad block"), "the changelog") == STORE_DAMAGED_EXIT
    True
    """
    if not is_damage(err):
        raise err
    log.error("a store is damaged (%r): exiting; the next start sets it aside and rebuilds it from %s", err, what)
    return STORE_DAMAGED_EXIT


def set_aside_if_damaged(path: Path, *, read_all: bool) -> Path | None:
    """Open the RocksDB at ``path`` (a garbled ``CURRENT`` or manifest fails there) and, with
    ``read_all``, read every item (each block's checksum); if RocksDB finds it damaged, move it
    aside (``<path>.damaged-<unix time>``, kept for a post-mortem) and return where to. None when
    it reads (or is not there).

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp()) / "db"
    >>> Rdict(str(d)).close()
    >>> _ = (d / "CURRENT").write_text("garbage")
    >>> set_aside_if_damaged(d, read_all=False).name.startswith("db.damaged-"), d.exists()
    (True, False)
    """
    if not path.exists():
        return None
    try:
        db = Rdict(str(path), Options(raw_mode=True))
        try:
            if read_all:
                count_items(db)
        finally:
            db.close()
    except Exception as err:  # (rocksdict raises a bare Exception carrying RocksDB's status)
        if not is_damage(err):
            raise
        aside = set_aside(path)
        log.error("the store %s is damaged (%s): moved to %s", path, as_fault(err, str(path)), aside)
        return aside
    return None


def mark_for_check(marker: Path, err: BaseException) -> None:
    """Have the next start read its stores in full (:func:`set_aside_damaged`): which store
    ``err`` came from is not always known (Faust's own reads name no path)."""
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"{err}\n")


def set_aside_damaged(stores: Iterable[Path], marker: Path) -> list[Path]:
    """At start: each of ``stores`` that does not read moved aside (:func:`set_aside_if_damaged`;
    read in full when :func:`mark_for_check` left ``marker``, which is then removed); where they
    went. The caller rebuilds them from where their data also lives.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> Rdict(str(d / "a")).close(); Rdict(str(d / "b")).close()
    >>> _ = (d / "b" / "CURRENT").write_text("garbage")
    >>> mark_for_check(d / "check", StoreDamaged("?", "Corruption: bad block"))
    >>> [p.name.split("-")[0] for p in set_aside_damaged([d / "a", d / "b"], d / "check")], (d / "check").exists()
    (['b.damaged'], False)
    """
    read_all = marker.exists()
    moved = [aside for path in stores if (aside := set_aside_if_damaged(path, read_all=read_all)) is not None]
    marker.unlink(missing_ok=True)
    return moved


def set_aside(path: Path, keep: int = KEEP_SET_ASIDE) -> Path:
    """Move a damaged store (a directory or a file) out of the way, kept for a post-mortem: to
    ``<path>.damaged-<unix time>``, which no reader of ``path`` globs; where it went. Only the
    ``keep`` newest copies of ``path`` are kept (a disk that keeps damaging it would otherwise
    fill up with them, one per restart): older ones are deleted, each logged.

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> for _ in range(4):
    ...     _ = (d / "spool").write_text("x")
    ...     _ = set_aside(d / "spool", keep=2)
    >>> [p.name.rsplit("-", 1)[1] for p in set_aside_copies(d / "spool")]  # (all in the same second)
    ['2', '3']
    """
    stamp = int(time.time())
    taken = [_order(p) for p in set_aside_copies(path)]
    # (a second damage within the second: after the last of that second, both kept)
    n = max((o[1] if len(o) > 1 else 0 for o in taken if o[0] == stamp), default=-1) + 1
    aside = path.with_name(f"{path.name}.damaged-{stamp}" + (f"-{n}" if n else ""))
    path.rename(aside)
    for old in set_aside_copies(path)[:-keep]:
        log.warning("deleting %s: the %d newer copies set aside are kept", old, keep)
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    return aside


def set_aside_copies(path: Path) -> list[Path]:
    """The copies of ``path`` that :func:`set_aside` keeps, oldest first."""
    copies = path.parent.glob(f"{path.name}.damaged-*")
    return sorted((p for p in copies if _STAMP.fullmatch(p.name.rsplit(".damaged-", 1)[1])), key=_order)


def _order(copy: Path) -> tuple[int, ...]:
    """(unix time, n) of ``<path>.damaged-<unix time>[-n]``."""
    return tuple(int(x) for x in copy.name.rsplit(".damaged-", 1)[1].split("-"))


def count_items(db: Rdict) -> int:
    """Read every item of ``db`` once (RocksDB verifies each block's checksum on the way); how
    many, or what :func:`as_fault` makes of the error (rocksdict's own iteration ends at a
    damaged block without a word)."""
    it = db.iter()
    n, fault = 0, None
    try:
        it.seek_to_first()
        while it.valid():
            n += 1
            it.next()
        it.status()
    except Exception as err:  # noqa: BLE001 - rocksdict raises a bare Exception carrying RocksDB's status
        fault = as_fault(err, db.path())
    del it  # (raised from here, the traceback does not keep the database open)
    if fault is not None:
        raise fault
    return n
