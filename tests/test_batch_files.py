"""One pass over a micro-batch: Spark tasks write both tables' files, the driver moves the
duplicates out of the buffer's, and the commits hold every record once."""

from __future__ import annotations

import datetime as dt
import itertools
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_envelope import PRIORITY, records

from dejaq.conf.tables import Table, ensure_table, scan
from dejaq.pipelines.batch_files import RESULT_SPARK_SCHEMA, VALID, BatchFiles, task
from dejaq.pipelines.dedup import IN_BATCH, SeenIds
from dejaq.pipelines.delta_source import WriteTarget, commit
from dejaq.pipelines.envelope import parse

HOUR_MS = 3600 * 1000
_tables = itertools.count()


def write_batch(spark, rows, warehouse: str) -> tuple[BatchFiles, WriteTarget, WriteTarget]:
    """`rows` through the ingest's one pass, in two Kafka partitions: the files written,
    nothing committed."""
    buffer = WriteTarget.of(ensure_table(warehouse, Table.BUFFER, "p"))
    quarantine = WriteTarget.of(ensure_table(warehouse, Table.QUARANTINE, "p"))
    half = len(rows) // 2
    df = records(spark, rows[:half]).union(records(spark, rows[half:], partition=1))
    parsed = parse(df.repartition(2), PRIORITY)
    write = task(buffer, quarantine, dt.datetime.now(dt.UTC))
    results = parsed.mapInArrow(write, RESULT_SPARK_SCHEMA).toArrow()
    return BatchFiles.read(results), buffer, quarantine


def on_disk(path: str) -> set[str]:
    return {str(p.relative_to(path)) for p in Path(path).rglob("*.parquet")}


def committed(path: str) -> set[str]:
    return set(pa.table(DeltaTable(path).get_add_actions()).column("path").to_pylist())


def test_each_task_writes_its_valid_and_bad_records_to_their_tables(spark, tmp_path) -> None:
    rows = [
        (b"k1", b"a", {"dejaq-priority": b"1", "dejaq-id": b"x"}),
        (b"k2", b"b", {"dejaq-priority": b"nope"}),
        (b"k3", b"c", {"dejaq-priority": b"3"}),
        (b"k4", b"d", {}),
    ]
    files, buffer, quarantine = write_batch(spark, rows, str(tmp_path))
    assert files.counts == {VALID: 2, "invalid_priority": 1, "missing_priority": 1}
    assert files.judged.column("message_id").to_pylist() == ["x"]
    assert files.judged.column("path").to_pylist()[0] in {a.path for a in files.buffer}
    assert on_disk(buffer.path) == {a.path for a in files.buffer}
    assert scan(buffer.path, Table.BUFFER).num_rows == 0, "nothing committed yet"
    commit(quarantine, files.quarantine, "append", ("t", 0))
    commit(buffer, files.buffer, "append", ("t", 0))
    assert sorted(scan(buffer.path, Table.BUFFER)["payload"].to_pylist()) == [
        b"a",
        b"c",
    ]
    bad = scan(quarantine.path, Table.QUARANTINE)
    assert sorted(bad["reason"].to_pylist()) == ["invalid_priority", "missing_priority"]


record = st.tuples(
    st.sampled_from([b"k1", b"k2", None]),
    st.binary(max_size=4),
    st.fixed_dictionaries(
        {"dejaq-priority": st.sampled_from([b"1", b"2", b"bad"])},
        optional={"dejaq-id": st.sampled_from([b"a", b"b", b"c"])},
    ),
)


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batch=st.lists(record, min_size=1, max_size=24))
def test_duplicates_move_to_the_quarantine_and_every_record_lands_once(
    spark, tmp_path, batch
) -> None:
    warehouse = str(tmp_path / f"w{next(_tables)}")
    files, buffer, quarantine = write_batch(spark, batch, warehouse)
    verdict = SeenIds(HOUR_MS).check(files.judged, 0)
    if verdict.duplicates:
        files.move_duplicates(buffer, quarantine, verdict.duplicates)
    commit(quarantine, files.quarantine, "append", ("t", 0))
    commit(buffer, files.buffer, "append", ("t", 0))
    kept = scan(buffer.path, Table.BUFFER)
    bad = scan(quarantine.path, Table.QUARANTINE)

    coordinates = sorted(
        zip(
            *(
                pa.concat_arrays([t[c].combine_chunks() for t in (kept, bad)]).to_pylist()
                for c in ("source_partition", "source_offset")
            ),
            strict=True,
        )
    )
    half = len(batch) // 2
    assert coordinates == [(0, i) for i in range(half)] + [(1, i) for i in range(len(batch) - half)]
    ids = kept["message_id"].to_pylist()
    assert len(ids) == len(set(ids)), "an id is buffered once"
    duplicates = bad.filter(pc.equal(bad["reason"], "duplicate"))
    assert duplicates.num_rows == len(verdict.duplicates)
    assert set(duplicates["detail"].to_pylist()) <= {IN_BATCH}
    assert files.counts.get("duplicate", 0) == duplicates.num_rows
    assert files.counts[VALID] == kept.num_rows
    assert on_disk(buffer.path) == committed(buffer.path), "no file left over"
