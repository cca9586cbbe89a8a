"""One table, two engines: delta-spark (the jobs) and delta-rs (the broker, compaction).

Each writes what the other reads and writes again: a row written by either is read back
exactly once by both, a replayed (app id, version) is skipped, and no table carries a
feature delta-rs cannot write.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from chispa import assert_df_equality
from deltalake import DeltaTable, write_deltalake
from pyspark.sql import DataFrame, SparkSession
from test_delta_source import buffer_rows

from dejaq.conf.tables import BUFFER_SCHEMA, TIMESTAMP, Table, ensure_table
from dejaq.pipelines.compaction import compact
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


def read_both(spark: SparkSession, path: str) -> tuple[DataFrame, pa.Table]:
    return spark.read.format("delta").load(path), DeltaTable(path).to_pyarrow_table()


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

    from_spark, from_rs = read_both(spark, path)
    expected = buffer_rows(100)
    assert from_rs.num_rows == from_spark.count() == 100
    assert (
        sorted(from_rs.column("message_id").to_pylist())
        == expected.column("message_id").to_pylist()
    )
    assert_df_equality(
        from_spark.select(*BUFFER_SCHEMA.names),
        spark.createDataFrame(expected),
        ignore_row_order=True,
        ignore_nullable=True,
    )
    assert_df_equality(
        spark.createDataFrame(from_rs.select(BUFFER_SCHEMA.names)),
        spark.createDataFrame(expected),
        ignore_row_order=True,
        ignore_nullable=True,
    )
    assert not features(path) & UNWRITABLE


def test_a_table_spark_creates_stays_writable_by_delta_rs(
    spark: SparkSession, tmp_path: Path
) -> None:
    path = str(tmp_path / "made_by_spark")
    spark.createDataFrame(buffer_rows(20)).write.format("delta").partitionBy("bucket").save(path)
    assert not features(path) & UNWRITABLE
    write_deltalake(path, buffer_rows(20, start=20), mode="append")
    compact(path)
    spark_append(spark, buffer_rows(20, start=40), path, "ingest", 0)

    from_spark, from_rs = read_both(spark, path)
    ids = [f"m-{i:05d}" for i in range(60)]
    assert sorted(r.message_id for r in from_spark.select("message_id").collect()) == ids
    assert sorted(from_rs.column("message_id").to_pylist()) == ids
