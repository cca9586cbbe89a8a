"""`dejaq kafka`: Apache Kafka, a single-node KRaft broker run as a child JVM.

The broker and its controller share one process (`process.roles=broker,controller`) on
127.0.0.1, from the jars pinned in `jvm/kafka/pom.xml`; internal topics have one
replica. For development, the demo, the tests and the benchmarks: everything also runs
against an external Kafka (`DEJAQ_KAFKA_BOOTSTRAP`).
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import secrets
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from cryptography import x509

from dejaq.conf import jvm
from dejaq.conf.settings import KafkaConfig, load_settings
from dejaq.jobs.certificates import CA_LEFT_AT_LEAST, Authority, new_authority, unfit
from dejaq.jobs.children import check_free, die_with_parent, serve, stop, wait_for_port
from dejaq.jobs.ports import free_port
from dejaq.jobs.stopping import stop_on_signals

HEAP = ["-Xms256m", "-Xmx512m"]
READY_TIMEOUT_S = 90
LOG_FILE = "kafka.log"


def _cluster_id() -> str:
    """A Kafka cluster id: 16 random bytes, URL-safe base64 (Kafka's own Uuid form)."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text


class SecureMismatch(Exception):
    """A data dir started otherwise than it was made (with --secure or without), or its
    CA near its end."""


USER = "dejaq"  # the SCRAM (and PLAIN) user clients log in as
SECURE_FILE = "secure.json"
CLIENT_ENV = "client.env"


@dataclass(frozen=True)
class Secure:
    """`dejaq kafka --secure`: a SASL_SSL listener, TLS from a CA made here, one user
    (`dejaq`) for SCRAM-SHA-256, SCRAM-SHA-512 and PLAIN, and an inter-broker user. Made
    on the first start and kept in the data dir, so a restart serves the same."""

    ca: Path
    keystore: Path  # the broker's key, then its certificate: Kafka's PEM key store
    password: str
    broker_password: str

    @classmethod
    def load_or_create(cls, data_dir: Path) -> Secure:
        """The data dir's, its broker certificate issued again from its CA when it has
        less than a month left (it is valid a year; the CA ten); a new one on the first
        start."""
        state = data_dir / SECURE_FILE
        if state.exists():
            saved = json.loads(state.read_text())
            secure = cls(
                Path(saved["ca"]),
                Path(saved["keystore"]),
                saved["password"],
                saved["broker_password"],
            )
            secure._renew_if_ending()
            return secure
        pki = data_dir / "pki"
        ca = new_authority(pki, "dejaq-kafka-ca")
        keystore = pki / "kafka-keystore.pem"
        _issue_keystore(ca, keystore)
        secure = cls(ca.cert, keystore, secrets.token_urlsafe(18), secrets.token_urlsafe(18))
        state.touch(mode=0o600)
        state.write_text(json.dumps({k: str(v) for k, v in asdict(secure).items()}))
        return secure

    def _renew_if_ending(self) -> None:
        """Issue the broker's certificate again if it ends within `CA_LEFT_AT_LEAST`;
        a clear error if the CA does too (a new data dir makes a new one)."""
        cert = x509.load_pem_x509_certificate(self.keystore.read_bytes())
        if cert.not_valid_after_utc - dt.datetime.now(dt.UTC) >= CA_LEFT_AT_LEAST:
            return
        ca = Authority(self.ca, self.ca.with_name("ca-key.pem"))
        if (why := unfit(ca)) is not None:
            raise SecureMismatch(f"{why}; or start Kafka on a new data dir")
        _issue_keystore(ca, self.keystore)

    def server_properties(self) -> dict[str, str]:
        plain = (
            "org.apache.kafka.common.security.plain.PlainLoginModule required "
            f'username="broker" password="{self.broker_password}" '
            f'user_broker="{self.broker_password}" user_{USER}="{self.password}";'
        )
        scram = "org.apache.kafka.common.security.scram.ScramLoginModule required;"
        # The controller's listener takes the broker alone: open, any local process
        # could change the users' passwords or delete topics through it.
        controller = (
            "org.apache.kafka.common.security.plain.PlainLoginModule required "
            f'username="broker" password="{self.broker_password}" '
            f'user_broker="{self.broker_password}";'
        )
        return {
            "sasl.mechanism.controller.protocol": "PLAIN",
            "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
            "listener.name.controller.plain.sasl.jaas.config": controller,
            "sasl.enabled.mechanisms": "PLAIN,SCRAM-SHA-256,SCRAM-SHA-512",
            "sasl.mechanism.inter.broker.protocol": "PLAIN",
            "listener.name.sasl_ssl.plain.sasl.jaas.config": plain,
            "listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config": scram,
            "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config": scram,
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(self.keystore),
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(self.ca),
            "ssl.client.auth": "requested",  # a client certificate, if sent, is checked
        }

    def format_arguments(self) -> list[str]:
        """The SCRAM credentials, written into the metadata log when it is formatted."""
        return [
            arg
            for mechanism in ("SCRAM-SHA-256", "SCRAM-SHA-512")
            for arg in ("--add-scram", f"{mechanism}=[name={USER},password={self.password}]")
        ]

    def client_settings(self, bootstrap: str) -> dict[str, str]:
        """The `kafka:` settings that reach this broker, as environment variables."""
        return {
            "DEJAQ_KAFKA_BOOTSTRAP": bootstrap,
            "DEJAQ_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
            "DEJAQ_KAFKA_SASL_MECHANISM": "SCRAM-SHA-256",
            "DEJAQ_KAFKA_SASL_USERNAME": USER,
            "DEJAQ_KAFKA_SASL_PASSWORD": self.password,
            "DEJAQ_KAFKA_SSL_CAFILE": str(self.ca),
        }


def _issue_keystore(ca: Authority, keystore: Path) -> None:
    """The broker's key and a certificate for it from `ca`, as Kafka's PEM key store."""
    issued = ca.issue(keystore.parent, "kafka", ["127.0.0.1", "localhost"])
    keystore.touch(mode=0o600)
    keystore.write_bytes(issued.key.read_bytes() + issued.cert.read_bytes())


def server_properties(
    port: int, controller_port: int, log_dir: Path, secure: Secure | None = None
) -> str:
    """One broker that is its own controller (a static quorum of one), on 127.0.0.1;
    `secure`: its client and controller listeners are SASL_SSL instead of PLAINTEXT."""
    listener = "SASL_SSL" if secure else "PLAINTEXT"
    props = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": f"1@127.0.0.1:{controller_port}",
        "listeners": f"{listener}://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"{listener}://127.0.0.1:{port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": listener,
        "listener.security.protocol.map": f"CONTROLLER:{listener},{listener}:{listener}",
        "log.dirs": str(log_dir),
        "num.partitions": "1",
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "8",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "transaction.state.log.num.partitions": "8",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0",
    }
    if secure is not None:
        props.update(secure.server_properties())
    return "".join(f"{k}={v}\n" for k, v in props.items())


def log4j_properties(log_file: Path) -> str:
    """Kafka's log to a file in its data dir; only errors also reach this process's stderr."""
    return f"""status = warn
shutdownHook = disable
appender.file.type = File
appender.file.name = file
appender.file.fileName = {log_file}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
appender.err.type = Console
appender.err.name = err
appender.err.target = SYSTEM_ERR
appender.err.layout.type = PatternLayout
appender.err.layout.pattern = kafka: %p %m%n
appender.err.filter.threshold.type = ThresholdFilter
appender.err.filter.threshold.level = error
rootLogger.level = info
rootLogger.appenderRef.file.ref = file
rootLogger.appenderRef.err.ref = err
"""


def _java(data_dir: Path, main: str, *args: str) -> list[str]:
    classpath = ":".join(str(p) for p in jvm.require(jvm.KAFKA))
    return [
        "java",
        *HEAP,
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={data_dir / 'log4j2.properties'}",
        "-cp",
        classpath,
        main,
        *args,
    ]


def _argument_file(args: list[str], folder: Path) -> Path:
    """`args` as a JVM argument file (`java @file`) in `folder` that only its owner reads:
    a command line is any local user's to read (ps, /proc/*/cmdline), and the format's
    carries the SCRAM passwords. Each argument is quoted, `\\` and `"` escaped."""
    fd, name = tempfile.mkstemp(prefix="java-", suffix=".args", dir=folder)
    quoted = ('"' + a.replace("\\", "\\\\").replace('"', '\\"') + '"' for a in args)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(quoted))
    return Path(name)


def prepare(port: int, data_dir: Path, secure: bool = False) -> Path:
    """Write the configuration for this start; format the storage on first use.

    Ports may change between starts: a static quorum keeps no listener in the metadata
    log, so the same data dir serves again on new ports.
    """
    data_dir = data_dir.resolve()
    log_dir = data_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    config = data_dir / "server.properties"
    formatted = (log_dir / "meta.properties").exists()
    if secure and formatted and not (data_dir / SECURE_FILE).exists():
        raise SecureMismatch(
            f"{data_dir} holds a Kafka made without --secure (it has no SCRAM users): "
            "give --secure another --data-dir"
        )
    if not secure and (data_dir / SECURE_FILE).exists():
        raise SecureMismatch(
            f"{data_dir} holds a Kafka made with --secure: start it with --secure (without,"
            " it would serve its topics to any local process, no login asked)"
        )
    security = Secure.load_or_create(data_dir) if secure else None
    config.touch(mode=0o600)  # it holds the users' passwords when secure
    config.write_text(server_properties(port, free_port(), log_dir, security))
    (data_dir / "log4j2.properties").write_text(log4j_properties(data_dir / LOG_FILE))
    if not formatted:
        fmt = _java(
            data_dir,
            "kafka.tools.StorageTool",
            "format",
            "--cluster-id",
            _cluster_id(),
            "--config",
            str(config),
            *(security.format_arguments() if security else []),
        )
        argument_file = _argument_file(fmt[1:], data_dir)
        try:
            done = subprocess.run(
                [fmt[0], f"@{argument_file}"],
                capture_output=True,
                text=True,
                stdin=subprocess.DEVNULL,
            )
        finally:
            argument_file.unlink()
        if done.returncode != 0:
            raise RuntimeError(f"formatting Kafka storage in {log_dir} failed: {done.stderr}")
    return config


def answers(bootstrap: str, timeout_ms: int = 2000, kafka: KafkaConfig | None = None) -> bool:
    """Whether a broker at `bootstrap` answers a metadata request (not just a connect);
    `kafka`: how to log in to a secured one."""
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError

    from dejaq.conf.kafka_clients import python_config

    config = python_config(kafka) if kafka is not None else {"bootstrap_servers": bootstrap}
    try:
        admin = KafkaAdminClient(**config, request_timeout_ms=timeout_ms)
    except KafkaError:
        return False
    try:
        admin.list_topics()
    except KafkaError:
        return False
    finally:
        admin.close()
    return True


def start(port: int, data_dir: Path, secure: bool = False) -> subprocess.Popen:
    """Start Kafka; return once it answers on 127.0.0.1:port (its log: data_dir/kafka.log).
    `secure`: on SASL_SSL, its client settings in data_dir/client.env."""
    check_free(port)
    config = prepare(port, data_dir, secure)
    # The settings a shell would `source`, read as the jobs read them.
    kafka = load_settings(env=client_env(data_dir, port)).kafka if secure else None
    proc = subprocess.Popen(
        _java(data_dir.resolve(), "kafka.Kafka", str(config)),
        stdout=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        preexec_fn=die_with_parent,
    )
    try:
        wait_for_port(port, timeout=READY_TIMEOUT_S, proc=proc)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not answers(f"127.0.0.1:{port}", kafka=kafka):
            if proc.poll() is not None:
                raise RuntimeError(f"Kafka exited with code {proc.returncode}: see {data_dir}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"Kafka on 127.0.0.1:{port} did not answer: see {data_dir}")
            time.sleep(0.2)
    except BaseException:
        stop(proc)
        raise
    return proc


def client_env(data_dir: Path, port: int) -> dict[str, str]:
    """A secured broker's client settings, also written (owner-only) to data_dir/client.env
    for a shell to `source`, each value quoted: the CA's path is the data dir's, which
    may hold a space."""
    settings = Secure.load_or_create(data_dir.resolve()).client_settings(f"127.0.0.1:{port}")
    path = data_dir / CLIENT_ENV
    path.touch(mode=0o600)
    path.write_text("".join(f"export {k}={shlex.quote(v)}\n" for k, v in settings.items()))
    return settings


def run(port: int | None, data_dir: Path, secure: bool = False) -> int:
    """Foreground: print the bootstrap address, serve until SIGTERM or Ctrl-C."""
    port = port or free_port()
    # Before the broker starts: a SIGTERM as soon as the port answers must still stop it.
    with stop_on_signals() as stopping:
        try:
            proc = start(port, data_dir, secure)
        except (OSError, SecureMismatch) as e:  # a busy port, jars not fetched
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"kafka bootstrap: 127.0.0.1:{port}", flush=True)
        if secure:
            print(
                f"SASL_SSL, SCRAM-SHA-256 user {USER}: its settings are in "
                f"{(data_dir / CLIENT_ENV).resolve()} (source it)",
                flush=True,
            )
        print(
            f"data dir: {data_dir.resolve()}  (log: {LOG_FILE}; SIGTERM or Ctrl-C stops it)",
            flush=True,
        )
        if serve(proc, stopping, "Kafka"):
            return 1
    print("kafka stopped", flush=True)
    return 0
