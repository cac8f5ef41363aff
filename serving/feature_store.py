"""The online feature store in Redis: user and item side features and real-time user features.

Layout (``P`` = the key prefix, ``serving.redis_prefix``: ``driftline`` by default):

* ``P:u:<user_id>`` / ``P:i:<item_id>``: the sparse slots as one string, ``slot=id,id;slot=id``
  (ids in decimal; one ``MGET`` fetches a request's user and all its candidates in one round
  trip), and dense values as ``name:value`` parts of the same string (a float in decimal: an
  item's price, a user's click rate). ``/rank`` reads only the features the served model declares
  (:mod:`serving.request_features`);
* ``P:clicks:<user_id>``: a list of the user's last K clicked item ids, newest first, updated
  from the ``actions`` topic (:func:`record_clicks`), served as the ``recent_items`` slot; beside
  it ``{P:clicks:<user_id>}:seen``, the same clicks' identities (:func:`click_tag`; the braces put
  it on the list's cluster slot), so a click delivered twice is recorded once;
* ``P:meta:<name>``: small values of the readers that fill it (the broker epoch whose actions the
  clicks were last read from; ``features-loaded``, written by every load: its absence after a load
  tells serving the store was emptied, :mod:`serving.store_watch`).

Keys and values are plain strings, so any writer can fill it: ids are int64 in decimal, string
values hashed to ids with :func:`services.hashing.string_id`. Fill it from your own Parquet or CSV
files with ``driftline features load --users FILE --items FILE`` (:mod:`serving.feature_files`),
or with the MovieLens demo's features with ``driftline features load --movielens``.

On a Redis Cluster (``redis_client.cluster``) the keys are the same, without hash tags: a
request's candidates are on every master whatever the layout, so tagging a user's two keys into
one slot would save no round trip and would rename an existing store's keys. A request's reads
are then GETs packed per node, sent to all masters at once (:mod:`serving.cluster_io`;
docs/scale-out.md).

>>> encode_slots({"user_id": [7], "genres": [1, 2]})
b'user_id=7;genres=1,2'
>>> decode_slots(b'user_id=7;genres=1,2;year=')
{'user_id': [7], 'genres': [1, 2], 'year': []}
>>> raw = encode_slots({"genres": [1]}, {"price": 12.5})
>>> raw, decode_slots(raw), decode_dense(raw), decode_dense(b"genres=1")
(b'genres=1;price:12.5', {'genres': [1]}, {'price': 12.5}, None)
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import hiredis
from redis.exceptions import AuthenticationError, NoPermissionError, RedisClusterException, RedisError, ResponseError

from services.redis_client import RedisCluster, connect, redacted, without_password
from services.settings import RedisClientSettings
from serving import metrics
from serving.cluster_io import SlotMapRefresh, send_by_node
from serving.redis_state import Evictions

Slots = dict[str, list[int]]

#: the marker every load writes (``P:meta:features-loaded``; :mod:`serving.store_watch` reads it)
LOADED_MARKER = "features-loaded"


def marker_key(prefix: str, name: str) -> str:
    """Where the store keeps the small named value ``name`` (:meth:`FeatureStore.get_marker`).

    >>> marker_key("driftline", LOADED_MARKER)
    'driftline:meta:features-loaded'
    """
    return f"{prefix}:meta:{name}"


def encode_slots(slots: Mapping[str, Sequence[int]], dense: Mapping[str, float] | None = None) -> bytes:
    parts = [f"{k}={','.join(map(str, v))}" for k, v in slots.items()]
    parts += [f"{k}:{float(v)!r}" for k, v in (dense or {}).items()]
    return ";".join(parts).encode()


def decode_slots(raw: bytes | str) -> Slots:
    """The sparse slots of a stored value (its dense ``name:value`` parts are left out)."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    out: Slots = {}
    if not text:
        return out
    for part in text.split(";"):
        name, eq, ids = part.partition("=")
        if eq:
            out[name] = [int(i) for i in ids.split(",")] if ids else []
    return out


def decode_dense(raw: bytes | str) -> dict[str, float] | None:
    """The dense values of a stored value (None: it has none)."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    if ":" not in text:
        return None
    return {name: float(value) for name, colon, value in (p.partition(":") for p in text.split(";")) if colon}


def click_tag(request_id: str, item_id: int, action_type: str) -> bytes:
    """An action's identity among a user's recent clicks: its request, item and type (8 bytes).

    >>> click_tag("r1", 7, "click") == click_tag("r1", 7, "click") != click_tag("r1", 7, "like")
    True
    """
    return hashlib.blake2b(f"{request_id}\x1f{item_id}\x1f{action_type}".encode(), digest_size=8).digest()


class Click(NamedTuple):
    """A click to record: the user, the item, and the action's :func:`click_tag`."""

    user_id: int
    item_id: int
    tag: bytes


#: Push one user's clicks (oldest first) onto both lists, each unless its tag is among the user's
#: last K already; keep K of each. KEYS: the clicks list, its tags list; ARGV: K, then item id and
#: tag per click. Atomic per user, so a call that timed out after Redis ran it can be made again.
#: Errors are returned as they are (pcall), so the client sees Redis's own (OOM, READONLY,
#: WRONGTYPE: :func:`serving.redis_state.refuses_all_writes`), not a script failure; Redis refuses
#: a full store's write at the script's first write, before anything changed.
_RECORD_CLICKS = """
local function failed(r)  -- Redis 6 prefixes a script's errors with the line: strip it
  return type(r) == 'table' and r.err and redis.error_reply((string.gsub(r.err, '^@user_script:%s*%d+:%s*%-', '')))
end
local k = tonumber(ARGV[1])
local tags = redis.pcall('LRANGE', KEYS[2], 0, k - 1)
if failed(tags) then return failed(tags) end
local seen = {}
for _, tag in ipairs(tags) do seen[tag] = true end
for i = 2, #ARGV, 2 do
  local tag = ARGV[i + 1]
  if not seen[tag] then
    seen[tag] = true
    for j, value in ipairs({ARGV[i], tag}) do
      local r = redis.pcall('LPUSH', KEYS[j], value)
      if failed(r) then return failed(r) end
    end
  end
end
for j = 1, 2 do
  local r = redis.pcall('LTRIM', KEYS[j], 0, k - 1)
  if failed(r) then return failed(r) end
end
return 0
"""


@dataclass(frozen=True)
class RankFeatures:
    """What the store knows for one /rank request."""

    user: Slots | None          # None: user not in the store
    recent_items: list[int]
    items: list[Slots | None]   # None: item not in the store (shared: copy before changing)
    #: the raw stored value of each item (a cache key for what is derived from it)
    items_raw: list[bytes | None] | None = None
    #: the user's stored dense values (None: none)
    user_dense: dict[str, float] | None = None
    #: each item's stored dense values (None: no item of the request has any)
    items_dense: list[dict[str, float] | None] | None = None


class FeatureStoreError(RuntimeError):
    """Redis failed or timed out."""


async def _no_refresh() -> bool:
    """A single node has no slot map to re-read."""
    return False


class FeatureStore:
    """Async access to the feature store (one connection pool per process)."""

    def __init__(self, url: str, prefix: str = "driftline", recent_clicks: int = 20,
                 timeout_s: float = 1.0, max_connections: int = 100, wait_s: float | None = None,
                 client: RedisClientSettings | None = None) -> None:
        # Past max_connections a call waits for a free connection (up to wait_s, default
        # timeout_s) and then fails as one FeatureStoreError (services.redis_client.connect): a
        # /rank is never scored on defaults because the pool was momentarily full.
        try:
            self.redis = connect(url, client, timeout_s=timeout_s, max_connections=max_connections, wait_s=wait_s)
        except ValueError as err:  # a URL redis-py cannot read, or TLS files with a redis:// URL
            raise FeatureStoreError(f"REDIS_URL {redacted(url)}: {without_password(str(err), url)}") from err
        #: a Redis Cluster: a request's keys live on several nodes (see :meth:`_fetch_cluster`)
        self.cluster = isinstance(self.redis, RedisCluster)
        self._refresh = SlotMapRefresh(self.redis) if self.cluster else _no_refresh
        self.url = url
        self.prefix = prefix
        self.recent_clicks = recent_clicks
        #: raw item value -> decoded slots (item features change rarely; the key is the value)
        self._decoded: dict[bytes, Slots] = {}
        #: raw item value -> its dense values, for the values that have any
        self._dense: dict[bytes, dict[str, float]] = {}

    def user_key(self, user_id: int) -> str:
        return f"{self.prefix}:u:{user_id}"

    def item_key(self, item_id: int) -> str:
        return f"{self.prefix}:i:{item_id}"

    def clicks_key(self, user_id: int) -> str:
        return f"{self.prefix}:clicks:{user_id}"

    def click_tags_key(self, user_id: int) -> str:
        """The tags of the clicks in :meth:`clicks_key` (its name in braces: the same cluster slot)."""
        return f"{{{self.clicks_key(user_id)}}}:seen"

    async def close(self) -> None:
        await self.redis.aclose()

    def error(self, what: str, err: BaseException) -> FeatureStoreError:
        """One error for callers, naming the Redis without its password."""
        login = "Redis refused the login (the user and password in REDIS_URL): " \
            if isinstance(err, AuthenticationError) or isinstance(err.__cause__, AuthenticationError) else ""
        return FeatureStoreError(f"feature store {what} failed ({redacted(self.url)}): {login}"
                                 f"{without_password(str(err) or type(err).__name__, self.url)}")

    async def ping(self) -> bool:
        """Every master answers (a cluster's replicas are not asked: a dead one loses no key)."""
        try:
            if self.cluster:
                return bool(await self.redis.ping(target_nodes=RedisCluster.PRIMARIES))
            return bool(await self.redis.ping())
        except Exception:  # noqa: BLE001 - a ping that fails in any way means not ready
            return False

    async def fetch(self, user_id: int, item_ids: Sequence[int]) -> RankFeatures:
        """User, recent clicks and candidate features in one pipelined round trip."""
        started = time.perf_counter()
        item = f"{self.prefix}:i:"
        try:
            if self.cluster:
                values, clicks = await self._fetch_cluster(
                    [self.user_key(user_id), *map(item.__add__, map(str, item_ids))], self.clicks_key(user_id))
            else:
                packed = hiredis.pack_command(("MGET", self.user_key(user_id), *map(item.__add__, map(str, item_ids)))) + \
                    hiredis.pack_command(("LRANGE", self.clicks_key(user_id), 0, self.recent_clicks - 1))
                values, clicks = await self._round_trip(packed, 2)
        except Exception as err:
            metrics.FEATURE_STORE_ERRORS.labels("fetch").inc()
            raise self.error("fetch", err) from err
        finally:
            metrics.FEATURE_STORE_SECONDS.labels("fetch").observe(time.perf_counter() - started)
        user = decode_slots(values[0]) if values[0] is not None else None
        user_dense = decode_dense(values[0]) if values[0] is not None else None
        cache, dense = self._decoded, self._dense
        if len(cache) > 200_000:
            cache.clear()
            dense.clear()
        raws = values[1:]
        items: list[Slots | None] = list(map(cache.get, raws))  # one C-level pass; misses below
        if None in items:
            for i, v in enumerate(raws):
                if items[i] is None and v is not None:
                    items[i] = cache[v] = decode_slots(v)
                    if (d := decode_dense(v)) is not None:
                        dense[v] = d
        items_dense = list(map(dense.get, raws)) if dense else None  # a store without dense values: no pass
        recent = [int(c) for c in clicks] if self.recent_clicks else []  # (LRANGE 0 -1 is the whole list)
        return RankFeatures(user, recent, items, raws, user_dense, items_dense)

    async def _fetch_cluster(self, keys: list[str], clicks_key: str) -> tuple[list[Any], list[Any]]:
        """A cluster's :meth:`fetch`: the keys' slots differ (one MGET would be CROSSSLOT), so each
        is a GET, packed per node and sent to all masters at once: one round trip's wait, as on a
        single node (:mod:`serving.cluster_io`). After a failure (a node down, a slot moved by a
        failover) the slot map is re-read and the request tried once more; a node that still
        cannot answer fails the request, and only the requests that read its keys."""
        commands: list[tuple[Any, ...]] = [("GET", key) for key in keys]
        commands.append(("LRANGE", clicks_key, 0, self.recent_clicks - 1))
        for last in (False, True):
            try:
                replies = await send_by_node(self.redis, commands)
                if refused := next((r for r in replies if isinstance(r, ResponseError)), None):
                    raise refused
                return replies[:-1], replies[-1]
            except (RedisError, RedisClusterException, OSError):
                if last or not await self._refresh():
                    raise
        raise AssertionError("unreachable")

    async def _round_trip(self, packed: bytes, replies: int) -> list[Any]:
        """Send ``packed`` (``replies`` commands) on one pooled connection and read the replies.

        What ``redis.pipeline(transaction=False).execute()`` does for a /rank's MGET + LRANGE, at
        about a third of its CPU (120 vs 350 us: no command objects, no per-argument encoding in
        Python; hiredis packs in C), with the connection's retry policy as the pipeline's. A
        connection that failed or was cancelled mid-way is disconnected, never reused with a
        reply left unread."""
        pool = self.redis.connection_pool
        conn = await pool.get_connection()

        async def send() -> list[Any]:
            await conn.send_packed_command(packed)
            return [await conn.read_response() for _ in range(replies)]

        async def failed(_err: BaseException) -> None:
            await conn.disconnect()

        try:
            return await conn.retry.call_with_retry(send, failed)
        except BaseException:
            await conn.disconnect()
            raise
        finally:
            await pool.release(conn)

    async def record_clicks(self, clicks: Sequence[Click]) -> list[tuple[int, Exception]]:
        """Push clicks, oldest first, keeping the last K per user; a click whose tag is among its
        user's last K already is not pushed again. Its reader reads ``actions`` at least once (what
        it recorded before a crash comes again), a client retries an ``/actions`` whose 503 hid a
        late write, and a call that timed out may have been carried out: none of them repeats an
        item in ``recent_items``. (One a user's K newer clicks have pushed out is recorded again.)

        Returns the clicks Redis refused, as (index, error): a user's key holding another type,
        say, or Redis taking no writes for now (:func:`serving.redis_state.refuses_all_writes`: the caller tries those
        again). Raises :class:`FeatureStoreError` when Redis cannot be reached (nothing to blame
        on the clicks: retry).
        """
        if not clicks or self.recent_clicks == 0:
            return []
        started = time.perf_counter()
        by_user: dict[int, list[int]] = {}
        for i, click in enumerate(clicks):
            by_user.setdefault(click.user_id, []).append(i)
        try:
            pipe = self.redis.pipeline(transaction=False)
            for user_id, indices in by_user.items():
                args: list[Any] = [self.recent_clicks]
                for i in indices:
                    args += [clicks[i].item_id, clicks[i].tag]
                pipe.eval(_RECORD_CLICKS, 2, self.clicks_key(user_id), self.click_tags_key(user_id), *args)
            results = await pipe.execute(raise_on_error=False)
        except Exception as err:
            metrics.FEATURE_STORE_ERRORS.labels("record_clicks").inc()
            await self._refresh()  # a cluster's node down: the next try finds its replica
            raise self.error("update", err) from err
        finally:
            metrics.FEATURE_STORE_SECONDS.labels("record_clicks").observe(time.perf_counter() - started)
        refused = sorted(((i, r) for indices, r in zip(by_user.values(), results, strict=True)
                          if isinstance(r, Exception) for i in indices), key=lambda refusal: refusal[0])
        if refused:
            metrics.FEATURE_STORE_ERRORS.labels("record_clicks").inc()
        return refused

    def marker_key(self, name: str) -> str:
        return marker_key(self.prefix, name)

    async def get_marker(self, name: str) -> str | None:
        """A small named value kept beside the features (e.g. the broker epoch they were read in)."""
        try:
            raw = await self.redis.get(self.marker_key(name))
        except Exception as err:
            await self._refresh()
            raise self.error("read", err) from err
        return raw.decode() if raw is not None else None

    async def set_marker(self, name: str, value: str) -> None:
        try:
            await self.redis.set(self.marker_key(name), value)
        except Exception as err:
            await self._refresh()
            raise self.error("update", err) from err

    async def server_time(self) -> float:
        """Redis's clock (``TIME``; one node's in a Redis Cluster), in seconds. Raises
        :class:`FeatureStoreError` when Redis cannot be reached."""
        try:
            got = await self.redis.time()
        except Exception as err:
            await self._refresh()
            raise self.error("read", err) from err
        sec, usec = next(iter(got.values())) if isinstance(got, dict) else got
        return int(sec) + int(usec) / 1e6

    async def evictions(self) -> Evictions | None:
        """What Redis says of evicting keys (None: its ACL denies this login ``INFO``). Raises
        :class:`FeatureStoreError` when Redis cannot be reached."""
        try:
            if self.cluster:
                by_node = await self.redis.info(target_nodes=RedisCluster.PRIMARIES)
                infos = list(by_node.values()) if "run_id" not in by_node else [by_node]
            else:
                infos = [await self.redis.info()]
        except NoPermissionError:
            return None
        except Exception as err:
            await self._refresh()
            raise self.error("read", err) from err
        return Evictions.of(infos)

    async def put(self, users: Mapping[int, Slots], items: Mapping[int, Slots], batch: int = 10_000, *,
                  users_dense: Mapping[int, Mapping[str, float]] | None = None,
                  items_dense: Mapping[int, Mapping[str, float]] | None = None) -> int:
        """Write user and item features (pipelined MSETs of ``batch`` keys), then the load marker
        (:data:`LOADED_MARKER`: the number of keys, the time, and Redis's evictions before the load:
        :class:`Evictions`); return keys written. ``*_dense``:
        the dense values of some of the same keys. In a cluster, one SET per key in one pipeline
        (redis-py's splits it by node). Raises :class:`FeatureStoreError` when Redis cannot take
        them (unreachable, refused the login)."""
        ud, id_ = users_dense or {}, items_dense or {}
        pairs = [(self.user_key(u), encode_slots(s, ud.get(u))) for u, s in users.items()]
        pairs += [(self.item_key(i), encode_slots(s, id_.get(i))) for i, s in items.items()]
        pipe = self.redis.pipeline(transaction=False)
        if self.cluster:  # keys of other slots: one MSET would be CROSSSLOT
            for key, value in pairs:
                pipe.set(key, value)
        else:
            for start in range(0, len(pairs), batch):
                pipe.mset(dict(pairs[start:start + batch]))
        try:
            before = await self.evictions()  # (keys the load itself evicts count as evicted since it)
        except FeatureStoreError as err:
            raise self.error("load", err.__cause__ or err) from err.__cause__
        stamp = f"; {before.stamp()}" if before is not None else ""
        pipe.set(self.marker_key(LOADED_MARKER), f"{len(pairs)} keys at {int(time.time() * 1000)}{stamp}")
        try:
            await pipe.execute()
        except (RedisError, RedisClusterException, OSError) as err:
            raise self.error("load", err) from err
        return len(pairs)
