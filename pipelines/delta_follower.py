"""Follow a Delta table from the driver: each poll returns the rows of files added since.

The release job polls its buffer and ledger several times a second. A Spark read of the
whole table costs seconds; delta-rs reading only the new files of a new version costs
milliseconds, and nothing at all when the version has not moved.
"""

from __future__ import annotations

import datetime as dt
from typing import Any
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable

from dejaq.conf.storage import filesystem
from dejaq.conf.table_watch import TableWatch
from dejaq.conf.tables import TIMESTAMP, conform
from dejaq.pipelines.retention import LogGap, commits

EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


class DeltaFollower:
    """The rows of every file a table gains, each row once.

    A compaction or a retention run rewrites rows the table already had
    (`retention.commits`): its files are seen, not read, so a caller gets each row
    once and keeps no ids to skip repeats by. When appends and a rewrite of them arrive
    in one poll, the versions are walked one at a time, so the appended files are read
    even though the rewrite has replaced them (replaced files stay on disk for the
    table's file retention). Memory: the paths of the version read (`files`). A poll
    further behind than the table keeps its log raises `retention.LogGap`: the caller
    starts again.
    """

    def __init__(self, path: str, schema: pa.Schema, time_column: str | None = None) -> None:
        self.path = path
        self.schema = schema
        self.time_column = time_column  # for `since_ms`: its file statistics say when
        self.files: set[str] = set()  # the paths of version `version`
        self.files_read = 0  # since this follower started: what its polls cost
        self._table: DeltaTable | None = None
        self._version = -1
        self.watch = TableWatch(path)

    @property
    def version(self) -> int:
        """The table version the last poll read up to (-1 before the table exists)."""
        return self._version

    @property
    def table(self) -> DeltaTable | None:
        """The snapshot the last poll read up to (None before the table exists)."""
        return self._table

    def poll(self, upto: int | None = None, since_ms: int = 0) -> pa.Table:
        """Rows of files added since the last poll, in the contract's schema.

        `upto` stops at that version instead of the newest: stepping through the versions
        one at a time says which version added each row, each file read once.
        `since_ms`: a file whose `time_column` is before it in every row (by the file's
        statistics) is seen, not read: the caller has no use for such rows.
        """
        if self._table is None:
            if not DeltaTable.is_deltatable(self.path):
                return self.schema.empty_table()
            self._table = DeltaTable(self.path, version=upto)
        elif upto is None:
            if not self.watch.moved(self._table.version()):
                return self.schema.empty_table()
            self._table.update_incremental()
        else:
            self._table.load_as_version(upto)
        version = self._table.version()
        if version == self._version:
            return self.schema.empty_table()
        fs, root = filesystem(self.path)
        adds = pa.table(self._table.get_add_actions(flatten=True))
        parts = []
        seen: set[str] = set()
        for path, partition, recent, rewrite, newest in self._added(version, adds, since_ms):
            if path in self.files or path in seen:
                continue
            seen.add(path)
            if rewrite or not recent:
                continue
            try:
                data = pq.read_table(f"{root}/{unquote(path)}", filesystem=fs)
            except FileNotFoundError as e:
                if newest:
                    raise  # a file of the table's current version: it is damaged
                raise LogGap(
                    f"{self.path}: {path}, added by a version this reader has not "
                    "read, was vacuumed since: a start reads the table afresh"
                ) from e
            parts.append(conform(data, self.schema, partition))
            self.files_read += 1
        self.files = set(adds.column("path").to_pylist())
        self._version = version
        if not parts:
            return self.schema.empty_table()
        return pa.concat_tables(parts)

    def _added(
        self, version: int, adds: pa.Table, since_ms: int
    ) -> list[tuple[str, dict[str, Any], bool, bool, bool]]:
        """The files to look at, in the order their versions added them: (path, partition
        values, whether any row may be at or after `since_ms`, whether its version is a
        rewrite, whether `version` added it). Those of `version`'s snapshot (`adds`)
        alone, or every new version's when a rewrite is among them, taken from the
        versions' log entries: `retention.commits` reads each of them anyway, and a
        snapshot of each would cost a listing, a checkpoint and all its add actions."""
        if self._version >= 0:
            walked = commits(self.path, range(self._version + 1, version + 1))
            if any(c.rewrite for c in walked):
                fields = {f.name: f.type for f in self.schema}
                return [
                    (
                        add.path,
                        {
                            k: _typed(value, fields[k])
                            for k, value in add.partition.items()
                            if k in fields
                        },
                        self._after(add.max_values.get(self.time_column), since_ms),
                        c.rewrite,
                        c.version == version,
                    )
                    for c in walked
                    for add in c.adds
                ]
        recent = self._recent(adds, since_ms)
        names = [f.name for f in self.schema if f"partition.{f.name}" in adds.column_names]
        partitions = [adds.column(f"partition.{name}").to_pylist() for name in names]
        return [
            (path, dict(zip(names, values, strict=True)), recent[i], False, True)
            for i, (path, *values) in enumerate(
                zip(adds.column("path").to_pylist(), *partitions, strict=True)
            )
        ]

    def _after(self, latest: Any, since_ms: int) -> bool:
        """Whether a file whose `time_column` statistic is `latest` (as the log writes
        it) may hold a row at or after `since_ms`, as `_recent` says for a snapshot's."""
        if since_ms <= 0 or self.time_column is None:
            return True
        at = _timestamp_us(latest)
        return at is None or at >= since_ms * 1000

    def _recent(self, adds: pa.Table, since_ms: int) -> list[bool]:
        """Per file: whether any of its rows may be at or after `since_ms`."""
        stat = f"max.{self.time_column}"
        if since_ms <= 0 or stat not in adds.column_names:
            return [True] * adds.num_rows
        latest = adds.column(stat).cast(TIMESTAMP)
        since = pa.scalar(since_ms * 1000, TIMESTAMP)
        keep = pc.or_kleene(pc.is_null(latest), pc.greater_equal(latest, since))
        return keep.to_pylist()


def _typed(value: str | None, type_: pa.DataType) -> Any:
    """A partition value as the log writes it (a string), as a value of `type_`."""
    return None if value is None else pa.scalar(value).cast(type_).as_py()


def _timestamp_us(value: Any) -> int | None:
    """A timestamp statistic as the log writes it (ISO 8601; UTC where it names no
    offset), in epoch microseconds; None where there is none."""
    if not isinstance(value, str):
        return None
    try:
        at = dt.datetime.fromisoformat(value)
    except ValueError:
        return None
    if at.tzinfo is None:
        at = at.replace(tzinfo=dt.UTC)
    return (at - EPOCH) // dt.timedelta(microseconds=1)
