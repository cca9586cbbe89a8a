"""Retention on real Delta tables: settled messages leave the buffer, pending ones never do,
and a start reads the ledger's tail only."""

from __future__ import annotations

import base64
import datetime as dt
import json
import logging
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest
from conftest import buffer_names, wait_until
from deltalake import DeltaTable, write_deltalake
from deltalake.exceptions import CommitFailedError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_broker import (
    _until,
    acked_batches,
    buffer_rows,
    fill,
    listed,
    loaded_topic,
    on_one_node,
    run_node,
    topic_conf,
)
from test_broker import packed as as_picks

from dejaq.broker.state.handles import mh, mhs, packed
from dejaq.broker.state.leases import TopicState
from dejaq.broker.state.settlements import redriven
from dejaq.broker.storage import index as index_module
from dejaq.broker.storage.index import TopicIndex
from dejaq.broker.storage.ledger_writer import checkpoint
from dejaq.conf import table_watch
from dejaq.conf.settings import Settings
from dejaq.conf.tables import BUFFER_SCHEMA, LEDGER_SCHEMA, Table, ensure_table, scan
from dejaq.jobs.ports import free_port
from dejaq.pipelines import delta_source, retention
from dejaq.pipelines.delta_follower import DeltaFollower
from dejaq.pipelines.delta_source import DeltaBatchWriter, WriteTarget
from dejaq.pipelines.log_compaction import SEAL_MIN_FILES, seal
from dejaq.pipelines.pending import PendingSet
from dejaq.pipelines.retention import retain, watermark

HOUR = 3600 * 1000


def now_ms() -> int:
    return int(time.time() * 1000)


Event = tuple[str, str, int] | tuple[str, str, int, int]


def ledger_rows(events: list[Event]) -> pa.Table:
    """(message id, event, at ms[, sort key: 0 unless given]) as ledger rows."""
    return pa.Table.from_pylist(
        [
            {
                "message_id": e[0],
                "bucket": 0,
                "event": e[1],
                "sort_key": e[3] if len(e) > 3 else 0,
                "deliveries": 1,
                "at": dt.datetime.fromtimestamp(e[2] / 1000, dt.UTC),
            }
            for e in events
        ],
        schema=LEDGER_SCHEMA,
    )


def record(warehouse: str, events: list[Event]) -> None:
    write_deltalake(
        ensure_table(warehouse, Table.LEDGER, "jobs"), ledger_rows(events), mode="append"
    )


def buffered(warehouse: str) -> set[str]:
    table = ensure_table(warehouse, Table.BUFFER, "jobs")
    return set(scan(table, Table.BUFFER, ["message_id"]).column(0).to_pylist())


def run(warehouse: str, now: int, retention_ms: int = HOUR) -> retention.RetentionRun | None:
    return retain(
        ensure_table(warehouse, Table.BUFFER, "jobs"),
        ensure_table(warehouse, Table.LEDGER, "jobs"),
        retention_ms,
        now,
    )


def redriven_now(state: TopicState) -> list[str]:
    """The ids of the messages whose latest event in `state` is a redrive, as the leader's
    checkpoint puts their rows back (`Broker._checkpoint_topic`)."""
    return [state.redriven_ids[h] for h in redriven(state.events)]


def test_settled_messages_past_retention_leave_and_nothing_else_does(tmp_path: Path) -> None:
    warehouse = str(tmp_path / "wh")
    fill(warehouse, "jobs", buffer_rows(list(range(10))))
    now = now_ms()
    old, recent = now - 2 * HOUR, now - 60_000
    record(
        warehouse,
        [
            ("m0", "acked", old),
            ("m1", "cancelled", old),
            ("m2", "released", old),
            ("m3", "dead", old),
            ("m4", "dead", old),
            ("m4", "redriven", old + 1),  # pending again
            ("m5", "acked", recent),  # inside the retention window
            ("m6", "dead", old),
            ("m6", "redriven", old),  # same millisecond: the redrive follows the death
            ("m7", "dead", old),
            ("m7", "redriven", old + 1),
            ("m7", "acked", old + 2),
        ],
    )
    done = run(warehouse, now)
    assert done is not None and done.removed == 5 and done.watermark_ms == now - HOUR
    assert buffered(warehouse) == {"m4", "m5", "m6", "m8", "m9"}
    buffer = DeltaTable(ensure_table(warehouse, Table.BUFFER, "jobs"))
    assert watermark(buffer) == now - HOUR
    assert retention.is_rewrite(buffer.history(1)[0])
    assert buffer.metadata().partition_columns == ["bucket"]
    assert run(warehouse, now) is None, "the cutoff has not moved"
    assert run(warehouse, now + 1000) is None, "nothing to remove: a minute at a time"
    step = retention.WATERMARK_STEP_MS
    again = run(warehouse, now + step)
    assert again is not None and again.removed == 0 and again.messages_read == 0, "m5 is later"
    assert watermark(DeltaTable(ensure_table(warehouse, Table.BUFFER, "jobs"))) == now - HOUR + step


def buffer_by_id(warehouse: str) -> dict[str, dict]:
    table = scan(ensure_table(warehouse, Table.BUFFER, "jobs"), Table.BUFFER)
    return {row["message_id"]: row for row in table.to_pylist()}


def started(warehouse: str) -> dict[str, int]:
    """The pending messages and their keys as a release job's start reads them: the
    buffer, and the ledger from the buffer's retention watermark on."""
    buffer = DeltaFollower(ensure_table(warehouse, Table.BUFFER, "jobs"), BUFFER_SCHEMA)
    ledger = DeltaFollower(
        ensure_table(warehouse, Table.LEDGER, "jobs"), LEDGER_SCHEMA, time_column="at"
    )
    pending = PendingSet()
    pending.add_buffer_rows(buffer.poll())
    assert buffer.table is not None
    since = watermark(buffer.table)
    pending.forget_before(since)
    pending.apply_ledger_rows(ledger.poll(since_ms=since))
    return {m.message_id: m.sort_key for m in pending.take(len(pending))}


@pytest.mark.parametrize("kind", ["priority", "timeline"])  # the kinds brokers deliver
def test_a_run_past_a_pending_messages_new_key_gives_its_row_that_key_and_moves_on(
    tmp_path: Path, kind: str
) -> None:
    """A `rescheduled` row (a reschedule or a nack's priority on the brokers) of a message
    still pending at the cutoff: the run rewrites its buffer row at the latest such key,
    with the column its kind derives from it, in the commit that removes the settled
    messages, and its watermark passes the row (a watermark held at it would stay
    there until the message settles). A start (a broker node, the release job) reads
    the new key from the row; a new key past the cutoff is read from the ledger and
    wins, and the run past it writes it in turn."""
    warehouse = str(tmp_path / "wh")
    timed = kind == "timeline"
    column = "deliver_at" if timed else "priority"
    now = now_ms()
    base = now if timed else 10
    fill(warehouse, "jobs", buffer_rows([base + i for i in range(4)], timeline=timed))
    ahead = 30 * 24 * HOUR if timed else 1000  # a month ahead; a lower priority
    old = now - 3 * HOUR
    record(
        warehouse,
        [
            ("m0", "acked", old),
            ("m1", "rescheduled", old + 1000, base + ahead),
            ("m2", "acked", old + 2000),
            ("m1", "rescheduled", old + 3000, base + ahead + 1),
            ("m2", "rescheduled", old - 1000, base + 7),  # before its ack: settled
            ("m3", "rescheduled", now - 60_000, base + ahead + 3),  # past the cutoff
        ],
    )
    before = buffer_by_id(warehouse)
    following = DeltaFollower(ensure_table(warehouse, Table.BUFFER, "jobs"), BUFFER_SCHEMA)
    assert following.poll().num_rows == 4
    done = run(warehouse, now)
    assert done is not None and done.watermark_ms == now - HOUR > old + 3000
    assert following.poll().num_rows == 0, "a running release job does not read it again"
    assert (done.removed, done.rekeyed) == (2, 1)
    rows = buffer_by_id(warehouse)
    assert set(rows) == {"m1", "m3"}
    m1 = rows["m1"]
    assert m1["sort_key"] == base + ahead + 1, "the latest new key"
    key = base + ahead + 1
    assert m1[column] == (dt.datetime.fromtimestamp(key / 1000, dt.UTC) if timed else key)
    derived = {"sort_key", column}
    assert {c: v for c, v in m1.items() if c not in derived} == {
        c: v for c, v in before["m1"].items() if c not in derived
    }, "its bucket, payload, source, ingestion and the other kinds' columns (null) stay"
    assert rows["m3"] == before["m3"], "its new key is past the cutoff"
    files = DeltaTable(ensure_table(warehouse, Table.BUFFER, "jobs")).get_add_actions(True)
    buckets = pa.table(files).column("partition.bucket").to_pylist()
    assert sorted(buckets) == [1, 3], "each row in its own bucket's partition"

    assert started(warehouse) == {"m1": base + ahead + 1, "m3": base + ahead + 3}
    index = TopicIndex(warehouse, topic_conf(kind=kind))
    index.load()
    m1_row, m3_row = index.row("m1"), index.row("m3")
    index.close()
    assert m1_row is not None and m1_row.sort_key == base + ahead + 1
    assert m3_row is not None and m3_row.sort_key == base + 3, "the Raft state has m3's"

    record(warehouse, [("m1", "rescheduled", now - 30_000, base + 5)])  # after the run
    assert started(warehouse) == {"m1": base + 5, "m3": base + ahead + 3}, "it wins"
    done = run(warehouse, now + HOUR)
    assert done is not None and done.watermark_ms == now and (done.removed, done.rekeyed) == (0, 2)
    assert started(warehouse) == {"m1": base + 5, "m3": base + ahead + 3}
    assert {m: r["sort_key"] for m, r in buffer_by_id(warehouse).items()} == {
        "m1": base + 5,
        "m3": base + ahead + 3,
    }
    record(warehouse, [("m1", "acked", now + 1000)])
    done = run(warehouse, now + 2 * HOUR)
    assert done is not None and done.removed == 1 and set(buffer_by_id(warehouse)) == {"m3"}


def test_a_run_reads_the_ledger_up_to_its_cutoff_and_past_it_only_redrives_of_the_dead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run each minute must not read the whole retention window again. Past the cutoff
    only a redrive can undo a settlement (of a death), so that is all a run looks for
    there (and the span's events that set a key, none here); `ledger_tail` is wrapped,
    not replaced, to see what it returned."""
    warehouse = str(tmp_path / "wh")
    fill(warehouse, "jobs", buffer_rows(list(range(60))))
    now = now_ms()
    old, cutoff = now - 2 * HOUR, now - HOUR
    record(
        warehouse,
        [
            ("m0", "dead", old),
            ("m1", "dead", old),
            ("m2", "acked", old),
            ("m3", "dead", old),
            ("m4", "dead", old),
        ],
    )
    record(
        warehouse,
        [
            ("m0", "redriven", cutoff + 60_000),  # pending again: stays
            ("m3", "redriven", cutoff),  # at the cutoff is past it
            ("m4", "redriven", cutoff + 1),
            ("m4", "acked", cutoff + 2),  # settled after the cutoff: stays
            *((f"m{i}", "acked", now - 60_000) for i in range(10, 60)),
        ],
    )
    seen: list[tuple[int, int]] = []
    real = retention.ledger_tail

    def spied(*args, **kwargs) -> pa.Table:
        tail = real(*args, **kwargs)
        seen.append((args[1], tail.num_rows))
        return tail

    monkeypatch.setattr(retention, "ledger_tail", spied)
    done = run(warehouse, now)
    assert done is not None and done.watermark_ms == cutoff
    assert done.messages_read == 5 and done.removed == 2
    assert buffered(warehouse) == {f"m{i}" for i in range(60)} - {"m1", "m2"}
    # The span's settling events, past the cutoff the redrives of m0, m3, m4, then the
    # span's events that set a key (none).
    assert seen == [(0, 5), (cutoff, 3), (0, 0)]


def test_a_question_about_a_settled_message_reads_the_ledger_from_the_watermark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Peek, cancel and reschedule ask the ledger about a message the index forgot, an
    unknown id too: from the buffer's retention watermark, not the ledger's history. A
    message settled before it has left the buffer, and is the ledger table's; one whose
    history crosses the watermark is told by its latest event. `latest_events` is
    wrapped, not replaced, to see where it starts."""
    warehouse, index, _ = loaded_topic(tmp_path, [1])
    now = now_ms()
    old, cutoff = now - 2 * HOUR, now - HOUR
    record(
        warehouse,
        [
            ("a0", "acked", old),
            ("d0", "dead", old),
            ("d0", "redriven", cutoff + 1),
            ("d0", "dead", cutoff + 2),  # dead again
            ("r0", "dead", old),
            ("r0", "redriven", cutoff + 1),  # pending again
            ("a1", "acked", cutoff + 1),
        ],
    )
    done = run(warehouse, now)
    assert done is not None and done.removed == 0 and done.messages_read == 3
    buffer = DeltaTable(index.buffer_path)
    assert watermark(buffer) == cutoff, "no row of a0, d0, r0 here"
    assert buffer.history(1)[0][retention.OPERATION] == "0", "as `dejaq status` shows it"
    starts: list[int] = []
    real = index_module.latest_events

    def spied(ledger_path: str, since_ms: int, *args) -> pa.Table:
        starts.append(since_ms)
        return real(ledger_path, since_ms, *args)

    monkeypatch.setattr(index_module, "latest_events", spied)
    answers = {m: index.settled_event(m) for m in ("a0", "d0", "r0", "a1", "unknown")}
    assert answers == {"a0": None, "d0": "dead", "r0": None, "a1": "acked", "unknown": None}
    assert starts == [cutoff] * 5


def ingest_append(path: str, rows: pa.Table, app_id: str, batch_id: int) -> None:
    """An ingest micro-batch's write as its Spark tasks and driver make it (files, then
    one commit tagged (app id, batch id)), without Spark."""
    delta = DeltaTable(path)
    target = WriteTarget(
        path, pa.schema(delta.schema().to_arrow()), tuple(delta.metadata().partition_columns)
    )
    writer = DeltaBatchWriter(target, overwrite=False, txn=(app_id, batch_id))
    writer.commit([writer.write(iter(rows.to_batches()))])


def stamped(rows: pa.Table, at: dt.datetime) -> pa.Table:
    """`rows` as a batch the ingest began at `at`."""
    i = rows.schema.get_field_index("ingested_at")
    return rows.set_column(i, "ingested_at", pa.array([at] * rows.num_rows, rows.schema[i].type))


@pytest.mark.parametrize("late", [False, True])
def test_an_append_landing_during_the_rewrite_does_not_fail_it(
    late: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ingest batch committed between the run's snapshot and its commit, of rows
    stamped after the snapshot's latest (every batch the ingest begins later): the run
    commits anyway, so appends however frequent cannot starve a slow rewrite. A batch
    stamped before it (`late`: a second ingest whose clock is behind) may hold rows the
    rewrite should have read: that commit fails, and the next attempt removes them. A
    pending message's new key, which the rewrite writes too, changes none of that. The
    batch is committed by the run's own MERGE call, through a wrapper of delta-rs's table
    class: the one way to place it in that window here."""
    warehouse = str(tmp_path / "wh")
    t0 = dt.datetime.now(dt.UTC)
    odd = "m'\n"  # ids the commit's predicate must quote, as the conflict check reads it
    fill(warehouse, "jobs", stamped(buffer_rows(list(range(10)), prefix=odd), t0))
    buffer = ensure_table(warehouse, Table.BUFFER, "jobs")
    now = now_ms()
    record(warehouse, [(f"{odd}{i}", "acked", now - 2 * HOUR) for i in range(5)])
    record(warehouse, [(f"{odd}5", "rescheduled", now - 2 * HOUR, 42)])
    batch_at = t0 + dt.timedelta(seconds=-1 if late else 1)
    # The same ids as settled messages: their files overlap the rewrite's id range.
    batch = stamped(buffer_rows([7] * 3, prefix=f"{odd}1"), batch_at)
    appended: list[int] = []

    class AppendFirst(DeltaTable):
        """A buffer snapshot whose MERGE starts after an ingest batch has committed."""

        def merge(self, *args, **kwargs):
            if not appended:
                ingest_append(buffer, batch, "dejaq-ingest-jobs", 0)
                appended.append(DeltaTable(buffer).version())
            return super().merge(*args, **kwargs)

    monkeypatch.setattr(retention, "DeltaTable", AppendFirst)
    monkeypatch.setattr(retention, "ATTEMPTS", 1)  # a lost commit raises
    if late:
        with pytest.raises(CommitFailedError):
            run(warehouse, now)
        assert watermark(DeltaTable(buffer)) == 0, "the lost run committed nothing"
    done = run(warehouse, now)
    assert done is not None and (done.removed, done.rekeyed) == (5, 1)
    assert DeltaTable(buffer).version() == appended[0] + 1, "committed on top of the batch"
    kept = scan(buffer, Table.BUFFER, ["message_id", "sort_key"]).to_pylist()
    assert sorted((r["message_id"], r["sort_key"]) for r in kept) == sorted(
        (f"{odd}{i}", {5: 42, 10: 7, 11: 7, 12: 7}.get(i, i)) for i in range(5, 13)
    )


def test_an_append_beaten_by_a_rewrite_commits_again_on_top(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The other side of the race: a retention run commits between an ingest batch's
    snapshot and its commit. delta-rs counts an append as reading its whole snapshot, so
    the removal fails that commit; the batch's rows depend on nothing it read, so the
    connector commits the same files again on a fresh snapshot, once, with its (app id,
    batch id). The run is placed in that window by the connector's own snapshot call."""
    warehouse = str(tmp_path / "wh")
    fill(warehouse, "jobs", buffer_rows(list(range(10))))
    buffer = ensure_table(warehouse, Table.BUFFER, "jobs")
    now = now_ms()
    record(warehouse, [(f"m{i}", "acked", now - 2 * HOUR) for i in range(5)])
    runs: list[retention.RetentionRun | None] = []

    class RetentionFirst(DeltaTable):
        """A buffer snapshot whose write commits after a retention run has."""

        def create_write_transaction(self, *args, **kwargs):
            if not runs:
                runs.append(run(warehouse, now))
            return super().create_write_transaction(*args, **kwargs)

    monkeypatch.setattr(delta_source, "DeltaTable", RetentionFirst)
    with caplog.at_level(logging.INFO, logger=delta_source.__name__):
        ingest_append(buffer, buffer_rows([3] * 4, prefix="n"), "dejaq-ingest-jobs", 0)
    assert runs[0] is not None and runs[0].removed == 5
    assert any("lost its commit" in r.getMessage() for r in caplog.records)
    table = DeltaTable(buffer)
    assert table.transaction_version("dejaq-ingest-jobs") == 0
    assert retention.is_rewrite(table.history(2)[1]), "the append landed on top of the run"
    kept = scan(table, Table.BUFFER, ["message_id"]).column(0).to_pylist()
    assert sorted(kept) == sorted([f"m{i}" for i in range(5, 10)] + [f"n{i}" for i in range(4)])


def test_the_cutoff_stays_before_what_is_not_yet_in_the_ledger(tmp_path: Path) -> None:
    warehouse = str(tmp_path / "wh")
    fill(warehouse, "jobs", buffer_rows([1, 2]))
    now = now_ms()
    record(warehouse, [("m0", "acked", now - 2 * HOUR)])
    buffer = ensure_table(warehouse, Table.BUFFER, "jobs")
    ledger = ensure_table(warehouse, Table.LEDGER, "jobs")
    unwritten = now - 2 * HOUR  # the caller holds an event this old, not yet checkpointed
    assert retain(buffer, ledger, HOUR, now, unwritten) is not None
    assert watermark(DeltaTable(buffer)) == unwritten - retention.CLOCK_SKEW_MS
    assert buffered(warehouse) == {"m0", "m1"}, "m0 settled after the cutoff it allowed"


def test_a_start_after_retention_reads_only_the_ledger_tail(tmp_path: Path) -> None:
    """The ledger files before the watermark are deleted from disk: a node's index still
    loads, so nothing on its start reads them."""
    warehouse, index, state = loaded_topic(tmp_path, list(range(300)))
    for n, _ in enumerate(acked_batches(index, state, 50)):  # settled at epoch ms 1
        index.forget(
            state.trim(checkpoint(warehouse, "jobs", state.events, buffer_names(warehouse)))
        )
        if n == 3:
            break
    settled_now = [m for m, _, _ in listed(index.pick(state, state.buckets_of("c"), 10, now=0))]
    state.lease("c", 0, 10**15, [(m, index.row(m).bucket, 0) for m in settled_now])
    assert state.ack("c", now_ms(), settled_now) == {}
    index.forget(state.trim(checkpoint(warehouse, "jobs", state.events, buffer_names(warehouse))))
    done = run(warehouse, now_ms())
    assert done is not None and done.removed == 200
    ledger = DeltaTable(ensure_table(warehouse, Table.LEDGER, "jobs"))
    adds = pa.table(ledger.get_add_actions(flatten=True)).to_pylist()
    old = [a["path"] for a in adds if a["max.at"] < dt.datetime.fromtimestamp(1, dt.UTC)]
    assert len(old) == 4, "the four checkpoints of epoch ms 1"
    for path in old:
        (Path(ensure_table(warehouse, Table.LEDGER, "jobs")) / path).unlink()
    fresh = TopicIndex(warehouse, topic_conf())
    fresh.load()
    assert len(buffered(warehouse)) == 100
    assert set(fresh.rows) == buffered(warehouse) - set(settled_now)
    assert len(fresh.rows) == 90 and fresh.buffer_rows == 100


def settled_long_ago_and_now(tmp_path: Path) -> tuple[str, TopicIndex, set[str]]:
    """Topic "jobs" with 40 messages: 10 acked at epoch ms 1 (the next retention run
    removes them), 10 acked now (inside the window), both checkpointed and forgotten;
    the 20 pending."""
    warehouse, index, state = loaded_topic(tmp_path, list(range(40)))
    next(acked_batches(index, state, 10))
    index.forget(state.trim(checkpoint(warehouse, "jobs", state.events, buffer_names(warehouse))))
    picks = listed(index.pick(state, state.buckets_of("c"), 10, now=0))
    state.lease("c", 0, 10**15, picks)
    index.release(state, as_picks(picks))
    assert state.ack("c", now_ms(), [m for m, _, _ in picks]) == {}
    index.forget(state.trim(checkpoint(warehouse, "jobs", state.events, buffer_names(warehouse))))
    return warehouse, index, set(index.rows)


def test_the_index_does_not_read_a_retention_runs_rewritten_files(tmp_path: Path) -> None:
    """Settled messages inside the window share files with removed ones: rewritten, they
    must not come back into an index that forgot them."""
    warehouse, index, pending = settled_long_ago_and_now(tmp_path)
    fill(warehouse, "jobs", buffer_rows([7, 8], prefix="new"))
    done = run(warehouse, now_ms())
    assert done is not None and done.removed == 10 and done.files_rewritten == 4
    assert index.refresh() == 2, "the appended rows only"
    assert set(index.rows) == pending | {"new0", "new1"}
    assert len(index.files) == len(DeltaTable(index.buffer_path).file_uris())


def expire_log(path: str) -> int:
    """Have the table at `path` drop every log entry before a Delta checkpoint of its
    current version, as delta-rs does once they are past the table's log retention (set
    to nothing here, so the test need not wait it out); the first version left."""
    table = DeltaTable(path)
    table.alter.set_table_properties({"delta.logRetentionDuration": "interval 0 seconds"})
    table = DeltaTable(path)
    table.create_checkpoint()
    table.cleanup_metadata()
    return min(int(p.name[:20]) for p in Path(path, "_delta_log").glob("*.json"))


def test_an_index_further_behind_than_the_buffers_log_reads_it_as_a_start_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The buffer keeps its log two hours; a node frozen longer finds no next log entry,
    and sees the table moved by its Delta checkpoint (read each minute, here each time).
    It cannot tell which of the versions it missed were rewrites, so it reads every file
    it has not seen without what the ledger settled since the retention watermark: the
    new rows come in once, and neither a settled message in a rewritten file nor a
    pending one comes back twice. What the ledger settled is applied to those files
    alone, so the node still owes the rows it held a read of the ledger: a snapshot
    arriving next (`rebuild`) must find one it revived meanwhile settled, not skip the
    ledger as read."""
    monkeypatch.setattr(table_watch, "CHECKPOINT_PROBE_S", 0.0)
    warehouse, index, pending = settled_long_ago_and_now(tmp_path)
    seen = index.version
    index.revived_since_read = True  # a redriven message's row revived from its dead letter
    owed = (index.ledger_version, True)
    assert DeltaTable(index.ledger_path).version() != owed[0], "the ledger moved since the load"
    fill(warehouse, "jobs", buffer_rows([7, 8], prefix="new"))
    done = run(warehouse, now_ms())
    assert done is not None and done.removed == 10, "rewrites files of settled messages"
    assert expire_log(index.buffer_path) > seen + 1, "versions this index has not read"
    assert index.refresh() == 2, "the appended rows only"
    assert set(index.rows) == pending | {"new0", "new1"}
    assert (index.ledger_version, index.revived_since_read) == owed
    with pytest.raises(retention.LogGap, match="no longer holds version"):
        retention.commits(index.buffer_path, range(seen + 1, seen + 2))


def test_an_index_whose_unread_files_were_vacuumed_or_rewritten_untagged_reads_as_a_start(
    tmp_path: Path,
) -> None:
    """A file that a version the node has not read added, compacted and vacuumed since
    (the log still naming it), or a commit that replaced files untagged (a DELETE by
    hand): the node cannot walk the versions, so it reads the files it has not seen as
    a start does. Each new row comes in once; nothing is read again."""
    warehouse, index, _ = loaded_topic(tmp_path, [4, 9])
    fill(warehouse, "jobs", buffer_rows([7], prefix="new"))
    DeltaTable(index.buffer_path).optimize.compact()
    DeltaTable(index.buffer_path).vacuum(
        retention_hours=0, enforce_retention_duration=False, dry_run=False
    )
    assert index.refresh() == 1
    assert set(index.rows) == {"m0", "m1", "new0"}
    fill(warehouse, "jobs", buffer_rows([8], prefix="more"))
    DeltaTable(index.buffer_path).delete("message_id = 'new0'")
    assert index.refresh() == 1, "more0 alone"
    assert set(index.rows) == {"m0", "m1", "new0", "more0"}


class VersionedOpens:
    """A spy on a module's `DeltaTable`: counts the snapshots opened at a given version
    (a follower walking the versions it missed opening one each), and opens them."""

    def __init__(self, module: object, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = module.DeltaTable  # type: ignore[attr-defined]

        def opened(*args: object, **kwargs: object) -> DeltaTable:
            if kwargs.get("version") is not None or (len(args) > 1 and args[1] is not None):
                self.count += 1
            return real(*args, **kwargs)

        opened.is_deltatable = real.is_deltatable  # type: ignore[attr-defined]
        monkeypatch.setattr(module, "DeltaTable", opened)


def test_an_index_behind_a_rewrite_walks_the_log_entries_not_a_snapshot_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node that missed appends, a compaction of them and a retention run takes each
    version's files from its log entry: no snapshot per version, and every appended row
    read once, those a compaction replaced before the node read them too."""
    warehouse, index, _ = loaded_topic(tmp_path, [4, 9])
    seen = index.version
    fill(warehouse, "jobs", buffer_rows([1, 2, 3, 5], prefix="a"))
    DeltaTable(index.buffer_path).optimize.compact()  # replaces m* and a* files
    assert run(warehouse, now_ms()) is not None  # a watermark-only retention commit
    fill(warehouse, "jobs", buffer_rows([6, 7], prefix="c"))
    opens = VersionedOpens(index_module, monkeypatch)
    read: list[int] = []  # rows of each bucket read: a spy on `_read_bucket`
    read_bucket = index._read_bucket

    def reading(bucket: int, uris: list[str]) -> index_module.Batch:
        batch = read_bucket(bucket, uris)
        read.append(len(batch.mids))
        return batch

    monkeypatch.setattr(index, "_read_bucket", reading)
    assert index.version == seen and DeltaTable(index.buffer_path).version() == seen + 4
    assert index.refresh() == 6
    assert opens.count == 0, "no snapshot of a version between"
    assert sum(read) == 6, "the appended rows, once; not the compaction's"
    assert set(index.rows) == {"m0", "m1", "a0", "a1", "a2", "a3", "c0", "c1"}
    current = DeltaTable(index.buffer_path)
    assert index.files == set(pa.table(current.get_add_actions()).column("path").to_pylist())
    assert index.buffer_rows == 8


def m0_settled_and_retained(tmp_path: Path, settle: str) -> tuple[str, TopicIndex, TopicState]:
    """Topic "jobs" with m0 and m1; m0 leased, settled by `settle` ("ack" or "reject"),
    checkpointed, and its buffer row removed by a retention run."""
    warehouse, index, state = loaded_topic(tmp_path, [4, 9])
    state.lease("c", 0, 100, [("m0", 0, 4)])
    getattr(state, settle)("c", 1, ["m0"])
    index.forget(state.trim(checkpoint(warehouse, "jobs", state.events, buffer_names(warehouse))))
    assert run(warehouse, now_ms()) is not None
    assert buffered(warehouse) == {"m1"}
    return warehouse, index, state


def test_a_redriven_message_whose_row_retention_removed_comes_from_the_dead_letters(
    tmp_path: Path,
) -> None:
    _, index, state = m0_settled_and_retained(tmp_path, "reject")
    done = state.redrive(2, state.trimmed_upto(), [("m0", 0, 4)])
    assert done == (["m0"], {})
    index.push(state, [mh("m0")])
    assert index.revive(state) == 1
    picked, taken = index.pick_with_heads(state, state.buckets_of("c"), 2, now=3)
    picks = listed(picked)
    assert [p[0] for p in picks] == ["m0", "m1"]
    assert base64.b64encode(b"payload-m0") in taken[0][1], "the dead letter's payload"


def test_a_node_catching_up_warns_only_of_rows_no_trim_forgets(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarted node applies a redrive of a message before its later lease, ack and
    trim, its row removed by retention: it is not indexed, and the trim forgets it
    before it is warned of. A redriven message with a row nowhere, that no trim
    forgets, is warned of once the grace has passed."""
    warehouse, _, _ = m0_settled_and_retained(tmp_path, "ack")
    restarted = TopicIndex(warehouse, topic_conf())
    restarted.load()
    replaying = TopicState(4, 5)
    replaying.touch("c", 0)
    pending = ["m0", "unknown"]  # redriven: read by id, the others awaited by handle
    replaying.redriven_ids.update(zip(mhs(pending), pending, strict=True))
    restarted.push(replaying, mhs(pending))

    def warned() -> list[str]:
        return [r.getMessage() for r in caplog.records if "cannot be leased" in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="dejaq.broker.storage.index"):
        assert restarted.revive(replaying) == 0
        assert restarted.unread == {} and set(restarted.rows) == {"m1"}
        assert warned() == [], "within the grace"
        restarted.forget(packed(["m0"]))  # the replayed trim of its ack
        monkeypatch.setattr(index_module, "UNFOUND_GRACE_S", 0.0)
        restarted.revive(replaying)
        restarted.revive(replaying)
    assert len(warned()) == 1 and "['unknown']" in warned()[0], warned()
    assert restarted.unfound == {}


History = list[tuple[str, int]]  # (event, hours before now); one ms apart
HISTORIES = st.sampled_from(
    [
        [],
        [("acked", 3)],
        [("acked", 0)],
        [("dead", 3)],
        [("dead", 3), ("redriven", 2)],
        [("dead", 3), ("redriven", 2), ("acked", 2)],
        [("dead", 2), ("redriven", 0)],
        [("cancelled", 2)],
        [("released", 0)],
    ]
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    first=st.lists(HISTORIES, min_size=1, max_size=12),
    later=st.lists(HISTORIES, min_size=0, max_size=12),
    retention_hours=st.integers(0, 4),
)
def test_retention_keeps_every_pending_message_and_a_start_agrees(
    tmp_path_factory, first: list[History], later: list[History], retention_hours: int
) -> None:
    """Two runs, each after some messages' histories reached the ledger: pending messages
    all stay, messages settled before a cutoff all go, and an index loaded after the
    runs holds exactly the pending messages (those redriven included).

    The first histories lie 5 hours further back and the first run's cutoff before
    every later event, as a deliverer keeps it (no event older than a run's cutoff
    reaches the ledger after the run)."""
    warehouse = str(tmp_path_factory.mktemp("prop"))
    histories = [(h, 5) for h in first] + [(h, 0) for h in later]
    fill(warehouse, "jobs", buffer_rows(list(range(len(histories))), bucket_of=lambda i: i % 4))
    now = now_ms()
    last_at = {
        f"m{i}": now - (h[-1][1] + shift) * HOUR + len(h) - 1
        for i, (h, shift) in enumerate(histories)
        if h
    }

    def write(ids: range) -> None:
        events = [
            (f"m{i}", event, now - (hours + histories[i][1]) * HOUR + n)
            for i in ids
            for n, (event, hours) in enumerate(histories[i][0])
        ]
        if events:
            record(warehouse, events)

    write(range(len(first)))
    run(warehouse, now - 4 * HOUR, retention_hours * HOUR)
    write(range(len(first), len(histories)))
    run(warehouse, now, retention_hours * HOUR)
    cutoff = now - retention_hours * HOUR
    pending = {f"m{i}" for i, (h, _) in enumerate(histories) if not h or h[-1][0] == "redriven"}
    settled_early = {m for m, at in last_at.items() if m not in pending and at < cutoff}
    left = buffered(warehouse)
    assert pending <= left, "no pending message leaves"
    assert not settled_early & left, "every message settled before the cutoff left"
    index = TopicIndex(warehouse, topic_conf())
    index.load()
    assert set(index.rows) | set(index.unread.values()) == pending


# A step of a message's history, as a deliverer writes it to the ledger: the event
# applies only in a state that allows it (a new key or a death while pending, a redrive
# while dead); a `None` key: a redrive at the key it died with.
STEPS = st.lists(
    st.tuples(
        st.integers(0, 3),  # which message
        st.sampled_from(["rescheduled", "dead", "redriven", "acked", "cancelled"]),
        st.none() | st.integers(0, 50),  # the new key
        st.integers(1, 90),  # minutes after the step before
    ),
    max_size=16,
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps=STEPS, cutoffs=st.lists(st.integers(0, 24 * 60), min_size=1, max_size=3))
def test_after_runs_at_any_cutoffs_a_start_reads_each_pending_messages_key_in_force(
    tmp_path_factory, steps: list[tuple[int, str, int | None, int]], cutoffs: list[int]
) -> None:
    """New keys, deaths, redrives and settlements of a few messages in the ledger, then
    retention runs at increasing cutoffs (minutes into the history): each run's
    watermark is its cutoff, however long a message stays pending after a new key, and
    a start of the release job reads every pending message, and only those, at the key
    in force: the latest one given, or its buffer row's."""
    warehouse = str(tmp_path_factory.mktemp("keys"))
    fill(warehouse, "jobs", buffer_rows([100 + i for i in range(4)]))
    base = now_ms() - 30 * HOUR
    state = ["pending"] * 4
    key = [100 + i for i in range(4)]
    events: list[Event] = []
    at = base
    for i, event, new_key, minutes in steps:
        at += minutes * 60_000
        allowed = "dead" if event == "redriven" else "pending"
        if state[i] != allowed:
            continue
        if event in ("rescheduled", "redriven"):
            key[i] = key[i] if new_key is None else new_key
            state[i] = "pending"
        else:
            state[i] = "dead" if event == "dead" else "settled"
        events.append((f"m{i}", event, at, key[i]))
    if events:
        record(warehouse, events)
    for minutes in sorted(set(cutoffs)):
        cutoff = base + minutes * 60_000
        done = run(warehouse, cutoff + HOUR)
        assert done is not None and done.watermark_ms == cutoff
    in_force = {f"m{i}": key[i] for i in range(4) if state[i] == "pending"}
    assert started(warehouse) == in_force


def test_a_node_that_lagged_past_the_watermark_forgets_what_retention_removed(
    tmp_path: Path,
) -> None:
    """A snapshot covers trims a lagging node never applied, of messages settled before
    the retention watermark: the ledger's tail does not name them, the buffer no longer
    has them, and a message redriven from the dead letters stays."""
    warehouse, lagging, leader = loaded_topic(tmp_path, [5, 1, 3, 7])
    now = now_ms()  # after the rows' ingestion, as every event of theirs is
    leader.lease("c", now, 1000, [("m1", 1, 1), ("m2", 2, 3), ("m3", 3, 7)])
    assert leader.ack("c", now + 1, ["m1", "m2"]) == {}
    leader.reject("c", now + 1, ["m3"])
    leader.trim(
        checkpoint(warehouse, "jobs", leader.events, buffer_names(warehouse))
    )  # never reached `lagging`
    assert run(warehouse, now + 2 * HOUR) is not None
    assert buffered(warehouse) == {"m0"}
    assert leader.redrive(now + 2, leader.trimmed_upto(), [("m3", 3, 7)]) == (["m3"], {})
    lagging.push(leader, [mh("m3")])
    assert lagging.refresh() == 0, "a retention run's files are not read"
    assert lagging.revive(leader) == 0, "m3 still has its buffer row here"
    leader.trim(
        checkpoint(warehouse, "jobs", leader.events, buffer_names(warehouse))
    )  # the redrive: trimmed too
    snapshot = pickle.loads(pickle.dumps(leader))
    lagging.rebuild(snapshot)
    assert sorted(lagging.rows) == ["m0"] and lagging.unread == {mh("m3"): "m3"}
    assert lagging.revive(snapshot) == 1, "from the dead letters"
    picks = listed(lagging.pick(snapshot, snapshot.buckets_of("c"), 3, now=now + 3))
    assert [p[0] for p in picks] == ["m0", "m3"]


def test_a_dead_letter_of_a_bucket_the_topic_no_longer_has_is_refused_by_a_redrive(
    tmp_path: Path,
) -> None:
    """Buckets lowered from 8 to 4 once retention removed the rows of the higher ones: a
    dead letter of bucket 6 cannot be indexed in 4 buckets, nor go back into the buffer
    (no node would start), so a redrive naming it, or of all, is refused before anything
    is committed, saying which bucket and how many the topic has; the others still go."""
    import asyncio

    from dejaq.broker.service import Broker, Problem

    warehouse = str(tmp_path / "wh")
    fill(warehouse, "jobs", buffer_rows([5, 7], lambda i: 6 if i == 0 else 1))
    index = TopicIndex(warehouse, topic_conf(buckets=8))
    index.load()
    state = TopicState(8, 5)
    state.touch("c", 0)
    state.lease("c", 0, 1000, listed(index.pick(state, state.buckets_of("c"), 2, now=0)))
    assert state.reject("c", 1, ["m0", "m1"]) == {}
    checkpoint(warehouse, "jobs", state.events, buffer_names(warehouse))
    assert run(warehouse, now_ms() + 2 * HOUR) is not None and buffered(warehouse) == set()
    settings = Settings(warehouse=warehouse, topics=[topic_conf(buckets=4)])

    async def scenario(broker: Broker) -> None:
        for ids in (["m0"], None):
            with pytest.raises(Problem) as refused:
                await broker.redrive("jobs", ids, None, None)
            assert refused.value.status == 409, refused.value.detail
            assert "m0 in bucket 6" in refused.value.detail
            assert "topics[jobs].buckets is 4" in refused.value.detail
        assert not broker.state("jobs").redriven_at, "nothing committed"
        assert await broker.redrive("jobs", ["m1"], None, None) == (1, {})
        await asyncio.to_thread(broker.indexes["jobs"].revive, broker.state("jobs"))
        assert sorted(broker.indexes["jobs"].rows) == ["m1"]

    run_node(settings, f"127.0.0.1:{free_port()}", tmp_path / "node", scenario)


def test_a_redriven_message_gets_its_buffer_row_back_and_survives_a_restart(
    tmp_path: Path,
) -> None:
    """Dead, removed by retention, redriven: its dead letter goes back into the buffer
    before the redrive leaves Raft, so a node started after the next run, which reads
    the ledger from a watermark past the redrive, still finds it pending."""
    warehouse, index, state = loaded_topic(tmp_path, [4, 9])
    state.lease("c", 0, 100, [("m0", 0, 4)])
    state.reject("c", 1, ["m0"])
    index.forget(state.trim(checkpoint(warehouse, "jobs", state.events, buffer_names(warehouse))))
    assert run(warehouse, now_ms()) is not None and buffered(warehouse) == {"m1"}
    assert state.redrive(2, state.trimmed_upto(), [("m0", 0, 4)]) == (["m0"], {})
    assert redriven_now(state) == ["m0"]
    checkpoint(warehouse, "jobs", state.events, buffer_names(warehouse))
    buffer, dead = (ensure_table(warehouse, t, "jobs") for t in (Table.BUFFER, Table.DEAD_LETTER))
    assert retention.restore(buffer, dead, ["m0", "m1"], now_ms()) == 1, "m1 has its row"
    assert retention.restore(buffer, dead, ["m0"], now_ms()) == 0, "once"
    index.forget(state.trim(state.events[-1].seq))
    assert run(warehouse, now_ms() + retention.WATERMARK_STEP_MS) is not None
    fresh = TopicIndex(warehouse, topic_conf())
    fresh.load()
    assert sorted(fresh.rows) == ["m0", "m1"]


def failing(*args: object) -> int:
    raise OSError("the store is unreachable")


def m0_dead(tmp_path: Path) -> tuple[str, TopicIndex, TopicState, tuple[str, str, str]]:
    """A topic of m0 and m1, m0 rejected, dead and checkpointed: the warehouse, index and
    state, and the paths of its buffer, ledger and dead letters."""
    warehouse, index, state = loaded_topic(tmp_path, [4, 9])
    state.lease("c", 0, 100, [("m0", 0, 4)])
    state.reject("c", 1, ["m0"])
    index.forget(state.trim(checkpoint(warehouse, "jobs", state.events, buffer_names(warehouse))))
    tables = (Table.BUFFER, Table.LEDGER, Table.DEAD_LETTER)
    buffer, ledger, dead = (ensure_table(warehouse, t, "jobs") for t in tables)
    return warehouse, index, state, (buffer, ledger, dead)


def test_a_redrive_checkpointed_while_a_run_reads_gets_its_row_back_after_the_rewrite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dead message is redriven, its redrive checkpointed and its row checked by
    `restore`, between a run's read of the ledger and its rewrite: `restore` finds the
    row still there, the rewrite removes it, and the run puts it back from the dead
    letters, so a node started afterwards finds the message pending."""
    warehouse, index, state, (buffer, ledger, dead) = m0_dead(tmp_path)
    read = retention.settled_before

    def redriven_meanwhile(*args: object) -> tuple:
        got = read(*args)
        assert state.redrive(now_ms(), state.trimmed_upto(), [("m0", 0, 4)]) == (["m0"], {})
        checkpoint(warehouse, "jobs", state.events, buffer_names(warehouse))
        assert retention.restore(buffer, dead, redriven_now(state), now_ms()) == 0
        return got

    monkeypatch.setattr(retention, "settled_before", redriven_meanwhile)
    assert retain(buffer, ledger, HOUR, now_ms(), None, dead) is not None
    monkeypatch.undo()
    assert buffered(warehouse) == {"m0", "m1"}, "the rewrite removed m0's row; it is back"
    index.forget(state.trim(state.events[-1].seq))
    assert run(warehouse, now_ms() + retention.WATERMARK_STEP_MS) is not None
    fresh = TopicIndex(warehouse, topic_conf())
    fresh.load()
    assert sorted(fresh.rows) == ["m0", "m1"]


@pytest.mark.parametrize("lost", ["redrives_since", "restore"])
def test_a_redrive_whose_row_a_run_removed_and_did_not_put_back_stays_pending(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lost: str
) -> None:
    """As above, but the run's look for redrives after its rewrite, or its putting the
    row back, fails and its process ends there, the redrive trimmed from Raft: a node
    started then leases the message from its dead letter, and the run whose span
    reaches the redrive, in another process (a new leader), puts its row back before
    its watermark passes it, so a node started later reads it from the buffer."""
    warehouse, index, state, (buffer, ledger, dead) = m0_dead(tmp_path)
    read, real = retention.settled_before, getattr(retention, lost)
    armed: list[bool] = []
    redriven_at: list[int] = []

    def redriven_meanwhile(*args: object) -> tuple:
        got = read(*args)
        redriven_at.append(now_ms())
        assert state.redrive(redriven_at[0], state.trimmed_upto(), [("m0", 0, 4)]) == (["m0"], {})
        checkpoint(warehouse, "jobs", state.events, buffer_names(warehouse))
        assert retention.restore(buffer, dead, redriven_now(state), now_ms()) == 0
        armed.append(True)  # the run's next call of `lost` is after its rewrite
        return got

    def fails_once_armed(*args: object) -> object:
        if armed:
            armed.pop()
            return failing(*args)
        return real(*args)

    monkeypatch.setattr(retention, "settled_before", redriven_meanwhile)
    monkeypatch.setattr(retention, lost, fails_once_armed)
    done = retain(buffer, ledger, HOUR, now_ms(), None, dead)
    assert done is not None and done.removed == 1, "the rewrite committed"
    monkeypatch.undo()
    assert buffered(warehouse) == {"m1"}, "m0's row is gone"
    index.forget(state.trim(state.events[-1].seq))
    fresh = TopicIndex(warehouse, topic_conf())
    fresh.load()
    assert fresh.revive(state) == 1, "from its dead letter"
    picks = listed(fresh.pick(state, state.buckets_of("c"), 2, now=now_ms()))
    assert [p[0] for p in picks] == ["m0", "m1"]
    past = now_ms() + HOUR + retention.WATERMARK_STEP_MS  # its span holds the redrive
    monkeypatch.setattr(retention, "restore", failing)
    with pytest.raises(OSError):
        retain(buffer, ledger, HOUR, past, None, dead)
    monkeypatch.undo()
    assert watermark(DeltaTable(buffer)) < redriven_at[0], "that run failed: no watermark"
    code = (
        "import sys; from dejaq.pipelines.retention import retain; "
        "retain(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), None, sys.argv[5])"
    )
    args = [buffer, ledger, str(HOUR), str(past), dead]
    subprocess.run([sys.executable, "-c", code, *args], check=True, timeout=120)
    assert watermark(DeltaTable(buffer)) > redriven_at[0], "past the redrive"
    assert buffered(warehouse) == {"m0", "m1"}, "the run put m0's row back"
    again = TopicIndex(warehouse, topic_conf())
    again.load()
    assert sorted(again.rows) == ["m0", "m1"]


def test_a_restored_row_read_after_its_message_settled_leaves_it_settled(tmp_path: Path) -> None:
    """A node indexes a redriven message from its dead letter; the leader restores its
    row; the message is leased, acked, checkpointed and forgotten before the node reads
    the restore's version: the row is not indexed again as pending."""
    warehouse, index, state = loaded_topic(tmp_path, [4, 9])
    state.lease("c", 0, 100, [("m0", 0, 4)])
    state.reject("c", 1, ["m0"])
    index.forget(state.trim(checkpoint(warehouse, "jobs", state.events, buffer_names(warehouse))))
    assert run(warehouse, now_ms()) is not None and buffered(warehouse) == {"m1"}
    index.refresh()
    assert state.redrive(2, state.trimmed_upto(), [("m0", 0, 4)]) == (["m0"], {})
    index.push(state, [mh("m0")])
    assert index.revive(state) == 1, "from its dead letter"
    checkpoint(warehouse, "jobs", state.events, buffer_names(warehouse))
    buffer, dead = (ensure_table(warehouse, t, "jobs") for t in (Table.BUFFER, Table.DEAD_LETTER))
    assert retention.restore(buffer, dead, ["m0"], now_ms()) == 1
    picks = listed(index.pick(state, state.buckets_of("c"), 1, now=3))
    assert picks == [("m0", 0, 4)]
    assert len(state.lease("c", 3, 100, picks)) == 1
    index.release(state, as_picks(picks))
    assert state.ack("c", 4, ["m0"]) == {}
    index.forget(state.trim(checkpoint(warehouse, "jobs", state.events, buffer_names(warehouse))))
    index.refresh()
    assert [m for m, _, _ in listed(index.pick(state, state.buckets_of("c"), 5, now=5))] == ["m1"]


def sealed_history(warehouse: str, before_ms: int) -> list[Path]:
    """Acks of other messages a month before `before_ms`, appended as checkpoints and
    sealed into one file, as maintenance leaves a ledger's history: a sealed file has no
    string statistics, so no filter on `event` or `message_id` skips it. Its files."""
    long_ago = before_ms - 30 * 24 * HOUR
    for n in range(SEAL_MIN_FILES):
        record(warehouse, [(f"old{n}-{i}", "acked", long_ago + n) for i in range(50)])
    ledger = ensure_table(warehouse, Table.LEDGER, "jobs")
    assert seal(ledger, "at", long_ago + HOUR) is not None
    adds = pa.table(DeltaTable(ledger).get_add_actions(flatten=True))
    assert adds.column("min.event").to_pylist() == [None], "nothing to skip the file by"
    return [Path(ledger) / path for path in adds.column("path").to_pylist()]


def test_a_redrive_reads_the_ledger_from_the_earliest_death_it_names_on(tmp_path: Path) -> None:
    """A redrive of one id costs the time since its death, not the ledger's history: its
    dead letter names it, and the ledger is read from that death on (less the clock
    skew). The history before is deleted from disk: reading any of it would fail."""
    warehouse, index, state = loaded_topic(tmp_path, [5, 1])
    now = now_ms()
    history = sealed_history(warehouse, now)
    state.lease("c", now, 1000, [("m1", 1, 1)])
    state.reject("c", now + 1, ["m1"])
    index.forget(state.trim(checkpoint(warehouse, "jobs", state.events, buffer_names(warehouse))))
    for path in history:
        path.unlink()
    upto, found, redriven = index.dead(["m1"])
    assert (found, redriven) == ({"m1": (1, 1)}, {})
    assert state.redrive(now + 2, upto, [("m1", *found["m1"])]) == (["m1"], {})
    index.forget(state.trim(checkpoint(warehouse, "jobs", state.events, buffer_names(warehouse))))
    assert index.dead(["m1"])[1] == {} and set(index.dead(["m1"])[2]) == {"m1"}, "redriven"
    assert index.dead(["m0"])[1:] == ({}, {}), "never died"
    assert index.dead(None)[1] == {} and set(index.dead(None)[2]) == {"m1"}


def test_a_death_trimmed_while_a_redrive_reads_the_tables_is_still_redriven(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tables know a death by its dead letter. A checkpoint that has written the death
    to the ledger writes its dead letter only after the redrive has read them, and trims
    the death from Raft before the redrive reads the state's events: the redrive still
    finds it, in the events it read before the tables."""
    import threading

    from dejaq.broker.service import Broker
    from dejaq.broker.storage import checkpoints

    read = threading.Event()
    real_write = checkpoints.write_dead_letters

    def after_the_read(*args: object) -> None:
        assert read.wait(30), "the redrive read the tables"
        real_write(*args)

    monkeypatch.setattr(checkpoints, "write_dead_letters", after_the_read)

    async def scenario(broker: Broker) -> tuple[int, dict]:
        leased = json.loads(await broker.lease("jobs", "w", 1, 60_000, 0))
        assert [m["id"] for m in leased] == ["m1"]
        index, st = broker.indexes["jobs"], broker.state("jobs")
        real_dead = index.dead

        def then_trimmed(*args: object) -> tuple:
            answer = real_dead(*args)
            read.set()
            wait_until(lambda: not any(e.mh == mh("m1") for e in st.events), what="trim")
            return answer

        index.dead = then_trimmed
        await broker.settle("jobs", "reject", "w", ["m1"])
        ledger = ensure_table(broker.settings.warehouse, Table.LEDGER, "jobs")
        await _until(lambda: DeltaTable(ledger).version() > 0, "the death in the ledger")
        return await broker.redrive("jobs", ["m1"], None, None)

    assert on_one_node(tmp_path, scenario) == (1, {})


def test_a_second_death_trimmed_while_a_redrive_reads_the_tables_is_still_redriven(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message died, was redriven, and died again. A redrive reads the tables before
    the checkpoint writes the second death (they show the first redrive last), and the
    checkpoint trims it from Raft before the redrive reads the state's events again: the
    death it read before the tables, later than that redrive, still stands."""
    import threading

    from dejaq.broker.service import Broker
    from dejaq.broker.storage import checkpoints

    read, gate = threading.Event(), threading.Event()
    real_write = checkpoints.write_ledger

    def after_the_read(*args: object) -> int:
        if gate.is_set():
            assert read.wait(30), "the redrive read the tables"
        return real_write(*args)

    monkeypatch.setattr(checkpoints, "write_ledger", after_the_read)

    async def scenario(broker: Broker) -> tuple[tuple, tuple]:
        index, st = broker.indexes["jobs"], broker.state("jobs")

        async def lease_and_reject() -> None:
            await _until(lambda: "m1" in index.rows or mh("m1") in index.unread, "m1 pending")
            leased: list = []
            while not leased:
                leased = json.loads(await broker.lease("jobs", "w", 1, 60_000, 0))
            assert [m["id"] for m in leased] == ["m1"]
            await broker.settle("jobs", "reject", "w", ["m1"])

        def trimmed() -> bool:
            return not any(e.mh == mh("m1") for e in st.events)

        await lease_and_reject()
        await _until(trimmed, "the first death checkpointed")
        first = await broker.redrive("jobs", ["m1"], None, None)
        await _until(trimmed, "the redrive checkpointed")
        real_dead = index.dead

        def then_trimmed(*args: object) -> tuple:
            answer = real_dead(*args)
            read.set()
            wait_until(trimmed, what="the second death trimmed")
            return answer

        index.dead = then_trimmed
        gate.set()
        await lease_and_reject()
        return first, await broker.redrive("jobs", ["m1"], None, None)

    first, second = on_one_node(tmp_path, scenario)
    assert first == (1, {})
    assert second == (1, {}), "redriven again, not refused as already redriven"


def test_a_snapshot_reads_the_ledger_for_a_row_gone_from_its_ingestion_on(
    tmp_path: Path,
) -> None:
    """A lagging node holds a row retention removed (its ack's trim never reached the
    node): the ledger is read for it from the row's ingestion on (less the clock skew),
    not from its start. The history before is deleted from disk: reading any of it would
    fail."""
    warehouse, lagging, leader = loaded_topic(tmp_path, [5, 1])
    now = now_ms()
    history = sealed_history(warehouse, now)
    leader.lease("c", now, 1000, [("m1", 1, 1)])
    assert leader.ack("c", now + 1, ["m1"]) == {}
    leader.trim(checkpoint(warehouse, "jobs", leader.events, buffer_names(warehouse)))
    assert run(warehouse, now + 2 * HOUR) is not None
    assert buffered(warehouse) == {"m0"} and lagging.refresh() == 0
    assert sorted(lagging.rows) == ["m0", "m1"]
    for path in history:
        path.unlink()
    lagging.rebuild(pickle.loads(pickle.dumps(leader)))
    assert sorted(lagging.rows) == ["m0"] and lagging.unread == {}


def test_first_per_id_of_no_rows_is_no_rows() -> None:
    empty = ledger_rows([])
    assert retention.first_per_id(empty).num_rows == 0
    rows = ledger_rows([("a", "dead", 1), ("b", "dead", 2), ("a", "dead", 3)])
    assert retention.first_per_id(rows).column("at").to_pylist() == [
        r["at"] for r in rows.to_pylist()[:2]
    ]
