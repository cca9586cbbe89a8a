"""The release job under retention: its costs follow what is pending, not history.

Real Delta tables and real Kafka: released messages leave the buffer, a restart reads
the ledger's tail only and releases nothing twice, and neither the pending set nor the
buffer follower keeps anything per message that has left.
"""

from __future__ import annotations

import datetime as dt
import os
from collections import Counter
from pathlib import Path
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable, write_deltalake
from test_release import Output, add_buffer, add_ledger, ids, run_until, settings_for
from test_retention import VersionedOpens, expire_log

from dejaq.conf import table_watch
from dejaq.conf.tables import (
    BUFFER_SCHEMA,
    LEDGER_SCHEMA,
    TIMESTAMP,
    LedgerEvent,
    Table,
    ensure_table,
    scan,
)
from dejaq.pipelines import delta_follower
from dejaq.pipelines.compaction import compact
from dejaq.pipelines.delta_follower import DeltaFollower
from dejaq.pipelines.pending import HEAP_SLACK, PendingSet
from dejaq.pipelines.release import Releaser
from dejaq.pipelines.retention import LogGap, retain, watermark

T0 = dt.datetime(2026, 11, 21, tzinfo=dt.UTC)


def rows(mids: list[str], sort_key: int = 5) -> pa.Table:
    """Buffer rows, in memory, as the follower hands them over."""
    n = len(mids)
    return pa.table(
        {
            "message_id": mids,
            "bucket": [0] * n,
            "sort_key": [sort_key] * n,
            "priority": [sort_key] * n,
            "deliver_at": [None] * n,
            "event_time": [None] * n,
            "key": [None] * n,
            "payload": [b"p"] * n,
            "headers": [[]] * n,
            "source_topic": ["in"] * n,
            "source_partition": [0] * n,
            "source_offset": list(range(n)),
            "produced_at": [T0] * n,
            "ingested_at": [T0] * n,
        },
        schema=BUFFER_SCHEMA,
    )


def events(mids: list[str], event: str, seconds: int = 0, sort_key: int | None = None) -> pa.Table:
    n = len(mids)
    at = T0 + dt.timedelta(seconds=seconds)
    return pa.table(
        {
            "message_id": mids,
            "bucket": [0] * n,
            "event": [event] * n,
            "sort_key": [sort_key] * n,
            "deliveries": [1] * n,
            "at": [at] * n,
        },
        schema=LEDGER_SCHEMA,
    )


def ms(seconds: int) -> int:
    return int((T0 + dt.timedelta(seconds=seconds)).timestamp() * 1000)


def test_the_pending_set_keeps_no_id_of_a_message_that_has_left() -> None:
    """100,000 released and read back from the ledger: nothing of them stays; stale
    heap entries of cancelled messages do not pile up either."""
    pending = PendingSet()
    mids = [f"m{i}" for i in range(100_000)]
    pending.add_buffer_rows(rows(mids))
    taken = pending.take(len(mids))
    pending.settle(taken)
    assert len(pending) == 0 and pending.remembered == len(mids), "until read back"
    pending.apply_ledger_rows(events(mids, LedgerEvent.RELEASED))
    assert pending.remembered == 0

    # Repeated events find no row: kept until the retention watermark passes them.
    pending.apply_ledger_rows(events(mids[:1000], LedgerEvent.CANCELLED, seconds=10))
    assert pending.remembered == 1000
    pending.forget_before(ms(11))
    assert pending.remembered == 0
    pending.apply_ledger_rows(events(["late"], LedgerEvent.CANCELLED, seconds=5))
    assert pending.remembered == 0, "an event before the watermark has no row to wait for"

    live = [f"n{i}" for i in range(10_000)]
    pending.add_buffer_rows(rows(live))
    pending.apply_ledger_rows(events(live[:9000], LedgerEvent.CANCELLED, seconds=20))
    assert len(pending) == 1000 and pending.remembered == 0
    assert len(pending._heap) <= 2 * len(pending) + HEAP_SLACK
    assert [m.message_id for m in pending.take(5)] == live[9000:9005]


def test_an_event_ahead_of_its_row_settles_or_moves_it_when_the_row_comes() -> None:
    pending = PendingSet()
    pending.apply_ledger_rows(events(["c1", "c2"], LedgerEvent.CANCELLED, seconds=1))
    pending.apply_ledger_rows(events(["r"], LedgerEvent.RESCHEDULED, seconds=3, sort_key=7))
    pending.apply_ledger_rows(events(["r"], LedgerEvent.RESCHEDULED, seconds=2, sort_key=9))
    assert pending.remembered == 3
    added = pending.add_buffer_rows(rows(["c1", "r", "x"], sort_key=100))
    assert [m.message_id for m in added] == ["r", "x"], "the cancel came first"
    assert added[0].sort_key == 7, "the latest reschedule wins, whatever the read order"
    assert pending.remembered == 1, "c2's row has not come"
    pending.apply_ledger_rows(events(["r"], LedgerEvent.RESCHEDULED, seconds=2, sort_key=1))
    assert pending.next_sort_key() == 7, "an older reschedule does not win"
    pending.apply_ledger_rows(events(["r"], LedgerEvent.RESCHEDULED, seconds=4, sort_key=1))
    assert pending.next_sort_key() == 1
    # Once retention has passed the cancel, its row is not coming any more, and the
    # id is forgotten: a row that comes later all the same is pending (and retention,
    # which reads the ledger from its watermark on, keeps it too).
    pending.forget_before(ms(2))
    assert pending.remembered == 0
    assert [m.message_id for m in pending.add_buffer_rows(rows(["c2"]))] == ["c2"]


def test_a_message_whose_latest_event_is_a_redrive_is_pending_at_its_key() -> None:
    """A topic the broker delivered before: its ledger holds deaths and the redrives
    that made them pending again, read in one go, in any order. A redrive after the
    death is pending, at the redrive's key, with or without its row read yet (at equal
    times it follows the death); a death after a redrive, or an ack, settles."""
    pending = PendingSet()
    pending.add_buffer_rows(rows(["back", "dead", "acked"], sort_key=50))
    ledger = pa.concat_tables(
        [
            events(["back", "early", "same"], LedgerEvent.REDRIVEN, seconds=2, sort_key=3),
            events(["dead"], LedgerEvent.REDRIVEN, seconds=1, sort_key=2),
            events(["back", "dead", "acked", "early"], LedgerEvent.DEAD, seconds=1),
            events(["same"], LedgerEvent.DEAD, seconds=2),
            events(["dead"], LedgerEvent.DEAD, seconds=3),
            events(["acked"], LedgerEvent.REDRIVEN, seconds=2, sort_key=1),
            events(["acked"], LedgerEvent.ACKED, seconds=4),
        ]
    )
    pending.apply_ledger_rows(ledger)
    assert len(pending.add_buffer_rows(rows(["early", "same"], sort_key=90))) == 2
    taken = pending.take(10)
    assert [(m.message_id, m.sort_key) for m in taken] == [
        ("back", 3),
        ("early", 3),
        ("same", 3),
    ]


def test_a_settle_in_its_redrive_s_millisecond_settles_the_message() -> None:
    """A redrive and the cancel or ack after it can share a millisecond (the broker's
    times, before a topic moves to release): nothing follows those, so the message is
    settled, in whichever order the rows come."""
    pending = PendingSet()
    pending.add_buffer_rows(rows(["cancelled", "acked", "back"], sort_key=50))
    ledger = pa.concat_tables(
        [
            events(["cancelled"], LedgerEvent.CANCELLED, seconds=2),
            events(["acked"], LedgerEvent.ACKED, seconds=2),
            events(["cancelled", "acked", "back"], LedgerEvent.REDRIVEN, seconds=2, sort_key=3),
            events(["cancelled", "acked", "back"], LedgerEvent.DEAD, seconds=1),
        ]
    )
    pending.apply_ledger_rows(ledger)
    assert [m.message_id for m in pending.take(10)] == ["back"]


def test_the_follower_reads_each_row_once_through_compactions_and_retention(tmp_path) -> None:
    """Rewritten files are seen, not read, even when a compaction replaces appended
    files the follower has not read yet; it holds the paths of one version only."""
    s = settings_for(tmp_path, "127.0.0.1:1", "priority", "out")
    path = ensure_table(s.warehouse, Table.BUFFER, "jobs")
    follower = DeltaFollower(path, BUFFER_SCHEMA)
    first = add_buffer(s, "priority", list(range(10)))
    first += add_buffer(s, "priority", list(range(10)), first_offset=10)
    assert sorted(follower.poll()["message_id"].to_pylist()) == sorted(first)

    compact(path)  # rewrites what the follower read
    later = add_buffer(s, "priority", list(range(10)), first_offset=20)
    assert sorted(follower.poll()["message_id"].to_pylist()) == sorted(later)
    more = add_buffer(s, "priority", list(range(10)), first_offset=30)
    more += add_buffer(s, "priority", list(range(10)), first_offset=40)
    compact(path)  # rewrites appends the follower has not read: they are read once
    assert sorted(follower.poll()["message_id"].to_pylist()) == sorted(more)

    settled = first[:15]
    add_ledger(s, [(mid, LedgerEvent.RELEASED, None) for mid in settled])
    ledger = ensure_table(s.warehouse, Table.LEDGER, "jobs")
    now_ms = int(dt.datetime.now(dt.UTC).timestamp() * 1000)
    assert retain(path, ledger, 0, now_ms + 1000).removed == len(settled)
    assert follower.poll().num_rows == 0, "a retention run's files hold no new row"
    current = DeltaTable(path)
    assert follower.files == set(pa.table(current.get_add_actions()).column("path").to_pylist())

    fresh = DeltaFollower(path, BUFFER_SCHEMA)  # a start: reads MERGE-written files too
    held = fresh.poll()
    assert sorted(held["message_id"].to_pylist()) == sorted(set(first + later + more) - {*settled})
    assert held.schema == BUFFER_SCHEMA


def behind_a_compaction(tmp_path: Path, n: int) -> tuple[str, DeltaFollower, list[str], list[str]]:
    """A buffer and a follower that read its first `n` rows, then `n` more appended and
    the table compacted: (path, follower, first ids, later ids)."""
    s = settings_for(tmp_path, "127.0.0.1:1", "priority", "out")
    path = ensure_table(s.warehouse, Table.BUFFER, "jobs")
    follower = DeltaFollower(path, BUFFER_SCHEMA)
    first = add_buffer(s, "priority", list(range(n)))
    assert sorted(follower.poll()["message_id"].to_pylist()) == sorted(first)
    later = add_buffer(s, "priority", list(range(n)), first_offset=n)
    compact(path)
    return path, follower, first, later


def test_a_follower_further_behind_than_the_log_stops_with_an_error_a_start_gets_past(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release job's follower cannot tell which of the versions the log no longer
    holds were rewrites: its poll says so (the job then reads afresh), and a follower that
    starts again reads each row once."""
    monkeypatch.setattr(table_watch, "CHECKPOINT_PROBE_S", 0.0)
    path, follower, first, later = behind_a_compaction(tmp_path, 10)
    assert expire_log(path) > follower.version + 1
    with pytest.raises(LogGap, match="a start reads the table afresh"):
        follower.poll()
    fresh = DeltaFollower(path, BUFFER_SCHEMA)
    assert sorted(fresh.poll()["message_id"].to_pylist()) == sorted(first + later)


def test_a_follower_behind_a_rewrite_walks_the_log_entries_not_a_snapshot_each(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A follower that missed appends and a compaction of them takes each version's
    files from its log entry, as `get_add_actions` names them (partition values and
    file names percent-encoded alike), with their statistics: no snapshot per version,
    each appended row read once, a file whose rows are all before `since_ms` not read."""
    path = str(tmp_path / "t")
    schema = pa.schema([("id", pa.int64()), ("k", pa.string()), ("ts", TIMESTAMP)])
    odd = "a b/c%d=é"

    def append(i: int, k: str, at: dt.datetime) -> None:
        rows = pa.table({"id": [i], "k": [k], "ts": [at]}, schema=schema)
        write_deltalake(path, rows, mode="append", partition_by=["k"])

    append(0, odd, T0)
    follower = DeltaFollower(path, schema, time_column="ts")
    assert follower.poll()["id"].to_pylist() == [0]
    append(1, odd, T0 - dt.timedelta(hours=1))
    append(2, odd, T0)
    append(3, "x=y", T0)
    assert DeltaTable(path).optimize.compact()["numFilesRemoved"] == 3  # 0, 1 and 2
    opens = VersionedOpens(delta_follower, monkeypatch)
    read = follower.files_read
    since_ms = int(T0.timestamp() * 1000) - 1
    held = follower.poll(since_ms=since_ms)
    assert opens.count == 0, "no snapshot of a version between"
    assert follower.files_read - read == 2, "2 and 3; 1 is before since_ms, 0 was read"
    assert sorted(held.to_pylist(), key=lambda r: r["id"]) == [
        {"id": 2, "k": odd, "ts": T0},
        {"id": 3, "k": "x=y", "ts": T0},
    ]
    current = DeltaTable(path)
    assert follower.files == set(pa.table(current.get_add_actions()).column("path").to_pylist())
    assert follower.poll().num_rows == 0


def test_a_follower_whose_unread_files_were_vacuumed_or_rewritten_untagged_reads_afresh(
    tmp_path,
) -> None:
    """A file a version the follower has not read added, compacted and vacuumed since
    while the log still names it, is a gap too (not a crash at each poll); so is a
    commit that replaced files without a DejaQ rewrite's tag (a DELETE by hand), whose
    rows the follower cannot tell new from old: a start reads each row once."""
    path, follower, first, later = behind_a_compaction(tmp_path, 4)
    DeltaTable(path).vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)
    with pytest.raises(LogGap, match="was vacuumed since"):
        follower.poll()
    follower = DeltaFollower(path, BUFFER_SCHEMA)
    assert sorted(follower.poll()["message_id"].to_pylist()) == sorted(first + later)
    DeltaTable(path).delete(f"message_id = '{first[0]}'")
    with pytest.raises(LogGap, match="without a DejaQ rewrite's tag"):
        follower.poll()
    fresh = DeltaFollower(path, BUFFER_SCHEMA)
    assert sorted(fresh.poll()["message_id"].to_pylist()) == sorted(first[1:] + later)


@pytest.mark.parametrize("kind", ["priority", "timeline"])
def test_a_release_job_further_behind_than_the_log_reads_the_tables_afresh_and_goes_on(
    kafka_bootstrap, topic_factory, tmp_path, monkeypatch, caplog, kind
):
    """A job frozen for longer than the buffer keeps its log does not stop: it reads the
    tables as a start does, and releases every message once, those its timed sender
    held across the gap too."""
    monkeypatch.setattr(table_watch, "CHECKPOINT_PROBE_S", 0.0)
    out = topic_factory(partitions=2)
    s = settings_for(tmp_path, kafka_bootstrap, kind, out, max_per_trigger=15)
    buffer_path = ensure_table(s.warehouse, Table.BUFFER, "jobs")
    first = add_buffer(s, kind, [i % 50 for i in range(40)])
    releaser = Releaser(s, s.topic("jobs"))
    output = Output(kafka_bootstrap, out, 2)
    try:
        releaser.run_batch(0)
        assert 0 < len(releaser.pending) < len(first)
        later = add_buffer(s, kind, [7] * 10, first_offset=100)
        compact(buffer_path)
        assert expire_log(buffer_path) > releaser.buffer.version + 1
        run_until(releaser, lambda: not len(releaser.pending) and releaser.idle, first=1)
        records = output.wait_for(len(first) + len(later))
        output.poll()
        assert releaser.pending.remembered == 0
    finally:
        releaser.finish()
        output.close()
    assert "reading the tables afresh" in caplog.text
    seen = Counter(ids(records))
    assert set(seen) == set(first + later), "nothing lost"
    assert max(seen.values()) == 1, "nothing released twice"


def test_a_re_read_after_a_gap_counts_late_only_the_events_new_to_the_job(
    kafka_bootstrap, topic_factory, tmp_path, monkeypatch, caplog
):
    """Reading the tables afresh keeps the event-time watermark, and re-reads the rows
    of events released or pending before the gap: late are only the events that came
    behind the watermark during the gap, each released once."""
    monkeypatch.setattr(table_watch, "CHECKPOINT_PROBE_S", 0.0)
    out = topic_factory(partitions=1)
    s = settings_for(
        tmp_path, kafka_bootstrap, "event_time", out, allowed_lateness_ms=100, max_per_trigger=5
    )
    buffer_path = ensure_table(s.warehouse, Table.BUFFER, "jobs")
    first = add_buffer(s, "event_time", [1000 + i for i in range(20)] + [2000])
    releaser = Releaser(s, s.topic("jobs"))
    output = Output(kafka_bootstrap, out, 1)
    try:
        stats = [releaser.run_batch(0), releaser.run_batch(1)]
        assert [st.released for st in stats] == [5, 5], "the first 5 read back, 5 not yet"
        late = add_buffer(s, "event_time", [1500], first_offset=100)
        compact(buffer_path)
        assert expire_log(buffer_path) > releaser.buffer.version + 1
        stats.append(releaser.run_batch(2))
        assert "reading the tables afresh" in caplog.text
        assert stats[-1].late == 1, "only the event that came during the gap"
        run_until(releaser, lambda: len(releaser.pending) == 1 and releaser.idle, first=3)
        records = output.wait_for(len(first) - 1 + len(late))
        output.poll()
    finally:
        releaser.finish()
        output.close()
    assert sum(st.late for st in releaser.stats) == 1
    seen = Counter(ids(records))
    assert set(seen) == set(first[:-1] + late), "all but 2000, the newest, held"
    assert max(seen.values()) == 1, "nothing released twice"


@pytest.mark.parametrize("kind", ["priority", "timeline"])
def test_released_messages_leave_the_buffer_and_a_restart_reads_only_the_ledger_tail(
    kafka_bootstrap, topic_factory, tmp_path, kind
):
    """On a timeline the timed sender's messages are recorded a batch later, still
    after every retention cutoff (sort keys 0..49: due since 1970)."""
    out = topic_factory(partitions=2)
    s = settings_for(
        tmp_path, kafka_bootstrap, kind, out, max_per_trigger=15, settled_retention_ms=10_000
    )
    topic = s.topic("jobs")
    buffer_path = ensure_table(s.warehouse, Table.BUFFER, "jobs")
    ledger_path = ensure_table(s.warehouse, Table.LEDGER, "jobs")

    def buffered() -> set[str]:
        return set(scan(buffer_path, Table.BUFFER, ["message_id"])[0].to_pylist())

    first = add_buffer(s, kind, [i % 50 for i in range(40)])
    chunks = iter(range(8))
    arrived: list[str] = []
    releaser = Releaser(s, topic)
    output = Output(kafka_bootstrap, out, 2)
    try:

        def step() -> bool:
            """New rows keep coming while the job releases and retention runs."""
            chunk = next(chunks, None)
            if chunk is not None:
                offset = 1000 + 10 * chunk
                arrived.extend(add_buffer(s, kind, [chunk] * 10, first_offset=offset))
                return False
            return not len(releaser.pending) and not set(first) & buffered()

        run_until(releaser, step, timeout=90)
        removed = sum(st.retention.removed for st in releaser.stats if st.retention)
        assert removed >= len(first), "released messages left the buffer"
        assert buffered() <= set(arrived)
        # The last ones are released just before the job stops: still in the buffer (their
        # retention is 10 s away, ample for a loaded machine).
        recent = add_buffer(s, kind, [0] * 10, first_offset=2000)
        next_batch = releaser.stats[-1].batch_id + 1
        run_until(releaser, lambda: not len(releaser.pending) and releaser.idle, first=next_batch)
        assert releaser.pending.remembered == 0, "nothing kept of what was released"
    finally:
        releaser.finish()
    released = first + arrived + recent
    assert set(recent) <= buffered()

    # A restart after retention: the ledger before the buffer's watermark is history,
    # so its files are deleted from disk; the job must not need them.
    since = watermark(DeltaTable(buffer_path))
    adds = pa.table(DeltaTable(ledger_path).get_add_actions(flatten=True))
    old = adds.filter(pc.less(adds["max.at"].cast(TIMESTAMP), pa.scalar(since * 1000, TIMESTAMP)))
    for path in old.column("path").to_pylist():
        os.remove(os.path.join(ledger_path, unquote(path)))
    assert 0 < old.num_rows < adds.num_rows
    waiting = add_buffer(s, kind, [3] * 12, first_offset=3000)
    again = Releaser(s, topic)
    try:
        next_batch = releaser.stats[-1].batch_id + 1  # the query's checkpoint goes on
        run_until(again, lambda: not len(again.pending) and again.idle, first=next_batch)
        records = output.wait_for(len(released) + len(waiting))
        output.poll()
        assert again.pending.remembered == 0
    finally:
        again.finish()
        output.close()
    appended = sum(1 for st in again.stats if st.released)
    assert again.ledger.files_read == adds.num_rows - old.num_rows + appended, "the tail only"
    assert sum(st.released for st in again.stats) == len(waiting)
    seen = Counter(ids(records))
    assert set(seen) == set(released + waiting), "nothing lost"
    assert max(seen.values()) == 1, "nothing released twice"
