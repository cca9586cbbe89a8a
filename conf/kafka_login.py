"""A secured Kafka's login, tried once at start: a wrong password or an untrusted
certificate fails with the setting to fix named, never as a job that retries for good.

The check speaks Kafka's protocol itself, with kafka-python's request classes and SASL
mechanisms, over one blocking socket. Kafka answers a refused login and then closes the
connection; read in step, that answer is always seen whole. A client library's
background connection may see only the close, and retry until its timeout. Spark-free:
the broker uses it too.
"""

from __future__ import annotations

import socket
import ssl
import time
from typing import Any

from dejaq.conf.kafka_clients import python_config
from dejaq.conf.settings import ConfigError, KafkaConfig

CHECK_TIMEOUT_MS = 8000
CLIENT_ID = "dejaq-login-check"


def check_login(kafka: KafkaConfig, timeout_ms: int = CHECK_TIMEOUT_MS) -> None:
    """On a secured Kafka, shake hands (TLS) and log in (SASL) at the first bootstrap
    address that answers, or raise a `ConfigError` naming the setting to fix. A Kafka
    that does not answer at all is left to the caller, which waits for it as it would
    for a plain one."""
    if not (kafka.sasl or kafka.tls):
        return
    deadline = time.monotonic() + timeout_ms / 1000
    for address in kafka.bootstrap.split(","):
        host, _, port = address.strip().rpartition(":")
        try:
            with _Connection(kafka, host, int(port), deadline) as conn:
                conn.login()
            return
        except ssl.SSLCertVerificationError as e:
            raise ConfigError(
                f"kafka.ssl_cafile: the certificate of Kafka at {address} is not trusted "
                f"({e.verify_message})"
            ) from None
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
            continue  # closed mid-handshake: not answering yet
        except ssl.SSLError as e:
            setting = "kafka.ssl_certfile" if kafka.ssl_certfile else "kafka.security_protocol"
            raise ConfigError(
                f"{setting}: Kafka at {address} refused the TLS handshake ({e.reason})"
            ) from None
        except (OSError, EOFError):
            continue


class _Connection:
    """One request at a time to one Kafka broker, each answer read before the next."""

    def __init__(self, kafka: KafkaConfig, host: str, port: int, deadline: float) -> None:
        from kafka.protocol.parser import KafkaProtocol

        self.kafka = kafka
        self.host = host
        self.address = f"{host}:{port}"
        self.deadline = deadline
        self.parser = KafkaProtocol(client_id=CLIENT_ID)
        self.sock = socket.create_connection((host, port), timeout=self._left())
        if kafka.tls:
            self.sock = self._tls().wrap_socket(self.sock, server_hostname=host)

    def __enter__(self) -> _Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def login(self) -> None:
        """SASL if configured; else one request, which a TLS refusal of our certificate
        (sent after the handshake in TLS 1.3) fails."""
        from kafka.protocol.metadata import ApiVersionsRequest

        if self.kafka.sasl:
            self._sasl()
        else:
            self._ask(ApiVersionsRequest(version=0))

    def _tls(self) -> ssl.SSLContext:
        kafka = self.kafka
        context = ssl.create_default_context(cafile=kafka.ssl_cafile)
        context.check_hostname = kafka.ssl_check_hostname
        if kafka.ssl_certfile:
            context.load_cert_chain(kafka.ssl_certfile, kafka.ssl_keyfile)
        return context

    def _sasl(self) -> None:
        import kafka.errors as errors
        from kafka.net.sasl import get_sasl_mechanism
        from kafka.protocol.sasl import SaslAuthenticateRequest, SaslHandshakeRequest

        name = self.kafka.sasl_mechanism
        shake = self._ask(SaslHandshakeRequest(mechanism=name, version=1))
        if shake.error_code or name not in shake.mechanisms:
            raise ConfigError(
                f"kafka.sasl_mechanism: Kafka at {self.address} does not take {name} "
                f"(it takes {', '.join(shake.mechanisms) or 'none'})"
            )
        mechanism = get_sasl_mechanism(name)(host=self.host, **python_config(self.kafka))
        while not mechanism.is_done():
            token = mechanism.auth_bytes()
            answer = self._ask(SaslAuthenticateRequest(auth_bytes=token, version=1))
            if answer.error_code:
                said = answer.error_message or errors.for_code(answer.error_code).__name__
                raise self._refused(said)
            mechanism.receive(answer.auth_bytes)
        if not mechanism.is_authenticated():
            raise self._refused("the server's proof did not match")

    def _refused(self, said: str) -> ConfigError:
        kafka = self.kafka
        return ConfigError(
            f"kafka.sasl_password: Kafka at {self.address} refused user "
            f"{kafka.sasl_username!r} ({kafka.sasl_mechanism}: {said[:300]})"
        )

    def _ask(self, request: Any) -> Any:
        from kafka.errors import KafkaError

        self.parser.send_request(request)
        self.sock.settimeout(self._left())
        self.sock.sendall(self.parser.send_bytes())
        while True:
            self.sock.settimeout(self._left())
            data = self.sock.recv(65536)
            if not data:
                raise EOFError(f"Kafka at {self.address} closed the connection")
            try:
                answers = self.parser.receive_bytes(data)
            except KafkaError as e:
                raise ConfigError(
                    f"kafka.security_protocol: Kafka at {self.address} does not answer as "
                    f"{self.kafka.security_protocol} ({e})"
                ) from None
            if answers:
                return answers[0][1]

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"Kafka at {self.address} did not answer in time")
        return left
