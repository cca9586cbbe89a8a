"""Spark-style `kafka.*` options → kafka-python client settings, from a closed list.

A closed list, because a JVM-only setting (say kafka.sasl.jaas.config) silently dropped
would connect with weaker security than the job asked for.

TLS material comes as files (`kafka.ssl.cafile`, ...) or inline as PEM text
(`kafka.ssl.cadata`, ...): the tasks that connect run on executors, which have none of
the driver's files, so the driver passes the text and each client builds its TLS context
from it where it runs (`client_kwargs`).
"""

from __future__ import annotations

import os
import socket
import ssl
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

# What consumers and producers both take: where the cluster is and how to log in to it.
CONNECTION_OPTIONS: dict[str, type] = {
    "bootstrap.servers": str,
    "client.id": str,
    "security.protocol": str,
    "sasl.mechanism": str,
    "sasl.plain.username": str,
    "sasl.plain.password": str,
    "ssl.cafile": str,
    "ssl.certfile": str,
    "ssl.keyfile": str,
    "ssl.cadata": str,
    "ssl.certdata": str,
    "ssl.keydata": str,
    "ssl.password": str,
    "ssl.check.hostname": bool,
    "request.timeout.ms": int,
}

TRUST_CHECK_S = 8  # the trust check's wait for Kafka's handshake, all addresses together

# Each inline PEM option, by the file option it stands for.
_INLINE = {"ssl_cadata": "ssl_cafile", "ssl_certdata": "ssl_certfile", "ssl_keydata": "ssl_keyfile"}
_TLS_MATERIAL = (*_INLINE, *_INLINE.values(), "ssl_password")


def client_config(
    opts: Mapping[str, str], allowed: Mapping[str, type], role: str, min_int: int
) -> dict[str, Any]:
    """Settings for a KafkaConsumer or KafkaProducer (`role` names it in errors).

    Option names lose their `kafka.` prefix and dots become underscores; integers must be
    at least `min_int`; `kafka.bootstrap.servers` is required. Inline PEM is read here,
    on the driver, so that a bad one fails the query at its start.
    """
    config: dict[str, Any] = {}
    for key, raw in opts.items():
        if not key.startswith("kafka."):
            continue
        name = key.removeprefix("kafka.")
        kind = allowed.get(name)
        if kind is None:
            raise ValueError(
                f"dejaq_kafka: option '{key}' is not supported for {role} (the settings it "
                f"passes to kafka-python are: {', '.join('kafka.' + k for k in allowed)})"
            )
        config[name.replace(".", "_")] = _typed(key, raw, kind, min_int)
    if not config.get("bootstrap_servers"):
        raise ValueError(
            "dejaq_kafka: option 'kafka.bootstrap.servers' is required (host:port[,host:port])"
        )
    for data, path in _INLINE.items():
        if data in config and path in config:
            raise ValueError(f"dejaq_kafka: give option '{_option(path)}' or '{_option(data)}'")
    if "ssl_keydata" in config and "ssl_certdata" not in config:
        raise ValueError("dejaq_kafka: option 'kafka.ssl.keydata' goes with 'kafka.ssl.certdata'")
    if "ssl_certdata" in config and "ssl_keyfile" in config:
        # The tasks run where the driver's key file is not: both inline, or both files.
        raise ValueError("dejaq_kafka: option 'kafka.ssl.certdata' goes with 'kafka.ssl.keydata'")
    if any(name in config for name in _INLINE):
        tls_context(config)
    return config


def client_kwargs(config: Mapping[str, Any]) -> dict[str, Any]:
    """kafka-python's keyword arguments for a `client_config`, made where the client
    runs: inline PEM becomes an `ssl_context` there (kafka-python reads TLS material from
    files only, and a context does not pickle to the tasks)."""
    if not any(name in config for name in _INLINE):
        return dict(config)
    kwargs = {name: value for name, value in config.items() if name not in _TLS_MATERIAL}
    kwargs["ssl_context"] = tls_context(config)
    return kwargs


def tls_context(config: Mapping[str, Any]) -> ssl.SSLContext:
    """The TLS context kafka-python would build from files, from inline PEM or files.

    Errors name the option, never its value (a key, a password)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.check_hostname = config.get("ssl_check_hostname", True)
    if "ssl_cadata" in config:
        try:
            context.load_verify_locations(cadata=config["ssl_cadata"])
        except (ssl.SSLError, ValueError):
            raise ValueError(
                "dejaq_kafka: option 'kafka.ssl.cadata' must be the PEM text of the CA "
                "certificates that signed Kafka's (-----BEGIN CERTIFICATE-----...)"
            ) from None
    elif "ssl_cafile" in config:
        context.load_verify_locations(cafile=config["ssl_cafile"])
    else:
        context.load_default_certs()
    if "ssl_certdata" in config:
        pem = config["ssl_certdata"] + "\n" + config.get("ssl_keydata", "")
        with _private_file(pem) as path:
            try:
                context.load_cert_chain(path, config.get("ssl_keyfile"), config.get("ssl_password"))
            except ssl.SSLError as e:
                why = e.reason or "unreadable PEM"
                raise ValueError(
                    "dejaq_kafka: options 'kafka.ssl.certdata' and 'kafka.ssl.keydata' must be "
                    f"the PEM text of a client certificate and its key ({why})"
                ) from None
    elif "ssl_certfile" in config:
        context.load_cert_chain(
            config["ssl_certfile"], config.get("ssl_keyfile"), config.get("ssl_password")
        )
    return context


def check_trust(config: Mapping[str, Any]) -> None:
    """Over TLS, shake hands with the first bootstrap address that answers, on the driver
    before any task: a CA that does not vouch for Kafka's certificate fails naming its
    option, where kafka-python would retry until its bootstrap times out. A Kafka that
    does not answer is left to the client, which waits for it."""
    if not str(config.get("security_protocol", "")).endswith("SSL"):
        return
    context = tls_context(config)
    deadline = time.monotonic() + TRUST_CHECK_S
    for address in config["bootstrap_servers"].split(","):
        host, _, port = address.strip().rpartition(":")
        host = host.removeprefix("[").removesuffix("]")  # an IPv6 address: [::1]:9093
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            with (
                socket.create_connection((host, int(port)), timeout=left) as sock,
                context.wrap_socket(sock, server_hostname=host),
            ):
                return
        except ssl.SSLCertVerificationError as e:
            given = next((n for n in ("ssl_cadata", "ssl_cafile") if n in config), None)
            trust = f"option '{_option(given)}'" if given else "the system's CAs"
            raise ValueError(
                f"dejaq_kafka: the certificate of Kafka at {address.strip()} is not trusted "
                f"by {trust} ({e.verify_message})"
            ) from None
        except (OSError, ValueError):
            continue


@contextmanager
def _private_file(text: str) -> Iterator[str]:
    """`text` in a file only this user reads (mkstemp makes it 0600), removed once read:
    OpenSSL loads a client certificate and key from files only."""
    fd, path = tempfile.mkstemp(prefix="dejaq-kafka-", suffix=".pem")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        yield path
    finally:
        os.unlink(path)


def _option(name: str) -> str:
    return "kafka." + name.replace("_", ".")


def _typed(key: str, raw: str, kind: type, min_int: int) -> Any:
    if kind is bool:
        if raw.lower() not in ("true", "false"):
            raise ValueError(f"dejaq_kafka: option '{key}' must be true or false, got {raw!r}")
        return raw.lower() == "true"
    if kind is int:
        if not raw.isdigit() or int(raw) < min_int:
            raise ValueError(
                f"dejaq_kafka: option '{key}' must be an integer >= {min_int}, got {raw!r}"
            )
        return int(raw)
    return raw
