"""Driver-side dedup of explicit ids: first wins, replays are not duplicates, the window ends."""

from __future__ import annotations

import datetime as dt

import pyarrow as pa
import pyarrow.compute as pc
from hypothesis import given
from hypothesis import strategies as st

from dejaq.pipelines.dedup import IN_BATCH, IN_BUFFER, SeenIds, default_id_pattern

T0 = dt.datetime(2026, 11, 21, tzinfo=dt.UTC)
HOUR_MS = 3600 * 1000


def batch(rows: list[tuple[str, int, int, int]]) -> pa.Table:
    """(id, partition, offset, produced second) rows of topic `in`."""
    ids, parts, offsets, seconds = zip(*rows, strict=True) if rows else ([], [], [], [])
    return pa.table(
        {
            "message_id": pa.array(ids, pa.string()),
            "source_topic": pa.array(["in"] * len(rows), pa.string()),
            "source_partition": pa.array(parts, pa.int32()),
            "source_offset": pa.array(offsets, pa.int64()),
            "produced_at": pa.array(
                [T0 + dt.timedelta(seconds=s) for s in seconds], pa.timestamp("us", "UTC")
            ),
        }
    )


def test_first_wins_in_a_batch_by_produce_time_then_coordinates() -> None:
    seen = SeenIds(HOUR_MS)
    verdict = seen.check(
        batch([("a", 1, 5, 2), ("a", 0, 9, 1), ("a", 0, 3, 2), ("b", 0, 4, 9)]), 1_000
    )
    assert verdict.kept == {"a": ("in", 0, 9), "b": ("in", 0, 4)}
    assert verdict.duplicates == {("in", 0, 3): IN_BATCH, ("in", 1, 5): IN_BATCH}


def test_an_id_stored_earlier_is_a_duplicate_but_a_replay_of_its_record_is_not() -> None:
    seen = SeenIds(HOUR_MS)
    seen.commit(seen.check(batch([("a", 0, 0, 0)]), 1_000), now_ms=1_000)
    assert seen.check(batch([("a", 1, 7, 5)]), 1_000).duplicates == {("in", 1, 7): IN_BUFFER}
    replay = seen.check(batch([("a", 0, 0, 0)]), 1_000)
    assert replay.duplicates == {} and replay.kept == {"a": ("in", 0, 0)}


def test_check_alone_changes_nothing_so_a_failed_batch_is_forgotten() -> None:
    seen = SeenIds(HOUR_MS)
    seen.check(batch([("a", 0, 0, 0)]), 1_000)
    assert len(seen) == 0
    assert seen.check(batch([("a", 0, 1, 0)]), 1_000).duplicates == {}


def test_ids_older_than_the_window_are_forgotten_once_their_rows_left_the_buffer() -> None:
    """The broker and the release job know a message by its id: a second row of an id
    whose first is still in the buffer would be taken for the first, and never sent."""
    seen = SeenIds(HOUR_MS)
    seen.load([("old", "in", 0, 0, 0), ("new", "in", 0, 1, HOUR_MS), ("done", None, None, None, 0)])
    seen.commit(seen.check(batch([]), HOUR_MS + 1), now_ms=HOUR_MS + 1)
    assert seen.lingering == {"old": ("in", 0, 0)}, "settled ones have no row to wait for"
    assert seen.check(batch([("done", 1, 0, 0)]), HOUR_MS + 1).duplicates == {}
    assert seen.check(batch([("old", 1, 0, 0)]), HOUR_MS + 1).duplicates == {
        ("in", 1, 0): IN_BUFFER
    }
    assert seen.check(batch([("old", 0, 0, 0)]), HOUR_MS + 1).duplicates == {}, "its own replay"
    assert seen.check(batch([("new", 1, 0, 0)]), HOUR_MS + 1).duplicates == {
        ("in", 1, 0): IN_BUFFER
    }
    assert seen.prune(["old"]) == 0 and "old" in seen.lingering, "its row is still there"
    assert seen.prune([]) == 1
    assert seen.check(batch([("old", 1, 0, 0)]), HOUR_MS + 1).duplicates == {}
    assert len(seen) == 1


def test_an_id_settled_before_the_window_is_free_before_a_commit_forgets_it() -> None:
    """The input idle past the window: no commit has forgotten a settled id yet, but it is
    free, as a start would judge; one whose row is in the buffer is still taken."""
    seen = SeenIds(HOUR_MS)
    seen.load([("done", None, None, None, 0), ("held", "in", 0, 0, 0)])
    seen.commit(seen.check(batch([]), 0), now_ms=0)
    later = seen.check(batch([("done", 1, 0, 0), ("held", 1, 1, 0)]), HOUR_MS + 1)
    assert later.kept == {"done": ("in", 1, 0)}
    assert later.duplicates == {("in", 1, 1): IN_BUFFER}
    seen.commit(later, now_ms=HOUR_MS + 1)
    assert seen.check(batch([("done", 1, 2, 0)]), HOUR_MS + 2).duplicates == {
        ("in", 1, 2): IN_BUFFER
    }, "stored anew"


def test_a_look_for_the_ids_a_batch_reuses_frees_those_whose_rows_left_alone() -> None:
    """The ingest looks for the lingering ids a batch reuses before judging it: each
    whose row has left is free for it, the others stay taken, and ids it did not look
    for are left to the periodic prune."""
    seen = SeenIds(HOUR_MS)
    seen.load([("gone", "in", 0, 0, 0), ("held", "in", 0, 1, 0), ("other", "in", 0, 2, 0)])
    seen.expire(HOUR_MS + 1)
    reused = seen.lingering_among(["gone", "held", "fresh"])
    assert reused == {"gone": ("in", 0, 0), "held": ("in", 0, 1)}
    assert seen.prune(["held"], among=reused) == 1
    assert set(seen.lingering) == {"held", "other"}, "not looked for: still lingering"
    verdict = seen.check(batch([("gone", 1, 0, 0), ("held", 1, 1, 0)]), HOUR_MS + 1)
    assert verdict.kept == {"gone": ("in", 1, 0)}
    assert verdict.duplicates == {("in", 1, 1): IN_BUFFER}


def test_a_zero_window_dedups_against_the_buffer_alone() -> None:
    seen = SeenIds(0)
    seen.commit(seen.check(batch([("a", 0, 0, 0), ("a", 0, 1, 0)]), 0), now_ms=0)
    assert seen.check(batch([("a", 0, 2, 0)]), 0).duplicates == {("in", 0, 2): IN_BUFFER}
    seen.commit(seen.check(batch([]), 1), now_ms=1)
    assert seen.lingering == {"a": ("in", 0, 0)}
    seen.prune([])
    assert len(seen) == 0
    assert seen.check(batch([("a", 0, 2, 0)]), 0).duplicates == {}


@given(
    events=st.lists(
        st.one_of(
            st.tuples(st.just("ingest"), st.sampled_from("abc"), st.integers(0, 3)),
            st.tuples(st.just("leave"), st.sampled_from("abc"), st.integers(0, 3)),
            st.tuples(st.just("prune"), st.just(""), st.integers(0, 3)),
        ),
        max_size=40,
    )
)
def test_an_id_is_never_stored_twice_while_its_first_row_is_in_the_buffer(events) -> None:
    """Whatever the window, the time and the rounds of `prune`: a record is kept if and
    only if no row of its id is in the buffer (retention takes rows away: `leave`), nor
    was stored within the window. Each batch looks for the lingering ids it reuses, as
    the ingest does, so an id is free as soon as its row left and its window passed."""
    window = 5
    seen = SeenIds(window)
    buffer: dict[str, tuple] = {}  # id -> its row's coordinates
    stored_at: dict[str, int] = {}  # id -> when its last row was stored
    now = offset = 0
    for kind, mid, step in events:
        now += step
        if kind == "leave":
            buffer.pop(mid, None)
        elif kind == "prune":
            seen.prune([m for m in seen.lingering if m in buffer])
        else:
            offset += 1
            seen.expire(now)
            reused = seen.lingering_among([mid])
            seen.prune([m for m in reused if m in buffer], among=reused)
            verdict = seen.check(batch([(mid, 0, offset, now)]), now)
            past = now - stored_at.get(mid, -window - 1) >= window
            if mid in verdict.kept:
                assert mid not in buffer, "a second row of an id in the buffer"
                assert past, "within the window"
                buffer[mid], stored_at[mid] = verdict.kept[mid], now
            else:
                assert mid in buffer or not past, "a free id held a duplicate"
            seen.commit(verdict, now_ms=now)


records = st.lists(
    st.tuples(st.sampled_from("abcde"), st.integers(0, 2), st.integers(0, 5)),
    max_size=30,
)


@given(batches=st.lists(records, max_size=5))
def test_each_id_is_kept_once_at_its_first_record_across_batches(batches) -> None:
    """Stored once, first wins, whatever the batches; in = kept + duplicates per batch."""
    seen = SeenIds(HOUR_MS)
    stored: dict[str, tuple] = {}
    offset = 0
    for n, rows in enumerate(batches):
        numbered = []
        for mid, part, second in rows:
            numbered.append((mid, part, offset, n * 10 + second))
            offset += 1
        verdict = seen.check(batch(numbered), n)
        assert len(verdict.kept) + len(verdict.duplicates) == len(numbered)
        assert not set(verdict.kept) & set(stored), "an id stored earlier is kept again"
        for mid, coordinates in verdict.kept.items():
            first = min((r for r in numbered if r[0] == mid), key=lambda r: (r[3], r[1], r[2]))
            assert coordinates == ("in", first[1], first[2])
        seen.commit(verdict, now_ms=n)
        stored.update(verdict.kept)


def test_the_default_id_pattern_takes_no_explicit_id_with_a_leading_zero_for_one() -> None:
    """The ingest leaves default ids out of the seed it reads from the ledger (they cannot
    repeat); an explicit id taken for one would escape deduplication once its buffer row
    is gone. The pattern runs where the ingest runs it, in Arrow's regex engine."""
    ids = ["orders-0-0", "orders-3-1024", "orders-2024-0001", "orders-01-5", "orders-1", "x-0-0"]
    pattern = default_id_pattern(["orders", "x"])
    matched = pc.match_substring_regex(pa.array(ids), pattern).to_pylist()
    assert [i for i, m in zip(ids, matched, strict=True) if m] == [
        "orders-0-0",
        "orders-3-1024",
        "x-0-0",
    ]
