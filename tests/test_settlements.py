"""The settled events awaiting a checkpoint, kept as tuples and, for bulk acks, runs of
columns: they read, cut, pickle and write to the ledger as the list of settlements they
stand for."""

from __future__ import annotations

import pickle
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from test_broker import leased

from dejaq.broker.state.leases import TopicState
from dejaq.broker.state.settlements import EventLog, Run, Settlement, entries_of, last
from dejaq.broker.storage.ledger_writer import write_ledger
from dejaq.conf.tables import Table, scan, table_path

EVENTS = ("acked", "dead", "cancelled")

# Steps on a log: ("add", events in the run, which event), ("extend", the same as
# settlements) or ("cut", how far past the first seq, how many of the cut to keep).
steps = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["add", "extend"]), st.integers(0, 5), st.sampled_from(EVENTS)),
        st.tuples(st.just("cut"), st.integers(-2, 12), st.integers(0, 2)),
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(steps)
def test_a_log_reads_and_cuts_as_the_list_of_its_settlements(plan: list) -> None:
    """The model is the list the state kept before runs: appended in seq order, cut at
    a seq with the kept deaths put back in front."""
    log, model = EventLog(), []
    seq = 0
    for step in plan:
        if step[0] != "cut":
            how, n, event = step
            mids = [f"m{seq + i + 1}" for i in range(n)]
            events = [
                Settlement(seq + 1 + i, m, i % 3, event, i, 1, seq) for i, m in enumerate(mids)
            ]
            if how == "add":
                log.add(
                    Run(seq + 1, mids, [i % 3 for i in range(n)], event, [*range(n)], [1] * n, seq)
                )
            else:
                log.extend(events)
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
        assert all(type(e) is Settlement or e.message_ids for e in log.entries), "no empty run"
    assert list(log) == model and log == model
    again = pickle.loads(pickle.dumps(log))
    assert again == log and len(again) == len(log) and again.entries == log.entries


def test_a_bulk_ack_adds_one_run_and_an_old_snapshot_s_list_loads_into_a_log() -> None:
    """A bulk ack holds its whole lease's events as one run, not a tuple each; a state
    pickled with the list of settlements (snapshots before the log) loads into one."""
    s = TopicState(buckets=1, max_deliveries=5)
    record = s.lease("c", 0, 100, [(f"m{i}", 0, i) for i in range(40)], lid=1)
    assert s.ack("c", 1, [], [record.receipt(p) for p in range(40)]) == {}
    [run] = s.events.entries
    assert type(run) is Run and run.message_ids == record.mids
    assert (run.seq, last(run), run.event) == (1, 40, "acked")
    leased(s, "c", ["x", "y"], now=2)
    assert s.ack("c", 3, ["y", "x"]) == {}
    assert s.events.entries[1:] == list(s.events)[40:], "acked one at a time: a tuple each"
    state = s.__getstate__()
    state["events"] = list(s.events)
    old = TopicState.__new__(TopicState)
    old.__setstate__(pickle.loads(pickle.dumps(state)))
    assert isinstance(old.events, EventLog) and old.events == s.events
    assert old.trim(41) == [*record.mids, "y"]
    assert [e.message_id for e in old.events] == ["x"]


def test_the_ledger_gets_the_same_rows_from_runs_as_from_settlements(tmp_path: Path) -> None:
    events = [
        Settlement(1, "a", 0, "acked", 5, 1, 1_000),
        Settlement(2, "b", 1, "dead", 7, 3, 1_001, "max_deliveries"),
        Settlement(3, "c", 2, "acked", 9, 1, 1_002),
    ]
    runs = [
        Run(1, ["a"], [0], "acked", [5], [1], 1_000),
        Run(2, ["b"], [1], "dead", [7], [3], 1_001, "max_deliveries"),
        Run(3, ["c"], [2], "acked", [9], [1], 1_002),
    ]
    assert entries_of(EventLog(runs)) == runs and EventLog(runs) == events
    for name, given_as in (("settlements", events), ("runs", runs)):
        warehouse = str(tmp_path / name)
        assert write_ledger(warehouse, "t", given_as) == 3
        assert write_ledger(warehouse, "t", given_as) == 3, "a replay writes nothing"
    rows = [
        sorted(
            scan(table_path(str(tmp_path / n), Table.LEDGER, "t"), Table.LEDGER).to_pylist(),
            key=str,
        )
        for n in ("settlements", "runs")
    ]
    assert rows[0] == rows[1] and len(rows[0]) == 3
