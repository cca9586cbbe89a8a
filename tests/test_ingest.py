"""Ingest end to end: real Kafka in, real Delta tables out, real job processes killed."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from conftest import buffer_names, run_to_end, wait_until
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame
from test_broker import buffer_rows, fill

from dejaq.broker.state.leases import TopicState
from dejaq.broker.storage.index import TopicIndex
from dejaq.broker.storage.ledger_writer import checkpoint
from dejaq.conf import jvm
from dejaq.conf.settings import Settings, load_settings
from dejaq.conf.tables import (
    BUFFER_SCHEMA,
    KIND_PROPERTY,
    LEDGER_SCHEMA,
    KindChanged,
    LedgerEvent,
    Table,
    ensure_buffer,
    ensure_table,
    scan,
    table_path,
)
from dejaq.jobs.ingest import summary
from dejaq.jobs.logs import query_failure
from dejaq.jobs.status import row_count
from dejaq.pipelines import ingest as ingest_module
from dejaq.pipelines.dedup import IN_BUFFER, SETTLED
from dejaq.pipelines.delta_follower import DeltaFollower
from dejaq.pipelines.delta_source import SecondWriter
from dejaq.pipelines.ingest import STATS_KEPT, BatchStats, CheckpointBehind, IngestJob
from dejaq.pipelines.ingest_resume import CannotResume, Resume, offset_app_id, positions, resume
from dejaq.pipelines.pending import PendingSet
from dejaq.pipelines.retention import retain
from dejaq.pipelines.session import detect_connectors

DEJAQ = [sys.executable, "-m", "dejaq.jobs.cli"]


def write_conf(tmp_path: Path, bootstrap: str, source: str, kind: str = "priority") -> Path:
    conf = tmp_path / "dejaq.yaml"
    conf.write_text(
        f"warehouse: {tmp_path / 'warehouse'}\n"
        f"kafka: {{bootstrap: '{bootstrap}'}}\n"
        f"topics:\n  - {{name: jobs, kind: {kind}, source: [{source}], buckets: 4,"
        f" max_payload_bytes: 100}}\n"
    )
    return conf


def produce(
    bootstrap: str,
    topic: str,
    records: list[tuple[bytes, bytes, dict[str, bytes]]],
    partitions: int = 3,
    timestamp_ms: int | None = None,
):
    """`records` spread over `partitions` in turn, with `timestamp_ms` (else the producer's
    time)."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    for i, (key, value, headers) in enumerate(records):
        producer.send(
            topic,
            key=key,
            value=value,
            headers=list(headers.items()),
            partition=i % partitions,
            timestamp_ms=timestamp_ms,
        )
    producer.flush()
    producer.close()


def table(settings: Settings, kind: Table, topic: str = "jobs") -> pa.Table:
    path = table_path(settings.warehouse, kind, topic)
    return scan(path, kind) if DeltaTable.is_deltatable(path) else pa.table({})


def coordinates(t: pa.Table) -> list[tuple[str, int, int]]:
    if t.num_rows == 0:
        return []
    cols = [t.column(c).to_pylist() for c in ("source_topic", "source_partition", "source_offset")]
    return list(zip(*cols, strict=True))


def good(i: int) -> tuple[bytes, bytes, dict[str, bytes]]:
    return (
        f"k{i % 7}".encode(),
        f"payload-{i}".encode(),
        {"dejaq-priority": str(i % 100).encode()},
    )


def test_the_summary_at_exit_counts_every_batch_not_only_those_kept(tmp_path) -> None:
    """A job runs far more batches than it keeps stats of (minutes of a busy ingest):
    what its first batches took in still counts in the line it prints at exit."""
    settings = load_settings(write_conf(tmp_path, "127.0.0.1:9", "in"))
    job = IngestJob(None, settings, settings.topic("jobs"), None)  # type: ignore[arg-type]
    job._note(BatchStats(0, rows_in=100, buffered=90, quarantined=10, millis=5))
    job._note(BatchStats(1, 0, 0, 0, millis=1, replay=True))
    for batch_id in range(2, STATS_KEPT + 500):
        job._note(BatchStats(batch_id, rows_in=1, buffered=1, quarantined=0, millis=5))
    assert len(job.stats) == STATS_KEPT and job.stats[0].batch_id > 1, "the first not kept"
    assert summary("jobs", job) == (
        f"ingest jobs: {STATS_KEPT + 500} batches, in {STATS_KEPT + 598}, "
        f"buffered {STATS_KEPT + 588}, quarantined 10"
    )


@pytest.mark.parametrize("connectors", ["jvm", "python"])
def test_once_lands_good_and_bad_records_exactly_once(
    spark, kafka_bootstrap, topic_factory, tmp_path, connectors
):
    source = topic_factory(partitions=3)
    settings = load_settings(write_conf(tmp_path, kafka_bootstrap, source), env={})
    bad = [
        (b"k", b"x", {}),
        (b"k", b"x", {"dejaq-priority": b"urgent"}),
        (b"k", b"x", {"dejaq-priority": b"70000"}),
        (b"k", b"x" * 101, {"dejaq-priority": b"1"}),
        (b"k", b"x", {"dejaq-priority": b"1", "dejaq-id": b"\xff"}),
        (b"k", b"first", {"dejaq-priority": b"1", "dejaq-id": b"dup"}),
        (b"k", b"second", {"dejaq-priority": b"1", "dejaq-id": b"dup"}),
    ]
    records = [good(i) for i in range(60)] + bad
    produce(kafka_bootstrap, source, records)

    job = IngestJob(
        spark,
        settings,
        settings.topic("jobs"),
        detect_connectors(spark, connectors),
        max_offsets_per_trigger=20,
    )
    run_to_end(job.start(once=True))

    buffer, quarantine = table(settings, Table.BUFFER), table(settings, Table.QUARANTINE)
    assert buffer.num_rows + quarantine.num_rows == len(records), "in = buffer + quarantine"
    assert len(job.stats) > 1, "several micro-batches"
    assert sum(s.rows_in for s in job.stats) == len(records)
    assert sorted(Counter(quarantine.column("reason").to_pylist()).items()) == [
        ("duplicate", 1),
        ("invalid_id", 1),
        ("invalid_priority", 1),
        ("missing_priority", 1),
        ("payload_too_large", 1),
        ("priority_out_of_range", 1),
    ]
    assert len(set(coordinates(buffer) + coordinates(quarantine))) == len(records)
    ids = buffer.column("message_id").to_pylist()
    assert ids.count("dup") == 1 and len(ids) == len(set(ids))
    kept = buffer.filter(pa.compute.equal(buffer.column("message_id"), "dup"))
    quarantined_dup = quarantine.filter(pa.compute.equal(quarantine.column("reason"), "duplicate"))
    # first wins: the dup pair went to different partitions, so compare by produce order
    assert {kept.column("payload")[0].as_py(), quarantined_dup.column("value")[0].as_py()} == {
        b"first",
        b"second",
    }

    # Running again finds nothing new, and records produced later come in once.
    produce(kafka_bootstrap, source, [good(i) for i in range(100, 110)])
    run_to_end(job.start(once=True))
    assert table(settings, Table.BUFFER).num_rows == buffer.num_rows + 10
    assert row_count(table_path(settings.warehouse, Table.BUFFER, "jobs")) == buffer.num_rows + 10


@pytest.mark.parametrize("connectors", ["jvm", "python"])
def test_a_deleted_checkpoint_resumes_where_the_buffer_left_kafka(
    spark, kafka_bootstrap, topic_factory, tmp_path, connectors
):
    """The checkpoint is deleted between two runs (a Spark upgrade, a corrupt file): the
    next run numbers its batches from 0 again and reads Kafka from where the buffer's
    last batch left it, so the records produced since land, and none lands twice."""
    source = topic_factory(partitions=3)
    settings = load_settings(write_conf(tmp_path, kafka_bootstrap, source), env={})
    topic = settings.topic("jobs")
    first = [good(i) for i in range(40)] + [(b"k", b"no priority", {})]
    produce(kafka_bootstrap, source, first)

    def run() -> IngestJob:
        job = IngestJob(
            spark, settings, topic, detect_connectors(spark, connectors), max_offsets_per_trigger=9
        )
        run_to_end(job.start(once=True))
        return job

    ran = run()
    assert len(ran.stats) > 1, "several batches, so the next run's first ids are taken"
    landed = coordinates(table(settings, Table.BUFFER)) + coordinates(
        table(settings, Table.QUARANTINE)
    )
    assert len(landed) == len(first)
    shutil.rmtree(ran.checkpoint)
    later = [good(i) for i in range(100, 120)] + [(b"k", b"x", {"dejaq-priority": b"urgent"})]
    produce(kafka_bootstrap, source, later)

    run()

    buffer, quarantine = table(settings, Table.BUFFER), table(settings, Table.QUARANTINE)
    landed = coordinates(buffer) + coordinates(quarantine)
    assert len(landed) == len(set(landed)) == len(first) + len(later), "each record once"
    assert sorted(quarantine.column("reason").to_pylist()) == [
        "invalid_priority",
        "missing_priority",
    ]
    good_payloads = sorted(v for _, v, _ in first + later if v.startswith(b"payload-"))
    assert sorted(buffer.column("payload").to_pylist()) == good_payloads


def produce_transaction(
    bootstrap: str,
    topic: str,
    records: list[tuple[bytes, bytes, dict[str, bytes]]],
    commit: bool,
    partitions: int = 3,
) -> None:
    """`records` in one Kafka transaction, committed or aborted once they are all sent."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, transactional_id=uuid.uuid4().hex)
    try:
        producer.init_transactions()
        producer.begin_transaction()
        for i, (key, value, headers) in enumerate(records):
            producer.send(
                topic, key=key, value=value, headers=list(headers.items()), partition=i % partitions
            )
        producer.flush()
        if commit:
            producer.commit_transaction()
        else:
            producer.abort_transaction()
    finally:
        producer.close()


def crash_before_sparks_commit(checkpoint: str, batch_id: int) -> None:
    """The checkpoint as a driver leaves it that died after the tables' commits of batch
    `batch_id` and before Spark's own: the next start replays the batch, over the Kafka
    range its offsets log planned."""
    for name in (str(batch_id), f".{batch_id}.crc"):
        (Path(checkpoint) / "commits" / name).unlink(missing_ok=True)


@pytest.mark.parametrize("connectors", ["jvm", "python"])
def test_records_of_an_aborted_transaction_are_not_ingested(
    spark, kafka_bootstrap, topic_factory, tmp_path, connectors
):
    """A producer's transaction aborted, and the same messages committed by its retry at
    later offsets: only the committed ones land. Read, the aborted ones would be
    delivered too, under default ids of other offsets, which no dedup can match."""
    source = topic_factory(partitions=3)
    settings = load_settings(write_conf(tmp_path, kafka_bootstrap, source), env={})
    records = [good(i) for i in range(12)]
    produce_transaction(kafka_bootstrap, source, records, commit=False)
    produce_transaction(kafka_bootstrap, source, records, commit=True)

    def ingest() -> IngestJob:
        job = IngestJob(
            spark, settings, settings.topic("jobs"), detect_connectors(spark, connectors)
        )
        run_to_end(job.start(once=True))
        return job

    job = ingest()

    buffer = table(settings, Table.BUFFER)
    assert table(settings, Table.QUARANTINE).num_rows == 0
    assert sorted(buffer.column("payload").to_pylist()) == sorted(v for _, v, _ in records)
    assert sum(s.rows_in for s in job.stats) == len(records)
    # Each partition: 4 aborted records, the abort marker, 4 records, the commit marker.
    # The buffer records where the batch's range ends, past the marker no record carries:
    # a replay of the batch, whose records end before it, is that batch.
    recorded = DeltaTable(table_path(settings.warehouse, Table.BUFFER, "jobs"))
    at = {p: recorded.transaction_version(offset_app_id(job.app_id, (source, p))) for p in range(3)}
    assert at == dict.fromkeys(range(3), 10)
    last = job.stats[-1].batch_id
    crash_before_sparks_commit(job.checkpoint, last)
    assert [(s.batch_id, s.replay) for s in ingest().stats] == [(last, True)]
    assert table(settings, Table.BUFFER).num_rows == len(records)


# Compacted, and cleaned as soon as a segment is closed: a record whose key is written
# again in a later closed segment is removed within the log cleaner's next round.
COMPACTED = {
    "cleanup.policy": "compact",
    "segment.ms": "60000",
    "min.cleanable.dirty.ratio": "0.01",
    "min.compaction.lag.ms": "0",
}


def offsets_in(bootstrap: str, topic: str, end: int) -> list[int]:
    """The offsets partition 0 of `topic` holds below `end`, read from its start."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        found: list[int] = []
        while consumer.position(tp) < end:
            found += [r.offset for r in consumer.poll(timeout_ms=1000).get(tp, [])]
        return [o for o in found if o < end]
    finally:
        consumer.close()


@pytest.mark.parametrize("connectors", ["jvm", "python"])
def test_a_replay_whose_last_record_kafka_compacted_away_is_skipped(
    spark, kafka_bootstrap, topic_factory, tmp_path, connectors
):
    """A driver dies between the tables' commits of a batch and Spark's; meanwhile the
    log cleaner of the compacted source topic removes the batch's last record, its key
    written again. Replayed, the batch reads records ending before the end its commit
    recorded, yet it is the same batch over the same range: skipped, and the ingest
    goes on. Refused as a checkpoint behind, the ingest could never start again."""
    source = topic_factory(partitions=1, configs=COMPACTED)
    settings = load_settings(write_conf(tmp_path, kafka_bootstrap, source), env={})
    topic = settings.topic("jobs")
    produce(kafka_bootstrap, source, [good(i) for i in range(6)], partitions=1)  # keys k0-k5

    def ingest() -> IngestJob:
        job = IngestJob(spark, settings, topic, detect_connectors(spark, connectors))
        run_to_end(job.start(once=True))
        return job

    first = ingest()
    assert [s.batch_id for s in first.stats] == [0]
    crash_before_sparks_commit(first.checkpoint, 0)
    # Key k5 again at offset 6, then offset 7: each timestamped two segment.ms past the
    # one before, so Kafka closes a segment before each, and the cleaner may take 5.
    now = int(time.time() * 1000)
    for i, record in enumerate([good(12), good(13)], start=1):
        produce(kafka_bootstrap, source, [record], partitions=1, timestamp_ms=now + i * 120_000)
    wait_until(
        lambda: offsets_in(kafka_bootstrap, source, 8) == [0, 1, 2, 3, 4, 6, 7],
        timeout=120,
        what="the log cleaner to remove offset 5",
    )

    replayed = ingest()

    assert [(s.batch_id, s.replay) for s in replayed.stats] == [(0, True), (1, False)]
    buffer = table(settings, Table.BUFFER)
    assert sorted(coordinates(buffer)) == [(source, 0, n) for n in range(8)]


def test_a_new_checkpoint_over_batches_without_kafka_positions_refuses_to_start(
    kafka_bootstrap, topic_factory, tmp_path
):
    """Batches whose commits carry no Kafka positions: a new checkpoint could only read
    Kafka again from its start (repeating) or from its end (losing). Nor where batches
    that record them came after those, but read one partition only: the other's
    position is in none. Where every batch recorded its positions, a partition none
    recorded was never read, and starts from its beginning."""
    source = topic_factory(partitions=2)
    settings = load_settings(write_conf(tmp_path, kafka_bootstrap, source), env={})
    buffer = ensure_table(settings.warehouse, Table.BUFFER, "jobs")
    quarantine = ensure_table(settings.warehouse, Table.QUARANTINE, "jobs")
    app_id = "dejaq-ingest-jobs"
    rows = pa.table({f.name: pa.nulls(0, f.type) for f in BUFFER_SCHEMA}, schema=BUFFER_SCHEMA)

    def batch(*transactions: Transaction) -> None:
        commit = CommitProperties(app_transactions=list(transactions))
        write_deltalake(buffer, rows, mode="append", commit_properties=commit)

    def resumed() -> Resume:
        return resume(str(checkpoint), buffer, quarantine, app_id, settings.kafka, [source])

    checkpoint = tmp_path / "checkpoint"
    batch(Transaction(app_id, 4))
    with pytest.raises(CannotResume, match="as the stopped ingest left it"):
        resumed()
    assert not checkpoint.exists(), "nothing kept for a query that does not start"
    batch(Transaction(app_id, 5), *positions(app_id, {(source, 0): 7}, since=5))
    with pytest.raises(CannotResume, match=f"partitions {source}/1"):
        resumed()

    fresh = tmp_path / "fresh"
    buffer = ensure_table(str(fresh), Table.BUFFER, "jobs")
    quarantine = ensure_table(str(fresh), Table.QUARANTINE, "jobs")
    batch(Transaction(app_id, 0), *positions(app_id, {(source, 0): 7}, since=0))
    assert json.loads(resumed().starting_offsets) == {source: {"0": 7, "1": -2}}


def test_a_new_checkpoint_waits_for_kafka_to_list_partitions_and_never_reads_from_the_start(
    kafka_bootstrap, topic_factory, tmp_path, monkeypatch
):
    """Kafka lists no partitions of a topic for a while (a leader election, metadata not
    loaded yet, no Describe permission): a new checkpoint over batches asks again, then
    refuses to start, rather than read everything Kafka holds again. Tables with no
    batch start from Kafka's start without asking."""
    source = topic_factory(partitions=2)
    settings = load_settings(write_conf(tmp_path, kafka_bootstrap, source), env={})
    app_id = "dejaq-ingest-jobs"
    checkpoint = tmp_path / "checkpoint"
    buffer = ensure_table(settings.warehouse, Table.BUFFER, "jobs")
    quarantine = ensure_table(settings.warehouse, Table.QUARANTINE, "jobs")
    asked: list[str] = []

    def lists_nothing(consumer, topic: str) -> None:
        asked.append(topic)

    def resumed() -> Resume:
        return resume(str(checkpoint), buffer, quarantine, app_id, settings.kafka, [source])

    monkeypatch.setattr("kafka.KafkaConsumer.partitions_for_topic", lists_nothing)
    monkeypatch.setattr("dejaq.pipelines.ingest_resume.PARTITIONS_WAIT_S", 1.5)
    assert resumed().starting_offsets == "earliest", "no batch yet: Kafka's start"
    assert asked == []
    shutil.rmtree(checkpoint)

    rows = pa.table({f.name: pa.nulls(0, f.type) for f in BUFFER_SCHEMA}, schema=BUFFER_SCHEMA)
    recorded = [Transaction(app_id, 0), *positions(app_id, {(source, 0): 7}, since=0)]
    write_deltalake(
        buffer, rows, mode="append", commit_properties=CommitProperties(app_transactions=recorded)
    )
    with pytest.raises(CannotResume, match=f"did not list every partition of {source}"):
        resumed()
    assert len(asked) >= 2, "asked again before refusing"

    monkeypatch.undo()
    assert json.loads(resumed().starting_offsets) == {source: {"0": 7, "1": -2}}


def test_a_buffer_of_another_kinds_rows_is_not_ingested_into_until_it_is_empty(
    spark, kafka_bootstrap, topic_factory, tmp_path
):
    """Priorities appended among a timeline's deliver_at times would be read as one kind
    or the other, both wrong: the ingest of a topic reconfigured from timeline to
    priority refuses it by name while the buffer holds the timeline's rows. Emptied, the
    buffer takes the new kind, and the ingest writes it, readable by Spark's Delta."""
    source = topic_factory(partitions=1)
    was = load_settings(write_conf(tmp_path, kafka_bootstrap, source, kind="timeline"), env={})
    buffer = ensure_buffer(was.warehouse, was.topic("jobs"))
    due = int(time.time() * 1000) + 3_600_000
    fill(was.warehouse, "jobs", buffer_rows([due, due + 1, due + 2], timeline=True))
    settings = load_settings(write_conf(tmp_path, kafka_bootstrap, source), env={})
    produce(kafka_bootstrap, source, [good(i) for i in range(5)], partitions=1)
    job = IngestJob(spark, settings, settings.topic("jobs"), detect_connectors(spark, "jvm"))
    with pytest.raises(
        KindChanged,
        match="'jobs' is configured as kind priority, but its buffer holds 3 rows written "
        "as kind timeline",
    ):
        job.start(once=True)
    assert table(settings, Table.BUFFER).num_rows == 3
    assert not Path(job.checkpoint).exists(), "no query started"

    DeltaTable(buffer).delete()  # what retention leaves once every message settled
    run_to_end(job.start(once=True))
    assert DeltaTable(buffer).metadata().configuration[KIND_PROPERTY] == "priority"
    assert sorted(table(settings, Table.BUFFER).column("priority").to_pylist()) == list(range(5))
    assert spark.read.format("delta").load(buffer).count() == 5


def job_env(connectors: str = "auto") -> dict[str, str]:
    return {
        **os.environ,
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "DEJAQ_SPARK_CONNECTORS": connectors,
    }


def start_ingest(conf: Path, *extra: str, connectors: str = "auto") -> subprocess.Popen:
    return subprocess.Popen(
        [*DEJAQ, "ingest", "--topic", "jobs", "--conf-file", str(conf), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=job_env(connectors),
    )


# What each path's job logs when it starts: which connectors it runs on.
USES = {
    "jvm": "Kafka: JVM (format 'kafka'); Delta: JVM (format 'delta')",
    "python": "Kafka: Python on kafka-python (dejaq_kafka); Delta: Python on delta-rs",
}


@pytest.mark.slow
@pytest.mark.parametrize("connectors", ["jvm", "python"])
def test_kill_9_mid_stream_then_restart_loses_and_duplicates_nothing(
    kafka_bootstrap, topic_factory, tmp_path, connectors
):
    source = topic_factory(partitions=3)
    conf = write_conf(tmp_path, kafka_bootstrap, source)
    settings = load_settings(conf, env={})
    total = 3000
    produce(kafka_bootstrap, source, [good(i) for i in range(total)])

    proc = start_ingest(conf, "--max-offsets-per-trigger", "150", connectors=connectors)
    buffer_path = table_path(settings.warehouse, Table.BUFFER, "jobs")
    try:
        wait_until(
            lambda: (row_count(buffer_path) or 0) >= 300, timeout=180, what="some batches landed"
        )
    finally:
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    assert USES[connectors] in err
    landed = row_count(buffer_path)
    assert landed < total, "killed mid-stream"

    # Restart through spark-submit, the way a cluster runs it: the JVM connectors are
    # handed over on its command line, as a cluster's --packages or --jars would.
    spark_submit = Path(sys.executable).parent / "spark-submit"
    jars = ["--jars", ",".join(map(str, jvm.jars(jvm.SPARK)))] if connectors == "jvm" else []
    result = subprocess.run(
        [
            str(spark_submit),
            *jars,
            "jobs/ingest.py",
            "--topic",
            "jobs",
            "--conf-file",
            str(conf),
            "--once",
            "--max-offsets-per-trigger",
            "1000",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parent.parent,
        env=job_env(connectors),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert USES[connectors] in result.stdout + result.stderr  # spark-submit merges them
    buffer = table(settings, Table.BUFFER)
    coords = coordinates(buffer)
    assert len(coords) == len(set(coords)) == total
    assert table(settings, Table.QUARANTINE).num_rows == 0


@pytest.mark.slow
def test_sigterm_stops_cleanly_and_status_reports(kafka_bootstrap, topic_factory, tmp_path):
    source = topic_factory(partitions=3)
    conf = write_conf(tmp_path, kafka_bootstrap, source)
    settings = load_settings(conf, env={})
    produce(kafka_bootstrap, source, [good(i) for i in range(200)] + [(b"k", b"x", {})])
    proc = start_ingest(conf)
    buffer_path = table_path(settings.warehouse, Table.BUFFER, "jobs")
    wait_until(lambda: row_count(buffer_path) == 200, timeout=180, what="all records buffered")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert "buffered 200, quarantined 1" in out
    assert "batch 0: in 201, buffered 200, quarantined 1 (missing_priority 1)" in err
    assert "lag " in err

    status = subprocess.run(
        [*DEJAQ, "status", "--topic", "jobs", "--conf-file", str(conf)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    assert lines[0].split() == ["buffer", "200"]
    assert lines[1].split() == ["quarantine", "1"]
    assert ["ingest", "lag", "0"] in [line.split() for line in lines[2:]]


def test_compaction_keeps_every_row_once_for_every_reader(
    spark, kafka_bootstrap, topic_factory, tmp_path
):
    """Small files are compacted every 2 batches; readers that saw them see nothing twice,
    and the broker's index, which keeps no settled ids, brings none of them back."""
    source = topic_factory(partitions=3)
    conf = write_conf(tmp_path, kafka_bootstrap, source)
    conf.write_text(conf.read_text().replace("max_payload_bytes: 100", "compact_every_batches: 2"))
    settings = load_settings(conf, env={})
    topic = settings.topic("jobs")
    path = table_path(settings.warehouse, Table.BUFFER, "jobs")
    job = IngestJob(spark, settings, topic, detect_connectors(spark), max_offsets_per_trigger=10)

    def ingest(first: int) -> None:
        produce(kafka_bootstrap, source, [good(i) for i in range(first, first + 30)])
        run_to_end(job.start(once=True))

    ingest(0)
    index = TopicIndex(settings.warehouse, topic)
    index.load()
    follower, pending = DeltaFollower(path, BUFFER_SCHEMA), PendingSet()
    pending.add_buffer_rows(follower.poll())
    assert len(index.rows) == len(pending) == 30
    state = TopicState(topic.buckets, 5)  # the broker settles 10, and forgets them
    state.touch("c", 0)
    picks = index.pick(state, state.buckets_of("c"), 10, now=0)
    state.lease("c", 0, 1000, picks)
    index.release(state, picks)
    picked = buffer_names(settings.warehouse)(picks[0])  # the lease names them by handle
    assert None not in picked
    assert state.ack("c", 1, picked) == {}
    index.forget(
        state.trim(
            checkpoint(settings.warehouse, "jobs", state.events, buffer_names(settings.warehouse))
        )
    )
    assert len(index.rows) == 20
    ingest(30)  # appends, and compacts files the index and the follower have read

    operations = [h["operation"] for h in DeltaTable(path).history()]
    assert operations.count("OPTIMIZE") >= 2
    assert len(DeltaTable(path).file_uris()) <= topic.buckets, "one file per bucket after"
    assert table(settings, Table.BUFFER).num_rows == 60
    index.refresh()  # walks the versions: appends read, compactions' rewrites not
    pending.add_buffer_rows(follower.poll())
    assert len(pending) == 60
    assert len(index.rows) == 50, "the settled 10 do not come back with the compaction"
    assert len(index.order) == 50, "no row indexed twice"
    assert not set(picks[0]) & index.rows.keys()
    fresh = TopicIndex(settings.warehouse, topic)  # a node starting now: buffer minus ledger
    fresh.load()
    assert fresh.rows.keys() == index.rows.keys()


Ranges = dict[int, tuple[int, int]]  # Kafka partition → offsets [start, end)


def kafka_range(spark, kafka_format: str, bootstrap: str, source: str, ranges: Ranges) -> DataFrame:
    """The records of `source` in `ranges` (every partition of it), as Spark hands a
    micro-batch over, the first time or on a replay."""
    offsets = lambda i: json.dumps({source: {str(p): r[i] for p, r in ranges.items()}})  # noqa: E731
    return (
        spark.read.format(kafka_format)
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", source)
        .option("startingOffsets", offsets(0))
        .option("endingOffsets", offsets(1))
        .option("includeHeaders", "true")
        .load()
    )


def hand_over(job: IngestJob, batch_id: int, source: str, ranges: Ranges) -> None:
    """Batch `batch_id` of `job` over `ranges` of `source`, run as Spark runs one: the
    ends it plans go to the checkpoint's offsets log, then its records to
    `process_batch`. These tests run batches with no query, so the offsets log entry is
    written here, in Spark's format: a version line, the batch's metadata, the source's
    offsets."""
    offsets = Path(job.checkpoint) / "offsets"
    offsets.mkdir(parents=True, exist_ok=True)
    ends = {source: {str(p): end for p, (_, end) in ranges.items()}}
    (offsets / str(batch_id)).write_text(f"v1\n{{}}\n{json.dumps(ends)}")
    bootstrap = job.settings.kafka.bootstrap
    job.process_batch(
        kafka_range(job.spark, job.connectors.kafka, bootstrap, source, ranges), batch_id
    )


def test_an_id_settled_and_removed_from_the_buffer_is_still_a_duplicate_after_a_restart(
    spark, kafka_bootstrap, topic_factory, tmp_path
):
    """Retention removes a settled message from the buffer; the ingest's dedup seed,
    read when it restarts, finds its id in the ledger's last dedup window. A replayed
    batch is skipped whole, so its own rows, settled since, are not duplicates."""
    source = topic_factory(partitions=1)
    settings = load_settings(write_conf(tmp_path, kafka_bootstrap, source), env={})
    topic = settings.topic("jobs")
    connectors = detect_connectors(spark)
    explicit = {"dejaq-priority": b"1", "dejaq-id": b"order-7"}
    first = [good(i) for i in range(5)] + [(b"k", b"once", explicit)]
    produce(kafka_bootstrap, source, first, partitions=1)

    def ingest() -> IngestJob:
        job = IngestJob(spark, settings, topic, connectors)
        run_to_end(job.start(once=True))
        return job

    def batch(start: int, end: int) -> DataFrame:
        return kafka_range(spark, connectors.kafka, kafka_bootstrap, source, {0: (start, end)})

    def counts() -> tuple[int, int]:
        return table(settings, Table.BUFFER).num_rows, table(settings, Table.QUARANTINE).num_rows

    assert [s.batch_id for s in ingest().stats] == [0]
    buffer_path = table_path(settings.warehouse, Table.BUFFER, "jobs")
    ledger_path = ensure_table(settings.warehouse, Table.LEDGER, "jobs")
    now = dt.datetime.now(dt.UTC)
    delivered = ["order-7", f"{source}-0-0"]  # the default id is left out of the seed
    released = {
        "message_id": delivered,
        "bucket": [0, 0],
        "event": [LedgerEvent.RELEASED.value] * 2,
        "sort_key": [1, 0],
        "deliveries": [1, 1],
        "at": [now, now],
    }
    write_deltalake(ledger_path, pa.table(released, schema=LEDGER_SCHEMA), mode="append")
    run = retain(buffer_path, ledger_path, 0, int(now.timestamp() * 1000) + 1000)
    assert run is not None and run.removed == 2
    assert counts() == (len(first) - 2, 0)

    # Spark replays the last batch after a crash (the query's offsets log has it): the
    # buffer has it, so it is skipped, though the ledger now says its order-7 is settled.
    replaying = IngestJob(spark, settings, topic, connectors)
    replaying.process_batch(batch(0, len(first)), 0)
    assert counts() == (len(first) - 2, 0)
    assert [(s.batch_id, s.replay) for s in replaying.stats] == [(0, True)]

    # The producer sends the id again (a retry), and a new message, to a restarted ingest.
    produce(kafka_bootstrap, source, [(b"k", b"again", explicit), good(100)], partitions=1)
    restarted = ingest()
    assert [s.batch_id for s in restarted.stats] == [1]
    quarantine = table(settings, Table.QUARANTINE)
    assert quarantine.select(["value", "reason", "detail"]).to_pylist() == [
        {"value": b"again", "reason": "duplicate", "detail": SETTLED}
    ]
    assert sum(counts()) + run.removed == len(first) + 2, "in = buffer + quarantine + removed"
    assert restarted._seen is not None and len(restarted._seen) == 1, "explicit ids only"
    replaying = IngestJob(spark, settings, topic, connectors)
    replaying.process_batch(batch(len(first), len(first) + 2), 1)
    assert [(s.batch_id, s.replay) for s in replaying.stats] == [(1, True)]
    assert sum(counts()) + run.removed == len(first) + 2


def _reminders(
    spark, kafka_bootstrap: str, topic_factory, tmp_path: Path, *others: tuple
) -> tuple[IngestJob, Settings, Callable[[bytes], list[dict]]]:
    """An ingest of a topic whose dedup window is 1 ms, and a function producing a message
    of id `reminder-42` with the payload given (and `others`), ingesting once, and
    returning that id's rows in the buffer."""
    source = topic_factory(partitions=1)
    conf = write_conf(tmp_path, kafka_bootstrap, source)
    conf.write_text(conf.read_text().replace("max_payload_bytes: 100", "dedup_window_ms: 1"))
    settings = load_settings(conf, env={})
    job = IngestJob(spark, settings, settings.topic("jobs"), detect_connectors(spark))
    explicit = {"dejaq-priority": b"1", "dejaq-id": b"reminder-42"}

    def ingest(value: bytes) -> list[dict]:
        produce(kafka_bootstrap, source, [(b"k", value, explicit), *others], partitions=1)
        run_to_end(job.start(once=True))
        buffered = table(settings, Table.BUFFER).filter(pc.field("message_id") == "reminder-42")
        return buffered.select(["message_id", "payload"]).to_pylist()

    return job, settings, ingest


def test_an_id_past_the_window_is_a_duplicate_while_its_row_is_in_the_buffer(
    spark, kafka_bootstrap, topic_factory, tmp_path, monkeypatch
):
    """The broker and the release job know a message by its id: a second row of an id
    whose first is still in the buffer (a reminder due in a month outlives a week's
    window) would be taken for the first and never delivered. So the id stays taken
    until its row has left the buffer, then it is free again."""
    monkeypatch.setattr("dejaq.pipelines.ingest.PRUNE_EVERY_S", 0.0)  # a look each batch
    job, settings, ingest = _reminders(spark, kafka_bootstrap, topic_factory, tmp_path)

    first = [{"message_id": "reminder-42", "payload": b"first"}]
    assert ingest(b"first") == first
    assert ingest(b"re-armed") == first
    assert ingest(b"re-armed, past the window") == first
    quarantine = table(settings, Table.QUARANTINE).sort_by("source_offset")
    assert quarantine.select(["value", "reason", "detail"]).to_pylist() == [
        {"value": b"re-armed", "reason": "duplicate", "detail": IN_BUFFER},
        {"value": b"re-armed, past the window", "reason": "duplicate", "detail": IN_BUFFER},
    ]
    assert job._seen is not None and set(job._seen.lingering) == {"reminder-42"}

    # Delivered and settled, its row leaves the buffer; the next look frees the id.
    DeltaTable(table_path(settings.warehouse, Table.BUFFER, "jobs")).delete(
        "message_id = 'reminder-42'"
    )
    assert ingest(b"next") == [{"message_id": "reminder-42", "payload": b"next"}]
    assert job._seen is not None and not job._seen.lingering


def test_an_id_reused_past_the_window_after_its_row_left_is_stored_without_waiting(
    spark, kafka_bootstrap, topic_factory, tmp_path, monkeypatch
):
    """A producer reuses an id once its first message was settled and removed from the
    buffer, past the window: the message is stored at once, not quarantined until the
    periodic look at the buffer (made never to come here) frees the id. The batch looks
    for the id's row itself; while the new row is in the buffer, the id is taken again."""
    monkeypatch.setattr("dejaq.pipelines.ingest.PRUNE_EVERY_S", float("inf"))
    job, settings, ingest = _reminders(spark, kafka_bootstrap, topic_factory, tmp_path, good(0))

    first = [{"message_id": "reminder-42", "payload": b"first"}]
    assert ingest(b"first") == first
    assert ingest(b"re-armed, past the window") == first
    assert job._seen is not None and set(job._seen.lingering) == {"reminder-42"}

    # Delivered and settled, its row leaves the buffer; the id is reused.
    DeltaTable(table_path(settings.warehouse, Table.BUFFER, "jobs")).delete(
        "message_id = 'reminder-42'"
    )
    reused = [{"message_id": "reminder-42", "payload": b"reused"}]
    assert ingest(b"reused") == reused
    assert ingest(b"reused again, past the window") == reused
    quarantine = table(settings, Table.QUARANTINE).sort_by("source_offset")
    assert quarantine.select(["value", "reason", "detail"]).to_pylist() == [
        {"value": b"re-armed, past the window", "reason": "duplicate", "detail": IN_BUFFER},
        {"value": b"reused again, past the window", "reason": "duplicate", "detail": IN_BUFFER},
    ]


def test_a_batch_cut_between_its_two_commits_keeps_its_verdict_when_done_again(
    spark, kafka_bootstrap, topic_factory, tmp_path, monkeypatch
):
    """The quarantine's commit of a batch landed, the buffer's did not (the process died
    between them). Done again after a restart, the batch is judged against a dedup seed
    holding what the ledger settled since, which the first judge did not: an id it kept
    would now be a duplicate, for a quarantine whose commit is already done, and land
    nowhere. The commit that dies is the buffer's, made to raise; the rest is real."""
    source = topic_factory(partitions=1)
    settings = load_settings(write_conf(tmp_path, kafka_bootstrap, source), env={})
    topic = settings.topic("jobs")
    connectors = detect_connectors(spark)
    records = [
        good(0),
        (b"k", b"kept", {"dejaq-priority": b"1", "dejaq-id": b"order-9"}),
        (b"k", b"no priority", {}),
    ]
    produce(kafka_bootstrap, source, records, partitions=1)
    ensure_buffer(settings.warehouse, topic)  # as the job's start makes them
    ensure_table(settings.warehouse, Table.QUARANTINE, "jobs")
    _cut(IngestJob(spark, settings, topic, connectors), 0, source, {0: (0, 3)}, monkeypatch)
    assert table(settings, Table.QUARANTINE).num_rows == 1
    # An earlier copy of order-9, settled since: the restarted job's seed has it.
    ledger = ensure_table(settings.warehouse, Table.LEDGER, "jobs")
    settled = {
        "message_id": ["order-9"],
        "bucket": [0],
        "event": [LedgerEvent.ACKED.value],
        "sort_key": [1],
        "deliveries": [1],
        "at": [dt.datetime.now(dt.UTC)],
    }
    write_deltalake(ledger, pa.table(settled, schema=LEDGER_SCHEMA), mode="append")

    hand_over(IngestJob(spark, settings, topic, connectors), 0, source, {0: (0, 3)})

    buffer = table(settings, Table.BUFFER)
    assert sorted(buffer.column("payload").to_pylist()) == [b"kept", b"payload-0"]
    assert table(settings, Table.QUARANTINE).column("reason").to_pylist() == ["missing_priority"]


def test_a_checkpoint_behind_the_buffer_stops_the_ingest_rather_than_skip_its_batches(
    spark, kafka_bootstrap, topic_factory, tmp_path
):
    """A checkpoint older than the buffer (a copy put back, another driver's) plans batch
    ids the buffer has over Kafka positions it has not read: skipped as replays, their
    records would land nowhere. Only the buffer's last batch, over the positions its
    commit recorded on every partition it planned, is a replay: one that plans no
    records of a partition the buffer's batch read is another batch too."""
    source = topic_factory(partitions=2)
    settings = load_settings(write_conf(tmp_path, kafka_bootstrap, source), env={})
    topic = settings.topic("jobs")
    connectors = detect_connectors(spark)
    produce(kafka_bootstrap, source, [good(i) for i in range(24)], partitions=2)
    ensure_buffer(settings.warehouse, topic)
    ensure_table(settings.warehouse, Table.QUARANTINE, "jobs")

    def job() -> IngestJob:
        return IngestJob(spark, settings, topic, connectors)

    ran = job()
    hand_over(ran, 0, source, {0: (0, 3), 1: (0, 0)})
    hand_over(ran, 1, source, {0: (3, 6), 1: (0, 0)})
    hand_over(ran, 2, source, {0: (6, 9), 1: (0, 3)})
    assert table(settings, Table.BUFFER).num_rows == 12

    with pytest.raises(CheckpointBehind, match="delete its checkpoint"):
        hand_over(job(), 1, source, {0: (3, 12), 1: (0, 0)})
    with pytest.raises(CheckpointBehind, match="other Kafka positions"):
        hand_over(job(), 2, source, {0: (6, 12), 1: (0, 3)})
    with pytest.raises(CheckpointBehind, match="other Kafka positions"):
        hand_over(job(), 2, source, {0: (6, 9), 1: (0, 0)})  # reads none of partition 1
    assert table(settings, Table.BUFFER).num_rows == 12, "nothing committed by any"

    replaying = job()
    hand_over(replaying, 2, source, {0: (6, 9), 1: (0, 3)})
    assert [(s.batch_id, s.replay) for s in replaying.stats] == [(2, True)]
    hand_over(replaying, 3, source, {0: (9, 12), 1: (3, 12)})
    buffer = table(settings, Table.BUFFER)
    assert sorted(coordinates(buffer)) == [(source, p, n) for p in (0, 1) for n in range(12)]


def _cut(job: IngestJob, batch_id: int, source: str, ranges: Ranges, monkeypatch) -> None:
    """Batch `batch_id` of `job` over `ranges` of `source`, its process killed between
    its quarantine's commit and its buffer's (the buffer's commit made to raise)."""
    real = ingest_module.commit

    def dies_on_the_buffer(target, files, mode, txn, *also):
        if "/buffer/" in target.path:
            raise RuntimeError("the process died between the two commits")
        return real(target, files, mode, txn, *also)

    with monkeypatch.context() as m:
        m.setattr(ingest_module, "commit", dies_on_the_buffer)
        with pytest.raises(RuntimeError, match="between the two commits"):
            hand_over(job, batch_id, source, ranges)


def test_a_cut_batch_done_again_under_a_changed_configuration_lands_each_record_once(
    spark, kafka_bootstrap, topic_factory, tmp_path, monkeypatch
):
    """The topic's configuration changes while a batch is cut between its two commits:
    done again, the records the quarantine holds stay there alone, and every other one
    lands once, in the buffer, or in the quarantine if it is bad now."""
    source = topic_factory(partitions=1)
    settings = load_settings(write_conf(tmp_path, kafka_bootstrap, source), env={})
    topic = settings.topic("jobs")
    connectors = detect_connectors(spark)
    first = [
        good(0),  # payload of 9 bytes
        (b"k", b"kept", {"dejaq-priority": b"1", "dejaq-id": b"order-9"}),
        (b"k", b"no priority", {}),
    ]
    second = [good(1), (b"k", b"tiny", {"dejaq-priority": b"1"})]
    produce(kafka_bootstrap, source, first + second, partitions=1)
    ensure_buffer(settings.warehouse, topic)
    ensure_table(settings.warehouse, Table.QUARANTINE, "jobs")

    def landed() -> tuple[list, list]:
        buffer, quarantine = table(settings, Table.BUFFER), table(settings, Table.QUARANTINE)
        return coordinates(buffer), coordinates(quarantine)

    # Payloads up to 100 bytes when cut, 5 when done again: payload-0 turns bad.
    small = topic.model_copy(update={"max_payload_bytes": 5})
    _cut(IngestJob(spark, settings, topic, connectors), 0, source, {0: (0, 3)}, monkeypatch)
    hand_over(IngestJob(spark, settings, small, connectors), 0, source, {0: (0, 3)})
    buffered, quarantined = landed()
    assert sorted(buffered + quarantined) == [(source, 0, n) for n in range(3)]
    assert not set(buffered) & set(quarantined)
    assert table(settings, Table.BUFFER).column("payload").to_pylist() == [b"kept"]
    assert sorted(table(settings, Table.QUARANTINE).column("reason").to_pylist()) == [
        "missing_priority",
        "payload_too_large",
    ]

    # 5 bytes when cut, 100 when done again: payload-1, quarantined, turns good.
    _cut(IngestJob(spark, settings, small, connectors), 1, source, {0: (3, 5)}, monkeypatch)
    hand_over(IngestJob(spark, settings, topic, connectors), 1, source, {0: (3, 5)})
    buffered, quarantined = landed()
    assert sorted(buffered + quarantined) == [(source, 0, n) for n in range(5)]
    assert not set(buffered) & set(quarantined)
    assert sorted(table(settings, Table.BUFFER).column("payload").to_pylist()) == [
        b"kept",
        b"tiny",
    ]


def test_a_second_driver_fails_at_its_quarantine_commit_of_a_batch_the_first_wrote(
    spark, kafka_bootstrap, topic_factory, tmp_path, monkeypatch
):
    """Two drivers on one checkpoint plan batch 0 over different ranges; the first
    commits its quarantine and stops before its buffer. The second's quarantine commit
    of the batch is refused, not skipped: skipped, its bad records past the first's
    range would land nowhere, once its buffer commit made the buffer resume past them."""
    source = topic_factory(partitions=1)
    settings = load_settings(write_conf(tmp_path, kafka_bootstrap, source), env={})
    topic = settings.topic("jobs")
    connectors = detect_connectors(spark)
    records = [good(0), (b"k", b"no priority", {}), good(1), (b"k", b"x", {})]
    produce(kafka_bootstrap, source, records, partitions=1)
    ensure_buffer(settings.warehouse, topic)
    ensure_table(settings.warehouse, Table.QUARANTINE, "jobs")

    _cut(IngestJob(spark, settings, topic, connectors), 0, source, {0: (0, 2)}, monkeypatch)
    with pytest.raises(SecondWriter, match=r"/quarantine/.*other positions"):
        hand_over(IngestJob(spark, settings, topic, connectors), 0, source, {0: (0, 4)})
    assert table(settings, Table.BUFFER).num_rows == 0
    assert coordinates(table(settings, Table.QUARANTINE)) == [(source, 0, 1)]


class Lines:
    """A running job's stderr, read line by line as it comes (so the pipe never fills)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._reader.start()

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def having(self, text: str) -> list[str]:
        return [line for line in self.lines if text in line]

    def join(self) -> list[str]:
        self._reader.join(timeout=60)
        return self.lines


def start_ingest_reading(conf: Path, *extra: str) -> tuple[subprocess.Popen, Lines]:
    proc = subprocess.Popen(
        [*DEJAQ, "ingest", "--topic", "jobs", "--conf-file", str(conf), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=job_env(),
    )
    return proc, Lines(proc)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def admin(kafka_bootstrap: str) -> Iterator[KafkaAdminClient]:
    client = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    yield client
    client.close()


def test_ingest_waits_for_its_input_topic_then_ingests(kafka_bootstrap, admin, tmp_path):
    source = f"late-{uuid.uuid4().hex[:10]}"
    conf = write_conf(tmp_path, kafka_bootstrap, source)
    settings = load_settings(conf, env={})
    waiting = f"waiting for Kafka topic {source} to exist (create it or produce to it)"

    once = subprocess.run(
        [*DEJAQ, "ingest", "--topic", "jobs", "--conf-file", str(conf), "--once"],
        capture_output=True,
        text=True,
        timeout=300,
        env=job_env(),
    )
    assert once.returncode == 1, once.stderr[-3000:]
    assert once.stderr.splitlines()[-1] == (
        f"error: ingest jobs: Kafka topic {source} does not exist (create it or produce to it)"
    )

    proc, err = start_ingest_reading(conf)
    try:
        wait_until(lambda: err.having(waiting), timeout=180, what="the waiting line")
        admin.create_topics([NewTopic(source, 3, 1)])
        try:
            produce(kafka_bootstrap, source, [good(i) for i in range(30)])
            buffer_path = table_path(settings.warehouse, Table.BUFFER, "jobs")
            wait_until(
                lambda: row_count(buffer_path) == 30, timeout=180, what="the records buffered"
            )
            stop(proc)
        finally:
            admin.delete_topics([source])
    finally:
        stop(proc)
    lines = err.join()
    assert proc.returncode == 0, "\n".join(lines[-50:])
    assert len(err.having(waiting)) == 1, "said once, not once a poll"
    assert not err.having("UnknownTopicOrPartition"), "the query started after the topic"


def test_a_failed_query_ends_with_one_line_naming_the_cause(
    kafka_bootstrap, admin, topic_factory, tmp_path
):
    """The input topic is deleted under a running ingest: Spark's Kafka source fails the
    query; the job ends with exit code 1 and one line, the stack only in the log above."""
    source = topic_factory(partitions=1)
    conf = write_conf(tmp_path, kafka_bootstrap, source)
    settings = load_settings(conf, env={})
    produce(kafka_bootstrap, source, [good(i) for i in range(10)], partitions=1)
    proc, err = start_ingest_reading(conf)
    try:
        buffer_path = table_path(settings.warehouse, Table.BUFFER, "jobs")
        wait_until(lambda: row_count(buffer_path) == 10, timeout=180, what="the first batch")
        admin.delete_topics([source])
        proc.wait(180)
    finally:
        stop(proc)
    lines = err.join()
    assert proc.returncode == 1, "\n".join(lines[-50:])
    assert lines[-1] == (
        "error: ingest jobs failed: org.apache.kafka.common.errors."
        "UnknownTopicOrPartitionException: This server does not host this topic-partition."
    )
    assert not err.having("Traceback"), "no Python traceback"
    assert err.having("ERROR MicroBatchExecution"), "Spark's log has the stack"


def test_a_python_error_in_a_batch_is_named_by_its_last_traceback_line(spark):
    def fail(batch: DataFrame, batch_id: int) -> None:
        raise ValueError(f"no good: batch {batch_id}")

    query = spark.readStream.format("rate").load().writeStream.foreachBatch(fail).start()
    try:
        with pytest.raises(StreamingQueryException):
            query.awaitTermination(120)
    finally:
        query.stop()
    assert query_failure(query) == "ValueError: no good: batch 0"


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_batch_line_reports_how_long_the_batch_took(
    spark, kafka_bootstrap, topic_factory, tmp_path
):
    """Between two batches an idle trigger reports progress, under the next batch's id,
    that took milliseconds; the next batch's line still gives that batch's duration."""
    source = topic_factory(partitions=1)
    settings = load_settings(write_conf(tmp_path, kafka_bootstrap, source), env={})
    job = IngestJob(spark, settings, settings.topic("jobs"), detect_connectors(spark))

    def ran(batch_id: int) -> object:
        return next(
            (
                p
                for p in query.recentProgress
                if p.batchId == batch_id and "addBatch" in p.durationMs
            ),
            None,
        )

    def idle(batch_id: int) -> bool:
        return any(
            p.batchId == batch_id and "addBatch" not in p.durationMs for p in query.recentProgress
        )

    def landed(rows: int) -> BatchStats | None:
        """The batch that brought the buffer to `rows`, once its progress is in."""
        if sum(s.rows_in for s in job.stats) < rows or not ran(job.stats[-1].batch_id):
            return None
        return job.stats[-1]

    captured = Captured()
    logger = logging.getLogger("dejaq.ingest")
    logger.addHandler(captured)
    level = logger.level
    logger.setLevel(logging.INFO)
    query = job.start(once=False)
    try:
        produce(kafka_bootstrap, source, [good(i) for i in range(10)], partitions=1)
        first = wait_until(lambda: landed(10), timeout=180, what="the first records")
        next_id = first.batch_id + 1
        wait_until(lambda: idle(next_id), timeout=120, what="an idle trigger's progress")
        produce(kafka_bootstrap, source, [good(i) for i in range(10, 20)], partitions=1)
        wait_until(lambda: landed(20), timeout=180, what="the second records")
        job.report(query)
    finally:
        query.stop()
        logger.removeHandler(captured)
        logger.setLevel(level)
    logged = {
        int(m.group(1)): int(m.group(2))
        for m in (re.search(r" batch (\d+): .*, (\d+) ms, lag ", t) for t in captured.messages)
        if m
    }
    assert sorted(logged) == [s.batch_id for s in job.stats]
    for stats in job.stats:
        progress = ran(stats.batch_id)
        assert logged[stats.batch_id] == progress.batchDuration
        assert logged[stats.batch_id] >= progress.durationMs["triggerExecution"] >= stats.millis


def test_an_offsets_log_entry_of_another_layout_is_refused_by_name(tmp_path) -> None:
    """A Spark that writes its offsets log otherwise (another version line, more lines)
    is refused rather than its batch's range misread."""
    from dejaq.pipelines.ingest_resume import planned

    (tmp_path / "offsets").mkdir()
    (tmp_path / "offsets" / "0").write_text('v1\n{"batchWatermarkMs":0}\n{"t":{"0":5}}\n')
    assert planned(str(tmp_path), 0) == {("t", 0): 5}
    (tmp_path / "offsets" / "1").write_text('v2\n{"batchWatermarkMs":0}\n{"t":{"0":5}}\n')
    with pytest.raises(ValueError, match=r"offsets/1 is not an offsets log entry.*'v2'"):
        planned(str(tmp_path), 1)
