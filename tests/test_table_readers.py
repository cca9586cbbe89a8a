"""Every reader of a table gets the contract's types, whatever wrote its files.

One buffer table is written by each of its writers in turn: a Spark append, a delta-rs
append, a delta-rs compaction, a retention run's MERGE and a redrive's restore. The
MERGE and the compaction store strings as Arrow string views, the appends as plain
strings; a filter over such files once failed in Arrow's statistics check ("no kernel
matching input types (string, string_view)"), and the ledger's checkpoints with it.
Then each reader reads the mixed files: the index's load, refresh and revive, the
checkpoint's dead-letter look-up, the restore, the release job's follower, `status`,
and Spark SQL over both Delta connectors (the notebook's reads).
"""

from __future__ import annotations

import base64
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from chispa import assert_df_equality
from conftest import buffer_names
from deltalake import DeltaTable
from pyspark.sql import SparkSession
from test_broker import buffer_rows, fill, topic_conf
from test_delta_engines import spark_append

from dejaq.broker.state.handles import mh
from dejaq.broker.state.leases import TopicState
from dejaq.broker.storage.index import TopicIndex
from dejaq.broker.storage.ledger_writer import checkpoint, compact_ledger
from dejaq.conf.tables import (
    BUFFER_SCHEMA,
    LEDGER_SCHEMA,
    LedgerEvent,
    Table,
    ensure_table,
    matching,
    scan,
)
from dejaq.jobs.status import row_count
from dejaq.pipelines.compaction import compact
from dejaq.pipelines.delta_follower import DeltaFollower
from dejaq.pipelines.retention import latest_events, restore, retain, split

HOUR_MS = 3_600_000


def string_types(path: str) -> set[str]:
    """The Arrow types the table's current files store `message_id` as."""
    return {
        str(pq.read_schema(uri).field("message_id").type) for uri in DeltaTable(path).file_uris()
    }


def settle(
    warehouse: str, state: TopicState, index: TopicIndex, mids: list[str], how: str, at: int = 0
) -> None:
    """Lease `mids` as consumer "c" and ack or reject them, checkpointed to the ledger."""
    rows = [(mid, index.row(mid)) for mid in mids]
    picks = [(mid, row.bucket, row.sort_key) for mid, row in rows if row is not None]
    state.lease("c", at, 1000, picks)
    settled = state.ack("c", at + 1, mids) if how == "ack" else state.reject("c", at + 1, mids)
    assert settled == {}
    index.forget(
        state.trim(checkpoint(warehouse, "jobs", list(state.events), buffer_names(warehouse)))
    )


def test_every_reader_gets_the_contract_from_every_writer(
    spark: SparkSession, tmp_path: Path
) -> None:
    warehouse = str(tmp_path / "wh")
    buffer = ensure_table(warehouse, Table.BUFFER, "jobs")
    ledger = ensure_table(warehouse, Table.LEDGER, "jobs")
    dead_letters = ensure_table(warehouse, Table.DEAD_LETTER, "jobs")
    spark_append(spark, buffer_rows(list(range(10)), prefix="s"), buffer, "ingest", 0)
    fill(warehouse, "jobs", buffer_rows(list(range(10)), prefix="r"))
    compact(buffer)
    fill(warehouse, "jobs", buffer_rows(list(range(10)), prefix="x"))
    index = TopicIndex(warehouse, topic_conf())
    index.load()
    state = TopicState(4, 5)
    state.touch("c", 0)
    # Settled at epoch ms 1, long before any cutoff: the next retention run removes them.
    settle(warehouse, state, index, ["s0", "r0", "x0"], "ack")
    settle(warehouse, state, index, ["x1"], "reject")
    done = retain(buffer, ledger, HOUR_MS, int(time.time() * 1000))
    assert done is not None and done.removed == 4
    assert "string_view" in string_types(buffer), "a MERGE's files hold string views"
    assert "string" in string_types(buffer), "beside an append's plain strings"

    # The checkpoint's dead-letter look-up over the rewritten files.
    now = int(time.time() * 1000)  # after the retention watermark, as a settlement is
    settle(warehouse, state, index, ["s1", "r1"], "reject", now)
    dead = scan(dead_letters, Table.DEAD_LETTER)
    assert sorted(dead.column("message_id").to_pylist()) == ["r1", "s1", "x1"]
    assert dead.column("payload").to_pylist()[0].startswith(b"payload-")

    # Redrive's restore appends x1 from its dead letter; the index revives it.
    compact_ledger(warehouse, "jobs", HOUR_MS)  # the ledger's files rewritten too
    redriven = state.redrive(now + 2, state.trimmed_upto(), [("x1", 1, 1)])
    assert redriven == (["x1"], {})
    assert restore(buffer, dead_letters, ["x1"], now + 2) == 1
    index.push(state, [mh("x1")])
    assert index.revive(state) == 1
    assert index.settled_event("s1") == LedgerEvent.DEAD
    assert index.settled_event("s0") is None, "settled before the watermark: the ledger's"
    assert index.dead(["s1", "x1"])[1].keys() == {"s1", "x1"}, "the redrive is in Raft"
    index.forget(
        state.trim(checkpoint(warehouse, "jobs", list(state.events), buffer_names(warehouse)))
    )
    assert index.dead(["s1", "x1"])[1].keys() == {"s1"}
    assert split(latest_events(ledger, 0, ["s0", "x1"])) == (["s0"], ["x1"])

    removed = {"s0", "r0", "x0"}
    held = {f"{p}{i}" for p in "srx" for i in range(10)} - removed
    pending = held - {"s1", "r1"}
    assert index.refresh() == 0, "no row is new to the index"
    assert set(index.rows) == pending

    fresh = TopicIndex(warehouse, topic_conf())
    fresh.load()
    assert set(fresh.rows) == pending
    for mid in ("s2", "r2", "x1"):  # the heads read from each writer's files
        head = fresh.head(mid)
        assert head is not None and head == index.head(mid)
        assert base64.b64encode(f"payload-{mid}".encode()) in head[1]

    rows = DeltaFollower(buffer, BUFFER_SCHEMA).poll()
    assert rows.schema == BUFFER_SCHEMA
    assert sorted(rows.column("message_id").to_pylist()) == sorted(held)
    wanted = scan(buffer, Table.BUFFER, where=matching(Table.BUFFER, message_id=["x1", "s2"]))
    assert wanted.schema == BUFFER_SCHEMA and wanted.num_rows == 2
    assert scan(ledger, Table.LEDGER).schema == LEDGER_SCHEMA
    assert row_count(buffer) == len(held)

    expected = spark.createDataFrame(pa.table({"message_id": sorted(held)}))
    for df in (
        spark.sql(f"SELECT message_id FROM delta.`{buffer}`"),
        spark.read.format("dejaq_delta").option("path", buffer).load().select("message_id"),
    ):
        assert_df_equality(df, expected, ignore_row_order=True, ignore_nullable=True)


def test_tables_are_read_through_the_contract_alone() -> None:
    """Filters and datasets over Delta tables are built in `conf/tables.py` only, so no
    reader compares a column in a file's own type again."""
    root = Path(__file__).resolve().parent.parent
    raw = ("to_pyarrow_dataset(", "to_pyarrow_table(", "pc.field(")
    found = [
        f"{path.relative_to(root)}: {needle}"
        for folder in ("broker", "pipelines", "jobs", "conf")
        for path in (root / folder).rglob("*.py")
        if path != root / "conf" / "tables.py"
        for needle in raw
        if needle in path.read_text()
    ]
    assert found == []
