"""Tansu quirk 8 in isolation: producers flooding a topic across a kill -9 and restart of the broker.

Starts the embedded broker (:func:`driftline.embedded.tansu_command`, memory storage) on a free
port, creates topic ``t`` (4 partitions), and has ``PRODUCERS`` aiokafka producers send small
records as fast as they can (many in flight, ``linger_ms`` 5, as the services' producers). After
``BEFORE_S`` seconds it kill -9s the broker, starts it again on the same port, creates the topic
again (as ``driftline up`` does on a restart: :func:`services.kafka.create_topics`) and lets the
producers go on for ``AFTER_S`` seconds. Then one reader reads the new broker's topic from the
start. Every record acknowledged by the new broker should be there, once, at the offset its
acknowledgement gave.

Last line, JSON: ``acked`` (records the new broker acknowledged), ``lost`` (acknowledged, never
read), ``moved`` (read at another offset than acknowledged), ``offsets_with_two_records`` (offsets
the reader got two different records at), ``send_errors`` (by type: a produce the broker refused),
``broker_already_exists_errors`` (the broker's own log lines). On Apache Kafka every count is 0.

    .venv/bin/python bench/tansu_restart.py            # PRODUCERS=8 BEFORE_S=3 AFTER_S=6
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError

from driftline.embedded import tansu_command
from services.ports import free_port

PRODUCERS = int(os.environ.get("PRODUCERS", 8))
BEFORE_S = float(os.environ.get("BEFORE_S", 3))
AFTER_S = float(os.environ.get("AFTER_S", 6))
PARTITIONS = 4


async def create_topic(bootstrap: str) -> None:
    """CreateTopics ``t`` once the broker answers (retried while it starts)."""
    deadline = time.monotonic() + 30
    while True:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=2000)
        try:
            await admin.start()
            await admin.create_topics([NewTopic("t", PARTITIONS, 1)])
            return
        except (KafkaError, OSError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)
        finally:
            await admin.close()


async def flood(i: int, bootstrap: str, stop: asyncio.Event, acked: dict, epoch: list[int], errors: Counter) -> None:
    """Send records ``i-j`` round-robin over the partitions until ``stop``; note each acknowledgement."""
    p = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, request_timeout_ms=5000, retry_backoff_ms=50)
    await p.start()

    async def one(key: bytes, partition: int) -> None:
        try:
            md = await (await p.send("t", key, partition=partition))
            acked[key] = (md.partition, md.offset, epoch[0])
        except KafkaError as err:  # a produce the broker refused (or a timeout)
            errors[type(err).__name__] += 1

    pending: set[asyncio.Task] = set()
    j = 0
    try:
        while not stop.is_set():
            task = asyncio.ensure_future(one(f"{i}-{j}".encode(), j % PARTITIONS))
            pending.add(task)
            task.add_done_callback(pending.discard)
            j += 1
            if len(pending) > 200:
                await asyncio.sleep(0.002)
        await asyncio.gather(*pending, return_exceptions=True)
    finally:
        await p.stop()


async def read_all(bootstrap: str) -> tuple[dict[bytes, tuple[int, int]], int]:
    """Every record of ``t`` (value -> first (partition, offset)) and the offsets read twice with
    different records."""
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None)
    await c.start()
    try:
        tps = [TopicPartition("t", q) for q in range(PARTITIONS)]
        c.assign(tps)
        await c.seek_to_beginning(*tps)
        seen: dict[bytes, tuple[int, int]] = {}
        at: dict[tuple[int, int], set[bytes]] = defaultdict(set)
        while batch := await c.getmany(timeout_ms=1000):
            for tp, records in batch.items():
                for r in records:
                    seen.setdefault(r.value, (tp.partition, r.offset))
                    at[(tp.partition, r.offset)].add(r.value)
        return seen, sum(1 for values in at.values() if len(values) > 1)
    finally:
        await c.stop()


async def run(log_path: Path) -> dict:
    port = free_port()
    bootstrap = f"127.0.0.1:{port}"
    with log_path.open("w") as log:
        def start() -> subprocess.Popen:
            return subprocess.Popen(tansu_command("127.0.0.1", port), stdout=log, stderr=subprocess.STDOUT)

        broker = start()
        try:
            await create_topic(bootstrap)
            stop, acked, epoch, errors = asyncio.Event(), {}, [0], Counter()
            tasks = [asyncio.ensure_future(flood(i, bootstrap, stop, acked, epoch, errors)) for i in range(PRODUCERS)]
            await asyncio.sleep(BEFORE_S)
            broker.send_signal(signal.SIGKILL)
            broker.wait()
            epoch[0] = 1  # (an acknowledgement from here on is the new broker's)
            broker = start()
            await create_topic(bootstrap)
            await asyncio.sleep(AFTER_S)
            stop.set()
            await asyncio.gather(*tasks)
            seen, two = await read_all(bootstrap)
        finally:
            broker.kill()
            broker.wait()
    new = {k: v for k, v in acked.items() if v[2] == 1}
    return {
        "producers": PRODUCERS,
        "acked": len(new),
        "lost": sum(1 for k in new if k not in seen),
        "moved": sum(1 for k, v in new.items() if k in seen and seen[k] != v[:2]),
        "offsets_with_two_records": two,
        "send_errors": dict(errors),
        "broker_already_exists_errors": log_path.read_text(errors="replace").count("AlreadyExists"),
    }


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="driftline-tansu-restart-") as tmp:
        result = asyncio.run(run(Path(tmp) / "broker.log"))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
