"""`dejaq_delta`: real Delta tables through delta-rs, exactly once across restarts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from chispa import assert_df_equality
from conftest import run_to_end, wait_until
from deltalake import DeltaTable
from deltalake.transaction import Transaction
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.datasource import CaseInsensitiveDict
from pyspark.sql.pandas.types import from_arrow_schema
from pyspark.sql.streaming import StreamingQuery

from dejaq.conf.tables import (
    BUFFER_SCHEMA,
    PARTITION_BY,
    QUARANTINE_SCHEMA,
    Table,
    ensure_table,
    scan,
)
from dejaq.pipelines import delta_source
from dejaq.pipelines.delta_source import DeltaDataSource, WriteTarget

REPO = Path(__file__).resolve().parents[1]
FORMAT = "dejaq_delta"
T0 = datetime(2024, 5, 1, 12, 0, 0, 123456, tzinfo=UTC)


def buffer_rows(n: int, start: int = 0) -> pa.Table:
    """Buffer rows exercising nulls, binary, array<struct> headers and sub-ms timestamps."""
    rows = [
        {
            "message_id": f"m-{i:05d}",
            "bucket": i % 3,
            "sort_key": 1_000 - i,
            "priority": None if i % 4 == 0 else i % 7,
            "deliver_at": None if i % 5 == 0 else T0 + timedelta(seconds=i, microseconds=i),
            "event_time": T0 + timedelta(minutes=i),
            "key": None if i % 3 == 0 else f"k{i}".encode(),
            "payload": bytes([i % 256]) * (i % 5),
            "headers": None
            if i % 7 == 0
            else [{"key": "h", "value": b"v"}, {"key": "n", "value": None}],
            "source_topic": "orders",
            "source_partition": i % 2,
            "source_offset": i,
            "produced_at": None,
            "ingested_at": T0 + timedelta(microseconds=i),
        }
        for i in range(start, start + n)
    ]
    return pa.Table.from_pylist(rows, schema=BUFFER_SCHEMA)


def quarantine_rows(n: int, start: int = 0) -> pa.Table:
    rows = [
        {
            "key": None,
            "value": f"v{i}".encode(),
            "headers": [],
            "source_topic": "orders",
            "source_partition": 0,
            "source_offset": i,
            "produced_at": T0,
            "reason": "bad_json",
            "detail": None if i % 2 else "x" * 40,
            "quarantined_at": T0 + timedelta(seconds=i),
        }
        for i in range(start, start + n)
    ]
    return pa.Table.from_pylist(rows, schema=QUARANTINE_SCHEMA)


def read(spark: SparkSession, path: str, **options: str) -> DataFrame:
    return spark.read.format(FORMAT).options(**options).load(path)


def app_commits(path: str, app_id: str) -> list[int]:
    """The batch ids of the Delta commits tagged with `app_id`, oldest first."""
    if not DeltaTable.is_deltatable(path):
        return []
    history = DeltaTable(path).history()
    return sorted(h["dejaq.batchId"] for h in history if h.get("dejaq.appId") == app_id)


def test_batch_roundtrip_partitioned(spark: SparkSession, warehouse: str) -> None:
    path = f"{warehouse}/buffer"
    rows = buffer_rows(40)
    df = spark.createDataFrame(rows)
    df.write.format(FORMAT).option("partitionBy", "bucket").mode("append").save(path)

    assert_df_equality(read(spark, path), df, ignore_row_order=True)

    table = DeltaTable(path)  # a real Delta table to delta-rs
    assert table.version() == 1  # create, then one append
    assert table.metadata().partition_columns == ["bucket"]
    assert pa.schema(table.schema().to_arrow()).equals(BUFFER_SCHEMA)
    assert table.to_pyarrow_table().sort_by("message_id").equals(rows.sort_by("message_id"))

    # Hive-style folders, partition column only in the folder name and the log.
    files = sorted(Path(path).glob("bucket=*/part-*.parquet"))
    assert {f.parent.name for f in files} == {"bucket=0", "bucket=1", "bucket=2"}
    assert all("bucket" not in pq.read_schema(f).names for f in files)

    # Stats that delta-rs reads back and can prune files with.
    adds = pa.table(table.get_add_actions()).to_pylist()
    assert sum(a["num_records"] for a in adds) == 40
    for add in adds:
        part = pq.read_table(Path(path) / add["path"])
        assert add["num_records"] == part.num_rows
        assert add["min"]["sort_key"] == pc.min(part["sort_key"]).as_py()
        assert add["max"]["sort_key"] == pc.max(part["sort_key"]).as_py()
        assert add["null_count"]["priority"] == part["priority"].null_count
        # Delta keeps milliseconds; the bounds are rounded outwards so they still hold.
        assert add["min"]["ingested_at"] <= pc.min(part["ingested_at"]).as_py()
        assert add["max"]["ingested_at"] >= pc.max(part["ingested_at"]).as_py()
    in_bucket_1 = [a for a in adds if a["partition"]["bucket"] == 1]
    assert len(table.file_uris(file_pruning_predicate="bucket = 1")) == len(in_bucket_1)
    assert table.file_uris(file_pruning_predicate="sort_key > 5000") == []


def test_batch_append_unpartitioned_and_time_travel(spark: SparkSession, warehouse: str) -> None:
    path = f"{warehouse}/quarantine"
    first, second = quarantine_rows(5), quarantine_rows(7, start=5)
    spark.createDataFrame(first).write.format(FORMAT).mode("append").save(path)
    spark.createDataFrame(second).write.format(FORMAT).mode("append").save(path)

    expected = spark.createDataFrame(pa.concat_tables([first, second]))
    assert_df_equality(read(spark, path), expected, ignore_row_order=True)
    old = read(spark, path, versionAsOf="1")
    assert_df_equality(old, spark.createDataFrame(first), ignore_row_order=True)
    assert scan(path, Table.QUARANTINE).num_rows == 12
    assert not list(Path(path).glob("*=*"))  # no partition folders


def test_columns_option_reads_only_those(spark: SparkSession, warehouse: str) -> None:
    path = f"{warehouse}/buffer"
    rows = buffer_rows(9)
    writer = spark.createDataFrame(rows).write.format(FORMAT).option("partitionBy", "bucket")
    writer.mode("append").save(path)

    narrow = read(spark, path, columns="sort_key, bucket,message_id")
    expected = spark.createDataFrame(rows.select(["sort_key", "bucket", "message_id"]))
    assert_df_equality(narrow, expected, ignore_row_order=True)
    with pytest.raises(Exception, match=r"option 'columns': \['nope'\] not in Delta table"):
        read(spark, path, columns="sort_key,nope")


def test_batch_txn_skips_a_replayed_append(spark: SparkSession, warehouse: str) -> None:
    """foreachBatch appends tagged as in JVM Delta: txnAppId + txnVersion."""
    path = f"{warehouse}/quarantine"
    first, second = quarantine_rows(3), quarantine_rows(4, start=3)

    def append(rows: pa.Table, version: int) -> None:
        (
            spark.createDataFrame(rows)
            .write.format(FORMAT)
            .option("txnAppId", "fb")
            .option("txnVersion", str(version))
            .mode("append")
            .save(path)
        )

    append(first, 0)
    append(first, 0)  # the replay of batch 0
    append(second, 1)

    assert app_commits(path, "fb") == [0, 1]
    assert DeltaTable(path).transaction_version("fb") == 1
    expected = spark.createDataFrame(pa.concat_tables([first, second]))
    assert_df_equality(read(spark, path), expected, ignore_row_order=True)
    half = spark.createDataFrame(first).write.format(FORMAT).option("txnAppId", "fb")
    # Said by this source, or first by Delta's session extension where it is loaded.
    with pytest.raises(Exception, match=r"(?=.*txnAppId)(?=.*txnVersion)"):
        half.mode("append").save(path)


def test_overwrite_replaces_the_rows(spark: SparkSession, warehouse: str) -> None:
    path = f"{warehouse}/quarantine"
    spark.createDataFrame(quarantine_rows(5)).write.format(FORMAT).mode("append").save(path)
    replacement = spark.createDataFrame(quarantine_rows(2, start=100))
    replacement.write.format(FORMAT).mode("overwrite").save(path)

    assert_df_equality(read(spark, path), replacement, ignore_row_order=True)
    assert scan(path, Table.QUARANTINE).num_rows == 2


def test_empty_table_reads_as_empty(spark: SparkSession, warehouse: str) -> None:
    path = f"{warehouse}/buffer"
    DeltaTable.create(path, schema=BUFFER_SCHEMA, partition_by=PARTITION_BY[Table.BUFFER])
    df = read(spark, path)
    assert df.schema == from_arrow_schema(BUFFER_SCHEMA)
    assert df.count() == 0


def test_concurrent_writers_create_the_table_once(warehouse: str) -> None:
    path = f"{warehouse}/buffer"
    schema = from_arrow_schema(BUFFER_SCHEMA)
    source = DeltaDataSource(CaseInsensitiveDict(path=path, partitionBy="bucket"))
    errors: list[BaseException] = []

    def create() -> None:
        try:
            source.writer(schema, overwrite=False)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=create) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    # delta-rs may record a racing creator's commit too; what matters is one usable table.
    table = DeltaTable(path)
    assert pa.schema(table.schema().to_arrow()).names == BUFFER_SCHEMA.names
    assert table.metadata().partition_columns == ["bucket"]


def write_inputs(folder: Path, batches: list[pa.Table]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i, batch in enumerate(batches):
        pq.write_table(batch, folder / f"in-{i:03d}.parquet")


def stream_into(spark: SparkSession, source: Path, path: str, checkpoint: Path) -> StreamingQuery:
    """Start an availableNow query with appId "q1": one micro-batch per input file."""
    return (
        spark.readStream.format("parquet")
        .schema(from_arrow_schema(BUFFER_SCHEMA))
        .option("maxFilesPerTrigger", 1)
        .load(str(source))
        .writeStream.format(FORMAT)
        .option("appId", "q1")
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start(path)
    )


def assert_exactly(spark: SparkSession, path: str, rows: pa.Table) -> None:
    actual = read(spark, path)
    assert actual.count() == actual.select("message_id").distinct().count(), "duplicates"
    assert_df_equality(
        actual, spark.createDataFrame(rows), ignore_row_order=True, ignore_nullable=True
    )


def test_stream_commits_once_per_micro_batch(spark: SparkSession, tmp_path: Path) -> None:
    source, checkpoint, path = tmp_path / "in", tmp_path / "ckpt", str(tmp_path / "buffer")
    DeltaTable.create(path, schema=BUFFER_SCHEMA, partition_by=PARTITION_BY[Table.BUFFER])
    batches = [buffer_rows(6, start=10 * i) for i in range(3)]
    write_inputs(source, batches)

    run_to_end(stream_into(spark, source, path, checkpoint))

    assert app_commits(path, "q1") == [0, 1, 2]
    table = DeltaTable(path)
    assert table.version() == 3
    assert table.transaction_version("q1") == 2
    assert_exactly(spark, path, pa.concat_tables(batches))


def test_replayed_batch_is_not_appended_twice(spark: SparkSession, tmp_path: Path) -> None:
    source, checkpoint, path = tmp_path / "in", tmp_path / "ckpt", str(tmp_path / "buffer")
    batches = [buffer_rows(5, start=10 * i) for i in range(4)]
    write_inputs(source, batches[:3])
    run_to_end(stream_into(spark, source, path, checkpoint))
    version = DeltaTable(path).version()

    # A crash after the Delta commit of batch 2 but before Spark's own commit of it.
    for name in ("2", ".2.crc"):
        (checkpoint / "commits" / name).unlink(missing_ok=True)
    query = stream_into(spark, source, path, checkpoint)
    run_to_end(query)

    assert query.recentProgress[0]["batchId"] == 2  # Spark did run batch 2 again...
    assert (checkpoint / "commits" / "2").exists()
    assert DeltaTable(path).version() == version  # ...and the table kept the first run's
    assert app_commits(path, "q1") == [0, 1, 2]
    orphans = len(list(Path(path).glob("part-*.parquet"))) - len(DeltaTable(path).file_uris())
    assert orphans > 0  # the replay's files, left for VACUUM
    assert_exactly(spark, path, pa.concat_tables(batches[:3]))

    # The query carries on from there.
    write_inputs(source, batches)
    run_to_end(stream_into(spark, source, path, checkpoint))
    assert app_commits(path, "q1") == [0, 1, 2, 3]
    assert_exactly(spark, path, pa.concat_tables(batches))


CHILD = """
import sys

from pyspark.sql.pandas.types import from_arrow_schema

from dejaq.conf.tables import BUFFER_SCHEMA
from dejaq.pipelines.session import get_spark

source, path, checkpoint = sys.argv[1:]
spark = get_spark("dejaq-delta-kill-test")
query = (
    spark.readStream.format("parquet")
    .schema(from_arrow_schema(BUFFER_SCHEMA))
    .option("maxFilesPerTrigger", 1)
    .load(source)
    .writeStream.format("dejaq_delta")
    .option("appId", "killed")
    .option("partitionBy", "bucket")
    .option("checkpointLocation", checkpoint)
    .trigger(availableNow=True)
    .start(path)
)
query.awaitTermination()
spark.stop()
"""


@pytest.mark.slow
def test_sigkill_mid_stream_then_restart(spark: SparkSession, tmp_path: Path) -> None:
    source, checkpoint, path = tmp_path / "in", tmp_path / "ckpt", str(tmp_path / "buffer")
    batches = [buffer_rows(4, start=10 * i) for i in range(6)]
    write_inputs(source, batches)
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYTHONPATH": str(REPO)}

    def start(log_name: str) -> subprocess.Popen[bytes]:
        log = open(tmp_path / log_name, "wb")  # noqa: SIM115 - the child owns it until it exits
        return subprocess.Popen(
            [sys.executable, str(script), str(source), path, str(checkpoint)],
            env=env,
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the JVM dies with it
        )

    child = start("first.log")
    try:
        wait_until(
            lambda: child.poll() is not None or len(app_commits(path, "killed")) >= 2,
            timeout=180,
            what="two micro-batches committed",
        )
        assert child.poll() is None, (tmp_path / "first.log").read_text()
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    assert len(app_commits(path, "killed")) < len(batches), "killed too late to matter"

    restarted = start("second.log")
    assert restarted.wait(timeout=300) == 0, (tmp_path / "second.log").read_text()

    assert app_commits(path, "killed") == list(range(len(batches)))
    assert_exactly(spark, path, pa.concat_tables(batches))


def test_missing_path_is_named(spark: SparkSession) -> None:
    with pytest.raises(Exception, match="option 'path'"):
        spark.read.format(FORMAT).load().collect()
    df = spark.createDataFrame(quarantine_rows(1))
    with pytest.raises(Exception, match="option 'path'"):
        df.write.format(FORMAT).mode("append").save()


def test_missing_table_is_named(spark: SparkSession, warehouse: str) -> None:
    with pytest.raises(Exception, match=f"no Delta table at {warehouse}/nope"):
        read(spark, f"{warehouse}/nope").collect()


def test_stream_without_app_id_says_why(spark: SparkSession, tmp_path: Path) -> None:
    write_inputs(tmp_path / "in", [buffer_rows(1)])
    stream = (
        spark.readStream.format("parquet")
        .schema(from_arrow_schema(BUFFER_SCHEMA))
        .load(str(tmp_path / "in"))
        .writeStream.format(FORMAT)
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(availableNow=True)
    )
    with pytest.raises(Exception, match=r"option 'appId' is required.*replay"):
        query = stream.start(str(tmp_path / "buffer"))
        query.awaitTermination(120)


def test_schema_mismatch_names_the_columns(spark: SparkSession, warehouse: str) -> None:
    path = f"{warehouse}/buffer"
    DeltaTable.create(path, schema=BUFFER_SCHEMA, partition_by=PARTITION_BY[Table.BUFFER])
    df = (
        spark.createDataFrame(buffer_rows(2))
        .drop("payload")
        .withColumn("bucket", F.col("bucket").cast("long"))
        .withColumn("extra", F.col("sort_key"))
    )
    with pytest.raises(Exception, match=r"missing columns \['payload'\]") as error:
        df.write.format(FORMAT).mode("append").save(path)
    assert "columns not in the table ['extra']" in str(error.value)
    assert "bucket (table int, DataFrame bigint)" in str(error.value)
    assert DeltaTable(path).version() == 0


def test_partition_by_must_match_the_table(spark: SparkSession, warehouse: str) -> None:
    path = f"{warehouse}/buffer"
    DeltaTable.create(path, schema=BUFFER_SCHEMA, partition_by=PARTITION_BY[Table.BUFFER])
    df = spark.createDataFrame(buffer_rows(2))
    with pytest.raises(Exception, match=r"partitionBy=\['source_topic'\] but .* by \['bucket'\]"):
        df.write.format(FORMAT).option("partitionBy", "source_topic").mode("append").save(path)


def test_null_in_not_null_column_fails(spark: SparkSession, warehouse: str) -> None:
    path = f"{warehouse}/buffer"
    DeltaTable.create(path, schema=BUFFER_SCHEMA, partition_by=PARTITION_BY[Table.BUFFER])
    df = spark.createDataFrame(buffer_rows(2)).withColumn("message_id", F.lit(None).cast("string"))
    with pytest.raises(Exception, match="'message_id' is NOT NULL"):
        df.write.format(FORMAT).mode("append").save(path)
    assert DeltaTable(path).version() == 0


def test_an_empty_append_opens_no_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each micro-batch commits to the quarantine too, most with nothing for it: an empty
    append neither commits nor opens the table (an open reads the table's log since its
    last checkpoint). The table class is wrapped, not replaced, to count opens."""
    path = ensure_table(str(tmp_path), Table.QUARANTINE, "jobs")
    target = WriteTarget(path, QUARANTINE_SCHEMA, tuple(PARTITION_BY[Table.QUARANTINE]))
    opened: list[str] = []
    real = delta_source.DeltaTable

    def counted(*args, **kwargs) -> DeltaTable:
        opened.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(delta_source, "DeltaTable", counted)
    delta_source.commit(target, [], "append", ("ingest", 0))
    assert opened == []
    assert real(path).version() == 0 and real(path).transaction_version("ingest") is None


def test_a_batch_the_table_has_from_other_positions_is_a_second_writer_not_a_replay(
    tmp_path: Path,
) -> None:
    """Two drivers on one checkpoint plan the same batch id over different Kafka ranges:
    the second to commit finds the batch there with other positions and stops, rather
    than skip the records it read past the other's. A replay of the same range, the
    latest batch or one before it, is skipped as ever."""
    path = ensure_table(str(tmp_path), Table.BUFFER, "jobs")
    target = WriteTarget.of(path)

    def positions(offset: int) -> list[Transaction]:
        return [Transaction("ingest:in:0", offset), Transaction("ingest:in:1", 7)]

    def append(batch: int, offset: int) -> None:
        rows = buffer_rows(3, start=10 * batch)
        actions = delta_source.write_files(target, rows)
        delta_source.commit(target, actions, "append", ("ingest", batch), positions(offset))

    append(0, 10)
    append(0, 10)
    with pytest.raises(delta_source.SecondWriter, match=r"ingest:in:0=10\b.*ingest:in:0=20\b"):
        append(0, 20)
    append(1, 30)
    append(0, 10)
    with pytest.raises(delta_source.SecondWriter, match="batch 0 "):
        append(0, 20)
    assert app_commits(path, "ingest") == [0, 1]
    assert DeltaTable(path).transaction_version("ingest:in:0") == 30
    assert scan(path, Table.BUFFER).num_rows == 6


def test_rows_made_for_a_kind_the_buffer_no_longer_records_are_not_committed(
    tmp_path: Path,
) -> None:
    """An ingest started as a timeline writes deliver_at times; a broker restarted since
    as a priority topic, on an empty buffer, recorded the new kind: the ingest's next
    batch is refused, not read as priorities and leased at once. Made for the recorded
    kind, it is committed."""
    from dejaq.conf.settings import TopicConfig
    from dejaq.conf.tables import KIND_PROPERTY, ensure_buffer

    warehouse = str(tmp_path)
    path = ensure_buffer(warehouse, TopicConfig(name="jobs", kind="timeline", source=["in"]))
    target = WriteTarget.of(path)
    ensure_buffer(warehouse, TopicConfig(name="jobs", kind="priority", source=["in"]))
    actions = delta_source.write_files(target, buffer_rows(3))
    with pytest.raises(delta_source.TableChanged, match="'priority'") as refused:
        delta_source.commit(target, actions, "append", None, (), {KIND_PROPERTY: "timeline"})
    assert refused.value.found == {KIND_PROPERTY: "priority"}
    assert scan(path, Table.BUFFER).num_rows == 0
    delta_source.commit(target, actions, "append", None, (), {KIND_PROPERTY: "priority"})
    assert scan(path, Table.BUFFER).num_rows == 3
    unset = ensure_table(warehouse, Table.BUFFER, "older")  # made before kinds were recorded
    older = WriteTarget.of(unset)
    rows = delta_source.write_files(older, buffer_rows(2))
    delta_source.commit(older, rows, "append", None, (), {KIND_PROPERTY: "timeline"})
    assert scan(unset, Table.BUFFER).num_rows == 2, "no kind set: nothing changed"
