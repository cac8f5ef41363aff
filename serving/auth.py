"""API keys on the serving API: :class:`ApiKeys`, the FastAPI dependency of every endpoint that
asks for one (``/rank``, ``/actions``; ``/metrics`` and the docs when ``serving.protect_metrics``
/ ``serving.protect_docs`` say so; ``/healthz``, ``/readyz`` and ``/ping`` never).

A request sends its key as ``Authorization: Bearer <key>`` or ``X-API-Key: <key>``. None sent is a
401, one that is not configured a 403, each with the reason in the app's error body
(``{"message": ..., "detail": ...}``), and ``driftline_serving_auth_total{outcome}`` counts
``ok``, ``missing``, ``wrong``, and ``anonymous`` (no key configured: every request passes).
The key is compared as its SHA-256 against every configured key's with ``hmac.compare_digest``,
all of them every time: neither the time taken nor an early exit tells which key, or which part
of one, came close; the digests have one length, so neither does a key's length. No key is ever
logged.

Rotation: ``serving.api_keys`` holds several keys at once (read at start: a change takes a
restart, rolling over the replicas); ``serving.api_keys_file`` is looked at again at most every
:data:`FILE_CHECK_S` seconds and re-read when it changed (a Kubernetes secret's update swaps the
file under the same name), so adding the new key, moving the clients to it and removing the old
one needs no restart. A file that turns unreadable or empty keeps the keys read before (logged):
a broken secret mount must not open serving, nor lock everyone out.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.openapi.models import HTTPBearer as HTTPBearerModel
from fastapi.responses import JSONResponse, Response
from fastapi.security.base import SecurityBase

from services.api_keys import API_KEY_HEADER, ApiKeyError, configured_keys, keys_required, listed_keys, read_key_file
from services.settings import ServingSettings
from serving.metrics import AUTH

log = logging.getLogger(__name__)

#: seconds between looks at ``serving.api_keys_file`` (a stat; re-read only when it changed)
FILE_CHECK_S = 1.0

MISSING = f"no API key: send `Authorization: Bearer <key>` or `{API_KEY_HEADER}: <key>`"
WRONG = "wrong API key"
#: driftline_serving_auth_total's children, made at import: every outcome is on /metrics from the start (at 0)
_COUNTED = {outcome: AUTH.labels(outcome) for outcome in ("ok", "missing", "wrong", "anonymous")}
#: what the OpenAPI schema says of the endpoints that ask for a key
RESPONSES: dict[int | str, dict] = {401: {"description": "No API key sent (when serving.api_keys is set)"},
                                    403: {"description": "Not one of serving's API keys"}}


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _stamp(path: os.PathLike) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


def _presented(request: Request) -> str | None:
    """The key the request sends: ``Authorization: Bearer <key>``, else ``X-API-Key: <key>``."""
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and credentials.strip():
        return credentials.strip()
    return request.headers.get(API_KEY_HEADER) or None


class ApiKeys(SecurityBase):
    """The keys one replica accepts, and the dependency that checks a request's (``Depends(keys)``).

    A security scheme to FastAPI (the OpenAPI schema lists it; ``/docs`` offers "Authorize"), read
    from the headers in one dependency: FastAPI's HTTPBearer and APIKeyHeader as two sub-dependencies
    cost ~50 us more CPU per request."""

    def __init__(self, options: ServingSettings) -> None:
        self.model = HTTPBearerModel(description=f"one of serving.api_keys, as `Authorization: Bearer <key>` "
                                                 f"or `{API_KEY_HEADER}: <key>`")
        self.scheme_name = "ApiKey"
        self.required = keys_required(options)
        self._file = options.api_keys_file
        self._listed = listed_keys(options)
        self._stamp = _stamp(self._file) if self._file is not None else None
        self._digests = tuple(_digest(k) for k in configured_keys(options))  # an unreadable file: ApiKeyError
        self._next_check = time.monotonic() + FILE_CHECK_S

    def _reload(self) -> None:
        """Re-read the key file if it changed since it was last read."""
        assert self._file is not None
        self._next_check = time.monotonic() + FILE_CHECK_S
        stamp = _stamp(self._file)
        if stamp == self._stamp:
            return
        self._stamp = stamp  # warned once per change, not every check
        try:
            keys = self._listed + read_key_file(self._file)
        except ApiKeyError as err:
            log.warning("%s: keeping the %d keys read before", err, len(self._digests))
            return
        self._digests = tuple(_digest(k) for k in dict.fromkeys(keys))
        log.info("serving.api_keys_file %s re-read: %d keys accepted", self._file, len(self._digests))

    def accepts(self, key: str) -> bool:
        """Whether ``key`` is one of the configured keys, in time that does not depend on which."""
        if self._file is not None and time.monotonic() >= self._next_check:
            self._reload()
        given = _digest(key)
        found = False
        for digest in self._digests:  # every one, no early exit
            found |= hmac.compare_digest(given, digest)
        return found

    async def __call__(self, request: Request) -> None:
        if not self.required:
            _COUNTED["anonymous"].inc()
            return
        key = _presented(request)
        if not key:
            _COUNTED["missing"].inc()
            raise HTTPException(401, MISSING, headers={"WWW-Authenticate": "Bearer"})
        if not self.accepts(key):
            _COUNTED["wrong"].inc()
            raise HTTPException(403, WRONG)
        _COUNTED["ok"].inc()


def protected_docs(app: FastAPI, protected: list) -> APIRouter:
    """``/openapi.json``, ``/docs`` and ``/redoc`` behind the API key (FastAPI's own pages, served
    by routes that take dependencies). A browser does not send the key: a proxy or a tool that
    adds the header reads them."""
    from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html

    docs = APIRouter(dependencies=protected, include_in_schema=False)

    @docs.get("/openapi.json")
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @docs.get("/docs")
    async def swagger() -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - Swagger UI")

    @docs.get("/redoc")
    async def redoc() -> Response:
        return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc")

    return docs
