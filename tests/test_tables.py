"""The table contract: paths under the warehouse and schemas both sides agree on."""

from __future__ import annotations

import datetime as dt
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake
from pyspark.sql.pandas.types import from_arrow_schema

from dejaq.conf.settings import TopicConfig
from dejaq.conf.table_features import (
    UnsupportedTable,
    check_table,
    features,
    has_deletion_vectors,
)
from dejaq.conf.tables import (
    BUFFER_SCHEMA,
    KIND_PROPERTY,
    PARTITION_BY,
    SCHEMAS,
    TABLE_PROPERTIES,
    KindChanged,
    Table,
    create_if_missing,
    ensure_buffer,
    ensure_table,
    table_path,
)


def test_paths_local_and_uri(tmp_path) -> None:
    assert table_path(str(tmp_path), Table.BUFFER, "orders") == f"{tmp_path}/buffer/orders"
    assert table_path("s3://bucket/wh/", Table.LEDGER, "o.v2") == "s3://bucket/wh/ledger/o.v2"
    assert table_path("relative", "quarantine", "x").startswith("/")


@pytest.mark.parametrize("bad", ["", "../etc", "a/b", "-x", "a b", "orders\n"])
def test_topic_names_that_would_escape_the_warehouse_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid topic name"):
        table_path("/w", Table.BUFFER, bad)


@pytest.mark.parametrize("table", list(Table))
def test_every_schema_converts_to_spark_and_partitions_exist(table: Table) -> None:
    schema = SCHEMAS[table]
    spark_schema = from_arrow_schema(schema)
    assert spark_schema.fieldNames() == schema.names
    for column in PARTITION_BY[table]:
        assert column in schema.names
    if "headers" in schema.names:
        assert schema.field("headers").type == pa.list_(
            pa.struct([("key", pa.string()), ("value", pa.binary())])
        )


def _buffer_rows(keys: list[int]) -> pa.Table:
    """Buffer rows at these sort keys (a timeline's deliver_at, ms), as the ingest writes."""
    now = dt.datetime.now(dt.UTC)
    at = [dt.datetime.fromtimestamp(k / 1000, dt.UTC) for k in keys]
    rows = {name: [None] * len(keys) for name in BUFFER_SCHEMA.names}
    rows |= {
        "message_id": [f"m{i}" for i in range(len(keys))],
        "bucket": [0] * len(keys),
        "sort_key": keys,
        "deliver_at": at,
        "source_topic": ["in"] * len(keys),
        "source_partition": [0] * len(keys),
        "source_offset": list(range(len(keys))),
        "ingested_at": [now] * len(keys),
    }
    return pa.table(rows, schema=BUFFER_SCHEMA)


def _topic(kind: str) -> TopicConfig:
    return TopicConfig(name="jobs", kind=kind, source=["in"], delivery="release", output="out")


def _kind(path: str) -> str | None:
    return DeltaTable(path).metadata().configuration.get(KIND_PROPERTY)


def test_a_buffer_holding_rows_of_another_kind_refuses_the_topic_by_name(tmp_path) -> None:
    """A timeline's deliver_at read as a priority is due at once: with its rows pending,
    a topic reconfigured to a kind sorted otherwise is refused, naming both kinds and
    the way out; one sorted alike (a cron topic's occurrences are a timeline's) is not."""
    warehouse = str(tmp_path)
    path = ensure_buffer(warehouse, _topic("timeline"))
    assert DeltaTable(path).metadata().configuration == TABLE_PROPERTIES | {
        KIND_PROPERTY: "timeline"
    }
    future = int(time.time() * 1000) + 3_600_000
    write_deltalake(path, _buffer_rows([future, future + 1]), mode="append")
    for kind in ("priority", "event_time"):
        with pytest.raises(
            KindChanged,
            match=rf"topic 'jobs' is configured as kind {kind}, but its buffer holds 2 rows "
            r"written as kind timeline .*Set kind back to timeline",
        ):
            ensure_buffer(warehouse, _topic(kind))
        assert _kind(path) == "timeline"
    assert ensure_buffer(warehouse, _topic("cron")) == path
    assert _kind(path) == "cron"
    with pytest.raises(KindChanged, match="written as kind cron"):
        ensure_buffer(warehouse, _topic("priority"))


def test_an_empty_buffer_takes_the_kind_configured_now(tmp_path) -> None:
    """No row to misread: a buffer never written to, or emptied by retention, records
    the new kind, and guards it as it did the old one."""
    warehouse = str(tmp_path)
    path = ensure_buffer(warehouse, _topic("timeline"))
    ensure_buffer(warehouse, _topic("priority"))
    assert _kind(path) == "priority"
    write_deltalake(path, _buffer_rows([5]), mode="append")
    DeltaTable(path).delete()  # what retention leaves once every message settled
    ensure_buffer(warehouse, _topic("timeline"))
    assert _kind(path) == "timeline"
    write_deltalake(path, _buffer_rows([5]), mode="append")
    with pytest.raises(KindChanged, match="holds 1 row written as kind timeline"):
        ensure_buffer(warehouse, _topic("priority"))


def test_a_buffer_made_before_kinds_were_recorded_takes_the_configured_kind(tmp_path) -> None:
    """Its rows were written as the topic is configured at its first start since: that
    kind is recorded, and a later change guarded like any other."""
    warehouse = str(tmp_path)
    path = ensure_table(warehouse, Table.BUFFER, "jobs")
    write_deltalake(path, _buffer_rows([7, 8, 9]), mode="append")
    assert _kind(path) is None
    assert ensure_buffer(warehouse, _topic("priority")) == path
    assert _kind(path) == "priority"
    with pytest.raises(KindChanged, match="holds 3 rows written as kind priority"):
        ensure_buffer(warehouse, _topic("timeline"))


def test_every_table_dejaq_makes_has_only_features_it_honours(tmp_path) -> None:
    """Delta's first writer protocol: append-only and invariants, implied, nothing more."""
    for table in Table:
        path = ensure_table(str(tmp_path), table, "jobs")
        assert features(DeltaTable(path)) == {"appendOnly", "invariants"}
        check_table(DeltaTable(path))


def test_a_table_with_a_check_constraint_is_refused_by_name(tmp_path) -> None:
    """A constraint raises the protocol to writer version 3, whose features imply it:
    the ingest commits files it wrote without evaluating it."""
    path = table_path(str(tmp_path), Table.LEDGER, "jobs")
    create_if_missing(path, SCHEMAS[Table.LEDGER], [])
    DeltaTable(path).alter.add_constraint({"tried": "deliveries >= 0"})
    with pytest.raises(UnsupportedTable, match=rf"{path}.*checkConstraints.*DROP FEATURE"):
        ensure_table(str(tmp_path), Table.LEDGER, "jobs")


def test_a_legacy_protocol_bars_a_table_only_for_the_features_it_uses(tmp_path) -> None:
    """A change data feed turned on raises the protocol to writer version 4 for good;
    turned off again, the table is honoured (no feature left to drop). A dropped
    constraint leaves writer version 3 the same way."""
    path = table_path(str(tmp_path), Table.LEDGER, "jobs")
    create_if_missing(path, SCHEMAS[Table.LEDGER], [], {"delta.enableChangeDataFeed": "true"})
    table = DeltaTable(path)
    assert table.protocol().min_writer_version == 4
    with pytest.raises(UnsupportedTable, match="changeDataFeed"):
        check_table(table)
    table.alter.set_table_properties({"delta.enableChangeDataFeed": "false"})
    table.alter.add_constraint({"tried": "deliveries >= 0"})
    with pytest.raises(UnsupportedTable, match="checkConstraints"):
        check_table(DeltaTable(path))
    DeltaTable(path).alter.drop_constraint("tried")
    check_table(DeltaTable(path))


def reads(table: DeltaTable) -> Counter[str]:
    """How often `table`'s metadata and schema are read: each read counted, then made
    on the real table (a spy, no stand-in)."""
    counted: Counter[str] = Counter()

    def counting(name: str, read: Callable[[], Any]) -> Callable[[], Any]:
        def counted_read() -> Any:
            counted[name] += 1
            return read()

        return counted_read

    for name in ("metadata", "schema"):
        setattr(table, name, counting(name, getattr(table, name)))
    return counted


def test_a_tables_features_are_judged_from_each_read_once(tmp_path) -> None:
    """Deletion vectors are in the protocol alone; a legacy protocol's implied features
    need the properties or the columns only where it implies one that they decide, and
    `check_table` reads the properties once for all its checks."""
    own = ensure_table(str(tmp_path), Table.BUFFER, "jobs")
    table = DeltaTable(own)
    counted = reads(table)
    assert not has_deletion_vectors(table)
    assert features(table) == {"appendOnly", "invariants"}
    assert counted == Counter()
    check_table(table)
    assert counted == Counter(metadata=1)
    path = table_path(str(tmp_path), Table.LEDGER, "jobs")
    create_if_missing(path, SCHEMAS[Table.LEDGER], [], {"delta.enableChangeDataFeed": "true"})
    DeltaTable(path).alter.set_table_properties({"delta.enableChangeDataFeed": "false"})
    table = DeltaTable(path)
    counted = reads(table)
    check_table(table)  # writer 4: a change data feed by the properties, generated columns
    assert counted == Counter(metadata=1, schema=1)


def test_an_append_only_table_is_refused_by_name(tmp_path) -> None:
    """Retention and compaction remove the files they replace, which Delta refuses on an
    append-only table: every run would fail, and settled rows never leave."""
    path = table_path(str(tmp_path), Table.BUFFER, "jobs")
    create_if_missing(path, SCHEMAS[Table.BUFFER], [], {"delta.appendOnly": "true"})
    with pytest.raises(UnsupportedTable, match=rf"{path}.*delta.appendOnly"):
        check_table(DeltaTable(path), path)
