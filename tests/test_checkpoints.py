"""A checkpoint writes what it can: a dead letter that cannot be written holds back no
ack, stays in Raft for the next try, and shows as lag."""

from __future__ import annotations

import logging
import pickle
import shutil
import threading
import time
from pathlib import Path

import pytest
from conftest import wait_until
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from test_broker import TEST_IDS, listed, loaded_topic

from dejaq.broker.state.handles import mh
from dejaq.broker.state.leases import TopicState
from dejaq.broker.state.settlements import Settlement
from dejaq.broker.storage import ledger_writer
from dejaq.broker.storage.checkpoints import Health, Lag, checkpoint, lag
from dejaq.broker.storage.ledger_writer import (
    Claimed,
    Contested,
    Rival,
    compact_dead_letters,
    compact_ledger,
    foreign,
    write_dead_letters,
    write_ledger,
)
from dejaq.conf.tables import (
    LEDGER_SCHEMA,
    TABLE_PROPERTIES,
    LedgerEvent,
    Table,
    ensure_table,
    scan,
    table_path,
)

HOUR_MS = 3_600_000  # a topic's settled retention, as it defaults
NAMES = TEST_IDS.names  # the events' messages, by the ids these tests write


def acked(seq: int) -> Settlement:
    """An ack of message f"m{seq}" at seq `seq`."""
    return Settlement(seq, mh(f"m{seq}"), 0, "acked", 0, 1, seq)


def test_a_dead_letter_that_cannot_be_written_holds_back_nothing_else(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    warehouse, index, state = loaded_topic(tmp_path, [1, 2, 3, 4])
    picks = listed(index.pick(state, state.buckets_of("c"), 4, now=0))
    state.lease("c", 0, 1000, picks)
    assert state.reject("c", 1, ["m0"]) == {}
    assert state.ack("c", 1, ["m1", "m2"]) == {}
    # A real failure of the store under the dead letters: their table's folder is a file.
    dead_path = Path(table_path(warehouse, Table.DEAD_LETTER, "jobs"))
    shutil.rmtree(dead_path)
    dead_path.write_text("not a Delta table")
    health = Health()
    with caplog.at_level(logging.WARNING, "dejaq.broker.storage.checkpoints"):
        upto, keep = checkpoint(warehouse, "jobs", list(state.events), NAMES, health)
    death = next(e.seq for e in state.events if e.mh == mh("m0"))
    assert keep == [death]
    index.forget(state.trim(upto, keep))
    ledger = scan(table_path(warehouse, Table.LEDGER, "jobs"), Table.LEDGER)
    events = zip(ledger["message_id"].to_pylist(), ledger["event"].to_pylist(), strict=True)
    assert sorted(events) == [
        ("m0", LedgerEvent.DEAD),
        ("m1", LedgerEvent.ACKED),
        ("m2", LedgerEvent.ACKED),
    ], "the acks are written, and the death"
    assert [e.mh for e in state.events] == [mh("m0")], "only the death stays in Raft"
    assert state.trimmed_upto() == upto
    assert lag(state) == Lag(events=0, oldest_ms=None, unwritten_dead_letters=1)
    assert health.failures == 1 and health.streak == 1
    assert [r.getMessage() for r in caplog.records if "m0" in r.getMessage()] != []

    # Later events are written and trimmed while the death waits; no second log line.
    assert state.ack("c", 2, ["m3"]) == {}
    assert lag(state) == Lag(events=1, oldest_ms=2, unwritten_dead_letters=1)
    caplog.clear()
    upto, keep = checkpoint(warehouse, "jobs", list(state.events), NAMES, health)
    index.forget(state.trim(upto, keep))
    assert keep == [death] and [e.mh for e in state.events] == [mh("m0")]
    assert not [r for r in caplog.records if "m0" in r.getMessage()], "logged once"
    assert health.alert() is None, "not failing for minutes yet"

    dead_path.unlink()  # the store is back: the next try after the backoff writes it

    def retried() -> bool:
        upto, keep = checkpoint(warehouse, "jobs", list(state.events), NAMES, health)
        index.forget(state.trim(upto, keep))
        if not keep:  # the round went through, its trim too: the broker ends the streak
            health.ok()
        return not keep

    wait_until(retried, timeout=10, what="the dead letter written after the backoff")
    assert state.events == [] and health.streak == 0
    assert lag(state) == Lag(events=0, oldest_ms=None, unwritten_dead_letters=0)
    dead = scan(str(dead_path), Table.DEAD_LETTER)
    assert dead["message_id"].to_pylist() == ["m0"]
    assert dead["payload"].to_pylist() == [b"payload-m0"]
    ledger = scan(table_path(warehouse, Table.LEDGER, "jobs"), Table.LEDGER)
    assert ledger.num_rows == 4, "no ledger row written twice"


def test_lag_counts_events_not_yet_checkpointed(tmp_path: Path) -> None:
    _, index, state = loaded_topic(tmp_path, [1, 2])
    now = int(time.time() * 1000)
    state.lease("c", now, 1000, listed(index.pick(state, state.buckets_of("c"), 2, now=now)))
    assert state.ack("c", now, ["m0", "m1"]) == {}
    assert lag(state) == Lag(events=2, oldest_ms=now, unwritten_dead_letters=0)


def test_a_deposed_leaders_late_dead_letters_are_refused_then_found_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leader stopped between reading the dead letters' tag and writing them resumes
    after its successor wrote the same deaths: its commit is refused, not added twice,
    and its second attempt, from a new snapshot, finds them written, adds nothing and
    raises nothing. The stop is placed with a wrapper around the buffer read, the one
    step between."""
    warehouse, index, state = loaded_topic(tmp_path, [1, 2])
    state.lease("c", 0, 1000, listed(index.pick(state, state.buckets_of("c"), 2, now=0)))
    assert state.reject("c", 1, ["m0", "m1"]) == {}
    events = list(state.events)
    write_ledger(warehouse, "jobs", events, NAMES)
    reading, resume = threading.Event(), threading.Event()
    read_rows = ledger_writer._dead_letters

    def stopped_while_reading(*args):
        rows = read_rows(*args)
        if threading.current_thread().name == "deposed":
            reading.set()
            assert resume.wait(30)
        return rows

    monkeypatch.setattr(ledger_writer, "_dead_letters", stopped_while_reading)
    refused: list[BaseException] = []
    write = ledger_writer.write_deltalake

    def counted(*args, **kwargs):
        try:
            return write(*args, **kwargs)
        except Exception as e:
            refused.append(e)
            raise

    monkeypatch.setattr(ledger_writer, "write_deltalake", counted)
    failed: list[BaseException] = []

    def deposed() -> None:
        try:
            write_dead_letters(warehouse, "jobs", events, NAMES)
        except Exception as e:
            failed.append(e)

    old = threading.Thread(target=deposed, name="deposed")
    old.start()
    assert reading.wait(30)
    write_dead_letters(warehouse, "jobs", events, NAMES)  # the successor
    resume.set()
    old.join(30)
    assert failed == []
    assert [type(e).__name__ for e in refused] == ["CommitFailedError"]
    dead = scan(table_path(warehouse, Table.DEAD_LETTER, "jobs"), Table.DEAD_LETTER)
    assert sorted(dead["message_id"].to_pylist()) == ["m0", "m1"]


def test_dead_letters_are_compacted_and_keep_their_checkpoint_tags(tmp_path: Path) -> None:
    """Each checkpoint with a death adds a dead-letter file, and every open of the table
    reads every file's entry: compacted, it reads the same, and a checkpoint replayed
    after it writes no dead letter twice."""
    warehouse, index, state = loaded_topic(tmp_path, list(range(6)))
    batches = []
    for i in range(6):
        state.lease("c", i, 1000, listed(index.pick(state, state.buckets_of("c"), 1, now=i)))
        assert state.reject("c", i, [f"m{i}"]) == {}
        batches.append(list(state.events))
        index.forget(state.trim(ledger_writer.checkpoint(warehouse, "jobs", state.events, NAMES)))
    path = table_path(warehouse, Table.DEAD_LETTER, "jobs")
    before = scan(path, Table.DEAD_LETTER).sort_by("message_id")
    assert before["message_id"].to_pylist() == [f"m{i}" for i in range(6)]
    assert len(DeltaTable(path).file_uris()) == 6
    done = compact_dead_letters(warehouse, "jobs", HOUR_MS)
    assert done is not None and (done.files_removed, done.files_added) == (6, 1)
    assert DeltaTable(path).metadata().configuration == TABLE_PROPERTIES
    assert scan(path, Table.DEAD_LETTER).sort_by("message_id").equals(before)
    write_dead_letters(warehouse, "jobs", batches[2], NAMES)
    assert scan(path, Table.DEAD_LETTER).num_rows == 6, "the replay wrote nothing"


def test_a_compaction_gives_a_table_the_properties_it_has_no_value_for_and_keeps_its_own(
    tmp_path: Path,
) -> None:
    """An owner who streams from a table for longer than two hours sets its log retention
    so: the writer that compacts it adds what the table lacks and leaves that value."""
    warehouse = str(tmp_path)
    path = table_path(warehouse, Table.LEDGER, "owned")
    own = {"delta.logRetentionDuration": "interval 30 days"}
    DeltaTable.create(path, LEDGER_SCHEMA, configuration=own)
    write_ledger(warehouse, "owned", [Settlement(1, mh("m1"), 0, "acked", 0, 1, 1)], NAMES)
    assert compact_ledger(warehouse, "owned", HOUR_MS) is not None
    assert DeltaTable(path).metadata().configuration == TABLE_PROPERTIES | own


def _delta_checkpoints(path: str) -> list[str]:
    return sorted(p.name for p in Path(path, "_delta_log").glob("*.checkpoint.parquet"))


def test_ledgers_write_a_delta_checkpoint_every_ten_commits_older_ones_once_compacted(
    tmp_path: Path,
) -> None:
    """Each open of, and commit to, a table replays its log since its last Delta
    checkpoint: a ledger the leader appends to every second writes one each 10 commits
    (delta-rs's own default is 100). A ledger made without the property gets it at its
    next compaction, by the leader that alone writes it; no row is lost or doubled."""
    warehouse = str(tmp_path)
    old = table_path(warehouse, Table.LEDGER, "old")
    DeltaTable.create(old, LEDGER_SCHEMA)  # as made before the property
    for topic in ("new", "old"):
        for seq in range(1, 13):
            write_ledger(warehouse, topic, [acked(seq)], NAMES)
    new = table_path(warehouse, Table.LEDGER, "new")
    assert DeltaTable(new).metadata().configuration == TABLE_PROPERTIES
    assert len(_delta_checkpoints(new)) == 1, "one in 13 versions"
    assert _delta_checkpoints(old) == []

    assert compact_ledger(warehouse, "old", HOUR_MS) is not None
    assert DeltaTable(old).metadata().configuration == TABLE_PROPERTIES
    before = DeltaTable(old).version()
    for seq in range(13, 25):
        write_ledger(warehouse, "old", [acked(seq)], NAMES)
    assert _delta_checkpoints(old), f"none in the 12 commits after version {before}"
    for path, rows in ((new, 12), (old, 24)):
        ids = scan(path, Table.LEDGER)["message_id"].to_pylist()
        assert sorted(ids) == sorted(f"m{s}" for s in range(1, rows + 1))


def test_a_ledger_tag_of_another_raft_history_is_told_from_a_lost_trim(tmp_path: Path) -> None:
    """A journal whose last commands were lost goes on from an earlier point: its seqs
    past it name other events than those the ledger's tag counts. A lost trim is told
    apart (the ledger's last event is the state's own), the other history is found (its
    last checkpoint differs, an earlier one is the state's own), and the state's events
    past that one are written under a history of their own."""
    warehouse = str(tmp_path)
    lost = TopicState(buckets=1, max_deliveries=5)
    lost.touch("c", 0)
    lost.lease("c", 1, 1000, [(f"m{i}", 0, i) for i in range(5)])
    assert lost.ack("c", 2, ["m0", "m1", "m2"]) == {}
    assert write_ledger(warehouse, "jobs", lost.events, NAMES) == 3
    survived = pickle.loads(pickle.dumps(lost))  # the journal as far as it survived
    assert lost.ack("c", 3, ["m3", "m4"]) == {}
    assert write_ledger(warehouse, "jobs", lost.events, NAMES) == 5
    with pytest.raises(Claimed):
        write_ledger(warehouse, "jobs", lost.events, NAMES, trimmed=lost.trimmed_upto())
    assert foreign(warehouse, "jobs", lost.events, 0, 5, lost.seq) is None, "a lost trim"

    assert survived.ack("c", 3, ["m4", "m3"]) == {}  # seqs 4 and 5 again, other events
    with pytest.raises(Claimed):
        write_ledger(warehouse, "jobs", survived.events, NAMES, trimmed=survived.trimmed_upto())
    assert foreign(warehouse, "jobs", survived.events, 0, 5, survived.seq) == 3
    survived.begin_history("h", 3)
    history = (survived.history, survived.history_from)
    assert write_ledger(warehouse, "jobs", survived.events, NAMES, history, trimmed=0) == 5
    ledger = scan(ensure_table(warehouse, Table.LEDGER, "jobs"), Table.LEDGER)
    assert sorted(ledger.column("message_id").to_pylist()) == [
        *["m0", "m1", "m2"],
        *["m3", "m3", "m4", "m4"],  # each history's seqs 4 and 5
    ]
    assert foreign(warehouse, "jobs", survived.events, 0, 5, survived.seq) is None


def test_a_new_history_writes_the_dead_letters_a_trim_kept(tmp_path: Path) -> None:
    """A death whose dead letter failed stays in Raft at or below the last trim; a
    history begun past that seq (`history_from`) still writes its dead letter."""
    warehouse, _, state = loaded_topic(tmp_path, [4, 9])
    state.lease("c", 0, 100, [("m0", 0, 4)])
    state.reject("c", 1, ["m0"])
    write_dead_letters(warehouse, "jobs", state.events, NAMES, ("h", state.seq))
    dead = scan(ensure_table(warehouse, Table.DEAD_LETTER, "jobs"), Table.DEAD_LETTER)
    assert dead.column("message_id").to_pylist() == ["m0"]


def test_a_tag_past_the_state_is_another_historys_where_no_commit_says_its_last_event(
    tmp_path: Path,
) -> None:
    """Checkpoints written before they noted their last event tell nothing by it; a tag
    past every seq the state holds (new data folders on that ledger) still cannot be
    a lost trim."""
    warehouse = str(tmp_path)
    state = TopicState(buckets=1, max_deliveries=5)
    state.touch("c", 0)
    state.lease("c", 1, 1000, [("m0", 0, 0)])
    assert state.ack("c", 2, ["m0"]) == {}
    path = ensure_table(warehouse, Table.LEDGER, "jobs")
    untold = CommitProperties(app_transactions=[Transaction(ledger_writer.APP_ID, 7)])
    write_deltalake(path, LEDGER_SCHEMA.empty_table(), mode="append", commit_properties=untold)
    assert foreign(warehouse, "jobs", state.events, 0, 7, state.seq) == 0
    assert foreign(warehouse, "jobs", state.events, 0, 1, state.seq) is None


def test_a_replaced_tag_that_keeps_moving_stops_the_checkpoint_before_it_writes(
    tmp_path: Path,
) -> None:
    """The tags a new history replaced, watched at each checkpoint: one move (a deposed
    leader's late checkpoint of this cluster) is let pass; a second is another live
    cluster's, and the checkpoint raises `Contested` without writing."""
    warehouse = str(tmp_path)
    other = TopicState(buckets=1, max_deliveries=5)
    other.touch("c", 0)
    other.lease("c", 1, 1000, [(f"o{i}", 0, i) for i in range(3)])
    ours = TopicState(buckets=1, max_deliveries=5)
    ours.touch("c", 0)
    ours.lease("c", 1, 1000, [(f"m{i}", 0, i) for i in range(3)])
    assert other.ack("c", 2, ["o0"]) == {}
    assert write_ledger(warehouse, "jobs", other.events, NAMES) == 1
    ours.begin_history("h", 0, ("dejaq-broker", 1))
    rival = Rival(*ours.replaced)
    history = (ours.history, ours.history_from)
    assert ours.ack("c", 2, ["m0"]) == {}
    assert write_ledger(warehouse, "jobs", ours.events, NAMES, history, None, rival) == 1
    assert other.ack("c", 3, ["o1"]) == {}
    assert write_ledger(warehouse, "jobs", other.events, NAMES) == 2
    assert ours.ack("c", 3, ["m1"]) == {}
    assert write_ledger(warehouse, "jobs", ours.events, NAMES, history, None, rival) == 2, (
        "one move"
    )
    assert other.ack("c", 4, ["o2"]) == {}
    assert write_ledger(warehouse, "jobs", other.events, NAMES) == 3
    assert ours.ack("c", 4, ["m2"]) == {}
    with pytest.raises(Contested, match="moved from 1 to 3"):
        write_ledger(warehouse, "jobs", ours.events, NAMES, history, None, rival)
    ledger = DeltaTable(ensure_table(warehouse, Table.LEDGER, "jobs"))
    assert ledger.transaction_version("dejaq-broker:h") == 2, "nothing written"
