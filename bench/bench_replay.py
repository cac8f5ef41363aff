"""Replay throughput against a raw aiokafka produce loop, in the same run, on a fresh tansu broker.

`make bench-replay` (QUICK=1: a 100k-rating slice). The last line is one JSON object:
`replay_msgs_per_s`, `raw_produce_msgs_per_s`, `replay_vs_raw`, `messages`.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from driftline.embedded import tansu_command, wait_for_port
from producers.replay import replay, replay_events
from services.kafka import create_topics, producer, start_client
from services.ports import free_port
from services.settings import Settings


async def raw_produce(settings: Settings, messages: list[tuple[str, bytes, bytes]]) -> float:
    """The floor: aiokafka sending the same pre-encoded bytes, same producer settings."""
    topics = {t + "-raw": 4 for t in {m[0] for m in messages}}
    await create_topics(settings, topics)
    p = producer(settings)
    await start_client(p, settings)
    started = time.perf_counter()
    pending = []
    for topic, key, value in messages:
        pending.append(await p.send(topic + "-raw", value, key=key))
        if len(pending) >= 5000:
            await asyncio.gather(*pending)
            pending.clear()
    await asyncio.gather(*pending)
    seconds = time.perf_counter() - started
    await p.stop()
    return len(messages) / seconds


def main() -> None:
    quick = os.environ.get("QUICK") == "1"
    limit = 100_000 if quick else None
    port = free_port()
    broker = subprocess.Popen(tansu_command("127.0.0.1", port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port("127.0.0.1", port, 20, "broker", broker)
        settings = Settings(kafka_bootstrap_servers=f"127.0.0.1:{port}")
        stats = asyncio.run(replay(settings, "ml-1m", speed=0, limit=limit, progress=True))
        print(f"replay: {stats['messages']:,} messages in {stats['seconds']:.1f} s = {stats['messages_per_s']:,.0f} msg/s")
        messages = list(replay_events(settings, "ml-1m", limit=limit))
        raw = asyncio.run(raw_produce(settings, messages))
        print(f"raw aiokafka produce of the same bytes: {raw:,.0f} msg/s")
        print(json.dumps({
            "replay_msgs_per_s": stats["messages_per_s"],
            "raw_produce_msgs_per_s": round(raw, 1),
            "replay_vs_raw": round(stats["messages_per_s"] / raw, 3),
            "messages": stats["messages"],
        }))
    finally:
        broker.terminate()
        broker.wait()


if __name__ == "__main__":
    main()
