"""``POST /rank`` and ``POST /actions`` from plain values: :class:`RankClient` (sync) and
:class:`AsyncRankClient` (asyncio), both on one keep-alive :mod:`httpx` connection pool.

Serving takes int64 ids only; the client hashes string items, users and feature values
(:mod:`driftline.client.features`) and maps the ranked ids back to the values the caller gave.
Input the project's features do not allow is refused locally (:class:`InvalidInput`) before any
network call. A 4xx from serving (a feature the *served* model does not know, an event time out of
range...) is a :class:`Rejected` carrying serving's message; 5xx and a broken connection are
retried ``retries`` times with back-off (a serving restart, a full feature-log spool), then a
:class:`ServingError`. Every request carries the API key serving asks for (``api_key``, else the
settings' first key: :mod:`services.api_keys`); a missing or wrong one is a :class:`Rejected` (401, 403).

The request bodies are built and the answers read by :class:`Requests`, without a network:

>>> from driftline.project import FeatureSpec
>>> req = Requests(FeatureEncoder([FeatureSpec(name="pos", source="candidate")]))
>>> body, items = req.rank_body(["a", {"item_id": 7, "features": {"pos": 1}}], user_id=3)
>>> body["user_id"], body["candidates"][1], items[7]
(3, {'item_id': 7, 'features': {'sparse': {'pos': [1]}, 'dense': {}}}, 7)
>>> answer = {"request_id": "r1", "user_known": False, "model_version": {},
...           "items": [{"item_id": 7, "score": 0.5, "raw_score": 0.4}]}
>>> ranking = req.ranking(answer, items)
>>> ranking.request_id, ranking.items[0].item, ranking.pairs()
('r1', 7, [(7, 0.5)])
>>> req.rank_body([])
Traceback (most recent call last):
...
driftline.client.features.InvalidInput: candidates: at least one is needed
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from driftline.client.features import FeatureEncoder, InvalidInput, WrongValue, item_id_of
from driftline.project import FeatureSpec

__all__ = ["AsyncRankClient", "RankClient", "Ranking", "Rejected", "Requests", "ScoredItem", "ServingError"]

#: the schema's cap on actions per /actions call (``serving.schemas.ActionsRequest``)
ACTIONS_PER_CALL = 1000
_BACKOFF_CAP_S = 4.0
_READY_POLL_S = 0.25

Item = str | int


class ServingError(RuntimeError):
    """Serving answered an error (or could not be reached): ``status`` (0: no answer) and its ``message``."""

    def __init__(self, status: int, message: str, endpoint: str) -> None:
        super().__init__(f"{endpoint}: HTTP {status}: {message}" if status else f"{endpoint}: {message}")
        self.status = status
        self.message = message
        self.endpoint = endpoint


class Rejected(ServingError):
    """A 4xx: serving refused the request as it is (retrying would not help); ``message`` says why."""


@dataclass(frozen=True, slots=True)
class ScoredItem:
    item: Item  # as the caller gave it
    item_id: int  # as serving scored it
    score: float  # calibrated probability
    raw_score: float


@dataclass(frozen=True, slots=True)
class Ranking:
    """``/rank``'s answer: the request id (send actions with it) and the items, best first."""

    request_id: str
    items: list[ScoredItem]
    user_known: bool
    model_version: dict

    def pairs(self) -> list[tuple[Item, float]]:
        return [(s.item, s.score) for s in self.items]


def _at_least(low: int, value: Any, what: str) -> int:
    """``value`` if it is an int of at least ``low``; :class:`WrongValue` saying ``what`` it is."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise WrongValue(f"{what}, {low} or more, got {value!r}")
    return value


def _candidate(value: Any) -> tuple[Item, Mapping[str, Any] | None]:
    if isinstance(value, Mapping):
        if "item_id" not in value:
            raise InvalidInput(f"candidate {dict(value)!r} has no item_id")
        return value["item_id"], value.get("features")
    return value, None


class Requests:
    """Builds ``/rank`` and ``/actions`` bodies from plain values and reads the answers (no I/O)."""

    def __init__(self, encoder: FeatureEncoder) -> None:
        self.encoder = encoder

    def rank_body(self, candidates: Sequence[Any], user_id: Item | None = None,
                  context: Mapping[str, Any] | None = None, request_id: str | None = None,
                  event_time_ms: int | None = None, log: bool = True,
                  first_position: int = 0, shown: int | None = None) -> tuple[dict, dict[int, Item]]:
        """The JSON body and id -> the caller's item. ``candidates``: items (str or int) or dicts
        ``{"item_id": ..., "features": {...}}``. ``log=False``: score only (no feature log).
        ``first_position``: where the answer's first item is shown (a later page: 20, 40...);
        ``shown``: how many of the answer's first items are shown (only they are impressions)."""
        if not candidates:
            raise InvalidInput("candidates: at least one is needed")
        _at_least(0, first_position, "first_position: the place the answer's first item is shown at")
        sparse, dense = self.encoder.context(context)
        body: dict[str, Any] = {"candidates": []}
        if sparse or dense:
            body["context"] = {"sparse": sparse, "dense": dense}
        items: dict[int, Item] = {}
        for i, value in enumerate(candidates):
            item, features = _candidate(value)
            item_id = item_id_of(item)
            items[item_id] = item
            c_sparse, c_dense = self.encoder.candidate(features, i)
            c: dict[str, Any] = {"item_id": item_id}
            if c_sparse or c_dense:
                c["features"] = {"sparse": c_sparse, "dense": c_dense}
            body["candidates"].append(c)
        if user_id is not None:
            body["user_id"] = item_id_of(user_id)
        if request_id is not None:
            body["request_id"] = request_id
        if event_time_ms is not None:
            body["event_time_ms"] = int(event_time_ms)
        if not log:
            body["log"] = False
        if first_position:
            body["first_position"] = first_position
        if shown is not None:
            body["shown"] = _at_least(1, shown, "shown: how many of the answer's first items are shown")
        return body, items

    @staticmethod
    def ranking(answer: dict, items: Mapping[int, Item]) -> Ranking:
        return Ranking(answer["request_id"],
                       [ScoredItem(items.get(s["item_id"], s["item_id"]), s["item_id"], s["score"], s["raw_score"])
                        for s in answer["items"]],
                       answer["user_known"], answer["model_version"])

    def action_bodies(self, actions: Iterable[Mapping[str, Any]]) -> list[dict]:
        """``/actions`` bodies (at most :data:`ACTIONS_PER_CALL` each) from dicts with
        ``request_id``, ``item_id``, ``action_type`` and optionally ``user_id`` (the user's recent
        clicks, the ``recent_items`` feature, hold only clicks that name their user), ``event_time_ms``."""
        out = []
        for i, a in enumerate(actions):
            where = f"actions[{i}]"
            try:
                action = {"request_id": str(a["request_id"]), "item_id": item_id_of(a["item_id"]),
                          "action_type": self.encoder.action_type(a["action_type"], where)}
            except KeyError as err:
                raise InvalidInput(f"{where}: {err.args[0]!r} missing") from None
            if a.get("user_id") is not None:
                action["user_id"] = item_id_of(a["user_id"])
            if a.get("event_time_ms") is not None:
                action["event_time_ms"] = int(a["event_time_ms"])
            out.append(action)
        if not out:
            raise InvalidInput("actions: at least one is needed")
        return [{"actions": out[i:i + ACTIONS_PER_CALL]} for i in range(0, len(out), ACTIONS_PER_CALL)]


def _error(endpoint: str, r: httpx.Response) -> ServingError:
    try:
        message = str(r.json().get("message", r.text))
    except ValueError:
        message = r.text[:500]
    return (Rejected if 400 <= r.status_code < 500 else ServingError)(r.status_code, message, endpoint)


def _base_url(url: str | None) -> str:
    if url is not None:
        return url
    from services.settings import get_settings

    s = get_settings().serving
    return f"http://{s.host}:{s.port}"


def _auth_headers(api_key: str | None) -> dict[str, str]:
    """``Authorization: Bearer <api_key>``; without one, the first key of the settings
    (``serving.api_keys``, else ``serving.api_keys_file``), or none when no key is set."""
    if api_key is not None:
        return {"Authorization": f"Bearer {api_key}"}
    from services.api_keys import client_headers
    from services.settings import get_settings

    return client_headers(get_settings().serving)


class _Base:
    def __init__(self, features: Sequence[FeatureSpec], action_types: Iterable[str] | None, url: str | None,
                 retries: int, api_key: str | None) -> None:
        self.requests = Requests(FeatureEncoder(features, action_types))
        self.url = _base_url(url)
        self.retries = retries
        self.headers = _auth_headers(api_key)

    def _settled(self, endpoint: str, attempt: int, outcome: httpx.Response | Exception) -> dict | None:
        """A call's answer (a 2xx's body), None to retry after :meth:`_pause`, or the error raised
        (a rejection at once; anything else once the retries are spent)."""
        if isinstance(outcome, httpx.Response):
            if outcome.status_code < 300:
                answer: dict = outcome.json()
                return answer
            err = _error(endpoint, outcome)
            if isinstance(err, Rejected) or attempt >= self.retries:
                raise err
        elif attempt >= self.retries:
            raise ServingError(0, f"{type(outcome).__name__}: {outcome}", endpoint)
        return None

    def _ready(self, outcome: httpx.Response | Exception, deadline: float, timeout_s: float) -> dict | None:
        """``/readyz``'s body once serving has a model; None to ask again; past the deadline an error
        naming the last answer."""
        if isinstance(outcome, httpx.Response) and outcome.status_code == 200:
            body: dict = outcome.json()
            return body
        if time.monotonic() <= deadline:
            return None
        last = f"HTTP {outcome.status_code}" if isinstance(outcome, httpx.Response) else type(outcome).__name__
        raise ServingError(503, f"serving at {self.url} not ready after {timeout_s:.0f} s ({last})", "/readyz")

    @staticmethod
    def _pause(attempt: int) -> float:
        return min(0.25 * 2**attempt, _BACKOFF_CAP_S)

    @classmethod
    def _project(cls, path: str) -> tuple[Sequence[FeatureSpec], Iterable[str]]:
        from driftline.project import load_project

        project = load_project(path)
        return project.features, project.labels.keys()


class RankClient(_Base):
    """Blocking client: ``rank(...)`` and ``actions(...)``; use as a context manager or ``close()``."""

    def __init__(self, features: Sequence[FeatureSpec], url: str | None = None, *, action_types: Iterable[str] | None = None,
                 timeout_s: float = 30.0, retries: int = 0, api_key: str | None = None) -> None:
        """``features``: the project's FeatureSpecs; ``url``: serving (None: settings' host and port);
        ``api_key``: the key serving asks for (None: the settings' first, if any)."""
        super().__init__(features, action_types, url, retries, api_key)
        self.http = httpx.Client(base_url=self.url, timeout=timeout_s, headers=self.headers)

    @classmethod
    def from_project(cls, path: str, url: str | None = None, **options: Any) -> RankClient:
        features, action_types = cls._project(path)
        return cls(features, url, action_types=action_types, **options)

    def _post(self, endpoint: str, body: dict) -> dict:
        for attempt in range(self.retries + 1):
            try:
                outcome: httpx.Response | Exception = self.http.post(endpoint, json=body)
            except httpx.TransportError as err:
                outcome = err
            if (answer := self._settled(endpoint, attempt, outcome)) is not None:
                return answer
            time.sleep(self._pause(attempt))
        raise AssertionError("unreachable")

    def wait_ready(self, timeout_s: float = 60.0) -> dict:
        """Poll ``/readyz`` until serving has a model (its body), or :class:`ServingError` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                outcome: httpx.Response | Exception = self.http.get("/readyz")
            except httpx.TransportError as err:
                outcome = err
            if (body := self._ready(outcome, deadline, timeout_s)) is not None:
                return body
            time.sleep(_READY_POLL_S)

    def rank(self, user_id: Item | None = None, candidates: Sequence[Any] = (), context: Mapping[str, Any] | None = None,
             request_id: str | None = None, event_time_ms: int | None = None, log: bool = True,
             first_position: int = 0, shown: int | None = None) -> Ranking:
        """``log=False``: score only; nothing is trained on it and no action can join it.
        ``first_position``: where the answer's first item is shown (a position feature's places);
        ``shown``: how many of the answer's first items are shown (only they are learned from)."""
        body, items = self.requests.rank_body(candidates, user_id, context, request_id, event_time_ms, log,
                                              first_position, shown)
        return self.requests.ranking(self._post("/rank", body), items)

    def actions(self, actions: Iterable[Mapping[str, Any]]) -> int:
        """Send actions; returns how many serving accepted (written to the actions topic)."""
        return sum(self._post("/actions", body)["accepted"] for body in self.requests.action_bodies(actions))

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> RankClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncRankClient(_Base):
    """The asyncio twin of :class:`RankClient` (``await client.rank(...)``, ``async with``)."""

    def __init__(self, features: Sequence[FeatureSpec], url: str | None = None, *, action_types: Iterable[str] | None = None,
                 timeout_s: float = 30.0, retries: int = 0, max_connections: int = 16,
                 api_key: str | None = None) -> None:
        super().__init__(features, action_types, url, retries, api_key)
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self.http = httpx.AsyncClient(base_url=self.url, timeout=timeout_s, limits=limits, headers=self.headers)

    @classmethod
    def from_project(cls, path: str, url: str | None = None, **options: Any) -> AsyncRankClient:
        features, action_types = cls._project(path)
        return cls(features, url, action_types=action_types, **options)

    async def _post(self, endpoint: str, body: dict) -> dict:
        for attempt in range(self.retries + 1):
            try:
                outcome: httpx.Response | Exception = await self.http.post(endpoint, json=body)
            except httpx.TransportError as err:
                outcome = err
            if (answer := self._settled(endpoint, attempt, outcome)) is not None:
                return answer
            await asyncio.sleep(self._pause(attempt))
        raise AssertionError("unreachable")

    async def wait_ready(self, timeout_s: float = 60.0) -> dict:
        """Poll ``/readyz`` until serving has a model (its body), or :class:`ServingError` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                outcome: httpx.Response | Exception = await self.http.get("/readyz")
            except httpx.TransportError as err:
                outcome = err
            if (body := self._ready(outcome, deadline, timeout_s)) is not None:
                return body
            await asyncio.sleep(_READY_POLL_S)

    async def rank(self, user_id: Item | None = None, candidates: Sequence[Any] = (),
                   context: Mapping[str, Any] | None = None, request_id: str | None = None,
                   event_time_ms: int | None = None, log: bool = True, first_position: int = 0,
                   shown: int | None = None) -> Ranking:
        body, items = self.requests.rank_body(candidates, user_id, context, request_id, event_time_ms, log,
                                              first_position, shown)
        return self.requests.ranking(await self._post("/rank", body), items)

    async def actions(self, actions: Iterable[Mapping[str, Any]]) -> int:
        return sum([(await self._post("/actions", body))["accepted"] for body in self.requests.action_bodies(actions)])

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncRankClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
