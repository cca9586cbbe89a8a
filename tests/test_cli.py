"""The `dejaq` command as a user runs it: real processes, real ports."""

from __future__ import annotations

import datetime as dt
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import wait_until
from deltalake import CommitProperties, DeltaTable, Transaction
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from test_broker import buffer_rows, fill
from test_broker_cluster import follower, leader_of, start, stop

from dejaq.conf.tables import Table, table_path
from dejaq.jobs import cluster
from dejaq.jobs.children import wait_for_port
from dejaq.jobs.embedded_kafka import answers
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


def test_status_with_kafka_down_says_so_at_once(tmp_path: Path) -> None:
    nowhere = f"127.0.0.1:{free_port()}"
    env = {"DEJAQ_KAFKA_BOOTSTRAP": nowhere, "DEJAQ_WAREHOUSE": str(tmp_path / "wh")}
    started = time.monotonic()
    result = run("status", "--topic", "orders", env=env, timeout=60)
    took = time.monotonic() - started
    assert result.returncode == 1
    assert f"ingest lag  unknown: nothing listens at {nowhere}" in result.stdout
    assert took < 10, f"{took:.1f} s: Kafka's client waited out its own timeouts"


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
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    for i in range(5):
        producer.send("kept", f"m{i}".encode())
    producer.flush()
    producer.close()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
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


def test_invalid_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    conf = tmp_path / "bad.yaml"
    conf.write_text("kafka: {bootstrap: 1}\n")
    result = run("doctor", "--conf-file", str(conf))
    assert result.returncode == 2
    assert "kafka.bootstrap" in result.stderr


def status_conf(tmp_path: Path, bootstrap: str, *sources: str) -> Path:
    conf = tmp_path / "dejaq.yaml"
    conf.write_text(
        f"warehouse: {tmp_path / 'warehouse'}\n"
        f"kafka: {{bootstrap: '{bootstrap}'}}\n"
        f"topics:\n  - {{name: jobs, kind: priority, source: [{', '.join(sources)}], buckets: 2}}\n"
    )
    return conf


def test_status_says_a_source_topic_kafka_lacks_and_fails(
    tmp_path: Path, kafka_bootstrap: str, topic_factory
) -> None:
    """A misspelt source has no lag to show: unknown, not 0."""
    present = topic_factory(partitions=2)
    conf = status_conf(tmp_path, kafka_bootstrap, present, "no-such-topic")
    result = run("status", "--topic", "jobs", "--conf-file", str(conf), timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    said = f"ingest lag  unknown: Kafka at {kafka_bootstrap} has no source topic no-such-topic"
    assert said in result.stdout
    lines = [line.split() for line in result.stdout.splitlines() if line.startswith("  ")]
    assert lines == [[f"{present}/0", "0"], [f"{present}/1", "0"]]
    spelt_right = status_conf(tmp_path, kafka_bootstrap, present)
    assert run("status", "--topic", "jobs", "--conf-file", str(spelt_right)).returncode == 0


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
