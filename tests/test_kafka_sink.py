"""The `dejaq_kafka` sink: Spark rows to a real Kafka, batch and streaming."""

from __future__ import annotations

from collections import defaultdict

import pytest
from conftest import run_to_end, wait_until
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.consumer.fetcher import ConsumerRecord
from pyspark.sql.types import _parse_datatype_string

from dejaq.pipelines.kafka_source import KafkaDataSource


def read_all(bootstrap: str, topic: str, partitions: int, n: int) -> list[ConsumerRecord]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    consumer.assign([TopicPartition(topic, p) for p in range(partitions)])
    consumer.seek_to_beginning()
    records: list[ConsumerRecord] = []

    def poll() -> bool:
        for batch in consumer.poll(timeout_ms=200).values():
            records.extend(batch)
        return len(records) >= n

    try:
        wait_until(poll, timeout=60, what=f"{n} records on {topic}")
    finally:
        consumer.close()
    return records


def test_batch_write_keeps_key_order_per_partition(spark, kafka_bootstrap, topic_factory):
    out = topic_factory(partitions=3)
    rows = [(f"k{i % 4}", f"v{i}".encode(), [("h", f"{i}".encode())]) for i in range(40)]
    df = spark.createDataFrame(
        rows, "key string, value binary, headers array<struct<key: string, value: binary>>"
    )
    (
        df.coalesce(1)
        .write.format("dejaq_kafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("topic", out)
        .mode("append")
        .save()
    )
    records = read_all(kafka_bootstrap, out, 3, 40)
    partitions_of_key = defaultdict(set)
    for r in records:
        partitions_of_key[r.key].add(r.partition)
    assert len(partitions_of_key) == 4 and all(len(p) == 1 for p in partitions_of_key.values())
    by_partition = defaultdict(list)
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        by_partition[r.partition].append(int(dict(r.headers)["h"]))
    assert all(numbers == sorted(numbers) for numbers in by_partition.values())
    assert sorted(r.value for r in records) == sorted(v for _, v, _ in rows)


def test_stream_from_kafka_to_kafka_where_the_topic_column_wins(
    spark, kafka_bootstrap, topic_factory, tmp_path
):
    source, out = topic_factory(partitions=2), topic_factory(partitions=2)
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    for i in range(30):
        producer.send(source, key=f"k{i}".encode(), value=f"v{i}".encode(), headers=[("n", b"1")])
    producer.flush()
    producer.close()
    query = (
        spark.readStream.format("dejaq_kafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("subscribe", source)
        .load()
        .selectExpr("key", "value", "headers", f"'{out}' AS topic")
        .writeStream.format("dejaq_kafka")
        .option("kafka.bootstrap.servers", kafka_bootstrap)
        .option("topic", source)  # the default; each row's topic column wins
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    run_to_end(query)
    records = read_all(kafka_bootstrap, out, 2, 30)
    assert sorted(r.value for r in records) == sorted(f"v{i}".encode() for i in range(30))
    assert all(r.headers == [("n", b"1")] for r in records)


@pytest.mark.parametrize(
    ("columns", "opts", "message"),
    [
        ("key string", {"topic": "t"}, "needs a 'value' column"),
        ("value int", {"topic": "t"}, "column 'value' must be binary or string"),
        ("value string", {"subscribe": "t"}, "give option 'topic' or a 'topic' column"),
        ("value string", {"topic": "t", "kafka.acks": "1"}, "'kafka.acks' is not supported"),
        ("value string", {"topic": "t", "kafka.linger.ms": "soon"}, "must be an integer"),
    ],
)
def test_bad_writes_name_the_problem(columns: str, opts: dict[str, str], message: str) -> None:
    source = KafkaDataSource({"kafka.bootstrap.servers": "127.0.0.1:1", **opts})
    with pytest.raises(ValueError, match=message):
        source.writer(_parse_datatype_string(columns), overwrite=False)
