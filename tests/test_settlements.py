"""The settled events awaiting a checkpoint, kept as tuples and, for bulk acks, runs of
columns: they read, cut, pickle and write to the ledger as the list of settlements they
stand for."""

from __future__ import annotations

import pickle
import sys
import threading
from array import array
from pathlib import Path

from conftest import Named
from dejaq_core import AckRun, PackedIds
from hypothesis import given, settings
from hypothesis import strategies as st
from test_broker import leased, record_ids

from dejaq.broker.state.handles import WIDTH, handles_in, mh, mhs, packed
from dejaq.broker.state.leases import TopicState
from dejaq.broker.state.settlements import (
    EventLog,
    Run,
    Settlement,
    count,
    entries_of,
    last,
    settlements,
)
from dejaq.broker.storage import ledger_writer
from dejaq.broker.storage.ledger_writer import write_ledger
from dejaq.conf.tables import Table, scan, table_path

EVENTS = ("acked", "dead", "cancelled")
# The ids the ledger tests' events name, by handle (`ledger_writer.Names`).
NAMES = Named(["a", "b", "bé", "c", "d", "e", "f", "g", "h", "i", "j", "k", "lé", "m", "n"])

# Steps on a log: ("add", events in the run, which event), ("append", the same as
# settlements), ("ack", acks, -) one at a time into the open `AckRun`, ("view", -, -) a
# reader's view, or ("cut", how far past the first seq, how many of the cut to keep).
steps = st.lists(
    st.one_of(
        st.tuples(
            st.sampled_from(["add", "append", "ack"]), st.integers(0, 5), st.sampled_from(EVENTS)
        ),
        st.tuples(st.just("view"), st.just(0), st.just(0)),
        st.tuples(st.just("cut"), st.integers(-2, 12), st.integers(0, 2)),
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(steps)
def test_a_log_reads_and_cuts_as_the_list_of_its_settlements(plan: list) -> None:
    """The model is the list the state kept before runs: appended in seq order, cut at
    a seq with the kept deaths put back in front. A view stays as it was taken while
    acks go on joining the log."""
    log, model = EventLog(), []
    views: list[tuple[list, list[Settlement]]] = []
    seq = 0
    for step in plan:
        if step[0] == "view":
            view = log.view()
            views.append((view, list(settlements(view))))
            continue
        if step[0] != "cut":
            how, n, event = step
            event = "acked" if how == "ack" else event
            mids = [f"m{seq + i + 1}" for i in range(n)]
            events = [
                Settlement(seq + 1 + i, h, i % 3, event, i, 1, seq * 10 + i)
                for i, h in enumerate(mhs(mids))
            ]
            if how == "add":
                at = seq * 10
                events = [e._replace(at=at) for e in events]
                buckets = [i % 3 for i in range(n)]
                log.add(Run(seq + 1, packed(mids), buckets, event, [*range(n)], [1] * n, at))
            elif how == "append":
                for e in events:
                    log.append(e)
            else:
                for e in events:
                    log.ack(*e[:7])
            model += events
            seq += n
            continue
        _, past, k = step
        first = model[0].seq if model else seq
        upto = first + past
        cut = [e for e in model if e.seq <= upto]
        keep = [e.seq for e in cut[:k]]
        done = log.cut(upto, keep)
        assert list(EventLog(done)) == [e for e in cut if e.seq not in keep]
        model = [e for e in cut if e.seq in keep] + [e for e in model if e.seq > upto]
        assert list(log) == model and len(log) == len(model)
        assert log.first() == (model[0].seq if model else None)
        assert all(count(e) for e in log.entries), "no empty run"
    assert list(log) == model and log == model
    assert all(list(settlements(view)) == seen for view, seen in views), "a view changed"
    again = pickle.loads(pickle.dumps(log))
    assert again == log and len(again) == len(log)
    assert not any(type(e) is AckRun for e in again.entries), "snapshots hold settlements"


def test_a_bulk_ack_adds_one_run_and_an_old_snapshot_s_list_loads_into_a_log() -> None:
    """A bulk ack holds its whole lease's events as one run, and acks one at a time
    append to one `AckRun`, not a tuple each; a state pickled with the list of
    settlements (snapshots before the log) loads into one."""
    s = TopicState(buckets=1, max_deliveries=5)
    record = s.lease("c", 0, 100, [(f"m{i}", 0, i) for i in range(40)], lid=1)
    assert s.ack("c", 1, [], [record.receipt(p) for p in range(40)]) == {}
    [run] = s.events.entries
    assert type(run) is Run and run.handles == record.handles == packed(record_ids(record))
    assert (run.seq, last(run), run.event) == (1, 40, "acked")
    leased(s, "c", ["x", "y"], now=2)
    assert s.ack("c", 3, ["y", "x"]) == {}
    [acks] = s.events.entries[1:]
    assert type(acks) is AckRun and len(acks) == 2, "acked one at a time: rows of one run"
    assert list(settlements([acks])) == list(s.events)[40:]
    state = s.__getstate__()
    state["events"] = list(s.events)
    old = TopicState.__new__(TopicState)
    old.__setstate__(pickle.loads(pickle.dumps(state)))
    assert isinstance(old.events, EventLog) and old.events == s.events
    assert handles_in(old.trim(41)) == mhs([*record_ids(record), "y"])
    assert [e.mh for e in old.events] == [mh("x")]


def test_a_snapshots_runs_by_id_load_by_handle() -> None:
    """Runs in snapshots from before handles hold their ids, packed (`PackedIds`) or a
    list: they load holding their handles, as the state they were taken from."""
    s = TopicState(buckets=1, max_deliveries=5)
    record = s.lease("c", 0, 100, [(f"m{i}", 0, i) for i in range(40)], lid=1)
    assert s.ack("c", 1, [], [record.receipt(p) for p in range(20)]) == {}
    assert s.ack("c", 2, [], [record.receipt(p) for p in range(20, 40)]) == {}
    first, second = s.events.entries
    mids = record_ids(record)
    state = s.__getstate__()
    state["events"] = EventLog(
        [
            first._replace(handles=PackedIds.pack(mids[:20])),
            second._replace(handles=mids[20:]),
        ]
    )
    old = TopicState.__new__(TopicState)
    old.__setstate__(pickle.loads(pickle.dumps(state)))
    assert old.events.entries == s.events.entries and old.events == s.events
    assert handles_in(old.trim(40)) == mhs(mids) and not old.leases


def test_the_ledger_gets_the_same_rows_from_runs_as_from_settlements(tmp_path: Path) -> None:
    events = [
        Settlement(1, mh("a"), 0, "acked", 5, 1, 1_000),
        Settlement(2, mh("b"), 1, "dead", 7, 3, 1_001, "max_deliveries"),
        Settlement(3, mh("c"), 2, "acked", 9, 1, 1_002),
    ]
    runs = [
        Run(1, packed(["a"]), [0], "acked", [5], [1], 1_000),
        Run(2, packed(["b"]), [1], "dead", [7], [3], 1_001, "max_deliveries"),
        Run(3, packed(["c"]), [2], "acked", [9], [1], 1_002),
    ]
    assert entries_of(EventLog(runs)) == runs and EventLog(runs) == events
    for name, given_as in (("settlements", events), ("runs", runs)):
        warehouse = str(tmp_path / name)
        assert write_ledger(warehouse, "t", given_as, NAMES.names) == 3
        assert write_ledger(warehouse, "t", given_as, NAMES.names) == 3, "a replay: nothing"
    rows = [
        sorted(
            scan(table_path(str(tmp_path / n), Table.LEDGER, "t"), Table.LEDGER).to_pylist(),
            key=str,
        )
        for n in ("settlements", "runs")
    ]
    assert rows[0] == rows[1] and len(rows[0]) == 3


def test_the_ledger_keeps_the_order_of_mixed_runs_and_settlements(tmp_path: Path) -> None:
    """Runs as lease records pack them (arrays, ids packed whole or sliced; two such
    runs in a row are joined), as snapshots from before hold them (lists), single
    settlements between them, one with no sort key, and acks' runs, each ack at its own
    time: the ledger gets one row per event, in seq order, each with its own fields."""
    entries = [
        Run(
            1,
            packed(["a", "bé"]),
            array("H", [3, 4]),
            "acked",
            array("q", [2**40, -1]),
            array("i", [1, 2]),
            10,
        ),
        Settlement(3, mh("c"), 5, "cancelled", None, 0, 11),
        Settlement(4, mh("d"), 6, "dead", 7, 3, 12, "max_deliveries"),
        Run(5, packed(["e"]), [7], "acked", [8], [1], 13),
        Run(
            6,
            packed(["cut", "f", "g"])[WIDTH:],
            array("H", [8, 9]),
            "rejected",
            array("q", [9, 10]),
            array("i", [1, 1]),
            14,
        ),
        Run(
            8,
            packed(["i", "j"]),
            array("H", [2, 1]),
            "acked",
            array("q", [2**33, 5]),
            array("i", [2, 1]),
            15,
        ),
        Settlement(10, mh("h"), 1, "acked", 2, 1, 16),
    ]
    for e in (
        Settlement(11, mh("k"), 3, "acked", 4, 1, 19),
        Settlement(12, mh("lé"), 4, "acked", 2**35, 2, 17),
        Settlement(13, mh("m"), 5, "dead", 1, 5, 20, "max_deliveries"),
        Settlement(14, mh("n"), 6, "acked", 3, 1, 21),
    ):
        if e.event == "acked":  # each ack with its own time, as the core's ack adds it
            AckRun.append(entries, *e[:7])
        else:
            entries.append(e)
    assert [type(e) for e in entries[-3:]] == [AckRun, Settlement, AckRun]
    assert write_ledger(str(tmp_path), "t", entries, NAMES.names) == 14
    rows = scan(table_path(str(tmp_path), Table.LEDGER, "t"), Table.LEDGER).to_pylist()
    got = [
        (r["message_id"], r["bucket"], r["event"], r["sort_key"], r["deliveries"], r["at"])
        for r in rows
    ]
    want = [
        (NAMES[e.mh], e.bucket, e.event, e.sort_key, e.deliveries, e.at) for e in EventLog(entries)
    ]
    assert [g[:5] for g in got] == [w[:5] for w in want]
    assert [int(g[5].timestamp() * 1000) for g in got] == [w[5] for w in want]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.booleans(), st.lists(st.booleans(), min_size=1, max_size=5)), max_size=8)
)
def test_a_checkpoint_takes_the_events_before_the_first_it_cannot_name(plan: list) -> None:
    """Single settlements and runs, each message named or not by the leader's index: the
    writer takes the events before the first it cannot name (a run holding it cut
    there), with their ids in seq order."""
    entries, ids, named = [], [], Named()
    for single, known in plan:
        seq = len(ids) + 1
        mids = [f"m{seq + i}" for i in range(1 if single else len(known))]
        named.note(m for m, k in zip(mids, known, strict=False) if k)
        if single:
            entries.append(Settlement(seq, mh(mids[0]), 0, "dead", 1, 1, 10))
        else:
            n = len(mids)
            entries.append(Run(seq, packed(mids), [0] * n, "acked", [1] * n, [1] * n, 10))
        ids += [m if k else None for m, k in zip(mids, known, strict=False)]
    got, got_ids = ledger_writer._named(entries, named.names)
    want = ids[: ids.index(None)] if None in ids else ids
    assert got_ids.to_pylist() == want, "as an Arrow column"
    assert [e.seq for e in settlements(got)] == list(range(1, len(want) + 1))


def test_a_view_taken_while_acks_join_the_log_never_changes_under_its_reader() -> None:
    """The checkpoint's thread views the log and reads each run's columns while the event
    loop appends acks: with threads switching every microsecond, every run it reads
    keeps one length across its columns, and every ack is read once, in seq order."""
    log = EventLog()
    done = threading.Event()
    seen: list[list[Settlement]] = []
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            while not done.is_set():
                view = log.view()
                for e in view:
                    if type(e) is AckRun:
                        columns = (e.buckets, e.sort_keys, e.deliveries, e.ats)
                        lengths = {len(c) for c in columns} | {len(e.handles) // WIDTH}
                        assert lengths == {len(e)}, "a run changed"
                seen.append(list(settlements(view)))
        except BaseException as e:
            errors.append(e)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for seq in range(1, 60_001):
            log.ack(seq, seq, seq % 7, "acked", seq, 1, seq)
            if seq % 500 == 0:
                log.cut(seq - 250)
    finally:
        done.set()
        thread.join()
        sys.setswitchinterval(switch)
    assert not errors, errors
    assert len(seen) > 1, "the reader viewed the log while acks joined it"
    for view in seen:
        seqs = [e.seq for e in view]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) if seqs else True
    assert [e.seq for e in log] == list(range(59_751, 60_001))


class _AckWhileCopied(list):
    """A log's entries that let the event loop add an ack while a reader copies them,
    the thread switch that test stages at the one place it matters."""

    def __init__(self, entries: list, log: EventLog) -> None:
        super().__init__(entries)
        self.log = log

    def __iter__(self):  # type: ignore[no-untyped-def]
        seq = last(self[-1]) + 1
        self.log.ack(seq, seq, 0, "acked", seq, 1, seq)
        return super().__iter__()


def test_an_ack_added_while_a_view_is_copied_never_joins_a_run_in_the_view() -> None:
    """The view is copied, then its last run sealed: an ack that lands in between joins
    that run before the seal, and acks after it start a run the view does not hold."""
    log = EventLog()
    for seq in (1, 2):
        log.ack(seq, seq, 0, "acked", seq, 1, seq)
    log.entries = _AckWhileCopied(log.entries, log)
    view = log.view()
    lengths = [count(e) for e in view]
    log.entries = log.entries[:]  # a plain list again: no ack while copied
    for seq in range(4, 10):
        log.ack(seq, seq, 0, "acked", seq, 1, seq)
    assert [count(e) for e in view] == lengths and sum(lengths) == 3, "a run in the view grew"
    assert [e.seq for e in log] == list(range(1, 10))
