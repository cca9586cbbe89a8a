"""Checkpoint settled messages from the Raft state into `ledger/<topic>` and dead letters.

The leader writes the events up to sequence number N as one Delta commit tagged with
the transaction (app id, N), then commits `trim(N)` through Raft, which drops them from
the replicated state. A leader that dies between the two leaves the tag behind, and
its successor sees the tag and only trims: the ledger never gets a row twice.

The state names settled messages by handle (`broker.state.settlements`): the writer asks
the leader for their ids (`Names`, its index's), and writes the events up to the first
it cannot name yet (a new leader whose index has not read that row), which waits for
the next checkpoint: never a row with a wrong id.
"""

from __future__ import annotations

import datetime as dt
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from dejaq_core import AckRun
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake.exceptions import CommitFailedError

from dejaq.broker.state.handles import WIDTH, mh, packed_handles
from dejaq.broker.state.settlements import (
    Entry,
    Events,
    Settlement,
    count,
    entries_of,
    last,
    past,
    settlements,
)
from dejaq.conf.table_features import refused_commit
from dejaq.conf.tables import (
    APPEND_PROPERTIES,
    BROKER_APP_ID,
    DEAD_LETTER_SCHEMA,
    LEDGER_SCHEMA,
    TIMESTAMP,
    LedgerEvent,
    Table,
    ensure_table,
    matching,
    scan,
)
from dejaq.pipelines.compaction import Compacted
from dejaq.pipelines.log_compaction import maintain_log

APP_ID = BROKER_APP_ID
# A ledger commit's last event, "<seq> <event> <message id>": which Raft history wrote
# the tag, where a state's own event at that seq differs.
LAST = "dejaq.last"
# Checkpoints between compactions of a ledger. Each checkpoint adds a file, about one a
# second under load, and a node's start reads the files holding the ledger's tail.
COMPACT_EVERY = 30


# Attempts at one checkpoint's commit, each refused because another writer's commit of
# the same tag came first (`_append_tagged`), before it fails.
COMMIT_ATTEMPTS = 3
# Ledger commits `foreign` reads back for the one tagged with a seq: a checkpoint a
# second, and a compaction each `COMPACT_EVERY`, leave it among the last few.
HISTORY_LOOKBACK = 100
CONVERT_SLICE = 4096  # events per Arrow conversion, ~0.3 ms holding the GIL


def _ts(ms: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)


# The ids of the messages whose handles a bytes object packs, in their order, null or
# None for each this node cannot name: an Arrow string column (the leader's index,
# `TopicIndex.id_column`), or a list.
Names = Callable[[bytes], pa.ChunkedArray | list[str | None]]


def id_list(ids: pa.ChunkedArray | list[str | None]) -> list[str | None]:
    """What `Names` gave, as a list."""
    return ids if type(ids) is list else ids.to_pylist()


class Rows(NamedTuple):
    """What a tagged commit appends: its rows, the last seq they hold (its tag), and
    the commit's metadata."""

    table: pa.Table
    upto: int
    metadata: dict[str, str] | None = None


class Unnamed(Exception):
    """Deaths whose messages neither the leader's index nor the ledger names: their dead
    letters wait, kept in Raft (`checkpoints.checkpoint`)."""

    def __init__(self, seqs: list[int]) -> None:
        super().__init__(f"the messages of the deaths of seqs {seqs[:10]} cannot be named here")
        self.seqs = seqs


# A Raft history (`TopicState.history`) and the last of its seqs the ledger held when it
# began.
History = tuple[str, int]


def app_id(history: str) -> str:
    """The tables' app transaction for a Raft history (`TopicState.history`), its
    version the last seq written: "" is the history every state began in."""
    return f"{APP_ID}:{history}" if history else APP_ID


class Claimed(Exception):
    """The ledger's tag claims events past the state's last trim: a checkpoint whose
    trim a leader change lost, or a tag written by another Raft history (the nodes'
    data folders replaced, or the journal's last commands lost), whose seqs name other
    events. The leader tells them apart (`foreign`) before it writes."""

    def __init__(self, done: int) -> None:
        super().__init__(f"the ledger's tag {done} is past the state's last trim")
        self.done = done


class Contested(Exception):
    """Another cluster writes the ledger: the tags of the history this state replaced
    (`TopicState.replaced`) move on, so a second cluster over the warehouse checkpoints
    the topic beside this one."""

    def __init__(self, app: str, since: int, now: int) -> None:
        super().__init__(f"the tag {app} moved from {since} to {now}")
        self.app, self.since, self.now = app, since, now


@dataclass
class Rival:
    """The app transaction of the tags a new history replaced, watched at each
    checkpoint (`Contested` once it moves on). One move is let pass: a deposed leader
    of this cluster may write one late checkpoint under the history its successor left.
    Only a tag that keeps moving is another live cluster's."""

    app: str
    origin: int  # its version when the history was replaced
    seen: int = -1  # the last version read, -1 before any
    moved: bool = False

    def check(self, table: DeltaTable) -> None:
        """Raises `Contested` once the tag has moved twice since `origin`."""
        version = table.transaction_version(self.app) or 0
        last = self.origin if self.seen < 0 else self.seen
        self.seen = version
        if version == last:
            return
        if self.moved:
            raise Contested(self.app, self.origin, version)
        self.moved = True


def tag_of(warehouse: str, topic: str, app: str) -> tuple[int, float]:
    """The ledger's tag for `app`, and the age in seconds of the ledger's newest commit
    by this node's clock."""
    table = DeltaTable(ensure_table(warehouse, Table.LEDGER, topic))
    newest = table.history(1)
    at_ms = newest[0].get("timestamp", 0) if newest else 0
    return table.transaction_version(app) or 0, time.time() - at_ms / 1000


def checkpoint(
    warehouse: str, topic: str, events: Events, names: Names, history: History = ("", 0)
) -> int:
    """Write `events` (ascending seq) to the ledger, then the dead letters of those
    written; return the last seq written (short of the last event where `names` cannot
    name one). The leader runs the two steps apart, to go on trimming while dead letters
    fail (`broker.service`)."""
    entries = entries_of(events)
    upto = write_ledger(warehouse, topic, entries, names, history)
    write_dead_letters(warehouse, topic, up_to(entries, upto), names, history)
    return upto


def up_to(entries: list[Entry], seq: int) -> list[Entry]:
    """The entries of `entries` (ascending seqs) up to `seq`, the last cut there."""
    out = [e for e in entries if e.seq <= seq]
    if out and last(out[-1]) > seq:
        out[-1] = out[-1].part(out[-1].seq, seq + 1)
    return out


def _is_event(theirs: str, entries: list[Entry]) -> bool:
    """Whether `LAST`'s form of an event ("<seq> <event> <message id>") is the event of
    its seq among `entries`, its message compared by handle."""
    seq, event, mid = theirs.split(" ", 2)
    for e in settlements(past(entries, int(seq) - 1)):
        return e.seq == int(seq) and e.event == event and e.mh == mh(mid)
    return False


def _mark(entries: list[Entry], ids: pa.ChunkedArray) -> str:
    """`LAST`'s form of the last event of `entries`, whose ids are `ids`."""
    return f"{last(entries[-1])} {entries[-1].event} {ids[len(ids) - 1].as_py()}"


def _handles(e: Entry) -> bytes:
    """The handles of `e`'s messages, packed."""
    return e.mh.to_bytes(WIDTH, "little") if type(e) is Settlement else e.handles


def _named(entries: list[Entry], names: Names) -> tuple[list[Entry], pa.ChunkedArray]:
    """The events of `entries` up to the first whose message `names` cannot name (all,
    if it names every one; a run holding it cut there), and their ids, in order, as an
    Arrow string column."""
    if not entries:
        return entries, pa.chunked_array([], pa.string())
    ids = names(b"".join(map(_handles, entries)))
    ids = _arrow(ids, pa.string()) if type(ids) is list else ids
    if not ids.null_count:
        return entries, ids
    first = n = pc.index(pc.is_null(ids), True).as_py()
    for e in entries:
        if n < count(e):
            return up_to(entries, e.seq + n - 1), ids.slice(0, first)
        n -= count(e)
    raise AssertionError("names gave more names than handles")


def foreign(
    warehouse: str, topic: str, events: Events, trimmed: int, done: int, seq: int
) -> int | None:
    """None if the ledger's last checkpoints, up to its tag `done`, are this state's
    (last seq `seq`), else the last seq of this state's the ledger holds: a
    checkpoint's last event (`LAST`), newest first, is compared with this state's event
    of its seq until one matches or was trimmed here. Call it once the state has
    applied every committed entry: a new leader still applying its predecessor's would
    lack events the ledger holds. Where no commit carries `LAST` (all from before it),
    a tag past `seq` is another history's."""
    entries = entries_of(events)
    table = DeltaTable(ensure_table(warehouse, Table.LEDGER, topic))
    differed = False
    for commit in table.history(HISTORY_LOOKBACK):
        theirs = commit.get(LAST)
        if not isinstance(theirs, str):
            continue
        written = int(theirs.split(" ", 1)[0])
        if written <= trimmed or _is_event(theirs, entries):
            return max(written, trimmed) if differed else None
        differed = True
    return trimmed if differed or done > seq else None


def write_ledger(
    warehouse: str,
    topic: str,
    events: Events,
    names: Names,
    history: History = ("", 0),
    trimmed: int | None = None,
    rival: Rival | None = None,
) -> int:
    """Write `events` (ascending seq) past the ledger's tag to it, up to the first whose
    message `names` cannot name; return the last seq the ledger holds of them. Raises
    `Claimed` where the tag is past `trimmed` (the state's last trim), if given, and
    `Contested` where `rival`'s tag keeps moving, before writing.

    The table is tagged with the last seq it holds and gets only the events past it, so
    a checkpoint after one whose trim was lost (a leader change) writes no row twice.
    The columns become Arrow in C, a slice at a time, each slice then offering the GIL
    back (`_arrow`): a conversion holds the GIL it shares with the event loop, and all
    of a checkpoint's tens of thousands at once kept requests and heartbeats waiting
    ~15 ms.
    """
    entries = entries_of(events)

    def rows_past(written: int) -> Rows | None:
        named, ids = _named(past(entries, written), names)
        if not named:
            return None
        # One batch: the writer takes batches in no set order, and the ledger's rows
        # stay in seq order (each column's chunks are cut differently).
        columns = _ledger_columns(named, ids)
        rows = pa.table(columns, schema=LEDGER_SCHEMA).combine_chunks()
        return Rows(rows, last(named[-1]), {LAST: _mark(named, ids)})

    path = ensure_table(warehouse, Table.LEDGER, topic)
    return _append_tagged(path, history, last(entries[-1]), rows_past, trimmed, rival)


def _append_tagged(
    path: str,
    history: History,
    upto: int,
    rows_past: Callable[[int], Rows | None],
    trimmed: int | None = None,
    rival: Rival | None = None,
) -> int:
    """Append `rows_past(tag)` to the table at `path` in a commit tagged with the last
    seq they hold (at most `upto`) for `history`'s app transaction, unless its tag (at
    least the seq the history began at) already reaches `upto`; returns the seq the
    table holds then, at most `upto`. `Claimed` where the tag is past `trimmed`, if
    given; `rival` checked on the snapshot read anyway.

    The tag and the write share one snapshot: a writer whose snapshot is older than
    another's commit of the same app id (a deposed leader's late checkpoint, made after
    its successor's) is refused by delta-rs as a concurrent transaction instead of
    adding rows twice. The refused writer reads a new snapshot and decides again: its
    successor's commit mostly holds its events already, and it writes nothing and
    raises nothing (a failure would be logged and counted as one, and alert nobody
    usefully).
    """
    attempt = 0
    while True:
        attempt += 1
        table = DeltaTable(path)
        if rival is not None:
            rival.check(table)
        app = app_id(history[0])
        tag = table.transaction_version(app) or 0
        if trimmed is not None and tag > trimmed:
            raise Claimed(tag)
        done = max(tag, history[1])
        if done >= upto:
            return upto
        rows = rows_past(done)
        if rows is None:
            return done
        commit = CommitProperties(
            app_transactions=[Transaction(app, rows.upto)], custom_metadata=rows.metadata
        )
        try:
            write_deltalake(
                table,
                rows.table,
                mode="append",
                commit_properties=commit,
                writer_properties=APPEND_PROPERTIES,
            )
            return rows.upto
        except CommitFailedError as e:
            refused_commit(path, e)
            if attempt == COMMIT_ATTEMPTS:
                raise


def _ledger_columns(
    entries: list[Entry], ids: pa.ChunkedArray
) -> dict[str, pa.ChunkedArray | pa.Array]:
    """The ledger's columns of `entries`, in their order; `ids`: their messages', as the
    leader's index names them. A run's packed columns (`LeaseRecord`) are joined by
    NumPy, without an int object per event; its event and time are repeated from one
    value (an `AckRun`'s time is a column too)."""
    lengths = list(map(count, entries))
    names: dict[str, int] = {}
    codes = np.array([names.setdefault(e.event, len(names)) for e in entries], np.int32)
    events = pa.array(list(names), pa.string()).take(pa.array(np.repeat(codes, lengths)))
    ms = pa.array(_times(entries, lengths))
    bucket, sort_key, deliveries = _int_columns(entries)
    return {
        "message_id": ids,
        "bucket": bucket,
        "event": events,
        "sort_key": sort_key,
        "deliveries": deliveries,
        "at": pc.multiply(ms, 1000).cast(TIMESTAMP),
    }


def _times(entries: list[Entry], lengths: list[int]) -> np.ndarray:
    """Each event's time, ms: a settlement's or a run's one for all its events, an
    `AckRun`'s from its column of each ack's."""
    ms = np.repeat(np.array([e.at for e in entries], np.int64), lengths)
    ends = np.cumsum(lengths)
    for i, e in enumerate(entries):
        if type(e) is AckRun:
            ms[ends[i] - lengths[i] : ends[i]] = e.ats
    return ms


_INT_KINDS = (pa.int32(), pa.int64(), pa.int32())  # bucket, sort_key, deliveries


def _int_columns(entries: list[Entry]) -> list[pa.ChunkedArray]:
    """Bucket, sort key and deliveries of `entries`: a stretch of runs joined from their
    packed columns (`_joined`), a stretch of single settlements (whose sort key may be
    null) converted from a list; one Arrow chunk per stretch."""
    chunks: list[list[pa.Array]] = [[], [], []]
    loose: list[list[int | None]] = [[], [], []]
    packed: list[list[Sequence[int]]] = [[], [], []]

    def close() -> None:
        for column, values, kind in zip(chunks, loose, _INT_KINDS, strict=True):
            if values:
                column.append(pa.array(values, kind))
                values.clear()
        for column, parts, kind in zip(chunks, packed, _INT_KINDS, strict=True):
            if parts:
                column.append(pa.array(_joined(parts)).cast(kind))
                parts.clear()

    for e in entries:
        if type(e) is Settlement:
            if packed[0]:
                close()
            loose[0].append(e.bucket)
            loose[1].append(e.sort_key)
            loose[2].append(e.deliveries)
        else:
            if loose[0]:
                close()
            packed[0].append(e.buckets)
            packed[1].append(e.sort_keys)
            packed[2].append(e.deliveries)
    close()
    return [pa.chunked_array(c, kind) for c, kind in zip(chunks, _INT_KINDS, strict=True)]


def _joined(parts: list[Sequence[int]]) -> np.ndarray:
    """Runs' packed columns as one: their bytes joined in one call when all are arrays
    of one type (a run's own), else by NumPy (lists, from old snapshots): a NumPy view
    of each of a checkpoint's thousands of runs cost more than the rest of the column."""
    codes = {p.typecode if type(p) is array else "" for p in parts}
    if len(codes) == 1 and "" not in codes:
        return np.frombuffer(b"".join(parts), codes.pop())
    return np.concatenate([np.asarray(p) for p in parts])


def _arrow(values: list | np.ndarray, kind: pa.DataType) -> pa.ChunkedArray:
    """`values` as Arrow, converted a slice at a time, with the GIL offered to the event
    loop after each rather than left to the switch interval: without the offer, a
    second's checkpoint added 4-5 ms to the batch-100 lease p99 (`bench/broker.py`)."""
    chunks = []
    for i in range(0, len(values), CONVERT_SLICE):
        chunks.append(pa.array(values[i : i + CONVERT_SLICE], kind))
        time.sleep(0)  # releases the GIL: a waiting thread takes it here
    return pa.chunked_array(chunks, kind)


def deaths(events: Events) -> list[Settlement]:
    """The events of `events` that need a dead letter."""
    dead = [e for e in entries_of(events) if e.event == LedgerEvent.DEAD]
    return list(settlements(dead))


def write_dead_letters(
    warehouse: str, topic: str, events: Events, names: Names, history: History = ("", 0)
) -> None:
    """Write the dead letters of the deaths among `events` past the table's tag, tagged
    with the last seq of `events`. Raises if a dead message's row cannot be read, or
    its message named (`Unnamed`)."""
    entries = entries_of(events)
    dead = deaths(entries)
    if not dead:
        return
    upto = last(entries[-1])

    def rows_past(done: int) -> Rows | None:
        left = [e for e in dead if e.seq > done]
        return Rows(_dead_letters(warehouse, topic, left, names), upto) if left else None

    # From the history's first seq, not the seq it began past: deaths a trim kept (their
    # dead letters failed) lie below that, and were written under no tag.
    path = ensure_table(warehouse, Table.DEAD_LETTER, topic)
    _append_tagged(path, (history[0], 0), upto, rows_past)


def compact_ledger(warehouse: str, topic: str, tail_ms: int) -> Compacted | None:
    """Compact the ledger's small files, seal its files past `tail_ms` and vacuum old
    ones (`pipelines.log_compaction`); a failure (a deposed leader's round beside its
    successor's, say) is logged and the next round retries.

    The leader is the ledger's only writer (one topic, one deliverer), and compacts it
    between its own checkpoints. Transaction versions survive it, so a checkpoint
    replayed later is still skipped.
    """
    return maintain_log(ensure_table(warehouse, Table.LEDGER, topic), "at", tail_ms)


def compact_dead_letters(warehouse: str, topic: str, tail_ms: int) -> Compacted | None:
    """`compact_ledger` of the dead letters, which the leader alone appends to as well:
    a file at each checkpoint with a death, and every open of the table (each such
    checkpoint, a restore, a listing page) reads every file's entry."""
    return maintain_log(ensure_table(warehouse, Table.DEAD_LETTER, topic), "dead_at", tail_ms)


def _dead_letters(warehouse: str, topic: str, dead: list[Settlement], names: Names) -> pa.Table:
    """The buffer rows of the dead messages, with deliveries, reason and time of death."""
    by_id = dict(zip(_death_ids(warehouse, topic, dead, names), dead, strict=True))
    buffer = ensure_table(warehouse, Table.BUFFER, topic)
    found = scan(buffer, Table.BUFFER, where=matching(Table.BUFFER, message_id=by_id))
    out: list[dict] = []
    seen: set[str] = set()
    for row in found.to_pylist():
        mid = row["message_id"]
        e = by_id[mid]
        if mid in seen:
            continue
        seen.add(mid)
        row.pop("ingested_at", None)
        row.update(deliveries=e.deliveries, reason=e.reason or "dead", dead_at=_ts(e.at))
        out.append(row)
    return pa.Table.from_pylist(out, schema=DEAD_LETTER_SCHEMA)


def _death_ids(warehouse: str, topic: str, dead: list[Settlement], names: Names) -> list[str]:
    """The ids of the dead messages: `names`', else the ledger's, which holds every
    death before its dead letter is written. A node's index no longer holds the row of
    a death the ledger has settled when it loaded or rebuilt (`TopicIndex.load`), so a
    death whose dead letter failed is named by its ledger row: a dead event at its time,
    whose id hashes to its handle. Raises `Unnamed` for any named by neither."""
    ids = id_list(names(packed_handles([e.mh for e in dead])))
    unnamed = [e for e, mid in zip(dead, ids, strict=True) if mid is None]
    if unnamed:
        at = matching(Table.LEDGER, event=[LedgerEvent.DEAD], at={_ts(e.at) for e in unnamed})
        rows = scan(ensure_table(warehouse, Table.LEDGER, topic), Table.LEDGER, ["message_id"], at)
        ledger = rows.column("message_id").to_pylist()
        by_handle = dict(zip(map(mh, ledger), ledger, strict=True))
        ids = [
            by_handle.get(e.mh) if mid is None else mid for e, mid in zip(dead, ids, strict=True)
        ]
        if missing := [e.seq for e, mid in zip(dead, ids, strict=True) if mid is None]:
            raise Unnamed(missing)
    return ids  # type: ignore[return-value]
