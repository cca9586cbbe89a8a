"""Checkpoint settled messages from the Raft state into `ledger/<topic>` and dead letters.

The leader writes the events up to sequence number N as one Delta commit tagged with
the transaction (app id, N), then commits `trim(N)` through Raft, which drops them from
the replicated state. A leader that dies between the two leaves the tag behind, and
its successor sees the tag and only trims: the ledger never gets a row twice.
"""

from __future__ import annotations

import datetime as dt

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from dejaq.broker.leases import Settlement
from dejaq.conf.tables import (
    DEAD_LETTER_SCHEMA,
    LEDGER_SCHEMA,
    TIMESTAMP,
    LedgerEvent,
    Table,
    ensure_table,
)
from dejaq.pipelines.compaction import LEDGER_FILE_BYTES, Compacted, maintain

APP_ID = "dejaq-broker"
# Checkpoints between compactions of a ledger. Each checkpoint adds a file, about one a
# second under load, and a node's start reads the files holding the ledger's tail.
COMPACT_EVERY = 30


CONVERT_SLICE = 4096  # events per Arrow conversion: the event loop waits ~1 ms at most

# A `Settlement` in Arrow, field for field.
SETTLEMENT = pa.struct(
    [
        ("seq", pa.int64()),
        ("message_id", pa.string()),
        ("bucket", pa.int32()),
        ("event", pa.string()),
        ("sort_key", pa.int64()),
        ("deliveries", pa.int32()),
        ("at", pa.int64()),  # epoch ms
        ("reason", pa.string()),
    ]
)


def _ts(ms: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)


def _written(path: str) -> int:
    return DeltaTable(path).transaction_version(APP_ID) or 0


def _commit(upto: int) -> CommitProperties:
    return CommitProperties(app_transactions=[Transaction(APP_ID, upto)])


def checkpoint(warehouse: str, topic: str, events: list[Settlement]) -> int:
    """Write `events` (ascending seq) to the ledger and dead letters; return the last seq.

    The events become Arrow in C, a slice at a time: a conversion holds the GIL it shares
    with the event loop, and all of a checkpoint's tens of thousands at once kept
    requests and heartbeats waiting ~15 ms.
    """
    upto = events[-1].seq
    ledger = ensure_table(warehouse, Table.LEDGER, topic)
    dead_path = ensure_table(warehouse, Table.DEAD_LETTER, topic)
    settled = pa.Table.from_batches(
        [
            pa.RecordBatch.from_struct_array(pa.array(events[i : i + CONVERT_SLICE], SETTLEMENT))
            for i in range(0, len(events), CONVERT_SLICE)
        ]
    )
    if pc.any(pc.equal(settled["event"], LedgerEvent.DEAD)).as_py() and (
        _written(dead_path) < upto
    ):
        dead = [e for e in events if e.event == LedgerEvent.DEAD]
        rows = _dead_letters(warehouse, topic, dead)
        write_deltalake(dead_path, rows, mode="append", commit_properties=_commit(upto))
    table = DeltaTable(ledger)  # opened once: for its transaction version and to write
    if (table.transaction_version(APP_ID) or 0) < upto:
        at = pc.multiply(settled["at"], 1000).cast(TIMESTAMP)
        columns = {f: at if f == "at" else settled[f] for f in LEDGER_SCHEMA.names}
        rows = pa.table(columns, schema=LEDGER_SCHEMA)
        write_deltalake(table, rows, mode="append", commit_properties=_commit(upto))
    return upto


def compact_ledger(warehouse: str, topic: str) -> Compacted | None:
    """Rewrite the ledger's small files into files of `LEDGER_FILE_BYTES` (and vacuum
    old ones); a failure (a deposed leader's late write, say) is logged and the next round retries.

    The leader is the ledger's only writer (one topic, one deliverer), and compacts it
    between its own checkpoints, as delta-rs compaction requires. Transaction versions
    survive it, so a checkpoint replayed later is still skipped.
    """
    return maintain(ensure_table(warehouse, Table.LEDGER, topic), LEDGER_FILE_BYTES)


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
