"""Envelope parsing: valid records become buffer rows, every bad one a quarantine row."""

from __future__ import annotations

import datetime as dt

import pytest
from chispa import assert_df_equality
from conftest import assert_rows
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyspark.sql import DataFrame

from dejaq.broker.api.routers.messages import payload_id
from dejaq.broker.service import Problem
from dejaq.conf.settings import JsonFields, TopicConfig
from dejaq.conf.tables import BUFFER_SCHEMA, QUARANTINE_SCHEMA
from dejaq.pipelines.batch_files import buffer_part, quarantine_part
from dejaq.pipelines.envelope import parse

KAFKA_DDL = (
    "key binary, value binary, topic string, partition int, offset long, timestamp timestamp,"
    " timestampType int, headers array<struct<key:string,value:binary>>"
)
T0 = dt.datetime(2026, 11, 21, 12, 0, tzinfo=dt.UTC)

PRIORITY = TopicConfig(name="p", kind="priority", source=["in"], buckets=8, max_payload_bytes=64)
TIMELINE = TopicConfig(name="t", kind="timeline", source=["in"])
EVENTS = TopicConfig(name="e", kind="event_time", source=["in"], delivery="release", output="o")


Headers = dict[str, bytes] | list[tuple[str, bytes]]


def pairs(headers: Headers) -> list[tuple[str, bytes]]:
    return list(headers.items()) if isinstance(headers, dict) else headers


def records(spark, rows: list[tuple[bytes | None, bytes | None, Headers]], partition=0):
    """Rows shaped like Spark's Kafka source; headers may repeat a key when given as pairs."""
    data = [
        (key, value, "in", partition, offset, T0, 0, pairs(headers))
        for offset, (key, value, headers) in enumerate(rows)
    ]
    return spark.createDataFrame(data, KAFKA_DDL)


def assert_reasons(parsed: DataFrame, expected: list[tuple[int, str | None]]) -> None:
    """Each record's offset with its quarantine reason, None for a record buffered."""
    ddl = "source_offset long, reason string"
    assert_rows(parsed.select("source_offset", "reason"), expected, ddl)


def test_priority_records_become_buffer_rows(spark) -> None:
    df = records(
        spark,
        [
            (b"k1", b"a", {"dejaq-priority": b"7"}),
            (b"k2", b"b", {"dejaq-priority": b"0", "dejaq-id": b"order-9"}),
            (None, b"c", {"dejaq-priority": b"3", "dejaq-priority ": b"x"}),
            (b"k1", b"d", [("dejaq-priority", b"9"), ("x", b"y"), ("dejaq-priority", b"65535")]),
        ],
    )
    rows = buffer_part(parse(df, PRIORITY).toArrow(), T0)
    assert rows.schema.equals(BUFFER_SCHEMA)
    out = spark.createDataFrame(rows)
    expected = spark.createDataFrame(
        [
            ("in-0-0", 7, 7, b"a"),
            ("order-9", 0, 0, b"b"),
            ("in-0-2", 3, 3, b"c"),
            ("in-0-3", 65535, 65535, b"d"),
        ],
        "message_id string, sort_key long, priority int, payload binary",
    )
    assert_df_equality(
        out.select("message_id", "sort_key", "priority", "payload"),
        expected,
        ignore_row_order=True,
        ignore_nullable=True,
    )
    buckets = {r.message_id: r.bucket for r in out.collect()}
    assert all(0 <= b < 8 for b in buckets.values())
    assert buckets["in-0-0"] == buckets["in-0-3"], "one key, one bucket"


@pytest.mark.parametrize(
    ("headers", "value", "reason"),
    [
        ({}, b"x", "missing_priority"),
        ({"dejaq-priority": b"high"}, b"x", "invalid_priority"),
        ({"dejaq-priority": b"1.5"}, b"x", "invalid_priority"),
        ({"dejaq-priority": b"\xff\xfe"}, b"x", "invalid_priority"),
        ({"dejaq-priority": b""}, b"x", "invalid_priority"),
        ({"dejaq-priority": b"65536"}, b"x", "priority_out_of_range"),
        ({"dejaq-priority": b"-1"}, b"x", "priority_out_of_range"),
        ({"dejaq-priority": b"99999999999999999999999"}, b"x", "invalid_priority"),
        ({"dejaq-priority": b"1", "dejaq-id": b"\xc3\x28"}, b"x", "invalid_id"),
        ({"dejaq-priority": b"1", "dejaq-id": b""}, b"x", "invalid_id"),
        ({"dejaq-priority": b"1"}, b"x" * 65, "payload_too_large"),
        ({"dejaq-priority": b"1"}, None, None),
        ({"dejaq-priority": b" 42 "}, b"x", None),
    ],
)
def test_bad_priority_records_are_quarantined_with_a_reason(spark, headers, value, reason) -> None:
    parsed = parse(records(spark, [(b"k", value, headers)]), PRIORITY)
    assert_reasons(parsed, [(0, reason)])
    q = quarantine_part(parsed.toArrow(), T0)
    assert q.schema.equals(QUARANTINE_SCHEMA)
    assert q.num_rows == (reason is not None)
    if reason:
        row = q.to_pylist()[0]
        assert (row["key"], row["value"], row["source_offset"]) == (b"k", value, 0)
        assert row["reason"] == reason and row["quarantined_at"] == T0
        assert [(h["key"], h["value"]) for h in row["headers"]] == list(headers.items())


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"1795262400000", dt.datetime(2026, 11, 21, 12, 0, tzinfo=dt.UTC)),
        (b"2026-11-21T13:00:00+01:00", dt.datetime(2026, 11, 21, 12, 0, tzinfo=dt.UTC)),
        (b"2026-11-21T12:00:00.250Z", dt.datetime(2026, 11, 21, 12, 0, 0, 250000, tzinfo=dt.UTC)),
        (b"2026-11-21T13:00+0100", dt.datetime(2026, 11, 21, 12, 0, tzinfo=dt.UTC)),
        (b"2026-11-21 11:00-01:00", dt.datetime(2026, 11, 21, 12, 0, tzinfo=dt.UTC)),
        (b"2026-11-21T12:00Z", dt.datetime(2026, 11, 21, 12, 0, tzinfo=dt.UTC)),
        (b"2026-11-21 07:00:00.5-0500", dt.datetime(2026, 11, 21, 12, 0, 0, 500000, tzinfo=dt.UTC)),
        (b"0", dt.datetime(1970, 1, 1, tzinfo=dt.UTC)),
        (b"999999999", dt.datetime(1970, 1, 12, 13, 46, 39, 999000, tzinfo=dt.UTC)),
        (b"100000000000", dt.datetime(1973, 3, 3, 9, 46, 40, tzinfo=dt.UTC)),
        (b"1795262400", None),
        (b"99999999999", None),
        (b"2026-11-21T12:00:00", None),
        (b"tomorrow", None),
        (b"2026-13-45T10:00:00Z", None),
        (b"-5", None),
    ],
)
def test_timeline_deliver_at_epoch_ms_or_iso_with_offset(spark, raw, expected) -> None:
    parsed = parse(records(spark, [(b"k", b"v", {"dejaq-deliver-at": raw})]), TIMELINE)
    row = parsed.first()
    if expected is None:
        assert row.reason == "invalid_deliver_at"
    else:
        assert row.reason is None
        assert row.deliver_at == expected.replace(tzinfo=None)
        assert row.sort_key == int(expected.timestamp() * 1000)


def test_an_iso_time_finer_than_a_millisecond_rounds_up_never_early(spark) -> None:
    """Milliseconds are what the buffer keeps: a truncated time would fall due early."""
    cases = {
        b"2026-11-21T12:00:00.0009Z": 1795262400001,
        b"2026-11-21T12:00:00.000000001Z": 1795262400001,
        b"2026-11-21T13:00:00.123456789+01:00": 1795262400124,
        b"2026-11-21T12:00:00.999999Z": 1795262401000,
        b"2026-11-21T12:00:00.001000000Z": 1795262400001,
        b"2026-11-21T12:00:00.0000000Z": 1795262400000,
    }
    times = [{"dejaq-deliver-at": raw, "dejaq-event-time": raw} for raw in cases]
    df = records(spark, [(b"k", b"v", headers) for headers in times])
    epoch = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    expected = [
        (offset, ms, epoch + dt.timedelta(milliseconds=ms))
        for offset, ms in enumerate(cases.values())
    ]
    for topic, column in ((TIMELINE, "deliver_at"), (EVENTS, "event_time")):
        assert_rows(
            parse(df, topic).select("source_offset", "sort_key", column),
            expected,
            f"source_offset long, sort_key long, {column} timestamp",
        )


def test_epoch_seconds_are_quarantined_with_why(spark) -> None:
    df = records(
        spark,
        [(b"k", b"v", {"dejaq-deliver-at": b"1795262400", "dejaq-event-time": b"1795262400"})],
    )
    why = "1795262400: milliseconds expected; this looks like seconds"
    for topic, reason in ((TIMELINE, "invalid_deliver_at"), (EVENTS, "invalid_event_time")):
        parsed = parse(df, topic).select("reason", "detail")
        assert_rows(parsed, [(reason, why)], "reason string, detail string")


def test_timeline_without_deliver_at_is_quarantined(spark) -> None:
    assert_reasons(parse(records(spark, [(b"k", b"v", {})]), TIMELINE), [(0, "missing_deliver_at")])


def test_event_time_from_header_or_kafka_timestamp(spark) -> None:
    df = records(
        spark,
        [
            (b"k", b"v", {"dejaq-event-time": b"1000"}),
            (b"k", b"v", {}),
            (b"k", b"v", {"dejaq-event-time": b"?"}),
        ],
    )
    parsed = parse(df, EVENTS)
    assert_reasons(parsed, [(0, None), (1, None), (2, "invalid_event_time")])
    assert_rows(
        parsed.where("reason IS NULL").select("source_offset", "sort_key"),
        [(0, 1000), (1, int(T0.timestamp() * 1000))],
        "source_offset long, sort_key long",
    )


def test_an_event_time_far_ahead_of_its_record_is_quarantined_the_rest_buffered(spark) -> None:
    t0_ms = int(T0.timestamp() * 1000)
    hour = 3600 * 1000
    times = [
        str(t0_ms - 1000).encode(),
        str(t0_ms + hour).encode(),
        str(t0_ms + hour + 1).encode(),
        b"2100-01-01T00:00:00Z",
        None,
    ]
    batch = [(b"k", b"v", {} if t is None else {"dejaq-event-time": t}) for t in times]
    parsed = parse(records(spark, batch), EVENTS).toArrow()
    buffered = spark.createDataFrame(buffer_part(parsed, T0)).select("source_offset", "sort_key")
    expected = spark.createDataFrame(
        [(0, t0_ms - 1000), (1, t0_ms + hour), (4, t0_ms)], "source_offset long, sort_key long"
    )
    assert_df_equality(buffered, expected, ignore_row_order=True, ignore_nullable=True)
    quarantined = quarantine_part(parsed, T0).to_pylist()
    assert sorted((r["source_offset"], r["reason"]) for r in quarantined) == [
        (2, "event_time_in_future"),
        (3, "event_time_in_future"),
    ]
    details = {r["source_offset"]: r["detail"] for r in quarantined}
    assert details[2] == (
        f"{t0_ms + hour + 1} is {hour + 1} ms ahead of the record's Kafka timestamp"
        f" (max_event_time_ahead_ms: {hour})"
    )


def test_the_event_time_bound_is_the_topic_s_and_needs_a_kafka_timestamp(spark) -> None:
    t0_ms = int(T0.timestamp() * 1000)
    exact = EVENTS.model_copy(update={"max_event_time_ahead_ms": 0})
    ahead = [(b"k", b"v", {"dejaq-event-time": str(t0_ms + d).encode()}) for d in (0, 1)]
    assert_reasons(parse(records(spark, ahead), exact), [(0, None), (1, "event_time_in_future")])
    no_timestamp = dt.datetime(1969, 12, 31, 23, 59, 59, 999000, tzinfo=dt.UTC)
    df = spark.createDataFrame(
        [(b"k", b"v", "in", 0, 0, no_timestamp, 0, [("dejaq-event-time", b"1795262400000")])],
        KAFKA_DDL,
    )
    assert_reasons(parse(df, exact), [(0, None)])


def test_an_empty_id_is_quarantined_not_taken_for_a_duplicate(spark) -> None:
    """Every repeat of an empty id would be quarantined as a duplicate of the first,
    under an id no API call can name: an empty id is invalid, in a header or a field."""
    by_field = TopicConfig(
        name="j", kind="priority", source=["in"], json_fields=JsonFields(priority="p", id="uid")
    )
    empty_header = [(b"k", b"v", {"dejaq-priority": b"1", "dejaq-id": b""})] * 2
    empty_field = [(b"k", b'{"p": 1, "uid": ""}', {})] * 2
    expected = spark.createDataFrame(
        [("invalid_id", "dejaq-id is empty: give an id, or none for the default")] * 2
        + [("invalid_id", "JSON field uid is empty: give an id, or none for the default")] * 2,
        "reason string, detail string",
    )
    parsed = parse(records(spark, empty_header), PRIORITY).unionByName(
        parse(records(spark, empty_field), by_field)
    )
    assert_df_equality(
        parsed.select("reason", "detail"),
        expected,
        ignore_row_order=True,
        ignore_nullable=True,
    )


def test_json_field_mapping(spark) -> None:
    topic = TopicConfig(
        name="j", kind="priority", source=["in"], json_fields=JsonFields(priority="prio", id="uid")
    )
    df = records(
        spark,
        [
            (b"k", b'{"prio": 12, "uid": "u-1"}', {}),
            (b"k", b'{"prio": "13"}', {}),
            (b"k", b"not json", {}),
        ],
    )
    assert_rows(
        parse(df, topic).select("message_id", "sort_key", "reason"),
        [("u-1", 12, None), ("in-0-1", 13, None), ("in-0-2", None, "missing_priority")],
        "message_id string, sort_key long, reason string",
    )


def test_a_produce_answers_the_id_the_ingest_reads_from_the_payload(spark) -> None:
    """On a `json_fields` topic the broker answers a produce with the id it reads from
    the payload, as the ingest's `get_json_object` reads it: of a duplicated name, the
    first field that holds the path; no id (the default) for a lone surrogate."""
    path = "order.refs[1]"
    topic = TopicConfig(
        name="j", kind="priority", source=["in"], json_fields=JsonFields(priority="p", id=path)
    )
    payloads = [
        b'{"p": 1, "order": {"refs": ["a", "b"]}}',
        b'{"p": 1, "order": {"refs": ["a", "first"], "refs": ["a", "second"]}}',
        b'{"p": 1, "order": {"refs": ["a", "c"]}, "order": {"refs": ["a", "d"]}}',
        b'{"p": 1, "order": {"refs": null}, "order": {"refs": ["a", "e"]}}',
        b'{"p": 1, "order": {"refs": ["a"]}, "order": {"refs": ["a", "f"]}}',
        b'{"p": 1, "order": 5, "order": {"refs": ["a", 7]}}',
        b'{"p": 1, "order": {"refs": ["a", null]}, "order": {"refs": ["a", "g"]}}',
        b'{"p": 1, "order": {"refs": ["a", "\\ud800"]}, "order": {"refs": ["a", "h"]}}',
        b'{"p": 1, "order": {"refs": ["a", "x\\udc00y"]}}',
        '{"p": 1, "order": {"refs": ["a", "\u00e9\u20ac"]}}'.encode(),
        b'{"p": 1}',
    ]
    parsed = parse(records(spark, [(b"k", p, {}) for p in payloads]), topic)
    stored = dict(parsed.select("source_offset", "message_id").collect())
    answered = [payload_id(p, path) or f"in-0-{i}" for i, p in enumerate(payloads)]
    assert [stored[i] for i in range(len(payloads))] == answered
    assert answered[1:8] == ["first", "c", "e", "f", "7", "null", "in-0-7"]
    deep = b'{"p": 1, "order": {"refs": ["a", "b"]}, "x": ' + b"[" * 960 + b"]" * 960 + b"}"
    with pytest.raises(Problem, match="nests too deep"):  # no id named that it may not get
        payload_id(deep, path)


header_values = st.one_of(
    st.binary(max_size=24), st.integers(-10, 70000).map(lambda i: str(i).encode())
)
header_names = st.sampled_from(
    ["dejaq-priority", "dejaq-deliver-at", "dejaq-id", "dejaq-event-time", "other"]
)
record = st.tuples(
    st.one_of(st.none(), st.binary(max_size=8)),
    st.one_of(st.none(), st.binary(max_size=80)),
    st.dictionaries(header_names, header_values, max_size=4),
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    batch=st.lists(record, min_size=1, max_size=30),
    topic=st.sampled_from([PRIORITY, TIMELINE, EVENTS]),
)
def test_any_bytes_become_exactly_one_buffer_or_quarantine_row(spark, batch, topic) -> None:
    parsed = parse(records(spark, batch), topic).toArrow()
    buffered = buffer_part(parsed, T0).to_pylist()
    quarantined = quarantine_part(parsed, T0).to_pylist()
    assert len(buffered) + len(quarantined) == len(batch)
    offsets = sorted(r["source_offset"] for r in buffered + quarantined)
    assert offsets == list(range(len(batch)))
    assert all(r["reason"] for r in quarantined)
    for r in buffered:
        raw = batch[r["source_offset"]][2].get("dejaq-priority")
        if topic is PRIORITY:
            assert r["priority"] == int(raw) == r["sort_key"] and 0 <= r["priority"] <= 65535
        assert r["sort_key"] is not None and 0 <= r["bucket"] < topic.buckets
