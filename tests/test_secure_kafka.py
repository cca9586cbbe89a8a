"""The pipeline against a secured Kafka: `dejaq kafka --secure` (SASL_SSL, SCRAM, a CA made
for it), one `kafka:` section reaching every client (Spark's JVM and Python sources, the
release job, the broker's producer, `status`, `doctor`), and a wrong password or CA
failing at start with the setting named."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import assert_rows, sourced, wait_until
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer
from kafka.admin import NewTopic
from pydantic import SecretStr
from pyspark.sql import SparkSession
from pyspark.sql.types import BinaryType, StructField, StructType

from dejaq.conf.kafka_clients import python_config, python_source_options
from dejaq.conf.kafka_login import check_login
from dejaq.conf.settings import ConfigError, load_settings
from dejaq.conf.tables import Table, table_path
from dejaq.jobs import children, cluster, embedded_kafka
from dejaq.jobs.certificates import Authority, new_authority
from dejaq.jobs.ports import free_port
from dejaq.pipelines.kafka_options import tls_context
from dejaq.pipelines.kafka_source import KafkaDataSource, KafkaOptions, KafkaStreamReader

DEJAQ = [sys.executable, "-m", "dejaq.jobs.cli"]


@pytest.fixture(scope="module")
def secure_kafka_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("secure-kafka")


@pytest.fixture(scope="module")
def secure_kafka(secure_kafka_dir: Path) -> Iterator[dict[str, str]]:
    """A secured embedded Kafka; yields its client settings as DEJAQ_KAFKA_* variables."""
    data_dir = secure_kafka_dir
    port = free_port()
    proc = embedded_kafka.start(port, data_dir, secure=True)
    try:
        settings = embedded_kafka.client_env(data_dir, port)
        assert (data_dir / embedded_kafka.CLIENT_ENV).stat().st_mode & 0o777 == 0o600
        yield settings
    finally:
        children.stop(proc)


def kafka_config(env: dict[str, str]) -> dict:
    """kafka-python's arguments for the `DEJAQ_KAFKA_*` settings `env`, read as the jobs
    read them."""
    return python_config(load_settings(env=env).kafka)


def dejaq(*args: str, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*DEJAQ, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={
            **os.environ,
            "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_DRIVER_PYTHON": sys.executable,
            **env,
        },
    )


def test_client_env_sources_whole_from_a_data_dir_whose_path_has_a_space(tmp_path) -> None:
    """The CA's path is the data dir's: a shell reads each value whole, not cut at a space
    (the data dir needs no running Kafka for its settings)."""
    data_dir = tmp_path / "my kafka"
    data_dir.mkdir()
    settings = embedded_kafka.client_env(data_dir, free_port())
    assert " " in settings["DEJAQ_KAFKA_SSL_CAFILE"]
    assert sourced(data_dir / embedded_kafka.CLIENT_ENV) == settings


def test_a_plain_client_is_refused(secure_kafka: dict[str, str]) -> None:
    """The listener really asks for a login: a client without one gets nowhere."""
    from kafka.errors import KafkaError

    with pytest.raises(KafkaError):
        KafkaAdminClient(
            bootstrap_servers=secure_kafka["DEJAQ_KAFKA_BOOTSTRAP"],
            request_timeout_ms=3000,
            bootstrap_timeout_ms=3000,
        ).list_topics()


def test_the_controller_listener_takes_no_client_without_a_login(
    secure_kafka: dict[str, str], secure_kafka_dir: Path
) -> None:
    """The controller's port, on 127.0.0.1 beside the client one, asks for TLS and the
    broker's own login too: open, any local process could change the users' passwords
    there (AlterUserScramCredentials). A request sent in the clear gets no Kafka answer."""
    from kafka.protocol.metadata import ApiVersionsRequest
    from kafka.protocol.parser import KafkaProtocol

    props = (secure_kafka_dir / "server.properties").read_text()
    voter = re.search(r"^controller\.quorum\.voters=1@127\.0\.0\.1:(\d+)$", props, re.M)
    assert voter is not None
    parser = KafkaProtocol(client_id="nobody")
    parser.send_request(ApiVersionsRequest(version=0))
    with socket.create_connection(("127.0.0.1", int(voter.group(1))), timeout=10) as sock:
        sock.sendall(parser.send_bytes())
        try:
            answer = sock.recv(65536)
        except ConnectionResetError:
            answer = b""
    # Nothing, or a TLS alert record (content type 21): no Kafka answer.
    assert answer[:1] in (b"", b"\x15"), "the controller answered a request in the clear"


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"])
def test_every_sasl_mechanism_logs_in(secure_kafka: dict[str, str], mechanism: str) -> None:
    """Each mechanism the `kafka:` section offers, through the start-up check and a
    producer's round trip."""
    kafka = load_settings(env={**secure_kafka, "DEJAQ_KAFKA_SASL_MECHANISM": mechanism}).kafka
    check_login(kafka)
    producer = KafkaProducer(**python_config(kafka), acks="all")
    sent = producer.send(f"mechanisms-{secrets.token_hex(3)}", b"x").get(timeout=30)
    producer.close()
    assert sent.offset == 0
    wrong = kafka.model_copy(update={"sasl_password": SecretStr("wrong")})
    for _ in range(10):  # Kafka closes the connection right after refusing: every time
        with pytest.raises(ConfigError, match=rf"kafka\.sasl_password: .*{mechanism}"):
            check_login(wrong)


@pytest.mark.parametrize(
    ("update", "named"),
    [
        ({"sasl_mechanism": "GSSAPI"}, r"kafka\.sasl_mechanism: .* takes PLAIN"),
        ({"security_protocol": "SASL_PLAINTEXT"}, r"kafka\.security_protocol: "),
        ({"ssl_cafile": "other"}, r"kafka\.ssl_cafile: .* not trusted"),
    ],
)
def test_the_login_check_names_the_setting_to_fix(
    secure_kafka: dict[str, str], tmp_path: Path, update: dict[str, str], named: str
) -> None:
    kafka = load_settings(env=secure_kafka).kafka
    if update.get("ssl_cafile"):
        update = {"ssl_cafile": str(new_authority(tmp_path / "other").cert)}
    with pytest.raises(ConfigError, match=named):
        check_login(kafka.model_copy(update=update))


def test_the_login_check_leaves_a_silent_kafka_to_the_caller(
    secure_kafka: dict[str, str],
) -> None:
    """Nothing listening is not a wrong setting: the jobs wait for Kafka as they do for a
    plain one."""
    kafka = load_settings(env=secure_kafka).kafka
    check_login(kafka.model_copy(update={"bootstrap": f"127.0.0.1:{free_port()}"}))


def test_the_whole_pipeline_on_a_secured_kafka(
    secure_kafka: dict[str, str], spark: SparkSession, tmp_path: Path
) -> None:
    config = kafka_config(secure_kafka)
    suffix = secrets.token_hex(3)
    sources = {name: f"{name}-in-{suffix}" for name in ("jvm", "py", "rel")}
    output = f"rel-out-{suffix}"
    admin = KafkaAdminClient(**config)
    admin.create_topics([NewTopic(t, 2, 1) for t in [*sources.values(), output]])
    admin.close()
    producer = KafkaProducer(**config, acks="all")
    for name, source in sources.items():
        for i in range(20):
            headers = [("dejaq-priority", str(i % 5).encode())]
            if name == "rel":
                headers = [("dejaq-deliver-at", b"0")]
            producer.send(
                source, key=f"k{i}".encode(), value=f"{name}{i}".encode(), headers=headers
            )
    producer.flush()
    producer.close()
    conf = tmp_path / "dejaq.yaml"
    conf.write_text(
        f"warehouse: {tmp_path / 'warehouse'}\n"
        "topics:\n"
        f"  - {{name: jvm, kind: priority, source: [{sources['jvm']}], buckets: 2}}\n"
        f"  - {{name: py, kind: priority, source: [{sources['py']}], buckets: 2}}\n"
        f"  - {{name: rel, kind: timeline, source: [{sources['rel']}], buckets: 2,"
        f" delivery: release, output: {output}}}\n"
    )
    # Mutual TLS too: a client certificate from Kafka's CA, which the listener checks
    # when one is sent, given to both ingests (as inline PEM: the JVM's key store, and
    # `dejaq_kafka`'s kafka.ssl.certdata and kafka.ssl.keydata).
    ca = Path(secure_kafka["DEJAQ_KAFKA_SSL_CAFILE"])
    client = Authority(ca, ca.with_name("ca-key.pem")).issue(tmp_path, "client", ["dejaq"], True)
    mutual = {
        "DEJAQ_KAFKA_SSL_CERTFILE": str(client.cert),
        "DEJAQ_KAFKA_SSL_KEYFILE": str(client.key),
    }
    outputs: list[str] = []
    for topic, connectors in (("jvm", "jvm"), ("py", "python"), ("rel", "auto")):
        env = {**secure_kafka, "DEJAQ_SPARK_CONNECTORS": connectors}
        if topic != "rel":
            env.update(mutual)
        done = dejaq("ingest", "--topic", topic, "--once", "--conf-file", str(conf), env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "buffered 20" in done.stdout, done.stdout
        outputs.append(done.stdout + done.stderr)
        buffer = table_path(str(tmp_path / "warehouse"), Table.BUFFER, topic)
        assert_rows(
            spark.read.format("delta").load(buffer).select("key", "payload", "sort_key"),
            [
                (f"k{i}".encode(), f"{topic}{i}".encode(), 0 if topic == "rel" else i % 5)
                for i in range(20)
            ],
            "key binary, payload binary, sort_key long",
        )
    released = dejaq(
        "release", "--topic", "rel", "--once", "--conf-file", str(conf), env=secure_kafka
    )
    assert released.returncode == 0, released.stderr[-3000:]
    outputs.append(released.stdout + released.stderr)
    consumer = KafkaConsumer(
        output, **config, auto_offset_reset="earliest", consumer_timeout_ms=10000
    )
    got = {m.value.decode() for m in consumer}
    consumer.close()
    assert got == {f"rel{i}" for i in range(20)}
    status = dejaq("status", "--topic", "jvm", "--conf-file", str(conf), env=secure_kafka)
    assert status.returncode == 0, status.stdout + status.stderr
    assert ["ingest", "lag", "0"] in [line.split() for line in status.stdout.splitlines()]
    doctor = dejaq("doctor", "--conf-file", str(conf), env=secure_kafka)
    assert "SASL_SSL, SCRAM-SHA-256 as dejaq" in doctor.stdout, doctor.stdout
    outputs += [status.stdout + status.stderr, doctor.stdout + doctor.stderr]
    password = secure_kafka["DEJAQ_KAFKA_SASL_PASSWORD"]
    for text in outputs:
        assert password not in text


def test_the_python_connector_needs_none_of_the_drivers_tls_files(
    secure_kafka: dict[str, str], spark: SparkSession, tmp_path: Path
) -> None:
    """`dejaq_kafka` writes and reads over mutual TLS with the CA, client certificate and
    key the settings name gone once its options are made: the driver passes their text,
    as it must to executors on other hosts, which have none of its files."""
    ca = Path(secure_kafka["DEJAQ_KAFKA_SSL_CAFILE"])
    client = Authority(ca, ca.with_name("ca-key.pem")).issue(tmp_path, "client", ["dejaq"], True)
    driver_ca = Path(shutil.copy(ca, tmp_path / "driver-ca.pem"))
    env = {
        **secure_kafka,
        "DEJAQ_KAFKA_SSL_CAFILE": str(driver_ca),
        "DEJAQ_KAFKA_SSL_CERTFILE": str(client.cert),
        "DEJAQ_KAFKA_SSL_KEYFILE": str(client.key),
    }
    options = python_source_options(load_settings(env=env).kafka)
    for path in (driver_ca, client.cert, client.key):
        path.unlink()
    topic = f"inline-tls-{secrets.token_hex(3)}"
    admin = KafkaAdminClient(**kafka_config(secure_kafka))
    admin.create_topics([NewTopic(topic, 2, 1)])
    admin.close()
    values = [f"v{i}".encode() for i in range(10)]
    rows = spark.createDataFrame(
        [(f"k{i}", v) for i, v in enumerate(values)], "key string, value binary"
    )
    rows.write.format("dejaq_kafka").options(**options).option("topic", topic).mode("append").save()
    name = f"inline_tls_{uuid.uuid4().hex[:8]}"
    query = (
        spark.readStream.format("dejaq_kafka")
        .options(**options)
        .option("subscribe", topic)
        .load()
        .writeStream.format("memory")
        .queryName(name)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    assert query.exception() is None
    assert_rows(spark.table(name).select("value"), [(v,) for v in values], "value binary")


def test_wrong_tls_text_fails_the_python_connector_at_start_naming_the_option(
    secure_kafka: dict[str, str], tmp_path: Path
) -> None:
    """Text that is no CA, another CA's certificate, a key that is not the certificate's:
    each fails on the driver naming the option, never echoing a key or a password, where
    kafka-python would retry until its bootstrap timed out."""
    options = python_source_options(load_settings(env=secure_kafka).kafka)
    read = {**options, "subscribe": "nowhere"}
    ca = Path(secure_kafka["DEJAQ_KAFKA_SSL_CAFILE"])
    authority = Authority(ca, ca.with_name("ca-key.pem"))
    client = authority.issue(tmp_path, "client", ["dejaq"], True)
    other = authority.issue(tmp_path, "other", ["dejaq"], True)
    with pytest.raises(ValueError, match=r"option 'kafka\.ssl\.cadata' must be the PEM text"):
        KafkaDataSource({**read, "kafka.ssl.cadata": "not a certificate"})
    key = other.key.read_text()
    mismatched = {**read, "kafka.ssl.certdata": client.cert.read_text(), "kafka.ssl.keydata": key}
    with pytest.raises(
        ValueError, match=r"'kafka\.ssl\.keydata' must be .*KEY_VALUES_MISMATCH"
    ) as e:
        KafkaDataSource(mismatched)
    assert key not in str(e.value)
    mixed = {**read, "kafka.ssl.certdata": client.cert.read_text(), "kafka.ssl.keyfile": "k"}
    with pytest.raises(ValueError, match=r"'kafka\.ssl\.certdata' goes with 'kafka\.ssl\.keydata'"):
        KafkaDataSource(mixed)  # the key file is the driver's: tasks run elsewhere
    untrusted = {**read, "kafka.ssl.cadata": new_authority(tmp_path / "x").cert.read_text()}
    reader = KafkaStreamReader(KafkaOptions.parse(untrusted))
    with pytest.raises(ValueError, match=r"not trusted by option 'kafka\.ssl\.cadata'"):
        reader.initialOffset()
    writer = KafkaDataSource(
        {**options, "topic": "nowhere", "kafka.ssl.cadata": untrusted["kafka.ssl.cadata"]}
    )
    with pytest.raises(ValueError, match=r"not trusted by option 'kafka\.ssl\.cadata'"):
        writer.writer(StructType([StructField("value", BinaryType())]), overwrite=False)
    password = secure_kafka["DEJAQ_KAFKA_SASL_PASSWORD"]
    assert password not in repr(KafkaOptions.parse(read))


def test_inline_client_keys_touch_the_disk_only_while_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OpenSSL reads a client certificate and key from a file: one only its user reads,
    gone once the TLS context is built."""
    client = new_authority(tmp_path).issue(tmp_path, "client", ["dejaq"], True)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    modes: list[int] = []
    load = ssl.SSLContext.load_cert_chain

    def seen(context: ssl.SSLContext, certfile: str, *args: object) -> None:
        modes.append(Path(certfile).stat().st_mode & 0o777)
        load(context, certfile, *args)

    monkeypatch.setattr(ssl.SSLContext, "load_cert_chain", seen)
    config = {"ssl_certdata": client.cert.read_text(), "ssl_keydata": client.key.read_text()}
    tls_context(config)
    assert modes == [0o600]
    assert list(scratch.iterdir()) == []


def test_the_brokers_producer_logs_in(
    secure_kafka: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message sent over HTTP reaches the secured Kafka through the node's producer."""
    source = f"http-in-{secrets.token_hex(3)}"
    conf = tmp_path / "dejaq.yaml"
    conf.write_text(
        f"warehouse: {tmp_path / 'warehouse'}\n"
        f"topics: [{{name: web, kind: priority, source: [{source}], buckets: 2}}]\n"
    )
    for name, value in secure_kafka.items():
        monkeypatch.setenv(name, value)
    nodes = cluster.up(1, tmp_path / "raft", str(conf))
    try:
        answer = httpx.post(
            f"{nodes[0].url}/v1/topics/web/messages",
            json={"payload": "aHR0cA==", "id": "over-http", "priority": 1},
            timeout=30,
        )
        assert answer.status_code == 201, answer.text
    finally:
        cluster.stop_node(nodes[0])
    consumer = KafkaConsumer(
        source,
        **kafka_config(secure_kafka),
        auto_offset_reset="earliest",
        consumer_timeout_ms=10000,
    )
    ids = [dict(m.headers).get("dejaq-id") for m in consumer]
    consumer.close()
    assert ids == [b"over-http"]


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("DEJAQ_KAFKA_SASL_PASSWORD", "kafka.sasl_password"),
        ("DEJAQ_KAFKA_SSL_CAFILE", "kafka.ssl_cafile"),
    ],
)
def test_a_wrong_login_fails_at_start_naming_the_setting(
    secure_kafka: dict[str, str], tmp_path: Path, setting: str, named: str
) -> None:
    wrong = "not-the-password"
    if setting == "DEJAQ_KAFKA_SSL_CAFILE":
        wrong = str(new_authority(tmp_path / "other").cert)
    env = {**secure_kafka, setting: wrong}
    conf = tmp_path / "dejaq.yaml"
    conf.write_text(
        f"warehouse: {tmp_path / 'warehouse'}\n"
        "topics: [{name: t, kind: priority, source: [nowhere]}]\n"
    )
    addresses = ["--http", f"127.0.0.1:{free_port()}", "--raft", f"127.0.0.1:{free_port()}"]
    for command in (
        ["ingest", "--topic", "t", "--once"],
        ["release", "--topic", "t", "--once"],
        ["broker", "--node-id", "x", "--data-dir", str(tmp_path / "node"), *addresses],
    ):
        done = dejaq(*command, "--conf-file", str(conf), env=env, timeout=60)
        assert done.returncode == 2, (command, done.stderr[-2000:])
        assert named in done.stderr, (command, done.stderr[-2000:])
        assert secure_kafka["DEJAQ_KAFKA_SASL_PASSWORD"] not in done.stdout + done.stderr


def test_the_brokers_certificate_is_issued_again_near_its_end_and_an_ending_ca_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded Kafka's certificate is valid a year: a data dir kept longer gets a new
    one from its CA at the next start, the logins unchanged, the key store's key and
    certificate a pair its CA vouches for. A CA near its own end is named, not reused."""
    import ssl

    from cryptography import x509
    from cryptography.x509.verification import PolicyBuilder, Store

    from dejaq.jobs import certificates

    def ends(secure: embedded_kafka.Secure) -> float:
        cert = x509.load_pem_x509_certificate(secure.keystore.read_bytes())
        return (cert.not_valid_after_utc - cert.not_valid_before_utc).days

    with monkeypatch.context() as m:
        m.setattr(certificates, "VALID_DAYS", 1)
        first = embedded_kafka.Secure.load_or_create(tmp_path / "kept")
    assert ends(first) <= 1
    again = embedded_kafka.Secure.load_or_create(tmp_path / "kept")
    assert again == first, "the same files and logins"
    assert ends(again) >= 300, "issued again for a year"
    ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(again.keystore)  # a pair
    store = Store([x509.load_pem_x509_certificate(again.ca.read_bytes())])
    verifier = PolicyBuilder().store(store).build_server_verifier(x509.DNSName("localhost"))
    verifier.verify(x509.load_pem_x509_certificate(again.keystore.read_bytes()), [])
    with monkeypatch.context() as m:
        m.setattr(certificates, "VALID_DAYS", 1)
        m.setattr(
            embedded_kafka,
            "new_authority",
            lambda folder, name: new_authority(folder, name, days=2),
        )
        embedded_kafka.Secure.load_or_create(tmp_path / "old")
    with pytest.raises(embedded_kafka.SecureMismatch, match=r"the CA .* expires .* new data dir"):
        embedded_kafka.Secure.load_or_create(tmp_path / "old")


def test_a_secure_data_dir_started_without_secure_is_refused(tmp_path: Path) -> None:
    """Started without --secure, a data dir made with it would serve its topics on a
    plain listener to any local process: refused, naming the flag."""
    embedded_kafka.Secure.load_or_create(tmp_path)
    with pytest.raises(embedded_kafka.SecureMismatch, match="start it with --secure"):
        embedded_kafka.prepare(free_port(), tmp_path, secure=False)
    assert not (tmp_path / "server.properties").exists(), "no plain configuration written"


def test_no_password_is_on_a_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Any local user reads a process's command line (ps, /proc/*/cmdline): the storage
    format that writes the SCRAM users reads them from a file only its owner reads,
    removed once it ran, and the users it wrote log in."""
    started: list[tuple[str, str, dict[str, int]]] = []  # argv, /proc cmdline, @files' modes

    class Watched(subprocess.Popen):
        """The real child, its command line read as ps would while it runs."""

        def __init__(self, args: list[str], *more: object, **kw: object) -> None:
            super().__init__(args, *more, **kw)
            # Read once the exec has set the command line up (empty until then).
            listed = Path(f"/proc/{self.pid}/cmdline")
            cmdline = wait_until(listed.read_bytes, 10, "the child's command line")
            modes = {a: Path(a[1:]).stat().st_mode & 0o777 for a in args if a.startswith("@")}
            started.append((" ".join(args), cmdline.replace(b"\0", b" ").decode(), modes))

    monkeypatch.setattr(subprocess, "Popen", Watched)
    port = free_port()
    proc = embedded_kafka.start(port, tmp_path, secure=True)
    try:
        monkeypatch.undo()
        env = embedded_kafka.client_env(tmp_path, port)
        for mechanism in ("SCRAM-SHA-256", "SCRAM-SHA-512"):
            check_login(load_settings(env={**env, "DEJAQ_KAFKA_SASL_MECHANISM": mechanism}).kafka)
    finally:
        children.stop(proc)
    secure = embedded_kafka.Secure.load_or_create(tmp_path)
    assert len(started) == 2, started  # the storage format, then Kafka
    for argv, cmdline, _ in started:
        assert "java" in cmdline
        for secret in (secure.password, secure.broker_password):
            assert secret not in argv and secret not in cmdline
    formatted = started[0][2]
    assert list(formatted.values()) == [0o600], formatted
    assert not any(Path(f[1:]).exists() for f in formatted), "the argument file is left"
