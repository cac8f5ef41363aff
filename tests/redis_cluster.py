"""A real Redis Cluster on loopback for tests: the embedded ``redis-server`` in cluster mode.

``LocalCluster(tmp, masters=3, replicas=1)`` starts ``masters * (1 + replicas)`` processes, gives
each master an equal share of the 16384 slots and each replica its master with the servers' own
cluster commands (``CLUSTER SET-CONFIG-EPOCH``, ``ADDSLOTS``, ``MEET``, ``REPLICATE``; what
``redis-cli --cluster create`` sends), and returns once every node says ``cluster_state:ok`` and
every replica's link to its master is up. ``kill(node)`` is a ``kill -9``.

The nodes run with a short ``cluster-node-timeout`` (a dead master is failed over in a few
seconds) and ``cluster-require-full-coverage no``: a slot range whose master died without a
replica fails alone, the others stay served (Redis's default stops the whole cluster instead).
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.crc import key_slot

from driftline.embedded import redis_binary, wait_for_port
from services.ports import free_port, port_is_open

SLOTS = 16384


@dataclass
class Node:
    port: int
    proc: subprocess.Popen
    id: str = ""
    master: Node | None = None  # None: a master
    slots: range = field(default_factory=lambda: range(0))
    password: str | None = None

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5)


class LocalCluster:
    def __init__(self, tmp: Path, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 1000,
                 timeout_s: float = 30.0, password: str | None = None) -> None:
        """``password``: every node's ``requirepass`` (and ``masterauth``, for its replicas)."""
        self.tmp = tmp
        self.password = password
        self.nodes: list[Node] = []
        self._logs = []
        try:
            self._start(masters, replicas, node_timeout_ms, timeout_s)
        except BaseException:
            self.stop()
            raise

    @property
    def masters(self) -> list[Node]:
        return [n for n in self.nodes if n.master is None]

    @property
    def url(self) -> str:
        """A cluster URL: any one node; the client discovers the rest."""
        return f"redis://127.0.0.1:{self.nodes[0].port}/0"

    def node_of(self, key: str) -> Node:
        """The master that started with the key's slot."""
        slot = key_slot(key.encode())  # computed here: any node may be dead
        return next(n for n in self.masters if slot in n.slots)

    def kill(self, node: Node) -> None:
        node.proc.kill()
        node.proc.wait()

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc.poll() is None:
                node.proc.kill()
                node.proc.wait()
        for log in self._logs:
            log.close()

    def _spawn(self, i: int, node_timeout_ms: int) -> Node:
        port = _cluster_port()
        data = self.tmp / f"node-{i}"
        data.mkdir(parents=True, exist_ok=True)
        log = open(data / "redis.log", "ab")
        self._logs.append(log)
        proc = subprocess.Popen([
            str(redis_binary()), "--bind", "127.0.0.1", "--port", str(port), "--dir", str(data),
            "--save", "", "--appendonly", "no", "--protected-mode", "no",
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(node_timeout_ms), "--cluster-require-full-coverage", "no",
            "--cluster-replica-validity-factor", "0",
            *(["--requirepass", self.password, "--masterauth", self.password] if self.password else []),
        ], stdout=log, stderr=subprocess.STDOUT)
        node = Node(port, proc, password=self.password)
        self.nodes.append(node)
        return node

    def _start(self, masters: int, replicas: int, node_timeout_ms: int, timeout_s: float) -> None:
        for i in range(masters * (1 + replicas)):
            self._spawn(i, node_timeout_ms)
        for i, node in enumerate(self.nodes):
            wait_for_port("127.0.0.1", node.port, timeout_s, "redis cluster node", node.proc)
            c = node.client()
            node.id = c.execute_command("CLUSTER", "MYID").decode()
            c.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
        share = SLOTS // masters
        for i, node in enumerate(self.nodes[:masters]):
            node.slots = range(i * share, SLOTS if i == masters - 1 else (i + 1) * share)
            node.client().execute_command("CLUSTER", "ADDSLOTS", *node.slots)
        for i, node in enumerate(self.nodes[masters:]):
            node.master = self.nodes[i % masters]
        first = self.nodes[0]
        for node in self.nodes[1:]:
            node.client().execute_command("CLUSTER", "MEET", "127.0.0.1", first.port)
        self._wait(lambda n: len(n.client().cluster("NODES")) == len(self.nodes), timeout_s, "every node knows every other")
        for node in self.nodes:
            if node.master is not None:
                node.client().execute_command("CLUSTER", "REPLICATE", node.master.id)
        self._wait(lambda n: n.client().cluster("INFO")["cluster_state"] == "ok" and (
            n.master is None or n.client().info("replication")["master_link_status"] == "up"),
            timeout_s, "cluster_state:ok and every replica linked")

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(ready(n) for n in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the test cluster did not reach {what} in {timeout_s} s")
            time.sleep(0.05)


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    while True:
        port = free_port()
        if port + 10_000 <= 65_535 and not port_is_open("127.0.0.1", port + 10_000):
            return port
