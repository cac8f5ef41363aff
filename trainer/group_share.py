"""One online trainer per consumer group: what a one-process trainer does when its group has
another member.

A second consumer in the trainer's group (another ``driftline trainer online`` started by hand
with the same settings, a scaled-up container) takes some of the examples' partitions at the next
rebalance: each trainer would then learn part of the stream, and both would publish deltas onto
``param-deltas`` (a fresh one its untrained weights at its start), which serving applies in
turn. So while another member holds partitions, a trainer pauses its own, trains and publishes
nothing, and says so (an error, once; ``driftline_trainer_group_partitions_elsewhere``); when the
other leaves, the rebalance gives it every partition and it goes on where it stopped. Several
trainers are ``driftline trainer online --nproc N`` (ranks, which do not share a group).

The group's own state cannot tell first: a member killed -9 stays listed (tansu keeps it until the
next rebalance), so a restarted trainer would take its dead predecessor for another one. The
assignment can: a dead member is expelled before partitions are handed out.

>>> share = GroupShare("driftline-trainer", "examples")
>>> share.assigned({0, 1}, {0, 1, 2, 3})
[2, 3]
>>> share.sharing
True
>>> share.assigned({0, 1, 2, 3}, {0, 1, 2, 3}), share.sharing
([], False)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from aiokafka import AIOKafkaConsumer, TopicPartition
from prometheus_client import Gauge

from .metrics import GROUP_ELSEWHERE

__all__ = ["GroupShare"]

log = logging.getLogger(__name__)


class GroupShare:
    """Whether the last assignment left partitions of ``topic`` to another member of ``group``."""

    def __init__(self, group: str, topic: str, gauge: Gauge = GROUP_ELSEWHERE) -> None:
        self.group, self.topic, self.gauge = group, topic, gauge
        self.elsewhere: list[int] = []
        gauge.set(0)

    @property
    def sharing(self) -> bool:
        return bool(self.elsewhere)

    def assigned(self, mine: Iterable[int], whole: Iterable[int]) -> list[int]:
        """Note an assignment (this member's partitions of the topic, and all of them); the
        partitions another member holds."""
        mine, whole = set(mine), set(whole)
        was, self.elsewhere = self.elsewhere, sorted(whole - mine)
        self.gauge.set(len(self.elsewhere))
        if self.elsewhere and not was:
            log.error("another member of the group %r holds partitions %s of %s: this trainer trains and publishes "
                      "nothing until it leaves (one online trainer per topic and group: two would each learn part "
                      "of the stream, or all of it twice, and publish over each other; a trainer of several "
                      "processes is one `driftline trainer online --nproc N`)", self.group, self.elsewhere, self.topic)
        elif was and not self.elsewhere:
            log.warning("the group %r is this trainer's own again (all %d partitions of %s): training goes on",
                        self.group, len(whole), self.topic)
        return self.elsewhere

    def check(self, consumer: AIOKafkaConsumer, assigned: Iterable[TopicPartition]) -> None:
        """After a rebalance: this member's partitions of the topic paused while another member
        holds some (a new assignment starts unpaused)."""
        ours = [tp for tp in assigned if tp.topic == self.topic]
        mine = {tp.partition for tp in ours}
        if self.assigned(mine, consumer.partitions_for_topic(self.topic) or mine):
            consumer.pause(*ours)
