"""The table contract: where each Delta table lives and what its rows look like.

Spark-free on purpose: the broker reads these tables with delta-rs and must not import
Spark, while the pipelines convert these Arrow schemas to Spark ones. One definition,
two readers, no drift.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs
from deltalake import ColumnProperties, DeltaTable, WriterProperties
from deltalake.exceptions import CommitFailedError

from dejaq.conf.delta_log import actions, checkpoint_column, last_checkpoint
from dejaq.conf.settings import TOPIC_NAME, ConfigError, TopicConfig, TopicKind
from dejaq.conf.storage import filesystem
from dejaq.conf.table_features import check_path, check_table, refused_commit


class Table(StrEnum):
    BUFFER = "buffer"
    LEDGER = "ledger"
    QUARANTINE = "quarantine"
    DEAD_LETTER = "dead_letter"
    SCHEDULES = "schedules"


class LedgerEvent(StrEnum):
    ACKED = "acked"
    NACKED = "nacked"
    DEAD = "dead"
    CANCELLED = "cancelled"
    RESCHEDULED = "rescheduled"
    RELEASED = "released"
    REDRIVEN = "redriven"  # a dead message pending again (one per death at most)


# A message's ledger events are (dead, redriven)* then at most one terminal event, and
# their `at` is in milliseconds: events of one message in one millisecond rank as they
# can have been applied. A redrive undoes a death before it; what a pending message gets
# (a nack, a reschedule) comes after; an ack, a cancel or a release is final. A death
# and a redrive are the one pair either order of which the grammar allows there: taken
# as the death and then its redrive (the other order needs a redrive, a lease and a
# death within the millisecond).
_APPLIED_AT_ONE_TIME = pa.array(
    [
        LedgerEvent.DEAD,
        LedgerEvent.REDRIVEN,
        LedgerEvent.NACKED,
        LedgerEvent.RESCHEDULED,
        LedgerEvent.ACKED,
        LedgerEvent.CANCELLED,
        LedgerEvent.RELEASED,
    ],
    pa.string(),
)


TIMESTAMP = pa.timestamp("us", tz="UTC")
# Epoch milliseconds of 10 or 11 digits fall within 1970-01-12 and 1973-03-03, a time no
# producer means: they are epoch seconds (2001 to 5138) sent for milliseconds, refused
# wherever a time is taken (the ingest's envelope, the broker's API).
SECONDS_LIKE_MS = range(10**9, 10**11)
HEADERS = pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())]))

# Kafka coordinates of the record a row came from: ties in sort key break on these.
_SOURCE = [
    pa.field("source_topic", pa.string(), nullable=False),
    pa.field("source_partition", pa.int32(), nullable=False),
    pa.field("source_offset", pa.int64(), nullable=False),
]

BUFFER_SCHEMA = pa.schema(
    [
        pa.field("message_id", pa.string(), nullable=False),
        pa.field("bucket", pa.int32(), nullable=False),
        pa.field("sort_key", pa.int64(), nullable=False),
        pa.field("priority", pa.int32()),
        pa.field("deliver_at", TIMESTAMP),
        pa.field("event_time", TIMESTAMP),
        pa.field("key", pa.binary()),
        pa.field("payload", pa.binary()),
        pa.field("headers", HEADERS),
        *_SOURCE,
        pa.field("produced_at", TIMESTAMP),
        pa.field("ingested_at", TIMESTAMP, nullable=False),
    ]
)

LEDGER_SCHEMA = pa.schema(
    [
        pa.field("message_id", pa.string(), nullable=False),
        pa.field("bucket", pa.int32(), nullable=False),
        pa.field("event", pa.string(), nullable=False),
        pa.field("sort_key", pa.int64()),
        pa.field("deliveries", pa.int32(), nullable=False),
        pa.field("at", TIMESTAMP, nullable=False),
    ]
)

QUARANTINE_SCHEMA = pa.schema(
    [
        pa.field("key", pa.binary()),
        pa.field("value", pa.binary()),
        pa.field("headers", HEADERS),
        *_SOURCE,
        pa.field("produced_at", TIMESTAMP),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("detail", pa.string()),
        pa.field("quarantined_at", TIMESTAMP, nullable=False),
    ]
)

DEAD_LETTER_SCHEMA = pa.schema(
    [
        *[f for f in BUFFER_SCHEMA if f.name != "ingested_at"],
        pa.field("deliveries", pa.int32(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("dead_at", TIMESTAMP, nullable=False),
    ]
)

# A cron topic's schedules, one row each; `materialised_until`: every occurrence at or
# before it has been sent to the topic's Kafka input.
SCHEDULES_SCHEMA = pa.schema(
    [
        pa.field("schedule_id", pa.string(), nullable=False),
        pa.field("cron", pa.string(), nullable=False),
        pa.field("time_zone", pa.string(), nullable=False),
        pa.field("key", pa.binary()),
        pa.field("payload", pa.binary(), nullable=False),
        pa.field("headers", HEADERS),
        pa.field("end_at", TIMESTAMP),
        pa.field("created_at", TIMESTAMP, nullable=False),
        pa.field("materialised_until", TIMESTAMP, nullable=False),
    ]
)

SCHEMAS: dict[Table, pa.Schema] = {
    Table.BUFFER: BUFFER_SCHEMA,
    Table.LEDGER: LEDGER_SCHEMA,
    Table.QUARANTINE: QUARANTINE_SCHEMA,
    Table.DEAD_LETTER: DEAD_LETTER_SCHEMA,
    Table.SCHEDULES: SCHEDULES_SCHEMA,
}

# The buffer is read per bucket (the broker's unit of assignment). The ledger is read
# whole, and each of its appends (a broker checkpoint, a release batch) spans every
# bucket: partitioned by bucket, each wrote a file per bucket, at 2-3x the CPU of one.
# Ledgers created partitioned stay so (appends follow the table's own partitioning).
PARTITION_BY: dict[Table, list[str]] = {
    Table.BUFFER: ["bucket"],
    Table.LEDGER: [],
    Table.QUARANTINE: [],
    Table.DEAD_LETTER: [],
    Table.SCHEDULES: [],
}


def iso_ms(ms: int) -> str:
    """A UTC time in milliseconds as Delta writes it in statistics and reads it in predicates."""
    when = dt.datetime(1970, 1, 1, tzinfo=dt.UTC) + dt.timedelta(milliseconds=ms)
    return when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z"


def table_path(warehouse: str, table: Table, topic: str) -> str:
    """`<warehouse>/<table>/<topic>`; the warehouse may be a local folder or a URI."""
    if not TOPIC_NAME.fullmatch(topic):
        raise ValueError(f"invalid topic name {topic!r}: use [A-Za-z0-9._-]")
    if "://" not in warehouse:
        warehouse = str(Path(warehouse).expanduser().resolve())
    return f"{warehouse.rstrip('/')}/{Table(table).value}/{topic}"


def checkpoint_path(warehouse: str, job: str, topic: str) -> str:
    """Where a streaming job of a topic keeps its Spark checkpoint: beside its tables."""
    return table_path(warehouse, Table.BUFFER, topic).replace("/buffer/", f"/_checkpoints/{job}/")


def ensure_table(warehouse: str, table: Table, topic: str) -> str:
    """Create the table from the contract if it does not exist; return its path.

    Creating up front (rather than on first write) gives every reader, the broker's
    included, an empty table with the right schema from the start. One that exists with
    a Delta feature DejaQ cannot honour is refused (`conf.table_features`), at the
    process's first ensure of it.
    """
    path = table_path(warehouse, table, topic)
    create_if_missing(path, SCHEMAS[table], PARTITION_BY[table])
    check_path(path)
    return path


# The buffer's property naming the kind of the topic whose sort keys it holds: a priority,
# an epoch-ms deliver_at and an event time are all one int64, and read as another kind's
# they are delivered early or out of order.
KIND_PROPERTY = "dejaq.kind"
KIND_ATTEMPTS = 5  # recordings of the kind lost to a concurrent metadata commit, at most


class KindChanged(ConfigError):
    """A topic configured as another kind than the one its buffer's rows were written as."""


def ensure_buffer(warehouse: str, topic: TopicConfig) -> str:
    """`ensure_table` of the topic's buffer, whose rows are of the topic's configured kind;
    every part that writes or reads sort keys opens the buffer so, before it does. A
    buffer with a Delta feature DejaQ cannot honour is refused (`conf.table_features`).

    The kind is recorded in the table (`KIND_PROPERTY`): a buffer made before it takes
    the configured kind, and an empty one takes a new kind. One holding rows written as
    a kind sorted otherwise refuses the topic (`KindChanged`), as its rows would be read
    in the new kind's terms.
    """
    path = table_path(warehouse, Table.BUFFER, topic.name)
    configured = topic.kind.value
    create_if_missing(path, BUFFER_SCHEMA, PARTITION_BY[Table.BUFFER], {KIND_PROPERTY: configured})
    lost = 0
    while True:
        table = DeltaTable(path)
        check_table(table, path)
        recorded = table.metadata().configuration.get(KIND_PROPERTY)
        if recorded == configured:
            return path
        moved = recorded is not None and _sorted_as(recorded) is not topic.kind.sorted_as
        if moved and (rows := _rows(table)):
            raise KindChanged(
                f"topic {topic.name!r} is configured as kind {configured}, but its buffer "
                f"holds {rows} {'row' if rows == 1 else 'rows'} written as kind {recorded} "
                f"(table property {KIND_PROPERTY} of {path}): read as {configured}, their "
                f"sort keys would be delivered early or out of order. Set kind back to "
                f"{recorded}; or stop the topic's ingest, deliver what it holds as {recorded} "
                "until retention has emptied its buffer, stop its release or brokers, then "
                "change the kind; or give the new kind a new topic name"
            )
        try:
            table.alter.set_table_properties({KIND_PROPERTY: configured}, raise_if_not_exists=False)
            return path
        except CommitFailedError as e:
            refused_commit(path, e)
            lost += 1
            if lost == KIND_ATTEMPTS:
                raise


def _sorted_as(kind: str) -> TopicKind | None:
    """The kind whose sort keys a recorded kind wrote; None for one this version lacks."""
    try:
        return TopicKind(kind).sorted_as
    except ValueError:
        return None


def _rows(table: DeltaTable) -> int:
    """The table's rows: from its files' statistics, or counted where one has none."""
    counts = table.get_add_actions().column("num_records").to_pylist()
    if None in counts:
        return scan(table, Table.BUFFER, ["message_id"]).num_rows
    return sum(counts)


# The ledger's app transaction of the lease broker's checkpoints (one per Raft history,
# this and "<it>:<history>"): a ledger that has it is a topic the broker delivered.
BROKER_APP_ID = "dejaq-broker"
# Every table made here writes a Delta checkpoint each 10 commits, as Spark's Delta does by
# default, not delta-rs's 100: opening a table, or committing to it, replays its log
# since the last checkpoint, and a leader commits to its ledger every second. With 100,
# a ledger commit of 2,000 events cost 11 ms of CPU after a Delta checkpoint and 45-55
# ninety commits on; with 10, 12-20 throughout (`bench/ledger_commits.py`).
#
# Each keeps its log two hours, not Delta's 30 days: after each Delta checkpoint delta-rs
# lists the whole `_delta_log` to delete what expired, and on a local disk every open
# lists it too, so a month of commits a second (2.6 million files) would cost each open
# seconds and each checkpoint thousands of object-store requests. Readers that follow a
# table (a broker node's index, the release job) read its commits within seconds; one
# that falls further behind than the log (`pipelines.retention.LogGap`) reads the
# table as a start does. Files a compaction or a retention run replaced are kept as
# long, not Delta's 7 days: a Delta checkpoint carries a record of each until then, and
# the buffer's compactions replace thousands of files an hour (a file a bucket a
# micro-batch). No reader needs a version older than the log holds. A table whose
# owner sets these properties otherwise keeps their values (`with_table_properties`).
LOG_RETENTION = "interval 2 hours"
TABLE_PROPERTIES = {
    "delta.checkpointInterval": "10",
    "delta.logRetentionDuration": LOG_RETENTION,
    "delta.deletedFileRetentionDuration": LOG_RETENTION,
}

# How delta-rs writes the appends of the tables that grow at the pace of settlements
# (the ledger, the dead letters). Their ids are mostly unique, so a dictionary (delta-rs's
# default) is built and spilled for nothing; prefix deltas keep sequential ids as small,
# and write and read them for less CPU (`bench/id_encoding.py`). Other columns keep the
# defaults; Parquet readers (Spark's, Arrow's, delta-rs's) read either encoding.
APPEND_PROPERTIES = WriterProperties(
    column_properties={
        "message_id": ColumnProperties(dictionary_enabled=False, encoding="DELTA_BYTE_ARRAY")
    }
)


def is_broker_app_id(app_id: str) -> bool:
    """Whether `app_id` is the lease broker's, of any Raft history (`BROKER_APP_ID`)."""
    return app_id == BROKER_APP_ID or app_id.startswith(f"{BROKER_APP_ID}:")


def app_transactions(path: str) -> dict[str, int]:
    """Every app transaction of the Delta table at `path`, by app id, with its version:
    read from the log (its latest Delta checkpoint, then each commit after it), since
    delta-rs looks one up only by its app id, and the brokers' ids name Raft histories
    no reader of the table knows."""
    fs, root = filesystem(path)
    found: dict[str, int] = {}
    last = last_checkpoint(fs, root)
    version = -1 if last is None else int(last["version"])
    if last is not None:
        for txn in checkpoint_column(fs, root, last, "txn"):
            found[txn["appId"]] = txn["version"]
    while (entry := actions(fs, root, version := version + 1)) is not None:
        for action in entry:
            if txn := action.get("txn"):
                found[txn["appId"]] = txn["version"]
    return found


def create_if_missing(
    path: str,
    schema: pa.Schema,
    partition_by: list[str],
    properties: Mapping[str, str] | None = None,
) -> None:
    """`DeltaTable.create(mode="ignore")`, safe against a concurrent creator, with
    `TABLE_PROPERTIES` and the table's own `properties` (`KIND_PROPERTY`, say).

    delta-rs's "ignore" is not atomic: a racing creator can fail with CommitFailedError
    although the table now exists, which is all the caller wanted.
    """
    if DeltaTable.is_deltatable(path):
        return
    try:
        DeltaTable.create(
            path,
            schema,
            partition_by=partition_by or None,
            mode="ignore",
            configuration=TABLE_PROPERTIES | dict(properties or {}),
            raise_if_key_not_exists=False,  # delta-rs knows Delta's keys, not dejaq.*
        )
    except CommitFailedError:
        if not DeltaTable.is_deltatable(path):
            raise


def with_table_properties(path: str) -> None:
    """Give the table at `path` the `TABLE_PROPERTIES` it has no value for (one made
    before them); a value its owner set stays. A metadata commit, made by the writer that
    compacts the table, between its own appends: another writer's concurrent commit
    fails and tries again, as against a compaction."""
    table = DeltaTable(path)
    have = table.metadata().configuration
    if missing := {k: v for k, v in TABLE_PROPERTIES.items() if k not in have}:
        table.alter.set_table_properties(missing)


# --- reading: the contract's types, whatever wrote the files --------------------------
#
# Each writer stores the contract in its own Arrow types: Spark and delta-rs appends as
# plain strings, a delta-rs MERGE or compaction (DataFusion) as string views. A dataset
# over mixed files reads every column as the contract types it is given, but a filter
# is also checked against each file's column statistics in the file's own type, and
# Arrow has no kernel comparing a string with a string view: every filter names its
# columns through `column`, which compares in the contract's type.


Rows = TypeVar("Rows", pa.Table, pa.RecordBatch)


def column(table: Table, name: str) -> pc.Expression:
    """`name` in the contract's type, for a filter that holds on any file of `table`."""
    return pc.field(name).cast(SCHEMAS[table].field(name).type)


def matching(table: Table, **values: Collection[Any] | None) -> pc.Expression:
    """Rows whose column `name` holds one of `values[name]`, for every name given a
    collection (None: any value)."""
    found = [column(table, name).isin(list(v)) for name, v in values.items() if v is not None]
    if not found:
        raise ValueError("matching needs at least one column's values")
    out = found[0]
    for more in found[1:]:
        out &= more
    return out


def dataset(source: str | DeltaTable, table: Table) -> ds.Dataset:
    """The table's current files as one dataset of the contract's types.

    Read through Arrow's own filesystem for the table's URI, not delta-rs's default
    (a Python filesystem that Arrow's I/O threads call back into): a process that exits
    while those threads wind down aborted now and then ("terminate called without an
    active exception").
    """
    delta = source if isinstance(source, DeltaTable) else DeltaTable(source)
    fs, root = filesystem(delta.table_uri)
    return delta.to_pyarrow_dataset(
        schema=SCHEMAS[table], filesystem=pafs.SubTreeFileSystem(root, fs)
    )


def scan(
    source: str | DeltaTable,
    table: Table,
    columns: list[str] | None = None,
    where: pc.Expression | None = None,
) -> pa.Table:
    """The rows of `table` (a path or an open snapshot) matching `where` (built from
    `column` or `matching`), in the contract's types."""
    return dataset(source, table).to_table(columns=columns, filter=where)


def in_applied_order(events: pa.Table) -> pa.Table:
    """Ledger rows (`message_id`, `event`, `at`, any others) by message, each message's
    in the order they were applied: by `at`, and within a millisecond by the events'
    grammar (`_APPLIED_AT_ONE_TIME`), so its last row is its latest event."""
    rank = pc.index_in(events.column("event"), value_set=_APPLIED_AT_ONE_TIME)
    order = pa.table(
        {"message_id": events.column("message_id"), "at": events.column("at"), "rank": rank}
    )
    return events.take(
        pc.sort_indices(
            order,
            [("message_id", "ascending"), ("at", "ascending"), ("rank", "ascending")],
        )
    )


def conform(
    data: Rows, schema: pa.Schema, partition_values: Mapping[str, Any] | None = None
) -> Rows:
    """A file's rows as `schema` (a table's contract, or a projection of it): partition
    values, which Delta keeps in its log and not in the file, put back; columns the file
    lacks (written before they existed) as nulls; the rest cast to the contract's type."""
    n = data.num_rows
    partition_values = partition_values or {}
    columns = []
    for field in schema:
        if field.name in partition_values:
            columns.append(pa.array([partition_values[field.name]] * n).cast(field.type))
        elif field.name in data.schema.names:
            columns.append(data.column(field.name).cast(field.type))
        else:
            columns.append(pa.nulls(n, type=field.type))
    return type(data).from_arrays(columns, schema=schema)
