"""`dejaq_kafka` against a real broker: Spark's Kafka rows, each record once, new partitions."""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from chispa import assert_df_equality
from hypothesis import given
from hypothesis import strategies as st
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewPartitions, NewTopic
from kafka.errors import TopicAlreadyExistsError
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery
from pyspark.sql.streaming.datasource import ReadAllAvailable

from dejaq.pipelines.kafka_source import (
    KAFKA_SCHEMA,
    KafkaDataSource,
    KafkaInputPartition,
    KafkaOptions,
    KafkaStreamReader,
    fair_share,
)
from tests.conftest import assert_rows, wait_until

# What Spark's JVM source gives with includeHeaders=true.
SPARK_KAFKA_DDL = (
    "struct<key:binary,value:binary,topic:string,partition:int,offset:bigint,"
    "timestamp:timestamp,timestampType:int,headers:array<struct<key:string,value:binary>>>"
)


@pytest.fixture
def producer(kafka_bootstrap: str) -> Iterator[KafkaProducer]:
    p = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    yield p
    p.close()


@pytest.fixture
def admin(kafka_bootstrap: str) -> Iterator[KafkaAdminClient]:
    a = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    yield a
    a.close()


def produce(
    producer: KafkaProducer, topic: str, n: int, partitions: int = 3, tag: str = ""
) -> None:
    """n records spread round-robin; values are unique within the topic thanks to `tag`."""
    for i in range(n):
        producer.send(topic, key=b"k%d" % i, value=f"{tag}v{i}".encode(), partition=i % partitions)
    producer.flush()


def kafka_stream(spark: SparkSession, bootstrap: str, topics: str, **options: str) -> DataFrame:
    reader = spark.readStream.format("dejaq_kafka")
    reader = reader.option("kafka.bootstrap.servers", bootstrap).option("subscribe", topics)
    return reader.options(**options).load()


def run_available_now(df: DataFrame, out: Path, checkpoint: Path) -> StreamingQuery:
    """One availableNow run into a parquet folder (the file sink is exactly-once)."""
    query = (
        df.writeStream.format("parquet")
        .option("path", str(out))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    assert query.exception() is None
    return query


def to_memory(df: DataFrame) -> tuple[StreamingQuery, str]:
    name = f"kafka_{uuid.uuid4().hex[:8]}"
    return df.writeStream.format("memory").queryName(name).trigger(availableNow=True).start(), name


def options(**extra: str) -> dict[str, str]:
    return {"kafka.bootstrap.servers": "127.0.0.1:9", "subscribe": "t", **extra}


def reader_for(bootstrap: str, topic: str, **extra: str) -> KafkaStreamReader:
    """The driver-side reader, called directly: no Spark, no query."""
    opts = {"kafka.bootstrap.servers": bootstrap, "subscribe": topic, **extra}
    return KafkaStreamReader(KafkaOptions.parse(opts))


def make_again(admin: KafkaAdminClient, topic: str) -> None:
    """Delete a one-partition `topic` and create it anew, empty."""
    admin.delete_topics([topic])

    def made_again() -> bool:
        try:
            admin.create_topics([NewTopic(topic, 1, 1)])
        except TopicAlreadyExistsError:  # the deletion is still under way
            return False
        return True

    wait_until(made_again, what="the topic made again")


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# --- rows -------------------------------------------------------------------------------------


def test_rows_are_spark_kafka_rows_with_headers_and_timestamps(
    spark: SparkSession, kafka_bootstrap: str, topic_factory: Callable[..., str], producer
) -> None:
    topic = topic_factory(3)
    headers = [[], [("trace", b"abc")], [("a", b"1"), ("b", b""), ("a", b"2")]]
    expected = []
    # Recent timestamps: the broker's time-based retention would delete old ones at once.
    now_ms = int(time.time() * 1000)
    for i in range(9):
        ts_ms = now_ms + i
        key = None if i == 4 else b"k%d" % i
        meta = producer.send(
            topic,
            key=key,
            value=b"v%d" % i,
            partition=i % 3,
            headers=headers[i % 3],
            timestamp_ms=ts_ms,
        ).get(timeout=10)
        expected.append(
            (
                key,
                b"v%d" % i,
                topic,
                meta.partition,
                meta.offset,
                datetime.fromtimestamp(ts_ms / 1000, UTC),
                0,  # CreateTime
                [(k, v) for k, v in headers[i % 3]] or None,  # the JVM source gives null, not []
            )
        )

    # Two records per task at most: each partition's range is split across tasks.
    df = kafka_stream(spark, kafka_bootstrap, topic, maxRecordsPerPartition="2")
    assert df.schema.simpleString() == SPARK_KAFKA_DDL
    query, table = to_memory(df)
    query.awaitTermination()

    actual = spark.table(table).orderBy("partition", "offset")
    want = spark.createDataFrame(expected, KAFKA_SCHEMA).orderBy("partition", "offset")
    assert_df_equality(actual, want)


def test_transaction_markers_leave_gaps_that_do_not_stall_the_read(
    spark: SparkSession, kafka_bootstrap: str, topic_factory: Callable[..., str]
) -> None:
    """A committed transaction ends in a control record: the end offset has no record."""
    topic = topic_factory(1)
    txn = KafkaProducer(bootstrap_servers=kafka_bootstrap, transactional_id=f"tx-{topic}")
    txn.init_transactions()
    for batch in ([b"a", b"b"], [b"c"]):
        txn.begin_transaction()
        for value in batch:
            txn.send(topic, value=value)
        txn.commit_transaction()
    txn.close()

    df = kafka_stream(spark, kafka_bootstrap, topic, **{"kafka.isolation.level": "read_committed"})
    query, table = to_memory(df)
    query.awaitTermination()

    # Offsets 2 and 4 are the two transactions' markers.
    assert_rows(
        spark.table(table).select("offset", "value"),
        [(0, b"a"), (1, b"b"), (3, b"c")],
        "offset long, value binary",
    )
    consumer = KafkaConsumer(bootstrap_servers=kafka_bootstrap)
    end = consumer.end_offsets([TopicPartition(topic, 0)])[TopicPartition(topic, 0)]
    consumer.close()
    assert end == 5  # the read ended on a marker, past the last record


# --- exactly once -----------------------------------------------------------------------------


def test_every_record_once_across_restarts_and_rate_limited_batches(
    spark: SparkSession,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    producer,
    tmp_path: Path,
) -> None:
    topic = topic_factory(3)
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    df = kafka_stream(spark, kafka_bootstrap, topic, maxOffsetsPerTrigger="100")

    produce(producer, topic, 450, tag="first-")
    first = run_available_now(df, out, checkpoint)
    sizes = [p["numInputRows"] for p in first.recentProgress if p["numInputRows"]]
    assert len(sizes) > 1 and max(sizes) <= 100 and sum(sizes) == 450

    produce(producer, topic, 150, tag="second-")
    second = run_available_now(df, out, checkpoint)
    assert sum(p["numInputRows"] for p in second.recentProgress) == 150

    rows = spark.read.parquet(str(out))
    assert_rows(
        rows.select("partition", "offset"),
        [(p, o) for p in range(3) for o in range(200)],
        "partition int, offset long",
    )
    assert_rows(
        rows.select("value"),
        [
            (f"{tag}v{i}".encode(),)
            for tag, n in (("first-", 450), ("second-", 150))
            for i in range(n)
        ],
        "value binary",
    )


# --- where a new query starts -----------------------------------------------------------------


def test_starting_offsets_latest_reads_only_what_comes_after(
    spark: SparkSession,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    producer,
    tmp_path: Path,
) -> None:
    topic = topic_factory(3)
    produce(producer, topic, 30, tag="old-")
    out, checkpoint = tmp_path / "out", tmp_path / "checkpoint"
    df = kafka_stream(spark, kafka_bootstrap, topic, startingOffsets="latest")

    run_available_now(df, out, checkpoint)
    produce(producer, topic, 6, tag="new-")
    run_available_now(df, out, checkpoint)

    values = spark.read.parquet(str(out)).select("value")
    assert_rows(values, [(f"new-v{i}".encode(),) for i in range(6)], "value binary")


def test_starting_offsets_json_per_partition(
    spark: SparkSession, kafka_bootstrap: str, topic_factory: Callable[..., str], producer
) -> None:
    topic = topic_factory(3)
    produce(producer, topic, 15)  # offsets 0..4 in each partition
    starting = json.dumps({topic: {"0": 2, "1": -2, "2": -1}})
    query, table = to_memory(kafka_stream(spark, kafka_bootstrap, topic, startingOffsets=starting))
    query.awaitTermination()
    assert_rows(
        spark.table(table).select("partition", "offset"),
        [(0, o) for o in (2, 3, 4)] + [(1, o) for o in range(5)],
        "partition int, offset long",
    )


def test_starting_offsets_json_must_name_every_partition(
    spark: SparkSession, kafka_bootstrap: str, topic_factory: Callable[..., str]
) -> None:
    topic = topic_factory(2)
    starting = json.dumps({topic: {"0": -2}})
    query, _ = to_memory(kafka_stream(spark, kafka_bootstrap, topic, startingOffsets=starting))
    with pytest.raises(Exception, match=r"must list every partition.*missing"):
        query.awaitTermination()


# --- partitions and topics that appear later --------------------------------------------------


def test_new_partitions_and_topics_are_read_from_their_start(
    spark: SparkSession,
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    producer,
    admin: KafkaAdminClient,
) -> None:
    topic = topic_factory(2)
    later = f"later-{uuid.uuid4().hex[:10]}"  # subscribed before it exists
    produce(producer, topic, 4, partitions=2)
    table = f"kafka_{uuid.uuid4().hex[:8]}"
    df = kafka_stream(spark, kafka_bootstrap, f"{topic},{later}")
    query = (
        df.writeStream.format("memory").queryName(table).trigger(processingTime="200 milliseconds")
    )
    query = query.start()
    try:
        query.processAllAvailable()
        read = "topic string, partition int, offset long"
        first = [(topic, p, o) for p in (0, 1) for o in (0, 1)]
        assert_rows(spark.table(table).select("topic", "partition", "offset"), first, read)

        admin.create_partitions({topic: NewPartitions(3)})
        admin.create_topics([NewTopic(later, 1, 1)])
        fresh = KafkaProducer(bootstrap_servers=kafka_bootstrap)  # metadata with the new ones
        for i in range(3):
            fresh.send(topic, value=b"p2-%d" % i, partition=2)
            fresh.send(later, value=b"later-%d" % i, partition=0)
        fresh.close()  # flushes

        wait_until(lambda: spark.table(table).count() == 10, timeout=60, what="new records")
        query.processAllAvailable()
        assert_rows(
            spark.table(table).select("topic", "partition", "offset"),
            first + [(topic, 2, o) for o in range(3)] + [(later, 0, o) for o in range(3)],
            read,
        )
    finally:
        query.stop()
        admin.delete_topics([later])


def test_a_partition_whose_offsets_went_back_is_read_on_from_its_new_end(
    kafka_bootstrap: str, producer, admin: KafkaAdminClient
) -> None:
    """The stream had read 10 records; the topic is deleted and made again, and gets 5:
    the stream goes on from there (as Spark's source does without failOnDataLoss), so
    the next records are read at once, not once the new log has passed offset 10."""
    topic = f"again-{uuid.uuid4().hex[:10]}"
    admin.create_topics([NewTopic(topic, 1, 1)])
    produce(producer, topic, 10, partitions=1, tag="old")
    reader = reader_for(kafka_bootstrap, topic)
    start = reader.initialOffset()
    end = reader.latestOffset(start, reader.getDefaultReadLimit())
    assert sum(b.num_rows for p in reader.partitions(start, end) for b in reader.read(p)) == 10
    reader.stop()
    make_again(admin, topic)
    fresh = KafkaProducer(bootstrap_servers=kafka_bootstrap)  # metadata of the new topic
    reader = reader_for(kafka_bootstrap, topic)  # a restart from the checkpointed offsets
    try:
        produce(fresh, topic, 5, partitions=1, tag="before")
        moved = reader.latestOffset(end, reader.getDefaultReadLimit())
        assert moved == {topic: {"0": 5}} and reader.partitions(end, moved) == []
        produce(fresh, topic, 3, partitions=1, tag="after")
        nxt = reader.latestOffset(moved, reader.getDefaultReadLimit())
        batches = [b for p in reader.partitions(moved, nxt) for b in reader.read(p)]
        values = [v for b in batches for v in b.column("value").to_pylist()]
        assert values == [f"afterv{i}".encode() for i in range(3)]
    finally:
        fresh.close()
        reader.stop()
        admin.delete_topics([topic])


def test_a_replayed_batch_past_the_end_of_a_topic_made_again_is_skipped_with_a_warning(
    kafka_bootstrap: str, producer, admin: KafkaAdminClient, caplog: pytest.LogCaptureFixture
) -> None:
    """Batch [5, 10) was planned and logged, then the topic deleted and made again with 3
    records: its replay reads nothing and says so, rather than wait for the new topic's
    offsets 5-9 (and later take them for the old batch's, the next batch starting at 10)."""
    topic = f"again-{uuid.uuid4().hex[:10]}"
    admin.create_topics([NewTopic(topic, 1, 1)])
    produce(producer, topic, 10, partitions=1, tag="old")
    start, end = {topic: {"0": 5}}, {topic: {"0": 10}}
    make_again(admin, topic)
    fresh = KafkaProducer(bootstrap_servers=kafka_bootstrap)  # metadata of the new topic
    reader = reader_for(kafka_bootstrap, topic, pollTimeoutMs="3000")  # a restart
    try:
        produce(fresh, topic, 3, partitions=1, tag="new")
        with caplog.at_level(logging.WARNING, logger="dejaq.kafka_source"):
            assert reader.partitions(start, end) == []
            planned_before = KafkaInputPartition(topic, 0, 5, 10)  # a task of the first run
            assert list(reader.read(planned_before)) == []
        warned = [m for m in warnings_of(caplog) if f"{topic}-0 offsets [5, 10)" in m]
        assert len(warned) == 2 and all("not read" in m for m in warned)
    finally:
        fresh.close()
        reader.stop()
        admin.delete_topics([topic])


def test_records_deleted_before_they_are_read_are_skipped_with_a_warning(
    kafka_bootstrap: str,
    topic_factory: Callable[..., str],
    producer,
    admin: KafkaAdminClient,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Offsets [2, 10) are planned, then Kafka deletes the records below 6 (as retention
    does): the plan and a task planned before both name the offsets skipped."""
    topic = topic_factory(1)
    produce(producer, topic, 10, partitions=1)
    start, end = {topic: {"0": 2}}, {topic: {"0": 10}}
    admin.delete_records({TopicPartition(topic, 0): 6})
    reader = reader_for(kafka_bootstrap, topic, pollTimeoutMs="3000")
    try:
        with caplog.at_level(logging.WARNING, logger="dejaq.kafka_source"):
            assert reader.partitions(start, end) == [KafkaInputPartition(topic, 0, 6, 10)]
            batches = list(reader.read(KafkaInputPartition(topic, 0, 2, 10)))
        assert [o for b in batches for o in b.column("offset").to_pylist()] == [6, 7, 8, 9]
        warned = [m for m in warnings_of(caplog) if f"{topic}-0 offsets [2, 6)" in m]
        assert len(warned) == 2 and all("deleted" in m for m in warned)
    finally:
        reader.stop()


def test_available_now_stops_at_what_was_there_when_it_started(
    kafka_bootstrap: str, topic_factory: Callable[..., str], producer
) -> None:
    topic = topic_factory(1)
    produce(producer, topic, 5, partitions=1)
    reader = reader_for(kafka_bootstrap, topic)
    try:
        start = reader.initialOffset()
        reader.prepareForTriggerAvailableNow()
        produce(producer, topic, 5, partitions=1)
        end = reader.latestOffset(start, reader.getDefaultReadLimit())
        assert end == {topic: {"0": 5}}
        assert reader.latestOffset(end, reader.getDefaultReadLimit()) == end
    finally:
        reader.stop()


# --- planning and reading without Spark -------------------------------------------------------


def test_large_ranges_are_split_into_several_input_partitions(
    kafka_bootstrap: str, topic_factory: Callable[..., str], producer
) -> None:
    topic = topic_factory(3)
    for partition, n in ((0, 25), (1, 6), (2, 7)):
        for i in range(n):
            producer.send(topic, value=b"x%d" % i, partition=partition)
    producer.flush()
    reader = reader_for(kafka_bootstrap, topic, maxRecordsPerPartition="10")
    try:
        planned = reader.partitions(
            {topic: {"0": 0, "1": 5, "2": 7}}, {topic: {"0": 25, "1": 6, "2": 7}}
        )
    finally:
        reader.stop()
    assert planned == [
        KafkaInputPartition(topic, 0, 0, 10),
        KafkaInputPartition(topic, 0, 10, 20),
        KafkaInputPartition(topic, 0, 20, 25),
        KafkaInputPartition(topic, 1, 5, 6),
    ]


def test_read_stops_at_end_and_fails_rather_than_hangs(
    kafka_bootstrap: str, topic_factory: Callable[..., str], producer
) -> None:
    topic = topic_factory(1)
    produce(producer, topic, 10, partitions=1)
    reader = reader_for(kafka_bootstrap, topic, pollTimeoutMs="1500")
    batches = list(reader.read(KafkaInputPartition(topic, 0, 3, 6)))
    assert [o for b in batches for o in b.column("offset").to_pylist()] == [3, 4, 5]

    with pytest.raises(TimeoutError, match=r"offsets \[8, 20\).*pollTimeoutMs"):
        list(reader.read(KafkaInputPartition(topic, 0, 8, 20)))


@given(
    backlog=st.lists(st.integers(0, 1000), min_size=1, max_size=6),
    budget=st.integers(1, 3000),
)
def test_fair_share_uses_the_budget_and_starves_no_partition(
    backlog: list[int], budget: int
) -> None:
    backlogs = {TopicPartition("t", i): n for i, n in enumerate(backlog)}
    grant = fair_share(backlogs, budget)
    assert sum(grant.values()) == min(budget, sum(backlog))
    assert all(0 <= grant[tp] <= backlogs[tp] for tp in backlogs)
    # A partition left short got at most one less than any other partition.
    biggest = max(grant.values())
    assert all(grant[tp] >= biggest - 1 for tp in backlogs if grant[tp] < backlogs[tp])


def test_rate_limit_is_spread_over_partitions_by_latest_offset(
    kafka_bootstrap: str, topic_factory: Callable[..., str], producer
) -> None:
    topic = topic_factory(3)
    for partition, n in ((0, 40), (1, 2), (2, 40)):
        for i in range(n):
            producer.send(topic, value=b"x%d" % i, partition=partition)
    producer.flush()
    reader = reader_for(kafka_bootstrap, topic, maxOffsetsPerTrigger="30")
    try:
        start = reader.initialOffset()
        end = reader.latestOffset(start, reader.getDefaultReadLimit())
        assert end == {topic: {"0": 14, "1": 2, "2": 14}}
        assert reader.latestOffset(start, ReadAllAvailable())[topic] == {"0": 40, "1": 2, "2": 40}
    finally:
        reader.stop()


# --- options ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("opts", "message"),
    [
        ({"subscribe": "t"}, "'kafka.bootstrap.servers' is required"),
        ({"kafka.bootstrap.servers": "h:1"}, "'subscribe' is required"),
        (options(startingOffsets='{"t": {"0": }'), "'startingOffsets' must be"),
        (options(startingOffsets='{"t": {"x": 1}}'), "'startingOffsets' must be"),
        (options(startingOffsets='{"t": {"0": -3}}'), "'startingOffsets' must be"),
        (options(maxOffsetsPerTrigger="0"), "'maxOffsetsPerTrigger' must be a positive"),
        (options(maxRecordsPerPartition="lots"), "'maxRecordsPerPartition' must be a positive"),
        (options(**{"kafka.isolation.level": "dirty"}), "'kafka.isolation.level' must be one of"),
        (options(**{"kafka.group.id": "g"}), "'kafka.group.id' is not supported"),
    ],
)
def test_bad_options_name_the_option(opts: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        KafkaDataSource(opts)


def test_bad_option_reaches_the_user_when_the_stream_is_defined(spark: SparkSession) -> None:
    with pytest.raises(Exception, match=re.escape("'kafka.bootstrap.servers' is required")):
        spark.readStream.format("dejaq_kafka").option("subscribe", "t").load()
