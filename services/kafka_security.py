"""How every Kafka client of driftline connects: ``settings.kafka``'s security settings turned
into client options, in one place.

:func:`security_options` is the aiokafka keyword arguments (``security_protocol``, an
``ssl_context`` for TLS, the ``sasl_*`` credentials); every ``AIOKafkaProducer``,
``AIOKafkaConsumer`` and ``AIOKafkaAdminClient`` the project makes takes ``**security_options(settings)``
(tests/test_kafka_security.py walks the code for any that does not). :func:`faust_credentials` is the
same for the Faust joiner, whose own clients take Faust's credential objects.

>>> from services.settings import KafkaClientSettings, Settings
>>> security_options(Settings())
{'security_protocol': 'PLAINTEXT'}
>>> s = Settings(kafka=KafkaClientSettings(security_protocol="SASL_PLAINTEXT", sasl_mechanism="SCRAM-SHA-512",
...                                        sasl_username="driftline", sasl_password="not-printed"))
>>> options = security_options(s)
>>> options["security_protocol"], options["sasl_mechanism"], options["sasl_plain_username"]
('SASL_PLAINTEXT', 'SCRAM-SHA-512', 'driftline')
>>> faust_credentials(s)
<SASLCredentials: username=driftline>
"""

from __future__ import annotations

import ssl
from typing import TYPE_CHECKING, Any

from aiokafka.helpers import create_ssl_context

from services.settings import Settings

if TYPE_CHECKING:
    from faust.auth import Credentials


class KafkaSecurityError(RuntimeError):
    """The TLS files of ``settings.kafka`` cannot be loaded. The message says which (no secret)."""


def ssl_context(settings: Settings) -> ssl.SSLContext | None:
    """The TLS context of ``kafka.security_protocol`` SSL or SASL_SSL (None without TLS): the
    broker's certificate checked against ``kafka.ssl_cafile`` (else the system's CAs) and its host
    name, and the client certificate of ``kafka.ssl_certfile`` if one is set."""
    k = settings.kafka
    if not k.security_protocol.endswith("SSL"):
        return None
    try:
        context: ssl.SSLContext = create_ssl_context(
            cafile=str(k.ssl_cafile) if k.ssl_cafile else None,
            certfile=str(k.ssl_certfile) if k.ssl_certfile else None,
            keyfile=str(k.ssl_keyfile) if k.ssl_keyfile else None,
            # ("" rather than None: OpenSSL would prompt on the terminal for an encrypted key's password)
            password=k.ssl_key_password.get_secret_value() if k.ssl_key_password else "",
        )
        return context
    except (ssl.SSLError, OSError) as err:
        files = {n: getattr(k, n) for n in ("ssl_cafile", "ssl_certfile", "ssl_keyfile") if getattr(k, n)}
        raise KafkaSecurityError(
            f"kafka TLS settings {', '.join(f'{n}={v}' for n, v in files.items()) or '(system CAs)'}: "
            f"cannot load them ({err}): PEM files expected; an encrypted key needs kafka.ssl_key_password") from None


def security_options(settings: Settings) -> dict[str, Any]:
    """aiokafka's connection-security keyword arguments for ``settings.kafka``."""
    k = settings.kafka
    options: dict[str, Any] = {"security_protocol": k.security_protocol}
    context = ssl_context(settings)
    if context is not None:
        options["ssl_context"] = context
    if k.security_protocol.startswith("SASL_"):
        options.update(sasl_mechanism=k.sasl_mechanism, sasl_plain_username=k.sasl_username,
                       sasl_plain_password=k.sasl_password_value())
    return options


def faust_credentials(settings: Settings) -> Credentials | None:
    """:func:`security_options` as Faust's ``broker_credentials`` (None: plaintext)."""
    from faust.auth import SASLCredentials, SSLCredentials

    options = security_options(settings)
    protocol = options["security_protocol"]
    if protocol == "SSL":
        return SSLCredentials(options["ssl_context"])
    if protocol.startswith("SASL_"):
        # (with an ssl_context Faust's SASLCredentials is SASL_SSL, without one SASL_PLAINTEXT)
        return SASLCredentials(username=options["sasl_plain_username"], password=options["sasl_plain_password"],
                               mechanism=options["sasl_mechanism"], ssl_context=options.get("ssl_context"))
    return None
