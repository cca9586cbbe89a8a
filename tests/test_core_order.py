"""The compiled core's per-bucket order (`dejaq_core.Order`) against a model: a multiset
of entries, taken lowest first across the buckets asked, never one whose token is no
longer its message's or that the state makes stale, never one above the key limit."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
from dejaq_core import LeaseTable, Order
from hypothesis import given, settings
from hypothesis import strategies as st

from dejaq.broker.state.handles import mh, mhs
from dejaq.broker.state.leases import unpacked

BITS = 32
BUCKETS = 3


class Rows:
    """The row store's columns, as `RowStore` keeps them: the batch that stored each
    handle's row (a token's high bits), 0 when free."""

    def __init__(self, size: int = 64) -> None:
        self.batch = np.zeros(size, np.uint32)
        self.sort_key = np.zeros(size, np.int64)
        self.partition = np.zeros(size, np.int32)
        self.offset = np.zeros(size, np.int64)
        self.ids = np.zeros(size, "S8")  # as `IdTable.ids`, and the ids it holds apart
        self.long: dict[int, str] = {}
        self.batches = 0

    def columns(self) -> tuple[np.ndarray, ...]:
        return self.batch, self.sort_key, self.partition, self.offset

    def id_columns(self) -> tuple:
        return self.ids.view(np.uint8), self.ids.dtype.itemsize, self.long

    def mid(self, token: int) -> str:
        h = token & ((1 << BITS) - 1)
        return self.long.get(h) or self.ids[h].decode()

    def store(self, keys: list[tuple[int, int]]) -> np.ndarray:
        """Rows at free handles, lowest first; returns their tokens."""
        self.batches += 1
        handles = np.flatnonzero(self.batch == 0)[: len(keys)]
        for h, (key, partition) in zip(handles.tolist(), keys, strict=True):
            self.sort_key[h], self.partition[h], self.offset[h] = key, partition, h
            self.batch[h] = self.batches
            mid = f"é{self.batches}.{h}"  # some ids held apart, as a long one's are
            self.ids[h] = mid.encode()[:8]
            self.long.pop(h, None)
            if h % 3 == 0:
                self.long[h] = mid + "-" * 70
        return handles | (self.batches << BITS)

    def entry(self, token: int, key: int | None = None) -> tuple[int, int, int, int]:
        h = token & ((1 << BITS) - 1)
        own = int(self.sort_key[h])
        return (own if key is None else key, int(self.partition[h]), int(self.offset[h]), token)

    def token(self, h: int) -> int:
        """The token of the row at handle `h`, 0 if it is free."""
        batch = int(self.batch[h])
        return batch << BITS | h if batch else 0

    def current(self, token: int) -> bool:
        return int(self.batch[token & ((1 << BITS) - 1)]) == token >> BITS


operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.integers(0, BUCKETS - 1),
            st.lists(st.tuples(st.integers(0, 20), st.integers(0, 2)), min_size=1, max_size=12),
        ),
        st.tuples(st.just("forget"), st.integers(0, 63)),
        st.tuples(st.just("rekey"), st.integers(0, 63), st.integers(0, 20)),
        st.tuples(
            st.just("pick"),
            st.lists(st.integers(0, BUCKETS - 1), min_size=1, max_size=BUCKETS + 2),  # a repeat too
            st.integers(0, 10),
            st.integers(0, 25),
            st.sets(st.integers(0, 63), max_size=8),  # handles whose messages settled or are leased
        ),
    ),
    max_size=40,
)

NO_STATE = ({}, LeaseTable(), {}, {})


@settings(max_examples=300, deadline=None)
@given(operations=operations, run_min=st.integers(1, 8))
def test_pick_takes_the_lowest_current_entries_of_the_buckets_asked(
    operations: list[tuple], run_min: int
) -> None:
    rows = Rows()
    order = Order(BUCKETS)
    model: list[tuple[tuple[int, int, int, int], int]] = []  # (entry, bucket)
    bucket_of: dict[int, int] = {}  # token -> bucket
    for op in operations:
        if op[0] == "add" and (rows.batch == 0).sum() >= len(op[2]):
            tokens = rows.store(sorted(op[2]))
            order.add(op[1], tokens, run_min, *rows.columns())
            for token in tokens.tolist():
                bucket_of[token] = op[1]
                model.append((rows.entry(token), op[1]))
        elif op[0] == "forget":
            rows.batch[op[1]] = 0
        elif op[0] == "rekey" and rows.batch[op[1]]:
            token = rows.token(op[1])
            entry = rows.entry(token, op[2])
            order.push(bucket_of[token], *entry)
            model.append((entry, bucket_of[token]))
        elif op[0] == "pick":
            _, buckets, n, max_key, gone = op
            gone_ids = [rows.mid(rows.token(h)) for h in sorted(gone) if rows.batch[h]]
            settled = dict.fromkeys(mhs(gone_ids[::2]), "acked")  # by handle, as the state
            leased = LeaseTable()
            assert leased.add_all(gone_ids[1::2], 1)
            state = (settled, leased, {}, {})
            picks, found = order.pick(
                buckets, n, max_key, 0, state, *rows.columns(), *rows.id_columns()
            )
            model = [(e, b) for e, b in model if rows.current(e[3])]
            taken = []
            for e, b in sorted((e, b) for e, b in model if b in buckets and e[0] <= max_key):
                if len(taken) == n:
                    break
                model.remove((e, b))  # met: taken, or stale and dropped
                if mh(rows.mid(e[3])) not in settled and rows.mid(e[3]) not in leased:
                    taken.append((e, b))
            assert np.frombuffer(found, np.int64).tolist() == [e[3] for e, _ in taken]
            assert list(zip(*unpacked(picks), strict=True)) == [
                (mh(rows.mid(e[3])), b, e[0]) for e, b in taken
            ], "by handle, ids held as digests (long) too"
            left = [e[0] for e, b in model if b in buckets and rows.current(e[3])]
            assert order.lowest(buckets) == min(left, default=None), "a timeline's next due"
        live = [e for e, _ in model if rows.current(e[3])]
        assert len(order) >= len(live), "no current entry is lost"
    _, found = order.pick(
        list(range(BUCKETS)), 10_000, 1 << 62, 0, NO_STATE, *rows.columns(), *rows.id_columns()
    )
    assert sorted(np.frombuffer(found, np.int64).tolist()) == sorted(
        e[3] for e, _ in model if rows.current(e[3])
    )


def test_the_lowest_key_is_not_known_before_a_pick_holds_the_columns() -> None:
    """`lowest` reads the columns the last pick held: none before one, or once they are
    released (the row store grew), and a waiting timeline lease looks again on its step."""
    rows = Rows()
    order = Order(BUCKETS)
    order.add(0, rows.store([(5, 0), (7, 0)]), 1, *rows.columns())
    assert order.lowest([0]) is None
    order.pick([1], 1, 0, 0, NO_STATE, *rows.columns(), *rows.id_columns())
    assert order.lowest([0, 1]) == 5
    order.release_columns()
    assert order.lowest([0]) is None


def test_a_merge_keeps_re_keyed_entries_in_the_heap_at_their_keys() -> None:
    """New rows past the heap's share merge into the run; an entry re-keyed by a nack
    stays at its new key, and its row's own entry (still in the run) is the caller's to
    judge stale."""
    rows = Rows()
    order = Order(1)
    first = rows.store([(5, 0), (9, 0)])
    order.add(0, first, 1, *rows.columns())
    order.push(0, *rows.entry(int(first[1]), 1))  # the message at 9, nacked to key 1
    order.add(0, rows.store([(3, 0), (7, 0)]), 1, *rows.columns())
    tokens, heap_keys = (np.frombuffer(b, np.int64) for b in order.entries(0))
    assert heap_keys.tolist() == [1]
    assert len(tokens) == 5
    picks, _ = order.pick([0], 10, 100, 0, NO_STATE, *rows.columns(), *rows.id_columns())
    assert unpacked(picks)[2].tolist() == [1, 3, 5, 7, 9]


def test_a_pick_reads_the_arrays_passed_and_lets_go_of_those_it_held() -> None:
    """The order holds the columns' buffers between picks, and takes new ones whenever
    other arrays are passed (a store that grew or shrank passes copies): a pick never
    reads a replaced column. `release_columns` lets the held arrays go."""
    rows = Rows()
    order = Order(1)
    order.add(0, rows.store([(5, 0), (7, 0), (9, 0)]), 1, *rows.columns())
    assert unpacked(order.pick([0], 1, 100, 0, NO_STATE, *rows.columns(), *rows.id_columns())[0])[
        2
    ].tolist() == [5]
    old = weakref.ref(rows.batch)
    rows.batch = rows.batch.copy()  # replaced, as a growth does: the next row leaves it
    rows.batch[np.flatnonzero(rows.sort_key == 7)] = 0
    picks, _ = order.pick([0], 2, 100, 0, NO_STATE, *rows.columns(), *rows.id_columns())
    assert unpacked(picks)[2].tolist() == [9], "the row forgotten in the new column is stale"
    assert old() is None, "the replaced column is let go once another is passed"
    held = weakref.ref(rows.batch)
    rows.batch = rows.batch.copy()
    assert held() is not None, "held by the order until released"
    order.release_columns()
    assert held() is None


def test_bad_calls_are_refused_with_a_clear_error() -> None:
    rows = Rows()
    order = Order(2)
    tokens = rows.store([(1, 0)])
    with pytest.raises(IndexError, match="bucket 2 of 2"):
        order.add(2, tokens, 1, *rows.columns())
    with pytest.raises(ValueError, match="not stored"):
        order.add(0, tokens + 1, 1, *rows.columns())
    with pytest.raises(ValueError, match="rows of 4"):
        order.replace(0, tokens, np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="differ in length"):
        order.pick([0], 1, 10, 0, NO_STATE, rows.batch[:3], *rows.columns()[1:], *rows.id_columns())
    with pytest.raises(ValueError, match="id column does not match"):
        order.pick([0], 1, 10, 0, NO_STATE, *rows.columns(), rows.ids[:3].view(np.uint8), 8, {})
    assert len(order) == 0
