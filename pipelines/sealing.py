"""Sealing: a log-shaped table's old files rewritten into few large ones, in time order.

The ledger and the dead letters only grow, a file at a time, and compaction keeps their
files small (`compaction.LEDGER_FILE_BYTES`) so a reader of the recent tail reads little.
Left so, their file count follows their history: every open of the table, each of the
leader's once-a-second appends included, reads an entry per file, and each Delta
checkpoint writes them all again. Once files are older than anything read as a tail
(the settled retention plus `SEAL_AGE_MS`), a seal concatenates the oldest of them, in
the order of their earliest time, into one file of up to `SEALED_FILE_BYTES`: a
history of months becomes a few files a day at the busiest rates DejaQ records.

A seal is a compaction of chosen files, with its own choice of them: delta-rs's own
compaction bins a table's small files by size, with no say over which. The new file is
written by pyarrow a row group at a time, so its memory follows a row group, not the
file; its Delta statistics are taken on the way. The commit removes the old files and
adds the new one, every action `dataChange=false`, tagged `SEALED` in its commitInfo:
a reader that follows the table (Spark's stream, `retention.is_rewrite`) knows it holds
no new row. Only the table's writer seals, between its own appends, as it compacts.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable
from deltalake.transaction import AddAction, RemoveAction

from dejaq.conf.storage import filesystem, has_folders
from dejaq.conf.tables import conform, iso_ms

log = logging.getLogger("dejaq.sealing")

SEALED = "dejaq.sealed"  # commitInfo's custom metadata key: the files this commit sealed
SEALED_FILE_BYTES = 128 * 1024 * 1024
# Files past which a seal pays for itself: fewer wait for more (a sealed file under half
# the size is sealed again with the next ones, so a quiet table converges too).
SEAL_MIN_FILES = 8
# How far past the settled retention a file's latest row must be before it is sealed:
# tails are read from the retention watermark, which trails the clock by the retention.
SEAL_AGE_MS = 24 * 3600 * 1000
ROW_GROUP_ROWS = 128 * 1024  # pruned by `at` statistics, a few MB each
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_STAT_KINDS = (pa.types.is_integer, pa.types.is_floating, pa.types.is_timestamp)


@dataclass(frozen=True)
class Sealed:
    files_removed: int
    rows: int
    bytes_written: int


def seal(path: str, time_column: str, before_ms: int) -> Sealed | None:
    """Seal the oldest files of the table at `path` whose latest `time_column` is before
    `before_ms` into one; None when fewer than `SEAL_MIN_FILES` are due."""
    table = DeltaTable(path)
    chosen = _due(table, time_column, before_ms)
    if chosen is None:
        return None
    paths, sizes, partition = chosen
    partition_columns = set(table.metadata().partition_columns)
    contract = pa.schema(table.schema().to_arrow())
    file_schema = pa.schema([f for f in contract if f.name not in partition_columns])
    fs, root = filesystem(path)
    folder = "/".join(f"{k}={v}" for k, v in partition.items())
    name = f"{folder}/" if folder else ""
    name += f"part-00000-{uuid.uuid4()}-c000.sealed.snappy.parquet"
    if has_folders(fs) and folder:
        fs.create_dir(f"{root}/{folder}", recursive=True)
    stats = _Stats(file_schema)
    with pq.ParquetWriter(f"{root}/{name}", file_schema, filesystem=fs) as out:
        for group in _row_groups(_rows(fs, root, paths, file_schema), file_schema):
            out.write_table(group, row_group_size=ROW_GROUP_ROWS)
            stats.add(group)
    size = fs.get_file_info(f"{root}/{name}").size
    now = int(time.time() * 1000)
    actions: list[AddAction | RemoveAction] = [
        AddAction(name, size, partition, now, False, stats.json())
    ]
    actions += [
        RemoveAction(p, False, now, s, partition) for p, s in zip(paths, sizes, strict=True)
    ]
    try:
        table.create_write_transaction(
            actions,
            "append",
            table.schema(),
            partition_by=list(table.metadata().partition_columns),
            commit_properties=CommitProperties(custom_metadata={SEALED: str(len(paths))}),
        )
    except Exception:
        # Refused (another writer removed one of the files first): the file is nobody's.
        fs.delete_file(f"{root}/{name}")
        raise
    log.info(
        "sealed %d files of %s into one (%d rows, %d bytes)", len(paths), path, stats.rows, size
    )
    return Sealed(len(paths), stats.rows, size)


def _due(
    table: DeltaTable, time_column: str, before_ms: int
) -> tuple[list[str], list[int], dict[str, str | None]] | None:
    """The files to seal: from the oldest file due, those after it in time order of one
    partition, up to `SEALED_FILE_BYTES`; their paths, sizes and partition values."""
    adds = pa.table(table.get_add_actions(flatten=True))
    earliest, latest = f"min.{time_column}", f"max.{time_column}"
    if adds.num_rows < SEAL_MIN_FILES or latest not in adds.column_names:
        return None
    before = pa.scalar(before_ms * 1000, pa.timestamp("us", tz="UTC"))
    small = pc.less(adds.column("size_bytes"), SEALED_FILE_BYTES // 2)
    old = pc.less(adds.column(latest).cast(before.type), before)
    due = adds.filter(pc.and_kleene(small, old)).sort_by(earliest)
    if due.num_rows < SEAL_MIN_FILES:
        return None
    keys = [c for c in due.column_names if c.startswith("partition.")]
    rows = due.select(["path", "size_bytes", *keys]).to_pylist()
    first = {k: rows[0][k] for k in keys}
    paths, sizes, total = [], [], 0
    for row in rows:
        if {k: row[k] for k in keys} != first:
            continue
        if paths and total + row["size_bytes"] > SEALED_FILE_BYTES:
            break
        paths.append(unquote(row["path"]))
        sizes.append(row["size_bytes"])
        total += row["size_bytes"]
    if len(paths) < SEAL_MIN_FILES:
        return None
    partition = {k.removeprefix("partition."): _text(v) for k, v in first.items()}
    return paths, sizes, partition


def _text(value: object) -> str | None:
    """A partition value as Delta's log writes it."""
    return None if value is None else str(value)


def _rows(
    fs: pafs.FileSystem, root: str, paths: list[str], schema: pa.Schema
) -> Iterator[pa.RecordBatch]:
    """The rows of `paths`, in order, as `schema` (a file written before a column existed
    gets nulls), a batch at a time."""
    for p in paths:
        with fs.open_input_file(f"{root}/{p}") as f:
            for batch in pq.ParquetFile(f).iter_batches(batch_size=ROW_GROUP_ROWS):
                yield conform(batch, schema)


def _row_groups(batches: Iterator[pa.RecordBatch], schema: pa.Schema) -> Iterator[pa.Table]:
    """`batches` regrouped into `ROW_GROUP_ROWS` rows each (the last may be fewer): a
    source file of a few rows must not make a row group of its own."""
    pending = schema.empty_table()
    for batch in batches:
        pending = pa.concat_tables([pending, pa.Table.from_batches([batch], schema)])
        while pending.num_rows >= ROW_GROUP_ROWS:
            yield pending.slice(0, ROW_GROUP_ROWS)
            pending = pending.slice(ROW_GROUP_ROWS)
    if pending.num_rows:
        yield pending


class _Stats:
    """A file's Delta statistics, gathered a batch at a time: the row count, and each
    number's and time's bounds and nulls (strings and nested columns have none, which
    Delta allows: a reader then skips nothing by them)."""

    def __init__(self, schema: pa.Schema) -> None:
        self.rows = 0
        self.fields = [f for f in schema if any(kind(f.type) for kind in _STAT_KINDS)]
        self.low: dict[str, object] = {}
        self.high: dict[str, object] = {}
        self.nulls = {f.name: 0 for f in self.fields}

    def add(self, rows: pa.Table) -> None:
        self.rows += rows.num_rows
        for f in self.fields:
            values = rows.column(f.name)
            self.nulls[f.name] += values.null_count
            bounds = pc.min_max(values).as_py()
            for side, pick, keep in (("min", min, self.low), ("max", max, self.high)):
                if (v := bounds[side]) is not None:
                    keep[f.name] = v if f.name not in keep else pick(keep[f.name], v)

    def json(self) -> str:
        return json.dumps(
            {
                "numRecords": self.rows,
                "minValues": {k: _stat(v, upper=False) for k, v in self.low.items()},
                "maxValues": {k: _stat(v, upper=True) for k, v in self.high.items()},
                "nullCount": self.nulls,
            }
        )


def _stat(value: object, upper: bool) -> object:
    """A bound as Delta's statistics write it: times in UTC to the millisecond, rounded
    outward so the bound still holds."""
    if not isinstance(value, dt.datetime):
        return value
    us = (value - _EPOCH) // dt.timedelta(microseconds=1)
    ms = -(-us // 1000) if upper else us // 1000
    return iso_ms(ms)
