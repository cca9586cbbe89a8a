"""Compaction of the log tables, the ledger and the dead letters: their files rewritten,
in time order, into a few of bounded size, and, once old, sealed into large ones.

Those tables only grow, a commit a checkpoint (about a second), and their readers read
tails: a start reads the ledger from the retention watermark (the settled retention
back), retention a minute of it, the ingest's dedup seed its last days. Two tiers keep
both the tails and the whole cheap:
- **compaction**: files under half of `LOG_FILE_BYTES` (4 MB) are rewritten, oldest
  first, into files of up to that, so a tail is a few files whose time ranges
  (`min`/`max` statistics) follow each other;
- **sealing**: files whose latest row is older than the settled retention plus
  `SEAL_AGE_MS` (the tails read often, a start's and retention's, are younger; the
  ingest's start reads its dedup window, sealed files too) and under half of
  `SEALED_FILE_BYTES` (128 MB) are rewritten the same way into files of up to that,
  once `SEAL_MIN_FILES` are due. Every open of a table reads an entry per file (the
  leader opens its ledger at each checkpoint) and each Delta checkpoint writes them
  all again. A sealed file holds some 3 million events (about 42 bytes each with
  36-character ids): at 1,000 settled a second, about 30 files a day, not 900.

Each rewrite streams: pyarrow writes the new file a row group at a time, taking its Delta
statistics on the way, so its memory follows a row group, not the file. Its commit
removes the old files and adds the new one, every action `dataChange=false` (a Spark
stream over the ledger reads nothing twice; `retention.is_rewrite` says the same to
DejaQ's followers), and carries the next version of the `MAINTAINER` app transaction:
of two rewrites made from one snapshot (a deposed leader's round beside its
successor's), delta-rs refuses the second, which would otherwise add the rows of files
already replaced. delta-rs's own compaction is not used here: it bins files by size with
no say over which, and its commit carries no app transaction. Nothing else may rewrite
these tables (an OPTIMIZE by hand): Delta refuses neither of two commits that remove
the same file when one of them is a seal.
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
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.exceptions import CommitFailedError
from deltalake.transaction import AddAction, RemoveAction

from dejaq.conf.storage import filesystem, has_folders
from dejaq.conf.tables import TIMESTAMP, conform, iso_ms
from dejaq.pipelines.compaction import Compacted, maintained, vacuum

log = logging.getLogger("dejaq.log_compaction")

COMPACTED = "dejaq.compacted"  # commitInfo's custom metadata keys: how many files each
SEALED = "dejaq.sealed"  # rewrite of each tier replaced
MAINTAINER = "dejaq-maintenance"  # the app transaction of every rewrite
LOG_FILE_BYTES = 4 * 1024 * 1024
SEALED_FILE_BYTES = 128 * 1024 * 1024
# Files past which a seal pays for itself: fewer wait for more (a sealed file under half
# the size is sealed again with the next ones, so a quiet table converges too).
SEAL_MIN_FILES = 8
SEAL_AGE_MS = 24 * 3600 * 1000
ROW_GROUP_ROWS = 128 * 1024  # pruned by `at` statistics, a few MB each
# Compactions a round: a backlog is taken in bounded bites. A seal is one a round: its
# 128 MB take seconds, which the writer's next append waits.
MAX_COMPACTIONS = 16
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_STAT_KINDS = (pa.types.is_integer, pa.types.is_floating, pa.types.is_timestamp)


@dataclass(frozen=True)
class Rewritten:
    files_removed: int
    rows: int
    bytes_written: int


@dataclass(frozen=True)
class _Tier:
    """A tier's commit tag, the size of its files, and how many it waits for."""

    tag: str
    file_bytes: int
    min_files: int


def maintain_log(path: str, time_column: str, tail_ms: int) -> Compacted | None:
    """A round of maintenance of a log table by its only writer (a topic's broker leader
    or its release job), between its own appends: compaction, sealing of the files
    older than `tail_ms` (how far back its readers read a tail: the topic's settled
    retention) plus `SEAL_AGE_MS`, then vacuum. A failure is logged, not raised."""

    def rewrite() -> Compacted:
        done = compact_log(path, time_column)
        sealed = seal(path, time_column, int(time.time() * 1000) - tail_ms - SEAL_AGE_MS)
        done += [sealed] if sealed is not None else []
        return Compacted(sum(r.files_removed for r in done), len(done), vacuum(path))

    return maintained(path, rewrite)


def compact_log(path: str, time_column: str) -> list[Rewritten]:
    """The compaction tier's rewrites of the table at `path`, oldest files first, until
    none is due (`MAX_COMPACTIONS` at most)."""
    tier = _Tier(COMPACTED, LOG_FILE_BYTES, 2)
    done: list[Rewritten] = []
    while len(done) < MAX_COMPACTIONS:
        step = _rewrite(path, time_column, tier, None)
        if step is None:
            break
        done.append(step)
    return done


def seal(path: str, time_column: str, before_ms: int) -> Rewritten | None:
    """Seal the oldest files of the table at `path` whose latest `time_column` is before
    `before_ms` into one; None when fewer than `SEAL_MIN_FILES` are due."""
    return _rewrite(path, time_column, _Tier(SEALED, SEALED_FILE_BYTES, SEAL_MIN_FILES), before_ms)


def _rewrite(path: str, time_column: str, tier: _Tier, before_ms: int | None) -> Rewritten | None:
    """Rewrite the first run of files `tier` has due into one file; None if none."""
    table = DeltaTable(path)
    chosen = _due(table, time_column, tier, before_ms)
    if chosen is None:
        return None
    paths, sizes, partition = chosen
    partition_columns = list(table.metadata().partition_columns)
    contract = pa.schema(table.schema().to_arrow())
    file_schema = pa.schema([f for f in contract if f.name not in partition_columns])
    fs, root = filesystem(path)
    folder = "/".join(f"{k}={v}" for k, v in partition.items())
    name = f"{folder}/" if folder else ""
    kind = "sealed" if tier.tag == SEALED else "compacted"
    name += f"part-00000-{uuid.uuid4()}-c000.{kind}.snappy.parquet"
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
    version = (table.transaction_version(MAINTAINER) or 0) + 1
    commit = CommitProperties(
        app_transactions=[Transaction(MAINTAINER, version)],
        custom_metadata={tier.tag: str(len(paths))},
    )
    try:
        table.create_write_transaction(
            actions,
            "append",
            table.schema(),
            partition_by=partition_columns,
            commit_properties=commit,
        )
    except CommitFailedError:
        # Refused (another rewrite from this snapshot came first), the file is nobody's:
        # unless the refusal was of a retry that met its own commit (a store's timeout).
        if not _holds(path, name):
            fs.delete_file(f"{root}/{name}")
        raise
    log.info(
        "%s %d files of %s into one (%d rows, %d bytes)",
        kind,
        len(paths),
        path,
        stats.rows,
        size,
    )
    return Rewritten(len(paths), stats.rows, size)


def _holds(path: str, name: str) -> bool:
    """Whether the table's latest version holds the file `name`."""
    paths = pa.table(DeltaTable(path).get_add_actions()).column("path").to_pylist()
    return name in {unquote(p) for p in paths}


def _due(
    table: DeltaTable, time_column: str, tier: _Tier, before_ms: int | None
) -> tuple[list[str], list[int], dict[str, str | None]] | None:
    """The files to rewrite, their sizes and partition values: of the files `tier` has
    due (under half its file size; for a seal, latest row before `before_ms`), in time
    order within one partition, the earliest run of at least its `min_files` that fits
    its file size."""
    adds = pa.table(table.get_add_actions(flatten=True))
    earliest, latest = f"min.{time_column}", f"max.{time_column}"
    if adds.num_rows < tier.min_files or latest not in adds.column_names:
        return None
    due = pc.less(adds.column("size_bytes"), tier.file_bytes // 2)
    if before_ms is not None:
        before = pa.scalar(before_ms * 1000, TIMESTAMP)
        due = pc.and_kleene(due, pc.less(adds.column(latest).cast(TIMESTAMP), before))
    else:
        due = pc.and_kleene(due, pc.is_valid(adds.column(latest)))
    found = adds.filter(due).sort_by(earliest)
    if found.num_rows < tier.min_files:
        return None
    keys = [c for c in found.column_names if c.startswith("partition.")]
    groups: dict[tuple, list[dict]] = {}  # per partition, in the order of its oldest file
    for row in found.select(["path", "size_bytes", *keys]).to_pylist():
        groups.setdefault(tuple(row[k] for k in keys), []).append(row)
    for values, files in groups.items():
        run = _first_run([f["size_bytes"] for f in files], tier)
        if run is not None:
            chosen = files[run]
            partition = {
                k.removeprefix("partition."): _text(v) for k, v in zip(keys, values, strict=True)
            }
            return (
                [unquote(f["path"]) for f in chosen],
                [f["size_bytes"] for f in chosen],
                partition,
            )
    return None


def _first_run(sizes: list[int], tier: _Tier) -> slice | None:
    """The earliest run of consecutive files of `sizes` that, taken up to `tier`'s file
    size, holds at least its `min_files`; None if there is none. Two pointers: the end
    of the longest run from a start only moves on as the start does."""
    end, total = 0, 0
    for start in range(len(sizes)):
        if end < start:
            end, total = start, 0
        while end < len(sizes) and (end == start or total + sizes[end] <= tier.file_bytes):
            total += sizes[end]
            end += 1
        if end - start >= tier.min_files:
            return slice(start, end)
        total -= sizes[start]
    return None


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
