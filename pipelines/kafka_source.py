"""`dejaq_kafka`: a Kafka streaming source (and sink) on kafka-python, for Sparks without the jar.

It takes the options and yields the schema of Spark's own Kafka source (with
includeHeaders=true), so a job reads the same rows from `format("kafka")` and
`format("dejaq_kafka")`. Offsets are {topic: {"partition": next offset}}, as in the JVM
source's checkpoint. Consumers are assigned partitions and never join a group or commit:
the query's checkpoint is the only record of progress, which is what makes a file sink
exactly-once across restarts.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from kafka import KafkaConsumer, TopicPartition
from kafka.consumer.fetcher import ConsumerRecord
from kafka.errors import LogTruncationError, OffsetOutOfRangeError
from pyspark.sql.datasource import (
    CaseInsensitiveDict,
    DataSource,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from dejaq.pipelines.kafka_options import (
    CONNECTION_OPTIONS,
    check_trust,
    client_config,
    client_kwargs,
)
from dejaq.pipelines.kafka_sink import (
    KafkaBatchWriter,
    KafkaStreamWriter,
    KafkaWriteOptions,
    check_input_schema,
)

log = logging.getLogger("dejaq.kafka_source")

KAFKA_SCHEMA = StructType(
    [
        StructField("key", BinaryType()),
        StructField("value", BinaryType()),
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("offset", LongType()),
        StructField("timestamp", TimestampType()),
        StructField("timestampType", IntegerType()),
        StructField(
            "headers",
            ArrayType(
                StructType([StructField("key", StringType()), StructField("value", BinaryType())])
            ),
        ),
    ]
)

# Spark checks each batch's Arrow schema against KAFKA_SCHEMA exactly, so the types are spelt out.
_HEADERS_TYPE = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))
ARROW_SCHEMA = pa.schema(
    [
        ("key", pa.binary()),
        ("value", pa.binary()),
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("timestamp", pa.timestamp("us", tz="UTC")),
        ("timestampType", pa.int32()),
        ("headers", _HEADERS_TYPE),
    ]
)

BATCH_ROWS = 4096
_POLL_MS = 1000  # one poll's wait: short, so the pollTimeoutMs deadline is checked often
EARLIEST, LATEST = -2, -1  # the JVM source's markers inside a startingOffsets JSON

# `kafka.*` options handed to kafka-python's KafkaConsumer (see pipelines.kafka_options).
_CONSUMER_OPTIONS: dict[str, type] = {
    **CONNECTION_OPTIONS,
    "isolation.level": str,
    "fetch.max.bytes": int,
    "max.partition.fetch.bytes": int,
}
_ISOLATION_LEVELS = ("read_uncommitted", "read_committed")

Positions = dict[TopicPartition, int]


@dataclass(frozen=True)
class KafkaOptions:
    """The source's options, checked once so that a typo fails the query at start."""

    topics: tuple[str, ...]
    starting_offsets: str | dict[str, dict[str, int]]
    max_offsets_per_trigger: int | None
    max_records_per_partition: int
    poll_timeout_ms: int
    consumer: dict[str, Any] = field(repr=False)  # a password, a key

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> KafkaOptions:
        opts = CaseInsensitiveDict(options)
        topics = tuple(t.strip() for t in opts.get("subscribe", "").split(",") if t.strip())
        if not topics:
            raise ValueError(
                "dejaq_kafka: option 'subscribe' is required (comma-separated topic names) to "
                "read; to write, give option 'topic'"
            )
        max_per_trigger = opts.get("maxOffsetsPerTrigger")
        if max_per_trigger is not None:
            max_per_trigger = _positive_int("maxOffsetsPerTrigger", max_per_trigger)
        return cls(
            topics=topics,
            starting_offsets=_parse_starting_offsets(opts.get("startingOffsets", "earliest")),
            max_offsets_per_trigger=max_per_trigger,
            max_records_per_partition=_positive_int(
                "maxRecordsPerPartition", opts.get("maxRecordsPerPartition", "200000")
            ),
            poll_timeout_ms=_positive_int("pollTimeoutMs", opts.get("pollTimeoutMs", "120000")),
            consumer=_consumer_config(opts),
        )


def _positive_int(name: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"dejaq_kafka: option '{name}' must be a positive integer, got {raw!r}")
    return value


def _parse_starting_offsets(raw: str) -> str | dict[str, dict[str, int]]:
    """'earliest', 'latest', or the JVM source's JSON: {"topic": {"0": 23, "1": -2}}."""
    if raw.strip().lower() in ("earliest", "latest"):
        return raw.strip().lower()
    hint = (
        "dejaq_kafka: option 'startingOffsets' must be 'earliest', 'latest' or JSON like "
        '{"topic": {"0": 23, "1": -2}} (-2 = earliest, -1 = latest)'
    )
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{hint}; got {raw!r} ({e})") from None
    valid = isinstance(parsed, dict) and all(
        isinstance(parts, dict)
        and all(p.isdigit() and type(o) is int and o >= EARLIEST for p, o in parts.items())
        for parts in parsed.values()
    )
    if not valid:
        raise ValueError(f"{hint}; got {raw!r}")
    return {t: {str(int(p)): o for p, o in parts.items()} for t, parts in parsed.items()}


def _consumer_config(opts: CaseInsensitiveDict) -> dict[str, Any]:
    config = client_config(opts, _CONSUMER_OPTIONS, "reading", min_int=1)
    if config.setdefault("isolation_level", "read_uncommitted") not in _ISOLATION_LEVELS:
        raise ValueError(
            f"dejaq_kafka: option 'kafka.isolation.level' must be one of {_ISOLATION_LEVELS}, "
            f"got {config['isolation_level']!r}"
        )
    # Assigned partitions only: no group to join or rebalance, no offsets committed to Kafka.
    # No offset reset either: a read Kafka answers out of range is handled (and logged) by
    # the task, which knows the range it was given.
    config.update(
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="none",
        allow_auto_create_topics=False,
        max_poll_records=BATCH_ROWS,
    )
    return config


def _to_positions(offsets: Mapping[str, Mapping[str, int]]) -> Positions:
    return {
        TopicPartition(topic, int(p)): offset
        for topic, parts in offsets.items()
        for p, offset in parts.items()
    }


def _to_offsets(positions: Positions) -> dict[str, dict[str, int]]:
    """Sorted, so that equal positions always give the same JSON: Spark compares the text."""
    offsets: dict[str, dict[str, int]] = {}
    for tp in sorted(positions):
        offsets.setdefault(tp.topic, {})[str(tp.partition)] = positions[tp]
    return offsets


def fair_share(backlog: Mapping[TopicPartition, int], budget: int) -> Positions:
    """Split `budget` rows over partitions max-min fairly.

    Every partition with data gets an equal share; what a small partition does not need goes
    to the others. A busy partition can thus not starve a quiet one, and the whole budget is
    used whenever there is that much data.
    """
    grant = dict.fromkeys(backlog, 0)
    pending = sorted(tp for tp, n in backlog.items() if n > 0)
    while pending and budget > 0:
        share = max(budget // len(pending), 1)
        still_pending = []
        for tp in pending:
            take = min(share, backlog[tp] - grant[tp], budget)
            grant[tp] += take
            budget -= take
            if grant[tp] < backlog[tp]:
                still_pending.append(tp)
        pending = still_pending
    return grant


# Offsets a batch was given that Kafka no longer has: read by no task, so in neither the
# buffer nor the quarantine, and said so by topic, partition and range.
_DELETED = (
    "dejaq_kafka: %s-%d offsets [%d, %d) were deleted from Kafka (retention, or "
    "delete_records) before they were read: skipped"
)
_PAST_END = (
    "dejaq_kafka: %s-%d offsets [%d, %d) are past the partition's end (its topic deleted "
    "and made again, or its log cut): not read"
)


def _in_log(tp: TopicPartition, lo: int, until: int, first: int, end: int) -> tuple[int, int]:
    """Offsets [lo, until) cut to the partition's log [first, end), warning of what is cut
    on the driver, whose log is where the job's user looks."""
    if lo < min(first, until):
        log.warning(_DELETED, tp.topic, tp.partition, lo, min(first, until))
    if max(lo, end) < until:
        log.warning(_PAST_END, tp.topic, tp.partition, max(lo, end), until)
    return max(lo, first), min(until, end)


@dataclass(frozen=True)
class KafkaInputPartition(InputPartition):
    """Offsets [start, end) of one Kafka partition: one Spark task."""

    topic: str
    partition: int
    start: int
    end: int


class RecordColumns:
    """One Arrow batch of one partition's records, built column by column.

    The read's hot loop: headers are kept flat (offsets, keys, values) and become one
    ListArray, the topic and partition are constant, so no Python object is made per row.
    """

    def __init__(self, topic: str, partition: int) -> None:
        self.topic, self.partition = topic, partition
        self.keys: list[bytes | None] = []
        self.values: list[bytes | None] = []
        self.offsets: list[int] = []
        self.timestamps: list[int] = []
        self.types: list[int] = []
        self.header_ends: list[int] = [0]
        self.no_headers: list[bool] = []
        self.header_keys: list[str] = []
        self.header_values: list[bytes | None] = []

    def __len__(self) -> int:
        return len(self.offsets)

    def extend(self, records: list[ConsumerRecord], start: int, end: int) -> None:
        """Add the records with start <= offset < end."""
        for r in records:
            if not start <= r.offset < end:
                continue
            self.keys.append(r.key)
            self.values.append(r.value)
            self.offsets.append(r.offset)
            self.timestamps.append(r.timestamp * 1000)
            self.types.append(r.timestamp_type)
            self.no_headers.append(not r.headers)
            for k, v in r.headers:
                self.header_keys.append(k)
                self.header_values.append(v)
            self.header_ends.append(len(self.header_keys))

    def to_batch(self) -> pa.RecordBatch:
        n = len(self)
        pairs = pa.StructArray.from_arrays(
            [pa.array(self.header_keys, pa.string()), pa.array(self.header_values, pa.binary())],
            fields=list(_HEADERS_TYPE.value_type),
        )
        headers = pa.ListArray.from_arrays(
            pa.array(self.header_ends, pa.int32()),
            pairs,
            type=_HEADERS_TYPE,
            mask=pa.array(self.no_headers, pa.bool_()),
        )
        arrays = [
            pa.array(self.keys, pa.binary()),
            pa.array(self.values, pa.binary()),
            pa.array([self.topic] * n, pa.string()),
            pa.array([self.partition] * n, pa.int32()),
            pa.array(self.offsets, pa.int64()),
            pa.array(self.timestamps, ARROW_SCHEMA.field("timestamp").type),
            pa.array(self.types, pa.int32()),
            headers,
        ]
        return pa.RecordBatch.from_arrays(arrays, schema=ARROW_SCHEMA)


class KafkaStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Plans micro-batches on the driver and reads offset ranges in the tasks."""

    def __init__(self, options: KafkaOptions) -> None:
        self.options = options
        self._consumer: KafkaConsumer | None = None
        self._target: Positions | None = None  # set by Trigger.AvailableNow
        self._last_latest: Positions | None = None

    # --- driver side ---------------------------------------------------------------------

    def _driver(self) -> KafkaConsumer:
        """One consumer for offset look-ups, kept for the life of the query."""
        if self._consumer is None:
            check_trust(self.options.consumer)
            self._consumer = KafkaConsumer(**client_kwargs(self.options.consumer))
        return self._consumer

    def _current_partitions(self) -> list[TopicPartition]:
        consumer = self._driver()
        # topics() always asks the cluster, which also refreshes the partition lists: new
        # topics and partitions are seen at once rather than after metadata.max.age.ms.
        existing = consumer.topics()
        return sorted(
            TopicPartition(topic, p)
            for topic in self.options.topics
            if topic in existing
            for p in consumer.partitions_for_topic(topic)
        )

    def _beginning(self, tps: list[TopicPartition]) -> Positions:
        if not tps:
            return {}
        return self._driver().beginning_offsets(tps, timeout_ms=self.options.poll_timeout_ms)

    def _end(self, tps: list[TopicPartition]) -> Positions:
        """End offsets; under read_committed, the last stable offset."""
        if not tps:
            return {}
        return self._driver().end_offsets(tps, timeout_ms=self.options.poll_timeout_ms)

    def _rewound(self, begin: Positions, ends: Positions) -> Positions:
        """`begin`, but at its end for a partition whose end is now below where the
        stream had got to (its topic deleted and made again, or its log cut by an
        unclean leader election), as Spark's own source does with `failOnDataLoss`
        off: what comes next is read at once, not after its offsets pass the old ones.
        Reading the partition from its start instead would buffer again, as new
        messages, the records a cut log still holds (ids made of coordinates are not
        deduplicated), and give a topic made again ids its old messages had."""
        behind = [tp for tp, end in ends.items() if end < begin.get(tp, 0)]
        if not behind:
            return begin
        log.warning(
            "dejaq_kafka: the offsets of %s went back (a topic made again, or a log "
            "cut): reading on from their ends; what they held below it is not read",
            [f"{tp.topic}-{tp.partition}: {begin[tp]} -> {ends[tp]}" for tp in behind],
        )
        return begin | {tp: ends[tp] for tp in behind}

    def _with_new_partitions(self, start: dict, current: list[TopicPartition]) -> Positions:
        """`start` plus, for partitions it does not know yet, their earliest offset."""
        positions = _to_positions(start)
        positions.update(self._beginning([tp for tp in current if tp not in positions]))
        return positions

    def initialOffset(self) -> dict:
        current = self._current_partitions()
        starting = self.options.starting_offsets
        if starting == "earliest":
            return _to_offsets(self._beginning(current))
        if starting == "latest":
            return _to_offsets(self._end(current))
        given = _to_positions(starting)
        if set(given) != set(current):
            # The JVM source's rule too: a forgotten partition would otherwise start silently.
            raise ValueError(
                "dejaq_kafka: startingOffsets must list every partition of the subscribed "
                "topics (-2 = earliest, -1 = latest); "
                f"missing {sorted(set(current) - set(given))}, "
                f"unknown {sorted(set(given) - set(current))}"
            )
        earliest = self._beginning([tp for tp, o in given.items() if o == EARLIEST])
        latest = self._end([tp for tp, o in given.items() if o == LATEST])
        return _to_offsets({tp: earliest.get(tp, latest.get(tp, o)) for tp, o in given.items()})

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.options.max_offsets_per_trigger is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.options.max_offsets_per_trigger)

    def prepareForTriggerAvailableNow(self) -> None:
        """Fix the end of an availableNow run: data produced after this is left for later."""
        self._target = self._end(self._current_partitions())

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        # Under availableNow the target stands in for the end: later data waits for a later run.
        latest = self._target
        if latest is None:
            latest = self._end(self._current_partitions())
        self._last_latest = latest
        begin = self._rewound(self._with_new_partitions(start, list(latest)), latest)
        backlog = {tp: max(end - begin[tp], 0) for tp, end in latest.items()}
        if isinstance(limit, ReadMaxRows):
            backlog = fair_share(backlog, limit.max_rows)
        return _to_offsets(begin | {tp: begin[tp] + n for tp, n in backlog.items()})

    def reportLatestOffset(self) -> dict | None:
        """What the last latestOffset call saw before the read limit, for progress reports."""
        return None if self._last_latest is None else _to_offsets(self._last_latest)

    def partitions(self, start: dict, end: dict) -> list[KafkaInputPartition]:
        """One task per partition with new data; big ranges are split across several tasks.

        A batch replayed after a restart was planned against the Kafka of then: each range
        is cut to the partition's log now (see `_in_log`), so offsets a topic made again
        (or a cut log) no longer has are skipped with a warning rather than waited for, and
        not taken from the new log's records once it grows past them. A batch this reader
        has just planned ends at the ends it read: only the logs' beginnings are asked.
        """
        stop = _to_positions(end)
        begin = self._with_new_partitions(start, list(stop))
        if stop == self._last_latest:
            firsts, ends = self._beginning(list(stop)), stop
        else:
            current = set(self._current_partitions())
            existing = [tp for tp in stop if tp in current]
            firsts, ends = self._beginning(existing), self._end(existing)
        step = self.options.max_records_per_partition
        planned = []
        for tp, until in stop.items():
            lo = begin[tp]
            if tp in ends:
                lo, until = _in_log(tp, lo, until, firsts[tp], ends[tp])
            planned += [
                KafkaInputPartition(tp.topic, tp.partition, o, min(o + step, until))
                for o in range(lo, until, step)
            ]
        return planned

    def stop(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None

    # --- task side -----------------------------------------------------------------------

    def read(self, partition: KafkaInputPartition) -> Iterator[pa.RecordBatch]:  # type: ignore[override]
        """Records with start <= offset < end, as Arrow batches.

        The loop ends on the consumer's position, not on seeing offset end - 1: transaction
        markers, aborted records and compaction leave gaps that no record fills. It fails,
        rather than hangs, when the position stops moving for pollTimeoutMs, and ends with a
        warning, rather than waits, at offsets past the partition's end (see `_gone`).
        """
        p = partition
        tp = TopicPartition(p.topic, p.partition)
        timeout_s = self.options.poll_timeout_ms / 1000
        consumer = KafkaConsumer(**client_kwargs(self.options.consumer))
        try:
            consumer.assign([tp])
            consumer.seek(tp, p.start)
            columns = RecordColumns(p.topic, p.partition)
            position = p.start
            deadline = time.monotonic() + timeout_s
            while position < p.end:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"dejaq_kafka: could not read {p.topic}-{p.partition} offsets "
                        f"[{p.start}, {p.end}): stuck at {position} for "
                        f"{self.options.poll_timeout_ms} ms (pollTimeoutMs). Is the broker "
                        "down, or was the topic deleted or recreated?"
                    )
                try:
                    records = consumer.poll(timeout_ms=_POLL_MS).get(tp, [])
                    moved_to = consumer.position(tp, timeout_ms=_POLL_MS)
                except (OffsetOutOfRangeError, LogTruncationError):
                    moved_to = self._gone(consumer, p, position)
                    if moved_to is None:
                        break
                    consumer.seek(tp, moved_to)
                    records = []
                columns.extend(records, p.start, p.end)
                if len(columns) >= BATCH_ROWS:
                    yield columns.to_batch()
                    columns = RecordColumns(p.topic, p.partition)
                if moved_to is not None and moved_to > position:
                    position = moved_to
                    deadline = time.monotonic() + timeout_s
            if len(columns):
                yield columns.to_batch()
        finally:
            consumer.close()

    def _gone(self, consumer: KafkaConsumer, p: KafkaInputPartition, position: int) -> int | None:
        """Where to read on from after Kafka said `position` is not in the partition's log:
        its beginning if the records there were deleted, or None (the task ends) if it is
        past the end, the topic made again or the log cut since the batch was planned."""
        tp = TopicPartition(p.topic, p.partition)
        first = consumer.beginning_offsets([tp], timeout_ms=self.options.poll_timeout_ms)[tp]
        if position < first:
            log.warning(_DELETED, p.topic, p.partition, position, min(first, p.end))
            return first
        log.warning(_PAST_END, p.topic, p.partition, position, p.end)
        return None


class KafkaDataSource(DataSource):
    """`format("dejaq_kafka")`: Spark's Kafka source and sink, minus the jar.

    Options are checked when the source is defined, so a typo fails at once. Spark does not
    say whether it will read or write, so options with `topic` and no `subscribe` are taken
    as a write's (checked by the writer); anything else as a read's. Writes therefore need
    option `topic`, where Spark's sink also takes a `topic` column alone; the column still
    wins row by row.
    """

    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options)
        opts = CaseInsensitiveDict(options)
        self._for_write = "topic" in opts and "subscribe" not in opts
        self.parsed = None if self._for_write else KafkaOptions.parse(options)

    @classmethod
    def name(cls) -> str:
        return "dejaq_kafka"

    def schema(self) -> StructType:
        return KAFKA_SCHEMA

    def streamReader(self, schema: StructType) -> KafkaStreamReader:
        return KafkaStreamReader(self._read_options())

    def writer(self, schema: StructType, overwrite: bool) -> KafkaBatchWriter:
        return KafkaBatchWriter(self._write_options(schema))

    def streamWriter(self, schema: StructType, overwrite: bool) -> KafkaStreamWriter:
        return KafkaStreamWriter(self._write_options(schema))

    def _read_options(self) -> KafkaOptions:
        if self.parsed is None:
            self.parsed = KafkaOptions.parse(self.options)
        return self.parsed

    def _write_options(self, schema: StructType) -> KafkaWriteOptions:
        options = KafkaWriteOptions.parse(self.options)
        check_input_schema(schema, options.topic)
        check_trust(options.producer)
        return options
