"""One table, two engines: delta-spark (the jobs) and delta-rs (the broker, compaction).

Each writes what the other reads and writes again: a row written by either is read back
exactly once by both, a replayed (app id, version) is skipped, and no table carries a
feature delta-rs cannot write. A table Spark gave a feature DejaQ cannot honour is
refused by name, at a process's start or at a commit.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from chispa import assert_df_equality
from deltalake import DeltaTable, write_deltalake
from pyspark.sql import SparkSession
from test_delta_source import buffer_rows

from dejaq.broker.storage.index import TopicIndex
from dejaq.conf.settings import TopicConfig
from dejaq.conf.table_features import UnsupportedTable, check_table
from dejaq.conf.tables import (
    BUFFER_SCHEMA,
    LEDGER_SCHEMA,
    TIMESTAMP,
    Table,
    app_transactions,
    create_if_missing,
    ensure_table,
    table_path,
)
from dejaq.pipelines.compaction import compact, vacuum
from dejaq.pipelines.delta_source import WriteTarget, commit, write_files
from dejaq.pipelines.session import detect_connectors

# Table features delta-rs 1.x cannot write (DESIGN.md): none may appear on a table.
UNWRITABLE = {"deletionVectors", "rowTracking", "inCommitTimestamp", "v2Checkpoint", "clustering"}


def spark_append(spark: SparkSession, rows: pa.Table, path: str, app: str, version: int) -> None:
    (
        spark.createDataFrame(rows)
        .write.format("delta")
        .mode("append")
        .option("txnAppId", app)
        .option("txnVersion", str(version))
        .save(path)
    )


def features(path: str) -> set[str]:
    protocol = DeltaTable(path).protocol()
    return set(protocol.reader_features or []) | set(protocol.writer_features or [])


def assert_read_by_both(spark: SparkSession, path: str, expected: pa.Table) -> None:
    """Spark and delta-rs each read the table as exactly the rows `expected`."""
    from_spark = spark.read.format("delta").load(path).select(*BUFFER_SCHEMA.names)
    from_rs = spark.createDataFrame(DeltaTable(path).to_pyarrow_table().select(BUFFER_SCHEMA.names))
    for read in (from_spark, from_rs):
        assert_df_equality(
            read, spark.createDataFrame(expected), ignore_row_order=True, ignore_nullable=True
        )


def test_the_session_has_the_jvm_connectors(spark: SparkSession) -> None:
    connectors = detect_connectors(spark)
    assert connectors.jvm_kafka and connectors.jvm_delta
    assert not detect_connectors(spark, "python").jvm_delta


def test_spark_and_delta_rs_write_one_buffer_table_in_turn(
    spark: SparkSession, warehouse: str
) -> None:
    path = ensure_table(warehouse, Table.BUFFER, "orders")  # created by delta-rs
    spark_append(spark, buffer_rows(40), path, "ingest", 0)
    spark_append(spark, buffer_rows(40), path, "ingest", 0)  # a replay: skipped
    assert DeltaTable(path).transaction_version("ingest") == 0, "delta-rs reads Spark's txn"

    spark_file = next(uri for uri in DeltaTable(path).file_uris())
    assert pq.read_schema(spark_file).field("ingested_at").type == TIMESTAMP, "not INT96"

    done = compact(path)  # delta-rs rewrites Spark's files
    assert done.files_removed > done.files_added
    write_deltalake(path, buffer_rows(30, start=40), mode="append", partition_by=["bucket"])
    spark_append(spark, buffer_rows(30, start=70), path, "ingest", 1)

    assert_read_by_both(spark, path, buffer_rows(100))
    assert not features(path) & UNWRITABLE
    check_table(DeltaTable(path))  # DejaQ honours every feature of its own tables


def test_a_table_spark_creates_stays_writable_by_delta_rs(
    spark: SparkSession, tmp_path: Path
) -> None:
    path = str(tmp_path / "made_by_spark")
    spark.createDataFrame(buffer_rows(20)).write.format("delta").partitionBy("bucket").save(path)
    assert not features(path) & UNWRITABLE
    check_table(DeltaTable(path))  # nor any of a table Spark made with its defaults
    write_deltalake(path, buffer_rows(20, start=20), mode="append")
    compact(path)
    spark_append(spark, buffer_rows(20, start=40), path, "ingest", 0)

    assert_read_by_both(spark, path, buffer_rows(60))


def spark_alter(spark: SparkSession, path: str, properties: dict[str, str]) -> None:
    given = ", ".join(f"'{k}' = '{v}'" for k, v in properties.items())
    spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ({given})")


def refused(path: str, feature: str) -> str:
    """The refusal's message names the table and the feature."""
    return rf"{re.escape(path)}.*{feature}"


def test_a_buffer_with_deletion_vectors_is_refused_and_keeps_its_vectors(
    spark: SparkSession, warehouse: str
) -> None:
    """Rows a Spark DELETE marks in a deletion vector are still in their files, which
    the broker's index reads whole: it would lease them again. The buffer is refused at
    the broker's start, and vacuum never lists the table whole to delete its vectors."""
    path = table_path(warehouse, Table.BUFFER, "orders")
    spark.createDataFrame(buffer_rows(30)).write.format("delta").partitionBy("bucket").save(path)
    spark_alter(spark, path, {"delta.enableDeletionVectors": "true"})
    spark.sql(f"DELETE FROM delta.`{path}` WHERE source_offset < 5")
    vectors = list(Path(path).glob("deletion_vector_*.bin"))
    assert vectors and "deletionVectors" in features(path)

    topic = TopicConfig(name="orders", kind="priority", source=["in"])
    with pytest.raises(UnsupportedTable, match=refused(path, "deletionVectors")):
        TopicIndex(warehouse, topic)

    month_ago = time.time() - 30 * 24 * 3600
    for vector in vectors:
        os.utime(vector, (month_ago, month_ago))
    vacuum(path)
    assert all(vector.exists() for vector in vectors)
    assert_df_equality(
        spark.read.format("delta").load(path).select(*BUFFER_SCHEMA.names),
        spark.createDataFrame(buffer_rows(25, start=5)),
        ignore_row_order=True,
        ignore_nullable=True,
    )


def test_a_column_mapped_ledger_is_refused(spark: SparkSession, warehouse: str) -> None:
    """Its files name columns by physical names: read by the contract's, every column is
    null and the ledger reads as empty, its acked messages leased again."""
    path = table_path(warehouse, Table.LEDGER, "orders")
    create_if_missing(path, LEDGER_SCHEMA, [])
    spark_alter(spark, path, {"delta.columnMapping.mode": "name"})
    with pytest.raises(UnsupportedTable, match=refused(path, "columnMapping")):
        ensure_table(warehouse, Table.LEDGER, "orders")


def test_the_app_transactions_of_a_v2_checkpoint_are_read(
    spark: SparkSession, warehouse: str
) -> None:
    """`_last_checkpoint` names the checkpoint's own file (`<v>.checkpoint.<uuid>.*`);
    the table itself is refused at a start, as delta-rs writes classic checkpoints."""
    path = table_path(warehouse, Table.BUFFER, "orders")
    create_if_missing(path, BUFFER_SCHEMA, ["bucket"])
    spark_alter(spark, path, {"delta.checkpointPolicy": "v2", "delta.checkpointInterval": "2"})
    spark_append(spark, buffer_rows(10), path, "first", 0)  # version 2: a checkpoint
    spark_append(spark, buffer_rows(10, start=10), path, "second", 7)
    last = json.loads((Path(path) / "_delta_log" / "_last_checkpoint").read_text())
    assert "v2Checkpoint" in last, last
    assert app_transactions(path) == {"first": 0, "second": 7}
    with pytest.raises(UnsupportedTable, match=refused(path, "v2Checkpoint")):
        check_table(DeltaTable(path))


def test_a_commit_to_a_table_spark_gave_row_tracking_fails_at_once_by_name(
    spark: SparkSession, warehouse: str, caplog: pytest.LogCaptureFixture
) -> None:
    """delta-rs refuses to commit to it: no retry can succeed, so none is made."""
    path = ensure_table(warehouse, Table.BUFFER, "orders")
    target = WriteTarget.of(path)  # as a stream's start opens it, before the change
    spark_alter(spark, path, {"delta.enableRowTracking": "true"})
    caplog.set_level(logging.INFO)
    with pytest.raises(UnsupportedTable, match=refused(path, "rowTracking")):
        commit(target, write_files(target, buffer_rows(5)), "append", ("ingest", 0))
    assert not [r for r in caplog.records if "lost its commit" in r.getMessage()]


def test_the_ledger_as_the_broker_appends_it_is_read_alike_by_spark_and_delta_rs(
    spark: SparkSession, warehouse: str
) -> None:
    """The broker appends its ledger's ids by prefix deltas, with no dictionary
    (`APPEND_PROPERTIES`): Spark reads the very rows delta-rs reads, ids included."""
    from test_broker import TEST_IDS
    from test_checkpoints import acked

    from dejaq.broker.storage.ledger_writer import write_ledger
    from dejaq.conf.tables import scan

    for first in (1, 21):
        write_ledger(
            warehouse, "orders", [acked(s) for s in range(first, first + 20)], TEST_IDS.names
        )
    path = table_path(warehouse, Table.LEDGER, "orders")
    for uri in DeltaTable(path).file_uris():
        ids = pq.ParquetFile(uri).metadata.row_group(0).column(0)
        assert ids.path_in_schema == "message_id"
        assert "DELTA_BYTE_ARRAY" in ids.encodings and not ids.has_dictionary_page, ids
    from_rs = scan(path, Table.LEDGER)
    assert sorted(from_rs["message_id"].to_pylist()) == sorted(f"m{s}" for s in range(1, 41))
    assert_df_equality(
        spark.read.format("delta").load(path).select(*LEDGER_SCHEMA.names),
        spark.createDataFrame(from_rs),
        ignore_row_order=True,
        ignore_nullable=True,
    )
