"""The `kafka:` settings as each Kafka client of the project takes them, and a check at start.

One section, three dialects: kafka-python's keyword arguments (the Python connectors,
the release job, the broker's producer, `status`, admin calls), the project's Python
Data Source options (`kafka.sasl.plain.username`, ...), and the JVM connector's
(`kafka.sasl.jaas.config`, PEM trust and key stores given inline, so nothing has to be
copied to executors but the CA file). Spark-free: the broker uses it too.
"""

from __future__ import annotations

import logging
import secrets
import threading
from pathlib import Path
from typing import Any

from dejaq.conf.settings import ConfigError, KafkaConfig

CHECK_TIMEOUT_MS = 8000
LOGIN_SLACK_S = 5.0  # beyond kafka-python's own timeout, for its thread to return
CHECK_CLIENT = "dejaq-login-check-"  # the client id prefix of `check_login`'s clients
# What kafka-python's log says when TLS refuses Kafka's certificate, or Kafka the login.
REFUSALS = ("certificate", "authentication")
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
    """`kafka.*` options of the project's Python Data Sources (`pipelines.kafka_options`)."""
    return {
        "kafka." + name.replace("_", "."): str(value).lower() if isinstance(value, bool) else value
        for name, value in python_config(kafka).items()
    }


def jvm_options(kafka: KafkaConfig) -> dict[str, str]:
    """`kafka.*` options of Spark's own Kafka connector."""
    options = {
        "kafka.bootstrap.servers": kafka.bootstrap,
        "kafka.security.protocol": kafka.security_protocol,
    }
    if kafka.sasl:
        assert kafka.sasl_mechanism is not None and kafka.sasl_password is not None
        password = kafka.sasl_password.get_secret_value()
        options["kafka.sasl.mechanism"] = kafka.sasl_mechanism
        options["kafka.sasl.jaas.config"] = (
            f"{LOGIN_MODULES[kafka.sasl_mechanism]} required "
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


def check_login(kafka: KafkaConfig, timeout_ms: int = CHECK_TIMEOUT_MS) -> None:
    """On a secured Kafka, log in and ask for the topics' names, or raise a `ConfigError`
    naming the setting to fix: a wrong password or an untrusted certificate fails here,
    as soon as Kafka or TLS refuses it, never as a job that retries for good. A Kafka
    that does not answer at all is left to the caller, which waits for it as it would
    for a plain one."""
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError

    if not (kafka.sasl or kafka.tls):
        return
    # An earlier check's client, refused and left to run out, goes on logging refusals
    # meanwhile: records from its threads (named for its client id) do not count.
    client_id = f"{CHECK_CLIENT}{secrets.token_hex(4)}"
    seen = _Failures(client_id)
    outcome: list[BaseException | None] = []

    def login() -> None:
        try:
            admin = KafkaAdminClient(
                **python_config(kafka),
                client_id=client_id,
                request_timeout_ms=timeout_ms,
                bootstrap_timeout_ms=timeout_ms,
            )
            try:
                admin.list_topics()
            finally:
                admin.close()
            outcome.append(None)
        except (KafkaError, OSError) as e:
            outcome.append(e)
        finally:
            seen.done.set()

    log = logging.getLogger("kafka")
    log.addHandler(seen)
    try:
        # kafka-python goes on retrying a refused login until its timeout; the refusal
        # is known from its log at once, and the thread is left to run out alone.
        threading.Thread(target=login, name=client_id, daemon=True).start()
        seen.done.wait(timeout_ms / 1000 + LOGIN_SLACK_S)
    finally:
        log.removeHandler(seen)
    error = outcome[0] if outcome else None
    if seen.refused or error is not None:
        setting, why = _why(kafka, seen.errors, error)
        if setting != "kafka.bootstrap":
            raise ConfigError(why)


class _Failures(logging.Handler):
    """kafka-python retries a refused login until its timeout and then says only that it
    could not bootstrap; the reason is in what it logs on the way."""

    def __init__(self, client_id: str) -> None:
        super().__init__(logging.ERROR)
        self.client_id = client_id  # in the names of this check's threads
        self.errors: list[str] = []
        self.refused = False
        self.done = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        thread = record.threadName or ""
        if CHECK_CLIENT in thread and self.client_id not in thread:
            return  # another check's client
        message = record.getMessage()
        self.errors.append(message)
        if any(word in message.lower() for word in REFUSALS):
            self.refused = True
            self.done.set()


def _why(kafka: KafkaConfig, logged: list[str], error: BaseException | None) -> tuple[str, str]:
    """The setting to look at, and a line on it with what Kafka or TLS said."""

    def first(*words: str) -> str | None:
        return next((m for m in logged if any(w in m.lower() for w in words)), None)

    if said := first(REFUSALS[0]):
        setting = "kafka.ssl_cafile"
        why = f"the certificate of Kafka at {kafka.bootstrap} is not trusted"
    elif said := first(REFUSALS[1]):
        setting = "kafka.sasl_password"
        why = (
            f"Kafka at {kafka.bootstrap} refused user {kafka.sasl_username!r} "
            f"({kafka.sasl_mechanism})"
        )
    else:
        said = logged[0] if logged else f"{type(error).__name__}: {error}"
        setting = "kafka.bootstrap"
        why = f"no Kafka answered at {kafka.bootstrap} as {kafka.security_protocol}"
    return setting, f"{setting}: {why} ({said[:300]})"
