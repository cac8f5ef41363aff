"""``rocksdb://<path>``: RocksDB through rocksdict, the durable tier.

:class:`RdictKV` is the one :class:`joiner.types.KVStore` over an open rocksdict database: the
dumper's and the benches' :class:`RocksDBStore` opens its own by URL, the Faust table store's
partitions (:class:`joiner.faust_store.PartitionKV`) get theirs from Faust.

Each :meth:`RdictKV.write` is one RocksDB WriteBatch written through the WAL (not fsynced): it
survives a kill -9 of the process atomically (the OS keeps the WAL pages); a power loss may lose
the last writes, which the joiner then recomputes from Kafka because the input offsets are in the
same batch. Point lookups use a bloom filter, so the common "is this key waiting?" miss costs no I/O.

>>> import tempfile
>>> store = RocksDBStore(f"rocksdb://{tempfile.mkdtemp()}/state")
>>> store.write({b"a": b"1", b"b": b"2", b"c": None})
>>> store.get(b"a"), store.get_many([b"b", b"c"]), list(store.scan(b"a", b"b"))
(b'1', [b'2', None], [(b'a', b'1')])
>>> store.close()
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from rocksdict import BlockBasedOptions, Options, Rdict, ReadOptions, WriteBatch

from services.rocksdb_faults import as_fault


class RdictKV:
    """Get, scan and atomic batched writes over ``db`` (raw bytes); RocksDB's errors raised as
    :func:`services.rocksdb_faults.as_fault` names them."""

    def __init__(self, db: Rdict) -> None:
        self.db = db
        self.dir = db.path()  # (what a fault names)
        self.url = f"rocksdb://{self.dir}"

    def get(self, key: bytes) -> bytes | None:
        try:
            return self.db.get(key)
        except Exception as err:  # noqa: BLE001 - rocksdict raises a bare Exception carrying RocksDB's status
            raise as_fault(err, self.dir) from None

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        try:
            return self.db.get(list(keys)) if keys else []
        except Exception as err:  # noqa: BLE001 - as in get
            raise as_fault(err, self.dir) from None

    def scan(self, lo: bytes, hi: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        """Items with ``lo <= key < hi`` (``hi`` None: to the end) in key order."""
        ro = ReadOptions()
        if hi is not None:
            ro.set_iterate_upper_bound(hi)
        it = self.db.iter(ro)
        fault = None
        try:
            it.seek(lo)
            while it.valid():
                yield it.key(), it.value()
                it.next()
            it.status()  # the end, or damage: never a silent early end
        except Exception as err:  # noqa: BLE001 - as in get
            fault = as_fault(err, self.dir)
        del it  # (raised from here, the traceback does not keep the database open)
        if fault is not None:
            raise fault

    @staticmethod
    def batch(changes: Mapping[bytes, bytes | None]) -> WriteBatch:
        """Puts and deletes (None) as one WriteBatch."""
        wb = WriteBatch(raw_mode=True)
        for k, v in changes.items():
            if v is None:
                wb.delete(k)
            else:
                wb.put(k, v)
        return wb

    def write(self, changes: Mapping[bytes, bytes | None]) -> None:
        if changes:
            self._write(self.batch(changes))

    def _write(self, wb: WriteBatch) -> None:
        try:
            self.db.write(wb)
        except Exception as err:  # noqa: BLE001 - as in get
            raise as_fault(err, self.dir) from None


class RocksDBStore(RdictKV):
    """A database of its own at ``rocksdb://rel/path`` or ``rocksdb:///abs/path``."""

    def __init__(self, url: str) -> None:
        self.path = Path(url.split("://", 1)[1])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        table = BlockBasedOptions()
        table.set_bloom_filter(10, False)
        opts.set_block_based_table_factory(table)
        opts.increase_parallelism(2)
        super().__init__(Rdict(str(self.path), opts))
        self.url = url

    def close(self) -> None:
        self.db.close()
