"""The `dejaq` command as a user runs it: real processes, real ports."""

from __future__ import annotations

import datetime as dt
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import wait_until
from cryptography import x509
from deltalake import CommitProperties, DeltaTable, Transaction
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import KafkaError
from test_broker import buffer_rows, fill
from test_broker_cluster import follower, leader_of, start, stop

from dejaq.conf.tables import Table, checkpoint_path, table_path
from dejaq.jobs import cluster
from dejaq.jobs.certificates import hosts_of, new_authority
from dejaq.jobs.children import stop as stop_process
from dejaq.jobs.children import wait_for_port
from dejaq.jobs.embedded_kafka import _java, answers, prepare
from dejaq.jobs.ports import free_port
from dejaq.jobs.status import last_retention
from dejaq.pipelines.retention import APP_ID, OPERATION

DEJAQ = [sys.executable, "-m", "dejaq.jobs.cli"]


def run(
    *args: str, env: dict[str, str] | None = None, timeout: float = 180
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*DEJAQ, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    "command",
    [
        [],
        ["kafka"],
        ["doctor"],
        ["demo"],
        ["ingest"],
        ["release"],
        ["status"],
        ["broker"],
        ["cluster"],
        ["dead"],
        ["quarantine"],
        ["keys"],
        ["certs"],
        ["redrive"],
        ["pause"],
        ["purge"],
    ],
)
def test_help_everywhere(command: list[str]) -> None:
    result = run(*command, "--help")
    assert result.returncode == 0
    assert "usage: dejaq" in result.stdout


def test_unknown_command_is_a_usage_error() -> None:
    result = run("frobnicate")
    assert result.returncode == 2
    assert "invalid choice" in result.stderr


def test_unknown_topic_names_the_configured_ones() -> None:
    result = run("status", "--topic", "nope")
    assert result.returncode == 2
    assert "unknown topic 'nope' (configured: orders, reminders)" in result.stderr


def test_a_command_sends_no_key_in_clear_beyond_loopback_unless_allowed() -> None:
    """The key would cross the network in clear: refused as a usage error before any
    connection; with --insecure-http the command goes on to look for the node (192.0.2.1,
    a documentation address, answers nothing)."""
    node = "http://192.0.2.1:8441"
    env = {"DEJAQ_TOKEN": "dq_x_y"}
    refused = run("pause", "--topic", "orders", "--broker", node, env=env, timeout=60)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"{node}: the API key would cross the network in clear" in refused.stderr
    assert "--insecure-http" in refused.stderr
    allowed = run(
        "pause", "--topic", "orders", "--broker", node, "--insecure-http", env=env, timeout=60
    )
    assert allowed.returncode == 1, allowed.stdout + allowed.stderr
    assert f"no broker node answers at {node}" in allowed.stderr


def test_status_with_kafka_down_says_so_at_once(tmp_path: Path) -> None:
    nowhere = f"127.0.0.1:{free_port()}"
    env = {"DEJAQ_KAFKA_BOOTSTRAP": nowhere, "DEJAQ_WAREHOUSE": str(tmp_path / "wh")}
    result = run("status", "--topic", "orders", env=env, timeout=60)
    assert result.returncode == 1
    # Said of the probe's refused connection, not of Kafka's client waiting out its timeouts.
    assert f"ingest lag  unknown: nothing listens at {nowhere}" in result.stdout


def start_kafka(port: int, data_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [*DEJAQ, "kafka", "--port", str(port), "--data-dir", str(data_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_port(port, timeout=90, proc=proc)
    wait_until(lambda: answers(f"127.0.0.1:{port}"), timeout=90, what="Kafka to answer")
    return proc


def test_kafka_serves_stops_on_sigterm_and_keeps_its_data(tmp_path: Path) -> None:
    port, data_dir = free_port(), tmp_path / "kafka"
    bootstrap = f"127.0.0.1:{port}"
    proc = start_kafka(port, data_dir)
    try:
        producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
        for i in range(5):
            producer.send("kept", f"m{i}".encode())
        producer.flush()
        producer.close()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:  # a failure before its SIGTERM was answered
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert f"kafka bootstrap: {bootstrap}" in out
    assert "kafka stopped" in out
    assert not err.strip(), err
    assert "Kafka Server started" in (data_dir / "kafka.log").read_text()

    proc = start_kafka(port, data_dir)
    try:
        consumer = KafkaConsumer(bootstrap_servers=bootstrap)
        tp = TopicPartition("kept", 0)
        assert consumer.end_offsets([tp])[tp] == 5
        consumer.close()
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_kafka_refuses_a_busy_port(tmp_path: Path, kafka_bootstrap: str) -> None:
    if "DEJAQ_KAFKA_BOOTSTRAP" in os.environ:
        pytest.skip("needs the embedded broker's port")
    port = kafka_bootstrap.rsplit(":", 1)[1]
    result = run("kafka", "--port", port, "--data-dir", str(tmp_path / "k"), timeout=60)
    assert result.returncode == 1
    assert f"127.0.0.1:{port} is already in use" in result.stderr


def test_doctor_reports_connectors_and_kafka(kafka_bootstrap: str) -> None:
    result = run("doctor", env={"DEJAQ_KAFKA_BOOTSTRAP": kafka_bootstrap})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "java     ok" in result.stdout
    assert "Kafka: JVM (format 'kafka')" in result.stdout
    assert "Delta: JVM (format 'delta')" in result.stdout
    assert "delta 4.4.0" in result.stdout
    assert "spark-sql-kafka 4.2.0" in result.stdout
    assert "embedded Kafka: kafka_2.13-4.4.0.jar" in result.stdout
    assert f"kafka    ok   {kafka_bootstrap} answers" in result.stdout


def test_doctor_prints_its_report_and_nothing_else(kafka_bootstrap: str, tmp_path: Path) -> None:
    """Spark's start-up lines go to a log that is removed once Spark has started, and the
    default warehouse (./warehouse) shows as the folder the jobs would write to."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    result = subprocess.run(
        [*DEJAQ, "doctor"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env={**os.environ, "DEJAQ_KAFKA_BOOTSTRAP": kafka_bootstrap, "TMPDIR": str(temp)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr == ""
    labels = [line.split()[0] for line in result.stdout.splitlines() if not line.startswith(" ")]
    assert labels == ["python", "java", "spark", "jars", "kafka", "warehouse", "platform"]
    assert f"warehouse {tmp_path / 'warehouse'}\n" in result.stdout
    assert list(temp.glob("dejaq-doctor-*")) == []


def test_doctor_without_jars_reports_the_python_fallback(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    env = {"DEJAQ_KAFKA_BOOTSTRAP": kafka_bootstrap, "DEJAQ_JARS_DIR": str(tmp_path)}
    result = run("doctor", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Kafka: Python on kafka-python (dejaq_kafka)" in result.stdout
    assert "Delta: Python on delta-rs (dejaq_delta)" in result.stdout
    assert "delta not on the classpath" in result.stdout


def test_doctor_fails_when_jvm_connectors_are_required_but_absent(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    env = {
        "DEJAQ_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "DEJAQ_JARS_DIR": str(tmp_path),
        "DEJAQ_SPARK_CONNECTORS": "jvm",
    }
    result = run("doctor", env=env)
    assert result.returncode == 1
    assert "FAIL spark.connectors is 'jvm' but Spark lacks" in result.stdout
    assert "make test" in result.stdout


def test_doctor_fails_when_kafka_does_not_answer() -> None:
    result = run("doctor", env={"DEJAQ_KAFKA_BOOTSTRAP": f"127.0.0.1:{free_port()}"})
    assert result.returncode == 1
    assert "kafka    FAIL" in result.stdout


@pytest.fixture(scope="module")
def kafka_advertising_nowhere(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The bootstrap of a real embedded Kafka whose advertised listener is a closed port.

    Started from `dejaq kafka`'s own configuration and command line, its advertised
    address changed: `dejaq kafka` itself waits for an answer this broker never gives.
    """
    port, data_dir = free_port(), tmp_path_factory.mktemp("kafka-nowhere")
    config = prepare(port, data_dir)
    settings = config.read_text().replace(
        f"advertised.listeners=PLAINTEXT://127.0.0.1:{port}",
        f"advertised.listeners=PLAINTEXT://127.0.0.1:{free_port()}",
    )
    assert settings != config.read_text()
    config.write_text(settings)
    proc = subprocess.Popen(
        _java(data_dir.resolve(), "kafka.Kafka", str(config)),
        stdout=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )
    bootstrap = f"127.0.0.1:{port}"

    def bootstraps() -> bool:
        try:
            KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=2000).close()
        except KafkaError:
            return False
        return True

    try:
        wait_for_port(port, timeout=90, proc=proc)
        wait_until(bootstraps, timeout=90, what="Kafka's bootstrap to answer")
        yield bootstrap
    finally:
        stop_process(proc)


def test_doctor_and_status_say_kafka_advertises_an_address_they_cannot_reach(
    kafka_advertising_nowhere: str, tmp_path: Path
) -> None:
    """The bootstrap answers, the advertised address not: a FAIL line each, no traceback;
    doctor goes on to its other checks."""
    bootstrap = kafka_advertising_nowhere
    said = f"{bootstrap} answers, but its brokers' advertised addresses do not ("
    doctor = run("doctor", env={"DEJAQ_KAFKA_BOOTSTRAP": bootstrap})
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    assert f"kafka    FAIL {said}" in doctor.stdout, doctor.stdout + doctor.stderr
    assert "Traceback" not in doctor.stderr, doctor.stderr
    labels = [line.split()[0] for line in doctor.stdout.splitlines() if not line.startswith(" ")]
    assert labels[-3:] == ["kafka", "warehouse", "platform"], doctor.stdout

    conf = status_conf(tmp_path, bootstrap, "orders")
    status = run("status", "--topic", "jobs", "--conf-file", str(conf), timeout=60)
    assert status.returncode == 1, status.stdout + status.stderr
    assert f"ingest lag  unknown: {said}" in status.stdout, status.stdout + status.stderr
    assert "Traceback" not in status.stderr, status.stderr
    assert "buffer      no table yet" in status.stdout


def test_invalid_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    conf = tmp_path / "bad.yaml"
    conf.write_text("kafka: {bootstrap: 1}\n")
    result = run("doctor", "--conf-file", str(conf))
    assert result.returncode == 2
    assert "kafka.bootstrap" in result.stderr


@pytest.mark.parametrize("job", ["ingest", "release"])
def test_a_spark_master_spark_cannot_start_ends_the_job_with_one_line(
    tmp_path: Path, job: str
) -> None:
    """The reason Spark's launcher gives comes first (its own lines); then one line
    naming the setting, not a Python traceback."""
    conf = tmp_path / "dejaq.yaml"
    conf.write_text(
        f"warehouse: {tmp_path / 'warehouse'}\n"
        "spark: {master: 'locl[2]'}\n"
        "topics:\n  - {name: jobs, kind: priority, source: [in], delivery: release, output: out}\n"
    )
    result = run(job, "--topic", "jobs", "--conf-file", str(conf), "--once", timeout=120)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: Spark did not start (spark.master 'locl[2]'): "), last


def status_conf(tmp_path: Path, bootstrap: str, *sources: str) -> Path:
    conf = tmp_path / "dejaq.yaml"
    conf.write_text(
        f"warehouse: {tmp_path / 'warehouse'}\n"
        f"kafka: {{bootstrap: '{bootstrap}'}}\n"
        f"topics:\n  - {{name: jobs, kind: priority, source: [{', '.join(sources)}], buckets: 2}}\n"
    )
    return conf


def test_status_says_a_source_topic_kafka_lacks(
    tmp_path: Path, kafka_bootstrap: str, topic_factory
) -> None:
    """A source not made yet, or misspelt, has no lag to show: unknown, not 0. No failed
    check: the ingest waits for it (the quick start asks for status before producing)."""
    present = topic_factory(partitions=2)
    conf = status_conf(tmp_path, kafka_bootstrap, present, "no-such-topic")
    result = run("status", "--topic", "jobs", "--conf-file", str(conf), timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    said = f"ingest lag  unknown: Kafka at {kafka_bootstrap} has no source topic no-such-topic"
    assert said in result.stdout
    lines = [line.split() for line in result.stdout.splitlines() if line.startswith("  ")]
    assert lines == [[f"{present}/0", "0"], [f"{present}/1", "0"]]
    spelt_right = status_conf(tmp_path, kafka_bootstrap, present)
    assert run("status", "--topic", "jobs", "--conf-file", str(spelt_right)).returncode == 0


def test_status_reads_the_last_committed_batch_of_the_offsets_log_as_the_ingest_does(
    tmp_path: Path, kafka_bootstrap: str, topic_factory
) -> None:
    """The lag counts from the last batch Spark committed (one planned and not committed
    yet is not done), and an offsets log entry of another layout than the ingest reads
    is refused by the same name, lag unknown, rather than misread."""
    source = topic_factory(partitions=2)
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    for i in range(5):
        producer.send(source, f"m{i}".encode(), partition=0)
    producer.flush()
    producer.close()
    conf = status_conf(tmp_path, kafka_bootstrap, source)
    checkpoint = Path(checkpoint_path(str(tmp_path / "warehouse"), "ingest", "jobs"))
    (checkpoint / "offsets").mkdir(parents=True)
    (checkpoint / "commits").mkdir()
    meta = '{"batchWatermarkMs":0,"batchTimestampMs":0}'
    (checkpoint / "offsets" / "0").write_text(f'v1\n{meta}\n{{"{source}":{{"0":3,"1":0}}}}\n')
    (checkpoint / "commits" / "0").write_text('v1\n{"nextBatchWatermarkMs":0}\n')
    (checkpoint / "offsets" / "1").write_text(f'v1\n{meta}\n{{"{source}":{{"0":5,"1":0}}}}\n')
    result = run("status", "--topic", "jobs", "--conf-file", str(conf), timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ingest lag  2" in result.stdout, result.stdout
    (checkpoint / "offsets" / "1").write_text(f'v2\n{meta}\n{{"{source}":{{"0":5,"1":0}}}}\n')
    (checkpoint / "commits" / "1").write_text('v1\n{"nextBatchWatermarkMs":0}\n')
    result = run("status", "--topic", "jobs", "--conf-file", str(conf), timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    said = f"ingest lag  unknown: {checkpoint}/offsets/1 is not an offsets log entry"
    assert said in result.stdout, result.stdout + result.stderr


def test_status_names_a_cron_schedule_whose_occurrences_are_late_and_fails(
    tmp_path: Path, kafka_bootstrap: str, topic_factory
) -> None:
    """A cron topic's status counts its schedules and names one whose next occurrence is
    past and unsent (no leader materialising, or Kafka refusing it), exit 1; one sent
    ahead, or ended, is no failure."""
    from dejaq.broker.state.schedules import Schedule, ScheduleStore

    source = topic_factory()
    conf = tmp_path / "dejaq.yaml"
    conf.write_text(
        f"warehouse: {tmp_path / 'warehouse'}\n"
        f"kafka: {{bootstrap: '{kafka_bootstrap}'}}\n"
        f"topics:\n  - {{name: ticks, kind: cron, source: [{source}], output: out}}\n"
    )
    result = run("status", "--topic", "ticks", "--conf-file", str(conf), timeout=60)
    assert "schedules   none yet" in result.stdout and result.returncode == 0, result.stdout
    now = int(time.time() * 1000)
    hour = 3600 * 1000
    store = ScheduleStore(str(tmp_path / "warehouse"), "ticks")
    for schedule_id, sent, end in (
        ("hourly-late", now - 3 * hour, None),
        ("hourly-ahead", now + hour, None),
        ("ended", now - 3 * hour, now - 3 * hour),
    ):
        schedule = Schedule(schedule_id, "0 * * * *", "UTC", None, b"x", end_at=end)
        store.add(Schedule(**{**schedule.__dict__, "created_at": now - 4 * hour}))
        store.advance({(schedule_id, now - 4 * hour): sent})
    result = run("status", "--topic", "ticks", "--conf-file", str(conf), timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "schedules   3, 1 behind" in result.stdout, result.stdout
    named = [line for line in result.stdout.splitlines() if line.startswith("  hourly")]
    assert len(named) == 1 and named[0].startswith("  hourly-late (due "), result.stdout


def test_status_finds_a_retention_run_older_than_the_commits_it_reads(tmp_path: Path) -> None:
    """Retention commits its watermark with every run: a run further back than the
    commits looked at is still a run, not none."""
    warehouse = str(tmp_path / "warehouse")
    fill(warehouse, "jobs", buffer_rows([1, 2]))
    path = table_path(warehouse, Table.BUFFER, "jobs")
    assert last_retention(path) == "none yet"
    buffer = DeltaTable(path)
    cutoff = int(dt.datetime(2030, 1, 2, 3, 4, 5, tzinfo=dt.UTC).timestamp() * 1000)
    run = CommitProperties(
        app_transactions=[Transaction(APP_ID, cutoff)], custom_metadata={OPERATION: "0"}
    )
    buffer.create_write_transaction(
        [], mode="append", schema=buffer.schema(), commit_properties=run
    )
    assert "removed 0 settled" in last_retention(path)
    for i in range(3):
        fill(warehouse, "jobs", buffer_rows([3], prefix=f"later{i}-"))
    assert last_retention(path, look_back=3) == (
        "not in the last 3 commits; everything settled before 2030-01-02 03:04:05 UTC is gone"
    )


def test_status_with_a_node_down_names_it_and_fails(
    tmp_path: Path, kafka_bootstrap: str, kafka_source: str
) -> None:
    conf = status_conf(tmp_path, kafka_bootstrap, kafka_source)
    nodes = start(tmp_path, conf)
    try:
        with httpx.Client(timeout=10) as client:
            down = follower(nodes, client)
            alive = leader_of(nodes, client)
        assert alive is not None
        cluster.stop_node(down, kill=True)  # gone without leaving: still registered
        result = run("status", "--topic", "jobs", "--conf-file", str(conf), "--broker", alive.url)
    finally:
        stop(nodes)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{down.http} " in result.stdout and "unreachable" in result.stdout
    assert "ingest lag  0" in result.stdout  # the rest is still shown


def test_status_fails_while_no_node_can_serve_and_passes_once_all_serve(
    tmp_path: Path, kafka_bootstrap: str, kafka_source: str
) -> None:
    """A node answers /v1/cluster also when it cannot serve: status reads its /readyz too.
    One node of three up knows of no Raft leader: exit 1, naming why (the cluster lists
    no node then, as none registered: the node asked is shown); with the other two up,
    every node ready, exit 0."""
    conf = status_conf(tmp_path, kafka_bootstrap, kafka_source)
    env = {**os.environ, "DEJAQ_BROKER_RAFT_PASSWORD": secrets.token_hex(8)}
    nodes = cluster.plan(3, tmp_path / "raft")
    alone = nodes[0]
    status = ["status", "--topic", "jobs", "--conf-file", str(conf), "--broker", alone.url]
    try:  # a new cluster's nodes, started one by one: each bootstraps it
        cluster.start_node(alone, nodes, str(conf), env, new_cluster=True)
        wait_for_port(int(alone.http.rsplit(":", 1)[1]), timeout=90, proc=alone.proc)
        lone = run(*status, timeout=60)
        for node in nodes[1:]:
            cluster.start_node(node, nodes, str(conf), env, new_cluster=True)
        cluster.wait_ready(nodes)
        serving = run(*status, timeout=60)
    finally:
        stop(nodes)
    assert lone.returncode == 1, lone.stdout + lone.stderr
    assert re.search(r"  n1 +(follower|candidate) .*\n +NOT READY: no Raft leader", lone.stdout)
    assert "NO RAFT LEADER" in lone.stdout, lone.stdout
    assert "ingest lag  0" in lone.stdout  # the rest is still shown
    assert serving.returncode == 0, serving.stdout + serving.stderr
    shown = re.findall(r"^  (n\d) +(\w+) ", serving.stdout, re.MULTILINE)
    assert sorted(n for n, _ in shown) == ["n1", "n2", "n3"], serving.stdout
    assert [r for _, r in shown].count("leader") == 1, serving.stdout
    assert "NOT READY" not in serving.stdout and "LEADER" not in serving.stdout


def test_status_fails_on_a_node_whose_readiness_names_an_alert(
    tmp_path: Path, kafka_bootstrap: str, kafka_source: str
) -> None:
    """A node short of disk stays ready (200) while new messages wait in the buffer; its
    /readyz status says so, and status shows it and exits 1. A disk reserve above the
    free space stands in for a full disk."""
    beyond = shutil.disk_usage(tmp_path).free + (1 << 40)
    conf = status_conf(tmp_path, kafka_bootstrap, kafka_source)
    conf.write_text(conf.read_text() + f"broker: {{disk_reserve_bytes: {beyond}}}\n")
    nodes = start(tmp_path, conf, n=1)
    try:
        fill(str(tmp_path / "warehouse"), "jobs", buffer_rows([1, 2]))
        wait_until(
            lambda: "disk_reserve_bytes" in httpx.get(f"{nodes[0].url}/readyz").text,
            what="the node short of disk",
        )
        status = ["status", "--topic", "jobs", "--conf-file", str(conf)]
        result = run(*status, "--broker", nodes[0].url, timeout=60)
    finally:
        stop(nodes)
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(r"  n1 +leader .*\n +READY WITH ALERTS: jobs: ", result.stdout)
    assert "broker.disk_reserve_bytes" in result.stdout, result.stdout


def test_certs_refuses_a_ca_at_or_near_its_end(tmp_path: Path) -> None:
    """What such a CA signed would stop working within weeks, or at once."""
    for days, state in ((10, "expires"), (0, "expired")):
        pki = tmp_path / f"pki-{days}"
        ca = new_authority(pki, days=days).cert.read_bytes()
        result = run("certs", str(pki), "127.0.0.1")
        assert result.returncode == 1, result.stdout
        assert f"error: the CA {pki / 'ca.pem'} {state} " in result.stderr
        assert "make a new CA" in result.stderr
        assert (pki / "ca.pem").read_bytes() == ca and not (pki / "node.pem").exists()
    fresh = run("certs", str(tmp_path / "pki"), "127.0.0.1")
    assert fresh.returncode == 0, fresh.stderr
    ca = x509.load_pem_x509_certificate((tmp_path / "pki" / "ca.pem").read_bytes())
    node = x509.load_pem_x509_certificate((tmp_path / "pki" / "node.pem").read_bytes())
    assert ca.not_valid_after_utc - dt.datetime.now(dt.UTC) > dt.timedelta(days=3000)
    assert node.not_valid_after_utc <= ca.not_valid_after_utc


def test_certs_for_a_second_host_keep_the_first_hosts(tmp_path: Path) -> None:
    """One CA signs every node's certificate; one node's is not replaced by another's."""
    pki = tmp_path / "pki"
    assert run("certs", str(pki), "127.0.0.1").returncode == 0
    first = (pki / "node.pem").read_bytes(), (pki / "node-key.pem").read_bytes()
    other = run("certs", str(pki), "b2.example.com")
    assert other.returncode == 1
    assert f"{pki / 'node.pem'} is the certificate of 127.0.0.1" in other.stderr
    assert "--name" in other.stderr and "--force" in other.stderr
    assert ((pki / "node.pem").read_bytes(), (pki / "node-key.pem").read_bytes()) == first
    named = run("certs", str(pki), "b2.example.com", "--name", "b2")
    assert named.returncode == 0, named.stderr
    assert hosts_of(pki / "b2.pem") == {"b2.example.com"}
    assert hosts_of(pki / "node.pem") == {"127.0.0.1"}
    ca = x509.load_pem_x509_certificate((pki / "ca.pem").read_bytes())
    for name in ("node", "b2"):
        issued = x509.load_pem_x509_certificate((pki / f"{name}.pem").read_bytes())
        issued.verify_directly_issued_by(ca)  # raises if another CA's
    again = run("certs", str(pki), "127.0.0.1")  # the same host's, issued again
    assert again.returncode == 0 and (pki / "node.pem").read_bytes() != first[0]
    forced = run("certs", str(pki), "b3.example.com", "--force")
    assert forced.returncode == 0 and hosts_of(pki / "node.pem") == {"b3.example.com"}
    assert run("certs", str(pki), "x", "--name", "ca").returncode == 2  # not the CA's files
    assert x509.load_pem_x509_certificate((pki / "ca.pem").read_bytes()) == ca


@pytest.mark.parametrize(
    "args",
    [
        ["kafka", "--port", "99999"],
        ["s3", "--port", "99999"],
        ["kafka", "--port", "0"],
        ["cluster", "up", "--http-port", "70000"],
        ["cluster", "up", "--raft-port", "-1"],
        ["cluster", "up", "--nodes", "3", "--http-port", "65534"],
        ["broker", "--node-id", "n1", "--http", "127.0.0.1:99999", "--raft", "127.0.0.1:8101"],
        ["broker", "--node-id", "n1", "--http", "127.0.0.1:8001", "--raft", "127.0.0.1:0"],
        [
            "broker",
            "--node-id",
            "n1",
            "--http",
            "127.0.0.1:8001",
            "--raft",
            "127.0.0.1:8101",
            "--peers",
            "127.0.0.1:8102,127.0.0.1:70000",
        ],
        [
            "broker",
            "--node-id",
            "n1",
            "--http",
            "127.0.0.1:8001",
            "--advertise",
            "b1.example.com:65536",
            "--raft",
            "127.0.0.1:8101",
        ],
    ],
)
def test_a_port_outside_1_to_65535_is_a_usage_error(args: list[str], tmp_path: Path) -> None:
    """The kernel wraps a larger port modulo 65536 (99999 listens on 34463) or refuses it
    with a traceback: every command refuses it before it starts anything."""
    result = run(*args, "--data-dir", str(tmp_path / "d"), timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert re.search(r"port|65535", result.stderr.strip().splitlines()[-1]), result.stderr
    assert not list(tmp_path.iterdir()), "nothing started"


def test_a_broker_whose_http_port_is_taken_exits_1_naming_it(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        http = f"127.0.0.1:{taken.getsockname()[1]}"
        result = run(
            "broker",
            "--node-id",
            "n1",
            "--http",
            http,
            "--raft",
            f"127.0.0.1:{free_port()}",
            "--data-dir",
            str(tmp_path / "n1"),
            env={"DEJAQ_KAFKA_BOOTSTRAP": "127.0.0.1:9", "DEJAQ_WAREHOUSE": str(tmp_path)},
            timeout=60,
        )
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [f"error: --http {http} is already in use"]
    assert "listening" not in result.stdout
