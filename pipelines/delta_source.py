"""`dejaq_delta`: Delta Lake tables as a Spark Python Data Source, on delta-rs.

It stands in for the JVM Delta connector where its jar is absent (see pipelines.session).
Write tasks put parquet files straight into the table folder and send their add actions
to the driver, which makes them visible in one Delta commit. A streaming commit also
records (appId, batchId) as a Delta app transaction, so a micro-batch that Spark replays
after a crash is recognised and not appended twice.

Options: `path` (or `.load(path)` / `.save(path)`); reads: `versionAsOf`, `columns`
(comma-separated: Python sources get no column pruning from Spark); writes: `partitionBy`
(comma-separated; used when the writer creates the table), `appId` (streaming, required)
and, as in JVM Delta, `txnAppId` + `txnVersion` for idempotent batch appends (e.g. from
foreachBatch).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import random
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError
from deltalake.transaction import AddAction, CommitProperties, Transaction
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    DataSourceStreamArrowWriter,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema
from pyspark.sql.types import StructType

from dejaq.conf.storage import exported, filesystem, has_folders
from dejaq.conf.table_features import check_table, refused_commit
from dejaq.conf.tables import conform, create_if_missing, iso_ms

log = logging.getLogger(__name__)

# Files per read task: enough to amortise a task's start, few enough to spread the work.
FILES_PER_PARTITION = 4
# Longer strings get a truncated min and no max, so one big value cannot bloat the log.
STATS_STRING_PREFIX = 32
HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"
# An append commits again after losing to this many concurrent rewrites in a row.
COMMIT_ATTEMPTS = 20


class DeltaDataSource(DataSource):
    """Reads a Delta table's snapshot and appends to it, batch or streaming."""

    @classmethod
    def name(cls) -> str:
        return "dejaq_delta"

    def schema(self) -> StructType:
        full = from_arrow_schema(_arrow_schema(self._open_existing()))
        wanted = _names(self.options.get("columns"))
        if not wanted:
            return full
        if unknown := [c for c in wanted if c not in full.fieldNames()]:
            raise ValueError(f"option 'columns': {unknown} not in Delta table {self._path()}")
        return StructType([full[c] for c in wanted])

    def reader(self, schema: StructType) -> DeltaReader:
        delta = self._open_existing()
        check_table(delta, self._path())
        missing = sorted(set(schema.fieldNames()) - set(_arrow_schema(delta).names))
        if missing:
            raise ValueError(f"columns {missing} requested but not in Delta table {self._path()}")
        return DeltaReader(self._path(), delta.version(), schema)

    def writer(self, schema: StructType, overwrite: bool) -> DeltaBatchWriter:
        app_id, version = self.options.get("txnAppId"), self.options.get("txnVersion")
        txn = None
        if app_id is not None or version is not None:
            if not app_id or version is None or not version.isdigit():
                raise ValueError(
                    "options 'txnAppId' and 'txnVersion' (a number) go together: a write whose "
                    "txnVersion the table already has for txnAppId is skipped as a replay"
                )
            txn = (app_id, int(version))
        return DeltaBatchWriter(self._open_for_write(schema), overwrite, txn)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DeltaStreamWriter:
        path = self._path()
        if overwrite:
            raise ValueError(f"dejaq_delta streams only append to {path}: use outputMode('append')")
        app_id = self.options.get("appId")
        if not app_id:
            raise ValueError(
                f"option 'appId' is required to stream into Delta table {path}: it is recorded "
                "with each micro-batch's commit to recognise batches Spark replays after a "
                "restart, so they are not appended twice. Use one stable id per query."
            )
        return DeltaStreamWriter(self._open_for_write(schema), app_id)

    def _path(self) -> str:
        path = self.options.get("path")
        if not path:
            raise ValueError(
                "dejaq_delta needs option 'path' (the Delta table's folder or URI): "
                ".option('path', ...), .load(path) or .save(path)"
            )
        return path if "://" in path else os.path.abspath(path)

    def _open_existing(self) -> DeltaTable:
        path = self._path()
        if not DeltaTable.is_deltatable(path):
            raise FileNotFoundError(f"no Delta table at {path} (no _delta_log there)")
        version = self.options.get("versionAsOf")
        if version is None:
            return DeltaTable(path)
        if not version.isdigit():
            raise ValueError(
                f"option 'versionAsOf' must be a table version number, got {version!r}"
            )
        return DeltaTable(path, version=int(version))

    def _open_for_write(self, schema: StructType) -> WriteTarget:
        """Create the table from the DataFrame's schema if needed; check it matches."""
        path = self._path()
        requested = _names(self.options.get("partitionBy"))
        if not DeltaTable.is_deltatable(path):
            arrow = to_arrow_schema(schema, timezone="UTC")
            _check_partition_columns(path, arrow, requested)
            create_if_missing(path, arrow, requested)
        table = WriteTarget.of(path)
        if requested and tuple(requested) != table.partition_by:
            raise ValueError(
                f"partitionBy={requested} but Delta table {path} is partitioned by "
                f"{list(table.partition_by)}"
            )
        _check_partition_columns(path, table.schema, table.partition_by)
        _check_same_columns(path, table.schema, schema)
        return table


@dataclass(frozen=True)
class WriteTarget:
    """What a write task needs to know about the table (picklable)."""

    path: str
    schema: pa.Schema
    partition_by: tuple[str, ...]
    # The storage variables where it was made (the driver): the executors' may lack them.
    section: Mapping[str, str] = dataclasses.field(default_factory=exported, compare=False)

    @classmethod
    def of(cls, path: str) -> WriteTarget:
        """An existing table's, refused if it has a feature DejaQ cannot honour."""
        delta = DeltaTable(path)
        check_table(delta, path)
        return cls(path, _arrow_schema(delta), tuple(delta.metadata().partition_columns))

    @property
    def file_schema(self) -> pa.Schema:
        """Partition values live in folder names and the log, not in the files."""
        return pa.schema([f for f in self.schema if f.name not in self.partition_by])


def _names(option: str | None) -> list[str]:
    return [c.strip() for c in (option or "").split(",") if c.strip()]


def _arrow_schema(delta: DeltaTable) -> pa.Schema:
    return pa.schema(delta.schema().to_arrow())  # delta-rs returns an arro3 schema


def _check_partition_columns(path: str, schema: pa.Schema, partition_by: Sequence[str]) -> None:
    for name in partition_by:
        if name not in schema.names:
            raise ValueError(f"partition column {name!r} of {path} is not in the schema")
        t = schema.field(name).type
        if not (pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_date32(t)):
            raise ValueError(
                f"partition column {name!r} of {path} has type {t}: dejaq_delta writes only "
                "integer, string and date partitions"
            )


def _check_same_columns(path: str, table: pa.Schema, incoming: StructType) -> None:
    """Same names and types; nullability is the table's (Spark marks most columns nullable)."""
    want = {f.name: f.dataType.simpleString() for f in from_arrow_schema(table).fields}
    got = {f.name: f.dataType.simpleString() for f in incoming.fields}
    problems = []
    if missing := [n for n in want if n not in got]:
        problems.append(f"missing columns {missing}")
    if extra := [n for n in got if n not in want]:
        problems.append(f"columns not in the table {extra}")
    if differ := [
        f"{n} (table {want[n]}, DataFrame {got[n]})" for n in want if n in got and want[n] != got[n]
    ]:
        problems.append(f"different types: {', '.join(differ)}")
    if problems:
        raise ValueError(f"DataFrame does not match Delta table {path}: {'; '.join(problems)}")


# ---------------------------------------------------------------------------- read


class DeltaReader(DataSourceReader):
    """Reads the active files of one table version, a few files per task."""

    def __init__(self, path: str, version: int, schema: StructType) -> None:
        self.path = path
        self.version = version
        self.schema = schema
        self.section = exported()  # made on the driver, read on executors

    def partitions(self) -> Sequence[InputPartition]:
        adds = pa.table(DeltaTable(self.path, version=self.version).get_add_actions())
        paths = [unquote(p) for p in adds.column("path").to_pylist()]  # log paths are URIs
        if "partition" in adds.column_names:
            values = adds.column("partition").to_pylist()
        else:
            values = [{}] * len(paths)
        files = list(zip(paths, values, strict=True))
        groups = [
            files[i : i + FILES_PER_PARTITION] for i in range(0, len(files), FILES_PER_PARTITION)
        ]
        return [InputPartition(group) for group in groups] or [InputPartition([])]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        # Spark accepts only batches whose Arrow schema equals this one exactly.
        target = to_arrow_schema(self.schema, timezone="UTC")
        fs, root = filesystem(self.path, self.section)
        for rel_path, partition_values in partition.value:
            parquet = pq.ParquetFile(f"{root}/{rel_path}", filesystem=fs)
            present = [n for n in target.names if n in parquet.schema_arrow.names]
            for batch in parquet.iter_batches(columns=present):
                yield conform(batch, target, partition_values)


# --------------------------------------------------------------------------- write


@dataclass
class DeltaCommitMessage(WriterCommitMessage):
    """The files one write task added, as Delta add actions."""

    actions: list[AddAction]


class DeltaBatchWriter(DataSourceArrowWriter):
    """`mode("append")` adds files; `mode("overwrite")` also removes all current ones."""

    def __init__(self, table: WriteTarget, overwrite: bool, txn: tuple[str, int] | None) -> None:
        self.table = table
        self.overwrite = overwrite
        self.txn = txn

    def write(self, iterator: Iterator[pa.RecordBatch]) -> DeltaCommitMessage:
        return DeltaCommitMessage(write_files(self.table, gathered(iterator)))

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        mode = "overwrite" if self.overwrite else "append"
        commit(self.table, _actions(messages), mode, self.txn)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        _log_orphans(self.table, messages, "batch write")


class DeltaStreamWriter(DataSourceStreamArrowWriter):
    """Appends each micro-batch in one commit tagged with (appId, batchId), exactly once."""

    def __init__(self, table: WriteTarget, app_id: str) -> None:
        self.table = table
        self.app_id = app_id

    def write(self, iterator: Iterator[pa.RecordBatch]) -> DeltaCommitMessage:
        return DeltaCommitMessage(write_files(self.table, gathered(iterator)))

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        commit(self.table, _actions(messages), "append", (self.app_id, batchId))

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        _log_orphans(self.table, messages, f"appId {self.app_id} batch {batchId}")


def _actions(messages: list[WriterCommitMessage | None]) -> list[AddAction]:
    return [a for m in messages if isinstance(m, DeltaCommitMessage) for a in m.actions]


HISTORY_LOOK = 1000  # commits `_same_batch` reads back for a batch's own


class TableChanged(RuntimeError):
    """A table's properties no longer those the rows being committed were made for."""

    def __init__(self, path: str, assumed: dict[str, str], found: dict[str, str]) -> None:
        super().__init__(f"{path}: properties {found} where this writer assumed {assumed}")
        self.assumed, self.found = assumed, found


class SecondWriter(RuntimeError):
    """A batch id the table has, committed with other app transactions than this
    commit's `also`: another writer on the same checkpoint wrote it from other input."""


def commit(
    table: WriteTarget,
    actions: list[AddAction],
    mode: str,
    txn: tuple[str, int] | None,
    also: Sequence[Transaction] = (),
    assumes: Mapping[str, str] | None = None,
) -> None:
    """One Delta commit; with txn=(app id, batch id), none if the table already has it.

    `assumes` are table properties the rows were made for (a topic's kind): a table
    that sets one of them otherwise, since changed by another process, refuses them
    (`TableChanged`); one it does not set (a table made before it) changes nothing.

    `also` are more app transactions the commit records with txn (a streaming writer's
    source positions, say): an append of no files is still committed to record them.
    A batch the table has is skipped as a replay only if it recorded `also` the same,
    else SecondWriter: two drivers on one checkpoint (one left running after a retry,
    or launched twice) plan the same batch id over different source ranges, and the
    records one read past the other's would be skipped for good.
    An append loses its commit to a concurrent rewrite of files it did not touch (a
    retention run, a compaction: delta-rs counts the whole snapshot as read), though its
    rows depend on nothing it read: it is committed again on a fresh snapshot.
    """
    if not actions and not also and mode == "append":
        return  # an empty batch: no commit, no version to record, no open of the table
    for attempt in range(1, COMMIT_ATTEMPTS + 1):
        delta = DeltaTable(table.path)
        if assumes:
            have = delta.metadata().configuration
            if changed := {k: have[k] for k, v in assumes.items() if have.get(k, v) != v}:
                raise TableChanged(table.path, dict(assumes), changed)
        properties = CommitProperties(app_transactions=list(also)) if also else None
        if txn is not None:
            app_id, batch_id = txn
            committed = delta.transaction_version(app_id)
            if committed is not None and committed >= batch_id:
                # Spark crashed after our commit but before its own: the replay's files
                # are orphans.
                _same_batch(table.path, delta, txn, committed, also)
                log.warning(
                    "appId %s batch %d is already in %s (up to batch %d): skipping the replay",
                    app_id,
                    batch_id,
                    table.path,
                    committed,
                )
                return
            properties = CommitProperties(
                app_transactions=[Transaction(app_id, batch_id), *also],
                custom_metadata={"dejaq.appId": app_id, "dejaq.batchId": batch_id},
            )
        try:
            delta.create_write_transaction(
                actions,
                mode=mode,
                schema=delta.schema(),  # the table's own, so the commit changes no metadata
                partition_by=list(table.partition_by),
                commit_properties=properties,
            )
            return
        except CommitFailedError as e:
            refused_commit(table.path, e)
            if mode != "append" or attempt == COMMIT_ATTEMPTS:
                raise
            log.info("append to %s lost its commit (%s): committing again", table.path, e)
            time.sleep(random.uniform(0.01, 0.2))


def _same_batch(
    path: str, delta: DeltaTable, txn: tuple[str, int], committed: int, also: Sequence[Transaction]
) -> None:
    """Raise SecondWriter unless the table's commit of `txn` recorded `also` as given.

    Reached only when the table has the batch: a replay, or another writer's. Where the
    table has moved on and the batch's own commit is not among its last HISTORY_LOOK
    commits (or left the log), what it recorded is unknown: a replay is assumed."""
    if not also:
        return
    app_id, batch_id = txn
    then = delta
    if committed > batch_id:  # the app transactions since moved on: the batch's own commit
        found = next(
            (
                h["version"]
                for h in delta.history(limit=HISTORY_LOOK)
                if h.get("dejaq.appId") == app_id and h.get("dejaq.batchId") == batch_id
            ),
            None,
        )
        if found is None:
            log.warning(
                "appId %s batch %d: its commit in %s is too far back to compare positions",
                app_id,
                batch_id,
                path,
            )
            return
        then = DeltaTable(path, version=found)
    recorded = {t.app_id: then.transaction_version(t.app_id) for t in also}
    if all(recorded[t.app_id] == t.version for t in also):
        return
    ours = ", ".join(f"{t.app_id}={t.version}" for t in also)
    theirs = ", ".join(f"{a}={'none' if v is None else v}" for a, v in recorded.items())
    raise SecondWriter(
        f"appId {app_id} batch {batch_id} is in {path} with other positions ({theirs}) "
        f"than this one's ({ours}): another driver wrote it on the same checkpoint (one "
        "left running after a retry, or a second launch), and skipping it would lose the "
        "records this one read past the other's"
    )


def _log_orphans(table: WriteTarget, messages: list[WriterCommitMessage | None], what: str) -> None:
    log.warning(
        "%s into %s aborted: the files its tasks wrote (%d from tasks that finished) stay "
        "uncommitted until VACUUM removes them",
        what,
        table.path,
        len(_actions(messages)),
    )


def gathered(batches: Iterator[pa.RecordBatch]) -> pa.Table | None:
    """A task's rows in one table, so each file gets one row group instead of a sliver
    per Arrow batch per partition value: faster to write, and to read back."""
    chunks = [b for b in batches if b.num_rows]
    return pa.Table.from_batches(chunks) if chunks else None


def write_files(table: WriteTarget, rows: pa.Table | None) -> list[AddAction]:
    """One parquet file per partition value in `rows`; nothing is visible until commit."""
    if rows is None or not rows.num_rows:
        return []
    rows = _conform_write(rows, table)
    fs, root = filesystem(table.path, table.section)
    return [
        _DataFile(fs, root, table, values).write_all(part)
        for values, part in _split(rows, table.partition_by)
    ]


def _conform_write(rows: pa.Table, table: WriteTarget) -> pa.Table:
    """The table's column order and types (e.g. the session time zone becomes UTC)."""
    for field in table.schema:
        nulls = rows.column(field.name).null_count
        if not field.nullable and nulls:
            raise ValueError(
                f"column {field.name!r} is NOT NULL in Delta table {table.path} "
                f"but {nulls} rows have null"
            )
    return rows.select(table.schema.names).cast(table.schema)


def _split(
    batch: pa.Table, partition_by: tuple[str, ...]
) -> Iterator[tuple[tuple[Any, ...], pa.Table]]:
    if not partition_by:
        yield (), batch
        return
    keys = batch.select(list(partition_by))
    for key in keys.group_by(list(partition_by), use_threads=False).aggregate([]).to_pylist():
        masks = [
            pc.is_null(batch[c]) if v is None else pc.equal(batch[c], v) for c, v in key.items()
        ]
        rows = batch.filter(functools.reduce(pc.and_, masks))
        yield tuple(key[c] for c in partition_by), rows.drop_columns(list(partition_by))


class _DataFile:
    """A parquet file being written by a task, and the Delta stats of its rows."""

    def __init__(
        self, fs: pafs.FileSystem, root: str, table: WriteTarget, values: tuple[Any, ...]
    ) -> None:
        self.partition_values = {
            c: None if v is None else str(v)
            for c, v in zip(table.partition_by, values, strict=True)
        }
        folders = [
            f"{c}={HIVE_NULL if v is None else quote(v, safe='')}"
            for c, v in self.partition_values.items()
        ]
        self.path = "/".join([*folders, f"part-{uuid.uuid4()}.parquet"])
        self.fs = fs
        self.full_path = f"{root}/{self.path}"
        if has_folders(fs):
            fs.create_dir(self.full_path.rsplit("/", 1)[0], recursive=True)
        self.file_schema = table.file_schema
        self.stats = _Stats(table.file_schema)

    def write_all(self, rows: pa.Table) -> AddAction:
        """The file is made in memory, then stored whole: on an object store one PUT (a
        task's file per bucket is small), and its size known without asking."""
        rows = rows.cast(self.file_schema)
        made = pa.BufferOutputStream()
        pq.write_table(rows, made, row_group_size=max(rows.num_rows, 1))
        data = made.getvalue()
        with self.fs.open_output_stream(self.full_path) as out:
            out.write(data)
        self.stats.add(rows)
        return AddAction(
            path=self.path,
            size=data.size,
            partition_values=self.partition_values,
            modification_time=int(time.time() * 1000),
            data_change=True,
            stats=self.stats.to_json(),
        )


def _has_range(t: pa.DataType) -> bool:
    """Types whose min/max Delta readers use to skip files (floats: NaN has no order)."""
    return (
        pa.types.is_integer(t)
        or pa.types.is_string(t)
        or pa.types.is_date32(t)
        or (pa.types.is_timestamp(t) and t.tz is not None)
    )


class _Stats:
    """Running Delta file statistics: numRecords, and per top-level column nulls, min, max."""

    def __init__(self, schema: pa.Schema) -> None:
        self.schema = schema
        self.rows = 0
        self.nulls = dict.fromkeys(schema.names, 0)
        self.min: dict[str, Any] = {}
        self.max: dict[str, Any] = {}

    def add(self, batch: pa.Table) -> None:
        self.rows += batch.num_rows
        for field in self.schema:
            column = batch.column(field.name)
            self.nulls[field.name] += column.null_count
            if not _has_range(field.type) or column.null_count == len(column):
                continue
            extremes = pc.min_max(column)
            lo, hi = _value(extremes["min"]), _value(extremes["max"])
            self.min[field.name] = min(lo, self.min.get(field.name, lo))
            self.max[field.name] = max(hi, self.max.get(field.name, hi))

    def to_json(self) -> str:
        lows: dict[str, Any] = {}
        highs: dict[str, Any] = {}
        for name in self.min:
            t = self.schema.field(name).type
            lo, hi = self.min[name], self.max[name]
            if pa.types.is_timestamp(t):  # Delta keeps milliseconds: round outwards
                lows[name], highs[name] = iso_ms(lo // 1000), iso_ms(-(-hi // 1000))
            elif pa.types.is_date32(t):
                lows[name], highs[name] = lo.isoformat(), hi.isoformat()
            elif isinstance(lo, str):
                lows[name] = lo[:STATS_STRING_PREFIX]  # a prefix is still a lower bound
                if len(hi) <= STATS_STRING_PREFIX:
                    highs[name] = hi
            else:
                lows[name], highs[name] = lo, hi
        stats = {"numRecords": self.rows, "minValues": lows, "maxValues": highs}
        return json.dumps({**stats, "nullCount": self.nulls})


def _value(scalar: pa.Scalar) -> Any:
    """Python value to compare; timestamps as integer microseconds."""
    return scalar.value if isinstance(scalar, pa.TimestampScalar) else scalar.as_py()
