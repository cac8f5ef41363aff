"""One online trainer per examples topic and group, whatever kind each is: the *claim* every
trainer makes, so that a second one is seen.

The one-process trainer reads ``examples`` as a member of the trainer's group
(``trainer.group_id``) and sees a second member there (:mod:`trainer.group_share`). A set of ranks
(``trainer online --nproc N``) reads by manual assignment (:mod:`trainer.dist.input`) and commits
under the same group id without joining it: neither that check nor the broker tells two sets of
ranks apart, or a set from a one-process trainer, and both would learn the whole stream and
publish over each other. So every trainer (the one-process one, and rank 0 of a set) also joins
the *claim group* ``<group_id>.claim.<examples topic>``, subscribed to that topic, and pauses what
it is given there: it reads no record under it and commits nothing. An assignment short of every partition
means another trainer claims the rest, and both then train and publish nothing
(:class:`~trainer.group_share.GroupShare`'s rule, the same for both kinds) until the other leaves
and the next rebalance gives this one every partition again.

Why a group of its own and not the trainer's: the ranks commit their offsets with no generation
(they are not members), which Apache Kafka accepts only while the group has no member. The topic
is in its name because two trainers conflict only on the same topic: trainers of other topics
under the same group id are no one's business here, and would only add rebalances.

Until its first assignment here a trainer does not know whether it is alone, so it trains and
publishes nothing yet (:data:`UNKNOWN`): one started beside a running one must learn no part of
the stream, nor publish its untrained weights, before it knows. The claim group's session is
:data:`SESSION_TIMEOUT_MS`, Kafka's smallest by default (``group.min.session.timeout.ms``): a
first join on tansu waits half of it (tansu quirk 3), and a predecessor killed -9 is expelled
after it. A claim still unknown after :data:`GIVE_UP_S` (a stuck group coordinator, such as tansu
quirk 6's leader that never assigns) counts as alone, with a warning: the claim guards against a
mistake, it must not stop training for good.

>>> c = Claim.__new__(Claim)  # (what the states mean; a real one is started on a broker)
>>> c.share, c.known, c._started = GroupShare("g.claim.examples", "examples"), False, time.monotonic()
>>> c.state == UNKNOWN
True
>>> c._started -= GIVE_UP_S  # no assignment for that long: counted as alone
>>> c.state == ALONE
True
>>> _ = c.share.assigned({0, 1, 2, 3}, {0, 1, 2, 3}); c.known = True
>>> c.state == ALONE
True
>>> _ = c.share.assigned({0, 1}, {0, 1, 2, 3})
>>> c.state == SHARED
True
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError

from services import tansu_quirks
from services.aiokafka_quirks import stop_consumer
from services.kafka import start_client
from services.kafka_security import security_options
from services.settings import Settings

from .group_share import GroupShare
from .metrics import CLAIM_ELSEWHERE

__all__ = ["ALONE", "GIVE_UP_S", "SESSION_TIMEOUT_MS", "SHARED", "UNKNOWN", "Claim"]

log = logging.getLogger(__name__)

UNKNOWN, ALONE, SHARED = 0, 1, 2
SESSION_TIMEOUT_MS = 6_000
GIVE_UP_S = 60.0


class _Pause(ConsumerRebalanceListener):
    def __init__(self, claim: Claim) -> None:
        self.claim = claim

    async def on_partitions_revoked(self, revoked: Iterable[TopicPartition]) -> None:
        pass

    async def on_partitions_assigned(self, assigned: Iterable[TopicPartition]) -> None:
        self.claim.assigned(list(assigned))


class Claim:
    """This trainer's member of ``<group_id>.claim.<topic>``; :attr:`state` says whether it
    is alone. :meth:`start` and :meth:`stop` on the trainer's event loop."""

    def __init__(self, settings: Settings, topic: str, group_id: str) -> None:
        self.settings, self.topic = settings, topic
        self.share = GroupShare(f"{group_id}.claim.{topic}", topic, CLAIM_ELSEWHERE)
        self.known = False  # an assignment seen
        self._started: float | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task | None = None

    @property
    def state(self) -> int:
        if self.share.sharing:
            return SHARED
        if self.known or (self._started is not None and time.monotonic() - self._started >= GIVE_UP_S):
            return ALONE
        return UNKNOWN

    def assigned(self, tps: list[TopicPartition]) -> None:
        """An assignment: paused (never read), and what it leaves to another trainer noted."""
        assert self._consumer is not None
        mine = [tp for tp in tps if tp.topic == self.topic]
        self._consumer.pause(*mine)
        parts = {tp.partition for tp in mine}
        self.share.assigned(parts, self._consumer.partitions_for_topic(self.topic) or parts)
        self.known = True

    async def start(self) -> None:
        """Join (in the background: :attr:`state` is :data:`UNKNOWN` until the first assignment)."""
        tansu_quirks.install()
        k = self.settings.kafka
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=self.settings.bootstrap_servers, group_id=self.share.group, enable_auto_commit=False,
            session_timeout_ms=SESSION_TIMEOUT_MS, heartbeat_interval_ms=SESSION_TIMEOUT_MS // 6,
            request_timeout_ms=k.request_timeout_ms, fetch_max_wait_ms=k.fetch_max_wait_ms,
            **security_options(self.settings))
        await start_client(self._consumer, self.settings)
        self._consumer.subscribe([self.topic], listener=_Pause(self))
        self._started = time.monotonic()
        self._task = asyncio.create_task(self._keep_polling(), name="trainer-claim")

    async def _keep_polling(self) -> None:
        """A member that stops polling for ``max_poll_interval_ms`` leaves its group: poll its
        paused partitions (nothing comes) for as long as it runs."""
        assert self._consumer is not None
        warned = False
        while True:
            try:
                await self._consumer.getmany(timeout_ms=1000)
            except KafkaError as err:  # (the broker away: the client reconnects; the claim stays as it was)
                log.warning("trainers' claim group %r: %r", self.share.group, err)
                await asyncio.sleep(1.0)
            if not self.known and not warned and self.state == ALONE:
                warned = True
                log.warning("no assignment in the trainers' claim group %r after %.0f s: training as the only "
                            "trainer of %s (a second trainer with the same group would go unseen until one comes)",
                            self.share.group, GIVE_UP_S, self.topic)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._consumer is not None:
            await stop_consumer(self._consumer)
