"""The files of one ingest micro-batch, written in one pass over its records.

Each Spark task takes its parsed records (pipelines.envelope), writes the valid ones as
buffer files and the rest as quarantine files, and returns one small row per file, per
reason, and per explicit id. Reading Kafka, parsing and writing are thus one stage: the
batch is never cached, counted or scanned again before its commit. The driver judges
the ids (pipelines.dedup) and moves the duplicates it finds, few by nature, out of the
buffer files that hold them before committing (`move_duplicates`).

Files written and never committed (a failed batch) are orphans until VACUUM, as with
any Delta writer.
"""

from __future__ import annotations

import datetime as dt
import json
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake.transaction import AddAction
from pyspark.sql.pandas.types import from_arrow_schema

from dejaq.conf.storage import filesystem
from dejaq.conf.tables import BUFFER_SCHEMA, QUARANTINE_SCHEMA, TIMESTAMP, conform
from dejaq.pipelines.dedup import Coordinates
from dejaq.pipelines.delta_source import WriteTarget, gathered, write_files
from dejaq.pipelines.envelope import COORDINATES, Reason

# What a task returns: a row per file (`table` set), per reason (`reason`, `rows`), and
# per explicit id to judge (`message_id`, its coordinates, and the file holding it).
RESULT_SCHEMA = pa.schema(
    [
        ("table", pa.string()),
        ("path", pa.string()),
        ("size", pa.int64()),
        ("partition_values", pa.string()),
        ("modification_time", pa.int64()),
        ("stats", pa.string()),
        ("reason", pa.string()),
        ("rows", pa.int64()),
        ("message_id", pa.string()),
        ("source_topic", pa.string()),
        ("source_partition", pa.int32()),
        ("source_offset", pa.int64()),
        ("produced_at", pa.int64()),  # microseconds: Kafka order among equal ids
    ]
)
RESULT_SPARK_SCHEMA = from_arrow_schema(RESULT_SCHEMA)  # what `mapInArrow` is told
BUFFER = "buffer"
QUARANTINE = "quarantine"
VALID = "valid"  # the `reason` of the count of buffered rows


def buffer_part(rows: pa.Table, at: dt.datetime) -> pa.Table:
    """The parsed rows that passed every check, as buffer rows ingested `at`."""
    return conform(_at(rows.filter(pc.is_null(rows.column("reason"))), at), BUFFER_SCHEMA)


def quarantine_part(rows: pa.Table, at: dt.datetime) -> pa.Table:
    """The parsed rows with a reason, as quarantine rows: the record as Kafka gave it."""
    bad = _at(rows.filter(pc.is_valid(rows.column("reason"))), at)
    return as_quarantine(bad, bad.column("reason"), bad.column("detail"))


def _at(rows: pa.Table, at: dt.datetime) -> pa.Table:
    return rows.append_column("ingested_at", pa.array([at] * rows.num_rows, TIMESTAMP))


def as_quarantine(rows: pa.Table, reason: pa.ChunkedArray, detail: pa.ChunkedArray) -> pa.Table:
    """Buffer-shaped `rows` as quarantine rows with `reason` and `detail`."""
    columns = {
        **{name: rows.column(name) for name in rows.schema.names},
        "value": rows.column("payload"),
        "reason": reason,
        "detail": detail,
        "quarantined_at": rows.column("ingested_at"),
    }
    return pa.table([columns[f.name] for f in QUARANTINE_SCHEMA], schema=QUARANTINE_SCHEMA)


def task(
    buffer: WriteTarget, quarantine: WriteTarget, at: dt.datetime
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The function each task of `mapInArrow` runs over its parsed records, which carry
    `judge`: a valid record whose id the producer set (only those can repeat). Every
    row of the batch is ingested `at`, the driver's time when the batch began."""

    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        rows = gathered(batches)
        if rows is None:
            return
        kept = buffer_part(rows, at)
        results = [_files(BUFFER, write_files(buffer, kept))]
        bad = quarantine_part(rows, at)
        results.append(_files(QUARANTINE, write_files(quarantine, bad)))
        counts = bad.group_by("reason", use_threads=False).aggregate([([], "count_all")])
        results.append(
            _rows(
                reason=[VALID, *counts.column("reason").to_pylist()],
                rows=[kept.num_rows, *counts.column("count_all").to_pylist()],
            )
        )
        judged = rows.filter(rows.column("judge"))
        if judged.num_rows:
            # One buffer file per bucket in a task: a judged row's bucket names its file.
            file_of = {
                int(json.loads(values)["bucket"]): path
                for path, values in zip(
                    *(results[0].column(c).to_pylist() for c in ("path", "partition_values")),
                    strict=True,
                )
            }
            results.append(
                _rows(
                    path=[file_of[b] for b in judged.column("bucket").to_pylist()],
                    produced_at=judged.column("produced_at").cast(pa.int64()),
                    **{c: judged.column(c) for c in ["message_id", *COORDINATES]},
                )
            )
        for result in results:
            yield from result.to_batches()

    return write


def _files(table: str, actions: list[AddAction]) -> pa.Table:
    return _rows(
        table=[table] * len(actions),
        path=[a.path for a in actions],
        size=[a.size for a in actions],
        partition_values=[json.dumps(a.partition_values) for a in actions],
        modification_time=[a.modification_time for a in actions],
        stats=[a.stats for a in actions],
    )


def _rows(**columns: object) -> pa.Table:
    n = len(next(iter(columns.values())))  # type: ignore[arg-type]
    return pa.table(
        [columns[f.name] if f.name in columns else pa.nulls(n, f.type) for f in RESULT_SCHEMA],
        schema=RESULT_SCHEMA,
    )


@dataclass
class BatchFiles:
    """What a batch's tasks returned, read on the driver."""

    buffer: list[AddAction] = field(default_factory=list)
    quarantine: list[AddAction] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # reason → rows (VALID: buffered)
    # The explicit ids, their coordinates, produced_at and the buffer file holding each.
    judged: pa.Table = field(default_factory=RESULT_SCHEMA.empty_table)

    @classmethod
    def read(cls, results: pa.Table) -> BatchFiles:
        files = results.filter(pc.is_valid(results.column("table")))
        batch = cls()
        for r in files.to_pylist():
            action = AddAction(
                path=r["path"],
                size=r["size"],
                partition_values=json.loads(r["partition_values"]),
                modification_time=r["modification_time"],
                data_change=True,
                stats=r["stats"],
            )
            (batch.buffer if r["table"] == BUFFER else batch.quarantine).append(action)
        counts = results.filter(pc.is_valid(results.column("reason")))
        for reason, n in zip(
            *(counts.column(c).to_pylist() for c in ("reason", "rows")), strict=True
        ):
            batch.counts[reason] = batch.counts.get(reason, 0) + n
        batch.judged = results.filter(pc.is_valid(results.column("message_id")))
        return batch

    def move_duplicates(
        self, buffer: WriteTarget, quarantine: WriteTarget, duplicates: dict[Coordinates, str]
    ) -> None:
        """Rewrite each buffer file holding a duplicate without it, and write the
        duplicates to the quarantine with reason `duplicate`. The files replaced were
        never committed: they are deleted."""
        marks = pa.array([_key(*c) for c in duplicates], pa.string())
        whys = pa.array(list(duplicates.values()), pa.string())
        hit = pc.is_in(_keys(self.judged), value_set=marks)
        paths = set(self.judged.filter(hit).column("path").to_pylist())
        fs, root = filesystem(buffer.path)
        keep: list[AddAction] = []
        moved = []
        for action in self.buffer:
            if action.path not in paths:
                keep.append(action)
                continue
            with fs.open_input_file(f"{root}/{action.path}") as f:
                rows = conform(pq.read_table(f), BUFFER_SCHEMA, action.partition_values)
            where = pc.index_in(_keys(rows), value_set=marks)
            dup = pc.is_valid(where)
            keep += write_files(buffer, rows.filter(pc.invert(dup)))
            gone = rows.filter(dup)
            reason = pa.array([Reason.DUPLICATE.value] * gone.num_rows, pa.string())
            moved.append(as_quarantine(gone, reason, pc.take(whys, where.filter(dup))))
            fs.delete_file(f"{root}/{action.path}")
        self.quarantine += write_files(quarantine, pa.concat_tables(moved))
        self.buffer = keep
        n = sum(m.num_rows for m in moved)
        self.counts[VALID] -= n
        self.counts[Reason.DUPLICATE.value] = n

    def drop(
        self, buffer: WriteTarget, quarantine: WriteTarget, coordinates: Collection[Coordinates]
    ) -> None:
        """Rewrite each file holding a row of `coordinates` without it: those records
        are in the quarantine already (a batch cut between its two commits, done again),
        so they land in neither table again. The files replaced were never committed:
        they are deleted. Every file is read: a batch is done again only after a crash."""
        marks = pa.array([_key(*c) for c in coordinates], pa.string())
        self.buffer, gone = _without(buffer, self.buffer, marks, BUFFER_SCHEMA)
        self.counts[VALID] = self.counts.get(VALID, 0) - gone.num_rows
        self.quarantine, gone = _without(quarantine, self.quarantine, marks, QUARANTINE_SCHEMA)
        for reason, n in Counter(gone.column("reason").to_pylist()).items():
            self.counts[reason] -= n
            if not self.counts[reason]:
                del self.counts[reason]


def _without(
    target: WriteTarget, actions: list[AddAction], marks: pa.Array, schema: pa.Schema
) -> tuple[list[AddAction], pa.Table]:
    """`actions`' files rewritten without the rows whose `_key` is in `marks`, and
    those rows."""
    fs, root = filesystem(target.path)
    keep: list[AddAction] = []
    gone = [schema.empty_table()]
    for action in actions:
        with fs.open_input_file(f"{root}/{action.path}") as f:
            rows = conform(pq.read_table(f), schema, action.partition_values)
        hit = pc.is_in(_keys(rows), value_set=marks)
        if not pc.any(hit).as_py():
            keep.append(action)
            continue
        keep += write_files(target, rows.filter(pc.invert(hit)))
        gone.append(rows.filter(hit))
        fs.delete_file(f"{root}/{action.path}")
    return keep, pa.concat_tables(gone)


def _key(topic: str, partition: int, offset: int) -> str:
    return f"{topic}\x00{partition}\x00{offset}"


def _keys(rows: pa.Table) -> pa.Array:
    """Each row's coordinates as one `_key` string, to look up in a set of them."""
    parts = [rows.column(c).cast(pa.string()) for c in COORDINATES]
    return pc.binary_join_element_wise(*parts, "\x00")
