"""Every Redis client the project makes goes through services/redis_client.connect: one made any
other way would miss the password, TLS and cluster settings (found by walking the code)."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

#: what makes a Redis client or pool in redis-py (sync, asyncio, cluster, sentinel)
CLIENT_MAKERS = {"Redis", "StrictRedis", "RedisCluster", "ConnectionPool", "BlockingConnectionPool",
                 "ClusterConnectionPool", "Sentinel", "SentinelConnectionPool", "from_url", "from_pool"}
FACTORY = "services/redis_client.py"


def client_calls(source: str) -> list[tuple[int, str]]:
    """(line, name) of every call that makes a Redis client or pool.

    >>> client_calls("import redis\\nr = redis.Redis(host='db')\\nc = RedisCluster.from_url(u)\\nf(x)")
    [(2, 'Redis'), (3, 'from_url')]
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name in CLIENT_MAKERS:
                found.append((node.lineno, name))
    return sorted(found)


def test_every_redis_client_is_made_by_the_factory(repo_root: Path) -> None:
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
                           cwd=repo_root, capture_output=True, text=True, check=True).stdout.split()
    modules = [f for f in files if not f.startswith(("tests/", "bench/")) and (repo_root / f).exists()]
    assert FACTORY in modules and "serving/feature_store.py" in modules
    elsewhere = {f: calls for f in modules if f != FACTORY
                 and (calls := client_calls((repo_root / f).read_text()))}
    assert elsewhere == {}, f"Redis clients made without services.redis_client.connect: {elsewhere}"
    assert {name for _, name in client_calls((repo_root / FACTORY).read_text())} >= {"from_url", "from_pool"}
