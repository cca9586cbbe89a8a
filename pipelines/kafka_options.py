"""Spark-style `kafka.*` options → kafka-python client settings, from a closed list.

A closed list, because a JVM-only setting (say kafka.sasl.jaas.config) silently dropped
would connect with weaker security than the job asked for.
"""

from __future__ import annotations

from collections.abc import Mapping
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
    "ssl.password": str,
    "ssl.check.hostname": bool,
    "request.timeout.ms": int,
}


def client_config(
    opts: Mapping[str, str], allowed: Mapping[str, type], role: str, min_int: int
) -> dict[str, Any]:
    """Settings for a KafkaConsumer or KafkaProducer (`role` names it in errors).

    Option names lose their `kafka.` prefix and dots become underscores; integers must be
    at least `min_int`; `kafka.bootstrap.servers` is required.
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
    return config


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
