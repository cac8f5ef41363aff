"""Serving's API keys as configured: the keys a replica accepts, the header its clients send,
and whether serving may start without any.

Keys come from ``serving.api_keys`` and ``serving.api_keys_file`` (one key per line, the form of a
Docker or Kubernetes secret; surrounding whitespace and blank lines are ignored); both may be set
and every key of both is accepted. A client (the Python client, the traffic driver, the status
page, the benches) sends the first: the list's, else the file's. The check itself is
:mod:`serving.auth`; this module imports nothing heavy (no FastAPI, no prometheus_client), so a
client, and serving before its metrics are set up, can read the keys.

>>> from services.settings import ServingSettings
>>> options = ServingSettings(api_keys=["new", "old"])
>>> configured_keys(options), client_headers(options)
(('new', 'old'), {'Authorization': 'Bearer new'})
>>> client_headers(ServingSettings())
{}
>>> keys_in("k1\\n\\n  k2  \\n")
('k1', 'k2')
>>> keys_in("two words")
Traceback (most recent call last):
...
services.api_keys.ApiKeyError: an API key must be printable ASCII without spaces (line 1)
>>> startup_refusal(ServingSettings(host="127.0.0.1")) is None
True
>>> print(startup_refusal(ServingSettings(host="0.0.0.0")))
serving.host is 0.0.0.0 (not loopback) and no API key is set: set DRIFTLINE_SERVING__API_KEYS='["<key>"]' or DRIFTLINE_SERVING__API_KEYS_FILE=<file>, or DRIFTLINE_SERVING__ALLOW_ANONYMOUS=true to serve without keys
>>> startup_refusal(ServingSettings(host="0.0.0.0", api_keys=["k"])) is None
True
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from pydantic import SecretStr

from services.settings import ServingSettings

#: the request header of the alternative to ``Authorization: Bearer <key>``
API_KEY_HEADER = "X-API-Key"


class ApiKeyError(ValueError):
    """A key file that cannot be read or holds no key, or a key no HTTP header can carry."""


def _checked(key: str, where: str) -> str:
    if not key or not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
        raise ApiKeyError(f"an API key must be printable ASCII without spaces ({where})")
    return key


def keys_in(text: str) -> tuple[str, ...]:
    """The keys of a key file's text: one per line, blank lines skipped."""
    return tuple(_checked(line.strip(), f"line {n}") for n, line in enumerate(text.splitlines(), 1) if line.strip())


def read_key_file(path: Path) -> tuple[str, ...]:
    """The keys in ``path``; :class:`ApiKeyError` (one line, no key in it) when it cannot be read
    or holds none."""
    try:
        keys = keys_in(path.read_text())
    except OSError as err:
        raise ApiKeyError(f"serving.api_keys_file {path}: {err.strerror or err}") from None
    except ApiKeyError as err:
        raise ApiKeyError(f"serving.api_keys_file {path}: {err}") from None
    if not keys:
        raise ApiKeyError(f"serving.api_keys_file {path} holds no key")
    return keys


def listed_keys(options: ServingSettings) -> tuple[str, ...]:
    """``serving.api_keys`` as plain strings (a copy made by ``Settings.updated`` holds them unwrapped)."""
    return tuple(_checked(k.get_secret_value() if isinstance(k, SecretStr) else str(k), "serving.api_keys")
                 for k in options.api_keys)


def configured_keys(options: ServingSettings) -> tuple[str, ...]:
    """Every key serving accepts now: the listed ones, then the file's (each once)."""
    keys = listed_keys(options)
    if options.api_keys_file is not None:
        keys += read_key_file(options.api_keys_file)
    return tuple(dict.fromkeys(keys))


def keys_required(options: ServingSettings) -> bool:
    """Whether serving asks for a key: some are listed, or a key file is named (even one that
    cannot be read: that refuses requests, it does not open serving)."""
    return bool(options.api_keys) or options.api_keys_file is not None


def client_headers(options: ServingSettings) -> dict[str, str]:
    """The header a client of serving sends: ``Authorization: Bearer <first key>``, or none when
    no key is configured."""
    if not keys_required(options):
        return {}
    return {"Authorization": f"Bearer {configured_keys(options)[0]}"}


def is_loopback(host: str) -> bool:
    """Whether ``host`` (serving's bind address) is reachable from this machine alone.

    >>> [is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "127.0.0.2", "0.0.0.0", "", "10.0.0.1")]
    [True, True, True, True, False, False, False]
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost: it may resolve to anything
        return False


def startup_refusal(options: ServingSettings) -> str | None:
    """The one line serving exits with instead of starting (None: it may start): a key file that
    cannot be read, or a non-loopback host with no key unless ``serving.allow_anonymous``."""
    try:
        configured_keys(options)
    except ApiKeyError as err:
        return str(err)
    if keys_required(options) or options.allow_anonymous or is_loopback(options.host):
        return None
    return (f"serving.host is {options.host or '(all addresses)'} (not loopback) and no API key is set: set "
            "DRIFTLINE_SERVING__API_KEYS='[\"<key>\"]' or DRIFTLINE_SERVING__API_KEYS_FILE=<file>, "
            "or DRIFTLINE_SERVING__ALLOW_ANONYMOUS=true to serve without keys")
