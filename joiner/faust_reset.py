"""A broker reset under the Faust joiner (tansu memory storage restarted, quirk 5): keep the
local state and write it back into the new, empty changelog.

The join state is in two places: the table's changelog topic (what another worker rebuilds a
partition from) and each worker's local RocksDB (a copy, up to its last committed batch). A
reset empties the changelog; the local copies survive. At start-up a worker that finds its
recorded broker epoch outdated re-seeds (:func:`reseed`), for each partition store on its disk:

1. the input offsets in the state are dropped (they pointed into the old topics: the inputs are
   re-read from the start of the new ones, as the loop does; :meth:`OffsetBook.reset` counts
   what the reset lost), the new epoch recorded;
2. unless another worker has re-seeded the partition already, every key of the store goes to
   the new changelog partition as one committed batch (records + commit marker,
   :func:`joiner.worker.send_changelog`), with a delete for every key that records already there
   have and the store has not (a re-seed cut short by a crash: records without their marker),
   and the marker's offset becomes the store's persisted offset: Faust then finds the store and
   the changelog in agreement and the partition's waiting impressions, tombstones and watermarks
   are those before the reset, for whichever worker takes the partition. (The changelog topic is
   the new epoch's own, :func:`joiner.faust_app.changelog_topic`: a worker that died in the
   reset cannot have written to it);
3. if another worker has already re-seeded that partition (its changelog holds this epoch's
   id followed by a commit marker), the local copy is deleted (Faust rebuilds it from the
   changelog): one snapshot per partition, never two mixed.

A partition held on two disks (an active and a standby) is re-seeded by the first worker to
start; the standby's copy may be older than the active's. Workers re-seed on start-up only: a
running worker that sees a new epoch exits (:mod:`joiner.faust_app`) to be restarted.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import shutil
from pathlib import Path

from aiokafka import AIOKafkaConsumer, TopicPartition
from rocksdict import Options, Rdict

from joiner.faust_store import MARKER, OFFSET_KEY, PartitionKV, partition_stores
from joiner.offsets import OffsetBook
from joiner.worker import offset_book, send_changelog
from services.aiokafka_quirks import stop_consumer
from services.kafka_security import security_options
from services.settings import Settings

log = logging.getLogger(__name__)


async def reseed(settings: Settings, prod: object, tabledir: Path, table: str, changelog: str,
                 epoch: str) -> dict[int, int]:
    """Write each local partition store back into the new ``changelog`` (see the module doc);
    the number of keys re-seeded per partition (partitions left to another worker: absent)."""
    done: dict[int, int] = {}
    stores = partition_stores(tabledir, table)
    in_changelog = await changelog_records(settings, [TopicPartition(changelog, p) for p in stores])
    for p, path in stores.items():
        found = in_changelog[TopicPartition(changelog, p)]
        if reseeded_for(found, offset_book(settings, p).epoch_key, epoch):
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
            strays = {k for k, _ in found if k != MARKER and kv.get(k) is None}
            if found:
                log.warning("broker reset: changelog partition %d holds %d records of no committed re-seed "
                            "(one cut short): their %d keys the local state lacks are deleted",
                            p, len(found), len(strays))
            # (a checked scan: rocksdict's items() ends at a damaged block without a word, which
            # would re-seed part of the state as all of it; StoreDamaged stops the worker instead)
            items = itertools.chain(((k, v) for k, v in kv.scan(b"") if k != OFFSET_KEY),
                                    ((k, None) for k in sorted(strays)))
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


def reseeded_for(records: list[tuple[bytes, bytes | None]], epoch_key: bytes, epoch: str) -> bool:
    """Whether ``records`` (a changelog partition, in order) hold a committed re-seed for
    ``epoch``: its epoch id, then a commit marker.

    >>> reseeded_for([(b"Mepoch", b"e2"), (b"k", b"v"), (MARKER, b"")], b"Mepoch", "e2")
    True
    >>> reseeded_for([(b"Mepoch", b"e1"), (MARKER, b"")], b"Mepoch", "e2")  # another epoch's
    False
    >>> reseeded_for([(b"Mepoch", b"e2"), (b"k", b"v")], b"Mepoch", "e2")  # not committed
    False
    """
    claimed = False
    for key, value in records:
        if key == epoch_key:
            claimed = value == epoch.encode()
        elif key == MARKER and claimed:
            return True
    return False


async def changelog_records(settings: Settings, tps: list[TopicPartition]
                            ) -> dict[TopicPartition, list[tuple[bytes, bytes | None]]]:
    """Every record of the changelog partitions ``tps`` on the new broker, each read up to the
    high watermark its Fetch responses give (ListOffsets can count records a Fetch never returns)."""
    out: dict[TopicPartition, list[tuple[bytes, bytes | None]]] = {tp: [] for tp in tps}
    if not tps:
        return out
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap_servers, enable_auto_commit=False,
                                group_id=None, fetch_max_wait_ms=settings.kafka.fetch_max_wait_ms,
                                **security_options(settings))
    await consumer.start()
    try:
        await consumer._client.force_metadata_update()
        left = [tp for tp in tps if tp.partition in (consumer.partitions_for_topic(tp.topic) or set())]
        if not left:
            return out
        consumer.assign(left)
        await consumer.seek_to_beginning(*left)
        deadline = asyncio.get_running_loop().time() + settings.kafka.connect_timeout_s
        while asyncio.get_running_loop().time() < deadline:
            fetched = await consumer.getmany(*left, timeout_ms=500)
            for tp, records in fetched.items():
                out[tp] += [(r.key, r.value) for r in records]
            for tp in list(left):
                hw = consumer.highwater(tp)
                if hw is not None and await consumer.position(tp) >= hw:
                    left.remove(tp)
            if not left:
                return out
        raise TimeoutError(f"broker reset: could not read changelog partitions {left} to their end")
    finally:
        await stop_consumer(consumer)
