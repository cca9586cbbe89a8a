"""Checkpoint settled messages from the Raft state into `ledger/<topic>` and dead letters.

The leader writes the events up to sequence number N as one Delta commit tagged with
the transaction (app id, N), then commits `trim(N)` through Raft, which drops them from
the replicated state. A leader that dies between the two leaves the tag behind, and
its successor sees the tag and only trims: the ledger never gets a row twice.
"""

from __future__ import annotations

import datetime as dt
from operator import attrgetter

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from broker.leases import Settlement
from conf.tables import (
    DEAD_LETTER_SCHEMA,
    LEDGER_SCHEMA,
    TIMESTAMP,
    LedgerEvent,
    Table,
    ensure_table,
)
from pipelines.compaction import Compacted, maintain

APP_ID = "dejaq-broker"
# Checkpoints between compactions of a ledger. Each checkpoint adds a file, about one a
# second under load; every node reads the whole ledger on start.
COMPACT_EVERY = 30


_FIELDS = ("message_id", "bucket", "event", "sort_key", "deliveries", "at")


def _ts(ms: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)


def _written(path: str) -> int:
    return DeltaTable(path).transaction_version(APP_ID) or 0


def _commit(upto: int) -> CommitProperties:
    return CommitProperties(app_transactions=[Transaction(APP_ID, upto)])


def checkpoint(warehouse: str, topic: str, events: list[Settlement]) -> int:
    """Write `events` (ascending seq) to the ledger and dead letters; return the last seq.

    Each column is gathered by a C loop: a checkpoint holds tens of thousands of events,
    and its thread shares the GIL with the event loop.
    """
    upto = events[-1].seq
    ledger = ensure_table(warehouse, Table.LEDGER, topic)
    dead_path = ensure_table(warehouse, Table.DEAD_LETTER, topic)
    mids, buckets, kinds, keys, deliveries, ats = (
        list(map(attrgetter(field), events)) for field in _FIELDS
    )
    if LedgerEvent.DEAD in kinds and _written(dead_path) < upto:
        dead = [e for e in events if e.event == LedgerEvent.DEAD]
        rows = _dead_letters(warehouse, topic, dead)
        write_deltalake(dead_path, rows, mode="append", commit_properties=_commit(upto))
    table = DeltaTable(ledger)  # opened once: for its transaction version and to write
    if (table.transaction_version(APP_ID) or 0) < upto:
        rows = pa.table(
            {
                "message_id": pa.array(mids, pa.string()),
                "bucket": pa.array(buckets, pa.int32()),
                "event": pa.array(kinds, pa.string()),
                "sort_key": pa.array(keys, pa.int64()),
                "deliveries": pa.array(deliveries, pa.int32()),
                "at": pc.multiply(pa.array(ats, pa.int64()), 1000).cast(TIMESTAMP),
            },
            schema=LEDGER_SCHEMA,
        )
        write_deltalake(table, rows, mode="append", commit_properties=_commit(upto))
    return upto


def compact_ledger(warehouse: str, topic: str) -> Compacted | None:
    """Rewrite the ledger's small files into one (and vacuum old ones); a
    failure (a deposed leader's late write, say) is logged and the next round retries.

    The leader is the ledger's only writer (one topic, one deliverer), and compacts it
    between its own checkpoints, as delta-rs compaction requires. Transaction versions
    survive it, so a checkpoint replayed later is still skipped.
    """
    return maintain(ensure_table(warehouse, Table.LEDGER, topic))


def _dead_letters(warehouse: str, topic: str, dead: list[Settlement]) -> pa.Table:
    """The buffer rows of the dead messages, with deliveries, reason and time of death."""
    buffer = DeltaTable(ensure_table(warehouse, Table.BUFFER, topic)).to_pyarrow_dataset()
    by_id = {e.message_id: e for e in dead}
    found = buffer.to_table(filter=pc.field("message_id").isin(list(by_id)))
    out: list[dict] = []
    seen: set[str] = set()
    for row in found.to_pylist():
        e = by_id[row["message_id"]]
        if e.message_id in seen:
            continue
        seen.add(e.message_id)
        row.pop("ingested_at", None)
        row.update(deliveries=e.deliveries, reason=e.reason or "dead", dead_at=_ts(e.at))
        out.append(row)
    return pa.Table.from_pylist(out, schema=DEAD_LETTER_SCHEMA)
