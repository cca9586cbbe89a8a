"""Receipts: a lease names each message it grants, and ack, nack, extend and reject take
those names, resolved on every node from the lease's record instead of by id."""

from __future__ import annotations

import io
import pickle
from array import array
from collections import Counter, deque
from collections.abc import Iterator
from functools import partial
from itertools import count
from weakref import WeakKeyDictionary

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_broker import (
    lease_ids,
    leased_ids,
    packed,
    record_ids,
    settled_ids,
    settled_of,
    topic_conf,
)

from dejaq.broker.state.handles import handles_in, mh, mhs
from dejaq.broker.state.leases import (
    BULK_MIN,
    POSITION_BITS,
    Again,
    Lease,
    LeaseRecord,
    Refusal,
    TopicState,
    consecutive,
)
from dejaq.broker.state.raft import BrokerState
from dejaq.broker.state.settlements import Run

MIDS = [f"m{i}" for i in range(6)]


LIDS: WeakKeyDictionary[TopicState, Iterator[int]] = WeakKeyDictionary()


def lease(s: TopicState, consumer: str, mids: list[str], now: int, ms: int = 100) -> LeaseRecord:
    """A lease numbered as the cluster's count (`BrokerState.lids`) numbers them: 1, 2..."""
    lid = next(LIDS.setdefault(s, count(1)))
    return s.lease(consumer, now, ms, [(m, 0, i) for i, m in enumerate(mids)], lid=lid)


def receipts(record: LeaseRecord) -> dict[str, int]:
    return {m: record.receipt(p) for p, m in enumerate(record_ids(record))}


def test_a_receipt_names_one_delivery_and_is_refused_with_the_reason_an_id_would_get() -> None:
    s = TopicState(buckets=1, max_deliveries=5)
    first = receipts(lease(s, "c", ["a", "b", "c"], now=0))
    assert s.ack("c", 1, [], [first["a"], first["a"]]) == {first["a"]: Refusal.SETTLED}
    assert s.ack("d", 1, [], [first["b"]]) == {first["b"]: Refusal.OTHER_CONSUMER}
    unknown = (99 << POSITION_BITS) | 1
    beyond = first["c"] + 5
    assert s.ack("c", 1, [], [unknown, beyond]) == {
        unknown: Refusal.NOT_LEASED,
        beyond: Refusal.NOT_LEASED,
    }
    assert s.ack("c", 100, [], [first["b"]]) == {first["b"]: Refusal.EXPIRED}, "at the deadline"
    assert s.nack("c", 5, [], receipts=[first["c"]]) == ({}, [mh("c")], [])
    assert s.ack("c", 6, [], [first["c"]]) == {first["c"]: Refusal.NOT_LEASED}, "given back"
    assert settled_of(s) == {"a": "acked"} and s.totals["acked"] == 1


def test_an_expired_lease_s_receipt_stays_refused_when_the_same_consumer_leases_again() -> None:
    """By id, a worker could settle a redelivery it never saw; by receipt it cannot."""
    s = TopicState(buckets=1, max_deliveries=5)
    first = receipts(lease(s, "c", ["a", "b"], now=0, ms=100))
    s.extend("c", 50, [], 1000, [first["b"]])
    assert s.expire(100, 10**9) == [mh("a")]
    again = lease(s, "c", ["a"], now=101)
    new = receipts(again)["a"]
    assert list(again.deliveries) == [2] and new != first["a"]
    assert s.ack("c", 102, [], [first["a"]]) == {first["a"]: Refusal.EXPIRED}
    assert s.ack("c", 102, [], [new]) == {}
    assert s.nack("c", 103, [], receipts=[first["b"]])[0] == {}
    assert 1 not in s.records, "all of the first lease back to pending: nothing to keep"
    assert s.ack("c", 104, [], [first["a"]]) == {first["a"]: Refusal.NOT_LEASED}
    [event] = s.events
    assert (event.mh, event.deliveries) == (mh("a"), 2)


def test_a_batch_acked_by_its_receipts_in_bulk_leaves_what_acks_one_by_one_leave(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run of consecutive receipts of one lease is settled in bulk: the same events,
    marks and counts as acking each message in turn."""
    runs: list[int] = []
    bulk_ack = TopicState._ack_run
    monkeypatch.setattr(
        TopicState,
        "_ack_run",
        lambda s, r, start, n, now: runs.append(n) or bulk_ack(s, r, start, n, now),
    )
    states = [TopicState(buckets=2, max_deliveries=5) for _ in range(3)]
    n = BULK_MIN + 4
    for s in states:
        s.touch("c", 0)
        s.lease("c", 0, 100, [(f"m{i}", i % 2, 100 - i) for i in range(n)], lid=1)
    bulk, single, by_id = states
    named = list(range(1 << POSITION_BITS | 2, 1 << POSITION_BITS | (n - 2)))  # 2..n-3
    assert bulk.ack("c", 5, [], named) == {} and runs == [len(named)]
    for r in named:
        assert single.ack("c", 5, [], [r]) == {}
    assert by_id.ack("c", 5, [f"m{i}" for i in range(2, n - 2)]) == {}
    for other in (single, by_id):
        for field in ("events", "settled", "held", "totals", "seq", "ending"):
            assert getattr(bulk, field) == getattr(other, field), field
        assert bulk.records[1].ended == other.records[1].ended
        assert bulk.leased.keys() == other.leased.keys() == {1}
        assert settled_of(bulk) == settled_of(other) and bulk.leases.keys() == other.leases.keys()
    assert bulk.ack("c", 6, [], [named[0] - 2, named[0] - 1, *named]) == {
        r: Refusal.SETTLED for r in named
    }, "a run with settled positions: one at a time, as ids are"
    assert bulk.ack("c", 6, [], [named[-1] + 2, named[-1] + 1]) == {}, "out of order: also"
    assert bulk.ending == deque([(n, 1)]) and not leased_ids(bulk)
    assert settled_of(bulk) == {f"m{i}": "acked" for i in range(n)}
    again = TopicState(buckets=2, max_deliveries=5)
    again.touch("c", 0)
    whole = again.lease("c", 0, 100, [(f"m{i}", i % 2, i) for i in range(n)], lid=1)
    assert again.ack("c", 1, [], [whole.receipt(p) for p in range(n)]) == {}
    assert again.ending == deque([(n, 1)]) and again.held == {0: {}, 1: {}}
    assert again.leased == {}, "no message of it is leased: expiry no longer looks at it"
    assert [e.seq for e in again.events] == list(range(1, n + 1)) and runs[-1] == n


def test_a_whole_lease_s_receipts_travel_as_a_range_and_settle_as_the_list() -> None:
    """The leader sends a worker's consecutive receipts as a range (two ints in the
    Raft command); every node settles it as the list, in bulk or one at a time."""
    n = BULK_MIN + 3
    whole = [1 << POSITION_BITS | p for p in range(n)]
    assert consecutive(whole) == range(whole[0], whole[-1] + 1)
    assert type(consecutive([*whole[:-1], whole[0]])) is list, "named twice: as it is"
    assert type(consecutive(whole[: BULK_MIN - 1])) is list, "short: as it is"
    states = [TopicState(buckets=1, max_deliveries=5) for _ in range(2)]
    for s in states:
        s.touch("c", 0)
        s.lease("c", 0, 100, [(f"m{i}", 0, i) for i in range(n)], lid=1)
    by_range, by_list = states
    assert by_range.ack("c", 1, [], consecutive(whole[2:])) == by_list.ack("c", 1, [], whole[2:])
    assert by_range.events == by_list.events and len(by_range.events.entries) == 1, "in bulk"
    spread = range(whole[0], whole[0] + 2 * n)  # into positions no lease granted
    assert by_range.ack("c", 2, [], spread) == by_list.ack("c", 2, [], list(spread))
    assert settled_of(by_range) == settled_of(by_list) and by_range.events == by_list.events


KINDS = ("pending", "leased", "settled", "delayed", "again")
# What each of 40 messages is before a lease (pending, leased by another consumer,
# settled, delayed by a nack, or nacked and pending again); the lease picks those
# available, and one more that spoils it (or none), at a place among them.
histories = st.tuples(
    st.lists(st.sampled_from(KINDS), min_size=40, max_size=40),
    st.sampled_from(["none", "leased", "settled", "delayed", "theirs", "twice"]),
    st.integers(0, 40),
)


def granted_by_the_rules(s: TopicState, consumer: str, picks: list, now: int) -> list:
    """The picks a lease grants, by the rules `TopicState.lease` states, written out:
    (id, bucket, sort key, deliveries) of each."""
    mine, granted = set(s.buckets_of(consumer)), []
    for mid, bucket, key in picks:
        if (
            bucket in mine
            and mh(mid) not in s.settled
            and s.not_before.get(mh(mid), 0) <= now
            and mid not in s.leases
            and mid not in {g[0] for g in granted}
        ):
            granted.append((mid, bucket, key, s.deliveries.get(mh(mid), 0) + 1))
    return granted


@settings(max_examples=300, deadline=None)
@given(histories)
def test_a_lease_grants_exactly_the_picks_the_rules_allow(history) -> None:
    """Every node's grant (`dejaq_core.grant`, in the core) against its rules written
    out, with the picks packed (as the leader sends 16 or more) and as a list of str: the
    same record, holds, counts and overrides either way."""
    kinds, spoiler, at = history
    as_list, as_packed = (TopicState(buckets=2, max_deliveries=5) for _ in range(2))
    for s in (as_list, as_packed):
        s.touch("c", 0)
        s.touch("other", 0)
        for i, kind in enumerate(kinds):
            if kind == "settled":
                s.cancel(0, f"m{i}", 1, i)
            elif kind != "pending":
                s.lease("other", 0, 1000, [(f"m{i}", 1, i)], lid=100 + i)
                if kind != "leased":
                    s.nack("other", 1, [f"m{i}"], delay_ms=50 if kind == "delayed" else 0)
    assert as_list.buckets_of("c") == [0] and as_list.buckets_of("other") == [1]
    picks = [(f"m{i}", 0, i) for i, k in enumerate(kinds) if k in ("pending", "again")]
    if spoiler == "twice" and picks:
        picks.insert(at % len(picks), picks[at % len(picks)])
    elif spoiler == "theirs" and picks:
        picks[at % len(picks)] = (picks[at % len(picks)][0], 1, 0)
    elif spoiler in kinds:
        spoilt = [(f"m{i}", 0, i) for i, k in enumerate(kinds) if k == spoiler]
        picks[at % (len(picks) + 1) : at % (len(picks) + 1)] = spoilt[:1]
    want = granted_by_the_rules(as_list, "c", picks, 10)
    records = [
        as_list.lease("c", 10, 100, picks, lid=500),
        as_packed.lease("c", 10, 100, packed(picks), lid=500),
    ]
    for r in records:
        assert list(zip(record_ids(r), r.buckets, r.sort_keys, r.deliveries, strict=True)) == want
        assert r.live == len(want) and r.ended == bytearray(len(want))
    for field in ("deliveries", "not_before", "settled", "held", "totals"):
        assert getattr(as_list, field) == getattr(as_packed, field), field
    granted = {mh(mid) for mid, *_ in want}
    assert not granted & (as_list.deliveries.keys() | as_list.not_before.keys())
    assert as_list.held.get(0, {}) == ({"c": len(want)} if want else {})
    assert as_list.totals["redelivered"] == sum(n > 1 for *_, n in want)
    assert {m: r.lid for m, r in as_list.leases.items()} == {
        m: r.lid for m, r in as_packed.leases.items()
    }
    assert all(as_list.leases[m] is records[0] for m in granted)


def test_a_lease_granted_in_part_holds_the_granted_alone() -> None:
    """Picks partly granted (one leased meanwhile) make a record of the granted alone,
    by handle, in pick order."""
    s = TopicState(buckets=1, max_deliveries=5)
    picks = [(f"m{i}", 0, i) for i in range(BULK_MIN)]
    s.touch("c", 0)
    s.lease("c", 0, 100, picks[3:4], lid=1)
    s.nack("c", 1, ["m3"])
    s.lease("c", 2, 100, picks[5:6], lid=2)
    record = s.lease("c", 3, 100, packed(picks), lid=3)
    assert record_ids(record) == [m for m, _, _ in picks if m != "m5"]
    assert list(record.deliveries).count(2) == 1
    assert s.totals["redelivered"] == 1 and s.held == {0: {"c": BULK_MIN}}
    assert record.sort_keys.tolist() == [i for i in range(BULK_MIN) if i != 5]


def test_a_trim_of_leases_of_ids_of_every_length_names_them_by_handle_packed() -> None:
    """Ids of varied lengths, each 16 bytes as a handle: the trim of their acks (bulk,
    and one by id) names them all by handle, packed in one bytes object: no str or int
    per message."""
    s = TopicState(buckets=1, max_deliveries=5)
    s.touch("c", 0)
    leased = []
    for lid, tail in enumerate(["", "-long", "-longer-still" * 9], start=1):
        picks = [(f"m{lid}-{i}{tail}", 0, i) for i in range(BULK_MIN)]
        record = s.lease("c", lid, 100, packed(picks), lid=lid)
        leased += [m for m, _, _ in picks]
        first = record.receipt(0)
        assert s.ack("c", lid, [], range(first, first + BULK_MIN)) == {}
    single = lease(s, "c", ["one"], now=5)
    assert s.ack("c", 5, ["one"]) == {} and len(single) == 1
    trimmed = s.trim(s.seq)
    assert type(trimmed) is bytes
    assert handles_in(trimmed) == mhs([*leased, "one"])
    assert not s.leases and not s.records


def test_extend_by_receipt_moves_only_the_messages_named() -> None:
    s = TopicState(buckets=1, max_deliveries=5)
    named = receipts(lease(s, "c", ["a", "b"], now=0, ms=100))
    assert s.extend("c", 50, [], 1000, [named["a"]]) == ({}, 1050)
    assert s.lease_of("a").deadline == 1050 and s.lease_of("b").deadline == 100
    assert s.expire(100, 10**9) == [mh("b")]
    assert s.reject("c", 200, [], [named["a"], named["b"]]) == {named["b"]: Refusal.EXPIRED}
    assert settled_ids(s) == {"a": "dead"}


def test_records_go_once_their_events_are_trimmed() -> None:
    """The state holds a record while a receipt of it can still be answered as an id
    would be: until the events of its end reach the ledger (`trim`)."""
    s = TopicState(buckets=1, max_deliveries=5)
    for i in range(50):
        named = receipts(lease(s, "c", [f"x{i}", f"y{i}"], now=i))
        assert s.ack("c", i, [], list(named.values())) == {}
    assert len(s.records) == 50 and not leased_ids(s) and len(settled_of(s)) == 100
    s.trim(s.seq)
    assert s.records == {} and not s.ending and not s.leases, "acks go with their trim"
    dead = receipts(lease(s, "c", ["d"], now=70))["d"]
    s.reject("c", 71, [], [dead])
    s.trim(s.seq, keep=[s.seq])  # its dead letter not written yet: the death stays
    assert s.ack("c", 72, [], [dead]) == {dead: Refusal.SETTLED}
    assert s.ack("c", 72, ["d"]) == {"d": Refusal.SETTLED}
    s.trim(s.seq)
    assert s.records == {} and not s.ending
    for i in range(50):  # never settled: no trim comes, and none is needed
        named = receipts(lease(s, "c", [f"x{i}"], now=100 + i))
        assert s.nack("c", 100 + i, [], receipts=list(named.values()))[0] == {}
    assert s.records == {} and not s.ending and s.deliveries[mh("x49")] == 1
    assert s.ack("c", 60, [], [named[f"x{49}"]]) == {named["x49"]: Refusal.NOT_LEASED}


def test_an_acked_message_is_settled_to_every_path_until_its_trim() -> None:
    """An ack's mark lives in its lease's record, which `leases` keeps naming until the
    trim of the ack's event: every path that asks for a message by id must still see it
    settled (never leased, cancelled, rescheduled or redriven again), and the trim must
    take it out, also when a redrive of the same message is untrimmed."""
    s = TopicState(buckets=1, max_deliveries=1)
    many = [f"m{i}" for i in range(BULK_MIN)]
    named = receipts(lease(s, "c", [*many, "one", "dies"], now=0))
    assert s.ack("c", 1, [], [named[m] for m in many]) == {}, "in bulk"
    assert s.ack("c", 1, ["one"]) == {}, "by id"
    assert s.nack("c", 1, [], receipts=[named["dies"]]) == ({}, [], [mh("dies")])
    assert leased_ids(s) == set()
    for mid in [*many, "one"]:
        assert s.settled_event(mid) == "acked" and not s.is_available(mid, 2)
        assert s.lease_of(mid) is None
        assert s.cancel(2, mid, 0, 0) is Refusal.SETTLED
        assert s.reschedule(mid, 5) is Refusal.SETTLED
    assert s.ack("c", 2, ["one", "m0"]) == {"one": Refusal.SETTLED, "m0": Refusal.SETTLED}
    assert s.nack("c", 2, ["m1"])[0] == {"m1": Refusal.SETTLED}
    assert s.redrive(2, s.seq, [("m2", 0, 0), ("dies", 0, 0)]) == (
        ["dies"],
        {"m2": Refusal.SETTLED},
    )
    again = s.lease("c", 3, 100, [(m, 0, 0) for m in [*many, "one", "dies"]], lid=99)
    assert record_ids(again) == ["dies"], "neither the bulk nor the one-at-a-time grant takes them"
    assert leased_ids(s) == {"dies"} and s.ack("c", 4, ["dies"]) == {}
    assert sorted(handles_in(s.trim(s.seq))) == sorted(mhs([*many, "one", "dies"])), "redriven"
    assert s.leases == {} and s.settled == {} and s.redriven_at == {}
    assert s.settled_event("one") is None and s.is_available("one", 5), "forgotten: the ledger's"


def test_receipts_survive_a_snapshot() -> None:
    s = TopicState(buckets=1, max_deliveries=5)
    named = receipts(lease(s, "c", ["a", "b"], now=0))
    s.extend("c", 1, [], 500, [named["b"]])
    again = pickle.loads(pickle.dumps(s))
    assert again.leases["a"] is again.records[1], "one record, shared"
    assert "leased" not in s.__getstate__() and again.leased == {1: again.records[1]}
    assert again.ack("c", 2, ["a"]) == {}, "by id, through the rebuilt positions"
    assert again.ack("c", 2, [], [named["a"], named["b"]]) == {named["a"]: Refusal.SETTLED}
    assert again.lease_of("b") is None and settled_of(again) == {"a": "acked", "b": "acked"}
    assert again.leased == {}, "derived on load, and kept as the state changes"


class NoIndex:
    """The Raft state's listener: no index to tell."""

    def pending(self, topic: str, state: TopicState, handles: list[int]) -> None: ...
    def gone(self, topic: str, handles: bytes) -> None: ...
    def reset(self, states: dict[str, TopicState]) -> None: ...


def from_before_receipts(mids: list[str]) -> TopicState:
    """A topic's state as a broker from before lease records pickled it: `mids` leased."""
    s = TopicState(buckets=1, max_deliveries=5)
    s.touch("c", 0)
    s.leases = {m: Lease("c", 0, i, 10_000, 1) for i, m in enumerate(mids)}  # type: ignore[misc]
    s.held = {0: Counter({"c": len(mids)})}
    return pickle.loads(pickle.dumps(s))


def test_nodes_whose_snapshots_predate_receipts_at_different_points_number_leases_alike() -> None:
    """Each node compacts its log on its own: after an upgrade, one node replays from an
    older snapshot the lease a later snapshot of another node holds. Leases from before
    receipts are numbered apart (no receipt names them), so the next lease has the same
    number, and its receipt the same message, on both."""
    nodes = [BrokerState([topic_conf("t", buckets=1)], 5, NoIndex()) for _ in range(2)]
    older, later = nodes
    older.topics["t"] = from_before_receipts(["m0", "m1"])
    older._apply("t", "lease", ("c", 1, 10_000, [("m2", 0, 2), ("m3", 0, 3)], None))
    later.topics["t"] = from_before_receipts(["m0", "m1", "m2", "m3"])
    for node in nodes:
        assert sorted(lease_ids(node.topics["t"])) == ["m0", "m1", "m2", "m3"]
        assert all(lid < 0 for lid in node.topics["t"].records)
        new = node._apply("t", "lease", ("c", 2, 10_000, [("m4", 0, 4)], None, True))
        assert node.lids == new.lid == 1
        assert node._apply("t", "ack", ("c", 3, [], [new.receipt(0)])) == {}
        assert settled_of(node.topics["t"]) == {"m4": "acked"}


@pytest.mark.parametrize(
    "args",
    [
        ("c", 1, 10_000, [("m", 0, 1)]),  # before rate limits
        ("c", 1, 10_000, [("m", 0, 1)], None),  # before receipts
        ("c", 1, 10_000, [("m", 0, 1)], None, True),  # numbered, before the pick's seq
    ],
    ids=len,
)
def test_a_lease_command_of_every_older_layout_leases_what_its_ack_settles(args: tuple) -> None:
    """A journal written by older builds is applied again after an upgrade: each lease
    command's layout grants its pick, numbering no lease it did not number, and the
    acknowledgement by id that followed it settles the message, as when it was written."""
    node = BrokerState([topic_conf("t", buckets=1)], 5, NoIndex())
    commands = [("t", "touch", ("c", 0)), ("t", "lease", args), ("t", "ack", ("c", 2, ["m"]))]
    _, record, refused = node.batch(commands, _doApply=True)
    assert record_ids(record) == ["m"] and refused == {}
    assert settled_of(node.topics["t"]) == {"m": "acked"}
    assert node.lids == (1 if len(args) == 6 else 0)


def test_a_purge_command_of_the_older_layout_cancels_its_list() -> None:
    """A purge command from before it carried the trim its list was taken at, (now,
    picks), cancels the listed messages neither settled nor leased, as it did then."""
    node = BrokerState([topic_conf("t", buckets=1)], 5, NoIndex())
    node._apply("t", "lease", ("c", 1, 10_000, [("leased", 0, 1)], None, True))
    pending = [("a", 0, 1), ("b", 0, 2), ("leased", 0, 1)]
    [cancelled] = node.batch([("t", "purge", (3, pending))], _doApply=True)
    assert cancelled == 2
    assert settled_of(node.topics["t"]) == {"a": "cancelled", "b": "cancelled"}


@settings(max_examples=150, deadline=None)
@given(
    picks=st.lists(
        st.tuples(
            st.sampled_from([*MIDS, "ü" * 9, ""]),
            st.integers(0, 3),
            st.integers(-(2**63), 2**63 - 1),
        ),
        max_size=40,
    ),
    settled=st.sets(st.sampled_from(MIDS)),
    rate=st.none() | st.floats(1, 50),
)
def test_a_lease_of_packed_picks_grants_what_a_list_of_picks_grants(
    picks: list[tuple[str, int, int]], settled: set[str], rate: float | None
) -> None:
    """A lease command carries its picks packed, as the index picks them; journals from
    before hold a list of (id, bucket, sort key), or packed columns with the ids as a
    list of str. All grant the same messages with the same keys, on the bulk path (from
    `BULK_MIN` picks) and the one-at-a-time one (settled, duplicate, foreign-bucket
    picks), under a rate limit too."""
    states = []
    for form in (list, packed, partial(packed, old="packed"), partial(packed, old="listed")):
        node = BrokerState([topic_conf("t", buckets=4)], 5, NoIndex())
        s = node.topics["t"]
        s.touch("other", 0)  # owns some buckets: their picks are not granted to "c"
        for mid in sorted(settled):
            s.cancel(0, mid, 0, 0)
        record = node._apply("t", "lease", ("c", 1, 10_000, form(picks), rate, True))
        states.append((record, s))
    (a, sa), *others = states
    for b, sb in others:
        assert (a.handles, a.buckets, a.sort_keys, a.deliveries) == (
            b.handles,
            b.buckets,
            b.sort_keys,
            b.deliveries,
        )
        assert sa.leases.keys() == sb.leases.keys() and sa.held == sb.held
    assert set(record_ids(a)).isdisjoint(settled)
    assert all(isinstance(k, int) for k in [*a.sort_keys, *a.buckets])


def test_a_receipt_names_one_lease_in_the_whole_cluster() -> None:
    """Leases are numbered across topics: a receipt given to another topic's route names
    nothing there."""
    node = BrokerState([topic_conf("t", buckets=1), topic_conf("u", buckets=1)], 5, NoIndex())
    on_t = node._apply("t", "lease", ("c", 1, 10_000, [("a", 0, 1)], None, True))
    on_u = node._apply("u", "lease", ("c", 1, 10_000, [("a", 0, 1)], None, True))
    assert (on_t.lid, on_u.lid) == (1, 2)
    wrong = on_t.receipt(0)
    assert node._apply("u", "ack", ("c", 2, [], [wrong])) == {wrong: Refusal.NOT_LEASED}
    assert node.topics["u"].lease_of("a") is not None


@st.composite
def histories(draw: st.DrawFn) -> list[tuple[str, list[int], int]]:
    ops = st.sampled_from(["lease", "ack", "nack", "reject", "extend", "expire", "trim"])
    return draw(
        st.lists(
            st.tuples(ops, st.lists(st.integers(0, len(MIDS) - 1), max_size=4), st.integers(1, 60)),
            max_size=30,
        )
    )


@given(histories())
@settings(max_examples=150, deadline=None)
def test_receipts_settle_what_ids_settle(history: list[tuple[str, list[int], int]]) -> None:
    """The same history applied twice, naming messages by id in one state and by the
    receipt of their latest lease in the other, leaves both states the same, with the
    same refusals (a message leased again after its lease expired: its new receipt)."""
    by_id, by_receipt = TopicState(1, 3), TopicState(1, 3)
    latest: dict[str, int] = {}
    now = 0
    for op, picked, dt in history:
        for s in (by_id, by_receipt):  # what the last step left
            assert s.leased == {lid: r for lid, r in s.records.items() if r.live}
        now += dt
        mids = [MIDS[i] for i in picked]
        if op == "lease":
            lease(by_id, "c", mids, now)
            latest.update(receipts(lease(by_receipt, "c", mids, now)))
            continue
        if op == "expire":
            assert by_id.expire(now, 10**9) == by_receipt.expire(now, 10**9)
            continue
        if op == "trim":
            assert by_id.trim(by_id.seq) == by_receipt.trim(by_receipt.seq)
            continue
        named = [m for m in mids if m in latest]
        ids, rs = named, [latest[m] for m in named]
        if op == "ack":
            got = by_id.ack("c", now, ids), by_receipt.ack("c", now, [], rs)
        elif op == "reject":
            got = by_id.reject("c", now, ids), by_receipt.reject("c", now, [], rs)
        elif op == "extend":
            got = by_id.extend("c", now, ids, 50)[0], by_receipt.extend("c", now, [], 50, rs)[0]
        else:
            a, b = by_id.nack("c", now, ids), by_receipt.nack("c", now, [], receipts=rs)
            assert a[1:] == b[1:]
            got = a[0], b[0]
        refused_ids, refused_receipts = got
        back = {r: m for m, r in zip(ids, rs, strict=True)}
        assert {back[r] for r in refused_receipts} == set(refused_ids)
        for r, why in refused_receipts.items():
            if by_id.lease_of(back[r]) is not None or why is Refusal.OTHER_CONSUMER:
                assert refused_ids[back[r]] == why
    for field in ("settled", "deliveries", "not_before", "sort_keys", "totals", "held"):
        assert getattr(by_id, field) == getattr(by_receipt, field), field
    assert settled_of(by_id) == settled_of(by_receipt)
    assert by_id.events == by_receipt.events
    assert set(by_id.leases) == set(by_receipt.leases)


def _pickled_with_list_columns(state: TopicState) -> bytes:
    """`state` pickled as before packed columns: each record's columns as lists."""

    class Old(pickle.Pickler):
        def reducer_override(self, obj: object) -> object:
            if type(obj) is not LeaseRecord:
                return NotImplemented
            new, args, fields = obj.__reduce__()
            return new, args, tuple(list(f) if isinstance(f, array) else f for f in fields)

    out = io.BytesIO()
    Old(out, protocol=5).dump(state)
    return out.getvalue()


def test_lease_records_pickled_with_list_columns_load_packed_and_settle_alike() -> None:
    """Snapshots from before packed columns hold each record's buckets, sort keys and
    deliveries as lists: they load as arrays, and the loaded state settles and writes
    its events as the state that never was pickled."""
    s = TopicState(buckets=1, max_deliveries=5)
    record = lease(s, "c", [f"m{i}" for i in range(BULK_MIN)], now=0)
    old = pickle.loads(_pickled_with_list_columns(s))
    loaded = old.records[record.lid]
    assert [type(c).__name__ for c in (loaded.buckets, loaded.sort_keys, loaded.deliveries)] == [
        "array"
    ] * 3
    assert list(loaded.deliveries) == [1] * BULK_MIN
    fresh = TopicState(buckets=1, max_deliveries=5)
    lease(fresh, "c", [f"m{i}" for i in range(BULK_MIN)], now=0)
    for state in (old, fresh):
        assert state.ack("c", 1, [], list(receipts(state.records[record.lid]).values())) == {}
    assert list(old.events) == list(fresh.events) and old.held == fresh.held


GROUP_MIDS = [f"g{i}" for i in range(24)]  # enough for a lease whose ack is bulk


def by_python(node: BrokerState, commands: list[tuple[str, str, tuple]]) -> list:
    """A group commit applied one command at a time by `BrokerState._apply`."""
    results: list = []
    for topic, op, args in commands:
        try:
            results.append(node._apply(topic, op, args))
        except Exception as e:
            results.append(e)
    return results


def comparable(result: object) -> object:
    """A command's result as two nodes' can be compared: a record by its columns, an
    exception by its type."""
    if isinstance(result, LeaseRecord):
        return ("record", result.__getstate__())
    if isinstance(result, Exception):
        return ("raised", type(result))
    return result


def snapshot(state: TopicState) -> bytes:
    """A state's snapshot with its consumers' last requests in consumer order: the core
    remembers those of a run's leases once the run is applied, `_apply` as it goes, so
    a lease `_apply` takes within a run is remembered before earlier ones. Nothing reads
    them in order (one consumer's, by its name), so the order is no difference."""
    copy = pickle.loads(pickle.dumps(state))
    copy.requests = dict(sorted(copy.requests.items()))
    return pickle.dumps(copy)


@st.composite
def groups(draw: st.DrawFn) -> list[list[tuple]]:
    """Group commits of leases, acks by receipt and the commands around them, each a
    list of (op, parameters) the test turns into commands as the leader would."""
    consumer = st.sampled_from(["c", "d", "newcomer"])
    lease = st.tuples(
        st.just("lease"),
        consumer,
        st.lists(st.tuples(st.sampled_from(GROUP_MIDS), st.integers(0, 1)), max_size=20),
        st.sampled_from(["packed", "listed", "list of picks"]),
        st.sampled_from([None, None, 5.0]),
        st.sampled_from(["now", "now", "stale", "none"]),
        st.sampled_from([True, True, "r1", "r2"]),
    )
    ack = st.tuples(
        st.just("ack"),
        consumer,
        st.lists(st.integers(0, 40), max_size=20),
        st.sampled_from(["receipts", "receipts", "whole lease", "ids", "bogus"]),
    )
    other = st.tuples(
        st.sampled_from(["trim", "pause", "resume", "expire", "nack", "touch", "leave"])
    )
    op = st.one_of(lease, lease, ack, ack, other)
    return draw(st.lists(st.lists(op, min_size=1, max_size=6), max_size=12))


@settings(max_examples=150, deadline=None)
@given(groups())
@example(
    [
        [
            ("lease", "c", [], "packed", None, "now", True),
            ("lease", "d", [("g1", 1)], "packed", None, "now", "r1"),
            ("lease", "c", [("g0", 0)], "list of picks", None, "now", "r2"),
        ]
    ]
)
def test_the_core_applies_a_group_commit_as_the_python_transitions_do(
    history: list[list[tuple]],
) -> None:
    """Leases and acks by receipt are applied by the compiled core (`TRANSITIONS`), the
    rest, and their rarer cases (a new consumer, a paused or rate-limited topic, picks as
    a list, acks by id, a bulk ack of a run its consumer does not hold), by
    `BrokerState._apply`; a lease carrying its request's id ends a run of the core's,
    and one of the consumer's last request is answered by `_apply`. A history of group
    commits applied that way and one command at a time by `_apply` alone leaves two
    nodes with the same results and the same state, to the byte of their snapshots."""
    core, python = (BrokerState([topic_conf("t", buckets=2)], 3, NoIndex()) for _ in range(2))
    for node in (core, python):
        node._apply("t", "touch", ("c", 0))
        node._apply("t", "touch", ("d", 0))
    records: list[LeaseRecord] = []  # the core node's, whose receipts the acks name
    now = 0
    for group in history:
        now += 7
        s = core.topics["t"]
        commands: list[tuple[str, str, tuple]] = []
        for step in group:
            if step[0] == "lease":
                _, who, chosen, form, rate, seen, numbered = step
                picks = [(m, b, i) for i, (m, b) in enumerate(chosen)]
                carried = {"packed": packed, "listed": partial(packed, old="listed")}
                as_sent = carried[form](picks) if form in carried else picks
                at = {"now": s.seq, "stale": s.seq - 3, "none": None}[seen]
                args = (who, now, 50, as_sent, rate, numbered) + (() if at is None else (at,))
                commands.append(("t", "lease", args))
            elif step[0] == "ack":
                _, who, picked, how = step
                named = [r.receipt(p) for r in records for p in range(len(r))]
                chosen = [named[i] for i in picked if i < len(named)]
                if how == "whole lease" and records:
                    chosen = [records[-1].receipt(p) for p in range(len(records[-1]))]
                    chosen = consecutive(chosen)
                if how == "bogus":
                    chosen = [*chosen, 999 << POSITION_BITS, -1]
                if how == "ids":
                    commands.append(("t", "ack", (who, now, GROUP_MIDS[:3])))
                else:
                    commands.append(("t", "ack", (who, now, [], chosen)))
            elif step[0] == "trim":
                commands.append(("t", "trim", (s.seq - 1,)))
            elif step[0] in ("pause", "resume"):
                commands.append(("t", "pause", (step[0] == "pause",)))
            elif step[0] == "expire":
                commands.append(("t", "expire", (now, 10**9, (5, 20))))
            elif step[0] == "nack":
                commands.append(("t", "nack", ("c", now, GROUP_MIDS[:2])))
            elif step[0] == "leave":
                commands.append(("t", "leave", ("c", now, True)))
            else:
                commands.append(("t", "touch", ("d", now)))
        got = core.batch(pickle.loads(pickle.dumps(commands)), _doApply=True)
        expected = by_python(python, pickle.loads(pickle.dumps(commands)))
        assert list(map(comparable, got)) == list(map(comparable, expected)), commands
        records += [r for r in got if isinstance(r, LeaseRecord) and len(r)]
        assert core.lids == python.lids
        assert snapshot(core.topics["t"]) == snapshot(python.topics["t"]), commands
        assert core.topics["t"].leased.keys() == python.topics["t"].leased.keys()
        assert core.topics["t"].ending == python.topics["t"].ending


@pytest.mark.parametrize("form", ["range", "list"])
def test_a_whole_lease_acked_in_a_group_commit_is_settled_by_the_core_as_one_run(
    form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker acking its whole batch sends a lease's receipts in order, which the
    leader carries as a range (`consecutive`): the core settles them as one `Run` event,
    as `TopicState._ack_run` does, without a Python step (`TopicState.ack` is not
    called). A node applying the same commands one at a time in Python ends in the same
    state, to the byte of its snapshot. The same run acked by a consumer that does not
    hold it is handed to Python, which refuses it one receipt at a time."""
    mids = [f"w{i}" for i in range(BULK_MIN + 4)]
    core, python = (BrokerState([topic_conf("t", buckets=4)], 3, NoIndex()) for _ in range(2))
    picks = [(m, i % 4, i) for i, m in enumerate(mids)]
    for node in (core, python):
        node._apply("t", "touch", ("c", 0))  # the one member: it owns every bucket
        node.topics["t"].sort_keys[mh(mids[1])] = 1  # a nack's new key, dropped on ack
    lease = ("t", "lease", ("c", 1, 1_000, packed(picks), None, True, 0))
    [record] = core.batch([lease], _doApply=True)
    by_python(python, [lease])
    receipts = [record.receipt(p) for p in range(len(record))]
    assert len(receipts) == len(mids)
    named = consecutive(receipts) if form == "range" else receipts
    assert type(named) is (range if form == "range" else list)
    other = ("t", "ack", ("d", 2, [], named))
    whole = ("t", "ack", ("c", 3, [], named))

    def in_python(*args: object) -> None:
        raise NotImplementedError("an ack handed to Python")

    with monkeypatch.context() as m:
        m.setattr(TopicState, "ack", in_python)
        [by_other, by_holder] = core.batch([other, whole], _doApply=True)
    assert type(by_other) is NotImplementedError, "another consumer's: Python refuses it"
    assert by_holder == {} and by_python(python, [whole]) == [{}]
    [refused] = core.batch([other], _doApply=True)
    assert [refused] == by_python(python, [other])
    assert set(refused.values()) == {Refusal.SETTLED}, "acked by its holder already"
    s = core.topics["t"]
    [run] = [e for e in s.events.view() if type(e) is Run]
    assert (run.seq, len(run.buckets), run.at) == (1, len(mids), 3)
    assert (s.seq, s.totals["acked"], s.leased, s.sort_keys) == (len(mids), len(mids), {}, {})
    assert s.consumers["c"] == 3 and not any(s.held.values())
    assert snapshot(s) == snapshot(python.topics["t"])
    assert s.ending == python.topics["t"].ending


@pytest.mark.parametrize(
    "named",
    [range(0, 10**30, 10**28), range(2**70, 2**70 + BULK_MIN), range(-BULK_MIN, 0)],
    ids=["step past 64 bits", "receipts past 64 bits", "negative"],
)
def test_a_range_of_receipts_the_core_cannot_read_is_refused_as_python_refuses_it(
    named: range,
) -> None:
    """An ack by a range no leader carries (`consecutive` makes ranges of step 1 from a
    lease's receipts) is handed to `_apply`: the core answers it as Python does, each
    receipt refused, rather than failing the command."""
    core, python = (BrokerState([topic_conf("t", buckets=1)], 3, NoIndex()) for _ in range(2))
    for node in (core, python):
        node._apply("t", "touch", ("c", 0))
    ack = ("t", "ack", ("c", 1, [], named))
    [got] = core.batch([ack], _doApply=True)
    assert [got] == by_python(python, [ack])
    assert got == dict.fromkeys(named, Refusal.NOT_LEASED)


def asked(consumer: str, now: int, picks: list[tuple[str, int, int]], request: str) -> tuple:
    """A lease command carrying its request's id, as the leader commits it."""
    return ("t", "lease", (consumer, now, 60_000, packed(picks), None, request, None))


@pytest.mark.parametrize("path", ["core", "python"])
def test_a_lease_request_sent_again_is_answered_by_the_lease_that_answered_it(path: str) -> None:
    """A request whose answer was lost comes again with the same id: in the same group
    commit as its first attempt (sent again while that one was in flight) or in a later
    one, its command grants none of its picks and names the first lease; nothing is
    numbered, leased or counted anew. Another request of the consumer leases anew."""
    node = BrokerState([topic_conf("t", buckets=1)], 5, NoIndex())
    node._apply("t", "touch", ("c", 0))
    s = node.topics["t"]
    apply = (lambda g: node.batch(g, _doApply=True)) if path == "core" else partial(by_python, node)
    first, again = apply(
        [asked("c", 1, [("a", 0, 1), ("b", 0, 2)], "r1"), asked("c", 1, [("x", 0, 3)], "r1")]
    )
    assert record_ids(first) == ["a", "b"] and again == Again(first.lid)
    assert apply([asked("c", 2, [("y", 0, 4)], "r1")]) == [Again(first.lid)]
    assert (node.lids, sorted(lease_ids(s)), s.totals["leased"]) == (1, ["a", "b"], 2)
    assert s.ack("c", 3, [], [first.receipt(0)]) == {}
    assert apply([asked("c", 4, [("y", 0, 4)], "r1")]) == [Again(first.lid)], "b still held"
    [other] = apply([asked("c", 4, [("x", 0, 3), ("y", 0, 4)], "r2")])
    assert record_ids(other) == ["x", "y"] and list(other.deliveries) == [1, 1]
    assert s.requests == {"c": ("r2", other.lid)}


def test_a_lease_request_is_remembered_while_its_consumer_is_a_member_and_only_if_it_granted() -> (
    None
):
    """A request whose lease granted nothing (a long poll commits several) is not taken
    for answered. One entry per consumer, dropped as the consumer leaves or is expired
    silent (in the same group commit as the lease, too): the request sent after that
    leases anew."""
    node = BrokerState([topic_conf("t", buckets=1)], 5, NoIndex())
    node._apply("t", "touch", ("c", 0))
    s = node.topics["t"]
    [empty] = node.batch([asked("c", 1, [], "r1")], _doApply=True)
    assert len(empty) == 0 and s.requests == {}
    [first] = node.batch([asked("c", 1, [("a", 0, 1)], "r1")], _doApply=True)
    assert s.requests == {"c": ("r1", first.lid)}
    assert node._apply("t", "leave", ("c", 2, True)) == [mh("a")] and s.requests == {}
    [anew] = node.batch([asked("c", 3, [("a", 0, 1)], "r1")], _doApply=True)
    assert record_ids(anew) == ["a"] and anew.lid != first.lid
    assert s.expire(2_000, heartbeat_timeout_ms=1_000) == [] and s.requests == {}
    group = [asked("c", 3_000, [("b", 0, 2)], "r2"), ("t", "leave", ("c", 3_001, True))]
    granted, released = node.batch(group, _doApply=True)
    assert (record_ids(granted), released) == (["b"], mhs(["a", "b"])), "granted, then left"
    assert s.requests == {}, "a lease and its consumer's leave in one group: forgotten"


def test_a_trim_in_a_group_commit_is_seen_by_the_leases_after_it() -> None:
    """The core asks a topic's `trimmed_upto` once per group commit and keeps it until a
    command it hands to `_apply`: a lease after a trim in the same group, picked from a
    view the trim passed, grants nothing, as it would in a group of its own."""
    node = BrokerState([topic_conf("t", buckets=1)], 3, NoIndex())
    node._apply("t", "touch", ("c", 0))
    s = node.topics["t"]
    picks = packed([("a", 0, 1), ("b", 0, 2)])
    [first] = node.batch([("t", "lease", ("c", 1, 50, picks, None, True, s.seq))], _doApply=True)
    acks = [first.receipt(0), first.receipt(1)]
    assert node.batch([("t", "ack", ("c", 2, [], acks))], _doApply=True) == [{}]
    seen = s.seq
    group = [
        ("t", "lease", ("c", 3, 50, packed([("x", 0, 3)]), None, True, seen)),
        ("t", "trim", (seen,)),
        ("t", "lease", ("c", 3, 50, packed([("y", 0, 4)]), None, True, seen - 1)),
    ]
    before, _, after = node.batch(group, _doApply=True)
    assert (len(before), len(after)) == (1, 0), "the lease picked before the trim grants nothing"


@pytest.mark.parametrize("path", ["core", "python"])
def test_a_pick_made_before_a_reschedule_is_not_granted_early(path: str) -> None:
    """The leader picks a due message at its key; a reschedule to a later time commits
    before the lease: the lease grants nothing (never early), in a group commit as one
    command at a time, and the message leases at its new key once that is due."""
    node = BrokerState([topic_conf("t", buckets=1, kind="timeline")], 3, NoIndex())
    node._apply("t", "touch", ("c", 0))
    seen = node.topics["t"].seq
    group = [
        ("t", "reschedule", ("m", 10_000, seen)),
        ("t", "lease", ("c", 1_000, 50, packed([("m", 0, 900)]), None, True, seen)),
    ]
    apply = (lambda g: node.batch(g, _doApply=True)) if path == "core" else partial(by_python, node)
    refused, record = apply(group)
    assert refused is None and len(record) == 0, "picked at 900, due at 10,000"
    later = [("t", "lease", ("c", 10_000, 50, packed([("m", 0, 10_000)]), None, True, seen))]
    [record] = apply(later)
    assert record_ids(record) == ["m"]


def test_a_rebalance_in_a_group_commit_moves_the_buckets_the_leases_after_it_see() -> None:
    """The core reads a topic's attributes once per group commit and reads them again
    after a command it hands to `_apply`: there a newcomer's lease rebalances the
    buckets (`owned` is a new dict), and a member's lease after it in the same group
    grants only in the buckets left to it, as one command at a time would."""
    core, python = (BrokerState([topic_conf("t", buckets=2)], 3, NoIndex()) for _ in range(2))
    for node in (core, python):
        node._apply("t", "touch", ("c", 0))
    assert core.topics["t"].owned == {"c": [0, 1]}
    seen = core.topics["t"].seq
    group = [
        ("t", "lease", ("c", 1, 50, packed([("a", 0, 1)]), None, True, seen)),
        ("t", "lease", ("d", 1, 50, packed([("b", 0, 2)]), None, True, seen)),
        ("t", "lease", ("c", 2, 50, packed([("x", 0, 3), ("y", 1, 4)]), None, True, seen)),
    ]
    got = core.batch(pickle.loads(pickle.dumps(group)), _doApply=True)
    expected = by_python(python, pickle.loads(pickle.dumps(group)))
    assert list(map(comparable, got)) == list(map(comparable, expected))
    owned = core.topics["t"].owned
    assert sorted(owned) == ["c", "d"], "the newcomer joined and took a bucket"
    (mine,) = owned["c"]
    assert (owned["d"], len(got[1])) == ([1 - mine], 0), "the newcomer's pick was not its"
    buckets = got[2].__getstate__()[0]
    assert list(buckets) == [mine], "the member's last lease granted in its one bucket only"
    assert snapshot(core.topics["t"]) == snapshot(python.topics["t"])
