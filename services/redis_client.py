"""Every Redis client driftline makes, built from the settings, and Redis URLs safe to print.

:func:`connect` is the one place a Redis client is made (``tests/test_redis_clients.py`` finds
every other by walking the code): ``REDIS_URL`` carries the user and password
(``redis://alice:secret@host:6379/0``) and TLS (``rediss://``), the ``redis_client`` settings
the TLS files and ``cluster``. With ``redis_client.cluster`` the client is redis-py's
:class:`~redis.asyncio.cluster.RedisCluster`: the URL names any one node.

A URL is printed or logged only through :func:`redacted`, and an error through
:func:`without_password` (a client's error may quote what it was given):

>>> redacted("redis://alice:secret@db:6380/0")
'redis://alice:***@db:6380/0'
>>> redacted("rediss://:s3cr%40t@db/0")
'rediss://:***@db/0'
>>> redacted("redis://127.0.0.1:6379/0")
'redis://127.0.0.1:6379/0'
>>> without_password("auth failed for redis://:s3cr%40t@db (s3cr@t)", "rediss://:s3cr%40t@db/0")
'auth failed for redis://:***@db (***)'
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from services.settings import RedisClientSettings, get_settings

__all__ = ["connect", "redacted", "without_password", "RedisCluster"]


def redacted(url: str) -> str:
    """``url`` with its password, if any, replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def without_password(text: str, url: str) -> str:
    """``text`` (an error message) with ``url``'s password, raw or percent-encoded, as ``***``."""
    password = urlsplit(url).password
    if not password:
        return text
    for secret in {password, unquote(password)}:
        text = text.replace(secret, "***")
    return text


def _tls(url: str, options: RedisClientSettings) -> dict[str, str]:
    files = {name: str(path) for name, path in (("ssl_ca_certs", options.ssl_ca_certs),
                                                ("ssl_certfile", options.ssl_certfile),
                                                ("ssl_keyfile", options.ssl_keyfile)) if path is not None}
    if files and urlsplit(url).scheme != "rediss":
        raise ValueError(f"redis_client.{', '.join(files)} set, but REDIS_URL ({redacted(url)}) is not a "
                         "rediss:// (TLS) URL: use rediss://, or unset them")
    return files


def connect(url: str, options: RedisClientSettings | None = None, *, timeout_s: float = 1.0,
            max_connections: int = 100, wait_s: float | None = None) -> aioredis.Redis | RedisCluster:
    """An asyncio client of the Redis (or Redis Cluster) at ``url`` (``options``: the process's
    ``redis_client`` settings unless given).

    Every command times out after ``timeout_s``. A single node's pool blocks past
    ``max_connections`` for up to ``wait_s`` (default ``timeout_s``), then fails: redis-py's default
    pool raised "Too many connections" at once. A pooled connection that a Redis restart closed
    fails its next command: it is retried once on a new connection (not on a timeout: under
    overload that would double the wait). A cluster client keeps ``max_connections`` per node and
    does not retry: redis-py's retry after a node failed closes every node's connections, failing
    the requests in flight on the live ones; the feature store re-reads the slot map instead
    (:mod:`serving.cluster_io`).

    >>> connect("redis://127.0.0.1:1/0", RedisClientSettings()).connection_pool.max_connections
    100
    >>> type(connect("redis://127.0.0.1:1/0", RedisClientSettings(cluster=True))).__name__
    'RedisCluster'
    >>> from pathlib import Path
    >>> tls = RedisClientSettings(cluster=True, ssl_ca_certs=Path("ca.pem"))
    >>> node = connect("rediss://alice:pw@127.0.0.1:1/0", tls).nodes_manager.connection_kwargs
    >>> node["connection_class"].__name__, node["ssl_ca_certs"], node["username"]
    ('SSLConnection', 'ca.pem', 'alice')
    """
    options = options if options is not None else get_settings().redis_client
    retry = Retry(NoBackoff(), 0 if options.cluster else 1, supported_errors=(RedisConnectionError,))
    common: dict[str, Any] = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                  retry=retry, **_tls(url, options))
    if options.cluster:
        return RedisCluster.from_url(url, max_connections=max_connections, **common)
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=timeout_s if wait_s is None else wait_s, **common)
    return aioredis.Redis.from_pool(pool)
