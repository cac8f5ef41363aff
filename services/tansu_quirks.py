"""Every way the embedded tansu broker (0.6.0) differs from Apache Kafka, worked around here only.

Each workaround is also correct on Apache Kafka, so the same code runs against both:

1. ListOffsets(LATEST) answers the base offset of the last record batch + 1, not the log-end
   offset, so ``end_offsets()`` is too low whenever the last batch held several records. The high
   watermark in a Fetch response is right: :func:`log_end_offsets` reads that instead.
   Faust's table recovery asks for its changelog highwaters this way too: with the low answer a
   worker whose local store is up to date refuses to start (``ConsistencyError: The persisted
   offset for changelog topic partition ... is higher than the last offset in that topic``), and
   one rebuilding a store may stop reading the changelog before its last records.
   :func:`install_faust` makes Faust's consumer read the true end offsets.
2. The first group generation is 0, and aiokafka sends LeaveGroup only above 0, so a cleanly
   stopped first-generation member lingers until its session times out and the next member's
   join waits for it. :func:`install` makes aiokafka leave at any valid generation (>= 0; -1 is
   aiokafka's "no generation").
3. A first group join waits about half the session timeout: the default session timeout in
   :mod:`services.settings` is 10 s for that reason. A join that takes that long must not be cut
   off by a connect timeout (the member it leaves behind holds the next join for a whole
   session): :class:`services.kafka.TypedConsumer` bounds only reaching the broker.
4. ``list_consumer_group_offsets(group)`` without explicit partitions breaks the connection:
   :func:`committed_offsets` always names the partitions.
5. Memory storage is lost when the broker restarts. :mod:`services.broker_reset`: its
   :func:`~services.broker_reset.ensure_broker_epoch` writes a random
   epoch id into a marker topic when the stack starts; a service that keeps state across broker
   restarts compares it with the one stored beside its state (:func:`~services.broker_reset.state_matches_broker`) and
   discards stale state with a clear log line instead of crashing on offsets that no longer exist.
   A *running* consumer notices a reset with :class:`EpochWatch` (the topics are recreated under
   it, and offsets it held may be valid again on the new, shorter logs: nothing else tells).
   What a reset means for each service's state (kept: it lives outside the broker) and what it
   still loses (records that lived only in the broker) is in ``docs/broker-reset.md``. A service
   that must restart to follow a reset (the joiner worker: Faust cannot swap its changelog under a
   running app) exits with :data:`~services.broker_reset.RESET_EXIT_CODE`; the supervisor restarts it without counting
   the exit toward a crash loop.
6. After two members of a group leave at the same instant (two joiner workers stopped by one
   SIGTERM each), the coordinator can keep one of them as the group's leader for good: every
   JoinGroup of a new member answers with that departed leader (and no member list), the new
   member's follower SyncGroup waits for an assignment nobody sends and fails with
   REBALANCE_IN_PROGRESS after ~5 s, and so on forever (reproduced in 4 of 7 tries with two
   Faust workers; a LeaveGroup sent on the stale leader's behalf does not clear it, new processes
   do not either; DeleteGroups does: the next join starts the group afresh, as its leader).
   :func:`install_faust` makes a member whose follower SyncGroup failed
   :data:`STALE_LEADER_SYNCS` times in a row delete the group and rejoin as a new member. (On
   Apache Kafka a live group cannot be deleted, NON_EMPTY_GROUP, so the attempt is harmless; it
   costs the group's committed offsets, which the joiner keeps in its state anyway.)
7. A Fetch is answered only when its ``fetch_max_wait_ms`` is over, even when records are waiting
   (Kafka answers once ``fetch_min_bytes``, 1, are there): a consumer's latency is about that
   wait (measured: 1500 ms, Faust's worker consumer, gives 442 ms median delivery latency; 500 ms,
   aiokafka's default, 131 ms; 100 ms, 26 ms). Every consumer here takes
   ``kafka.fetch_max_wait_ms`` (100 ms); :func:`install_faust` gives it to Faust's consumer too,
   whose 1500 ms is not a setting. An idle consumer then fetches ten times a second, which both
   brokers take in stride. (A joiner that lags its inputs by a second loses that second's records
   when the broker dies, and a reader that lags costs time on every takeover.)
8. In the first seconds after a restart (kill -9 under load, clients reconnecting) a new
   partition can lose records it acknowledged and give their offsets to others, and can have
   holes. In `make chaos` runs (kept run, `chaos-topics.pickle`) a consumer reading the new
   topics in order saw every partition's log get shorter under it two or three times (its
   position reset, offsets read going back: 31 -> 18, 43 -> 35), then other records at the
   offsets it had read: 422 offsets held two different records, and 327 of the first ones were
   never seen again; other runs had 57-693 such offsets (`offsets_with_two_records`), or none.
   Three of four `features` partitions also read ``0, 4, 5, ...``, ``0, 6, 7, ...``,
   ``0, 3, 4, ...`` for two independent consumers (Kafka has holes only where compaction,
   retention or transaction markers put them, and never reuses an offset). A reader that was not
   reading at that moment never sees the lost records: every `make chaos` run that missed
   examples after the joiner fixes had such offsets, and none of those that missed nothing did.
   Reproduced in isolation by ``bench/tansu_restart.py``: producers flooding a topic (many sends
   in flight each) across a kill -9 and restart, the topic created again at once. When two or
   more producers' first sends reach a new partition together, the broker logs ``AlreadyExists``
   for a record batch it already stored at that offset, refuses one of them (``UnknownError``, which
   the producer retries) and loses records it acknowledged: eight runs, 1 producer 0 lost; 2
   producers 0 and 332; 4 producers 213 and 542; 8 producers 606, 795 and 866 of 160,000-190,000
   acknowledged (0-75 offsets read with two records). Variants of the script without the restart
   (16 producers at full speed; a topic created while 8 producers wait for it) lost nothing. (A second CreateTopics of an existing
   topic is accepted, not refused, and keeps its records.) A reader must
   not take a hole for records it skipped, nor skip records it can get back: the joiner seeks
   back once to the offset its state expects and, when the records after the gap come again,
   reads on and counts the hole (:meth:`joiner.worker.Worker.process`,
   ``driftline_joiner_input_offsets_unread_total``).
9. No SASL and no TLS. Without ``--authentication`` a SaslHandshake is answered
   UNSUPPORTED_SASL_MECHANISM; with it only SCRAM-SHA-256 is offered (PLAIN: "NoSharedMechanism")
   and, memory storage holding no credentials, no login passes. ``--cert`` and ``--key`` cannot
   be given together ("the argument '--cert <CERT>' cannot be used with '--key <KEY>'"). Nothing
   to work around in the clients: the embedded broker listens on 127.0.0.1 only (its listener and
   advertised URL; ``EmbeddedSettings.host`` refuses any other address), and the security
   settings are tested against it by the failure of each client's SASL handshake
   (tests/test_kafka_security.py) and end to end over mutual TLS through a TLS front before it
   (tests/kafka_tls.py).
10. A member that goes without a LeaveGroup (killed -9, or another client at generation 0 without
    quirk 2's patch) stays in its group after its session ended, until the group's next rebalance
    (a commit 28 s after a 6 s session ended was still refused; longer was not tried). A live
    member's heartbeat starts one after the session (a claim's peer killed -9 was gone 9.5 s later,
    tests/trainer/test_claim.py); a group with no live member has none. A commit with no
    generation, which a manually assigned consumer sends (the trainer's ranks), is accepted only
    while the group has no member (Kafka's rule too), so it is refused for as long (UNKNOWN_MEMBER_ID,
    aiokafka's ``CommitFailedError``). Kafka expels the member when its session ends.
    :func:`expel_departed_members` joins the group once and leaves it: the rebalance that the join
    starts drops the members that do not rejoin. On Kafka it is a rebalance of the live members.
11. A topic deleted (DeleteTopics) while clients use it leaves a ghost: it is gone from the metadata
    and its records with it, but produces to its partitions are taken (at offsets from 0 again)
    and fetched, and every offset commit for it is answered UnknownTopicOrPartition, which aiokafka
    retries for ever inside one ``commit()`` (measured; Kafka deletes the topic and refuses its
    produces instead). A consumer whose position lies past the ghost's new records waits there
    and skips them. Creating the topic again is accepted but can leave it unreadable: with a
    trainer reading and committing on the ghost, a new consumer then read nothing from offset 0
    while the end offsets said 1 per partition (a plain client that produced to the ghost and
    created it again did read its records: not understood). So nothing here creates it again:
    every consumer that commits bounds each commit and goes on without it, says so and stops
    cleanly: the trainer (:mod:`trainer.commits`), the joiner and serving's recent-clicks reader
    (:mod:`services.unanswered_commits`); tests/*/test_topic_deleted.py delete their topics. What
    the deletion took, and the ghost's records before a consumer's position, are lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.consumer import group_coordinator
from aiokafka.errors import KafkaError

from services.aiokafka_quirks import stop_consumer
from services.kafka_security import security_options
from services.settings import Settings

log = logging.getLogger(__name__)

# Quirk 6: follower SyncGroups failed in a row (each ~8 s: a join round and the sync's own wait)
# before the group is taken for stuck with a departed leader. A live leader syncs within one.
STALE_LEADER_SYNCS = 3
_installed = False
_faust_installed = False
_faust_settings: Settings | None = None  # (install_faust's: the joiner app's)


def install() -> None:
    """Patch aiokafka so a member of generation 0 sends LeaveGroup on a clean stop (quirk 2)."""
    global _installed
    if _installed:
        return
    coordinator = group_coordinator.GroupCoordinator
    original = coordinator._maybe_leave_group

    async def _maybe_leave_group(self: group_coordinator.GroupCoordinator) -> None:
        if self.generation == 0:
            # aiokafka only leaves above generation 0; bump it for the check alone.
            # The LeaveGroup request itself carries only group and member id.
            self.generation = 1
        await original(self)

    coordinator._maybe_leave_group = _maybe_leave_group
    _installed = True


async def log_end_offsets(
    settings: Settings, partitions: Iterable[TopicPartition]
) -> dict[TopicPartition, int]:
    """The true log-end offset (high watermark) of each partition, read from a Fetch (quirk 1)."""
    return await true_end_offsets(settings, partitions, settings.bootstrap_servers, settings.kafka.connect_timeout_s)


async def true_end_offsets(
    settings: Settings, partitions: Iterable[TopicPartition], bootstrap_servers: str | list[str], timeout_s: float,
) -> dict[TopicPartition, int]:
    """:func:`log_end_offsets` for a client that has its own broker addresses and timeout (Faust's)."""
    tps = list(partitions)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap_servers, enable_auto_commit=False, group_id=None,
                                fetch_max_wait_ms=settings.kafka.fetch_max_wait_ms, **security_options(settings))
    await consumer.start()
    try:
        consumer.assign(tps)
        # ListOffsets(LATEST) is at most the true end, so a fetch from there is short and its
        # response carries the true high watermark.
        approx = await consumer.end_offsets(tps)
        for tp in tps:
            consumer.seek(tp, approx[tp])
        result: dict[TopicPartition, int] = {}
        deadline = asyncio.get_running_loop().time() + timeout_s
        while len(result) < len(tps):
            await consumer.getmany(*tps, timeout_ms=200, max_records=1)
            for tp in tps:
                hw = consumer.highwater(tp)
                if hw is not None:
                    result[tp] = max(hw, approx[tp])
            if asyncio.get_running_loop().time() > deadline:
                for tp in tps:
                    result.setdefault(tp, approx[tp])
        return result
    finally:
        await stop_consumer(consumer)


async def expel_departed_members(settings: Settings, group_id: str, topic: str, timeout_s: float) -> bool:
    """Quirk 10: join ``group_id`` subscribed to ``topic`` (no record read, nothing committed) and
    leave again; whether the join completed within ``timeout_s``."""
    install()  # (its leave: quirk 2)
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.bootstrap_servers, group_id=group_id, enable_auto_commit=False,
                                session_timeout_ms=6_000, heartbeat_interval_ms=1_000, **security_options(settings))
    await consumer.start()
    try:
        consumer.subscribe([topic])
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not consumer.assignment() and asyncio.get_running_loop().time() < deadline:
            await consumer.getmany(timeout_ms=200, max_records=1)  # (records fetched here are not used)
        return bool(consumer.assignment())
    finally:
        await stop_consumer(consumer)


def install_faust(settings: Settings) -> None:
    """Make Faust's consumer answer its changelog highwaters with the true end offsets (quirk 1),
    aiokafka leave at generation 0 (quirk 2: :func:`install`), a member stuck behind a departed
    group leader delete the group and rejoin (quirk 6), and Faust's consumer wait
    ``kafka.fetch_max_wait_ms`` per fetch (quirk 7). The patches are installed once per process;
    they read the ``settings`` of the app made last (a joiner process runs one)."""
    global _faust_installed, _faust_settings
    _faust_settings = settings
    install()
    if _faust_installed:
        return
    from faust.transport.drivers import aiokafka as faust_aiokafka

    thread = faust_aiokafka.AIOKafkaConsumerThread
    original = thread._highwaters
    create_worker_consumer = thread._create_worker_consumer

    # (Faust's private methods, typed by what they touch: its protocols do not declare these attributes)
    def _create_worker_consumer(self: faust_aiokafka.AIOKafkaConsumerThread, transport: Any) -> AIOKafkaConsumer:
        consumer = create_worker_consumer(self, transport)
        assert _faust_settings is not None
        consumer._fetch_max_wait_ms = _faust_settings.kafka.fetch_max_wait_ms  # (read by its Fetcher, made at start)
        return consumer

    async def _highwaters(self: Any, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        if self.consumer.in_transaction:  # (last stable offsets: read from Fetch responses already)
            return dict(await original(self, partitions))
        servers = faust_aiokafka.server_list(self.transport.url, self.transport.default_port)
        # (Faust's TP is a namedtuple equal to aiokafka's, which aiokafka's asserts insist on)
        tps = [TopicPartition(tp.topic, tp.partition) for tp in partitions]
        assert _faust_settings is not None
        return await true_end_offsets(_faust_settings, tps, servers, self.app.conf.broker_request_timeout)

    thread._highwaters = _highwaters  # type: ignore[method-assign]
    thread._create_worker_consumer = _create_worker_consumer  # type: ignore[method-assign]
    _install_stale_leader_rejoin()
    _faust_installed = True


def _install_stale_leader_rejoin() -> None:
    """Quirk 6: after :data:`STALE_LEADER_SYNCS` failed follower SyncGroups in a row, delete the
    group (DeleteGroups) and rejoin as a new member."""
    from aiokafka.protocol.admin import DeleteGroupsRequest

    rebalance = group_coordinator.CoordinatorGroupRebalance
    original = rebalance._on_join_follower

    async def _on_join_follower(self: group_coordinator.CoordinatorGroupRebalance) -> bytes | None:
        assignment: bytes | None = await original(self)
        coordinator = self._coordinator
        failed = 0 if assignment is not None else getattr(coordinator, "_driftline_failed_syncs", 0) + 1
        coordinator._driftline_failed_syncs = failed
        if failed >= STALE_LEADER_SYNCS:
            coordinator._driftline_failed_syncs = 0
            log.warning("group %s: %d follower SyncGroups in a row failed, the leader never assigns "
                        "(tansu quirk 6): deleting the group to rejoin it afresh", self.group_id, failed)
            try:
                response = await coordinator._client.send(self.coordinator_id, DeleteGroupsRequest([self.group_id]))
                log.warning("group %s: DeleteGroups answered %s", self.group_id, response.results)
            except KafkaError as err:
                log.warning("group %s: DeleteGroups failed: %r", self.group_id, err)
            coordinator.reset_generation()  # (a new member id on the next JoinGroup)
        return assignment

    rebalance._on_join_follower = _on_join_follower


async def committed_offsets(
    settings: Settings, group_id: str, partitions: Iterable[TopicPartition]
) -> dict[TopicPartition, int]:
    """A group's committed offsets, asking for the partitions by name (quirk 4). -1 = none."""
    tps = list(partitions)
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap_servers, **security_options(settings))
    await admin.start()
    try:
        answer = await admin.list_consumer_group_offsets(group_id, partitions=tps)
        return {tp: (meta.offset if meta is not None else -1) for tp, meta in answer.items()}
    finally:
        await admin.close()
