"""The compiled core's packed ids (`dejaq_core.PackedIds`, as commands and snapshots
from before message handles hold them) against the list of str they stand for, and
its lease table (`dejaq_core.LeaseTable`, by message handle) against a dict model; a
topic's state pickled with its leases as a dict (every snapshot: by handle, or by id
before handles) loads into the table; a lease record (`dejaq_core.LeaseRecord`)
pickles as the Python record did, by handle; code from before handles refuses a
snapshot by handle."""

from __future__ import annotations

import io
import pickle
from array import array
from typing import Any

import pytest
from conftest import Named
from dejaq_core import LeaseTable, PackedIds, free_buckets, grant, hold
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_receipts import lease, receipts

from dejaq.broker.state.handles import KeyedByHandle, handles_in, mh, mhs, packed
from dejaq.broker.state.leases import ACKED, LeaseRecord, Refusal, TopicState
from dejaq.broker.state.raft import SnapshotUnpickler
from dejaq.broker.state.settlements import EventLog

IDS = st.sampled_from(["a", "b", "c", "é", "m" * 70, "", "x-1", "x-2", "日本" * 10])
PACKABLE = st.lists(
    st.text(st.characters(codec="utf-8", exclude_characters="\0"), max_size=16), max_size=12
)


@settings(max_examples=200, deadline=None)
@given(mids=PACKABLE, start=st.integers(-14, 14), stop=st.integers(-14, 14))
def test_packed_ids_read_as_the_list_they_pack(mids: list[str], start: int, stop: int) -> None:
    packed = PackedIds.pack(mids)
    if packed is None:  # wider than 64 bytes in UTF-8
        assert max(len(m.encode()) for m in mids) > 64
        return
    assert packed == mids and list(packed) == mids and len(packed) == len(mids)
    assert bool(packed) == bool(mids)
    assert [packed[i] for i in range(-len(mids), len(mids))] == mids + mids
    part = packed[start:stop]
    assert isinstance(part, PackedIds) and part == mids[start:stop]
    w = packed.width
    assert part.blob == b"".join(m.encode().ljust(w, b"\0") for m in mids[start:stop])
    assert packed[::-1] == mids[::-1]
    for ids in (packed, part):
        again = pickle.loads(pickle.dumps(ids, protocol=5))
        assert again == ids and again.width == ids.width


def test_ids_that_cannot_be_packed_are_told_and_bad_packs_refused() -> None:
    assert PackedIds.pack(["fine", "ends in nul\0"]) is None, "its padding would swallow it"
    assert PackedIds.pack(["x" * 65]) is None
    assert PackedIds.pack(["x" * 64]) == ["x" * 64]
    with pytest.raises(ValueError, match="fill their bytes"):
        PackedIds(b"abc", 2)
    with pytest.raises(ValueError, match="1 to 64 bytes wide"):
        PackedIds(b"", 0)
    with pytest.raises(ValueError, match="not UTF-8"):
        PackedIds(b"\xff\xfe", 2)[0]
    with pytest.raises(IndexError):
        PackedIds(b"ab", 2)[1]
    with pytest.raises(TypeError):
        PackedIds(b"ab", 2)["0"]


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("set"), IDS, st.integers(-5, 5)),
        st.tuples(st.just("add"), IDS, st.integers(-5, 5)),
        st.tuples(st.just("add_all"), st.lists(IDS, max_size=5), st.integers(-5, 5), st.booleans()),
        st.tuples(st.just("pop"), IDS),
        st.tuples(st.just("del"), IDS),
        st.tuples(st.just("discard_all"), st.lists(IDS, max_size=5), st.booleans()),
    ),
    max_size=40,
)


def by_mh(model: dict[str, int]) -> dict[int, int]:
    """A model by id as the table holds it: by message handle."""
    return {mh(m): v for m, v in model.items()}


def _ids(mids: list[str], pack: bool) -> PackedIds | list[str]:
    """`mids` packed if asked and they can be, else as a list."""
    return (PackedIds.pack(mids) if pack else None) or mids


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_the_table_answers_as_a_dict_of_ids(ops: list[tuple]) -> None:
    """Named by id, the table answers as a dict by id would; its keys are the ids'
    handles, by which it answers alike."""
    table, model = LeaseTable(), {}
    for op in ops:
        if op[0] == "set":
            table[op[1]] = model[op[1]] = op[2]
        elif op[0] == "add":
            assert table.add(op[1], op[2]) == (op[1] not in model)
            model.setdefault(op[1], op[2])
        elif op[0] == "add_all":
            _, mids, value, pack = op
            fits = len(set(mids)) == len(mids) and not set(mids) & model.keys()
            assert table.add_all(_ids(mids, pack), value) == fits, "all or nothing"
            if fits:
                model.update(dict.fromkeys(mids, value))
        elif op[0] == "pop":
            assert table.pop(op[1]) == model.pop(op[1], None)
        elif op[0] == "del":
            if op[1] in model:
                del table[op[1]], model[op[1]]
            else:
                with pytest.raises(KeyError):
                    del table[op[1]]
        else:
            table.discard_all(_ids(op[1], op[2]))
            for mid in op[1]:
                model.pop(mid, None)
        handles = by_mh(model)
        assert len(table) == len(model) and dict(table.items()) == handles and table == handles
        assert table.keys() == handles.keys() and sorted(table) == sorted(handles)
        assert all(mid in table and table[mid] == table.get(mid) for mid in model)
        assert all(h in table and table[h] == table.get(h) == v for h, v in handles.items())
    with pytest.raises(KeyError):
        table["never"]
    assert mh("never") not in table and table.get("never", 3) == 3
    assert b"a" not in table and table.get(b"a", 3) == 3, "names no message"


@settings(max_examples=12, deadline=None)
@given(
    rounds=st.lists(
        st.tuples(st.integers(0, 3000), st.integers(0, 3000), st.booleans()),
        min_size=1,
        max_size=12,
    ),
    width=st.integers(1, 50),
)
@example(  # past 4,096 entries, then under a quarter of them held: packed
    rounds=[(3000, 0, True), (3000, 0, False), *[(0, 3000, True)] * 3, (7, 1, False)], width=40
)
def test_a_large_table_grows_cleans_and_packs_as_a_dict_would(
    rounds: list[tuple[int, int, bool]], width: int
) -> None:
    """Leases of thousands of ids in and trims of thousands out: the table resizes,
    reuses freed entries and packs them (past 4,096 entries with under a quarter held),
    and answers as a dict throughout, ids long (on the heap) or short (inline)."""
    table, model, issued = LeaseTable(), {}, 0
    for r, (n_in, n_out, pack) in enumerate(rounds):
        mids = [f"{i:0{width}d}" for i in range(issued, issued + n_in)]
        issued += n_in
        assert table.add_all(_ids(mids, pack), issued)
        model.update(dict.fromkeys(mids, issued))
        extra = f"x{r:0{width}d}"  # in no lease, with one that is: all or nothing
        entered = table.add_all([*mids[:1], extra], 0)
        assert entered == (not mids)
        if entered:
            model[extra] = 0
        out = sorted(model)[::2][:n_out]
        table.discard_all(_ids(out, pack))
        for mid in out:
            del model[mid]
        assert len(table) == len(model) and dict(table.items()) == by_mh(model)
        assert all(table.get(mid) == value for mid, value in model.items())
        assert not any(mid in table for mid in out)


HOLDS = st.lists(
    st.tuples(
        st.sampled_from(["c1", "c2", "c3"]),
        st.dictionaries(st.integers(0, 5), st.integers(1, 4), max_size=4),
        st.sampled_from([1, -1]),
    ),
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(HOLDS)
def test_held_counts_and_free_buckets_answer_as_the_dicts_would(ops: list[tuple]) -> None:
    """The core's `hold` keeps bucket -> {consumer: leases} as the Python loop did, and
    `free_buckets` lists the owned buckets no other consumer holds leases in, in order."""
    held: dict[int, dict[str, int]] = {}
    model: dict[int, dict[str, int]] = {}
    for consumer, per_bucket, sign in ops:
        ends_too_many = sign < 0 and any(
            model.get(b, {}).get(consumer, 0) < n for b, n in per_bucket.items()
        )
        if ends_too_many:  # the broker never ends leases it did not count
            continue
        hold(held, per_bucket, consumer, sign)
        for b, n in per_bucket.items():
            counts = model.setdefault(b, {})
            left = counts.get(consumer, 0) + sign * n
            if left > 0:
                counts[consumer] = left
            else:
                del counts[consumer]
        assert held == model
        for c in ("c1", "c2", "c3"):
            owned = [0, 2, 3, 5, 7]
            free = [b for b in owned if not model.get(b) or set(model[b]) == {c}]
            assert free_buckets(owned, held, c) == free
    with pytest.raises(KeyError):
        hold({}, {1: 1}, "c1", -1)
    with pytest.raises(KeyError):
        hold({1: {"c2": 1}}, {1: 1}, "c1", -1)


def test_messages_named_neither_by_id_nor_by_handle_are_a_clear_error() -> None:
    with pytest.raises(TypeError):
        LeaseTable().add_all(["a", b"a"], 1)
    with pytest.raises(TypeError):
        LeaseTable().discard_all([b"a"])
    with pytest.raises(TypeError):
        LeaseTable()[1.0] = 1
    with pytest.raises(ValueError, match="16 bytes each"):
        LeaseTable().discard_all(b"a")
    table = LeaseTable()
    assert table.add_all([mh("a"), "b"], 1) and sorted(table) == sorted([mh("a"), mh("b")])


def test_a_grant_whose_columns_do_not_match_its_picks_changes_nothing() -> None:
    """A lease command's picks with fewer buckets or sort keys than handles are a clear
    error, raised before any pick enters the table or any hold is counted."""
    record = LeaseRecord(1, "c", 99)
    table, held = LeaseTable(), {}
    args = ([0], held, "c", {}, {}, {}, {}, 5, None)
    with pytest.raises(ValueError, match="2 picks with 2 bytes of buckets and 16"):
        grant(table, record, packed(["a", "b"]), bytes(2), bytes(16), *args)
    with pytest.raises(ValueError, match="16 bytes each"):
        grant(table, record, packed(["a", "b"])[:-1], bytes(4), bytes(16), *args)
    with pytest.raises(TypeError):
        grant(table, record, ["a", 1.0], bytes(4), bytes(16), *args)
    assert len(table) == 0 and held == {} and len(record) == 0
    assert grant(table, record, packed(["a", "b"]), bytes(4), bytes(16), *args) == 0
    assert record.handles == packed(["a", "b"]) and held == {0: {"c": 2}} and record.live == 2


@pytest.mark.parametrize("pack", [False, True], ids=["a list of str", "packed ids"])
def test_a_grant_of_picks_by_id_from_before_handles_hashes_them(pack: bool) -> None:
    """Lease commands from before handles carry their picks' ids (a list of str, or
    packed), replayed from a journal: granted as the same picks by handle would be."""
    record, table, held = LeaseRecord(1, "c", 99), LeaseTable(), {}
    mids = ["a", "é" * 9, "b"]
    args = ([0], held, "c", {}, {}, {}, {}, 5, None)
    assert grant(table, record, _ids(mids, pack), bytes(6), bytes(24), *args) == 0
    assert record.handles == packed(mids) and sorted(table) == sorted(mhs(mids))


@pytest.mark.parametrize("by_id", [False, True], ids=["by handle", "by id, before handles"])
def test_a_state_pickled_with_its_leases_as_a_dict_loads_into_the_table(by_id: bool) -> None:
    """Snapshots hold `leases` as a dict of message handle -> lease record, as before the
    table (and by id, before handles: hashed on load): every message leased or acked is
    found again, by id and by receipt."""
    s = TopicState(buckets=1, max_deliveries=5)
    named = receipts(lease(s, "c", ["a", "b", "d"], now=0))
    assert s.ack("c", 1, [], [named["a"]]) == {}
    state = s.__getstate__()
    names = Named(["a", "b", "d"])
    assert type(state["leases"]) is dict and sorted(names.ids(state["leases"])) == ["a", "b", "d"]
    if by_id:
        state["leases"] = {names[h]: record for h, record in state["leases"].items()}
    again = TopicState.__new__(TopicState)
    again.__setstate__(pickle.loads(pickle.dumps(state)))
    assert isinstance(again.leases, LeaseTable)
    assert sorted(names.ids(again.leases)) == ["a", "b", "d"], "acked until its trim, and leased"
    assert again.leases["b"] is again.records[again.leases["d"].lid]
    assert again.settled_event("a") == "acked" and again.lease_of("b") is not None
    assert again.ack("c", 2, ["b"]) == {} and again.ack("c", 2, ["a"]) == {"a": Refusal.SETTLED}
    assert again.ack("c", 2, [], [named["d"]]) == {}
    assert sorted(handles_in(again.trim(again.seq))) == sorted(mhs(["a", "b", "d"]))
    assert not again.leases


def test_a_lease_record_pickles_as_the_python_record_did() -> None:
    """Its state is the tuple the Python record pickled (columns as arrays, the ended
    marks as a bytearray) under the same class name, its messages by handle, packed,
    where the Python record held ids: a record from before handles, its ids a list or
    packed, loads by handle; a malformed one is refused, and a position ends once."""
    table, held = LeaseTable(), {}
    record = LeaseRecord(7, "c", 99)
    picks = packed(["a", "b", "c"])
    grant(table, record, picks, bytes(6), bytes(24), [0], held, "c", {}, {}, {}, {}, 5, None)
    assert record.take(1, "c", 5, ACKED) == (mh("b"), 0, 0, 1, 2)
    assert record.take(1, "c", 5, ACKED) == ACKED and record.take(0, "d", 5, ACKED) == 9
    record.extend(2, 120)
    state = record.__getstate__()
    assert state == (
        array("H", [0, 0, 0]),
        "c",
        99,
        {2: 120},
        array("i", [1, 1, 1]),
        bytearray([0, ACKED, 0]),
        7,
        2,
        picks,
        array("q", [0, 0, 0]),
    )
    pickled = pickle.dumps(record, protocol=5)
    assert b"dejaq.broker.state.leases" in pickled and b"LeaseRecord" in pickled
    again = pickle.loads(pickled)
    assert again.__getstate__() == state and again.position(mh("c")) == 2
    assert again.mh(2) == mh("c")
    for ids in (["a", "b", "c"], PackedIds.pack(["a", "b", "c"])):
        old = LeaseRecord()
        old.__setstate__((*state[:8], ids, state[9]))
        assert old.__getstate__() == state, "hashed on load"
    assert again.earliest() == 99 and again.deadline_of(2) == 120
    with pytest.raises(ValueError, match="10 fields"):
        LeaseRecord().__setstate__(state[:9])
    with pytest.raises(ValueError, match="differ in length"):
        LeaseRecord().__setstate__((array("H", [0]), *state[1:]))
    with pytest.raises(ValueError, match="differ in length"):
        LeaseRecord().__setstate__((*state[:8], picks[:16], state[9]))
    with pytest.raises(ValueError, match="ends once"):
        record.end(1, ACKED)
    assert record.live == 2 and record.ended == bytes([0, ACKED, 0])


def test_a_snapshots_counts_settlements_redrives_and_overrides_by_id_load_by_handle() -> None:
    """Snapshots from before message handles hold delivery counts, settlements, untrimmed
    redrives, overrides, delays and events by id: they load by handle, and a lease holds back the
    delayed message until its delay and counts the delivery, a settled message is
    refused, a redriven one keeps its key, and the trim forgets the settlement and the
    redrive, as in the state they were taken from."""
    s = TopicState(buckets=1, max_deliveries=5)
    first = receipts(lease(s, "c", ["a", "b", "d"], now=0))
    assert s.nack("c", 1, [], delay_ms=2, sort_key=0, receipts=[first["a"]])[0] == {}
    assert s.reject("c", 1, [], [first["b"], first["d"]]) == {}
    assert s.redrive(2, s.trimmed_upto(), [("b", 0, 5)]) == (["b"], {})
    state = s.__getstate__()
    names = Named(["a", "b", "d"])
    assert state["deliveries"] == {mh("a"): 1} and names.ids(state["redriven_at"]) == ["b"]
    assert state["settled"] == {mh("d"): "dead"} and state["not_before"] == {mh("a"): 3}
    assert state["sort_keys"] == {mh("a"): 0, mh("b"): 5}
    assert state.pop("redriven_ids") == {mh("b"): "b"}, "named by its events, if not kept"
    by_handle = ("deliveries", "redriven_at", "settled", "sort_keys", "not_before")
    for name in by_handle:
        state[name] = {names[h]: value for h, value in state[name].items()}
    state["events"] = EventLog(e._replace(mh=names[e.mh]) for e in s.events)  # by id too
    again = TopicState.__new__(TopicState)
    again.__setstate__(pickle.loads(pickle.dumps(state)))
    for name in (*by_handle, "redriven_ids", "events"):
        assert getattr(again, name) == getattr(s, name), name
    for state_now in (s, again):
        assert len(lease(state_now, "c", ["a"], now=2)) == 0, "delayed until 3"
        assert list(lease(state_now, "c", ["a", "d"], now=3).deliveries) == [2]
        assert state_now.deliveries == {} and state_now.settled_event("d") == "dead"
        assert state_now.not_before == {} and state_now.sort_key(mh("b"), 1) == 5
        assert state_now.cancel(4, "d", 0, 1) == Refusal.SETTLED
        state_now.trim(state_now.seq)
        assert state_now.redriven_at == {} and state_now.settled == {}
        assert state_now.redriven_ids == {}


class BeforeHandles(SnapshotUnpickler):
    """A node's snapshot load as code from before message handles runs it: that code has
    no `dejaq.broker.state.handles` module, so its import fails. Simulated here by
    refusing the module in `find_class`, where that import would be made."""

    def find_class(self, module: str, name: str) -> Any:
        if module == KeyedByHandle.__module__:
            raise ModuleNotFoundError(f"No module named {module!r}")
        return super().find_class(module, name)


def test_a_snapshot_by_handle_is_refused_by_code_from_before_handles() -> None:
    """A topic's state pickled as a snapshot holds the mark `KeyedByHandle`: code from
    before handles fails to load it (a node then exits naming its snapshot) rather than
    taking its maps by handle for maps by id, which would lease a dead message again.
    This code loads it, keeping no mark in the state."""
    s = TopicState(buckets=1, max_deliveries=5)
    lease(s, "c", ["a", "b"], now=0)
    assert s.reject("c", 1, ["a"]) == {}
    blob = pickle.dumps(s, protocol=5)
    assert KeyedByHandle.__name__.encode() in blob
    with pytest.raises(ModuleNotFoundError, match=KeyedByHandle.__module__):
        BeforeHandles(io.BytesIO(blob)).load()
    again = SnapshotUnpickler(io.BytesIO(blob)).load()
    assert "keyed_by" not in vars(again) and again.__getstate__()["keyed_by"] is KeyedByHandle
    assert again.settled_event("a") == "dead" and again.lease_of("b") is not None
    assert len(lease(again, "c", ["a"], now=2)) == 0, "dead: not leased again"
