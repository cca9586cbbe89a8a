"""Retention: settled messages leave `buffer/<topic>` once past `settled_retention_ms`.

Run by a topic's deliverer, the one writer of its ledger: the broker's leader for a
lease topic, the release job for a release topic. Spark-free, on delta-rs.

A run reads the ledger from the buffer's retention watermark W to the cutoff C and
finds the messages settled there (the latest event of a message decides: a redrive
makes it pending again). A redrive is the one event that can follow a settling one, a
death, so past C the run looks up only the redrives of those that died. The messages
whose latest event there is a redrive get their buffer rows back from the dead letters
where they have none (`restore`) before the run commits, so the watermark never passes
a redrive of a message left without one. It rewrites each buffer file holding any of
the settled messages without them (and the rows given new keys, below), and commits
the removes, the adds and C as the new W in one Delta commit (the app transaction
`dejaq-retention`). Everything the buffer still holds was therefore pending at C, at
its key then, or settled at or after W, so a reader that starts (a broker node, the
release job) needs the ledger only from W on: the files whose largest `at` reaches W.

The deliverer bounds C by what it has not yet written to the ledger (the broker's
un-checkpointed events), so no event older than C can reach the ledger after a run.
A message pending at C whose key an event in the span set (a `rescheduled` one: the
brokers' reschedule or a nack's priority; or a redrive, at its key) has its buffer row
rewritten at that key in the same commit (`new_keys`), with the columns its kind
derives from the key (priority, deliver_at or event_time), in its own bucket's
partition. A start reads the ledger from W on, so it would otherwise take the message
at the row's old key (the release job taking a topic over from the brokers: a timeline
message rescheduled later, early); holding W at such an event instead would stop
retention for the whole topic until the message settles, a month for a reminder
rescheduled a month ahead. An event after C is read by a start and wins over the row.
Other writers keep going, all on delta-rs (Delta's optimistic concurrency, a put-if-absent
commit on every store). The run's rewrite reads only rows ingested before the latest
stamp its snapshot holds (`ingested_before`), so an ingest append that commits first,
of rows stamped since, leaves the run's commit valid: however long a rewrite takes on
a slow store, appends every second cannot starve it. An append that commits second commits
again on top of it (`pipelines.delta_source`); a concurrent compaction or another run:
the loser fails and tries again. The rewritten files' rows are not new, so
readers that follow the buffer (`is_rewrite`) do not read them again (one that holds a
message keeps the key it applied from the event, the brokers' Raft state or the release
job's pending set, the same one); the replaced files stay for the table's file
retention, then vacuum deletes them.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake.exceptions import CommitFailedError

from dejaq.conf.delta_log import actions as log_actions
from dejaq.conf.storage import filesystem
from dejaq.conf.table_features import refused_commit
from dejaq.conf.tables import (
    BUFFER_SCHEMA,
    LEDGER_SCHEMA,
    LOG_RETENTION,
    TIMESTAMP,
    LedgerEvent,
    Table,
    column,
    in_applied_order,
    iso_ms,
    matching,
    scan,
)
from dejaq.pipelines.compaction import vacuum
from dejaq.pipelines.log_compaction import COMPACTED, SEALED

log = logging.getLogger("dejaq.retention")

APP_ID = "dejaq-retention"  # the buffer's app transaction: its version is W, epoch ms
OPERATION = "dejaq.retention"  # commitInfo's custom metadata key saying what a commit is
RESTORED = "dejaq.restored"  # the same, for the rows `restore` puts back
# How far a deliverer's clock may be behind the one that stamped earlier events (a new
# leader's): events stamped that far before the cutoff still count as after it.
CLOCK_SKEW_MS = 60_000
ATTEMPTS = 8
PERIOD_S = 60.0  # a deliverer runs retention at least this often
# A run that removes nothing commits its watermark only this far past the last one.
WATERMARK_STEP_MS = 60_000

TERMINAL = frozenset(
    {LedgerEvent.ACKED, LedgerEvent.DEAD, LedgerEvent.CANCELLED, LedgerEvent.RELEASED}
)
# The events that say whether a message is settled: a redrive undoes one death.
SETTLING = tuple(sorted({*TERMINAL, LedgerEvent.REDRIVEN}))
# The events that say whether a message is dead: its last death, or a redrive after it.
DEATHS = (LedgerEvent.DEAD, LedgerEvent.REDRIVEN)
# The events that give a pending message a key: a redrive (at the key it died with or
# the one given) and a `rescheduled` one; the latest is in force.
KEYING = (LedgerEvent.REDRIVEN, LedgerEvent.RESCHEDULED)
# The columns a row's kind derives from its sort key: a priority topic's `priority`, a
# timeline's (and a cron topic's) `deliver_at`, an event-time topic's `event_time`.
KEYED = ("priority", "deliver_at", "event_time")
_NO_KEYS = pa.table({"message_id": pa.array([], pa.string()), "sort_key": pa.array([], pa.int64())})


@dataclass(frozen=True)
class RetentionRun:
    """One run: when, the new watermark, what it removed and what it cost, and how many
    pending messages' rows it gave their new keys."""

    at_ms: int
    watermark_ms: int
    removed: int
    files_rewritten: int
    messages_read: int
    seconds: float
    rekeyed: int = 0


def watermark(buffer: DeltaTable) -> int:
    """W: every message settled before it has left this buffer version (0: none yet)."""
    return buffer.transaction_version(APP_ID) or 0


def ledger_tail(
    ledger_path: str,
    since_ms: int,
    columns: list[str],
    ids: list[str] | None = None,
    until_ms: int | None = None,
    events: tuple[str, ...] = SETTLING,
) -> pa.Table:
    """The ledger's `events` (settling ones unless told) at or after `since_ms` and, if
    given, before `until_ms` (epoch ms).

    Reads only the files whose `at` range meets that span, so its cost follows the span,
    not the ledger's history (the broker compacts the ledger into bounded files).
    """
    table = DeltaTable(ledger_path)
    adds = pa.table(table.get_add_actions(flatten=True))
    since = pa.scalar(since_ms * 1000, TIMESTAMP)
    if since_ms > 0 and "max.at" in adds.column_names:
        latest = adds.column("max.at").cast(TIMESTAMP)
        adds = adds.filter(pc.or_kleene(pc.is_null(latest), pc.greater_equal(latest, since)))
    until = None if until_ms is None else pa.scalar(until_ms * 1000, TIMESTAMP)
    if until is not None and "min.at" in adds.column_names:
        earliest = adds.column("min.at").cast(TIMESTAMP)
        adds = adds.filter(pc.or_kleene(pc.is_null(earliest), pc.less(earliest, until)))
    fs, root = filesystem(ledger_path)
    paths = [f"{root}/{unquote(p)}" for p in adds.column("path").to_pylist()]
    if not paths:
        return LEDGER_SCHEMA.empty_table().select(columns)
    wanted = matching(Table.LEDGER, event=events, message_id=ids)
    if since_ms > 0:
        wanted &= column(Table.LEDGER, "at") >= since
    if until is not None:
        wanted &= column(Table.LEDGER, "at") < until
    # The contract's schema, not the first file's: a ledger once partitioned lacks
    # `bucket` in its files.
    dataset = ds.dataset(paths, schema=LEDGER_SCHEMA, format="parquet", filesystem=fs)
    return dataset.to_table(columns=columns, filter=wanted)


def latest_events(
    ledger_path: str,
    since_ms: int,
    ids: list[str] | None = None,
    until_ms: int | None = None,
    events: tuple[str, ...] = SETTLING,
    also: tuple[str, ...] = (),
) -> pa.Table:
    """Each message's (of `ids`, if given) latest of `events` (settling ones unless told)
    at or after `since_ms` (and before `until_ms`, if given): message_id, event_last,
    at_last, and `<column>_last` of each column in `also`.

    A message's events are (dead, redriven)* then at most one terminal event, so its
    latest says what it is; those of one millisecond are taken in the order the
    grammar allows (`in_applied_order`): a cancel or an ack after a redrive of that
    millisecond settles the message.
    """
    columns = ["message_id", "event", "at", *also]
    tail = ledger_tail(ledger_path, since_ms, columns, ids, until_ms, events)
    return (
        in_applied_order(tail)
        .group_by("message_id", use_threads=False)
        .aggregate([(c, "last") for c in columns[1:]])
    )


def split(last: pa.Table) -> tuple[list[str], list[str]]:
    """The ids of `latest_events`: (settled, redriven since their last death)."""
    redriven = pc.equal(last.column("event_last"), LedgerEvent.REDRIVEN)
    ids = last.column("message_id")
    return ids.filter(pc.invert(redriven)).to_pylist(), ids.filter(redriven).to_pylist()


def first_per_id(t: pa.Table) -> pa.Table:
    """One row per message id, the first (a message that died twice has two dead
    letters)."""
    ids = t.column("message_id").to_pylist()
    first = {mid: i for i, mid in reversed(list(enumerate(ids)))}
    return t.take(pa.array(sorted(first.values()), pa.int64()))


def period_s(retention_ms: int) -> float:
    """How often a deliverer runs retention: a tenth of the retention, at least once a
    minute."""
    return min(PERIOD_S, retention_ms / 10_000)


def settled_before(
    ledger_path: str, since_ms: int, cutoff_ms: int
) -> tuple[pa.Array, int, list[str], list[str]]:
    """The ids settled at or after `since_ms` and before `cutoff_ms` that are still
    settled, how many messages the span's events name, which of the ids are dead, and
    the ids whose latest event in the span is a redrive.

    Reads the ledger of that span, not the events after it, so a run each minute does
    not read the whole retention window again: only a death can be followed (by a
    redrive), so past the cutoff only the dead are looked up, and only for a redrive.
    """
    last = latest_events(ledger_path, since_ms, until_ms=cutoff_ms)
    is_redrive = pc.equal(last.column("event_last"), LedgerEvent.REDRIVEN)
    redriven = last.filter(is_redrive).column("message_id").to_pylist()
    done = last.filter(pc.invert(is_redrive))
    ids = done.column("message_id").combine_chunks()
    dead = pc.equal(done.column("event_last"), LedgerEvent.DEAD)
    died: list[str] = []
    if pc.any(dead).as_py():
        died = done.filter(dead).column("message_id").to_pylist()
        undone = set(redrives_since(ledger_path, cutoff_ms, died))
        ids = ids.filter(pc.invert(pc.is_in(ids, value_set=pa.array(sorted(undone), pa.string()))))
        died = [mid for mid in died if mid not in undone]
    return ids, last.num_rows, died, redriven


def new_keys(ledger_path: str, since_ms: int, cutoff_ms: int) -> pa.Table:
    """The messages pending at `cutoff_ms` whose key an event at or after `since_ms` and
    before it set (`KEYING`), with the latest such key: message_id, sort_key.

    A message's events after a redrive, its last settling one if pending, are its new
    keys, so the latest of the settling events and the new keys is the keying event of a
    pending message, or says it is settled. Read for the messages the span keyed only:
    most spans key none.
    """
    keyed = ledger_tail(ledger_path, since_ms, ["message_id"], None, cutoff_ms, KEYING)
    if not keyed.num_rows:
        return _NO_KEYS
    ids = pc.unique(keyed.column("message_id")).to_pylist()
    events = (*SETTLING, LedgerEvent.RESCHEDULED)
    last = latest_events(ledger_path, since_ms, ids, cutoff_ms, events, ("sort_key",))
    pending = pc.and_(
        pc.is_in(last.column("event_last"), value_set=pa.array(KEYING, pa.string())),
        pc.is_valid(last.column("sort_key_last")),
    )
    last = last.filter(pending)
    return pa.table(
        [last.column("message_id"), last.column("sort_key_last")], schema=_NO_KEYS.schema
    )


def redrives_since(ledger_path: str, since_ms: int, ids: list[str]) -> list[str]:
    """Which of `ids` the ledger holds a redrive of at or after `since_ms`."""
    since = ledger_tail(ledger_path, since_ms, ["message_id"], ids, events=(LedgerEvent.REDRIVEN,))
    return since.column("message_id").to_pylist()


def retain(
    buffer_path: str,
    ledger_path: str,
    retention_ms: int,
    now_ms: int,
    unwritten_from_ms: int | None = None,
    dead_letter_path: str | None = None,
) -> RetentionRun | None:
    """Remove the messages settled before `now_ms - retention_ms` from the buffer, and
    give the rows of those pending then the keys the ledger gave them since the
    watermark (`new_keys`).

    `unwritten_from_ms`: the earliest `at` of events the caller has not yet written to
    the ledger; the cutoff stays a clock skew before it. Returns None when the cutoff
    has not moved past the watermark (or, with nothing to rewrite, not by a
    `WATERMARK_STEP_MS`). A run that rewrote rows vacuums the buffer's replaced files
    that are past the table's file retention. A commit that loses to a concurrent
    rewrite (a compaction, another run) is tried again from a fresh snapshot, up to
    `ATTEMPTS` times; then the error is raised.
    """
    started = time.monotonic()
    for attempt in range(1, ATTEMPTS + 1):
        try:
            done = _run(
                buffer_path, ledger_path, retention_ms, now_ms, unwritten_from_ms, dead_letter_path
            )
            break
        except CommitFailedError as e:
            refused_commit(buffer_path, e)
            if attempt == ATTEMPTS:
                raise
            log.info("retention of %s lost its commit (%s): trying again", buffer_path, e)
            time.sleep(random.uniform(0.05, 0.5))  # out of step with the writer it lost to
    if done is None:
        return None
    removed, rekeyed, rewritten, read, cutoff = done
    seconds = time.monotonic() - started
    run = RetentionRun(now_ms, cutoff, removed, rewritten, read, seconds, rekeyed)
    if rewritten:
        vacuum(buffer_path)
        log.info(
            "retention of %s: %d settled messages removed and %d given their new keys, "
            "from %d files in %.2f s",
            buffer_path,
            removed,
            rekeyed,
            rewritten,
            run.seconds,
        )
    return run


def _run(
    buffer_path: str,
    ledger_path: str,
    retention_ms: int,
    now_ms: int,
    unwritten_from_ms: int | None,
    dead_letter_path: str | None,
) -> tuple[int, int, int, int, int] | None:
    """One attempt: (rows removed, rows given a new key, files rewritten, messages read,
    new watermark).

    The buffer is opened again after the ledger is read, so the window in which an
    append makes the commit fail is the MERGE's alone. A dead message redriven while
    the run read and rewrote may have had its row restored-checked before the rewrite
    removed it (`restore` found the row still there): once the rewrite has landed, the
    run looks again and restores such rows from `dead_letter_path` (`_put_back`).

    That look, or its restore, can fail, or the process end before it: nothing of it is
    kept, the ledger is the record. The redrive lies past the new watermark, where a
    start reads the ledger (and takes the message from its dead letter), and the run
    whose span reaches it restores the rows of the span's redriven messages before it
    commits; if that fails, the run fails and the watermark stays.
    """
    upto = watermark(DeltaTable(buffer_path))
    cutoff = now_ms - retention_ms
    if unwritten_from_ms is not None:
        cutoff = min(cutoff, unwritten_from_ms - CLOCK_SKEW_MS)
    if cutoff <= upto:
        return None
    gone, read, died, redriven = settled_before(ledger_path, upto, cutoff)
    if redriven and dead_letter_path is not None:
        restore(buffer_path, dead_letter_path, redriven, now_ms)
    keys = new_keys(ledger_path, upto, cutoff)
    buffer = DeltaTable(buffer_path)
    if watermark(buffer) != upto:
        return None  # another run (a deposed leader's) moved it meanwhile
    if len(gone) or keys.num_rows:
        removed, rekeyed, rewritten = _rewrite(buffer, gone, keys, _commit(cutoff, len(gone)))
        if removed or rekeyed:
            if removed and died and dead_letter_path is not None:
                _put_back(buffer_path, ledger_path, dead_letter_path, cutoff, died, now_ms)
            return removed, rekeyed, rewritten, read, cutoff
        # None of them had a row here (settled before their rows came, say), or the rows
        # hold their new keys already: delta-rs commits nothing for a MERGE that changes
        # nothing, so the watermark moves alone.
    if cutoff - upto < WATERMARK_STEP_MS:  # alone, a minute at a time
        return None
    buffer.create_write_transaction(
        [], mode="append", schema=buffer.schema(), commit_properties=_commit(cutoff, 0)
    )
    return 0, 0, 0, read, cutoff


def _commit(cutoff: int, removing: int) -> CommitProperties:
    """A run's commit: the cutoff as the new watermark, and how many settled messages it
    removes, as `dejaq status` shows it."""
    return CommitProperties(
        app_transactions=[Transaction(APP_ID, cutoff)],
        custom_metadata={OPERATION: str(removing)},
    )


def _rewrite(
    buffer: DeltaTable, gone: pa.Array, keys: pa.Table, commit: CommitProperties
) -> tuple[int, int, int]:
    """Delete the rows of the ids `gone` from the buffer and give those of `keys` their
    new sort key, with `commit`: (rows removed, rows given a new key, files rewritten).

    A hash join of the buffer with the ids: only the files holding one are rewritten.
    Not streamed, so delta-rs derives the commit's read predicate from the ids' range
    and the ingest bound, and checks a concurrent append's files against it by their
    statistics: an append of rows ingested since the bound does not fail the commit.

    A new key sets the column the row's kind derives from its key, the one the ingest
    set (priority, deliver_at or event_time; the others stay null), and nothing else:
    the bucket, so the partition, is the message's, and `ingested_at` stays, which the
    ingest's bound and dedup read. The release job writes the key's header from
    `sort_key` (`pipelines.release.output_headers`), in place of the input's.
    """
    predicate = "t.message_id = s.message_id"
    bound = ingested_before(buffer)
    if bound is not None:
        predicate += f" AND t.ingested_at < '{iso_ms(bound)}'"
    merge = buffer.merge(
        source=_merge_source(gone, keys),
        predicate=predicate,
        source_alias="s",
        target_alias="t",
        streamed_exec=False,
        commit_properties=commit,
    ).when_matched_delete("s.sort_key IS NULL")
    if keys.num_rows:
        merge = merge.when_matched_update(
            {
                "sort_key": "s.sort_key",
                **{c: f"CASE WHEN t.{c} IS NULL THEN t.{c} ELSE s.{c} END" for c in KEYED},
            },
            "s.sort_key IS NOT NULL AND t.sort_key <> s.sort_key",
        )
    metrics = merge.execute()
    return (
        metrics["num_target_rows_deleted"],
        metrics["num_target_rows_updated"],
        metrics["num_target_files_removed"],
    )


def _merge_source(gone: pa.Array, keys: pa.Table) -> pa.Table:
    """The ids `gone` (a null key) and those of `keys`, with each key as the columns
    `KEYED` would hold it; a priority column only where the key fits one."""
    key = pa.concat_arrays(
        [pa.nulls(len(gone), pa.int64()), keys.column("sort_key").combine_chunks()]
    )
    fits = pc.and_(pc.greater_equal(key, -(2**31)), pc.less(key, 2**31))
    priority = pc.if_else(fits, key, None).cast(pa.int32())
    at = pc.multiply(key, 1000).cast(TIMESTAMP)
    ids = pa.concat_arrays([gone.cast(pa.string()), keys.column("message_id").combine_chunks()])
    return pa.table(
        {
            "message_id": ids,
            "sort_key": key,
            "priority": priority,
            "deliver_at": at,
            "event_time": at,
        }
    )


def ingested_before(buffer: DeltaTable) -> int | None:
    """A time (epoch ms) after every row of this snapshot was ingested: its files'
    largest `ingested_at`, a millisecond past (Delta keeps timestamp statistics in
    milliseconds). None when a file has no such statistic.

    The ingest stamps each batch with the time it began, so the batches that commit
    after the snapshot hold rows stamped since: a rewrite that reads only rows before
    this bound does not read their files.
    """
    adds = pa.table(buffer.get_add_actions(flatten=True))
    if not adds.num_rows or "max.ingested_at" not in adds.column_names:
        return None
    latest = adds.column("max.ingested_at").cast(TIMESTAMP)
    if latest.null_count:
        return None
    return pc.max(latest).value // 1000 + 1


def _put_back(
    buffer_path: str,
    ledger_path: str,
    dead_letter_path: str,
    cutoff_ms: int,
    died: list[str],
    now_ms: int,
) -> None:
    """Restore the rows of the dead a run removed that were redriven at or after its
    cutoff, once its rewrite has landed. A failure is logged, not raised: the rewrite has
    committed, and the run whose span reaches the redrive restores the row (`_run`)."""
    try:
        again = sorted(set(redrives_since(ledger_path, cutoff_ms, died)))
        restore(buffer_path, dead_letter_path, again, now_ms)
    except Exception:
        log.warning(
            "putting back the rows of messages redriven during a retention run of %s "
            "failed; the run that reaches their redrives does",
            buffer_path,
            exc_info=True,
        )


# A lock per buffer: a retention run's restore (after its rewrite) and a checkpoint's
# may find the same row missing at once, and each would append it.
_RESTORING: dict[str, threading.Lock] = {}
_RESTORING_GUARD = threading.Lock()


def _restoring(buffer_path: str) -> threading.Lock:
    with _RESTORING_GUARD:
        return _RESTORING.setdefault(buffer_path, threading.Lock())


def restore(buffer_path: str, dead_letter_path: str, ids: list[str], now_ms: int) -> int:
    """Append the dead letters of redriven `ids` whose buffer row retention has removed
    back to the buffer; returns how many.

    A pending message then has a buffer row once the watermark has passed its redrive:
    a start reads the buffer and the ledger from the watermark only, so a redrive older
    than the watermark would not be seen, and the message with it. The broker runs this
    before it trims the redrive from Raft, so a leader dying in between leaves the
    redrive for the next to restore; a retention run, before its watermark passes one.
    """
    if not ids:
        return 0
    with _restoring(buffer_path):  # a run's and a checkpoint's: one row per message
        return _restore(buffer_path, dead_letter_path, ids, now_ms)


def _restore(buffer_path: str, dead_letter_path: str, ids: list[str], now_ms: int) -> int:
    buffer = DeltaTable(buffer_path)
    held = scan(buffer, Table.BUFFER, ["message_id"], matching(Table.BUFFER, message_id=ids))
    missing = sorted(set(ids).difference(held.column("message_id").to_pylist()))
    if not missing:
        return 0
    wanted = matching(Table.DEAD_LETTER, message_id=missing)
    dead = first_per_id(scan(dead_letter_path, Table.DEAD_LETTER, where=wanted))
    ingested = pa.array([now_ms * 1000] * dead.num_rows, pa.int64()).cast(TIMESTAMP)
    columns = {f.name: ingested if f.name == "ingested_at" else dead[f.name] for f in BUFFER_SCHEMA}
    rows = pa.table(columns).cast(BUFFER_SCHEMA)
    partition_by = buffer.metadata().partition_columns
    commit = CommitProperties(custom_metadata={RESTORED: str(rows.num_rows)})
    write_deltalake(
        buffer, rows, mode="append", partition_by=partition_by or None, commit_properties=commit
    )
    if dead.num_rows < len(missing):
        log.warning(
            "%d redriven messages have neither a buffer row nor a dead letter: %s",
            len(missing) - dead.num_rows,
            sorted(set(missing).difference(dead.column("message_id").to_pylist()))[:10],
        )
    return dead.num_rows


def expire_quarantine(path: str, retention_ms: int, now_ms: int) -> int:
    """Delete the quarantine's rows quarantined more than `retention_ms` before `now_ms`;
    how many. It takes every record that could not be buffered, so it would otherwise
    grow with the topic's history of bad records. Only the files whose statistics say
    they hold such rows are rewritten; with none, nothing is committed."""
    table = DeltaTable(path)
    cutoff = now_ms - retention_ms
    adds = pa.table(table.get_add_actions(flatten=True))
    if "min.quarantined_at" in adds.column_names:
        oldest = pc.min(adds.column("min.quarantined_at").cast(TIMESTAMP)).value
        if oldest is None or oldest >= cutoff * 1000:
            return 0
    elif not adds.num_rows:
        return 0
    metrics = table.delete(f"quarantined_at < '{iso_ms(cutoff)}'")
    return int(metrics.get("num_deleted_rows", 0))


def is_rewrite(commit: dict) -> bool:
    """Whether a commit's `commitInfo` says it is a retention run, a compaction or a
    seal, whose added files hold only rows the table had before, or a `restore`, whose
    rows are of redriven messages every node indexes from their redrive (`revive`): a
    node reading one only after such a message was settled and forgotten would index
    it as pending again."""
    return commit.get("operation") == "OPTIMIZE" or any(
        tag in commit for tag in (OPERATION, COMPACTED, SEALED, RESTORED)
    )


class LogGap(Exception):
    """The table's log no longer holds commits a follower has not read: it was further
    behind than the table keeps its log (`conf.tables.LOG_RETENTION`)."""


@dataclass(frozen=True)
class Added:
    """A file a commit adds, as its own log entry says: a follower walking the versions
    it missed learns what to read from the entries it reads anyway, not from a snapshot
    of each version (a listing, a checkpoint and every file's add action apiece)."""

    path: str  # relative and percent-encoded, as `DeltaTable.get_add_actions` gives it
    partition: dict[str, str | None]  # the log's strings, not typed values
    rows: int | None  # `numRecords`, where the file has statistics
    max_values: dict[str, Any]  # the statistics' `maxValues`, as the log writes them


@dataclass(frozen=True)
class Commit:
    """One version of a table: whether it is a rewrite (`commits`), and its files."""

    version: int
    rewrite: bool
    adds: list[Added]


def commits(table_path: str, versions: range) -> list[Commit]:
    """Each of `versions` from its own log entry, one read apiece: whether it is a
    rewrite (`is_rewrite`, or every file it adds marked `dataChange: false`) and the
    files it adds; `LogGap` if the log no longer holds one, or if one replaced files
    untagged (a DELETE, UPDATE or RESTORE made by hand): which of its rows are new
    cannot be told from the log.

    Not `DeltaTable.history`: delta-rs 1.6 reads the newest commits of the log but
    numbers them down from the version the table object is at, so a table that gained
    a commit meanwhile gets every label shifted by one.
    """
    fs, root = filesystem(table_path)
    found = []
    for v in versions:
        actions = log_actions(fs, root, v)
        if actions is None:
            raise LogGap(
                f"{table_path}'s Delta log no longer holds version {v}, which this reader"
                f" has not read (a table keeps its log {LOG_RETENTION.removeprefix('interval ')}):"
                " a start reads the table afresh"
            )
        info = next((a["commitInfo"] for a in actions if "commitInfo" in a), {})
        adds = [a["add"] for a in actions if "add" in a]
        changed = [add.get("dataChange", True) for add in adds]
        rewrite = is_rewrite(info) or bool(changed and not any(changed))
        if not rewrite and any(changed) and any("remove" in a for a in actions):
            raise LogGap(
                f"version {v} of {table_path} replaced files without a DejaQ rewrite's tag "
                f"({info.get('operation', 'an operation')} made by hand?), so which of its "
                "rows are new cannot be told: a start reads the table afresh"
            )
        found.append(Commit(v, rewrite, [_added(add) for add in adds]))
    return found


def _added(add: dict) -> Added:
    stats = json.loads(add.get("stats") or "{}")
    return Added(
        add["path"],
        add.get("partitionValues") or {},
        stats.get("numRecords"),
        stats.get("maxValues") or {},
    )
