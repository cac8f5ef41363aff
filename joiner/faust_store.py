"""The joiner's Faust table store: Faust's RocksDB store on rocksdict, with changelog batches that
apply all or nothing.

The joiner writes a batch's state changes to the table's changelog topic itself (one record per
changed key, a null value for a delete), followed by a *commit marker* (key :data:`MARKER`), and
only then to the local RocksDB, in one WriteBatch together with the marker's changelog offset
(Faust's persisted offset). Recovery (:meth:`JoinStore.apply_changelog_batch`, used by Faust for
a takeover, a restart and standby replicas) holds a partition's records back until a marker
comes and then writes them and the marker's offset in one WriteBatch, so a store is always the
state after some committed batch, never half of one.

A partition store a disk damaged (a block failing its checksum, a garbled ``CURRENT``) is set
aside and rebuilt from the changelog like a takeover's: a read of it
raises :class:`services.rocksdb_faults.StoreDamaged` (never a record's fault: :mod:`joiner.worker` does not
dead-letter for it), the worker stops and marks its stores for a full check
(:data:`CHECK_MARKER`, :func:`services.rocksdb_faults.mark_for_check`), and its next start moves
every store that does not read aside (:func:`services.rocksdb_faults.set_aside_damaged`).

Records after the last marker are a batch whose writer died before committing it (its input is
replayed from the offsets of the last committed batch, which live in the state). They stay in
:attr:`JoinStore.tail` and :meth:`JoinStore.repair` writes, for each of their keys, the committed
value (or a delete) back to the changelog before the partition's first new batch: a later
recovery, even from a compacted changelog, then ends with the committed values.

>>> from joiner.faust_store import PartitionKV
>>> from rocksdict import Options, Rdict
>>> import tempfile
>>> kv = PartitionKV(Rdict(tempfile.mkdtemp(), Options(raw_mode=True)))
>>> kv.write({b"a": b"1", b"b": b"2", b"c": None}, changelog_offset=7)
>>> kv.get(b"a"), list(kv.scan(b"a", b"b")), kv.persisted_offset()
(b'1', [(b'a', b'1')], 7)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from faust.stores import STORES
from faust.stores import rocksdb as faust_rocksdb
from faust.types import TP, EventT
from rocksdict import DbClosedError

from joiner.stores.rocksdb import RdictKV

MARKER = b"\x00commit"  # (sorts before every state key: joiner.core's keys start with a letter)
OFFSET_KEY = faust_rocksdb.Store.offset_key
#: in the worker's state directory: a store was found damaged, read every store in full at start
CHECK_MARKER = "stores-damaged"


class PartitionKV(RdictKV):
    """One partition's RocksDB as a :class:`joiner.types.KVStore`, with Faust's persisted
    changelog offset written in the same batch as the state."""

    def write(self, changes: Mapping[bytes, bytes | None], changelog_offset: int | None = None) -> None:
        """Apply puts and deletes (None) atomically, with the changelog offset they reach."""
        wb = self.batch(changes)
        if changelog_offset is not None:
            wb.put(OFFSET_KEY, str(changelog_offset).encode())
        self._write(wb)

    def persisted_offset(self) -> int | None:
        raw = self.db.get(OFFSET_KEY)
        return int(raw) if raw is not None else None

    def close(self) -> None:
        """The store owns the database (Faust closes it on revocation)."""


class JoinStore(faust_rocksdb.Store):
    """``driftline://``: Faust's RocksDB store (rocksdict) whose recovery applies whole batches."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("driver", "rocksdict")
        super().__init__(*args, **kwargs)
        # partition -> key -> value (None: delete) of changelog records after the last marker
        self.tail: dict[int, dict[bytes, bytes | None]] = {}

    def kv(self, partition: int) -> PartitionKV:
        return PartitionKV(self._db_for_partition(partition))

    def apply_changelog_batch(self, batch: Iterable[EventT], to_key: Callable[[Any], Any],
                              to_value: Callable[[Any], Any]) -> None:
        for event in batch:
            msg = event.message
            tail = self.tail.setdefault(msg.partition, {})
            if msg.key == MARKER:
                self.kv(msg.partition).write(tail, changelog_offset=msg.offset)
                tail.clear()
            else:
                tail[msg.key] = msg.value

    def repair(self, partition: int) -> dict[bytes, bytes | None]:
        """The changelog records that undo the uncommitted tail of ``partition`` (empty if none):
        the committed value of each of its keys, None where it has none."""
        tail = self.tail.pop(partition, None)
        if not tail:
            return {}
        get = self._db_for_partition(partition).get
        return {k: get(k) for k in tail}

    async def stop(self) -> None:
        """Close the databases (Faust's store leaves that to the garbage collector, which a
        reference held elsewhere defeats: the next worker in this process could not open them)."""
        for db in self._dbs.values():
            with contextlib.suppress(DbClosedError):
                db.close()
        await super().stop()

    def revoke_partitions(self, table: Any, tps: set[TP]) -> None:
        for tp in tps:
            if tp.topic in table.changelog_topic.topics:
                self.tail.pop(tp.partition, None)
        super().revoke_partitions(table, tps)


def register() -> None:
    """Make ``driftline://`` name :class:`JoinStore` for Faust."""
    STORES.aliases.setdefault("driftline", f"{__name__}:JoinStore")


def partition_stores(tabledir: Path, table: str) -> dict[int, Path]:
    """The local RocksDB of each partition of ``table`` (Faust's ``<table>-<p>.db``).

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp()); (d / "state-3.db").mkdir(); (d / "other-1.db").mkdir()
    >>> (d / "state-4.db.damaged-1700000000").mkdir()
    >>> {p: path.name for p, path in partition_stores(d, "state").items()}
    {3: 'state-3.db'}
    """
    out = {}
    for path in tabledir.glob(f"{table}-*.db"):
        number = path.name[len(table) + 1:-3]
        if number.isdigit():
            out[int(number)] = path
    return dict(sorted(out.items()))
