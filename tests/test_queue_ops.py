"""Queue operations in the lease state machine and the index: pause, purge, rate limit,
retry backoff and dead-letter redrive (over real Delta tables where the index takes part)."""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path

import pytest
from conftest import buffer_names
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from test_broker import (
    TEST_IDS,
    buffer_rows,
    fill,
    lease_ids,
    leased,
    listed,
    loaded_topic,
    one_bucket_state,
    settled_ids,
    settled_of,
    topic_conf,
)

from dejaq.broker.state.handles import handles_in, mh, mhs, packed
from dejaq.broker.state.leases import CLOCK_BEHIND_MS, Refusal, TopicState, retry_delay
from dejaq.broker.storage.index import TopicIndex
from dejaq.broker.storage.ledger_writer import checkpoint
from dejaq.conf.settings import TopicConfig
from dejaq.conf.tables import LedgerEvent
from dejaq.jobs.operations import epoch_ms
from dejaq.pipelines.retention import settled_before


def test_a_paused_topic_leases_nothing_while_acks_nacks_and_extends_go_on() -> None:
    s = one_bucket_state()
    leased(s, "c", ["a", "b", "c"], now=0)
    assert s.pause(True) and not s.pause(True), "pausing twice changes nothing"
    assert leased(s, "c", ["d"], now=1) == []
    assert s.ack("c", 2, ["a"]) == {}
    assert s.extend("c", 3, ["b"], 5000)[0] == {}
    assert s.nack("c", 4, ["c"]) == ({}, [mh("c")], [])
    assert leased(s, "c", ["c", "d"], now=5) == [], "nacked: pending, but not leased"
    assert s.expire(5001, heartbeat_timeout_ms=10**9) == []
    assert s.pause(False)
    assert [g[:2] for g in leased(s, "c", ["c", "d"], now=6)] == [("c", 2), ("d", 1)]


def test_purge_cancels_the_pending_and_leaves_the_leased_to_their_consumer() -> None:
    s = one_bucket_state()
    leased(s, "c", ["held", "done"], now=0)
    s.ack("c", 1, ["done"])
    s.sort_keys[mh("late")] = 9
    picks = [("p1", 0, 5), ("late", 0, 3), ("held", 0, 1), ("done", 0, 2)]
    upto = s.trimmed_upto()
    assert s.purge(2, upto, picks) == 2
    assert settled_of(s) == {"done": "acked", "p1": "cancelled", "late": "cancelled"}
    assert [(e.mh, e.sort_key) for e in s.events[1:]] == [(mh("p1"), 5), (mh("late"), 9)]
    assert s.ack("c", 3, ["held"]) == {}, "a leased message is still its consumer's"
    assert s.purge(4, upto, picks) == 0, "purged already"


def test_a_purge_listed_before_a_trim_is_listed_again_not_applied() -> None:
    """A message listed as pending, then leased, acked and trimmed (forgotten here) before
    the purge commits, must not get a second, cancelled, ending."""
    s = one_bucket_state()
    upto = s.trimmed_upto()
    picks = [("m", 0, 1)]
    leased(s, "c", ["m"], now=0)
    s.ack("c", 1, ["m"])
    s.trim(s.seq)
    assert mh("m") not in s.settled, "forgotten once checkpointed"
    assert s.purge(2, upto, picks) is None
    assert s.events == [] and s.totals["cancelled"] == 0
    assert s.purge(3, s.trimmed_upto(), []) == 0, "a fresh list is taken and applied"


def _rate_history() -> st.SearchStrategy:
    return st.lists(st.tuples(st.integers(-2000, 5000), st.integers(1, 50)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(rate=st.floats(0.1, 500), steps=_rate_history())
def test_the_rate_limit_never_grants_more_than_rate_times_elapsed_plus_burst(
    rate: float, steps: list[tuple[int, int]]
) -> None:
    """Whatever the times the leaders stamp (a new leader's clock may be behind), the
    grants up to any lease are at most rate x (latest time - first time) + one burst."""
    s = TopicState(buckets=1, max_deliveries=5)
    burst = max(rate, 1.0)
    start = 10**12
    granted, latest, ids = 0, None, iter(range(10**6))
    for offset, n in steps:
        now = start + offset
        latest = now if latest is None else max(latest, now)
        picks = [(f"m{next(ids)}", 0, 1) for _ in range(n)]
        granted += len(s.lease("c", now, 10**9, picks, rate))
        first = start + steps[0][0]
        assert granted <= rate * max(0, latest - first) / 1000 + burst + 1e-9
    assert s.lease_budget(start + 10**7, rate) == int(burst), "it refills up to a burst"


def test_the_rate_limit_grants_what_accrued_and_the_leader_sizes_picks_by_it() -> None:
    s = one_bucket_state()
    now = 10**12
    assert s.lease_budget(now, 10) == 10, "a full bucket to start"
    assert len(s.lease("c", now, 10**9, [(f"a{i}", 0, 1) for i in range(25)], 10)) == 10
    assert s.lease_budget(now + 99, 10) == 0
    assert s.lease_budget(now + 300, 10) == 3
    got = s.lease("c", now + 300, 1000, [(f"b{i}", 0, 1) for i in range(5)], 10)
    assert len(got) == 3


def test_a_leader_whose_clock_is_far_behind_refills_the_rate_limit_from_its_own_time() -> None:
    """A leader whose clock ran an hour ahead emptied the bucket; the next leader's clock
    is right. Its first lease moves the refill's time back to its own clock (its budget
    at least one, for the leader to commit it), and the bucket refills at the rate from
    there on, where it would otherwise refill nothing for the hour: a stalled topic."""
    s = one_bucket_state()
    ahead, now, hour = 10**12 + 3_600_000, 10**12, 3_600_000
    assert len(s.lease("c", ahead, hour, [(f"a{i}", 0, 1) for i in range(10)], 10)) == 10
    assert s.lease_budget(ahead, 10) == 0, "the bucket empty at the fast clock's time"
    assert s.lease_budget(now, 10) == 1, "the next leader leases, to move the refill back"
    assert len(s.lease("c", now, hour, [("b0", 0, 1)], 10)) == 0, "nothing refilled yet"
    assert s.lease_budget(now + 500, 10) == 5, "refilled from its own clock on"
    assert len(s.lease("c", now + 500, hour, [(f"c{i}", 0, 1) for i in range(9)], 10)) == 5
    assert s.lease_budget(now + 499, 10) == 0, "stamped a little early: no refill"
    assert s.lease_budget(now + 500 - CLOCK_BEHIND_MS, 10) == 0, "as far as a reordering"
    assert s.lease_budget(now + 499 - CLOCK_BEHIND_MS, 10) == 1, "further: another clock"


def test_a_rate_limit_tells_a_reordering_from_another_clock_by_how_raft_stamps() -> None:
    """Leases apply within `STAMPED_WITHIN_MS` of their stamps' order: a stamp further
    back than CLOCK_BEHIND_MS can only be another leader's clock."""
    from dejaq.broker.state.raft import STAMPED_WITHIN_MS

    assert STAMPED_WITHIN_MS <= CLOCK_BEHIND_MS


def test_retry_delay_doubles_per_delivery_up_to_its_cap() -> None:
    assert [retry_delay(d, 100, 1000) for d in (1, 2, 3, 4, 5, 200)] == [
        100,
        200,
        400,
        800,
        1000,
        1000,
    ]


@settings(max_examples=200, deadline=None)
@given(
    base=st.integers(1, 500),
    cap=st.integers(500, 3000),
    steps=st.lists(
        st.tuples(st.sampled_from(["lease", "nack", "expire", "nack_delay"]), st.integers(0, 400)),
        max_size=40,
    ),
)
def test_backoff_never_lets_a_message_out_early(
    base: int, cap: int, steps: list[tuple[str, int]]
) -> None:
    """After an expired lease or a nack without a delay, the message is not leased again
    before base * 2^(deliveries - 1) (capped) has passed; a nack's own delay wins."""
    s = TopicState(buckets=1, max_deliveries=10**6)
    backoff = (base, cap)
    now = 0
    earliest: dict[str, int] = {}
    mids = ["a", "b", "c"]
    for op, dt_ms in steps:
        now += dt_ms
        if op == "lease":
            for mid, deliveries, _ in leased(s, "c", mids, now, lease_ms=300):
                assert now >= earliest.get(mid, 0), (mid, deliveries, now, earliest)
            continue
        leases = {m: s.lease_of(m) for m in lease_ids(s)}
        held = {m: lease.deliveries for m, lease in leases.items() if lease.deadline > now}
        if op == "expire":
            due = {m: lease.deliveries for m, lease in leases.items() if lease.deadline <= now}
            s.expire(now, 10**9, backoff)
            for mid, deliveries in due.items():
                earliest[mid] = now + min(cap, base * 2 ** (deliveries - 1))
        elif op == "nack":
            s.nack("c", now, list(held), backoff=backoff)
            for mid, deliveries in held.items():
                earliest[mid] = now + min(cap, base * 2 ** (deliveries - 1))
        else:
            s.nack("c", now, list(held), delay_ms=7, backoff=backoff)
            for mid in held:
                earliest[mid] = now + 7


def test_without_backoff_a_message_comes_back_at_once() -> None:
    s = one_bucket_state()
    leased(s, "c", ["a"], now=0)
    assert s.expire(1000, 10**9) == [mh("a")] and s.not_before == {}
    assert leased(s, "c", ["a"], now=1000)[0][:2] == ("a", 2)


def dead(s: TopicState, mid: str, now: int) -> None:
    leased(s, "c", [mid], now)
    assert s.reject("c", now, [mid]) == {}


def test_redrive_once_per_death_with_deliveries_reset() -> None:
    s = one_bucket_state(max_deliveries=2)
    dead(s, "a", 0)
    assert s.redrive(1, 0, [("a", 0, 1), ("a", 0, 1)]) == (["a"], {"a": Refusal.REDRIVEN})
    assert s.settled == {} and s.sort_key(mh("a"), 99) == 1, "the key it died with"
    assert s.redrive(2, 0, [("a", 0, 1)]) == ([], {"a": Refusal.REDRIVEN}), "no new death"
    assert leased(s, "c", ["a"], now=3)[0][:2] == ("a", 1), "deliveries from 0"
    assert s.redrive(4, 0, [("a", 0, 1)]) == ([], {"a": Refusal.REDRIVEN}), "leased"
    assert s.expire(1003, 10**9) == [mh("a")]
    assert leased(s, "c", ["a"], now=1004)[0][:2] == ("a", 2)
    assert s.expire(2004, 10**9) == [] and settled_ids(s) == {"a": "dead"}, "died again"
    assert s.redrive(2005, 0, [("a", 0, 1)], sort_key=7) == (["a"], {})
    assert s.sort_key(mh("a"), 1) == 7
    s.lease("c", 2006, 1000, [("a", 0, 7), ("b", 0, 1)])  # picked at its new key
    s.ack("c", 2007, ["a", "b"])
    assert s.redrive(2008, 0, [("a", 0, 1)]) == ([], {"a": Refusal.SETTLED})
    events = [(TEST_IDS[e.mh], e.event, e.sort_key, e.deliveries) for e in s.events]
    assert events == [
        ("a", "dead", 1, 1),
        ("a", "redriven", 1, 0),
        ("a", "dead", 1, 2),
        ("a", "redriven", 7, 0),
        ("a", "acked", 7, 1),
        ("b", "acked", 1, 1),
    ]


def test_a_redrive_read_before_a_trim_is_refused_whole() -> None:
    """The leader read the ledger up to seq 1; the state has since trimmed seq 2: what
    happened to a message in between is in neither, so the leader must read again."""
    s = one_bucket_state()
    dead(s, "a", 0)
    dead(s, "b", 1)
    s.trim(2)
    assert s.redrive(2, 1, [("a", 0, 1)]) is None
    assert s.redrive(2, 2, [("a", 0, 1)]) == (["a"], {}), "it trusts a current ledger read"


def test_trimming_keeps_what_a_redrive_made_pending_again() -> None:
    s = one_bucket_state()
    dead(s, "a", 0)
    s.redrive(1, 0, [("a", 0, 1)])
    assert s.trim(2) == b"", "a's death and redrive settle nothing: its row stays indexed"
    assert s.redriven_at == {} and s.settled == {}
    dead(s, "b", 2)
    s.redrive(3, 2, [("b", 0, 1)])
    leased(s, "c", ["b"], now=4)
    s.reject("c", 5, ["b"])
    assert s.trim(4) == b"" and settled_ids(s) == {"b": "dead"}, "the later death stands"
    assert handles_in(s.trim(5)) == [mh("b")] and s.settled == {}


def test_a_snapshot_keeps_pause_tokens_and_redrives() -> None:
    s = one_bucket_state()
    dead(s, "a", 0)
    s.redrive(1, 0, [("a", 0, 1)])
    s.lease("c", 10**12, 1000, [("b", 0, 1)], 5.0)
    s.pause(True)
    again = pickle.loads(pickle.dumps(s))
    assert again.paused and again.redriven_at == s.redriven_at
    assert (again.tokens, again.refilled_at) == (s.tokens, s.refilled_at)


# --- the index over real Delta tables -----------------------------------------------------


def test_a_redriven_message_is_indexed_again_after_its_row_was_forgotten(tmp_path: Path) -> None:
    warehouse, index, state = loaded_topic(tmp_path, [5, 1])
    picks = listed(index.pick(state, state.buckets_of("c"), 1, now=0))
    state.lease("c", 0, 1000, picks)
    state.reject("c", 1, ["m1"])
    index.forget(state.trim(checkpoint(warehouse, "jobs", state.events, buffer_names(warehouse))))
    assert "m1" not in index.rows
    upto, found, redriven = index.dead(None)
    assert (upto, found, redriven) == (1, {"m1": (1, 1)}, {})
    redrive = state.redrive(2, upto, [("m1", *found["m1"])], sort_key=0)
    assert redrive == (["m1"], {})
    index.push(state, mhs(redrive[0]))
    assert index.unread == {mh("m1"): "m1"} and listed(index.pick(state, [1], 5, now=3)) == []
    assert index.revive(state) == 1 and index.unread == {}
    assert listed(index.pick(state, state.buckets_of("c"), 1, now=3)) == [("m1", 1, 0)]
    assert index.settled_event("m1") == "dead", "the ledger has not seen the redrive yet"

    checkpoint(warehouse, "jobs", state.events, buffer_names(warehouse))
    assert index.settled_event("m1") is None, "dead, then redriven: pending"
    assert index.dead(["m1"])[1] == {} and set(index.dead(["m1"])[2]) == {"m1"}
    fresh = TopicIndex(warehouse, topic_conf())
    fresh.load()
    assert sorted(fresh.rows) == ["m0", "m1"], "a node starting now indexes it"


def test_a_settle_in_its_redrive_s_millisecond_is_what_every_ledger_reader_sees(
    tmp_path: Path,
) -> None:
    """The ledger's times are milliseconds: a redrive and what follows it can share one
    (a cancel right after it; a lease and an ack within it). The settle came last, so
    the message is settled for every reader of the ledger: a question about it, a node
    starting (which would otherwise index and lease it again), retention."""
    warehouse, index, state = loaded_topic(tmp_path, [5, 1, 3])
    picks = listed(index.pick(state, state.buckets_of("c"), 3, now=0))
    state.lease("c", 0, 1000, picks)
    assert state.reject("c", 1, ["m0", "m1", "m2"]) == {}
    index.forget(state.trim(checkpoint(warehouse, "jobs", state.events, buffer_names(warehouse))))
    upto, found, _ = index.dead(None)
    dead = [(mid, *found[mid]) for mid in sorted(found)]
    assert state.redrive(2, upto, dead) == (["m0", "m1", "m2"], {})
    assert state.cancel(2, "m0", *found["m0"]) is None
    state.lease("c", 2, 1000, [("m1", *found["m1"])])
    assert state.ack("c", 2, ["m1"]) == {}
    checkpoint(warehouse, "jobs", state.events, buffer_names(warehouse))

    assert [index.settled_event(m) for m in ("m0", "m1", "m2")] == ["cancelled", "acked", None]
    fresh = TopicIndex(warehouse, topic_conf())
    fresh.load()
    assert sorted(fresh.rows) == ["m2"], "a node starting now indexes the redriven one alone"
    settled, _, died, redriven = settled_before(index.ledger_path, 0, 10)
    assert (sorted(settled.to_pylist()), died, redriven) == (["m0", "m1"], [], ["m2"])
    assert index.dead(None)[1] == {}, "none is dead"


def test_revive_skips_what_settled_or_was_checkpointed_meanwhile(tmp_path: Path) -> None:
    warehouse = str(tmp_path / "wh")
    fill(warehouse, "jobs", buffer_rows([3, 4], bucket_of=lambda i: 0))
    index = TopicIndex(warehouse, topic_conf())
    index.load()
    index.forget(packed(["m0", "m1"]))  # both checkpointed, as if settled before
    state = TopicState(4, 5)
    state.settled[mh("m0")] = LedgerEvent.ACKED
    state.redriven_ids.update(zip(mhs(["m0", "m1"]), ["m0", "m1"], strict=True))  # redriven
    index.push(state, mhs(["m0", "m1"]))
    index.forget(packed(["m1"]))
    assert index.unread == {mh("m0"): "m0"}
    assert index.revive(state) == 0 and index.rows == {}


def test_topic_settings_default_to_no_limit_and_no_backoff() -> None:
    t = topic_conf()
    assert (t.max_lease_rate, t.retry_backoff_ms) == (None, 0)
    with pytest.raises(ValidationError, match="retry_backoff_max_ms"):
        TopicConfig(
            name="t", kind="priority", source=["in"], retry_backoff_ms=10, retry_backoff_max_ms=5
        )
    with pytest.raises(ValidationError, match="max_lease_rate"):
        TopicConfig(name="t", kind="priority", source=["in"], max_lease_rate=0)


def test_the_redrive_command_takes_deliver_at_as_epoch_ms_or_iso_8601() -> None:
    assert epoch_ms("1700000000000") == 1_700_000_000_000
    assert epoch_ms("2023-11-14T23:13:20+01:00") == 1_700_000_000_000
    assert epoch_ms("2023-11-14T22:13:20.0009+00:00") == 1_700_000_000_001, "rounded up"
    assert epoch_ms("1970-01-01T00:00:00.0000001+00:00") == 1, "finer than Python keeps"
    assert epoch_ms("1970-01-01T00:00:00.0010000+00:00") == 1
    assert epoch_ms("2023-11-14T22:13:20.123+00:00") == 1_700_000_000_123
    for bad in ("2023-11-14T22:13:20", "soon"):
        with pytest.raises(argparse.ArgumentTypeError, match="offset"):
            epoch_ms(bad)
