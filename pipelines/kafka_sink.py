"""Writing to Kafka with kafka-python: the `dejaq_kafka` sink, and the release job's producer.

The sink takes the options and input columns of Spark's own Kafka sink (`key`, `value`,
`headers`, optional `topic` and `partition`), so a job writes the same rows to
`format("kafka")` and `format("dejaq_kafka")`. Producers are idempotent with acks=all: a
retried send cannot duplicate or reorder records within a partition. Records without an
explicit partition go by key through kafka-python's murmur2 partitioner, the one Java
clients use, so a key lands on the same partition whichever client wrote it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from kafka import KafkaProducer
from kafka.producer.future import FutureRecordMetadata
from pyspark.sql.datasource import (
    CaseInsensitiveDict,
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import BinaryType, StringType, StructType

from dejaq.conf.kafka_clients import close_producer
from dejaq.pipelines.kafka_options import CONNECTION_OPTIONS, client_config, client_kwargs

SEND_TIMEOUT_S = 120
# A close after `wait_sent` has nothing left to wait for but its I/O thread, forced past this.
CLOSE_TIMEOUT_S = 10.0

# `kafka.*` options handed to kafka-python's KafkaProducer (see pipelines.kafka_options).
_PRODUCER_OPTIONS: dict[str, type] = {
    **CONNECTION_OPTIONS,
    "linger.ms": int,
    "batch.size": int,
    "compression.type": str,
    "max.request.size": int,
}

Header = tuple[str, bytes]


@dataclass(frozen=True)
class KafkaWriteOptions:
    """The sink's options, checked on the driver before any task starts."""

    topic: str | None
    producer: dict[str, Any] = field(repr=False)  # a password, a key

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> KafkaWriteOptions:
        opts = CaseInsensitiveDict(options)
        return cls(topic=opts.get("topic") or None, producer=producer_config(opts))


def producer_config(opts: Mapping[str, str]) -> dict[str, Any]:
    """KafkaProducer settings from `kafka.*` options: idempotent, acks=all, always."""
    config = client_config(opts, _PRODUCER_OPTIONS, "writing", min_int=0)
    config.update(enable_idempotence=True, acks="all")
    return config


def check_input_schema(schema: StructType, topic: str | None) -> None:
    """Spark's Kafka sink rules: `value` required; `topic` from the option or a column."""
    names = schema.fieldNames()
    if "value" not in names:
        raise ValueError("dejaq_kafka: the data to write needs a 'value' column (binary or string)")
    for name in ("key", "value", "topic"):
        if name in names and not isinstance(schema[name].dataType, BinaryType | StringType):
            raise ValueError(f"dejaq_kafka: column '{name}' must be binary or string")
    if topic is None and "topic" not in names:
        raise ValueError(
            "dejaq_kafka: give option 'topic' or a 'topic' column to say where records go"
        )


def _bytes(value: bytes | str | None) -> bytes | None:
    return value.encode() if isinstance(value, str) else value


def send_rows(
    producer: KafkaProducer, rows: Iterable[Mapping[str, Any]], topic: str | None
) -> list[FutureRecordMetadata]:
    """Send rows in order; a row's own `topic` and `partition` win over the defaults."""
    futures = []
    for row in rows:
        target = row.get("topic") or topic
        if target is None:
            raise ValueError("dejaq_kafka: a row has a null 'topic' and no 'topic' option is set")
        # kafka-python sends no null header value (Kafka allows one): it goes empty.
        headers = [(h["key"], _bytes(h["value"]) or b"") for h in row.get("headers") or []]
        futures.append(
            producer.send(
                target,
                key=_bytes(row.get("key")),
                value=_bytes(row.get("value")),
                headers=headers,
                partition=row.get("partition"),
            )
        )
    return futures


def wait_sent(
    producer: KafkaProducer, futures: list[FutureRecordMetadata], timeout: float = SEND_TIMEOUT_S
) -> None:
    """Flush, then raise the first send error: a write succeeds only if every record did,
    within `timeout` seconds (KafkaTimeoutError past it)."""
    deadline = time.monotonic() + timeout
    producer.flush(timeout=timeout)
    for f in futures:
        f.get(timeout=max(deadline - time.monotonic(), 0.0))


def in_partition_order(partitions: list[object], acked: list[bool]) -> list[bool]:
    """Of sends in send order, each with its output partition and whether Kafka
    acknowledged it, the ones written in order: in each partition, the acknowledged
    sends before its first one not acknowledged (failed, or not answered yet: one
    acknowledged behind it waits for its answer).

    An idempotent producer that drops a failed batch bumps its epoch and sends the
    batches queued behind it, which Kafka then acknowledges: taken for released, they
    would stay ahead of the failed ones, which a retry writes after them. Sent again
    instead, each also follows them in the partition; its earlier copy carries the same
    `dejaq-id`."""
    first_failed: dict[object, int] = {}
    for n, (partition, ok) in enumerate(zip(partitions, acked, strict=True)):
        if not ok:
            first_failed.setdefault(partition, n)
    return [
        ok and n < first_failed.get(partition, n + 1)
        for n, (partition, ok) in enumerate(zip(partitions, acked, strict=True))
    ]


@dataclass
class KafkaCommitMessage(WriterCommitMessage):
    records: int


def _write_task(
    options: KafkaWriteOptions, batches: Iterator[pa.RecordBatch]
) -> KafkaCommitMessage:
    producer = KafkaProducer(**client_kwargs(options.producer))
    try:
        futures: list[FutureRecordMetadata] = []
        for batch in batches:
            futures += send_rows(producer, batch.to_pylist(), options.topic)
        wait_sent(producer, futures)
    finally:
        close_producer(producer, CLOSE_TIMEOUT_S)
    return KafkaCommitMessage(len(futures))


class KafkaBatchWriter(DataSourceArrowWriter):
    """`df.write.format("dejaq_kafka")`: each task sends its rows in order and waits for acks."""

    def __init__(self, options: KafkaWriteOptions) -> None:
        self.options = options

    def write(self, iterator: Iterator[pa.RecordBatch]) -> KafkaCommitMessage:
        return _write_task(self.options, iterator)


class KafkaStreamWriter(DataSourceStreamArrowWriter):
    """At-least-once per micro-batch, like Spark's Kafka sink: a replayed batch is re-sent."""

    def __init__(self, options: KafkaWriteOptions) -> None:
        self.options = options

    def write(self, iterator: Iterator[pa.RecordBatch]) -> KafkaCommitMessage:
        return _write_task(self.options, iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Nothing to do: every record was acknowledged before its task finished."""

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Nothing to undo: Kafka records already acknowledged stay written."""
