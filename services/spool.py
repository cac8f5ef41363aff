"""A local, durable log of records on their way to Kafka, kept a while after Kafka took them.

Serving's feature-log spool: a FeatureLog is on local disk before /rank answers 200.
/rank appends the encoded FeatureLog to this spool (one RocksDB put, ~10-30 µs) and only then
answers; a background shipper (:class:`serving.feature_log.FeatureLogger`) sends the entries to
topic ``features`` in order and marks them shipped once Kafka acknowledged them. So a 200 means
the feature log survives a ``kill -9`` of serving: the next start (same spool directory) ships
the unacknowledged tail first.

Layout (RocksDB through ``rocksdict``, no file format of our own):

* default column family: key = the entry's *position* (8 bytes, big-endian) + the Kafka key
  (the request id), value = the encoded FeatureLog. A position is the byte offset of the entry
  in the log (the previous entry's position + its size), so positions sort in append order and
  "how many bytes between two positions" needs no bookkeeping;
* column family ``meta``: ``shipped`` (the position below which Kafka acknowledged everything)
  and ``epoch`` (the broker epoch that holds those entries).

Durability: a put goes to RocksDB's write-ahead log in the OS page cache, which survives a kill
of the process but not a crash of the machine (power loss, kernel panic): the last unsynced
writes can be lost then. ``sync=True`` (``serving.spool_sync``) fsyncs every append, which
survives that too at a few milliseconds per request instead of tens of microseconds. Damage to
the files (a block failing its checksum: a disk's error) is found at start, where every entry is
read once, and then the readable unshipped entries go on in a fresh spool and the damaged one is
moved aside (:meth:`Spool.recover`: the entries in the damaged blocks are lost, and logged); a
read that meets damage later raises :class:`SpoolDamaged` rather than end early, and its reader
has the spool recover the same way while running (serving's shipper does: no restart needed).
A spool that does not open at all (a garbled ``CURRENT`` or manifest) is kept aside and a copy
repaired by RocksDB (:meth:`Spool._repair`), which keeps its entries.

Shipped entries are kept ``retention_s`` (the joiner's window) and then deleted with one
``delete_range``: after a broker reset the shipper re-ships them (they may have lived only in the
broker); the joiner drops the duplicate impressions. The spool holds at most ``max_bytes`` (keys +
values, as appended; on disk RocksDB adds its own overhead until compaction): retained entries
are dropped early when it fills, and when *unshipped* entries fill it :meth:`append` raises
:class:`SpoolFull`, so /rank answers 503 instead of a 200 it could not keep.

The joiner keeps the ``examples`` records it produced in one the same way
(:mod:`joiner.output_spool`), to produce them again into a broker whose data was reset.

>>> import tempfile
>>> spool = Spool(Path(tempfile.mkdtemp()) / "spool", max_bytes=100, sync=False, retention_s=0,
...               name="feature-log spool", knobs="serving.spool")
>>> spool.append(b"r1", b"x" * 40), spool.append(b"r2", b"y" * 40)
(0, 50)
>>> spool.append(b"r3", b"z" * 40)
Traceback (most recent call last):
...
services.spool.SpoolFull: feature-log spool full: 100 of 100 bytes unshipped (Kafka slow or down)
>>> [(e.position, e.key) for e in spool.read(0, 10, 1 << 20)]
[(0, b'r1'), (50, b'r2')]
>>> spool.mark_shipped(spool.read(0, 1, 1 << 20)); spool.pending, spool.shipped
(1, 50)
>>> spool.trim_expired(); spool.bytes, spool.append(b"r3", b"z" * 40)
(50, 100)
>>> spool.close()
"""

from __future__ import annotations

import builtins
import logging
import shutil
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from rocksdict import Options, Rdict, RdictIter, WriteOptions

from services.rocksdb_faults import is_damage, set_aside

log = logging.getLogger(__name__)

_POS = 8  # bytes of the position prefix of every key
_META = "meta"


class SpoolError(RuntimeError):
    """The spool cannot take or give entries (closed, or RocksDB failed)."""


class SpoolLocked(SpoolError):
    """Another process has the spool open: two replicas must not share one spool directory."""


class SpoolDamaged(SpoolError):
    """RocksDB found the spool's files damaged (a block's checksum, a file cut short): a read
    raises it rather than end early; at start the spool is set aside and what is readable of its
    unshipped entries goes on in a fresh one (:meth:`Spool.recover`)."""


class SpoolFull(SpoolError):
    """Unshipped entries fill ``max_bytes``: Kafka has been slow or down for a while."""


class SpoolDiskFull(SpoolFull):
    """The disk under the spool is nearly full (``disk.pause_below_bytes``): nothing is appended."""


@dataclass(frozen=True, slots=True)
class Entry:
    position: int
    key: bytes
    value: bytes

    @property
    def end(self) -> int:
        """The next entry's position."""
        return self.position + _POS + len(self.key) + len(self.value)


def _pos(position: int) -> bytes:
    return position.to_bytes(_POS, "big")


def _options() -> Options:
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.create_missing_column_families(True)
    return opts


class Spool:
    """Append-only log of (key, value) entries with a shipped cursor, in one RocksDB."""

    def __init__(self, path: Path, max_bytes: int, *, sync: bool, retention_s: float,
                 name: str, knobs: str) -> None:
        """``max_bytes``, ``sync``, ``retention_s``: the user's settings (``<knobs>_*``);
        ``name`` and ``knobs``, the settings' prefix, are for the messages."""
        self.path, self.name, self.knobs = Path(path), name, knobs
        self.max_bytes = max_bytes
        self.retention_s = retention_s
        self._write = WriteOptions()
        self._write.sync = sync
        self._warned = -1e9
        self._closed = False
        self.recoveries = 0  # (times this process found it damaged and went on: repaired or afresh)
        try:
            self._open()
        except SpoolDamaged as err:
            self._repair(str(err))
        damage = None
        try:
            self._load()
        except SpoolDamaged as err:  # (recovered outside: its traceback holds the database's iterators)
            damage = str(err)
        if damage is not None:
            self.recover(damage)

    def _open(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        try:
            self._db = Rdict(str(self.path), _options(), column_families={_META: _options()})
        except Exception as err:  # noqa: BLE001 - rocksdict raises a bare Exception carrying RocksDB's message
            if "lock" in str(err).lower():
                raise SpoolLocked(
                    f"{self.name} {self.path} is in use by another process (two processes with one "
                    f"{self.knobs}_dir?): {err}") from None
            if is_damage(err):
                raise SpoolDamaged(f"{self.name} {self.path} is damaged: {err}") from None
            raise SpoolError(f"cannot open the {self.name} {self.path}: {err}") from None
        self._meta = self._db.get_column_family(_META)

    def _repair(self, damage: str) -> None:
        """A spool that does not open (a garbled ``CURRENT`` or manifest): the damaged directory
        is kept aside and a copy of it goes through RocksDB's repair, which rebuilds the manifest
        from the table files and the log, so the entries survive; if even that fails, the spool
        starts empty and says what was lost. (Refusing to open would stop /rank on every start.)"""
        aside = set_aside(self.path)
        shutil.copytree(aside, self.path)
        try:
            Rdict.repair(str(self.path), _options())
            self._open()
        except SpoolError as err:
            raise err from None  # (locked by another process meanwhile: not damage)
        except Exception as err:  # noqa: BLE001 - rocksdict raises a bare Exception carrying RocksDB's message
            shutil.rmtree(self.path)  # (the copy: the damaged original stays aside)
            self._open()
            self.recoveries += 1
            log.error("%s; kept at %s; RocksDB's repair failed (%s): started empty, its unshipped entries are "
                      "lost", damage, aside, err)
            return
        self.recoveries += 1
        log.error("%s; kept at %s; a repaired copy goes on (RocksDB's repair: what its table files and log held)",
                  damage, aside)

    def _load(self) -> None:
        """Where the entries start and end, what was shipped; every entry's key read once (the
        unshipped ones' count), so damage shows at start (:class:`SpoolDamaged`) rather than when
        a broker reset has the retained ones shipped again."""
        it = self._db.iter()
        it.seek_to_first()
        first = int.from_bytes(it.key()[:_POS], "big") if it.valid() else None
        it.seek_to_last()
        end = (int.from_bytes(it.key()[:_POS], "big") + len(it.key()) + len(it.value())) if it.valid() else None
        self._check(it)
        del it
        shipped_raw = self._meta.get(b"shipped")
        shipped = int.from_bytes(shipped_raw, "big") if shipped_raw else 0
        #: the first entry kept; [low, shipped) shipped and retained, [shipped, end) unshipped
        self.low = first if first is not None else shipped
        self.end = end if end is not None else self.low
        self.shipped = min(max(shipped, self.low), self.end)
        for _ in self._keys(self.low, self.shipped):
            pass
        self.pending = sum(1 for _ in self._keys(self.shipped, self.end))
        # (position, monotonic time): everything below position was shipped by then. What was
        # shipped before this start counts as shipped now (kept a little longer, never shorter).
        self._marks: deque[tuple[int, float]] = deque([(self.shipped, time.monotonic())])

    def _check(self, it: RdictIter) -> None:
        """Raise :class:`SpoolDamaged` when ``it`` stopped on an error, not at the end."""
        try:
            it.status()
        except Exception as err:  # noqa: BLE001 - rocksdict raises a bare Exception carrying RocksDB's message
            raise SpoolDamaged(f"{self.name} {self.path} is damaged: {err}") from None

    def recover(self, damage: str) -> None:
        """Go on from a damaged spool (found at start, or by a read: ``damage`` says how): its
        readable unshipped entries (forward from the shipped cursor to the damage, backward from
        the last entry to it) are kept, the directory is moved aside (``<dir>.damaged-<unix
        time>``, for a post-mortem) and they are appended, in order, to a fresh spool, whose
        positions start at 0 again (a reader goes on from :attr:`shipped`). What lay in the
        damaged blocks is lost, and logged, as are the shipped entries kept for a broker reset;
        refusing to go on instead would stop /rank (or the joiner) until someone deleted it.
        Call it with no exception in flight: a traceback keeps the database's iterators open."""
        try:
            raw = self._meta.get(b"shipped")
            shipped = int.from_bytes(raw, "big") if raw else 0
        except Exception:  # noqa: BLE001 - the cursor's own block damaged: everything readable is shipped again
            shipped = 0
        head: list[Entry] = []
        it = self._db.iter()
        it.seek(_pos(shipped))
        while it.valid():
            head.append(Entry(int.from_bytes(it.key()[:_POS], "big"), it.key()[_POS:], it.value()))
            it.next()
        tail: list[Entry] = []
        after = head[-1].position if head else shipped - 1
        it.seek_to_last()
        while it.valid() and int.from_bytes(it.key()[:_POS], "big") > after:
            tail.append(Entry(int.from_bytes(it.key()[:_POS], "big"), it.key()[_POS:], it.value()))
            it.prev()
        del it
        kept = head + tail[::-1]
        self.recoveries += 1
        lost_from = head[-1].end if head else shipped
        lost_to = tail[-1].position if tail else None
        del self._meta
        self._db.close()
        aside = set_aside(self.path)
        log.error("%s; moved to %s and started afresh with its %d readable unshipped entries: the entries "
                  "from position %d to %s are lost", damage, aside, len(kept), lost_from,
                  lost_to if lost_to is not None else "its end")
        self._open()
        self._load()
        for e in kept:
            self.append(e.key, e.value)

    # ------------------------------------------------------------------ state
    @property
    def bytes(self) -> int:
        """Bytes held (keys + values): unshipped and retained entries."""
        return self.end - self.low

    @property
    def epoch(self) -> str | None:
        """The broker epoch the shipped entries were sent to (None: never shipped)."""
        raw = self._meta.get(b"epoch")
        return raw.decode() if raw else None

    def set_epoch(self, epoch: str) -> None:
        self._meta.put(b"epoch", epoch.encode(), self._write)

    # ------------------------------------------------------------------ writing
    def append(self, key: builtins.bytes, value: builtins.bytes) -> int:  # (bytes: the property above)
        """Store one entry durably (see the module docstring); return its position."""
        if self._closed:
            raise SpoolError(f"the {self.name} is closed (its service is stopping)")
        size = _POS + len(key) + len(value)
        if self.end + size - self.low > self.max_bytes and self.low < self.shipped:
            self._make_room(self.end + size - self.max_bytes)
        if self.end + size - self.shipped > self.max_bytes:
            raise SpoolFull(f"{self.name} full: {self.end - self.shipped} of {self.max_bytes} "
                            "bytes unshipped (Kafka slow or down)")
        position = self.end
        try:
            self._db.put(_pos(position) + key, value, self._write)
        except Exception as err:  # noqa: BLE001 - disk full, I/O error: never answer 200 without the log
            raise SpoolError(f"{self.name} {self.path}: write failed: {err}") from None
        self.end = position + size
        self.pending += 1
        return position

    def _make_room(self, lowest: int) -> None:
        """Delete the oldest shipped entries, up to the first shipped batch at or above position
        ``lowest`` (all shipped ones if none is), before their retention ends."""
        upto = next((pos for pos, _t in self._marks if pos >= lowest), self.shipped)
        now = time.monotonic()
        if now - self._warned >= 60.0:
            self._warned = now
            log.warning("%s %s is full (%d bytes): dropping shipped entries before their retention "
                        "ends (a broker reset now could lose them); raise %s_max_bytes or lower "
                        "%s_retention_s", self.name, self.path, self.max_bytes, self.knobs, self.knobs)
        self.trim(upto)

    def mark_shipped(self, entries: Sequence[Entry]) -> None:
        """Kafka acknowledged ``entries`` (consecutive, in order): move the shipped cursor."""
        if not entries or entries[-1].end <= self.shipped:
            return  # re-shipped entries (after a broker reset): already counted as shipped
        self.pending -= sum(1 for e in entries if e.position >= self.shipped)
        self.shipped = entries[-1].end
        self._meta.put(b"shipped", _pos(self.shipped), self._write)
        self._marks.append((self.shipped, time.monotonic()))

    def trim(self, upto: int) -> None:
        """Delete the shipped entries below position ``upto``."""
        upto = min(upto, self.shipped)
        if upto <= self.low:
            return
        self._db.delete_range(_pos(self.low), _pos(upto), self._write)
        self.low = upto
        while self._marks and self._marks[0][0] <= upto:
            self._marks.popleft()

    def trim_expired(self, now: float | None = None) -> None:
        """Delete the entries shipped more than ``retention_s`` ago."""
        cutoff = (time.monotonic() if now is None else now) - self.retention_s
        upto = None
        while self._marks and self._marks[0][1] <= cutoff:
            upto = self._marks.popleft()[0]
        if upto is not None:
            self.trim(upto)

    # ------------------------------------------------------------------ reading
    def read(self, start: int, max_entries: int, max_bytes: int) -> list[Entry]:
        """Up to ``max_entries`` entries from position ``start`` on (at least one if any is there,
        however large; then no more than ``max_bytes`` in all)."""
        out: list[Entry] = []
        total = 0
        it = self._db.iter()
        it.seek(_pos(max(start, self.low)))
        while it.valid() and len(out) < max_entries:
            key, value = it.key(), it.value()
            total += len(key) + len(value)
            if out and total > max_bytes:
                break
            out.append(Entry(int.from_bytes(key[:_POS], "big"), key[_POS:], value))
            it.next()
        if not it.valid():  # the end, or damage (raised: ending early would leave entries unshipped)
            self._check(it)
        return out

    def _keys(self, start: int, end: int) -> Iterator[builtins.bytes]:
        it = self._db.iter()
        it.seek(_pos(start))
        while it.valid() and int.from_bytes(it.key()[:_POS], "big") < end:
            yield it.key()
            it.next()
        if not it.valid():
            self._check(it)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        del self._meta  # a column family handle keeps the database (and its lock) open
        self._db.close()
