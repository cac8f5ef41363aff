"""A broker reset under the Faust joiner (tansu memory storage restarted, quirk 5): keep the
local state and write it back into the new, empty changelog.

The join state is in two places: the table's changelog topic (what another worker rebuilds a
partition from) and each worker's local RocksDB (a copy, up to its last committed batch). A
reset empties the changelog; the local copies survive. At start-up a worker that finds its
recorded broker epoch outdated re-seeds (:func:`reseed`), for each partition store on its disk:

1. the input offsets in the state are dropped (they pointed into the old topics: the inputs are
   re-read from the start of the new ones, as the loop does; :meth:`OffsetBook.reset` counts
   what the reset lost), the new epoch recorded;
2. if the new changelog partition is still empty, every key of the store goes to it as one
   committed batch (records + commit marker, :func:`joiner.worker.send_changelog`), and the
   marker's offset becomes the store's persisted offset: Faust then finds the store and the
   changelog in agreement and the partition's waiting impressions, tombstones and watermarks
   are those before the reset, for whichever worker takes the partition;
3. if another worker has already re-seeded that partition, the local copy is deleted (Faust
   rebuilds it from the changelog): one snapshot per partition, never two mixed.

A partition held on two disks (an active and a standby) is re-seeded by the first worker to
start; the standby's copy may be older than the active's. Workers re-seed on start-up only: a
running worker that sees a new epoch exits (:mod:`joiner.faust_app`) to be restarted.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from aiokafka import TopicPartition
from rocksdict import Options, Rdict

from joiner.faust_store import OFFSET_KEY, PartitionKV
from joiner.offsets import OffsetBook
from joiner.worker import offset_book, send_changelog
from services import tansu_quirks
from services.settings import Settings

log = logging.getLogger(__name__)


def partition_stores(tabledir: Path, table: str) -> dict[int, Path]:
    """The local RocksDB of each partition of ``table`` (Faust's ``<table>-<p>.db``).

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp()); (d / "state-3.db").mkdir(); (d / "other-1.db").mkdir()
    >>> {p: path.name for p, path in partition_stores(d, "state").items()}
    {3: 'state-3.db'}
    """
    out = {}
    for path in tabledir.glob(f"{table}-*.db"):
        number = path.name[len(table) + 1:-3]
        if number.isdigit():
            out[int(number)] = path
    return dict(sorted(out.items()))


async def reseed(settings: Settings, prod: object, tabledir: Path, table: str, changelog: str,
                 epoch: str) -> dict[int, int]:
    """Write each local partition store back into the empty ``changelog`` (see the module doc);
    the number of keys re-seeded per partition (partitions left to another worker: absent)."""
    done: dict[int, int] = {}
    for p, path in partition_stores(tabledir, table).items():
        tp = TopicPartition(changelog, p)
        end = (await tansu_quirks.log_end_offsets(settings, [tp]))[tp]
        if end > 0:
            log.warning("broker reset: changelog partition %d was re-seeded by another worker; "
                        "dropping the local copy %s (rebuilt from the changelog)", p, path)
            shutil.rmtree(path, ignore_errors=True)
            continue
        db = Rdict(str(path), Options(raw_mode=True))
        try:
            kv = PartitionKV(db)
            book: OffsetBook = offset_book(settings, p)
            changes, lost = book.reset(kv.get, epoch)
            kv.write(changes)  # (before reading it back: the snapshot holds the new epoch, no offsets)
            items = ((k, v) for k, v in db.items() if k != OFFSET_KEY)
            n = 0

            def counted(it=items):  # type: ignore[no-untyped-def]
                nonlocal n
                for item in it:
                    n += 1
                    yield item

            marker = await send_changelog(prod, changelog, p, counted())
            kv.write({}, changelog_offset=marker)
        finally:
            db.close()
        done[p] = n
        log.warning("broker reset: partition %d's join state kept (%d keys written to the new changelog); "
                    "its inputs are re-read from the start of the new topics; records not consumed "
                    "before the reset are lost: %s", p, n, lost)
    return done
