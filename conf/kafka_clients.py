"""The `kafka:` settings as each Kafka client of the project takes them.

One section, three dialects: kafka-python's keyword arguments (the broker's producer,
`status`, admin calls), the project's Python Data Source options
(`kafka.sasl.plain.username`, ...; the release job's too), and the JVM connector's
(`kafka.sasl.jaas.config`, ...). The Spark connectors get the PEM files' contents, read
on the driver, not their paths: executors do not have the driver's files. Spark-free:
the broker uses it too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dejaq.conf.settings import KafkaConfig

# Databricks shades the Kafka client its Spark connector bundles: the JAAS config must
# name the login modules by their classes there, renamed under this prefix.
SHADED_PREFIX = "kafkashaded."

LOGIN_MODULES = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}


def python_config(kafka: KafkaConfig) -> dict[str, Any]:
    """Keyword arguments for kafka-python's consumer, producer and admin client."""
    config: dict[str, Any] = {
        "bootstrap_servers": kafka.bootstrap,
        "security_protocol": kafka.security_protocol,
    }
    if kafka.sasl:
        assert kafka.sasl_password is not None
        config.update(
            sasl_mechanism=kafka.sasl_mechanism,
            sasl_plain_username=kafka.sasl_username,
            sasl_plain_password=kafka.sasl_password.get_secret_value(),
        )
    if kafka.tls:
        config["ssl_check_hostname"] = kafka.ssl_check_hostname
        for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            if getattr(kafka, name) is not None:
                config[name] = getattr(kafka, name)
    return config


def python_source_options(kafka: KafkaConfig) -> dict[str, str]:
    """`kafka.*` options of the project's Python Data Sources (`pipelines.kafka_options`),
    the PEM files given inline (`kafka.ssl.cadata`, ...)."""
    config = python_config(kafka)
    for kind in ("ca", "cert", "key"):
        path = config.pop(f"ssl_{kind}file", None)
        if path is not None:
            config[f"ssl_{kind}data"] = Path(path).read_text()
    return {
        "kafka." + name.replace("_", "."): str(value).lower() if isinstance(value, bool) else value
        for name, value in config.items()
    }


def jvm_options(kafka: KafkaConfig, shaded: bool = False) -> dict[str, str]:
    """`kafka.*` options of Spark's own Kafka connector; `shaded` where its Kafka client
    is Databricks' (`session.shaded_kafka`)."""
    options = {
        "kafka.bootstrap.servers": kafka.bootstrap,
        "kafka.security.protocol": kafka.security_protocol,
    }
    if kafka.sasl:
        assert kafka.sasl_mechanism is not None and kafka.sasl_password is not None
        password = kafka.sasl_password.get_secret_value()
        options["kafka.sasl.mechanism"] = kafka.sasl_mechanism
        options["kafka.sasl.jaas.config"] = (
            f"{SHADED_PREFIX if shaded else ''}{LOGIN_MODULES[kafka.sasl_mechanism]} required "
            f'username="{_jaas(kafka.sasl_username or "")}" password="{_jaas(password)}";'
        )
    if kafka.tls:
        if kafka.ssl_cafile is not None:
            options["kafka.ssl.truststore.type"] = "PEM"
            options["kafka.ssl.truststore.certificates"] = Path(kafka.ssl_cafile).read_text()
        if kafka.ssl_certfile is not None and kafka.ssl_keyfile is not None:
            options["kafka.ssl.keystore.type"] = "PEM"
            options["kafka.ssl.keystore.certificate.chain"] = Path(kafka.ssl_certfile).read_text()
            options["kafka.ssl.keystore.key"] = Path(kafka.ssl_keyfile).read_text()
        if not kafka.ssl_check_hostname:
            options["kafka.ssl.endpoint.identification.algorithm"] = ""
    return options


def _jaas(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def close_producer(producer: Any, timeout: float) -> None:
    """Close a producer within about `timeout` seconds, even one an error it cannot retry
    broke or one stuck: its close begins with a flush that then raises (failed, or past
    the timeout), before it stops the producer's I/O thread, which is then stopped here
    (kafka-python has no close without the flush)."""
    try:
        producer.close(timeout=timeout)
    except Exception:
        sender = getattr(producer, "_sender", None)
        if sender is not None:
            sender.force_close()
