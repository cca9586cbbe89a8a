"""Kafka records → parsed rows, each a buffer row or carrying the reason it is not,
as Spark SQL expressions.

Parsing runs in the JVM (no Python per record) and never raises: every value is
checked with `try_*` casts and patterns, and a record that fails a check carries a
reason code instead. `pipelines.batch_files` splits the parsed rows between the
buffer and the quarantine on whether `reason` is null: `in = buffer + quarantine`.
"""

from __future__ import annotations

from enum import StrEnum

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from dejaq.conf.settings import TopicConfig, TopicKind

HEADER_PRIORITY = "dejaq-priority"
HEADER_DELIVER_AT = "dejaq-deliver-at"
HEADER_ID = "dejaq-id"
HEADER_EVENT_TIME = "dejaq-event-time"

MAX_PRIORITY = 65535
# 9999-12-31T23:59:59.999Z: the last instant a Delta timestamp holds.
MAX_EPOCH_MS = 253_402_300_799_999
ISO_WITH_OFFSET = r"^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2}(\.\d{1,9})?)?(Z|[+-]\d{2}:?\d{2})$"
# A time without seconds, before its offset: ISO-8601 allows it, Spark's cast does not.
NO_SECONDS = r"^(\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2})([Z+-])"
# A fraction of a second with a nonzero digit past the microseconds Spark's cast keeps.
SUB_MICROS = r"\.\d{6}0*[1-9]"
# `conf.tables.SECONDS_LIKE_MS` as text: read as ms, a producer's seconds would put a timeline
# message or an event 55 years in the past, so they are quarantined instead.
SECONDS_LIKE = r"^[1-9]\d{9,10}$"
SECONDS_DETAIL = ": milliseconds expected; this looks like seconds"

COORDINATES = ["source_topic", "source_partition", "source_offset"]


class Reason(StrEnum):
    """Why a record went to quarantine; stable codes for dashboards and replays."""

    MISSING_PRIORITY = "missing_priority"
    INVALID_PRIORITY = "invalid_priority"
    PRIORITY_OUT_OF_RANGE = "priority_out_of_range"
    MISSING_DELIVER_AT = "missing_deliver_at"
    INVALID_DELIVER_AT = "invalid_deliver_at"
    INVALID_EVENT_TIME = "invalid_event_time"
    EVENT_TIME_IN_FUTURE = "event_time_in_future"
    INVALID_ID = "invalid_id"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    DUPLICATE = "duplicate"


def _header(name: str) -> Column:
    """The last value of a header (Kafka's `lastHeader`), as bytes, or null."""
    matches = F.filter("headers", lambda h: h["key"] == F.lit(name))
    return F.when(F.size(matches) > 0, F.element_at(matches, -1)["value"])


def _field(header: str, json_field: str | None) -> Column:
    """A raw envelope value as a string: from the JSON payload if mapped, else the header."""
    if json_field is not None:
        return F.get_json_object(F.col("value").cast("string"), f"$.{json_field}")
    return _header(header).cast("string")


def _epoch_ms(raw: Column) -> Column:
    """Epoch milliseconds from decimal ms or ISO-8601 with an offset; null if neither,
    or if the number looks like seconds (`SECONDS_LIKE`).

    An ISO time finer than a millisecond rounds up: `….0009Z` is due at `….001Z`, as
    truncated it would be released before its time."""
    as_number = F.when(
        raw.rlike(r"^-?\d{1,16}$") & ~raw.rlike(SECONDS_LIKE), raw.try_cast("bigint")
    )
    ts = F.regexp_replace(raw, NO_SECONDS, "$1:00$2").try_cast("timestamp")
    finer = (F.pmod(F.unix_micros(ts), F.lit(1000)) > 0) | raw.rlike(SUB_MICROS)
    as_iso = F.when(raw.rlike(ISO_WITH_OFFSET), F.unix_millis(ts) + finer.cast("bigint"))
    ms = F.coalesce(as_number, as_iso)
    return F.when((ms >= 0) & (ms <= MAX_EPOCH_MS), ms)


def _time_detail(raw: Column) -> Column:
    """The detail of a time that failed to parse: the raw value, and why if it looks
    like seconds."""
    return F.when(raw.rlike(SECONDS_LIKE), F.concat(raw, F.lit(SECONDS_DETAIL))).otherwise(raw)


class Parser:
    """One topic's parse: Kafka-schema rows → every buffer column but `ingested_at`,
    plus `reason` and `detail` (null when valid), and `judge`: valid, with an id the
    producer set, which dedup must judge (see `explicit_id`).

    The first failing check wins, in a fixed order, so a record gets one stable reason.
    Its expressions are built once and applied to each micro-batch: building them takes
    the driver some 1,700 calls into the JVM, more than a small batch's own work. For
    the same reason the time of ingest is the writer's (`pipelines.batch_files`): the
    literal Spark makes of `current_timestamp()` differs in every batch, so its code
    would be generated and compiled anew each time.
    """

    def __init__(self, topic: TopicConfig) -> None:
        self.raw, self.numbers, self.columns = _projections(topic)

    def __call__(self, records: DataFrame) -> DataFrame:
        return records.withColumns(self.raw).withColumns(self.numbers).select(*self.columns)


def parse(records: DataFrame, topic: TopicConfig) -> DataFrame:
    """`records` parsed for `topic` (see `Parser`)."""
    return Parser(topic)(records)


def _projections(
    topic: TopicConfig,
) -> tuple[dict[str, Column], dict[str, Column], list[Column]]:
    """The raw envelope fields, the numbers read from them, and the parsed columns."""
    jf = topic.json_fields
    kind = topic.kind.sorted_as
    id_bytes = (
        F.get_json_object(F.col("value").cast("string"), f"$.{jf.id}").cast("binary")
        if jf and jf.id
        else _header(HEADER_ID)
    )
    id_source = f"JSON field {jf.id}" if jf and jf.id else HEADER_ID
    raw = {
        "_prio_raw": _field(HEADER_PRIORITY, jf and jf.priority),
        "_at_raw": _field(HEADER_DELIVER_AT, jf and jf.deliver_at),
        "_evt_raw": _field(HEADER_EVENT_TIME, jf and jf.event_time),
        "_id_raw": id_bytes,
    }
    numbers = {
        "_at_ms": _epoch_ms(F.col("_at_raw")),
        "_evt_ms": _epoch_ms(F.col("_evt_raw")),
        "_prio_num": F.when(
            F.col("_prio_raw").rlike(r"^\s*-?\d{1,18}\s*$"),
            F.col("_prio_raw").try_cast("bigint"),
        ),
    }

    checks: list[tuple[Column, Reason, Column]] = []
    if kind is TopicKind.PRIORITY:
        checks += [
            (F.col("_prio_raw").isNull(), Reason.MISSING_PRIORITY, F.lit(f"no {HEADER_PRIORITY}")),
            (F.col("_prio_num").isNull(), Reason.INVALID_PRIORITY, F.col("_prio_raw")),
            (
                (F.col("_prio_num") < 0) | (F.col("_prio_num") > MAX_PRIORITY),
                Reason.PRIORITY_OUT_OF_RANGE,
                F.col("_prio_raw"),
            ),
        ]
    if kind is TopicKind.TIMELINE:
        checks += [
            (
                F.col("_at_raw").isNull(),
                Reason.MISSING_DELIVER_AT,
                F.lit(f"no {HEADER_DELIVER_AT}"),
            ),
            (F.col("_at_ms").isNull(), Reason.INVALID_DELIVER_AT, _time_detail(F.col("_at_raw"))),
        ]
    if kind is TopicKind.EVENT_TIME:
        produced_ms = F.unix_millis("timestamp")
        ahead_ms = F.col("_evt_ms") - produced_ms
        checks += [
            (
                F.col("_evt_raw").isNotNull() & F.col("_evt_ms").isNull(),
                Reason.INVALID_EVENT_TIME,
                _time_detail(F.col("_evt_raw")),
            ),
            # The release's watermark follows the largest event time: one far ahead would
            # make every later event late. A record without a Kafka timestamp (-1) is
            # not judged.
            (
                (produced_ms >= 0) & (ahead_ms > topic.max_event_time_ahead_ms),
                Reason.EVENT_TIME_IN_FUTURE,
                F.concat(
                    F.col("_evt_raw"),
                    F.lit(" is "),
                    ahead_ms.cast("string"),
                    F.lit(
                        f" ms ahead of the record's Kafka timestamp"
                        f" (max_event_time_ahead_ms: {topic.max_event_time_ahead_ms})"
                    ),
                ),
            ),
        ]
    checks += [
        (
            F.col("_id_raw").isNotNull() & ~F.is_valid_utf8(F.col("_id_raw").cast("string")),
            Reason.INVALID_ID,
            F.lit(f"{HEADER_ID} is not UTF-8"),
        ),
        # An id no API call can name (it takes ids of 1 character or more), and whose
        # every repeat would be taken for a duplicate of the first: set by mistake.
        (
            F.col("_id_raw").isNotNull() & (F.length("_id_raw") == 0),
            Reason.INVALID_ID,
            F.lit(f"{id_source} is empty: give an id, or none for the default"),
        ),
        (
            F.coalesce(F.length("value"), F.lit(0)) > topic.max_payload_bytes,
            Reason.PAYLOAD_TOO_LARGE,
            F.concat(
                F.length("value").cast("string"), F.lit(f" bytes > {topic.max_payload_bytes}")
            ),
        ),
    ]
    reason = F.lit(None).cast("string")
    detail = F.lit(None).cast("string")
    for failed, code, why in reversed(checks):
        reason = F.when(failed, F.lit(code.value)).otherwise(reason)
        detail = F.when(failed, F.make_valid_utf8(why.cast("string"))).otherwise(detail)

    event_ms = F.coalesce(F.col("_evt_ms"), F.unix_millis("timestamp"))
    sort_key = {
        TopicKind.PRIORITY: F.col("_prio_num"),
        TopicKind.TIMELINE: F.col("_at_ms"),
        TopicKind.EVENT_TIME: event_ms,
    }[kind]
    default_id = F.concat_ws(
        "-", "topic", F.col("partition").cast("string"), F.col("offset").cast("string")
    )
    message_id = F.coalesce(F.col("_id_raw").cast("string"), default_id)
    # Null keys spread by id; a key always lands in the same bucket, which keeps its order.
    bucket = F.pmod(
        F.xxhash64(F.coalesce(F.col("key"), message_id.cast("binary"))), F.lit(topic.buckets)
    )
    in_kind = {
        "priority": F.col("_prio_num") if kind is TopicKind.PRIORITY else F.lit(None),
        "deliver_at": F.col("_at_ms") if kind is TopicKind.TIMELINE else F.lit(None),
        "event_time": event_ms if kind is TopicKind.EVENT_TIME else F.lit(None),
    }
    return (
        raw,
        numbers,
        [
            message_id.alias("message_id"),
            bucket.cast("int").alias("bucket"),
            sort_key.cast("bigint").alias("sort_key"),
            in_kind["priority"].cast("int").alias("priority"),
            F.timestamp_millis(in_kind["deliver_at"]).alias("deliver_at"),
            F.timestamp_millis(in_kind["event_time"]).alias("event_time"),
            "key",
            F.col("value").alias("payload"),
            "headers",
            F.col("topic").alias("source_topic"),
            F.col("partition").alias("source_partition"),
            F.col("offset").alias("source_offset"),
            F.col("timestamp").alias("produced_at"),
            reason.alias("reason"),
            detail.alias("detail"),
            (reason.isNull() & (message_id != default_id)).alias("judge"),
        ],
    )


def explicit_id() -> Column:
    """True where the producer set the id: only those can repeat.

    A default id is the record's own Kafka coordinates, unique by construction, so
    dedup (a shuffle, and a look at the buffer) is needed for explicit ids only.
    """
    default = F.concat_ws(
        "-", "source_topic", F.col("source_partition").cast("string"), F.col("source_offset")
    )
    return F.col("message_id") != default
