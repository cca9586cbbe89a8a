"""Broker core in one process: the lease state machine, bucket assignment, the index over
real Delta tables, and the ledger checkpoint. Also the helpers the process tests share."""

from __future__ import annotations

import base64
import datetime as dt
import gc
import gzip
import importlib
import io
import itertools
import json
import logging
import os
import pickle
import random
import re
import shutil
import sys
import threading
import time
import tracemalloc
import weakref
from array import array
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pytest
from conftest import Named, buffer_names, wait_until
from dejaq_core import PackedIds, read_heads, read_joined_heads, render_leased
from deltalake import DeltaTable, write_deltalake
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from pysyncobj.serializer import Serializer

from dejaq.broker.api.metrics import LeaseLatency
from dejaq.broker.state import leases
from dejaq.broker.state.assignment import rebalance
from dejaq.broker.state.handles import handles_in as unpacked_mhs
from dejaq.broker.state.handles import mh, mhs
from dejaq.broker.state.handles import packed as packed_mhs
from dejaq.broker.state.leases import (
    ACKED,
    BULK_MIN,
    POSITION_BITS,
    LeaseRecord,
    OldPicks,
    Pick,
    Picks,
    Refusal,
    Settlement,
    TopicState,
    unpacked,
)
from dejaq.broker.state.raft import BrokerState
from dejaq.broker.state.settlements import redriven, settlements
from dejaq.broker.storage import head_store, message_json
from dejaq.broker.storage import index as index_module
from dejaq.broker.storage import row_store as row_store_module
from dejaq.broker.storage.index import TopicIndex
from dejaq.broker.storage.ledger_writer import checkpoint, compact_ledger, write_ledger
from dejaq.broker.storage.row_store import HANDLE_MASK, Heads
from dejaq.conf.settings import ConfigError, TopicConfig
from dejaq.conf.tables import BUFFER_SCHEMA, LedgerEvent, Table, ensure_table, scan
from dejaq.jobs.cluster import bindable

_offsets = itertools.count()
T = TypeVar("T")


def buffer_rows(
    keys: list[int],
    bucket_of=lambda i: i % 4,
    prefix: str = "m",
    timeline: bool = False,
    noted: bool = True,
) -> pa.Table:
    """Buffer rows with the given sort keys (priorities, or deliver_at ms for timelines),
    their ids noted in `TEST_IDS` unless not `noted` (a benchmark's millions)."""
    if noted:
        TEST_IDS.note(f"{prefix}{i}" for i in range(len(keys)))
    now = dt.datetime.now(dt.UTC)
    rows = []
    for i, key in enumerate(keys):
        rows.append(
            {
                "message_id": f"{prefix}{i}",
                "bucket": bucket_of(i),
                "sort_key": key,
                "priority": None if timeline else key,
                "deliver_at": dt.datetime.fromtimestamp(key / 1000, dt.UTC) if timeline else None,
                "event_time": None,
                "key": f"k{i}".encode(),
                "payload": f"payload-{prefix}{i}".encode(),
                "headers": [],
                "source_topic": "in",
                "source_partition": 0,
                "source_offset": next(_offsets),
                "produced_at": now,
                "ingested_at": now,
            }
        )
    return pa.Table.from_pylist(rows, schema=BUFFER_SCHEMA)


def backlog_rows(n: int, buckets: int, payload_bytes: int = 100) -> pa.Table:
    """`n` priority rows (ids b0.., sort key = position, spread over `buckets`), built a
    column at a time: a buffer large enough that a node takes seconds to load it."""
    at = np.arange(n)
    now = pa.array([dt.datetime.now(dt.UTC)] * n, BUFFER_SCHEMA.field("ingested_at").type)
    columns = {
        "message_id": pa.array([f"b{i}" for i in range(n)]),
        "bucket": pa.array(at % buckets, pa.int32()),
        "sort_key": pa.array(at, pa.int64()),
        "priority": pa.array(at % 65536, pa.int32()),
        "payload": pa.array([b"x" * payload_bytes] * n, pa.binary()),
        "source_topic": pa.array(["in"] * n),
        "source_partition": pa.array(np.zeros(n, np.int32)),
        "source_offset": pa.array(at + next(_offsets) * n, pa.int64()),
        "produced_at": now,
        "ingested_at": now,
    }
    return pa.Table.from_arrays(
        [columns.get(f.name, pa.nulls(n, f.type)) for f in BUFFER_SCHEMA], schema=BUFFER_SCHEMA
    )


HOUR_MS = 3_600_000  # a topic's settled retention, as it defaults


def fill(warehouse: str, topic: str, rows: pa.Table) -> None:
    """Append to buffer/<topic> as the ingest job would (delta-rs, partitioned by bucket)."""
    path = ensure_table(warehouse, Table.BUFFER, topic)
    write_deltalake(path, rows, mode="append", partition_by=["bucket"])


def packed(picks: list[Pick], old: str | None = None) -> Picks | OldPicks:
    """A list of (id, bucket, sort key) as a lease command carries picks, as the index
    picks them: their message handles packed; `old`, as commands from before handles
    carry them: their ids packed ("packed", `PackedIds`, unless one cannot be) or a
    list of str ("listed")."""
    mids = [m for m, _, _ in picks]
    TEST_IDS.note(mids)
    named = {
        None: lambda: packed_mhs(mids),
        "packed": lambda: PackedIds.pack(mids) or mids,
        "listed": lambda: mids,
    }[old]()
    buckets = b"".join(b.to_bytes(2, "little") for _, b, _ in picks)
    return named, buckets, b"".join(k.to_bytes(8, "little", signed=True) for _, _, k in picks)


def listed(picks: Picks) -> list[Pick]:
    """Picks as a list of (id, bucket, sort key), named by the ids tests write."""
    handles, buckets, keys = unpacked(picks)
    return list(zip(TEST_IDS.ids(handles), buckets, keys, strict=True))


def record_ids(record: LeaseRecord) -> list[str]:
    """The ids of a lease record's messages, which it holds by handle, in its order."""
    return TEST_IDS.ids(unpacked_mhs(record.handles))


def lease_ids(state: TopicState) -> list[str]:
    """The ids of the messages in `state.leases`, which names them by handle."""
    return TEST_IDS.ids(state.leases)


# The ids these tests write, by handle: the state names settled messages by handle
# alone (its events too), and a test names them back by the ids it may have written.
TEST_IDS = Named(
    [
        *"abcdefghijklmnopqrstuvwxyz",
        *(
            f"{p}{i}"
            for p in ("m", "a", "b", "d", "o", "p", "r", "new", "x", "y", "n", "whole-", "k", "w")
            for i in range(6000)
        ),
        *("done", "late", "one", "dies", "gone", "nowhere", "back", "unknown", "leased", "held"),
        *("", "ü" * 9, "é" * 9),
    ]
)


def settled_ids(state: TopicState) -> dict[str, str]:
    """`state.settled`, which names messages by handle, by id (`TEST_IDS`)."""
    return {TEST_IDS[h]: event for h, event in state.settled.items()}


def settled_of(state: TopicState) -> dict[str, str]:
    """Every message settled and not yet trimmed, with its event: those in `settled`, and
    the acked ones, which `leases` keeps (their mark is in the lease's record)."""
    acked = [m for m in lease_ids(state) if state.settled_event(m) == LedgerEvent.ACKED]
    return {**settled_ids(state), **dict.fromkeys(acked, "acked")}


def leased_ids(state: TopicState) -> set[str]:
    """The messages leased now."""
    return {m for m in lease_ids(state) if state.lease_of(m) is not None}


# --- state machine ------------------------------------------------------------------------


def leased(state: TopicState, consumer: str, mids: list[str], now: int, lease_ms: int = 1000):
    """Lease `mids` of bucket 0 as the index's picks carry them: packed (`packed`)."""
    return grants(state.lease(consumer, now, lease_ms, packed([(m, 0, 1) for m in mids])))


def grants(lease: LeaseRecord) -> list[tuple[str, int, int]]:
    """(id, deliveries, deadline) of each message a lease granted, in pick order."""
    return [
        (m, n, lease.deadline_of(p))
        for p, (m, n) in enumerate(zip(record_ids(lease), lease.deliveries, strict=True))
    ]


def one_bucket_state(max_deliveries: int = 5) -> TopicState:
    return TopicState(buckets=1, max_deliveries=max_deliveries)


def test_ack_settles_once_and_refuses_with_reasons() -> None:
    s = one_bucket_state()
    assert [g[0] for g in leased(s, "c1", ["a", "b", "c"], now=0)] == ["a", "b", "c"]
    assert leased(s, "c1", ["a"], now=1) == [], "a leased message is not leased again"
    assert s.ack("c1", 10, ["a"]) == {}
    assert s.ack("c1", 11, ["a", "zz"]) == {"a": Refusal.SETTLED, "zz": Refusal.NOT_LEASED}
    assert s.ack("c2", 12, ["b"]) == {"b": Refusal.OTHER_CONSUMER}
    assert s.ack("c1", 1000, ["c"]) == {"c": Refusal.EXPIRED}, "deadline is exclusive"
    assert leased(s, "c1", ["a"], now=20) == [], "an acked message is never leased again"
    assert [e.event for e in s.events] == ["acked"]


def test_each_settling_transition_hashes_a_message_s_id_at_most_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A nack, a release, an expiry and a reject by receipt hash no id: the lease record
    holds its messages' handles. A cancel, which names its message by id, hashes it
    once, for every map it touches and the lease table."""
    hashed: list[str] = []

    def counted(mid: str) -> int:
        hashed.append(mid)
        return mh(mid)

    def hashes(step: Callable[[], object]) -> list[str]:
        hashed.clear()
        step()
        return sorted(hashed)

    s = one_bucket_state(max_deliveries=2)
    record = s.lease("c", 0, 100, [(m, 0, 1) for m in "abcdfg"], lid=1)
    receipt = dict(zip(record_ids(record), map(record.receipt, range(6)), strict=True))
    s.lease("c", 0, 10_000, [("e", 0, 1)], lid=2)
    monkeypatch.setattr(leases, "mh", counted)
    assert hashes(lambda: s.nack("c", 1, [], receipts=[receipt["a"], receipt["b"]])) == []
    assert hashes(lambda: s.reject("c", 1, [], [receipt["c"]])) == []
    assert hashes(lambda: s.cancel(1, "d", 0, 4)) == ["d"]
    assert hashes(lambda: s.cancel(1, "z", 0, 4)) == ["z"], "a pending message"
    assert hashes(lambda: s.expire(1_000, 10**9)) == []
    assert hashes(lambda: s.leave("c", 1_000)) == []
    again = s.lease("d2", 2_000, 100, [("a", 0, 1)], lid=3)
    assert hashes(lambda: s.nack("d2", 2_001, [], receipts=[again.receipt(0)])) == []
    assert s.settled_event("a") == LedgerEvent.DEAD, "its second delivery, its last"


def test_expiry_redelivers_then_dead_letters_at_max_deliveries() -> None:
    s = one_bucket_state(max_deliveries=2)
    assert leased(s, "c1", ["a"], now=0) == [("a", 1, 1000)]
    assert s.expire(1000, heartbeat_timeout_ms=10**9) == [mh("a")]
    assert s.deliveries == {mh("a"): 1}, "pending again, its count kept"
    assert leased(s, "c1", ["a"], now=1001) == [("a", 2, 2001)], "deliveries + 1"
    assert s.deliveries == {} and s.lease_of("a").deliveries == 2, "the lease holds it"
    assert s.expire(2001, heartbeat_timeout_ms=10**9) == [], "second expiry: dead"
    assert settled_ids(s) == {"a": "dead"}
    assert s.events[-1].reason == "max_deliveries" and s.events[-1].deliveries == 2


def test_nack_delay_priority_and_reject() -> None:
    s = one_bucket_state()
    leased(s, "c1", ["a", "b"], now=0)
    assert s.nack("c1", 5, ["a"], delay_ms=100, sort_key=7) == ({}, [mh("a")], [])
    assert not s.is_available("a", 104) and s.is_available("a", 105)
    assert s.sort_key(mh("a"), 1) == 7
    assert s.reject("c1", 6, ["b"]) == {}
    assert settled_ids(s) == {"b": "dead"} and s.events[-1].reason == "rejected"


def test_consumers_join_leave_and_time_out() -> None:
    s = TopicState(buckets=4, max_deliveries=5)
    s.touch("c1", 0)
    assert sorted(s.buckets_of("c1")) == [0, 1, 2, 3]
    s.lease("c1", 0, 1000, [("a", 3, 1)])
    s.touch("c2", 1)
    assert len(s.buckets_of("c1")) == 2
    assert s.assignment[3] == "c2" and s.buckets_of("c2") == [2], "3 waits for c1's lease"
    assert s.leave("c1", 2) == [mh("a")] and s.deliveries == {}, "leaving is not a failed delivery"
    assert sorted(s.buckets_of("c2")) == [0, 1, 2, 3]
    s.touch("c3", 50)
    assert s.expire(1000, heartbeat_timeout_ms=999) == []
    assert list(s.consumers) == ["c3"] and set(s.assignment.values()) == {"c3"}


def test_a_consumer_timed_out_rejoins_with_buckets_not_through_an_ack() -> None:
    """A consumer the heartbeat expiry removed while it held a lease still acks it; the
    ack must not re-add it (it would own no bucket for good): its next lease joins."""
    s = TopicState(buckets=4, max_deliveries=5)
    s.touch("a", 0)
    s.touch("b", 0)
    [bucket, *_] = s.buckets_of("b")
    s.lease("b", 0, 10_000, [("m", bucket, 1)])
    s.touch("a", 900)
    assert s.expire(1000, heartbeat_timeout_ms=999) == []
    assert list(s.consumers) == ["a"] and set(s.assignment.values()) == {"a"}
    assert s.ack("b", 1001, ["m"]) == {}
    assert list(s.consumers) == ["a"], "an ack is no way back in"
    assert sorted(s.buckets_of("a")) == [0, 1, 2, 3]
    assert s.extend("b", 1002, ["m"], 1000)[0] == {"m": Refusal.SETTLED}
    assert s.touch("b", 1003) is True, "its next lease or heartbeat joins"
    assert len(s.buckets_of("b")) == 2 and len(s.buckets_of("a")) == 2


@given(
    buckets=st.integers(1, 64),
    before=st.sets(st.sampled_from("abcdefgh"), max_size=8),
    after=st.sets(st.sampled_from("abcdefgh"), max_size=8),
)
def test_rebalance_is_fair_total_and_sticky(buckets: int, before: set, after: set) -> None:
    old = rebalance(buckets, before, {})
    new = rebalance(buckets, after, old)
    if not after:
        assert new == {}
        return
    assert sorted(new) == list(range(buckets)) and set(new.values()) <= after
    counts = [list(new.values()).count(c) for c in after]
    assert max(counts) - min(counts) <= 1
    stay = before & after
    kept = sum(1 for b, c in old.items() if c in stay and new[b] == c)
    quota = -(-buckets // len(after))
    assert kept >= sum(min(list(old.values()).count(c), quota - 1) for c in stay)
    assert rebalance(buckets, after, old) == new, "deterministic"


def _rebalance_reference(
    buckets: int, consumers: set[str], current: dict[int, str]
) -> dict[int, str]:
    """`rebalance` as first written, a max over every consumer per free bucket: the
    assignment is replicated state, so any faster one must give exactly this."""
    live = sorted(set(consumers))
    if not live:
        return {}
    base, extra = divmod(buckets, len(live))
    quota = {c: base + (1 if i < extra else 0) for i, c in enumerate(live)}
    owned = dict.fromkeys(live, 0)
    result: dict[int, str] = {}
    for b in range(buckets):
        owner = current.get(b)
        if owner in quota and owned[owner] < quota[owner]:
            result[b] = owner
            owned[owner] += 1
    for b in range(buckets):
        if b not in result:
            owner = max(live, key=lambda c: (quota[c] - owned[c], [-ord(ch) for ch in c]))
            result[b] = owner
            owned[owner] += 1
    return result


# Ids that are prefixes of each other, differ in case, or reach beyond ASCII, where a
# tie-break by code points and lengths could go either way.
CONSUMER_IDS = st.text(st.sampled_from("aAb\x00\xe9\u4e00\ud800\U0010ffff"), max_size=4)


@settings(max_examples=400, deadline=None)
@given(
    buckets=st.integers(1, 200),
    consumers=st.sets(CONSUMER_IDS, max_size=12),
    current=st.dictionaries(st.integers(0, 220), CONSUMER_IDS, max_size=220),
)
@example(buckets=7, consumers={"a", "ab", "b", "aa"}, current={})
@example(buckets=10, consumers={"ab", "a"}, current={0: "a", 1: "a", 2: "a", 3: "gone"})
def test_rebalance_is_the_reference_assignment(
    buckets: int, consumers: set[str], current: dict[int, str]
) -> None:
    """Every node and every replayed journal computes the same assignment, whichever
    way the free buckets are handed out."""
    expected = _rebalance_reference(buckets, consumers, current)
    assert rebalance(buckets, consumers, current) == expected
    settled = rebalance(buckets, consumers | {"joiner"}, expected)
    assert settled == _rebalance_reference(buckets, consumers | {"joiner"}, expected)


def test_a_join_costs_in_buckets_and_ids_not_their_product() -> None:
    """A join on the largest topic walks the buckets once and each consumer once: picking
    each free bucket's owner by a scan over every consumer's id (free buckets x consumers x
    id length calls) blocks every node's event loop while it applies the join."""
    buckets, ids = 4096, [f"{i:08x}-worker-{i * 7919:012x}-host-pool" for i in range(500)]
    before = rebalance(buckets, ids[:-1], {})
    calls = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        calls += event in ("call", "c_call")

    sys.setprofile(count)
    try:
        after = rebalance(buckets, ids, before)
    finally:
        sys.setprofile(None)
    assert after == _rebalance_reference(buckets, set(ids), before)
    moved = sum(1 for b in range(buckets) if after[b] != before[b])
    assert 0 < moved <= 16, "a join moves only the joiner's share"
    bound = 2 * (buckets + len(ids))
    assert calls <= bound, f"{calls} calls to apply one join (bound {bound})"


OLD_SNAPSHOT = bytes.fromhex(
    "80059531020000000000008c0d62726f6b65722e6c6561736573948c0a546f70696353746174659493942981"
    "947d94288c076275636b657473944b048c0e6d61785f64656c69766572696573944b058c066c656173657394"
    "7d94288c026d329468008c054c656173659493942981944e7d94288c08636f6e73756d6572948c0161948c06"
    "6275636b6574944b018c08736f72745f6b6579944b088c08646561646c696e65944deb038c0a64656c697665"
    "72696573944b01758694628c026d3394680b2981944e7d9428680e8c01629468104b0268114b0968124deb03"
    "68134b01758694627568137d942868094b0168154b01758c09736f72745f6b657973947d948c0a6e6f745f62"
    "65666f7265947d948c07736574746c6564947d948c026d31948c0b636f6e662e7461626c6573948c0b4c6564"
    "6765724576656e749493948c0561636b65649485945294738c066576656e7473945d9468008c054576656e74"
    "9493942981945d94284b0168214b0068274b074b014b044e6562618c03736571944b018c09636f6e73756d65"
    "7273947d9428680f4b0468184b03758c0a61737369676e6d656e74947d94284b00680f4b01680f4b0268184b"
    "036818758c0468656c64947d94284b008c0b636f6c6c656374696f6e73948c07436f756e7465729493947d94"
    "859452944b0168377d94680f4b0173859452944b0268377d9468184b017385945294758c06746f74616c7394"
    "68377d94288c066c6561736564944b038c0b726564656c697665726564944b0068274b01758594529475622e"
)


def test_a_snapshot_from_before_derived_bucket_owners_and_unfrozen_events_loads(
    tmp_path: Path,
) -> None:
    """A Raft snapshot pickled by an early broker (frozen `Event`, no `owned`, classes
    named by their module before the `dejaq` package): consumers a and b, a holds m2 and
    acked m1, b holds m3. A restarted cluster must read it through PySyncObj's own
    serializer, and what it writes now must read back the same."""
    importlib.import_module("dejaq.broker.state.raft")  # hands PySyncObj's serializer its loader
    snapshot = tmp_path / "snapshot"
    snapshot.write_bytes(gzip.compress(OLD_SNAPSHOT))
    old = Serializer(str(snapshot), 0, False, None, None, None).deserialize()
    assert old.owned == {"a": [0, 1], "b": [2, 3]}
    assert sorted(old.buckets_of("a")) == [0, 1] and old.buckets_of("b") == [2, 3]
    assert sorted(lease_ids(old)) == ["m2", "m3"] and settled_ids(old) == {"m1": "acked"}
    assert old.deliveries == {} and old.lease_of("m3").deliveries == 1, "counted by the lease"
    assert not old.paused and old.redriven_at == {}, "from before pause and redrive"
    assert old.requests == {} and old.again("a", "r1") is None, "and before lease requests"
    assert old.held == {0: {}, 1: {"a": 1}, 2: {"b": 1}}, "counts above 0 only"
    assert all(type(h) is dict for h in old.held.values()), "plain dicts, as a new state's"
    assert old.lease_budget(10**12, 5.0) == 5, "and before rate limits: a full bucket"
    [event] = old.events
    assert type(event) is Settlement, "made the tuple a checkpoint converts to Arrow"
    assert (event.seq, event.mh, event.bucket, event.event) == (1, mh("m1"), 0, "acked")
    assert (event.sort_key, event.deliveries, event.at, event.reason) == (7, 1, 4, None)
    old.ack("b", 5, ["m3"])
    old.requested("b", "r1", old.lease("b", 6, 1000, [("m4", 2, 9)], lid=1))
    again = pickle.loads(pickle.dumps(old))
    assert again.events == old.events and again.owned == old.owned
    assert again.requests == {"b": ("r1", 1)} and again.again("b", "r1") is not None
    assert again.buckets_of("a") == old.buckets_of("a")


def test_a_snapshotted_topic_takes_new_buckets_and_max_deliveries_by_a_configure_command() -> None:
    """A node loading a snapshot keeps its topics' buckets and max_deliveries whatever its
    configuration says (16 buckets, 5 deliveries); a `configure` command changes them
    at its point of the log. Buckets 16-31 are then assigned and leased, a message dies
    after the new 2 deliveries, and a lease in a bucket removed later stays valid."""
    before = BrokerState([topic_conf(buckets=16)], 5, _NoIndex())
    for consumer in ("a", "b"):
        before.topics["jobs"].touch(consumer, 0)
    snapshot = pickle.loads(pickle.dumps(before._serialize()))
    node = BrokerState([topic_conf(buckets=32)], 2, _NoIndex())  # restarted, config changed
    node._deserialize(snapshot)
    st = node.topics["jobs"]
    assert (st.buckets, st.max_deliveries, st.configured) == (16, 5, False), "the snapshot's"
    assert max(st.assignment) == 15

    assert node._apply("jobs", "configure", (32, 2)) is True
    assert sorted(st.assignment) == list(range(32))
    assert sorted(len(st.buckets_of(c)) for c in ("a", "b")) == [16, 16], "fair and total"
    owner = st.assignment[20]
    assert 20 in st.buckets_of(owner)
    lease = ("m20", 20, 1)
    assert len(node._apply("jobs", "lease", (owner, 10, 1000, packed([lease]), None, True, 0)))
    assert st.expire(1010, 10**9) == [mh("m20")], "first delivery failed: pending again"
    assert len(node._apply("jobs", "lease", (owner, 1011, 1000, packed([lease]), None, True, 0)))
    assert st.expire(2011, 10**9) == [] and settled_ids(st) == {"m20": "dead"}, "2 deliveries: dead"

    owner = st.assignment[12]
    granted = node._apply(
        "jobs", "lease", (owner, 3000, 1000, packed([("m12", 12, 1)]), None, True, 0)
    )
    assert node._apply("jobs", "configure", (8, 2)) is True
    assert node._apply("jobs", "configure", (8, 2)) is False, "the same again changes nothing"
    assert sorted(st.assignment) == list(range(8))
    assert all(b < 8 for c in ("a", "b") for b in st.buckets_of(c)), "none leased from 8 on"
    assert st.held[12] == {owner: 1}, "the lease in a removed bucket stays valid"
    assert st.ack(owner, 3001, [], [granted.receipt(0)]) == {} and st.held[12] == {}
    again = pickle.loads(pickle.dumps(st))
    assert (again.buckets, again.max_deliveries, again.configured) == (8, 2, True)


def test_raft_pickles_with_protocol_5_and_loads_what_protocol_2_wrote() -> None:
    """Commands, Raft messages and snapshots are pickled with protocol 5; a journal
    entry or a snapshot PySyncObj wrote with its own protocol 2 loads as before."""
    import pysyncobj.pickle

    from dejaq.broker.state import raft

    state = TopicState(4, 5)
    leased(state, "a", ["m1", "m2"], now=0)
    state.ack("a", 1, ["m1"])
    leased(state, "a", [f"whole-{i}" for i in range(BULK_MIN)], now=0)
    assert pysyncobj.pickle.dumps(state)[:2] == pickle.PROTO + bytes([raft.PICKLE_PROTOCOL])
    command = (7, ([("t", "lease", ("c", 1, 30_000, packed([("m3", 0, 3)]), None, True, 2))],))
    for protocol in (2, raft.PICKLE_PROTOCOL):
        assert pysyncobj.pickle.loads(pickle.dumps(command, protocol)) == command
        again = raft._SnapshotPickle.load(io.BytesIO(pickle.dumps(state, protocol)))
        assert again.events == state.events and settled_of(again) == settled_of(state)
        assert set(again.leases) == set(state.leases) and again.held == state.held


class _Niceness:
    """Pickles as the niceness of the process that pickles it."""

    def __reduce__(self) -> tuple[type, tuple[int]]:
        return int, (os.nice(0),)


def test_a_snapshot_is_written_by_a_niced_child_at_gzip_level_1(tmp_path: Path) -> None:
    """PySyncObj forks a child to write each snapshot: the child runs niced, so that
    the nodes sharing a host keep their cores for requests while it writes, and it
    compresses at gzip's fastest level, which reads back as any level does."""
    from pysyncobj.config import SERIALIZER_STATE

    from dejaq.broker.state import raft

    state = TopicState(4, 5)
    leased(state, "a", ["m1", "m2"], now=0)
    state.ack("a", 1, ["m1"])
    snapshot = tmp_path / "raft.dump"
    serializer = Serializer(str(snapshot), 0, True, None, None, None)
    serializer.serialize(([state, _Niceness()], None, None, None), 1)
    states = []

    def written() -> bool:
        states.append(serializer.checkSerializing()[0])
        return states[-1] != SERIALIZER_STATE.SERIALIZING

    wait_until(written, what="the snapshot's child to exit")
    assert states[-1] == SERIALIZER_STATE.SUCCESS
    assert snapshot.read_bytes()[8] == 4  # gzip's XFL: compressed at the fastest level
    (again, niceness), *_ = serializer.deserialize()
    assert niceness == min(19, os.nice(0) + raft.SNAPSHOT_NICE)
    assert settled_of(again) == settled_of(state) and set(again.leases) == set(state.leases)


def test_a_snapshot_child_that_may_not_lower_its_priority_still_writes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the host refuses `nice` (a mock: raising one's own niceness is always allowed
    here), the forked child goes on at the parent's priority, to write and exit, rather
    than raise into the code that forked it."""
    from dejaq.broker.state import raft

    def refused(_: int) -> int:
        raise PermissionError("nice refused")

    monkeypatch.setattr(os, "nice", refused)
    parent = os.getpid()
    try:
        pid = raft._SnapshotOs().fork()
    except BaseException:
        if os.getpid() != parent:
            os._exit(3)  # the child: never back into the test run
        raise
    if pid == 0:
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_snapshot_naming_the_broker_modules_before_their_grouping_loads(
    tmp_path: Path,
) -> None:
    """A snapshot written before the broker's modules were grouped by concern names its
    classes `dejaq.broker.leases.*`: they load from `dejaq.broker.state.leases`."""
    importlib.import_module("dejaq.broker.state.raft")  # hands PySyncObj's serializer its loader
    state = TopicState(4, 5)
    leased(state, "a", ["m1", "m2"], now=0)
    state.ack("a", 1, ["m1"])
    # Protocol 2 names a class as text, module and name, so the old names can be put back.
    data = pickle.dumps(state, protocol=2)
    assert b"dejaq.broker.state.leases" in data
    snapshot = tmp_path / "snapshot"
    snapshot.write_bytes(
        gzip.compress(data.replace(b"dejaq.broker.state.leases", b"dejaq.broker.leases"))
    )
    old = Serializer(str(snapshot), 0, False, None, None, None).deserialize()
    assert type(old) is TopicState and leased_ids(old) == {"m2"}
    assert settled_of(old) == {"m1": "acked"} and old.events == state.events


def free_buckets(s: TopicState, consumer: str) -> set[int]:
    """`buckets_of` by its definition: assigned to it, and no one else holds a lease there."""
    return {
        b
        for b, c in s.assignment.items()
        if c == consumer and not any(n for h, n in s.held.get(b, {}).items() if h != c)
    }


@given(
    buckets=st.integers(1, 40),
    steps=st.lists(
        st.tuples(
            st.sampled_from(["touch", "lease", "ack", "nack", "leave", "expire", "trim"]),
            st.sampled_from("abcd"),
            # Up to 30 picks: a lease may meet more buckets than the core keeps apart
            # before it counts them by map.
            st.lists(st.integers(0, 80), max_size=30),
        ),
        max_size=40,
    ),
)
def test_buckets_of_and_the_leased_records_match_their_definitions_through_any_history(
    buckets, steps
) -> None:
    s = TopicState(buckets=buckets, max_deliveries=3)
    for now, (op, consumer, ids) in enumerate(steps):
        mids = [f"m{i}" for i in ids]
        if op == "touch":
            s.touch(consumer, now)
        elif op == "lease":
            s.touch(consumer, now)  # as the lease would: a newcomer joins, and buckets move
            free = free_buckets(s, consumer)
            taken = {m for m in mids if m in s.leases or mh(m) in s.settled}
            picks = [(m, i % buckets, i) for m, i in zip(mids, ids, strict=True)]
            record = s.lease(consumer, now, 5, picks)
            expected = granted_by_definition(picks, free, taken)
            assert record_ids(record) == [m for m, _ in expected]
        elif op == "ack":
            s.ack(consumer, now, mids)
        elif op == "nack":
            s.nack(consumer, now, mids)
        elif op == "leave":
            s.leave(consumer, now)
        elif op == "trim":
            s.trim(s.seq)
        else:
            s.expire(now, heartbeat_timeout_ms=10)
        for c in "abcd":
            got = s.buckets_of(c)
            assert len(got) == len(set(got)) and set(got) == free_buckets(s, c), (op, c)
        # Expiry and a leaving consumer look only at the records still holding a lease.
        assert s.leased == {lid: r for lid, r in s.records.items() if r.live}, op


def test_a_lease_over_many_buckets_grants_in_the_free_ones_of_its_consumer_only() -> None:
    """A lease meeting more buckets than the core keeps apart before it counts them by
    map: granted exactly where one meeting few would be."""
    s = TopicState(buckets=40, max_deliveries=3)
    s.touch("a", 0)
    s.lease("a", 1, 1000, [(f"a{b}", b, b) for b in range(0, 40, 3)])
    s.touch("b", 2)  # buckets move to b; a still holds leases in some of them
    free = free_buckets(s, "b")
    assert free and free != set(s.owned["b"]), "b owns buckets that are not free to it"
    picks = [(f"m{i % 100}", i % 40, i) for i in range(150)]  # ids picked twice among them
    record = s.lease("b", 3, 1000, picks)
    expected = granted_by_definition(picks, free, taken=set())
    assert record_ids(record) == [m for m, _ in expected]
    assert {b: h["b"] for b, h in s.held.items() if "b" in h} == Counter(b for _, b in expected)


def granted_by_definition(
    picks: list[tuple[str, int, int]], free: set[int], taken: set[str]
) -> list[tuple[str, int]]:
    """(id, bucket) of each pick a lease grants, by `TopicState.lease`'s rule: in a free
    bucket of the consumer's, neither leased nor settled (`taken`), nor granted earlier
    in the same picks."""
    granted: dict[str, int] = {}
    for mid, bucket, _ in picks:
        if bucket in free and mid not in taken and mid not in granted:
            granted[mid] = bucket
    return list(granted.items())


# --- index over real Delta tables ---------------------------------------------------------


def topic_conf(name: str = "jobs", kind: str = "priority", buckets: int = 4) -> TopicConfig:
    return TopicConfig(name=name, kind=kind, source=[f"{name}-in"], buckets=buckets)


def on_one_node(
    tmp_path: Path,
    scenario: Callable[[Any], Awaitable[T]],
    prefix: str = "m",
    node: str = "node",
) -> T:
    """Run `scenario` with a one-node broker (in process, its own Raft, its data in
    `tmp_path / node`: at the Raft address that dir was made with, a restart being the
    same node) over messages m0, m1, m2 (`prefix`) at sort keys 5, 3, 9 in bucket 0,
    added to the warehouse, once it leads and "w" is a member."""
    from dejaq.broker.service import now_ms
    from dejaq.conf.settings import Settings
    from dejaq.jobs.ports import free_port

    warehouse = str(tmp_path / "warehouse")
    fill(warehouse, "jobs", buffer_rows([5, 3, 9], lambda i: 0, prefix))
    settings = Settings(warehouse=warehouse, topics=[topic_conf()])

    async def member(broker: Any) -> T:
        await broker.raft.commit("jobs", "touch", "w", now_ms())  # a member: no join
        return await scenario(broker)

    made = tmp_path / node / "node.json"
    raft = json.loads(made.read_text())["raft"] if made.exists() else f"127.0.0.1:{free_port()}"
    return run_node(settings, raft, tmp_path / node, member)


def test_a_long_poll_of_a_consumer_that_left_during_it_leases_nothing(tmp_path: Path) -> None:
    """A consumer leaves (its worker stopping) while its long poll waits: the leave hands
    its leases back, and the poll must not join it again and lease them to it, for its
    buckets to stay with a worker that is gone until its heartbeat times out."""
    import asyncio

    from dejaq.broker.service import now_ms

    async def scenario(broker: Any) -> tuple[bytes, list[str], int]:
        first = await broker.lease("jobs", "w", 10, 60_000, 0)
        index = broker.indexes["jobs"]
        picks = picks_counted(index)
        poll = asyncio.ensure_future(broker.lease("jobs", "w", 10, 60_000, 5_000))
        await _until(lambda: picks, "the poll's first pick")
        released = await broker.raft.commit("jobs", "leave", "w", now_ms())
        st = broker.state("jobs")
        return (
            await poll,
            sorted(TEST_IDS.ids(released)),
            len(json.loads(first)) + len(st.consumers),
        )

    answer, released, leased_and_members = on_one_node(tmp_path, scenario)
    assert released == ["m0", "m1", "m2"]
    assert answer == b"[]"
    assert leased_and_members == 3, "w is no member after the poll"


def test_an_idle_long_poll_looks_again_when_its_topic_changes_not_on_a_timer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long poll with nothing to lease on a priority topic waits for the topic's next
    change: a lease nacked, rows indexed. It does not pick every few milliseconds
    meanwhile, which costs a leader half a core per thousand idle workers. The idle
    step is set past the test's length here, so only a change can answer the polls."""
    import asyncio

    from dejaq.broker import service

    monkeypatch.setattr(service, "IDLE_POLL_STEP_S", 600.0)
    warehouse = str(tmp_path / "warehouse")

    async def scenario(broker: Any) -> tuple[int, list[str], list[str], float]:
        began = time.monotonic()
        assert len(json.loads(await broker.lease("jobs", "w", 3, 60_000, 0))) == 3
        index = broker.indexes["jobs"]
        picks = picks_counted(index)
        poll = asyncio.ensure_future(broker.lease("jobs", "w", 3, 60_000, 20_000))
        await _until(lambda: picks, "the poll's first pick")
        await asyncio.sleep(1.0)  # the idle second to count picks in, not a synchronisation
        idle_picks = len(picks)
        await broker.nack("jobs", "w", ["m1"], 0, None)
        nacked = [m["id"] for m in json.loads(await poll)]
        poll = asyncio.ensure_future(broker.lease("jobs", "w", 3, 60_000, 20_000))
        fill(warehouse, "jobs", buffer_rows([1], lambda i: 0, "n"))
        landed = [m["id"] for m in json.loads(await poll)]
        return idle_picks, nacked, landed, time.monotonic() - began

    idle_picks, nacked, landed, took = on_one_node(tmp_path, scenario)
    assert idle_picks == 1, f"{idle_picks} picks in an idle second"
    assert nacked == ["m1"]
    assert landed == ["n0"]
    assert took < 15, "each poll answered by its change, not at its 20 s end"


def on_a_timeline_node(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    prefix: str,
    scenario: Callable[[Any], Awaitable[T]],
) -> T:
    """Run `scenario` with a one-node broker over a timeline topic "later" holding one
    message due long ago (`prefix`0), its idle poll step set past any test's length:
    only a due time or a change of the topic answers a waiting poll."""
    from dejaq.broker import service
    from dejaq.conf.settings import Settings
    from dejaq.jobs.ports import free_port

    monkeypatch.setattr(service, "IDLE_POLL_STEP_S", 600.0)
    warehouse = str(tmp_path / "warehouse")
    fill(warehouse, "later", buffer_rows([1], lambda i: 0, prefix, timeline=True))
    settings = Settings(warehouse=warehouse, topics=[topic_conf("later", "timeline")])
    return run_node(settings, f"127.0.0.1:{free_port()}", tmp_path / "node", scenario)


def test_a_timeline_poll_sleeps_until_its_next_message_is_due(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long poll on a timeline topic whose messages are not due yet looks again when
    the next one is due, not every few milliseconds until then, and leases it then,
    never before. The idle step is set past the test's length: only the due time can
    answer the poll."""
    from dejaq.broker.service import now_ms

    async def scenario(broker: Any) -> tuple[list[str], int, int, int]:
        assert len(json.loads(await broker.lease("later", "w", 1, 60_000, 0))) == 1
        index = broker.indexes["later"]
        due = now_ms() + 1_500
        fill(
            broker.settings.warehouse, "later", buffer_rows([due], lambda i: 0, "n", timeline=True)
        )
        await _until(lambda: index.row("n0") is not None, "the row indexed")
        picks = picks_counted(index)
        leased = json.loads(await broker.lease("later", "w", 1, 60_000, 20_000))
        return [m["id"] for m in leased], now_ms(), due, len(picks)

    leased, at, due, picks = on_a_timeline_node(tmp_path, monkeypatch, "past", scenario)
    assert leased == ["n0"]
    assert at >= due, "never before its deliver_at"
    assert picks <= 3, f"{picks} picks while it was not due"


def test_a_poll_sleeps_until_its_first_nack_delay_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long poll whose topic's only pending message waits out a nack delay looks again
    when the delay ends, not every few milliseconds until then (each look a pick, which
    200 idle workers made a leader's CPU pay 15% of a core for), and leases it then,
    never before. The idle step is set past the test's length: only the delay's end
    can answer the poll."""
    from dejaq.broker import service

    monkeypatch.setattr(service, "IDLE_POLL_STEP_S", 600.0)

    async def scenario(broker: Any) -> tuple[list[str], int, int, int]:
        assert len(json.loads(await broker.lease("jobs", "w", 3, 60_000, 0))) == 3
        await broker.nack("jobs", "w", ["m1"], 1_500, None)
        (delayed_to,) = broker.state("jobs").not_before.values()
        picks = picks_counted(broker.indexes["jobs"])
        leased = json.loads(await broker.lease("jobs", "w", 3, 60_000, 20_000))
        granted_at = leased[0]["lease_deadline"] - 60_000
        return [m["id"] for m in leased], granted_at, delayed_to, len(picks)

    leased, granted_at, delayed_to, picks = on_one_node(tmp_path, scenario)
    assert leased == ["m1"]
    assert granted_at >= delayed_to, "never before its delay ends"
    assert picks <= 3, f"{picks} picks while it waited out its delay"


def test_a_poll_on_a_paused_topic_waits_for_its_resume_not_a_timer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long poll on a paused timeline topic whose message is due looks again when the
    topic changes, as at its resume, not every few milliseconds (the message due, time
    cannot make it leasable), and leases it once the topic is resumed."""
    import asyncio

    async def scenario(broker: Any) -> tuple[int, list[str]]:
        await broker.pause("later", True)
        picks = picks_counted(broker.indexes["later"])
        poll = asyncio.ensure_future(broker.lease("later", "w", 1, 60_000, 20_000))
        await _until(lambda: picks, "the poll's first pick")
        await asyncio.sleep(1.0)  # the paused second to count picks in, not a synchronisation
        paused_picks = len(picks)
        await broker.pause("later", False)
        return paused_picks, [m["id"] for m in json.loads(await poll)]

    paused_picks, leased = on_a_timeline_node(tmp_path, monkeypatch, "due", scenario)
    assert paused_picks <= 2, f"{paused_picks} picks in a paused second"
    assert leased == ["due0"]


def test_a_long_poll_whose_client_left_ends_at_its_next_look(tmp_path: Path) -> None:
    """A disconnected client's poll would otherwise look until its wait ends, committing
    heartbeats for a consumer nobody runs: it ends with nothing at its next look."""
    import asyncio

    async def scenario(broker: Any) -> tuple[bytes, float]:
        assert len(json.loads(await broker.lease("jobs", "w", 3, 60_000, 0))) == 3
        index = broker.indexes["jobs"]
        picks = picks_counted(index)
        left = [False]
        began = time.monotonic()
        poll = asyncio.ensure_future(broker.lease("jobs", "w", 3, 60_000, 20_000, lambda: left[0]))
        await _until(lambda: picks, "the poll's first pick")
        left[0] = True
        broker.wakeups.notify("jobs")
        return await poll, time.monotonic() - began

    answer, took = on_one_node(tmp_path, scenario)
    assert answer == b"[]"
    assert took < 10, f"answered after {took:.1f} s of its 20 s wait"


def test_a_consumer_the_heartbeat_expiry_removed_hands_its_leases_back_when_it_leaves() -> None:
    """Its leases hold its buckets until their deadline (up to 12 h): a leave releases
    them, as a member's."""
    st = TopicState(buckets=2, max_deliveries=5)
    st.touch("a", 0)
    st.touch("b", 0)
    bucket = st.buckets_of("b")[0]
    assert record_ids(st.lease("b", 0, 600_000, [("m", bucket, 1)])) == ["m"]
    st.touch("a", 15_000)
    assert st.expire(15_000, 10_000) == [] and "b" not in st.consumers
    assert st.buckets_of("a") == [1 - bucket], "b's lease holds its bucket"
    assert st.leave("b", 15_001) == [], "a command from before: applied as it was"
    assert st.leave("b", 15_001, True) == [mh("m")]
    assert st.lease_of("m") is None and sorted(st.buckets_of("a")) == [0, 1]


class Overtaken:
    """A spy: a topic's state as a walk off the event loop reads it, `land` run each
    time the walk reads what is settled, after it copied the index's entries."""

    def __init__(self, state: TopicState, land: Callable[[], None]) -> None:
        self._state, self._land = state, land

    def __getattr__(self, name: str) -> Any:
        return getattr(self._state, name)

    @property
    def settled(self) -> Any:
        self._land()
        return self._state.settled


def test_a_purge_whose_listing_a_trim_overtook_cancels_what_is_still_pending(
    tmp_path: Path,
) -> None:
    """The purge lists the pending off the event loop, while checkpoints trim: a message
    settled, checkpointed and trimmed during the walk is on its list though settled. It
    is left out once seen gone from the index, and the rest cancelled, not the purge
    refused as listed before a trim, over and over while trims go on."""
    import asyncio

    async def scenario(broker: Any) -> tuple[int, list[str]]:
        loop = asyncio.get_running_loop()
        index = broker.indexes["jobs"]
        walk = index.pending
        overtaken: list[str] = []

        def trimmed() -> None:  # the next message cancelled, checkpointed and forgotten
            mid = f"m{len(overtaken)}"
            overtaken.append(mid)
            asyncio.run_coroutine_threadsafe(broker.cancel("jobs", mid), loop).result(10)
            wait_until(lambda: index.row(mid) is None, 30, f"{mid} checkpointed")

        index.pending = lambda state: walk(Overtaken(state, trimmed))
        return await broker.purge("jobs", "jobs"), overtaken

    cancelled, overtaken = on_one_node(tmp_path, scenario)
    assert (cancelled, overtaken) == (2, ["m0"]), "m1 and m2, on the first listing"


def test_a_purge_overtaken_by_trims_tries_each_slice_again_not_the_whole_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trims come every second under load, and a large topic's listing takes seconds:
    a purge whose command a trim overtook checks that slice again at the new trim and
    sends it again, rather than list every pending message again (and give up after a
    few such listings). A spy stands in for the trims: it sends each slice's first two
    commands as listed before the last trim, which the state machine refuses."""
    from dejaq.broker import service

    monkeypatch.setattr(service, "OPS_SLICE", 1)

    async def scenario(broker: Any) -> tuple[int, int, list[int]]:
        leased = json.loads(await broker.lease("jobs", "w", 1, 60_000, 0))
        await broker.settle("jobs", "ack", "w", [leased[0]["id"]])
        state = broker.state("jobs")
        await _until(lambda: state.trimmed_upto() > 0, "the ack checkpointed and trimmed")
        commit = broker._commit
        tries: Counter[tuple] = Counter()

        async def overtaken(topic: str, op: str, *args: Any) -> Any:
            if op == "purge":
                now, upto, chunk = args
                tries[tuple(chunk)] += 1
                if tries[tuple(chunk)] <= 2:
                    upto -= 1
                args = (now, upto, chunk)
            return await commit(topic, op, *args)

        broker._commit = overtaken
        index = broker.indexes["jobs"]
        walk = index.pending
        walks: list[int] = []

        def counted(state: Any) -> Any:
            walks.append(1)
            return walk(state)

        index.pending = counted
        return await broker.purge("jobs", "jobs"), len(walks), sorted(tries.values())

    cancelled, walks, tries = on_one_node(tmp_path, scenario)
    assert cancelled == 2, "the two messages not acked"
    assert walks == 1, "listed once"
    assert tries == [3, 3], "each slice sent three times, the third applied"


def test_a_topics_counts_leave_out_what_a_trim_forgot_during_their_walk(tmp_path: Path) -> None:
    """Messages settled (a purge) and checkpointed while the counts walk the index are
    not counted as pending, though no longer in the settled set when the walk gets there."""
    import asyncio

    from dejaq.broker.service import now_ms

    async def scenario(broker: Any) -> tuple[int, int]:
        index = broker.indexes["jobs"]
        assert await broker.purge("jobs", "jobs") == 3
        landed: list[bool] = []

        def trimmed() -> None:
            if not landed:
                landed.append(True)
                wait_until(lambda: index.row("m0") is None, 30, "the purge checkpointed")

        state = Overtaken(broker.state("jobs"), trimmed)
        counts, _ = await asyncio.to_thread(index.stats, state, now_ms())
        return counts[0].pending, len(landed)

    assert on_one_node(tmp_path, scenario) == (0, 1)


def test_a_message_named_twice_in_one_request_is_settled_and_counted_once(tmp_path: Path) -> None:
    """By id and by receipt: the answer's count is of messages, not of names."""

    async def scenario(broker: Any) -> list[tuple[int, dict]]:
        leased = json.loads(await broker.lease("jobs", "w", 2, 60_000, 0))
        first, second = leased
        results = [
            await broker.settle("jobs", "ack", "w", [first["id"], first["id"]]),
            await broker.settle("jobs", "ack", "w", [second["receipt"]] * 2, True),
            await broker.settle("jobs", "ack", "w", ["nope", "nope"]),
            await broker.settle("jobs", "ack", "w", [12345 << 20] * 2, True),
        ]
        return [(r.ok, r.refused) for r in results]

    (one, none), (two, none_too), (nope, refused), (bad, bad_refused) = on_one_node(
        tmp_path, scenario
    )
    assert (one, none, two, none_too) == (1, {}, 1, {})
    assert (nope, list(refused), bad, list(bad_refused)) == (0, ["nope"], 0, [12345 << 20])


def test_a_lease_expires_while_a_checkpoint_hangs(tmp_path: Path) -> None:
    """The object store hangs inside a checkpoint: lease expiry goes on (its own thread),
    so a 200 ms lease is back to pending while the checkpoint still hangs, which it does
    until the expiry is seen (an expiry that waited for it fails `_until`'s deadline)."""
    entered, release = threading.Event(), threading.Event()

    def hanging(name: str) -> None:
        entered.set()
        release.wait()

    async def scenario(broker: Any) -> list[str]:
        broker._checkpoint_topic = hanging
        await _until(entered.is_set, "a checkpoint under way")
        leased = json.loads(await broker.lease("jobs", "w", 1, 200, 0))
        st = broker.state("jobs")
        try:
            await _until(lambda: st.lease_of("m1") is None, "the lease expired")
        finally:
            release.set()
        return [m["id"] for m in leased]

    assert on_one_node(tmp_path, scenario) == ["m1"]


def test_a_family_of_metrics_that_fails_leaves_the_others_published(tmp_path: Path) -> None:
    """Each family of metrics is published on its own: one that raises every time (here
    the key file's check, by a stand-in) is logged and the counters still count."""

    class FailingKeys:
        def check(self) -> str | None:
            raise RuntimeError("the key file check failed")

    async def scenario(broker: Any) -> float | None:
        broker.keys = FailingKeys()
        leased = json.loads(await broker.lease("jobs", "w", 1, 30_000, 0))
        await broker.settle("jobs", "ack", "w", [m["id"] for m in leased])

        def acked() -> float | None:
            labels = {"topic": "jobs"}
            return broker.metrics.registry.get_sample_value("dejaq_acked_messages_total", labels)

        await _until(lambda: acked() == 1, "the ack counted")
        return acked()

    assert on_one_node(tmp_path, scenario) == 1


def test_the_cluster_total_counters_say_to_take_the_max_over_nodes() -> None:
    """Leases, acks, nacks, redeliveries and deaths are counted in the replicated state
    and every node publishes the cluster's total: their help says to aggregate them over
    nodes with max, as a sum counts each event once per node."""
    from dejaq.broker.api.metrics import Metrics

    text = generate_latest(Metrics().registry).decode()
    helps = dict(
        line.removeprefix("# HELP ").split(" ", 1)
        for line in text.splitlines()
        if line.startswith("# HELP dejaq_")
    )
    for name in (
        "dejaq_leased_messages_total",
        "dejaq_acked_messages_total",
        "dejaq_nacked_messages_total",
        "dejaq_redelivered_messages_total",
        "dejaq_dead_letters_total",
    ):
        assert "every node publishes the same total" in helps[name], helps[name]
        assert "max by (topic), not sum" in helps[name], helps[name]
    assert "max by" not in helps["dejaq_lease_seconds"], "observed on the leader alone"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_panic_in_a_background_duty_is_logged_and_the_duty_goes_on(tmp_path: Path) -> None:
    """A panic in the compiled core (PyO3's PanicException, a BaseException) on the
    leader's duties' thread: the thread logs it and goes on, so a lease still expires. A
    thread that ends all the same (a SystemExit) makes the node unready, named."""
    raised: list[int] = []

    async def scenario(broker: Any) -> tuple[tuple[bool, str], tuple[bool, str]]:
        await _until(lambda: broker.ready()[0], "the node ready")
        st = broker.state("jobs")
        needs_expiry = st.needs_expiry

        def panicking_once(now: int, heartbeat_timeout_ms: int) -> bool:
            if not raised:
                raised.append(now)
                raise _Panic("the core panicked")
            return needs_expiry(now, heartbeat_timeout_ms)

        def exiting(now: int, heartbeat_timeout_ms: int) -> bool:
            raise SystemExit

        st.needs_expiry = panicking_once
        await _until(lambda: raised, "the panic")
        leased = json.loads(await broker.lease("jobs", "w", 1, 200, 0))
        await _until(lambda: st.lease_of(leased[0]["id"]) is None, "the lease expired")
        after_panic = broker.ready()
        st.needs_expiry = exiting
        await _until(lambda: not broker.ready()[0], "the node unready")
        return after_panic, broker.ready()

    after_panic, ended = on_one_node(tmp_path, scenario)
    assert after_panic[0], after_panic
    assert ended == (False, "background thread _leader_duties ended; restart the node")


def run_node(
    settings: Any, raft: str, data_dir: Path, scenario: Callable[[Any], Awaitable[T]]
) -> T:
    """Run `scenario` with a one-node broker (in process, its own Raft on `raft`, its
    data in `data_dir`) once it leads; stop it after."""
    import asyncio

    from dejaq.broker.service import Broker

    broker = Broker(settings, "n1", "127.0.0.1:1", raft, [], data_dir)
    collecting = gc.get_threshold()  # a node's start tunes the process's GC: put back after
    broker.start()

    async def main() -> T:
        assert broker.raft is not None
        broker.raft.attach(asyncio.get_running_loop())
        await _until(broker.raft.is_leader, "Raft leader")
        return await scenario(broker)

    try:
        return asyncio.run(main())
    finally:
        broker.stop()
        gc.unfreeze()
        gc.set_threshold(*collecting)


def ledger_ids(warehouse: str, event: str | None = "acked") -> list[str]:
    """The ids of the ledger's `event` rows (None: all)."""
    rows = scan(ensure_table(warehouse, Table.LEDGER, "jobs"), Table.LEDGER)
    return [r["message_id"] for r in rows.to_pylist() if event in (None, r["event"])]


def test_a_cluster_started_afresh_on_a_warehouse_writes_its_acks_to_its_ledger(
    tmp_path: Path,
) -> None:
    """The nodes' data folders replaced under an existing warehouse: the new Raft
    history counts its seqs from 0, where the ledger's tag already holds the old
    history's last. Its acks reach the ledger all the same (a new history's tags), and
    after the next start none of them is pending again."""
    import asyncio

    async def acked(broker: Any) -> list[str]:
        leased = json.loads(await broker.lease("jobs", "w", 3, 30_000, 0))
        done = await broker.settle("jobs", "ack", "w", [m["id"] for m in leased])
        assert done.ok == 3
        wanted = {m["id"] for m in leased}
        deadline = time.monotonic() + 30
        while not wanted <= set(ledger_ids(str(tmp_path / "warehouse"))):
            assert time.monotonic() < deadline, "the acks never reached the ledger"
            await asyncio.sleep(0.05)
        return sorted(wanted)

    assert on_one_node(tmp_path, acked) == ["m0", "m1", "m2"]
    assert on_one_node(tmp_path, acked, prefix="a", node="afresh") == ["a0", "a1", "a2"]

    async def pending(broker: Any) -> list[str]:
        return [m["id"] for m in json.loads(await broker.lease("jobs", "w", 10, 30_000, 0))]

    assert on_one_node(tmp_path, pending, prefix="p", node="afresh") == ["p1", "p0", "p2"]
    assert sorted(ledger_ids(str(tmp_path / "warehouse"))) == ["a0", "a1", "a2", "m0", "m1", "m2"]


async def rescheduled_and_trimmed(broker: Any) -> None:
    """Reschedule m1 to 20 and m0 to 30, and wait for their events' checkpoint and trim."""
    import asyncio

    await broker.reschedule("jobs", "m1", 20, None)
    await broker.reschedule("jobs", "m0", 30, None)
    deadline = time.monotonic() + 30
    while len(broker.state("jobs").events):
        assert time.monotonic() < deadline, "the reschedules were never trimmed"
        await asyncio.sleep(0.05)


def test_reschedules_checkpointed_and_trimmed_hold_through_a_restart(tmp_path: Path) -> None:
    """Reschedules reach the ledger as `rescheduled` rows and are trimmed from Raft; the
    node restarted (its journal and snapshot) leases the messages at their new keys."""
    on_one_node(tmp_path, rescheduled_and_trimmed)
    rows = DeltaTable(ensure_table(str(tmp_path / "warehouse"), Table.LEDGER, "jobs"))
    got = scan(rows, Table.LEDGER, ["message_id", "event", "sort_key"]).to_pylist()
    assert [tuple(r.values()) for r in got] == [
        ("m1", "rescheduled", 20),
        ("m0", "rescheduled", 30),
    ]

    async def leased(broker: Any) -> list[tuple[str, int]]:
        found = json.loads(await broker.lease("jobs", "w", 10, 30_000, 0))
        return [(m["id"], m["sort_key"]) for m in found]

    assert on_one_node(tmp_path, leased) == [("m2", 9), ("m1", 20), ("m0", 30)]


def test_a_restart_after_a_retention_run_past_reschedules_reads_them_from_the_rows(
    tmp_path: Path,
) -> None:
    """A retention run whose cutoff passes the `rescheduled` rows of pending messages
    gives their buffer rows the new keys: the running node does not read the rewrite
    (its index keeps the row at its old key, its Raft state the new one); restarted,
    it reads the rows at the new keys, which its Raft state's overrides equal, and
    leases them so."""
    import asyncio

    from dejaq.broker.service import now_ms
    from dejaq.conf.settings import Settings
    from dejaq.pipelines.retention import retain

    warehouse = str(tmp_path / "warehouse")
    buffer = ensure_table(warehouse, Table.BUFFER, "jobs")

    def keys(broker: Any) -> dict[str, tuple[int, int | None]]:
        """Per message: its row's key in the node's index, its Raft state's override."""
        index, state = broker.indexes["jobs"], broker.state("jobs")
        return {m: (index.row(m).sort_key, state.sort_keys.get(mh(m))) for m in ("m0", "m1")}

    async def rescheduled_and_retained(broker: Any) -> dict[str, tuple[int, int | None]]:
        await rescheduled_and_trimmed(broker)
        cutoff = now_ms()
        done = await asyncio.to_thread(
            retain, buffer, ensure_table(warehouse, Table.LEDGER, "jobs"), 0, cutoff
        )
        assert done is not None and done.watermark_ms == cutoff and done.rekeyed == 2
        index = broker.indexes["jobs"]
        assert await asyncio.to_thread(index.refresh) == 0, "a rewrite is not read"
        return keys(broker)

    assert on_one_node(tmp_path, rescheduled_and_retained) == {"m0": (5, 30), "m1": (3, 20)}
    rows = scan(buffer, Table.BUFFER, ["message_id", "sort_key", "priority"])
    assert sorted(tuple(r.values()) for r in rows.to_pylist()) == [
        ("m0", 30, 30),
        ("m1", 20, 20),
        ("m2", 9, 9),
    ]

    async def restarted(broker: Any) -> tuple[dict, list[tuple[str, int]]]:
        await broker.raft.commit("jobs", "touch", "w", now_ms())
        found = keys(broker)
        leased = json.loads(await broker.lease("jobs", "w", 10, 30_000, 0))
        return found, [(m["id"], m["sort_key"]) for m in leased]

    settings = Settings(warehouse=warehouse, topics=[topic_conf()])
    raft = json.loads((tmp_path / "node" / "node.json").read_text())["raft"]
    found, leased = run_node(settings, raft, tmp_path / "node", restarted)
    assert found == {"m0": (30, 30), "m1": (20, 20)}, "the row and the override agree"
    assert leased == [("m2", 9), ("m1", 20), ("m0", 30)]


def test_a_backlog_is_checkpointed_a_part_at_a_time_and_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint writes at most `CHECKPOINT_MAX_EVENTS` (a backlog after a long ledger
    outage would otherwise overflow Arrow's 2 GiB of ids in one column): the acks reach
    the ledger in parts, every one of them once."""
    import asyncio

    from dejaq.broker import service

    monkeypatch.setattr(service, "CHECKPOINT_MAX_EVENTS", 1)

    async def acked(broker: Any) -> int:
        leased = json.loads(await broker.lease("jobs", "w", 3, 30_000, 0))
        # Three entries: consecutive acks would join one run of events.
        for m, op in zip(leased, ["ack", "reject", "ack"], strict=True):
            assert (await broker.settle("jobs", op, "w", [m["id"]])).ok == 1
        deadline = time.monotonic() + 30
        while len(ledger_ids(str(tmp_path / "warehouse"), None)) < 3:
            assert time.monotonic() < deadline, "the acks never reached the ledger"
            await asyncio.sleep(0.05)
        return DeltaTable(ensure_table(str(tmp_path / "warehouse"), Table.LEDGER, "jobs")).version()

    assert on_one_node(tmp_path, acked) >= 3, "a commit an event"
    assert sorted(ledger_ids(str(tmp_path / "warehouse"), None)) == ["m0", "m1", "m2"]


def test_the_first_events_of_a_checkpoint_do_not_count_the_deaths_a_trim_kept() -> None:
    """Deaths whose dead letters failed stay in front of the events: counted, a million
    of them would make every checkpoint theirs alone, and hold the acks back."""
    kept = [Settlement(s, mh(f"d{s}"), 0, LedgerEvent.DEAD, s, 5, s) for s in (1, 2)]
    after = [Settlement(s, mh(f"m{s}"), 0, LedgerEvent.ACKED, s, 1, s) for s in (5, 6, 7)]
    from dejaq.broker.service import first_events

    assert first_events(kept + after, 4, 2) == [*kept, *after[:2]]
    assert first_events(kept + after, 4, 10) == kept + after
    state = TopicState(buckets=1, max_deliveries=5)  # a follower's acks: one run
    state.touch("c", 0)
    record = state.lease("c", 1, 1000, [(f"a{i}", 0, i) for i in range(10)], lid=1)
    for position in range(10):
        assert state.ack("c", 2, [], [record.receipt(position)]) == {}
    [run] = state.events.view()
    [part] = first_events([run], 0, 3)
    assert [e.mh for e in settlements([part])] == mhs(["a0", "a1", "a2"])


def test_the_picks_of_a_lease_its_command_refused_go_back_into_the_index(tmp_path: Path) -> None:
    """A lease picks, then commits; a pause applied just before its command grants it
    nothing. Its picks, already out of the index, must go back: left out, they would
    never lease again until the node restarted."""
    import asyncio

    async def scenario(broker: Any) -> tuple[bytes, list[dict]]:
        # Both start in this order in the loop's next step: the pause is in the log
        # before the lease's command, and applied after its pick.
        paused = asyncio.create_task(broker.raft.commit("jobs", "pause", True))
        refused = asyncio.create_task(broker.lease("jobs", "w", 3, 30_000, 0))
        assert await paused is True
        first = await refused
        await broker.raft.commit("jobs", "pause", False)
        return first, json.loads(await broker.lease("jobs", "w", 3, 30_000, 0))

    first, leased = on_one_node(tmp_path, scenario)
    assert first == b"[]", "paused before the lease applied: nothing granted"
    assert [m["sort_key"] for m in leased] == [3, 5, 9], "every pick back, in order"


def test_a_lease_refused_for_a_trimmed_view_picks_again_even_when_not_waiting(
    tmp_path: Path,
) -> None:
    """A lease picks, then commits; a cancel and the trim that forgets it apply between
    the two, so the lease's view is past and it grants nothing. The other picks are
    pending: a worker that asked not to wait gets them, not an empty answer that says
    the topic is drained."""
    import asyncio

    async def scenario(broker: Any) -> tuple[int, list[dict]]:
        state = broker.state("jobs")
        # All three start in this order in the loop's next step: the cancel and its trim
        # are in the log before the lease's command, and applied after its pick of m0.
        cancelled = asyncio.create_task(broker.raft.commit("jobs", "cancel", 1, "m0", 0, 5))
        trimmed = asyncio.create_task(broker.raft.commit("jobs", "trim", state.seq + 1))
        leased = asyncio.create_task(broker.lease("jobs", "w", 3, 30_000, 0))
        assert await cancelled is None and unpacked_mhs(await trimmed) == [mh("m0")]
        return state.trimmed_upto(), json.loads(await leased)

    trimmed_upto, leased = on_one_node(tmp_path, scenario)
    assert trimmed_upto == 1, "m0's cancel was trimmed before the lease applied"
    assert [m["id"] for m in leased] == ["m1", "m2"], "picked again: m0 gone, the rest leased"


def drain(
    index: TopicIndex, state: TopicState, n: int, now: int, limit: int | None = None
) -> list[list[int]]:
    """Lease everything (or `limit` messages) in batches of n as one consumer; the sort
    keys of each batch."""
    state.touch("c", now)
    batches: list[list[int]] = []
    left = float("inf") if limit is None else limit
    while left and (
        picks := listed(index.pick(state, state.buckets_of("c"), int(min(n, left)), now))
    ):
        left -= len(picks)
        granted = grants(state.lease("c", now, 10**9, picks))
        index.release(state, packed(picks))
        keys = {m: k for m, _, k in picks}
        batches.append([keys[m] for m, _, _ in granted])
    return batches


def test_buckets_lowered_below_the_buffers_are_refused_by_name(tmp_path) -> None:
    """Rows in a bucket the configuration no longer has: a clear error, not an IndexError
    that crashes every node at start."""
    warehouse = str(tmp_path)
    fill(warehouse, "jobs", buffer_rows([1, 2, 3, 4]))  # buckets 0..3
    index = TopicIndex(warehouse, topic_conf(buckets=2))
    with pytest.raises(ConfigError, match=r"topics\[jobs\]\.buckets is 2.*bucket [23]"):
        index.load()


def test_rows_in_buckets_beyond_a_running_node_wait_and_the_others_are_indexed(
    tmp_path: Path,
) -> None:
    """The ingest raised to 8 buckets before the brokers: its versions hold rows in
    buckets this node (4) has not. Those wait for a restart with the new count, named in
    the readiness answer; the rows of its own buckets, in the same versions and after,
    are indexed and leased as ever. A node started with 8 indexes them all.

    The node is waited on until it has read the version of the last append, not until
    c0 shows: a refresh that reads both appends inserts their buckets under one hold of
    the index's lock in the order delta-rs lists the files, newest first: bucket 1 (c0)
    before bucket 0 (b0). `rows`, read here without that lock, can show c0 while b0 is
    being inserted; a lease takes the lock and sees the version whole."""
    from dejaq.conf.settings import Settings
    from dejaq.jobs.ports import free_port

    warehouse = str(tmp_path / "warehouse")
    fill(warehouse, "jobs", buffer_rows([1, 2], lambda i: 0, "a"))
    settings = Settings(warehouse=warehouse, topics=[topic_conf(buckets=4)])

    async def scenario(broker: Any) -> tuple[list[str], str]:
        index = broker.indexes["jobs"]
        fill(warehouse, "jobs", buffer_rows([3, 4], lambda i: 6 * i, "b"))  # buckets 0, 6
        fill(warehouse, "jobs", buffer_rows([5], lambda i: 1, "c"))
        appended = DeltaTable(index.buffer_path).version()
        await _until(lambda: index.version >= appended, "the version of the last append read")
        await _until(lambda: broker.ready()[0], "the node ready, its HTTP address registered")
        return sorted(index.rows), broker.ready()[1]

    rows, status = run_node(settings, f"127.0.0.1:{free_port()}", tmp_path / "node", scenario)
    assert rows == ["a0", "a1", "b0", "c0"], "b1 (bucket 6) waits"
    assert "jobs: the buffer holds messages in bucket 6" in status
    assert "this node is configured for 4: restart the brokers" in status
    raised = TopicIndex(warehouse, topic_conf(buckets=8))
    raised.load()
    assert sorted(raised.rows) == ["a0", "a1", "b0", "b1", "c0"]


def test_new_messages_wait_in_the_buffer_while_the_disk_is_within_the_reserve(
    tmp_path: Path,
) -> None:
    """A node keeps `disk_reserve_bytes` free for its Raft journal: while writing new
    messages' heads would go below it, they stay pending in the buffer, not indexed, and
    the readiness answer says why; once there is room they are indexed and leased, none
    lost. A start within the reserve is refused with the same reason. A reserve above the
    disk's free space stands in for a full disk (filling the machine's disk is no test)."""
    from dejaq.broker.service import now_ms
    from dejaq.broker.storage.head_store import ReserveReached
    from dejaq.conf.settings import Settings
    from dejaq.jobs.ports import free_port

    warehouse = str(tmp_path / "warehouse")
    fill(warehouse, "jobs", buffer_rows([1, 2], lambda i: 0, "a"))
    settings = Settings(warehouse=warehouse, topics=[topic_conf(buckets=1)])
    beyond = shutil.disk_usage(tmp_path).free + (1 << 40)

    async def scenario(broker: Any) -> tuple[list[str], str, str, list[str]]:
        index = broker.indexes["jobs"]
        assert index.heads.reserve == settings.broker.disk_reserve_bytes > 0
        index.heads.reserve = beyond
        fill(warehouse, "jobs", buffer_rows([3, 4], lambda i: 0, "b"))
        await _until(lambda: "jobs" in broker.short_of_disk, "the reserve reached")
        await _until(lambda: broker.ready()[0], "the node ready, its HTTP address registered")
        held, status = sorted(index.rows), broker.ready()[1]
        index.heads.reserve = 1
        await _until(lambda: "b1" in index.rows, "the new rows indexed once there is room")
        await broker.raft.commit("jobs", "touch", "w", now_ms())
        leased = json.loads(await broker.lease("jobs", "w", 10, 30_000, 0))
        return held, status, broker.ready()[1], [m["id"] for m in leased]

    held, short, after, leased = run_node(
        settings, f"127.0.0.1:{free_port()}", tmp_path / "node", scenario
    )
    assert held == ["a0", "a1"], "the new rows wait in the buffer"
    assert "jobs:" in short and "broker.disk_reserve_bytes" in short, short
    assert "disk_reserve_bytes" not in after, after
    assert sorted(leased) == ["a0", "a1", "b0", "b1"], "none lost"
    index = TopicIndex(warehouse, topic_conf(buckets=1), str(tmp_path / "heads"), beyond)
    with pytest.raises(ReserveReached, match="kept for the Raft journal"):
        index.load()


def test_an_index_refresh_failing_past_its_bound_makes_the_node_unready(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A buffer file the node cannot read (its mode, the store's credentials expired)
    fails every refresh: past the bound (0.5 s here) the node is unready, naming the
    topic and the error, and `/metrics` says for how long; the rows it cannot read count
    neither as indexed nor as settled. Once they can be read it is ready again and
    indexes them. The streak is logged once, not at each of its rounds, and its end at
    WARNING, the level the broker logs at. A stand-in for `_read_bucket` makes the file
    unreadable (the tests run as root, whom a file's mode does not stop)."""
    warehouse = str(tmp_path / "warehouse")
    labels = {"topic": "jobs"}

    async def scenario(broker: Any) -> tuple[str, list[float | None], tuple[bool, str], list]:
        index = broker.indexes["jobs"]
        sample = broker.metrics.registry.get_sample_value
        await _until(lambda: broker.ready()[0], "the node ready")
        broker.refresh_alert_s = 0.5

        def unreadable(bucket: int, uris: list[str]) -> Any:
            raise PermissionError(13, "Permission denied", uris[0])

        index._read_bucket = unreadable
        fill(warehouse, "jobs", buffer_rows([1, 2, 3], lambda i: 0, "n"))
        await _until(lambda: not broker.ready()[0], "the node unready")
        unready = broker.ready()[1]
        await _until(lambda: sample("dejaq_index_refresh_failing_seconds", labels), "published")
        failing = [
            sample(name, labels)
            for name in (
                "dejaq_buffer_rows",
                "dejaq_buffer_settled_rows",
                "dejaq_index_messages",
            )
        ]
        assert sample("dejaq_index_refresh_failures_total", labels) >= 2
        del index._read_bucket
        await _until(lambda: broker.ready()[0], "the node ready again")
        await _until(lambda: sample("dejaq_index_messages", labels) == 6, "the rows published")
        after = [
            sample(name, labels)
            for name in (
                "dejaq_index_refresh_failing_seconds",
                "dejaq_buffer_rows",
                "dejaq_buffer_settled_rows",
            )
        ]
        return unready, failing, broker.ready(), [sorted(index.rows), *after]

    with caplog.at_level(logging.WARNING, "dejaq.broker"):
        unready, failing, ready, after = on_one_node(tmp_path, scenario)
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "indexing" in r.getMessage()]
    assert [level for level, _ in said] == [logging.ERROR, logging.WARNING], said
    assert said[0][1] == "indexing jobs failed; retrying"
    assert said[1][1].startswith("indexing jobs works again after "), said
    assert unready.startswith("indexing jobs has failed for "), unready
    assert "(PermissionError: [Errno 13] Permission denied: " in unready
    assert unready.endswith("its new messages wait in the buffer"), unready
    assert failing == [3, 0, 3], "the unread rows count neither as settled nor as indexed"
    assert ready == (True, "ready")
    assert after == [["m0", "m1", "m2", "n0", "n1", "n2"], 0, 6, 0]


def test_a_trim_that_fails_after_the_ledger_write_is_a_checkpoint_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ledger takes a round's events, then their trim from Raft fails, round after
    round: the checkpoints stall as surely as if the ledger had failed (Raft's state and
    the buffer grow), so they count as failing, logged once for the streak, in the
    node's readiness (`/readyz`) and its view (`/v1/cluster`, which `dejaq status
    --broker` reads) past the alert's bound (3 minutes, 0.5 s here). Once the trim goes
    through, the events leave Raft and the streak ends, said at WARNING. A stand-in
    fails the trim's Raft command, as a leader cut off from its majority would: a
    one-node cluster cannot lose its majority and go on leading."""
    from dejaq.broker import service
    from dejaq.broker.state.raft import NotCommitted
    from dejaq.broker.storage import checkpoints

    monkeypatch.setattr(checkpoints, "FAILING_ALERT_S", 0.5)
    warehouse = str(tmp_path / "warehouse")
    failing = threading.Event()
    committed = service.committed

    def trim_fails(method: Callable[..., Any], *args: Any, **waits: Any) -> Any:
        if args[1:2] == ("trim",) and failing.is_set():
            raise NotCommitted("timed out waiting for a Raft majority")
        return committed(method, *args, **waits)

    monkeypatch.setattr(service, "committed", trim_fails)

    async def scenario(broker: Any) -> list[Any]:
        health, st = broker.checkpoint_health["jobs"], broker.state("jobs")
        await _until(lambda: broker.ready()[0], "the node ready")
        failing.set()
        leased = json.loads(await broker.lease("jobs", "w", 3, 60_000, 0))
        await broker.settle("jobs", "ack", "w", [m["id"] for m in leased])
        await _until(lambda: sorted(ledger_ids(warehouse)) == ["m0", "m1", "m2"], "the ledger")
        await _until(lambda: health.failures >= 3, "three rounds failing")
        await _until(lambda: "checkpoints of jobs failing" in broker.ready()[1], "the alert")
        view = broker.node_topics()["jobs"].ledger_lag
        stalled = [broker.ready(), view.failing, view.checkpoint_failures, view.events]
        failing.clear()
        await _until(lambda: health.failing_since is None, "the streak ended")
        await _until(lambda: len(st.events) == 0, "the events trimmed")
        view = broker.node_topics()["jobs"].ledger_lag
        return [*stalled, broker.ready(), view.failing, view.events]

    with caplog.at_level(logging.WARNING, "dejaq.broker"):
        ready, failing, failures, events, *after = on_one_node(tmp_path, scenario)
    assert ready[0] and "checkpoints of jobs failing for " in ready[1], ready
    assert "(trim of jobs: NotCommitted: timed out waiting for a Raft majority)" in ready[1]
    assert failing.startswith("failing for ") and "trim of jobs" in failing, failing
    assert failures >= 3 and events > 0, (failures, events)
    assert after == [(True, "ready"), None, 0]
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "checkpoint" in r.getMessage()]
    assert [level for level, _ in said] == [logging.ERROR, logging.WARNING], said
    assert said[0][1] == "checkpoint trim of jobs failed; retrying"
    assert said[1][1].startswith("checkpoints work again after "), said


def test_a_trim_not_committed_as_its_node_stops_leading_is_no_checkpoint_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leader change cuts a round's trim off (PySyncObj fails the pending command): the
    next leader trims those events, so the round is no failure, counted, alerted or
    logged as an error. A stand-in fails the trim and ends this node's lead (`leading`),
    as a leader change would: a one-node cluster cannot lose its lead."""
    from dejaq.broker import service
    from dejaq.broker.state.raft import NotCommitted

    committed = service.committed
    cut: list[bool] = []

    async def scenario(broker: Any) -> tuple[int, int]:
        def trim_cut(method: Callable[..., Any], *args: Any, **waits: Any) -> Any:
            if args[1:2] == ("trim",):
                broker.raft.leading = lambda: False
                cut.append(True)
                raise NotCommitted("the leader changed")
            return committed(method, *args, **waits)

        monkeypatch.setattr(service, "committed", trim_cut)
        health, st = broker.checkpoint_health["jobs"], broker.state("jobs")
        await _until(lambda: broker.ready()[0], "the node ready")
        leased = json.loads(await broker.lease("jobs", "w", 3, 60_000, 0))
        await broker.settle("jobs", "ack", "w", [m["id"] for m in leased])
        await _until(lambda: cut, "the trim cut off")
        return health.failures, len(st.events)

    with caplog.at_level(logging.INFO, "dejaq.broker"):
        failures, events = on_one_node(tmp_path, scenario)
    assert failures == 0
    assert events > 0, "not trimmed here: the next leader's checkpoint trims them"
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "trim of jobs" in r.getMessage()]
    assert said == [
        (
            logging.INFO,
            "trim of jobs not committed, this node no longer leading: the leader changed",
        )
    ], said


def test_checkpoints_failing_are_reported_while_the_node_leads_only(tmp_path: Path) -> None:
    """Only the leader checkpoints: a node whose checkpoints failed for minutes while it
    led and that then stopped leading (a stand-in for `leading`) reports them neither in
    its readiness nor in its view (`/v1/cluster`, which `dejaq status --broker` prints),
    and its streak ends, so a new term as leader starts one afresh."""

    async def scenario(broker: Any) -> tuple[list[Any], list[Any]]:
        health = broker.checkpoint_health["jobs"]
        await _until(lambda: broker.ready()[0], "the node ready")
        health.failures, health.streak = 3, 3
        health.failing_since = time.time() - 200
        health.last_error = "ledger of jobs: OSError: the store refused the write"
        leading = [broker.ready(), broker.node_topics()["jobs"].ledger_lag.failing]
        broker.raft.leading = lambda: False
        following = [broker.ready(), broker.node_topics()["jobs"].ledger_lag.failing]
        await _until(lambda: health.failing_since is None, "the streak ended")
        return leading, [*following, health.streak, health.failures]

    leading, following = on_one_node(tmp_path, scenario)
    assert leading[0][0] and "checkpoints of jobs failing for 20" in leading[0][1]
    assert leading[1].startswith("failing for 20") and "(ledger of jobs: OSError: " in leading[1]
    assert following == [(True, "ready"), None, 0, 3], "the failures stay counted"


def test_the_index_names_the_messages_of_handles_it_holds_a_slice_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ids_of` names each handle by its row's id, None where no row here holds it, in
    the handles' order, across the slices it takes the lock for."""
    monkeypatch.setattr(index_module, "NAME_SLICE", 2)
    _, index, _ = loaded_topic(tmp_path, [1, 2, 3])
    asked = ["m2", "nowhere", "m0", "m1", "m2", "late0"]
    assert index.ids_of(packed_mhs(asked)) == ["m2", None, "m0", "m1", "m2", None]
    index.forget(packed_mhs(["m0"]))
    assert index.ids_of(packed_mhs(["m0", "m1"])) == [None, "m1"], "forgotten: unnamed"
    assert index.ids_of(b"") == []


def test_rows_the_index_dropped_are_named_from_the_tables_once_it_is_current(
    tmp_path: Path,
) -> None:
    """A row the index skipped at its load (the ledger had settled it: another Raft
    history's ledger, whose events this state's do not hold) is named by hashing the
    buffer's ids, once the index has read the buffer's current version; before, none
    is (a refresh may bring the row)."""
    warehouse, _, state = loaded_topic(tmp_path, [1, 2])
    state.lease("c", 0, 1000, [("m0", 0, 1), ("m1", 1, 2)])
    assert state.ack("c", 1, ["m0"]) == {}
    checkpoint(warehouse, "jobs", state.events, buffer_names(warehouse))
    index = TopicIndex(warehouse, topic_conf())
    index.load()  # skips m0, settled in the ledger
    asked = {mh("m0"), mh("m1"), mh("nowhere")}
    assert index.ids_of(packed_mhs(["m0", "m1"])) == [None, "m1"]
    assert index.ids_in_tables(asked) == {mh("m0"): "m0", mh("m1"): "m1"}
    fill(warehouse, "jobs", buffer_rows([3], prefix="late"))
    assert index.ids_in_tables(asked) == {}, "a version not read yet: wait for it"
    index.refresh()
    assert index.ids_in_tables({mh("late0")}) == {mh("late0"): "late0"}


def test_the_tables_are_read_for_handles_in_neither_once_a_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handle neither the buffer nor the dead letters hold (a row retention removed,
    its event asked for each checkpoint round) has them read again only once one of
    them changed, or with a handle not asked before."""
    warehouse, index, _ = loaded_topic(tmp_path, [1])
    reads: list[Table] = []
    read = index_module.scan
    monkeypatch.setattr(index_module, "scan", lambda *a: reads.append(a[1]) or read(*a))
    nowhere = {mh("nowhere")}
    assert index.ids_in_tables(nowhere) == {} and len(reads) == 2
    assert index.ids_in_tables(nowhere) == {} and len(reads) == 2, "neither table changed"
    assert index.ids_in_tables({mh("m0")}) == {mh("m0"): "m0"} and len(reads) == 4
    fill(warehouse, "jobs", buffer_rows([3], prefix="late"))
    index.refresh()
    assert index.ids_in_tables(nowhere) == {} and len(reads) == 6, "the buffer changed"
    assert index.ids_in_tables(nowhere) == {} and len(reads) == 6


def test_a_nack_answers_its_dead_by_id_whether_it_named_ids_or_receipts(tmp_path: Path) -> None:
    """The state tells a nack's dead by handle; the leader answers with their ids: those
    the request named, or its index's for a request by receipts."""

    async def scenario(broker: Any) -> list[list[str]]:
        dead = []
        for by_receipt in (True, False):
            for _ in range(5):  # max_deliveries
                [m] = json.loads(await broker.lease("jobs", "w", 1, 60_000, 5_000))
                named = [m["receipt"]] if by_receipt else [m["id"]]
                nacked = await broker.nack("jobs", "w", named, 0, None, by_receipt)
            dead.append(nacked.dead)
        return dead

    assert on_one_node(tmp_path, scenario) == [["m1"], ["m0"]], "the lowest key first"


def test_a_leader_whose_index_has_not_read_a_settled_message_waits_to_write_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state names settled messages by handle, and the leader names them by id
    through its index to write the ledger. A message cancelled (as a leader whose index
    had read its row commits it) before this node's index read its row cannot be named:
    the checkpoint writes the events before it and none from it on (the acks after it
    wait too), counts them on /metrics and, past the grace, says so on /readyz. Once
    the index reads the row, every event is written by its id, once, and trimmed."""
    from dejaq.broker.service import now_ms
    from dejaq.broker.storage import checkpoints

    monkeypatch.setattr(checkpoints, "UNNAMED_GRACE_S", 0.3)
    warehouse = str(tmp_path / "warehouse")

    async def scenario(broker: Any) -> list[Any]:
        index, health = broker.indexes["jobs"], broker.checkpoint_health["jobs"]
        sample = broker.metrics.registry.get_sample_value

        def unnamed() -> float | None:
            return sample("dejaq_checkpoint_unnamed_events", {"topic": "jobs"})

        await _until(lambda: broker.ready()[0], "the node ready")
        first = json.loads(await broker.lease("jobs", "w", 1, 60_000, 0))
        await broker.settle("jobs", "ack", "w", [m["id"] for m in first])
        await _until(lambda: ledger_ids(warehouse) == ["m1"], "m1's ack written")
        read_bucket, read = index._read_bucket, threading.Event()

        def lagging(bucket: int, uris: list[str]) -> Any:
            if not read.is_set():
                raise OSError("this node's index has not read the row yet")
            return read_bucket(bucket, uris)

        index._read_bucket = lagging
        fill(warehouse, "jobs", buffer_rows([1], lambda i: 0, "late"))
        assert await broker.raft.commit("jobs", "cancel", now_ms(), "late0", 0, 1) is None
        rest = json.loads(await broker.lease("jobs", "w", 2, 60_000, 0))
        await broker.settle("jobs", "ack", "w", [m["id"] for m in rest])
        await _until(lambda: health.unnamed == 3 and unnamed() == 3, "3 events counted")
        await _until(lambda: "waiting" in broker.ready()[1], "told on /readyz")
        waiting = [broker.ready(), sorted(ledger_ids(warehouse, None)), health.unnamed_from]
        read.set()
        await _until(lambda: len(broker.state("jobs").events) == 0, "every event trimmed")
        await _until(lambda: unnamed() == 0 and broker.ready() == (True, "ready"), "none left")
        rows = scan(ensure_table(warehouse, Table.LEDGER, "jobs"), Table.LEDGER)
        events = zip(rows["message_id"].to_pylist(), rows["event"].to_pylist(), strict=True)
        return [*waiting, sorted(events)]

    ready, written, first, ledger = on_one_node(tmp_path, scenario)
    assert ready[0] and "checkpoints of jobs waiting " in ready[1], ready
    assert "to read the rows of 3 settled messages (from seq 2 on)" in ready[1], ready
    assert written == ["m1"] and first == 2, "nothing from the cancel on"
    assert ledger == [
        ("late0", "cancelled"),
        ("m0", "acked"),
        ("m1", "acked"),
        ("m2", "acked"),
    ], "each by its id, once"


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(keys=st.lists(st.integers(0, 65535), min_size=1, max_size=60), n=st.integers(1, 7))
def test_leases_come_in_sort_key_order(tmp_path_factory, keys: list[int], n: int) -> None:
    warehouse = str(tmp_path_factory.mktemp("wh"))
    fill(warehouse, "jobs", buffer_rows(keys))
    index = TopicIndex(warehouse, topic_conf())
    index.load()
    state = TopicState(4, 5)
    batches = drain(index, state, n, now=0)
    flat = [k for b in batches for k in b]
    assert flat == sorted(keys), "one consumer with every bucket sees a total order"
    assert all(len(b) == n for b in batches[:-1])


def test_a_load_reads_a_slice_at_a_time_and_writes_heads_in_sort_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files whose rows are not in sort order, read 7 rows at a time: every head is its
    message's, each bucket's heads lie in sort order in the store, the file-order copies
    are gone, and ids of every shape the id table stores apart are found, leased and
    forgotten. Then a settled load's segments are all released."""
    monkeypatch.setattr(index_module, "HEAD_SLICE", 7)  # the slice size, made small
    warehouse = str(tmp_path)
    keys = [(i * 37) % 101 for i in range(60)]
    renamed = {f"m{i}": _id(i) for i in range(30)}
    TEST_IDS.note(renamed.values())
    first = buffer_rows(keys[:30])
    at = first.schema.get_field_index("message_id")
    mids = pa.array([renamed[m] for m in first.column(at).to_pylist()], pa.string())
    fill(warehouse, "jobs", first.set_column(at, BUFFER_SCHEMA.field("message_id"), mids))
    fill(warehouse, "jobs", buffer_rows(keys[30:], prefix="s"))
    index = TopicIndex(warehouse, topic_conf())
    index.load()
    store = index.store
    assert len(index.rows) == 60
    for bucket in range(4):
        h = store.stored()[store.bucket[store.stored()] == bucket]
        h = h[np.lexsort((store.offset[h], store.partition[h], store.sort_key[h]))]
        assert len(set(store.segment[h].tolist())) == 1, "a bucket's heads in one segment"
        assert (np.diff(store.position[h]) == 1).all(), "in the bucket's sort order"
    expected = sum(len(head) + 1 for _, head in store.heads(store.stored()))
    assert index.heads.disk_bytes() == expected, "no scratch store and no copy left"
    state = TopicState(4, 5)
    state.touch("c", 0)
    picked, taken = index.pick_with_heads(state, state.buckets_of("c"), 100, 0)
    picks = listed(picked)
    assert sorted(p[0] for p in picks) == sorted([*renamed.values(), *(f"s{i}" for i in range(30))])
    for (mid, _, key), (row_key, head) in zip(picks, taken, strict=True):
        shown = json.loads(head + b"}")
        assert (shown["id"], shown["sort_key"]) == (mid, key) and key == row_key
    assert [p[2] for p in picks] == sorted(keys)
    assert index.row(_id(2)) is not None and index.row("x" * 70) is None
    index.forget(packed_mhs([p[0] for p in picks]))
    assert len(index.rows) == 0 and store.segments == {}, "every segment released"


def test_a_versions_ids_encoded_before_the_lock_are_stored_as_they_would_be(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A version's ids are encoded for the id table before the index takes its lock. In
    one version: buckets whose ids are short, wide enough to widen the column, or kept
    as digests, and two messages forgotten between the read and the insert (a trim
    applied meanwhile). Every other id is stored and found, and the two are not. An id
    encoded at the column's width before another insert widened it is stored at the
    new width."""
    from dejaq.broker.storage.id_table import IdTable

    warehouse = str(tmp_path / "wh")
    fill(warehouse, "jobs", buffer_rows(list(range(8)), prefix="m"))
    index = TopicIndex(warehouse, topic_conf())
    index.load()
    prefixes = ["a", "w" * 30, "x" * 70, "b"]  # short, widening, digests, short
    parts = [buffer_rows(list(range(50)), lambda i, b=b: b, p) for b, p in enumerate(prefixes)]
    fill(warehouse, "jobs", pa.concat_tables(parts))
    gone = ["a3", "w" * 30 + "7", "x" * 70 + "9"]
    room = index.store.table.make_room

    def settled_meanwhile(n: int, lock: Any) -> None:
        index.forget(packed_mhs(gone))
        room(n, lock)

    monkeypatch.setattr(index.store.table, "make_room", settled_meanwhile)
    assert index.refresh() == 200 - len(gone)
    want = [f"{p}{i}" for p in prefixes for i in range(50)]
    assert [index.store.table.get(m) is None for m in want] == [m in gone for m in want]
    assert index.store.table.ids.dtype.itemsize == 32
    state = TopicState(4, 5)
    state.touch("c", 0)
    picks = listed(index.pick(state, state.buckets_of("c"), 1000, now=1))
    assert sorted(p[0] for p in picks) == sorted({*want, *(f"m{i}" for i in range(8))} - {*gone})

    table = IdTable()
    table.grow(4)
    early = table.encode(["s1", "s2"])
    table.insert(
        np.array([0, 1]), table.encode(["long-enough-to-widen-1", "long-enough-to-widen-2"])
    )
    table.insert(np.array([2, 3]), early)
    assert [table.get(m) for m in ["s1", "s2", "long-enough-to-widen-2"]] == [2, 3, 1]


def test_an_id_forgotten_twice_in_one_trim_frees_its_handle_and_head_once(tmp_path: Path) -> None:
    """A trim can name a message twice (and one this node has no row for): its handle is
    freed once, so no later row shares it, and its head's segment counts it once, so the
    segment is not released while other rows' heads are in it."""
    warehouse = str(tmp_path / "wh")
    fill(warehouse, "jobs", buffer_rows(list(range(40))))
    index = TopicIndex(warehouse, topic_conf())
    index.load()
    store = index.store
    index.forget(packed_mhs(["m1", "m1", "m2", "nowhere", "m2", "m3", "m1"]))
    assert len(store._free) == 3 and len(set(store._free)) == 3, "each handle freed once"
    assert len(index.rows) == 37 and index.forgotten == {mh("nowhere")}
    assert sum(store._rows_in.values()) == 37, "each head left its segment once"
    fill(warehouse, "jobs", buffer_rows(list(range(100, 103)), prefix="n"))
    index.refresh()
    state = TopicState(4, 5)
    state.touch("c", 0)
    picked, taken = index.pick_with_heads(state, state.buckets_of("c"), 100, 0)
    picks = listed(picked)
    expected = {f"m{i}" for i in range(40)} - {"m1", "m2", "m3"} | {"n0", "n1", "n2"}
    assert sorted(p[0] for p in picks) == sorted(expected)
    assert [json.loads(h + b"}")["id"] for _, h in taken] == [p[0] for p in picks]


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sizes=st.tuples(st.integers(1, 400), st.integers(0, 400), st.integers(0, 400)),
    n=st.integers(1, 9),
    data=st.data(),
)
def test_leases_stay_in_order_as_new_rows_arrive(
    tmp_path_factory, sizes: tuple[int, int, int], n: int, data: st.DataObject
) -> None:
    """Across a bucket's sorted run and its heap: a bucket of 100 rows is a run, a refresh
    adding 10 goes on the heap, one adding 100 merges into the run. Sizes are drawn
    apart from the keys, or hypothesis would rarely make a list long enough for a run."""
    first_n, second_n, taken = sizes
    first = data.draw(st.lists(st.integers(0, 300), min_size=first_n, max_size=first_n))
    second = data.draw(st.lists(st.integers(0, 300), min_size=second_n, max_size=second_n))
    warehouse = str(tmp_path_factory.mktemp("wh"))
    fill(warehouse, "jobs", buffer_rows(first))
    index = TopicIndex(warehouse, topic_conf())
    index.load()
    state = TopicState(4, 5)
    head = [k for b in drain(index, state, n, now=0, limit=taken) for k in b]
    fill(warehouse, "jobs", buffer_rows(second, prefix="s"))
    assert index.refresh() == len(second)
    rest = [k for b in drain(index, state, n, now=0) for k in b]
    assert head == sorted(first)[: len(head)] and len(head) == min(taken, len(first))
    assert rest == sorted(sorted(first)[len(head) :] + second)


def test_a_lease_whose_picks_may_have_settled_and_been_trimmed_since_grants_none(
    tmp_path: Path,
) -> None:
    """The leader picks, then commits: a cancel, its checkpoint's trim (the message is
    forgotten, `settled` no longer names it) and only then the lease may apply. The
    lease carries the seq its picks were made at; once a trim passed it, `settled` can
    no longer tell, and the lease grants nothing (the leader puts the picks back). One
    made before that trim is granted as before."""
    warehouse = str(tmp_path)
    fill(warehouse, "jobs", buffer_rows([5, 6, 7], lambda i: 0))
    node = BrokerState([topic_conf(buckets=1)], 5, _NoIndex())
    index, state = TopicIndex(warehouse, topic_conf(buckets=1)), node.topics["jobs"]
    index.load()
    state.touch("c", 0)
    picks = listed(index.pick(state, state.buckets_of("c"), 2, now=0))
    seen = state.seq
    assert [p[0] for p in picks] == ["m0", "m1"]
    assert node._apply("jobs", "cancel", (1, "m0", 0, 5)) is None
    index.forget(node._apply("jobs", "trim", (state.seq,)))
    granted = node._apply("jobs", "lease", ("c", 2, 1000, packed(picks), None, True, seen))
    assert not len(granted) and not state.leases, "m0 was cancelled: nothing granted"
    index.release(state, packed(picks))
    again = listed(index.pick(state, state.buckets_of("c"), 2, now=3))
    assert [p[0] for p in again] == ["m1", "m2"], "m1 back in the index, m0 gone"
    seen = state.seq
    granted = node._apply("jobs", "lease", ("c", 4, 1000, packed(again), None, True, seen))
    assert record_ids(granted) == ["m1", "m2"]


def test_a_cancel_or_reschedule_made_before_a_trim_passed_it_is_sent_back() -> None:
    """The leader finds a message's row, then commits a cancel or reschedule; meanwhile
    the message is acked and its ack trimmed (`settled` forgets it). Applied, the cancel
    would settle it a second time and the reschedule leave an override that nothing
    removes: both are refused as made from a trimmed view (the leader reads again).
    Commands from before they carried `seen` apply as they did."""
    state = TopicState(1, 5)
    state.touch("c", 0)
    record = state.lease("c", 0, 1000, [("m0", 0, 5), ("m1", 0, 6)], lid=1)
    seen = state.seq
    assert state.ack("c", 1, [], [record.receipt(0)]) == {}
    assert unpacked_mhs(state.trim(state.seq)) == [mh("m0")] and mh("m0") not in state.settled
    assert state.cancel(2, "m0", 0, 5, seen) == Refusal.TRIMMED
    assert state.reschedule("m0", 9, seen) == Refusal.TRIMMED
    assert state.seq == 1 and not state.sort_keys, "nothing settled or re-keyed"
    assert state.cancel(2, "m1", 0, 6, state.seq) is None, "a fresh view is applied"
    assert settled_ids(state) == {"m1": "cancelled"}
    assert state.reschedule("m2", 9) is None and state.sort_keys == {mh("m2"): 9}


def test_a_run_token_whose_handle_went_to_a_later_message_hides_no_lower_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message cancelled while its token lay in its bucket's run, forgotten, and its
    handle given to a message read since, at a higher key: the run's entries are made
    without the old token, which would carry the new message's key at the old one's
    place and hide the keys after it. So 17 leases before 18 (another bucket's)."""
    monkeypatch.setattr(index_module, "RUN_MIN", 1)  # two rows of a bucket make a run
    warehouse = str(tmp_path)
    fill(warehouse, "jobs", buffer_rows([5, 17, 18], lambda i: (1, 1, 2)[i], "a"))
    index = TopicIndex(warehouse, topic_conf())
    index.load()
    state = TopicState(4, 5)
    state.touch("c", 0)
    handle = index.store.get("a0") & index_module.HANDLE_MASK
    row = index.row("a0")
    assert row is not None and state.cancel(0, "a0", row.bucket, row.sort_key) is None
    index.forget(state.trim(state.seq))
    fill(warehouse, "jobs", buffer_rows([31], lambda i: 0, "b"))
    assert index.refresh() == 1
    assert index.store.get("b0") & index_module.HANDLE_MASK == handle, "the handle reused"
    picks = listed(index.pick(state, state.buckets_of("c"), 4, now=0))
    assert picks == [("a1", 1, 17), ("a2", 2, 18), ("b0", 0, 31)]


def test_a_message_rescheduled_while_pending_leases_at_its_new_key_only(tmp_path: Path) -> None:
    """A reschedule pushes an entry at the new key while the row's own entry stays in its
    bucket's run: that one is stale (the override says so) and dropped when met, so the
    message leases once, at its new place."""
    warehouse = str(tmp_path)
    fill(warehouse, "jobs", buffer_rows([1, 5, 9], lambda i: 0, "a"))
    index = TopicIndex(warehouse, topic_conf())
    index.load()
    state = TopicState(4, 5)
    state.touch("c", 0)
    assert state.reschedule("a1", 20) is None
    index.push(state, [mh("a1")])
    picks = listed(index.pick(state, state.buckets_of("c"), 10, now=0))
    assert picks == [("a0", 0, 1), ("a2", 0, 9), ("a1", 0, 20)]
    index.close()


def test_new_keys_are_events_whose_trim_forgets_nothing_on_any_node(tmp_path: Path) -> None:
    """A nack's priority and a reschedule are `rescheduled` events, at the new key, the
    command's time and the message's bucket, which the ledger gets by id. They settle
    nothing: their trim forgets nothing on either of two nodes applying the same
    commands, and the messages lease at their new keys after it and from a snapshot
    (an index rebuilt for it). A redriven message given a new key is still redriven
    (its row is put back); a reschedule command from before it carried a time records
    no event."""
    warehouse = str(tmp_path)
    fill(warehouse, "jobs", buffer_rows([1, 5, 9, 11], lambda i: 0, "a"))
    nodes = []
    for _ in range(2):
        index = TopicIndex(warehouse, topic_conf())
        index.load()
        state = TopicState(4, 5)
        state.touch("c", 0)
        nodes.append((index, state))
    for index, state in nodes:
        state.lease("c", 0, 1000, packed([("a0", 0, 1), ("a3", 0, 11)]), lid=1)
        assert state.nack("c", 2, ["a0"], 0, 20) == ({}, [mh("a0")], [])
        assert state.reject("c", 3, ["a3"]) == {}
        assert state.redrive(4, state.trimmed_upto(), [("a3", 0, 11)]) == (["a3"], {})
        assert state.reschedule("a1", 30, state.seq, 5, 0) is None
        assert state.reschedule("a3", 40, state.seq, 6, 0) is None
        assert state.reschedule("a2", 25) is None, "an old command: no event"
        index.push(state, mhs(["a0", "a1", "a2", "a3"]))
    state = nodes[0][1]
    moved = [(e.mh, e.bucket, e.sort_key, e.at) for e in state.events if e.event == "rescheduled"]
    assert moved == [(mh("a0"), 0, 20, 2), (mh("a1"), 0, 30, 5), (mh("a3"), 0, 40, 6)]
    assert nodes[1][1].events == state.events
    upto = checkpoint(warehouse, "jobs", state.events, buffer_names(warehouse))
    assert upto == state.seq
    assert ledger_ids(warehouse, "rescheduled") == ["a0", "a1", "a3"]
    assert [state.redriven_ids[h] for h in redriven(settlements(state.events.view()))] == ["a3"]
    wanted = [("a0", 0, 20), ("a2", 0, 25), ("a1", 0, 30), ("a3", 0, 40)]
    for index, state in nodes:
        gone = state.trim(upto)
        assert gone == b"", "nothing forgotten (a3's death: its redrive came after)"
        index.forget(gone)
        assert not state.events and not state.settled
        assert state.sort_keys == {
            mh("a0"): 20,
            mh("a1"): 30,
            mh("a2"): 25,
            mh("a3"): 40,
        }
    snapshot = pickle.loads(pickle.dumps(nodes[1][1]))
    fresh = TopicIndex(warehouse, topic_conf())
    fresh.load()
    fresh.rebuild(snapshot)
    for index, state in [*nodes, (fresh, snapshot)]:
        assert listed(index.pick(state, state.buckets_of("c"), 10, now=0)) == wanted
        index.close()


def test_a_freed_segments_number_names_no_other_segment_for_the_picks_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pick keeps blocks of heads it read by segment number: a freed segment's number
    taken by the next one before the cache is emptied would give a lease another
    message's head, so a number comes back only once the index lets its columns go."""
    warehouse, index, state = loaded_topic(tmp_path, [1])
    picked, _ = index.pick_with_heads(state, state.buckets_of("c"), 1, now=0)  # cached
    index.release(state, picked)
    state.lease("c", 0, 1000, listed(picked))
    assert state.ack("c", 1, ["m0"]) == {}
    index.forget(
        state.trim(checkpoint(warehouse, "jobs", state.events, buffer_names(warehouse)))
    )  # its head gone
    monkeypatch.setattr(head_store, "SEGMENT_BYTES", 1)  # the next write opens a segment
    fill(warehouse, "jobs", buffer_rows([1], prefix="n"))
    index.refresh()  # frees m0's segment as it opens one
    picked, taken = index.pick_with_heads(state, state.buckets_of("c"), 1, now=0)
    assert [json.loads(h + b"}")["id"] for _, h in taken] == ["n0"]
    index.release_columns()  # as the node's follow thread does after each round
    assert index.heads.current is not None


def test_a_freed_segments_number_is_taken_again(tmp_path: Path) -> None:
    """Segment numbers sit in an int32 column, and a node opens a scratch segment for
    each bucket it reads out of order: a counter would pass 2**31 within weeks at
    thousands of buckets. A number comes back when its segment is freed."""
    scratch = head_store.HeadStore(str(tmp_path))
    seg, _ = scratch.write(["{}"])
    number = seg.number
    scratch.close()  # as `_read_bucket` closes its scratch store
    again, _ = head_store.HeadStore(str(tmp_path)).write(["{}"])
    assert again.number <= number, "a freed number, not the next of a counter"


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rounds=st.lists(
        st.tuples(
            st.lists(st.integers(0, 40), min_size=1, max_size=150),  # new rows' sort keys
            st.integers(0, 60),  # leased and acked
            st.integers(1, 15),  # cancelled while pending, still in their bucket's run
            st.integers(0, 15),  # leased and nacked to a new priority
        ),
        min_size=2,
        max_size=4,
    ),
    nack_key=st.integers(0, 40),
)
@example(rounds=[(list(range(40)), 0, 10, 0), (list(range(40)), 5, 1, 5)], nack_key=3)
def test_handles_of_settled_messages_are_reused_and_never_stand_for_another(
    tmp_path_factory,
    monkeypatch: pytest.MonkeyPatch,
    rounds: list[tuple[list[int], int, int, int]],
    nack_key: int,
) -> None:
    """A settled message's handle goes to a row read later, while entries naming it may
    still lie in a run (a cancelled message's): they never lease the new message out of
    order, twice, or with another's head. Rows are renumbered (`shrink`) whenever that
    halves the columns: the tokens in runs and heaps, re-keyed ones too, move along.
    Checked against a model of what is pending. Small buckets get runs."""
    monkeypatch.setattr(index_module, "RUN_MIN", 2)
    monkeypatch.setattr(row_store_module, "MIN_HANDLES", 8)  # renumbered whenever that
    monkeypatch.setattr(row_store_module, "SHRINK_MIN", 1)  # halves the columns
    warehouse = str(tmp_path_factory.mktemp("wh"))
    index = TopicIndex(warehouse, topic_conf())
    state = TopicState(4, 5)
    state.touch("c", 0)
    model: dict[str, int] = {}  # pending id -> the key it should lease at
    for r, (keys, acked, cancelled, nacked) in enumerate(rounds):
        if keys:
            fill(warehouse, "jobs", buffer_rows(keys, prefix=f"r{r}-"))
            model.update({f"r{r}-{i}": k for i, k in enumerate(keys)})
        index.load() if r == 0 else index.refresh()
        picks = listed(index.pick(state, state.buckets_of("c"), acked, now=r))
        assert [k for _, _, k in picks] == sorted(model.values())[:acked], "the lowest"
        assert len(state.lease("c", r, 10**9, picks)) == len(picks)
        index.release(state, packed(picks))
        assert state.ack("c", r, [m for m, _, _ in picks]) == {}
        for mid, _, key in picks:
            assert model.pop(mid) == key
        middle = sorted(model, key=lambda m: (model[m], m))[len(model) // 3 :]
        for mid in middle[:cancelled]:
            row = index.row(mid)
            assert row is not None and state.cancel(r, mid, row.bucket, model.pop(mid)) is None
        picks = listed(index.pick(state, state.buckets_of("c"), nacked, now=r))
        state.lease("c", r, 10**9, picks)
        index.release(state, packed(picks))
        refused, again, _ = state.nack("c", r, [m for m, _, _ in picks], sort_key=nack_key)
        assert not refused
        index.push(state, again)
        model.update(dict.fromkeys(TEST_IDS.ids(again), nack_key))
        index.forget(state.trim(state.seq))
        index.shrink()
        n = len(index.rows)
        assert len(index.store.batch) <= 2 * max(n + n // 4, 8), "shrunk"
    picked, taken = index.pick_with_heads(state, state.buckets_of("c"), 10_000, now=len(rounds))
    picks = listed(picked)
    assert sorted(m for m, _, _ in picks) == sorted(model), "each pending message once"
    assert [k for _, _, k in picks] == sorted(model.values()), "in sort key order"
    assert [k for _, _, k in picks] == [model[m] for m, _, _ in picks]
    assert [json.loads(h + b"}")["id"] for _, h in taken] == [m for m, _, _ in picks]


def test_batch_numbers_wrap_and_every_token_stays_its_messages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node numbers a batch per bucket and refresh, billions over months at thousands
    of buckets: the numbers wrap below 2**31, as a token is a signed 64-bit integer, and
    the messages stored across the wrap lease once each, in order."""
    monkeypatch.setattr(index_module, "RUN_MIN", 2)
    warehouse = str(tmp_path)
    index = TopicIndex(warehouse, topic_conf())
    index.store._batches = row_store_module.BATCH_MAX - 3
    state = TopicState(4, 5)
    state.touch("c", 0)
    model: dict[str, int] = {}
    for r in range(4):
        fill(warehouse, "jobs", buffer_rows([10 - r, 20 + r, 30 + r], prefix=f"r{r}-"))
        model.update({f"r{r}-{i}": k for i, k in enumerate([10 - r, 20 + r, 30 + r])})
        index.load() if r == 0 else index.refresh()
    assert index.store._batches < 16, "the numbers wrapped"
    picks = listed(index.pick(state, state.buckets_of("c"), 100, now=1))
    assert sorted(m for m, _, _ in picks) == sorted(model), "each pending message once"
    assert [k for _, _, k in picks] == sorted(model.values()), "in sort key order"
    assert [model[m] for m, _, _ in picks] == [k for _, _, k in picks]


def test_leased_json_is_what_json_dumps_gives(tmp_path: Path) -> None:
    """A lease joins JSON rendered when the rows were indexed: the text `json.dumps` gives
    of the messages built from the buffer rows, on first delivery at the row's own sort
    key (the joined case) and on redelivery or at another key (rendered apart), mixed,
    and only of the picks the lease granted; the same again from the lease's record,
    for a request sent again. A record without a value has a null payload, an empty one
    an empty payload."""
    warehouse = str(tmp_path / "wh")
    for kind, keys in (("priority", [7, 65535, 3, 9]), ("timeline", [1_700_000_000_000] * 4)):
        timeline = kind == "timeline"
        rows = buffer_rows(keys, prefix='q"\\é', timeline=timeline).to_pylist()
        rows[0]["key"] = None
        rows[1]["payload"], rows[2]["payload"] = None, b""
        fill(warehouse, kind, pa.Table.from_pylist(rows, schema=BUFFER_SCHEMA))
        index = TopicIndex(warehouse, topic_conf(kind, kind))
        index.load()
        for shifts, deliveries in (
            ([0] * 4, [1] * 4),
            ([0, 0, 0, 1], [1] * 4),  # first deliveries, one at another key
            ([0, 1, 0, 1], [1, 1, 3, 2]),
            ([0] * 4, [0, 1, 0, 2]),  # 0: picked, not granted (leased meanwhile, say)
        ):
            picks = [
                (r["message_id"], r["bucket"], r["sort_key"] + k)
                for r, k in zip(rows, shifts, strict=True)
            ]
            granted = [(r, p, n) for r, p, n in zip(rows, picks, deliveries, strict=True) if n]
            lease = LeaseRecord(lid=5, consumer="c", deadline=99)
            columns = [list(c) for c in zip(*[(*p, n) for _, p, n in granted], strict=True)]
            mids, buckets, keys, counts = columns or ([], [], [], [])
            lease.__setstate__(  # as a snapshot holds it
                (
                    array("H", buckets),
                    "c",
                    99,
                    None,
                    array("i", counts),
                    bytearray(len(mids)),
                    5,
                    len(mids),
                    mids,
                    array("q", keys),
                )
            )
            want = [
                {**_leased(r, p[2], n, 99, timeline), "receipt": 5 << POSITION_BITS | i}
                for i, (r, p, n) in enumerate(granted)
            ]
            rendered = Heads.of(index.head(p[0]) for p in picks)
            got = message_json.leased_array(packed(picks), rendered, lease, timeline)
            assert got == json.dumps(want).encode() and len(want) == sum(map(bool, deliveries))
            held = list(range(len(mids)))
            again = message_json.held_array(lease, held, [index.head(m) for m in mids], timeline)
            assert again == got, "a request sent again is answered as its lease was"


def test_a_lease_rendered_from_heads_its_keys_do_not_match_is_refused() -> None:
    """The core renders a lease from one head per pick: keys for another number of
    picks are a caller's error, named, not a lease cut short; a pick whose key is not its
    row's is rendered apart (None)."""
    heads = Heads.of([(5, b'{"id": "m0"'), (-2, b'{"id": "m1"')])
    args = (heads.joined, heads.ends, heads.row_keys)
    with pytest.raises(ValueError, match="24 bytes of sort keys and 16 of row keys"):
        render_leased(*args, bytes(24), 99, 1)
    assert render_leased(*args, np.array([5, 6], "<i8").tobytes(), 99, 1) is None
    whole = render_leased(*args, np.array([5, -2], "<i8").tobytes(), 99, 1)
    assert json.loads(whole) == [
        {"id": f"m{i}", "deliveries": 1, "lease_deadline": 99, "receipt": 1 + i} for i in (0, 1)
    ]
    assert list(heads) == [(5, b'{"id": "m0"'), (-2, b'{"id": "m1"')] and heads[-1][0] == -2
    with pytest.raises(IndexError):
        heads[2]


def _leased(row: dict, key: int, deliveries: int, deadline: int, timeline: bool) -> dict:
    """A leased message as the API documents it, from its buffer row."""
    at = row["deliver_at"]
    return {
        "id": row["message_id"],
        "bucket": row["bucket"],
        "key": None if row["key"] is None else base64.b64encode(row["key"]).decode(),
        "payload": None if row["payload"] is None else base64.b64encode(row["payload"]).decode(),
        "sort_key": key,
        "priority": None if timeline else key,
        "deliver_at": key if timeline else (at and int(at.timestamp() * 1000)),
        "deliveries": deliveries,
        "lease_deadline": deadline,
    }


def test_timeline_never_before_deliver_at_and_follows_new_versions(tmp_path: Path) -> None:
    warehouse = str(tmp_path / "wh")
    fill(warehouse, "later", buffer_rows([1000, 3000, 2000], timeline=True))
    index = TopicIndex(warehouse, topic_conf("later", "timeline"))
    index.load()
    state = TopicState(4, 5)
    assert drain(index, state, 10, now=999) == []
    assert drain(index, state, 10, now=2000) == [[1000, 2000]]
    fill(warehouse, "later", buffer_rows([1500], prefix="n", timeline=True))
    assert index.refresh() == 1
    assert drain(index, state, 10, now=2500) == [[1500]]
    assert drain(index, state, 10, now=3000) == [[3000]]


def loaded_topic(tmp_path: Path, keys: list[int]) -> tuple[str, TopicIndex, TopicState]:
    """Topic "jobs" with these sort keys in its buffer, its index loaded, and a state in
    which consumer "c" holds every bucket."""
    warehouse = str(tmp_path / "wh")
    fill(warehouse, "jobs", buffer_rows(keys))
    index = TopicIndex(warehouse, topic_conf())
    index.load()
    state = TopicState(4, 5)
    state.touch("c", 0)
    return warehouse, index, state


def acked_batches(index: TopicIndex, state: TopicState, n: int) -> Iterator[list[str]]:
    """Lease everything in batches of n as consumer "c" and ack each batch; its ids."""
    while picks := listed(index.pick(state, state.buckets_of("c"), n, now=0)):
        state.lease("c", 0, 1000, picks)
        index.release(state, packed(picks))
        mids = [m for m, _, _ in picks]
        assert state.ack("c", 1, mids) == {}
        yield mids


def test_settled_messages_leave_the_index_through_the_ledger(tmp_path: Path) -> None:
    warehouse, index, state = loaded_topic(tmp_path, [5, 1, 3])
    picked, taken = index.pick_with_heads(state, state.buckets_of("c"), 1, now=0)
    picks = listed(picked)
    assert picks == [("m1", 1, 1)], "lowest sort key first"
    assert list(taken) == [index.head("m1")], "a lone pick's head, read on its own"
    state.lease("c", 0, 1000, picks)
    assert state.ack("c", 1, ["m1"]) == {}
    upto = checkpoint(warehouse, "jobs", list(state.events), buffer_names(warehouse))
    assert checkpoint(warehouse, "jobs", list(state.events), buffer_names(warehouse)) == upto, (
        "replay is skipped"
    )
    ledger = scan(ensure_table(warehouse, Table.LEDGER, "jobs"), Table.LEDGER)
    assert ledger.column("message_id").to_pylist() == ["m1"]
    index.forget(state.trim(upto))
    fresh = TopicIndex(warehouse, topic_conf())
    fresh.load()
    stored = fresh.store.table.mids(fresh.store.stored())
    assert "m1" not in fresh.rows and "m1" not in stored, "not stored at all"
    assert index.settled_event("m1") == fresh.settled_event("m1") == "acked"
    assert index.settled_event("m5") is None, "pending: not in the ledger"
    picked, taken = index.pick_with_heads(state, state.buckets_of("c"), 3, now=2)
    picks = listed(picked)
    assert [p[0] for p in picks] == ["m2", "m0"]
    assert list(taken) == [index.head("m2"), index.head("m0")], "each pick's head, in pick order"
    assert [json.loads(h + b"}")["id"] for _, h in taken] == ["m2", "m0"]


def test_a_pick_reads_each_head_whole_through_blocks_cached_before_it_was_written(
    tmp_path: Path,
) -> None:
    """A lease's pick reads heads through blocks of the segment cached by earlier picks.
    A head written into a block after it was cached is read from the file: past the
    block's end (the file was shorter), or where the block held zeros (a write that had
    not landed yet, made here by extending the file with zeros before the pick)."""
    warehouse, index, state = loaded_topic(tmp_path, [1])
    segment = index.heads.current
    assert segment is not None
    os.pwrite(segment.fd, bytes(300), segment.size)  # as if a write were under way
    picked, taken = index.pick_with_heads(state, state.buckets_of("c"), 1, now=0)
    assert listed(picked) == [("m0", 0, 1)] and list(taken) == [index.head("m0")]
    index.release(state, picked)
    state.lease("c", 0, 1000, listed(picked))
    fill(warehouse, "jobs", buffer_rows([2, 3], prefix="n"))
    assert index.refresh() == 2
    assert index.heads.current is segment, "the new heads are in the block read before"
    for _ in range(2):
        picked, taken = index.pick_with_heads(state, state.buckets_of("c"), 1, now=0)
        [(mid, _, _)] = listed(picked)
        [(key, head)] = taken
        assert (key, head) == index.head(mid) and json.loads(head + b"}")["id"] == mid
        state.lease("c", 0, 1000, listed(picked))


def leased_before_a_node_read_it(
    tmp_path: Path, lease_ms: int = 1000
) -> tuple[str, TopicIndex, TopicIndex, TopicState]:
    """Topic "jobs" with m0, loaded by two nodes' indexes; then new0 and new1 appended,
    which the leader's index alone reads before it leases new0 to "c": (warehouse, the
    leader's index, the lagging node's, the state)."""
    warehouse, leader, state = loaded_topic(tmp_path, [1])
    lagging = TopicIndex(warehouse, topic_conf())
    lagging.load()
    fill(warehouse, "jobs", buffer_rows([0, 2], prefix="new"))
    assert leader.refresh() == 2
    picks = listed(leader.pick(state, state.buckets_of("c"), 1, now=0))
    assert [p[0] for p in picks] == ["new0"]
    state.lease("c", 0, lease_ms, picks)
    return warehouse, leader, lagging, state


def test_a_node_that_reads_a_row_after_its_trim_does_not_index_it(tmp_path: Path) -> None:
    """A follower can apply a message's trim before it reads the version holding its row
    (the leader read it first, leased and settled it): the row must not come back as
    pending there, or that node, once leader, would deliver it again."""
    warehouse, leader, lagging, state = leased_before_a_node_read_it(tmp_path)
    assert state.ack("c", 1, ["new0"]) == {}
    mids = state.trim(checkpoint(warehouse, "jobs", state.events, buffer_names(warehouse)))
    leader.forget(mids)
    lagging.forget(mids)
    assert lagging.refresh() == 1
    assert set(lagging.rows) == set(leader.rows) == {"m0", "new1"}
    assert not lagging.forgotten, "remembered until the next refresh only"


def test_a_trim_outlives_a_refresh_that_read_no_new_version(tmp_path: Path) -> None:
    """On an object store the table watch probes a quiet table less often, so a refresh
    can find no new version: what the node forgot must wait for the version holding
    its rows. The watch's answer is stubbed (a quiet object store cannot be made to
    skip its probe on cue here); the tables and indexes are real."""
    warehouse, leader, lagging, state = leased_before_a_node_read_it(tmp_path)
    assert state.ack("c", 1, ["new0"]) == {}
    mids = state.trim(checkpoint(warehouse, "jobs", state.events, buffer_names(warehouse)))
    leader.forget(mids)
    lagging.forget(mids)
    probe = lagging.watch.moved
    lagging.watch.moved = lambda version: False  # backing off: no new version read

    assert lagging.refresh() == 0
    assert lagging.forgotten == {mh("new0")}

    lagging.watch.moved = probe
    assert lagging.refresh() == 1
    assert set(lagging.rows) == set(leader.rows) == {"m0", "new1"}
    again = listed(lagging.pick(state, state.buckets_of("c"), 5, now=2))
    assert "new0" not in [m for m, _, _ in again], "an acked message is not leased again"


@pytest.mark.parametrize("how", ["delay", "priority"])
def test_a_message_nacked_before_a_node_read_its_row_keeps_its_delay_or_key_there(
    tmp_path: Path, how: str
) -> None:
    """A follower applies a nack (with a delay, or a new priority) of a message whose row
    it has not read yet; it reads the row afterwards: the delay or the new key holds
    there too, and the message is leased, once due, if that node leads."""
    _, _, follower, state = leased_before_a_node_read_it(tmp_path, lease_ms=10_000)
    delay, priority = (100, None) if how == "delay" else (0, 7)
    refused, pending, _ = state.nack("c", 1, ["new0"], delay, priority)
    assert not refused and pending == [mh("new0")]
    follower.push(state, pending)  # the Raft hook, before the node read the row
    assert follower.awaited == {mh("new0")} and follower.unread == {}, "indexed once read"
    assert follower.refresh() == 2  # the follow thread: refresh, then revive
    follower.revive(state)

    early = [m for m, _, _ in listed(follower.pick(state, state.buckets_of("c"), 5, now=50))]
    later = listed(follower.pick(state, state.buckets_of("c"), 5, now=200))
    if how == "delay":
        assert early == ["m0", "new1"], "new0 held back until 101"
        assert [m for m, _, _ in later] == ["new0"]
    else:
        assert early == ["m0", "new1", "new0"], "new0 at its new key, 7"
        assert later == []


def test_a_snapshots_new_key_of_a_message_without_a_row_here_holds_once_its_row_is_read(
    tmp_path: Path,
) -> None:
    """A snapshot names a nacked message's new priority by message handle alone, and this
    node has not read its row: the rebuild awaits the row by handle, and once a refresh
    reads it the message is indexed at its new key, not dropped as a stale entry at its
    row's own key."""
    _, _, lagging, state = leased_before_a_node_read_it(tmp_path, lease_ms=10_000)
    assert state.nack("c", 1, ["new0"], 0, 7)[:2] == ({}, [mh("new0")])
    snapshot = pickle.loads(pickle.dumps(state))
    lagging.rebuild(snapshot)
    assert lagging.awaited == {mh("new0")} and lagging.unread == {}
    assert lagging.refresh() == 2
    lagging.revive(snapshot)
    assert lagging.awaited == set()
    picked = listed(lagging.pick(snapshot, snapshot.buckets_of("c"), 5, now=2))
    assert [(m, key) for m, _, key in picked] == [("m0", 1), ("new1", 2), ("new0", 7)]


def test_a_death_kept_by_the_trims_then_redriven_is_not_forgotten_with_its_trim(
    tmp_path: Path,
) -> None:
    """A death whose dead letter failed stays in the state (the trim keeps it) and can be
    redriven meanwhile; the redrive's event is trimmed first. The death's trim, later,
    must not forget the message, pending again since."""
    warehouse, index, state = loaded_topic(tmp_path, [5, 1])
    state.lease("c", 0, 1000, listed(index.pick(state, [0], 1, now=0)))
    assert state.reject("c", 1, ["m0"]) == {}
    death = state.seq
    index.forget(
        state.trim(write_ledger(warehouse, "jobs", state.events, buffer_names(warehouse)), [death])
    )
    redriven, refused = state.redrive(2, state.trimmed_upto(), [("m0", 0, 5)])
    assert redriven == ["m0"] and not refused
    index.push(state, mhs(redriven))
    index.forget(
        state.trim(write_ledger(warehouse, "jobs", state.events, buffer_names(warehouse)), [death])
    )

    gone = state.trim(state.seq)  # the dead letter written at last

    assert list(gone) == []
    index.forget(gone)
    index.revive(state)
    assert state.is_available("m0", 3) and not state.redriven_at
    assert [m for m, _, _ in listed(index.pick(state, [0], 5, now=3))] == ["m0"]


def test_the_ledger_is_compacted_and_keeps_its_checkpoint_tags(tmp_path: Path) -> None:
    """Each checkpoint adds a file (whatever buckets it spans); compacted, the ledger reads
    the same, and a checkpoint replayed after it is still skipped."""
    warehouse, index, state = loaded_topic(tmp_path, list(range(40)))
    batches = []
    for _ in acked_batches(index, state, 8):
        batches.append(list(state.events))
        index.forget(
            state.trim(checkpoint(warehouse, "jobs", state.events, buffer_names(warehouse)))
        )
    path = ensure_table(warehouse, Table.LEDGER, "jobs")
    before = scan(path, Table.LEDGER).sort_by("message_id")
    assert len(DeltaTable(path).file_uris()) == 5, "5 checkpoints of 4 buckets each"
    done = compact_ledger(warehouse, "jobs", HOUR_MS)
    assert done is not None and (done.files_removed, done.files_added) == (5, 1)
    assert scan(path, Table.LEDGER).sort_by("message_id").equals(before)
    assert checkpoint(warehouse, "jobs", batches[2], buffer_names(warehouse)) == batches[2][-1].seq
    assert scan(path, Table.LEDGER).num_rows == 40, "the replay wrote nothing"
    assert index.settled_event("m7") == "acked"


def test_a_snapshot_covering_unapplied_trims_forgets_what_they_settled(tmp_path: Path) -> None:
    """A lagging node gets the leader's state whole; the trims it skipped are in the
    ledger, and what they settled must not come back as pending."""
    warehouse, lagging, leader = loaded_topic(tmp_path, [5, 1, 3])
    leader.lease("c", 0, 1000, [("m1", 1, 1), ("m2", 2, 3)])
    assert leader.ack("c", 1, ["m1", "m2"]) == {}
    leader.trim(
        checkpoint(warehouse, "jobs", leader.events, buffer_names(warehouse))
    )  # never reached `lagging`
    snapshot = pickle.loads(pickle.dumps(leader))
    lagging.rebuild(snapshot)
    assert sorted(lagging.rows) == ["m0"]
    assert listed(lagging.pick(snapshot, snapshot.buckets_of("c"), 3, now=2)) == [("m0", 0, 5)]


def test_a_snapshot_covering_the_trim_of_a_row_the_node_has_not_read_keeps_it_settled(
    tmp_path: Path,
) -> None:
    """A node loading or lagging gets a snapshot covering the lease, ack and trim of a
    row it has not read yet: when it reads the row, the row must not come back as
    pending, or that node, once leader, would deliver an acked message again."""
    warehouse, leader, lagging, state = leased_before_a_node_read_it(tmp_path)
    assert state.ack("c", 1, ["new0"]) == {}
    leader.forget(state.trim(checkpoint(warehouse, "jobs", state.events, buffer_names(warehouse))))
    snapshot = pickle.loads(pickle.dumps(state))
    lagging.rebuild(snapshot)
    assert lagging.refresh() == 1
    assert set(lagging.rows) == set(leader.rows) == {"m0", "new1"}
    picked = listed(lagging.pick(snapshot, snapshot.buckets_of("c"), 3, now=2))
    assert "new0" not in [p[0] for p in picked]


def test_a_snapshot_carries_new_keys_and_delays_of_rows_the_node_has_not_read(
    tmp_path: Path,
) -> None:
    """A lagging node gets the leader's state whole, holding a reschedule and a nack's
    delay and priority of messages whose rows it has not read: read afterwards, they
    lease at their new keys, once due (their rows' own entries are stale, and alone
    would never lease)."""
    warehouse, lagging, leader = loaded_topic(tmp_path, [5])
    fill(warehouse, "jobs", buffer_rows([7, 8], lambda i: 0, prefix="n"))
    assert leader.reschedule("n0", 20) is None
    leader.lease("c", 0, 1000, [("n1", 0, 8)])
    refused, _, _ = leader.nack("c", 1, ["n1"], delay_ms=10, sort_key=2)
    assert not refused
    snapshot = pickle.loads(pickle.dumps(leader))
    lagging.rebuild(snapshot)
    lagging.refresh()
    lagging.revive(snapshot)
    assert listed(lagging.pick(snapshot, snapshot.buckets_of("c"), 3, now=5)) == [
        ("m0", 0, 5),
        ("n0", 0, 20),
    ]
    assert listed(lagging.pick(snapshot, snapshot.buckets_of("c"), 3, now=11)) == [("n1", 0, 2)]


def test_a_followers_delayed_entries_follow_the_delays_in_force(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only a pick pops the delayed entries, and a follower never picks: it kept one for
    every delayed redelivery ever made (memory growing with history, and a new leader's
    first pick popping them all under the lock). Stale ones are dropped as they pile up,
    and those in force stay."""
    monkeypatch.setattr(index_module, "DELAYED_SLACK", 4)
    _, index, state = loaded_topic(tmp_path, list(range(41)))
    for i in range(40):
        t, pick = 10_000 * i, (f"m{i}", i % 4, i)
        state.lease("c", t, 10, [pick])
        index.push(state, state.expire(t + 20, 10**9, (100, 1000)))  # a retry backoff
        state.lease("c", t + 5_000, 10_000, [pick])
        assert state.ack("c", t + 5_001, [f"m{i}"]) == {}
        index.forget(state.trim(state.seq))
    assert len(index.delayed) <= 4 + 1, "the stale delays were dropped"
    state.lease("c", 500_000, 10, [("m40", 0, 40)])
    index.push(state, state.expire(500_020, 10**9, (100, 1000)))
    h = mh("m40")
    assert (state.not_before[h], h) in index.delayed, "the delay in force stays"


def test_a_delay_that_passes_before_the_node_reads_the_row_leaves_the_message_leasable(
    tmp_path: Path,
) -> None:
    """A message nacked with a delay and a priority before this node read its row (a
    snapshot brought the state): the delay passes first, and the message still leases,
    at its new key, once the row is read."""
    warehouse, lagging, leader = loaded_topic(tmp_path, [5])
    fill(warehouse, "jobs", buffer_rows([8], lambda i: 0, prefix="n"))
    leader.lease("c", 0, 1000, [("n0", 0, 8)])
    refused, _, _ = leader.nack("c", 1, ["n0"], delay_ms=10, sort_key=2)
    assert not refused
    snapshot = pickle.loads(pickle.dumps(leader))
    lagging.rebuild(snapshot)
    assert listed(lagging.pick(snapshot, snapshot.buckets_of("c"), 3, now=20)) == [("m0", 0, 5)]
    lagging.refresh()
    lagging.revive(snapshot)
    assert listed(lagging.pick(snapshot, snapshot.buckets_of("c"), 3, now=21)) == [("n0", 0, 2)]


def test_a_restarted_node_revives_nothing_its_snapshot_settled(tmp_path: Path) -> None:
    """A restarted node replays its journal over an index loaded from the tables: an old
    expiry pushes a message whose row the index never took (the ledger had settled it),
    and the trim that settles it for good comes inside the leader's snapshot. The
    message must not come back as pending (it did: leased again after its ack)."""
    warehouse, _, leader = loaded_topic(tmp_path, [5, 1, 3])
    leader.lease("c", 0, 1000, [("m1", 1, 1)])
    leader.ack("c", 1, ["m1"])
    leader.trim(checkpoint(warehouse, "jobs", leader.events, buffer_names(warehouse)))
    node = TopicIndex(warehouse, topic_conf())
    node.load()
    assert sorted(node.rows) == ["m0", "m2"]
    replayed = TopicState(4, 5)  # the journal's older state: m1 expired, pending again
    node.push(replayed, [mh("m1")])
    assert node.awaited == {mh("m1")} and node.unread == {}, "no id to read its row by"
    snapshot = pickle.loads(pickle.dumps(leader))
    node.rebuild(snapshot)
    assert node.revive(snapshot) == 0
    assert sorted(node.rows) == ["m0", "m2"]
    snapshot.touch("c", 2)
    assert [p[0] for p in listed(node.pick(snapshot, snapshot.buckets_of("c"), 3, now=2))] == [
        "m2",
        "m0",
    ]

    # The follow thread revives m1 while the replay has it pending (redriven, by id),
    # before the snapshot.
    node = TopicIndex(warehouse, topic_conf())
    node.load()
    replayed.redriven_ids[mh("m1")] = "m1"
    node.push(replayed, [mh("m1")])
    assert node.revive(replayed) == 1
    node.rebuild(snapshot)
    assert sorted(node.rows) == ["m0", "m2"], "the ledger, unchanged since load, settled m1"


def test_a_snapshots_redrive_of_a_message_without_a_row_here_waits_for_its_row(
    tmp_path: Path,
) -> None:
    """A snapshot holds a redrive, by message handle, of a message this node has no row
    of (its row left the buffer as it died, or, here, is in a version not read yet):
    the rebuild names it by id (`redriven_ids`), and the message waits for its row
    (`unread`, and `awaited` by handle), which a revive brings from the buffer or the
    dead letters, rather than being lost; once the row is read, each message has one
    entry."""
    warehouse, index, state = loaded_topic(tmp_path, [5, 1])
    fill(warehouse, "jobs", buffer_rows([1], prefix="late"))
    state.lease("c", 0, 1000, [("late0", 0, 1), ("m0", 0, 5)])
    assert state.reject("c", 1, ["late0", "m0"]) == {}
    assert state.redrive(2, state.trimmed_upto(), [("late0", 0, 1), ("m0", 0, 5)])[0] == [
        "late0",
        "m0",
    ]
    snapshot = pickle.loads(pickle.dumps(state))
    assert snapshot.redriven_ids == {mh("late0"): "late0", mh("m0"): "m0"}
    index.rebuild(snapshot)
    assert index.unread == {mh("late0"): "late0"}, "m0's row is here"
    assert index.awaited == {mh("late0")}, "its redrive's key is an override"
    assert index.revive(snapshot) == 1
    assert index.revive(snapshot) == 0, "the follow thread revives after every refresh"
    assert index.unread == {} and index.awaited == set()
    picked = [m for m, _, _ in listed(index.pick(snapshot, [0, 1, 2, 3], 5, now=3))]
    assert sorted(picked) == ["late0", "m0", "m1"], "each message picked once"
    snapshot.trim(snapshot.seq)
    assert snapshot.redriven_at == {} and snapshot.redriven_ids == {}


@pytest.mark.parametrize("read_by", ["revive", "refresh"])
def test_a_snapshots_redrive_of_a_message_not_read_here_is_indexed_once_its_row_is(
    tmp_path: Path, read_by: str
) -> None:
    """A snapshot holds a redrive of a message whose row this node has not read: the
    rebuild waits for the row both by id (`unread`, a redrive's) and by message handle
    (`awaited`, as the redrive's key is an override). Once the row is read, by a revive
    (by id) or a refresh (a new version), one entry is made: two would lease the
    message twice in one pick."""
    _, _, lagging, state = leased_before_a_node_read_it(tmp_path)
    assert state.reject("c", 1, ["new0"]) == {}
    # At a key of its own: the entry a refresh makes at the row's key is then stale.
    assert state.redrive(2, state.trimmed_upto(), [("new0", 0, 5)])[0] == ["new0"]
    snapshot = pickle.loads(pickle.dumps(state))
    lagging.rebuild(snapshot)
    assert lagging.unread == {mh("new0"): "new0"} and lagging.awaited == {mh("new0")}
    if read_by == "refresh":
        assert lagging.refresh() == 2
    assert lagging.revive(snapshot) == (1 if read_by == "revive" else 0)
    assert lagging.revive(snapshot) == 0
    assert lagging.unread == {} and lagging.awaited == set()
    picked = listed(lagging.pick(snapshot, snapshot.buckets_of("c"), 5, now=3))
    expected = ["m0", "new1", "new0"] if read_by == "refresh" else ["m0", "new0"]
    assert [m for m, _, _ in picked] == expected, "each message picked once"


def test_the_index_keeps_nothing_of_a_settled_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Memory does not grow with the messages settled: no set of settled ids (the ledger
    has them), which would grow by ~140 bytes per message for as long as a node runs.
    Nor does the head store's disk: a segment goes once its messages are settled."""
    monkeypatch.setattr(head_store, "SEGMENT_BYTES", 64 * 1024)
    warehouse = str(tmp_path / "wh")
    index = TopicIndex(warehouse, topic_conf(), str(tmp_path / "heads"))
    state = TopicState(4, 5)
    state.touch("c", 0)
    held = []
    TEST_IDS.note(f"settled-{r}-{i}" for r in range(3) for i in range(10_000))  # not traced
    tracemalloc.start()
    try:
        for r in range(3):
            fill(warehouse, "jobs", buffer_rows(list(range(10_000)), prefix=f"settled-{r}-"))
            index.load() if r == 0 else index.refresh()
            assert sum(map(len, acked_batches(index, state, 1000))) == 10_000
            index.forget(
                state.trim(checkpoint(warehouse, "jobs", state.events, buffer_names(warehouse)))
            )
            assert not index.rows and not state.settled and not state.events
            assert len(index.heads.segments) == 1, "only the segment written last is left"
            assert index.heads.disk_bytes() < 10_000 * 100, "one file's heads at most"
            gc.collect()  # live memory, not cycles the collector has not reached yet
            held.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    assert held[2] - held[0] < 10_000 * 20, f"{held}: grew with 20,000 messages settled"
    assert len(list((tmp_path / "heads").iterdir())) == 0, "unlinked: gone with the process"
    index.close()


@settings(max_examples=60, deadline=None)
@given(
    writes=st.lists(
        st.lists(st.text(alphabet='ab{}"', max_size=40), min_size=1, max_size=8),
        min_size=1,
        max_size=8,
    ),
    data=st.data(),
)
def test_the_head_store_reads_back_what_it_wrote_and_frees_settled_segments(
    writes: list[list[str]], data: st.DataObject
) -> None:
    """Any heads written in any batches (as a list, or joined as a compaction reads
    them) read back in any order, consecutive ones of a segment in one read; a segment
    goes once every head written to it is released."""
    old = head_store.SEGMENT_BYTES
    head_store.SEGMENT_BYTES = 64  # many segments
    try:
        store = head_store.HeadStore()
        places: list[tuple[head_store.Segment, int]] = []
        heads: list[str] = []
        for n, batch in enumerate(writes):
            if n % 2:  # as a compaction writes heads it read joined
                joined = "".join(h + "\0" for h in batch).encode()
                placed = np.cumsum([len(h) + 1 for h in batch], dtype=np.int64)
                seg, first = store.write_joined(joined, placed)
            else:
                seg, first = store.write(batch)
            places += [(seg, first + i) for i in range(len(batch))]
            heads += batch
        order = data.draw(st.permutations(range(len(heads))))
        wanted = sorted(order[: data.draw(st.integers(0, len(heads)))])
        encoded = [h.encode() for h in heads]

        def read(rows: list[int]) -> list[bytes]:
            numbers = np.array([places[i][0].number for i in rows], np.int32)
            positions = np.array([places[i][1] for i in rows], np.int64)
            return head_store.read(numbers, positions, {seg.number: seg for seg, _ in places})

        assert read(wanted) == [encoded[i] for i in wanted]
        assert read(wanted[::-1]) == [encoded[i] for i in wanted[::-1]]
        assert read(list(range(len(heads)))) == encoded
        if places:  # what the row store passes: columns by row, segments by number
            keys, numbers, positions = (np.zeros(1, t) for t in (np.int64, np.int32, np.int32))
            with pytest.raises(IndexError, match="no row at handle 1"):
                read_heads(np.array([1]), keys, numbers, positions, {}, head_store.SPAN_PER_HEAD)
            with pytest.raises(ValueError, match="no head segment 0"):
                read_heads(np.array([0]), keys, numbers, positions, {}, head_store.SPAN_PER_HEAD)
        segments = {seg for seg, _ in places}
        store.release(Counter(seg for seg, _ in places))
        assert store.segments == {store.current} & segments, "all freed but the current"
        store.close()
        assert not store.segments
    finally:
        head_store.SEGMENT_BYTES = old


def test_a_head_write_the_disk_cuts_short_raises_and_counts_none_of_its_heads(
    tmp_path: Path,
) -> None:
    """A write of heads the file system takes only part of (here a file size limit, as
    a full disk does) fails whole: nothing of it is counted, and the next write lands
    where it would have, every head read back as written."""
    import resource

    store = head_store.HeadStore(str(tmp_path))
    seg, _ = store.write(["a" * 100])
    before = (seg.size, len(seg.ends), seg.live)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (seg.size + 50, hard))
    try:
        with pytest.raises(OSError):
            store.write(["b" * 100, "c" * 100])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert (seg.size, len(seg.ends), seg.live) == before, "none of the failed write counted"
    again, at = store.write(["d" * 70, "e"])
    assert (again, at) == (seg, 1)
    segments = {seg.number: seg}
    numbers, places = np.full(3, seg.number, np.int32), np.arange(3, dtype=np.int64)
    assert head_store.read(numbers, places, segments) == [b"a" * 100, b"d" * 70, b"e"]
    store.close()


def test_a_lease_whose_heads_cannot_be_read_answers_503_and_loses_no_pick(
    tmp_path: Path,
) -> None:
    """The core takes a lease's picks out of the index before it reads their heads: when
    the node's disk fails that read, the lease is refused (503), and every pick is
    leasable again once the heads read."""

    async def scenario(broker: Any) -> tuple[Any, list[int]]:
        from dejaq.broker.service import Problem

        segment = broker.indexes["jobs"].heads.current
        heads = os.pread(segment.fd, segment.size, 0)
        os.ftruncate(segment.fd, 0)  # as if the heads' write had been lost
        with pytest.raises(Problem) as refused:
            await broker.lease("jobs", "w", 2, 30_000, 0)
        os.pwrite(segment.fd, heads, 0)
        leased = json.loads(await broker.lease("jobs", "w", 3, 30_000, 0))
        return refused.value, [m["sort_key"] for m in leased]

    refused, keys = on_one_node(tmp_path, scenario)
    assert refused.status == 503 and "jobs: reading heads" in refused.detail
    assert keys == [3, 5, 9], "the refused lease's picks back, in order"


def test_heads_the_leader_cannot_read_are_read_again_from_the_buffer(tmp_path: Path) -> None:
    """The head store is a cache of the buffer's rows: a segment the node's disk fails
    (its file truncated here, through its descriptor, a stand-in for an I/O error) has
    the heads it lost read again from the buffer into a fresh segment. A long poll that
    meets the damage waits for that and leases, in order and with the messages' own
    payloads; the node stays ready."""
    labels = {"topic": "jobs"}

    async def scenario(broker: Any) -> tuple[Any, ...]:
        index = broker.indexes["jobs"]
        await _until(lambda: broker.ready()[0], "the node ready")
        segment = index.heads.current
        os.ftruncate(segment.fd, 0)
        leased = json.loads(await broker.lease("jobs", "w", 3, 30_000, 10_000))
        sample = broker.metrics.registry.get_sample_value
        return (
            leased,
            broker.ready(),
            index.heads.current is not segment,
            sample("dejaq_heads_repaired_total", labels),
            sample("dejaq_heads_unreadable_total", labels),
        )

    leased, ready, retired, repaired, failed = on_one_node(tmp_path, scenario)
    assert [(m["id"], m["sort_key"]) for m in leased] == [("m1", 3), ("m0", 5), ("m2", 9)]
    assert [base64.b64decode(m["payload"]) for m in leased] == [
        b"payload-m1",
        b"payload-m0",
        b"payload-m2",
    ]
    assert ready == (True, "ready")
    assert retired, "no more heads written to the damaged segment"
    assert (repaired, failed) == (3, 0)


def test_heads_neither_the_node_nor_the_buffer_can_read_make_the_node_unready(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A repair that cannot read the buffer either (its files moved away here) is
    counted, makes the node unready, naming the topic, and is logged once however long
    it lasts, as is the damage; a lease waits for it up to its long poll, then is
    refused (503). Once the buffer reads again the heads are repaired, the node leases
    and is ready again."""
    from dejaq.broker.service import Problem

    labels = {"topic": "jobs"}
    bucket = tmp_path / "warehouse" / "buffer" / "jobs" / "bucket=0"
    aside = tmp_path / "aside"

    async def scenario(broker: Any) -> tuple[Any, ...]:
        index = broker.indexes["jobs"]
        sample = broker.metrics.registry.get_sample_value
        await _until(lambda: broker.ready()[0], "the node ready")
        shutil.move(bucket, aside)
        os.ftruncate(index.heads.current.fd, 0)
        with pytest.raises(Problem) as refused:
            await broker.lease("jobs", "w", 3, 30_000, 500)
        await _until(lambda: (sample("dejaq_heads_unreadable_total", labels) or 0) >= 3, "fails")
        unready = broker.ready()
        with pytest.raises(Problem):
            await broker.lease("jobs", "w", 3, 30_000, 0)
        logged = Counter(r.message.split(":")[0] for r in caplog.records if r.levelname == "ERROR")
        shutil.move(aside, bucket)
        leased = json.loads(await broker.lease("jobs", "w", 3, 30_000, 10_000))
        await _until(lambda: broker.ready()[0], "the node ready again")
        return refused.value, unready, logged, [m["id"] for m in leased], broker.ready()

    refused, unready, logged, leased, ready = on_one_node(tmp_path, scenario)
    assert refused.status == 503 and "jobs: reading heads to lease" in refused.detail
    assert not unready[0] and "heads of jobs unreadable on this node" in unready[1], unready
    assert "(FileNotFoundError: " in unready[1], unready
    assert logged == {"jobs": 1, "repairing the heads of jobs failed; retrying": 1}, "once each"
    assert leased == ["m1", "m0", "m2"]
    assert ready == (True, "ready")


def test_a_repair_reads_again_only_the_heads_that_cannot_be_read(tmp_path: Path) -> None:
    """Heads lost past where a segment's file was cut (truncated through its descriptor,
    a stand-in for a disk error) are read again from the buffer, the others stay where
    they are; the damaged segment takes no more writes."""
    _, index, state = loaded_topic(tmp_path, [5, 1, 3, 7])
    before = {m: index.head(m) for m in ("m0", "m1", "m2", "m3")}
    segment = index.heads.current
    assert segment is not None and len(segment.ends) == 4, "a bucket a write"
    place = {
        m: int(index.store.position[index.store.get(m) & index_module.HANDLE_MASK]) for m in before
    }
    os.ftruncate(segment.fd, segment.ends[1])
    lost = sorted(m for m, p in place.items() if p >= 2)
    with pytest.raises(index_module.HeadsUnreadable):
        index.head(lost[0])  # a peek's
    assert index.repairing()
    with pytest.raises(index_module.HeadsUnreadable):
        index.pick_with_heads(state, state.buckets_of("c"), 4, now=0)
    assert index.repair_heads() == 2
    assert not index.repairing()
    assert index.repair_heads() == 0, "nothing left to repair"
    assert index.heads.current is not segment
    kept = {
        m
        for m in before
        if index.store.segment[index.rows[m] & index_module.HANDLE_MASK] == segment.number
    }
    assert kept == set(before) - set(lost), "the readable heads stay where they are"
    picked, taken = index.pick_with_heads(state, state.buckets_of("c"), 4, now=0)
    assert listed(picked) == [("m1", 1, 1), ("m2", 2, 3), ("m0", 0, 5), ("m3", 3, 7)]
    assert list(taken) == [before[m] for m, _, _ in listed(picked)]
    index.close()


def test_reads_of_heads_failing_while_their_repair_runs_are_the_repairs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads that fail on damaged heads while their repair runs (a long poll trying
    again, a peek) are the repair's: it is under way for them until the heads have moved
    (a long poll waits that long), and once they have, the next repair has nothing to
    do, not a failure no head explains that would make the node unready. Spies fail
    such a read at each step of the repair: while it looks for the damaged heads, and
    while it reads them again from the buffer. The segment is truncated through its
    descriptor, a stand-in for a disk error."""
    _, index, state = loaded_topic(tmp_path, [5, 1, 3, 7])
    buckets = state.buckets_of("c")
    under_way: list[bool] = []

    def spied(step: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:  # in the first repair, once a step
            if len(under_way) < 2:
                under_way.append(index.repairing())
                with pytest.raises(index_module.HeadsUnreadable):
                    index.pick_with_heads(state, buckets, 4, now=0)
            return step(*args)

        return run

    monkeypatch.setattr(index, "_unreadable_heads", spied(index._unreadable_heads))
    monkeypatch.setattr(index, "_read_again", spied(index._read_again))
    os.ftruncate(index.heads.current.fd, 0)
    with pytest.raises(index_module.HeadsUnreadable):
        index.pick_with_heads(state, buckets, 4, now=0)
    assert index.repair_heads() == 4
    assert index.repair_heads() == 0, "nothing left to repair"
    assert under_way == [True, True], "the repair under way while its heads fail"
    assert not index.repairing()
    picked, _ = index.pick_with_heads(state, buckets, 4, now=0)
    assert [m for m, _, _ in listed(picked)] == ["m1", "m2", "m0", "m3"]
    index.close()


def test_heads_awaiting_repair_follow_their_rows_renumbered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Messages whose heads wait for a repair that failed (the buffer moved away here,
    its head segments truncated through their descriptors, a stand-in for a disk that
    fails both) keep waiting for it while their rows are renumbered (`shrink`), and get
    their own heads once the buffer reads again."""
    monkeypatch.setattr(row_store_module, "MIN_HANDLES", 8)
    monkeypatch.setattr(row_store_module, "SHRINK_MIN", 1)
    _, index, state = loaded_topic(tmp_path, list(range(40)))
    next(acked_batches(index, state, 30))
    index.forget(state.trim(state.seq))
    before = {m: index.head(m) for m in index.rows}
    for segment in index.heads.segments:
        os.ftruncate(segment.fd, 0)
    buffer, aside = Path(index.buffer_path), tmp_path / "aside"
    shutil.move(buffer, aside)
    with pytest.raises(index_module.HeadsUnreadable):
        index.pick_with_heads(state, state.buckets_of("c"), 100, now=0)
    with pytest.raises(Exception, match="No such file"):
        index.repair_heads()
    handles = len(index.store.batch)
    index.shrink()
    assert len(index.store.batch) < handles, "renumbered"
    shutil.move(aside, buffer)
    assert index.repair_heads() == 10
    picked, taken = index.pick_with_heads(state, state.buckets_of("c"), 100, now=0)
    assert [k for _, _, k in listed(picked)] == list(range(30, 40))
    assert list(taken) == [before[m] for m, _, _ in listed(picked)]
    index.close()


@pytest.mark.parametrize("keys", [[5, 6, 7, 8, 9, 10, 11, 12], [12, 11, 10, 9, 8, 7, 6, 5]])
def test_a_refresh_that_fails_partway_leaves_no_head_counted_live(
    tmp_path: Path, keys: list[int]
) -> None:
    """A refresh reads a version's buckets one after another, writing their heads; when
    one fails (an object store's error, here an unreadable file), the heads the others
    wrote are not counted live, or each failed try would leave segments no message
    holds, never freed. Rows in sort order or not (copied through a scratch store)."""
    warehouse, index, state = loaded_topic(tmp_path, [1, 2, 3, 4])
    fill(warehouse, "jobs", buffer_rows(keys, prefix="n"))
    added = DeltaTable(index.buffer_path).get_add_actions(flatten=True)
    new = [p for p in added.column("path").to_pylist() if p not in index.files]
    last = Path(index.buffer_path, new[-1])  # the last bucket read
    whole = last.read_bytes()
    last.write_bytes(b"not parquet" * 100)
    for _ in range(2):
        with pytest.raises(Exception, match=r"(?i)parquet"):
            index.refresh()
        assert sum(s.live for s in index.heads.segments) == len(index.rows) == 4
    last.write_bytes(whole)
    assert index.refresh() == 8
    assert sum(s.live for s in index.heads.segments) == len(index.rows) == 12
    assert [k for batch in drain(index, state, 12, 0) for k in batch] == [1, 2, 3, 4, *sorted(keys)]


def test_dead_letters_carry_the_buffer_row(tmp_path: Path) -> None:
    warehouse = str(tmp_path / "wh")
    fill(warehouse, "jobs", buffer_rows([4]))
    state = TopicState(4, 5)
    state.touch("c", 0)
    state.lease("c", 0, 100, [("m0", 0, 4)])
    state.reject("c", 1, ["m0"])
    checkpoint(warehouse, "jobs", list(state.events), buffer_names(warehouse))
    dead = scan(ensure_table(warehouse, Table.DEAD_LETTER, "jobs"), Table.DEAD_LETTER)
    assert dead.to_pylist()[0]["payload"] == b"payload-m0"
    assert dead.column("reason").to_pylist() == ["rejected"]


@pytest.mark.parametrize("bad", ["", "x" * 201])
def test_consumer_ids_are_bounded(bad: str) -> None:
    from pydantic import ValidationError

    from dejaq.broker.api.routers.leases import LeaseRequest

    with pytest.raises(ValidationError):
        LeaseRequest(consumer_id=bad)


def test_ack_twice_in_one_batch_and_trim_by_slices() -> None:
    s = one_bucket_state()
    leased(s, "c1", ["a", "b", "c"], now=0)
    assert s.ack("c1", 1, ["a", "a", "b"]) == {"a": Refusal.SETTLED}
    assert s.held[0] == {"c1": 1} and s.totals["acked"] == 2
    assert s.ack("c1", 2, ["c"]) == {}
    assert unpacked_mhs(s.trim(1)) == [mh("a")] and s.trim(1) == b""
    assert unpacked_mhs(s.trim(99)) == mhs(["b", "c"])
    assert s.events == [] and s.settled == {}


@given(
    st.lists(st.text(min_size=1, max_size=8) | st.sampled_from(["\ud800", "x\udfffy"]), max_size=6),
    st.integers(0, 2000),
    st.lists(
        st.integers(-2, 2**54) | st.sampled_from([True, 1.0, "7", None, 2**53 - 1, 2**53]),
        max_size=4,
    ),
)
@settings(max_examples=80, deadline=None)
def test_hot_path_takes_only_what_the_models_accept(ids: list[str], n: int, receipts: list) -> None:
    """The hot path answers a body only if FastAPI's models would accept it as is."""
    from pydantic import ValidationError

    from dejaq.broker.api.hotpath import _ack_args, _lease_args
    from dejaq.broker.api.routers.leases import LeaseRequest, Settle

    for body in ({"consumer_id": "w", "max_messages": n}, {"consumer_id": "w", "wait_ms": n}):
        try:
            model = LeaseRequest(**body)
        except ValidationError:
            assert _lease_args(body) is None
        else:
            assert _lease_args(body) == (
                model.consumer_id,
                model.max_messages,
                model.lease_ms,
                model.wait_ms,
                None,
            )
    body = {"consumer_id": "w", "ids": ids}
    try:
        Settle(**body)
    except ValidationError:
        assert _ack_args(body) is None
    else:
        assert _ack_args(body) == ("w", ids, False)
    body = {"consumer_id": "w", "receipts": receipts}
    taken = _ack_args(body)
    try:
        model = Settle(**body)
    except ValidationError:
        assert taken is None
    else:  # the hot path may leave a body needing coercion (1.0, True) to the models
        assert taken is None or taken == ("w", model.receipts, True) == ("w", receipts, True)
    assert _lease_args({"consumer_id": "w", "extra": 1}) is None
    assert _ack_args({"consumer_id": "w", "ids": ids, "x": 1}) is None
    both = {"consumer_id": "w", "ids": ["a"], "receipts": [1]}
    with pytest.raises(ValidationError, match="either receipts or ids"):
        Settle(**both)
    assert _ack_args(both) is None


@given(
    st.text(max_size=4)
    | st.sampled_from(["w" * 200, "w" * 201, "\x21\x7e", "a b", "\x7f", "é", "\ud800", "\t"]),
    st.sampled_from([None, 0, 1, 43_200_000, 43_200_001, True, 2.0]),
    st.sampled_from([0, 30_000, 30_001, -1, False]),
    st.sampled_from(["absent", None, "r", "r" * 64, "r" * 65, "", "a b", "é", 7, ["r"]]),
)
@settings(max_examples=200, deadline=None)
def test_hot_path_takes_consumer_ids_and_limits_as_the_models_do(
    consumer: str, lease_ms: object, wait_ms: object, request: object
) -> None:
    """The core's checks of a body (`dejaq_core.Bodies`) take a consumer id, a lease
    time and a wait exactly where `LeaseRequest` and `Settle` take them as they are:
    printable ASCII, 1 to 200 characters; the limits at their bounds; no bool for an
    int, no float to coerce. The hot path's own check of a request id, as well: printable
    ASCII, 1 to 64 characters, or null."""
    from pydantic import ValidationError

    from dejaq.broker.api.hotpath import _ack_args, _lease_args
    from dejaq.broker.api.routers.leases import LeaseRequest, Settle

    body = {"consumer_id": consumer, "lease_ms": lease_ms, "wait_ms": wait_ms}
    if request != "absent":
        body["request_id"] = request
    taken = _lease_args(body)
    try:
        model = LeaseRequest(**body)
    except ValidationError:
        assert taken is None
    else:
        exact = type(lease_ms) in (int, type(None)) and type(wait_ms) is int
        given = None if request == "absent" else request
        assert taken == ((consumer, 1, lease_ms, wait_ms, given) if exact else None)
        assert taken is None or taken == (
            model.consumer_id,
            1,
            model.lease_ms,
            model.wait_ms,
            model.request_id,
        )
    ack = {"consumer_id": consumer, "receipts": [0]}
    try:
        Settle(**ack)
    except ValidationError:
        assert _ack_args(ack) is None
    else:
        assert _ack_args(ack) == (consumer, [0], True)


_BODY_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([0, 1, 1000, 2**63, 2**64 - 1, 2**64, 2**54 - 1, "w", "\ud800"])
    | st.floats()
    | st.text(max_size=4),
    lambda inner: st.lists(inner, min_size=1, max_size=3),
    max_leaves=4,
)


@given(
    st.dictionaries(
        st.sampled_from(
            ["consumer_id", "max_messages", "lease_ms", "wait_ms", "request_id", "receipts", "ids"]
        ),
        _BODY_VALUES,
    ),
    st.sampled_from(["utf-8", "utf-16"]),
)
@settings(max_examples=200, deadline=None)
def test_hot_path_reads_a_body_as_json_does_or_leaves_it_to_fastapi(
    body: dict, encoding: str
) -> None:
    """The hot path's parser (orjson) takes a lease or ack body only as `json.loads`
    (FastAPI's) reads it: a body it reads otherwise or refuses (NaN, UTF-16, a lone
    surrogate, an integer past 64 bits) is left to FastAPI."""
    import json

    from dejaq.broker.api.hotpath import _ack_args, _lease_args, _parsed

    raw = json.dumps(body).encode(encoding)
    mine, theirs = _parsed(raw), json.loads(raw)
    past_64_bits = any(
        type(v) is int and not -(2**63) <= v < 2**64 for v in _leaves(theirs)
    )  # orjson reads those as floats
    assert mine is None or mine == theirs or past_64_bits
    for args in (_lease_args, _ack_args):
        assert args(mine) in (None, args(theirs))
    if encoding != "utf-8":
        assert mine is None


def _leaves(value: object) -> list[object]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _leaves(v)]
    if isinstance(value, list):
        return [x for v in value for x in _leaves(v)]
    return [value]


def test_raft_messages_stay_zlib_and_sealed(caplog: pytest.LogCaptureFixture) -> None:
    import os
    import zlib

    from cryptography.exceptions import InvalidTag
    from pysyncobj.encryptor import getEncryptor

    from dejaq.broker.state.raft import AeadEncryptor, _RaftZlib

    for size in (0, 100, 70_000):
        data = os.urandom(size)
        assert zlib.decompress(_RaftZlib.compress(data, 3)) == data
    a, b = AeadEncryptor("pw"), AeadEncryptor("other")
    token = a.encrypt_at_time(b"hello", 42)
    assert a.extract_timestamp(token) == 42 and a.decrypt(token) == b"hello"
    with pytest.raises(InvalidTag):
        b.decrypt(token)
    with pytest.raises(InvalidTag):  # the timestamp is authenticated too
        a.decrypt((43).to_bytes(8, "big") + token[8:])
    nonces = [int.from_bytes(a.encrypt_at_time(b"x", 1)[8:20], "big") for _ in range(3)]
    assert [n - nonces[0] for n in nonces] == [0, 1, 2], "counted, never repeated"
    assert "another broker.raft_password" in caplog.text
    caplog.clear()
    with pytest.raises(InvalidTag):  # PySyncObj's own format, as older brokers send it
        AeadEncryptor("pw").decrypt(getEncryptor("pw").encrypt_at_time(b"hello", 42))
    assert "Fernet wire format" in caplog.text


class NoIdsProbingTheLock(set[str]):
    """An empty set of settled ids that counts, at each membership test (the per-row
    work a refresh or a walk does), whether `lock` was held then."""

    def __init__(self, lock: threading.Lock) -> None:
        super().__init__()
        self.lock = lock
        self.held: Counter[bool] = Counter()

    def __contains__(self, mid: object) -> bool:
        self.held[self.lock.locked()] += 1
        return False


def test_index_row_work_and_walks_run_outside_its_lock(tmp_path: Path) -> None:
    """The event loop takes the index lock for every lease and every applied Raft command:
    a refresh or `stats` may hold it for C-level inserts and copies, not for per-row work
    (here each row's settled check, made while the test alone runs the index)."""
    warehouse = str(tmp_path / "wh")
    before_ms = int(time.time() * 1000)
    fill(warehouse, "jobs", buffer_rows([1, 2, 3], prefix="a"))
    index = TopicIndex(warehouse, topic_conf())
    index.load()
    fill(warehouse, "jobs", buffer_rows([i % 100 for i in range(50_000)], prefix="b"))
    settled = NoIdsProbingTheLock(index.lock)
    assert index.refresh(settled) == 50_000
    assert settled.held == {False: 50_000}, "each new row checked, none under the lock"
    state = TopicState(4, 5)
    state.settled = settled = NoIdsProbingTheLock(index.lock)  # type: ignore[assignment]
    stats, delayed = index.stats(state, now=0)
    assert sum(s.pending for s in stats.values()) == 50_003 and delayed == 0
    assert settled.held == {False: 50_003}, "each row walked, none under the lock"
    oldest = min(s.oldest_ingested_ms for s in stats.values() if s.oldest_ingested_ms)
    assert before_ms - 1000 < oldest <= time.time() * 1000, "ingestion times kept to the second"


class _NoIndex:
    """A Raft node's listener with no index to tell."""

    def pending(self, topic: str, state: TopicState, handles: list[int]) -> None: ...
    def gone(self, topic: str, handles: bytes) -> None: ...
    def reset(self, states: dict[str, TopicState]) -> None: ...


def _raft_nodes(tmp_path: Path) -> list:
    """Three real Raft nodes (PySyncObj over TCP), not yet attached to a loop."""
    from dejaq.broker.state.raft import RaftNode
    from dejaq.conf.settings import BrokerConfig
    from dejaq.jobs.ports import free_port

    topic = TopicConfig(name="t", kind="priority", source=["t-in"], buckets=4)
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    return [
        RaftNode(
            a,
            [p for p in addrs if p != a],
            [topic],
            BrokerConfig(raft_password="pw"),
            tmp_path / f"n{i}",
            _NoIndex(),
        )
        for i, a in enumerate(addrs)
    ]


async def _until(condition: Callable[[], object], what: str, step: float = 0.005) -> None:
    """Wait on the running loop for `condition`, for at most 30 s."""
    import asyncio

    deadline = asyncio.get_running_loop().time() + 30
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"no {what} within 30 s"
        await asyncio.sleep(step)


def picks_counted(index: Any) -> list[int]:
    """A spy on `index`'s picks: the list gets an entry at each pick a poll makes, for a
    test to wait on a poll's first pass and count the passes after it."""
    picks: list[int] = []
    pick = index.pick_with_heads

    def counted(*args: Any) -> Any:
        picks.append(1)
        return pick(*args)

    index.pick_with_heads = counted
    return picks


async def _leader_once_attached(nodes: list) -> Any:
    """Run the nodes on the running loop; their leader, once they elect one."""
    import asyncio

    for node in nodes:
        node.attach(asyncio.get_running_loop())
    await _until(lambda: any(n.is_leader() for n in nodes), "leader")
    return next(n for n in nodes if n.is_leader())


def test_the_next_group_is_sent_before_the_leader_applies_the_last(tmp_path: Path) -> None:
    """Three real Raft nodes (PySyncObj over TCP, in one event loop). A command waiting
    while another is in flight is in the leader's log by the time the leader applies
    the first: the followers get it while the leader applies (`RaftNode._all_committed`).
    """
    import asyncio

    nodes = _raft_nodes(tmp_path)
    in_log_at_apply: dict[str, int] = {}

    async def scenario() -> list:
        leader = await _leader_once_attached(nodes)
        await leader.commit("t", "touch", "warm-up", 0)
        state, sync = leader.state.topics["t"], leader.sync
        touch = state.touch

        def recording(consumer: str, now: int) -> bool:
            ahead = sync._SyncObj__getCurrentLogIndex() - sync._SyncObj__raftLastApplied
            in_log_at_apply[consumer] = ahead  # 1: only this entry; 2: the next one too
            return touch(consumer, now)

        state.touch = recording
        first = asyncio.ensure_future(leader.commit("t", "touch", "a", 1))
        await _until(lambda: leader._uncommitted, "group in flight", step=0)  # a loop turn
        second = asyncio.ensure_future(leader.commit("t", "touch", "b", 2))
        return await asyncio.gather(first, second)

    try:
        assert asyncio.run(scenario()) == [True, True]  # both joined, in order
    finally:
        for node in nodes:
            node.destroy()
    assert in_log_at_apply == {"a": 2, "b": 1}


def test_a_command_that_waited_out_its_commit_timeout_for_an_entry_is_never_logged(
    tmp_path: Path,
) -> None:
    """Three real Raft nodes. A command still waiting for a log entry COMMIT_TIMEOUT_S
    after it arrived (groups ahead of it slow to commit) fails and is not sent: its caller
    was told it did not commit, and its time stamp, logged later, could fall below a
    retention run's watermark made meanwhile (`STAMPED_WITHIN_MS`). Its arrival is set
    back by hand here, as a Raft slow for seconds would leave it."""
    import asyncio

    from dejaq.broker.state import raft

    nodes = _raft_nodes(tmp_path)

    async def scenario() -> set[str]:
        leader = await _leader_once_attached(nodes)
        await leader.commit("t", "touch", "warm-up", 0)
        loop = asyncio.get_running_loop()
        stale: asyncio.Future = loop.create_future()
        arrived = loop.time() - raft.COMMIT_TIMEOUT_S
        leader._pending.append((("t", "touch", ("stale", 1)), stale, arrived))
        assert await leader.commit("t", "touch", "fresh", 2) is True
        with pytest.raises(raft.NotCommitted, match="waiting for a Raft log entry"):
            await stale
        await leader.commit("t", "touch", "after", 3)
        return set(leader.state.topics["t"].consumers)

    try:
        consumers = asyncio.run(scenario())
    finally:
        for node in nodes:
            node.destroy()
    assert consumers == {"warm-up", "fresh", "after"}, "the stale command never applied"


def test_a_retention_run_keeps_its_cutoff_back_by_what_a_command_in_flight_may_carry(
    tmp_path: Path,
) -> None:
    """With `settled_retention_ms` 0, a run's cutoff is still `STAMPED_WITHIN_MS` back:
    a command stamped before the run asked and logged after it would otherwise put its
    event below the watermark, where no start or run reads: its message's row would stay
    in the buffer for good, pending again at the next start. Acks just made stay."""
    import asyncio

    from dejaq.broker.service import now_ms
    from dejaq.broker.state.raft import STAMPED_WITHIN_MS
    from dejaq.pipelines.retention import watermark

    async def scenario(broker: Any) -> tuple[int, int, int]:
        leased = json.loads(await broker.lease("jobs", "w", 3, 60_000, 0))
        await broker.settle("jobs", "ack", "w", [m["id"] for m in leased])
        st = broker.state("jobs")
        await _until(lambda: st.trimmed_upto() >= st.seq, "the acks checkpointed")
        cfg = broker.topics["jobs"].model_copy(update={"settled_retention_ms": 0})
        before = now_ms()
        await asyncio.to_thread(broker._retain, "jobs", cfg)
        buffer = DeltaTable(broker.indexes["jobs"].buffer_path)
        return before, watermark(buffer), scan(buffer, Table.BUFFER).num_rows

    before, upto, rows = on_one_node(tmp_path, scenario)
    assert upto < before - STAMPED_WITHIN_MS + 5_000, "the cutoff is STAMPED_WITHIN_MS back"
    assert rows == 3, "messages acked within STAMPED_WITHIN_MS stay in the buffer"


def test_a_new_leader_answers_only_once_it_applied_the_last_terms_commits(
    tmp_path: Path,
) -> None:
    """Three real Raft nodes. The leader commits a lease and stops before a heartbeat
    tells the followers it committed; one of them is elected. PySyncObj calls it leader
    at once, before it applies the lease (it learns of the commit with its own first
    entry's): an ack by id read from that state would be refused as not leased. The
    leader-only routes' gate (`on_leader`) lets a request through only once the lease is
    applied."""
    import asyncio
    from types import SimpleNamespace

    from dejaq.broker.api.dependencies import on_leader

    nodes = _raft_nodes(tmp_path)
    elected: dict[str, Any] = {}

    def watch(node: Any) -> None:
        become = node.sync._SyncObj__onBecomeLeader

        def became() -> None:
            become()
            st = node.state.topics["t"]
            elected["at once"] = (node.leading(), st.receipts_of(["m"]))
            gate = on_leader(SimpleNamespace(headers={}), SimpleNamespace(raft=node))
            gated = asyncio.ensure_future(gate)
            gated.add_done_callback(lambda _: elected.setdefault("gated", st.receipts_of(["m"])))

        node.sync._SyncObj__onBecomeLeader = became

    async def scenario() -> None:
        leader = await _leader_once_attached(nodes)
        await leader.commit("t", "touch", "c", 0)
        followers = [n for n in nodes if n is not leader]
        await _until(lambda: all(f.leader() == leader.raft_addr for f in followers), "followers")
        leader.sync.conf.appendEntriesPeriod = 3600.0  # no heartbeat carries the next commit
        picks = packed([("m", 0, 1)])
        await leader.commit("t", "lease", "c", 1, 60_000, picks, None, True, None)
        leader.detach()
        for follower in followers:
            watch(follower)
        await _until(lambda: "gated" in elected, "a new leader through the gate")

    try:
        asyncio.run(scenario())
    finally:
        for node in nodes:
            node.destroy()
    leading, receipts = elected["at once"]
    assert (leading, receipts) == (False, ([], {"m": Refusal.NOT_LEASED})), "not applied yet"
    assert elected["gated"] == ([1 << POSITION_BITS], {}), "the lease, applied before an answer"


def test_a_command_that_raises_fails_alone_and_the_log_goes_on(tmp_path: Path) -> None:
    """Three real Raft nodes. A command on a topic no node configures (a leader started
    with a topic its followers lack) raises on every node: that is its result, by the
    duties' path (`committed`) and by the group path, and every node applies the
    entries after it. Raised out of the apply, PySyncObj applies the failing entry
    again at each tick and never the next: the node's state stops there."""
    import asyncio

    from dejaq.broker.state.raft import committed

    nodes = _raft_nodes(tmp_path)

    def by_duties(leader: Any) -> BaseException | None:
        try:
            committed(leader.state.command, "gone", "touch", ("c", 0), timeout=10)
        except KeyError as e:
            return e
        return None

    async def scenario() -> tuple[BaseException | None, BaseException | None]:
        leader = await _leader_once_attached(nodes)
        duties = await asyncio.to_thread(by_duties, leader)
        grouped = None
        try:
            await leader.commit("gone", "touch", "c", 1)
        except KeyError as e:
            grouped = e
        assert await leader.commit("t", "touch", "after", 2) is True
        await _until(
            lambda: all("after" in n.state.topics["t"].consumers for n in nodes), "every node"
        )
        return duties, grouped

    try:
        duties, grouped = asyncio.run(scenario())
    finally:
        for node in nodes:
            node.destroy()
    assert "no topic 'gone'" in str(duties) and "no topic 'gone'" in str(grouped)


class _Panic(BaseException):
    """Stands in for PyO3's PanicException, a BaseException, which no input here raises
    from the core."""


def test_what_a_command_raises_is_its_result_a_panic_and_a_malformed_command_too() -> None:
    """In a group commit and alone, a failing command's result is what it raised, and
    the commands after it apply; only an interrupt stops the group."""
    node = BrokerState([topic_conf(buckets=1)], 5, _NoIndex())
    applied = node._apply

    def panicking(topic: str, op: str, args: tuple) -> Any:
        if op == "pause":
            raise _Panic("the core panicked")
        if op == "purge":
            raise KeyboardInterrupt
        return applied(topic, op, args)

    node._apply = panicking  # type: ignore[method-assign]
    results = node.batch(
        [
            ("jobs", "touch", ("a", 0)),
            "not a command",
            ("jobs", "pause", (True,)),
            ("jobs", "touch", ("b", 0)),
        ],
        _doApply=True,
    )
    assert results[0] is True and results[3] is True
    assert isinstance(results[1], TypeError) and isinstance(results[2], _Panic)
    assert set(node.topics["jobs"].consumers) == {"a", "b"}
    assert isinstance(node.command("jobs", "pause", (True,), _doApply=True), _Panic)
    with pytest.raises(KeyboardInterrupt):
        node.batch([("jobs", "purge", ())], _doApply=True)


def test_the_leader_applies_its_own_commands_unpickled_by_the_followers_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three real Raft nodes. The leader applies a command it appended from the object
    it pickled (its lease record holds the very id list the lease sent), the followers
    from their unpickled copy, and all three reach the same state. A command that cannot
    be pickled fails alone: a command appended next, not through `own`, is applied as
    itself. So is one another thread appends while the loop's call is noted (the
    leader's duties: expiry, trims)."""
    import asyncio
    import threading

    from dejaq.broker.state import raft

    monkeypatch.setattr(raft, "COMMIT_TIMEOUT_S", 0.5)
    nodes = _raft_nodes(tmp_path)
    mids = [f"m{i}" for i in range(BULK_MIN)]
    mistaken: list[str] = []

    def joined(*names: str) -> bool:
        return all(set(names) <= n.state.topics["t"].consumers.keys() for n in nodes)

    picks = packed([(m, 0, i) for i, m in enumerate(mids)])

    async def scenario() -> tuple:
        leader = await _leader_once_attached(nodes)
        await leader.commit("t", "touch", "c", 0)
        lease = await leader.commit("t", "lease", "c", 1, 60_000, picks, None, True, None)
        with pytest.raises(raft.NotCommitted):
            await leader.commit("t", "touch", lambda: "no pickle", 2)
        leader.state.command("t", "touch", ("direct", 2), callback=None)  # not noted as own
        with leader.sync.own(lambda: mistaken.append("the loop's call")):
            args = ("t", "touch", ("duties", 2))
            other = threading.Thread(
                target=leader.state.command, args=args, kwargs={"callback": None}
            )
            other.start()
            other.join()
        await _until(lambda: joined("direct", "duties") or mistaken, "the commands not own")
        acked = await leader.commit("t", "ack", "c", 3, [], [lease.receipt(1)])
        await _until(lambda: all(n.state.topics["t"].seq == 1 for n in nodes), "ack applied")
        return leader, lease, acked

    try:
        leader, lease, acked = asyncio.run(scenario())
    finally:
        for node in nodes:
            node.destroy()
    assert lease.handles == picks[0]
    assert mistaken == [], "another thread's command was applied as the loop's call"
    assert acked == {} and leader.sync._own == {}
    for node in nodes:
        record = node.state.topics["t"].records[lease.lid]
        assert record_ids(record) == mids and record.ended[:3] == bytes([0, ACKED, 0])


def test_a_configure_command_brings_every_node_to_the_same_buckets_and_max_deliveries(
    tmp_path: Path,
) -> None:
    """Three real Raft nodes whose own configurations differ, as when one replays its
    journal with a changed file while the others load snapshots: the leader's `configure`
    gives all three its values at one point of the log, and the same assignment."""
    import asyncio

    from dejaq.broker.state.raft import RaftNode
    from dejaq.conf.settings import BrokerConfig
    from dejaq.jobs.ports import free_port

    addrs = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    configs = [(8, 2), (4, 5), (4, 5)]  # (buckets, max_deliveries) in each node's file
    nodes = [
        RaftNode(
            a,
            [p for p in addrs if p != a],
            [TopicConfig(name="t", kind="priority", source=["t-in"], buckets=buckets)],
            BrokerConfig(raft_password="pw", max_deliveries=max_deliveries),
            tmp_path / f"n{i}",
            _NoIndex(),
        )
        for i, (a, (buckets, max_deliveries)) in enumerate(zip(addrs, configs, strict=True))
    ]

    def states() -> list[tuple]:
        return [
            (t.buckets, t.max_deliveries, t.configured, t.assignment)
            for t in (n.state.topics["t"] for n in nodes)
        ]

    async def scenario() -> list[tuple]:
        leader = await _leader_once_attached(nodes)
        assert await leader.commit("t", "configure", 8, 2) is (leader is not nodes[0])
        for i, consumer in enumerate(("a", "b", "c")):
            await leader.commit("t", "touch", consumer, i)
        await _until(lambda: all(len(set(s[3].values())) == 3 for s in states()), "touches")
        return states()

    try:
        first, *others = asyncio.run(scenario())
    finally:
        for node in nodes:
            node.destroy()
    assert first[:3] == (8, 2, True) and sorted(first[3]) == list(range(8))
    assert others == [first, first]


def test_a_restarted_leader_commits_the_buckets_and_max_deliveries_its_snapshot_lacks(
    tmp_path: Path,
) -> None:
    """A node snapshots its state at 16 buckets and 5 deliveries, then restarts with 32
    and 2. Its snapshot's values would stay (the buckets the ingest now fills from 16 on
    assigned to nobody, a silent stall): the leader's duties commit its configuration,
    and a message in bucket 20 is leased, then dead after its second delivery."""

    from dejaq.conf.settings import BrokerConfig, Settings
    from dejaq.jobs.ports import free_port

    warehouse = str(tmp_path / "warehouse")
    fill(warehouse, "jobs", buffer_rows([5], lambda i: 0))
    raft, dump = f"127.0.0.1:{free_port()}", tmp_path / "node" / "raft.dump"

    def run(buckets: int, max_deliveries: int, scenario: Callable[[Any], Awaitable[T]]) -> T:
        settings = Settings(
            warehouse=warehouse,
            topics=[topic_conf(buckets=buckets)],
            broker=BrokerConfig(max_deliveries=max_deliveries),
        )
        return run_node(settings, raft, tmp_path / "node", scenario)

    async def snapshotted(broker: Any) -> tuple[int, int]:
        await _until(lambda: broker.state("jobs").configured, "the first configure")
        await broker.raft.commit("jobs", "touch", "w", int(time.time() * 1000))
        broker.raft.sync.forceLogCompaction()
        await _until(dump.exists, "a snapshot")
        return broker.state("jobs").buckets, broker.state("jobs").max_deliveries

    async def restarted(broker: Any) -> tuple[list, list, list]:
        st = broker.state("jobs")
        await _until(lambda: st.buckets == 32, "the new buckets committed")
        leased = json.loads(await broker.lease("jobs", "w", 10, 30_000, 5_000))
        _, dead = await broker.raft.commit("jobs", "nack", "w", int(time.time() * 1000), ["n0"])
        again = json.loads(await broker.lease("jobs", "w", 10, 30_000, 5_000))
        _, died = await broker.raft.commit("jobs", "nack", "w", int(time.time() * 1000), ["n0"])
        assert st.max_deliveries == 2 and sorted(st.assignment) == list(range(32))
        return [(m["id"], m["bucket"]) for m in leased], [m["id"] for m in again], [dead, died]

    assert run(16, 5, snapshotted) == (16, 5)
    fill(warehouse, "jobs", buffer_rows([1], lambda i: 20, prefix="n"))  # ingest at 32
    leased, again, deaths = run(32, 2, restarted)
    assert sorted(leased) == [("m0", 0), ("n0", 20)]
    assert again == ["n0"] and deaths == [[], [mh("n0")]], "dead after 2 deliveries, not 5"


def test_a_topic_a_nodes_file_lacks_is_kept_in_its_state_and_snapshot_from_its_configure(
    tmp_path: Path,
) -> None:
    """Three real Raft nodes; the third's file lacks topic `t2` (added in a rolling
    restart, that node not restarted yet). The leader's `configure` gives it t2's state,
    so it applies t2's lease and ack too, and its snapshot carries them: restarted with
    t2 in its file, it holds what the others hold (not a fresh t2 missing the commands
    its snapshot covers) and applies the next ack alike. A command on a topic no
    `configure` named is still refused."""
    import asyncio

    from dejaq.broker.state.raft import RaftNode
    from dejaq.conf.settings import BrokerConfig
    from dejaq.jobs.ports import free_port

    t1, t2 = (TopicConfig(name=n, kind="priority", source=["in"], buckets=2) for n in ("t", "t2"))
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(3)]

    def node(i: int, topics: list[TopicConfig]) -> RaftNode:
        peers = [p for p in addrs if p != addrs[i]]
        conf = BrokerConfig(raft_password="pw")
        return RaftNode(addrs[i], peers, topics, conf, tmp_path / f"n{i}", _NoIndex())

    nodes = [node(0, [t1, t2]), node(1, [t1, t2]), node(2, [t1])]

    def view(n: RaftNode) -> tuple | None:
        st = n.state.topics.get("t2")
        if st is None:
            return None
        return st.configured, st.seq, dict(st.totals), leased_ids(st), settled_of(st)

    def applied(n: RaftNode, leader: RaftNode) -> bool:
        return n.sync._SyncObj__raftLastApplied >= leader.commit_index()

    async def scenario() -> list:
        leader = await _leader_once_attached(nodes)
        await leader.commit("t2", "configure", 2, 5)
        await leader.commit("t2", "touch", "w", 0)
        picks = packed([(f"m{i}", 0, i) for i in range(3)])
        await leader.commit("t2", "lease", "w", 1, 600_000, picks, None, True, None)
        await leader.commit("t2", "ack", "w", 2, ["m0"])
        await _until(lambda: all(applied(n, leader) for n in nodes), "every node applied")
        lacking = nodes[2]
        lacking.sync.forceLogCompaction()
        await _until((tmp_path / "n2" / "raft.dump").exists, "a snapshot")
        lacking.detach()
        lacking.destroy()
        # Its accepted connections stay in FIN-WAIT-2, holding its port, until the other
        # nodes (on this loop) read their ends' close and close them too.
        await _until(lambda: bindable(addrs[2]), "its Raft port free")
        nodes[2] = node(2, [t1, t2])
        nodes[2].attach(asyncio.get_running_loop())
        await _until(lambda: any(n.leading() for n in nodes), "a leader")
        leader = next(n for n in nodes if n.leading())
        await leader.commit("t2", "ack", "w", 3, ["m1"])
        await _until(lambda: all(applied(n, leader) for n in nodes), "every node applied")
        with pytest.raises(KeyError, match="no topic 't3'"):
            await leader.commit("t3", "touch", "w", 4)
        return [view(n) for n in nodes]

    try:
        views = asyncio.run(scenario())
    finally:
        for n in nodes:
            n.destroy()
    assert views[0] == views[1] == views[2], views
    assert views[0] == (
        True,
        2,
        {"leased": 3, "acked": 2},
        {"m2"},
        dict.fromkeys(["m0", "m1"], "acked"),
    )


def test_a_leader_configures_a_topic_before_its_first_command(tmp_path: Path, monkeypatch) -> None:
    """A new leader may serve a request on a topic before its duties configure it: the
    request's command then follows a `configure`, which a node whose file lacks the topic
    takes its state from (it would refuse the command alone, before it)."""
    from dejaq.broker.service import Broker
    from dejaq.conf.settings import Settings
    from dejaq.jobs.ports import free_port

    monkeypatch.setattr(Broker, "_leader_duties", lambda self: None)
    warehouse = str(tmp_path / "warehouse")
    fill(warehouse, "jobs", buffer_rows([5], lambda i: 0))
    settings = Settings(warehouse=warehouse, topics=[topic_conf(buckets=2)])

    async def scenario(broker: Any) -> tuple[bool, list]:
        leased = json.loads(await broker.lease("jobs", "w", 10, 30_000, 0))
        st = broker.state("jobs")
        return st.configured, [m["id"] for m in leased]

    raft = f"127.0.0.1:{free_port()}"
    assert run_node(settings, raft, tmp_path / "node", scenario) == (True, ["m0"])


def test_a_node_alone_commits_without_waiting_for_the_periodic_tick(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A one-node cluster (a laptop, a notebook) answers a command in the loop turns
    that follow it, on the broker's uvloop: with the periodic tick an hour away, commits
    still complete."""
    import asyncio

    import uvloop

    from dejaq.broker.state import raft
    from dejaq.conf.settings import BrokerConfig
    from dejaq.jobs.ports import free_port

    topic = TopicConfig(name="t", kind="priority", source=["t-in"], buckets=4)
    node = raft.RaftNode(
        f"127.0.0.1:{free_port()}", [], [topic], BrokerConfig(), tmp_path / "n", _NoIndex()
    )

    async def scenario() -> list[bool]:
        node.attach(asyncio.get_running_loop())
        await _until(node.is_leader, "leadership")
        await node.commit("t", "touch", "warm-up", 0)
        monkeypatch.setattr(raft, "TICK_PERIOD_S", 3600.0)  # once the one due now has run
        return [await asyncio.wait_for(node.commit("t", "touch", f"c{i}", i), 5) for i in range(3)]

    try:
        assert uvloop.run(scenario()) == [True, True, True]
    finally:
        node.destroy()


def test_raft_ticks_and_socket_events_that_keep_failing_are_logged_once_a_streak(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A Raft tick runs at every event of the loop, and a socket event PySyncObj fails
    to handle fails again as long as its socket stays readable: a traceback each would
    flood the node's log. Each kind of error is logged once a streak, and the streak's
    end at WARNING. Stand-ins fail them (a real one needs a damaged disk or a peer in a
    state PySyncObj does not expect); the node, its loop and its sockets are real."""
    import asyncio
    import socket

    from dejaq.broker.state import raft
    from dejaq.conf.settings import BrokerConfig
    from dejaq.jobs.ports import free_port

    topic = TopicConfig(name="t", kind="priority", source=["t-in"], buckets=4)
    node = raft.RaftNode(
        f"127.0.0.1:{free_port()}", [], [topic], BrokerConfig(), tmp_path / "n", _NoIndex()
    )
    kinds = [OSError(28, "No space left on device"), ValueError("torn entry")]
    failed = Counter[str]()

    def failing_tick(timeToWait: float = 0.0) -> None:
        error = kinds[sum(failed.values()) // 20 % 2]
        failed[type(error).__name__] += 1
        raise error

    async def scenario() -> None:
        node.attach(asyncio.get_running_loop())
        await _until(node.is_leader, "leadership")
        node.sync.doTick = failing_tick
        await _until(lambda: sum(failed.values()) >= 60, "ticks failing", step=0.05)
        del node.sync.doTick
        await node.commit("t", "touch", "w", 0)  # Raft runs again
        readable, writer = socket.socketpair()
        handled: list[bytes] = []

        def event(fd: int, _: int) -> None:
            if failed["event"] < 50:
                failed["event"] += 1
                raise RuntimeError("a connection in a state PySyncObj does not expect")
            handled.append(readable.recv(1))

        node.poller.subscribe(readable.fileno(), event, raft.POLL_EVENT_TYPE.READ)
        writer.send(b"x")  # readable until read: its event fires again and again
        await _until(lambda: handled, "the socket's event handled")
        node.poller.unsubscribe(readable.fileno())
        readable.close()
        writer.close()

    try:
        with caplog.at_level(logging.WARNING, "dejaq.broker.state.raft"):
            asyncio.run(scenario())
    finally:
        node.destroy()
    raft_lines = [r for r in caplog.records if r.getMessage().startswith("Raft ")]
    said = [(r.levelname, re.sub(r"\d+ s$", "N s", r.getMessage())) for r in raft_lines]
    assert said == [
        ("ERROR", "Raft tick failed; retrying"),
        ("ERROR", "Raft tick failed; retrying"),
        ("WARNING", "Raft tick works again after N s"),
        ("ERROR", "Raft socket event failed; retrying"),
        ("WARNING", "Raft socket event works again after N s"),
    ], said
    errors = [type(r.exc_info[1]).__name__ for r in raft_lines if r.exc_info]
    assert errors == ["OSError", "ValueError", "RuntimeError"], "each with its traceback"


def test_a_raft_connection_dropped_with_bytes_to_send_is_torn_down_whole() -> None:
    """PySyncObj's disconnect closes a connection's socket, then unsubscribes it from the
    poller. A connection still watched for writing (a peer restarting while the leader
    had entries to send it) must be torn down whole: state disconnected, its callback
    told, the loop no longer watching the fd, so that the transport dials its peer again.
    A real connection over a real socket, on the node's poller and a real loop."""
    import asyncio
    import socket

    from pysyncobj.tcp_connection import CONNECTION_STATE, TcpConnection

    from dejaq.broker.state import raft

    async def scenario() -> tuple[Any, list[int], bool]:
        loop = asyncio.get_running_loop()
        poller = raft.LoopPoller()
        poller.attach(loop, lambda: None)
        ours, theirs = socket.socketpair()
        told: list[int] = []
        conn = TcpConnection(poller, onDisconnected=lambda: told.append(1), socket=ours)
        fd = conn.fileno()
        conn.disconnect()  # watched for reading and writing: as accepted, bytes unsent
        theirs.close()
        return conn.state, told, fd in {key.fd for key in loop._selector.get_map().values()}

    state, told, watched = asyncio.run(scenario())
    assert state == CONNECTION_STATE.DISCONNECTED and told == [1], "torn down whole"
    assert not watched, "the loop no longer watches its fd"


def test_a_tick_past_the_election_deadline_reads_the_heartbeats_waiting_first(
    tmp_path: Path,
) -> None:
    """A follower's process can stop anywhere, also inside a tick after it read the clock:
    then the tick finds the election deadline passed while the leader's heartbeats sit
    unread in its sockets. The tick must read them before it starts an election. Here the
    follower's loop stops watching its sockets and ticking until its deadline has passed
    and a heartbeat waits; then one tick runs, as the first after such a stop would."""
    import asyncio

    from pysyncobj.monotonic import monotonic as raft_clock  # PySyncObj's deadlines

    nodes = _raft_nodes(tmp_path)

    async def scenario() -> tuple[int, tuple[int, str], tuple[int, str], int]:
        loop = asyncio.get_running_loop()
        for node in nodes:
            node.attach(loop)
        await _until(lambda: any(n.is_leader() for n in nodes), "leader")
        leader = next(n for n in nodes if n.is_leader())
        stalled = next(n for n in nodes if not n.is_leader())
        await leader.commit("t", "touch", "warm-up", 0)
        await _until(lambda: stalled.leader() == leader.raft_addr, "a follower of the leader")
        term, before = leader.term(), (stalled.term(), stalled.role())
        stalled.detach()
        sync = stalled.sync
        await _until(
            lambda: (
                sync._SyncObj__raftElectionDeadline < raft_clock() and stalled.poller.readable()
            ),
            "the deadline passed with a heartbeat waiting",
        )
        sync.doTick(0)
        after = (stalled.term(), stalled.role())
        stalled.attach(loop)
        await leader.commit("t", "touch", "after", 1)
        return term, before, after, leader.term()

    try:
        term, before, after, term_after = asyncio.run(scenario())
    finally:
        for node in nodes:
            node.destroy()
    assert before == (term, "follower")
    assert after == before, "the follower started an election"
    assert term_after == term, "the leader was deposed"


def _mostly_settled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[TopicIndex, TopicState, list[str]]:
    """An index of 400 messages in segments of ~20 heads, all but every 25th leased,
    acked and forgotten: mostly settled segments, kept by the few left (returned),
    moved as soon as they are seen so (no `SETTLE_S`)."""
    monkeypatch.setattr(head_store, "SEGMENT_BYTES", 4096)
    monkeypatch.setattr(head_store, "SETTLE_S", 0.0)
    warehouse = str(tmp_path / "wh")
    fill(warehouse, "jobs", buffer_rows([i % 50 for i in range(400)]))
    index = TopicIndex(warehouse, topic_conf(), str(tmp_path / "heads"))
    index.load()
    state = TopicState(4, 5)
    state.touch("c", 0)
    keep = sorted(f"m{i}" for i in range(0, 400, 25))
    picks = listed(index.pick(state, state.buckets_of("c"), 1000, now=0))
    granted = grants(state.lease("c", 0, 10_000, [p for p in picks if p[0] not in keep]))
    index.release(state, packed(picks))
    assert state.ack("c", 1, [g[0] for g in granted]) == {}
    index.forget(state.trim(state.seq))
    return index, state, keep


def test_mostly_settled_segments_are_compacted_and_their_messages_lease_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A few long-pending messages do not keep whole segments of settled ones on disk:
    their heads move, and they lease in order with the same JSON as before."""
    index, state, keep = _mostly_settled(tmp_path, monkeypatch)
    before = {mid: index.head(mid) for mid in keep}
    assert index.heads.sparse(), "mostly settled segments, kept by a few messages"
    disk = index.heads.disk_bytes()
    # The segment that was current is compacted once the moved heads have filled another.
    moved = [index.compact_heads() for _ in range(3)]
    assert len(keep) <= sum(moved) <= 2 * len(keep) and moved[-1] == 0, moved
    assert not index.heads.sparse() and index.heads.disk_bytes() < disk / 4
    assert {mid: index.head(mid) for mid in keep} == before
    picked, taken = index.pick_with_heads(state, state.buckets_of("c"), 1000, now=2)
    again = listed(picked)
    assert sorted(p[0] for p in again) == sorted(keep), "each once, none lost"
    assert [json.loads(h + b"}")["id"] for _, h in taken] == [p[0] for p in again]
    for bucket in range(4):
        keys = [p[2] for p in again if p[1] == bucket]
        assert keys == sorted(keys), "in order within each bucket"
    index.close()


def test_a_compaction_moves_a_bounded_number_of_bytes_per_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backlog drained evenly leaves every segment sparse at once: a round moves at
    most COMPACT_BYTES of heads in one write, and the rounds after move the rest, each
    message's head as it was."""
    index, state, keep = _mostly_settled(tmp_path, monkeypatch)
    before = {mid: index.head(mid) for mid in keep}
    largest = max(len(head) + 1 for _, head in before.values())
    monkeypatch.setattr(index_module, "COMPACT_BYTES", 3 * largest)
    writes: list[int] = []
    write = index.heads.write_joined

    def counted(joined: bytes, ends: np.ndarray) -> tuple:
        writes.append(len(joined))
        return write(joined, ends)

    monkeypatch.setattr(index.heads, "write_joined", counted)
    disk = index.heads.disk_bytes()
    moved = [index.compact_heads() for _ in range(20)]
    assert writes and max(writes) <= 3 * largest, writes
    assert len(keep) <= sum(moved) <= 2 * len(keep) and moved[-1] == 0, moved
    assert not index.heads.sparse() and index.heads.disk_bytes() < disk / 4
    assert {mid: index.head(mid) for mid in keep} == before
    again = listed(index.pick(state, state.buckets_of("c"), 1000, now=2))
    assert sorted(p[0] for p in again) == sorted(keep), "each once, none lost"
    index.close()


def test_a_draining_segment_is_left_to_empty_and_moved_only_once_it_stays_sparse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backlog drained in sort order takes its segments through mostly settled to
    empty: their heads are not moved while the segment has been sparse for less than
    SETTLE_S, one emptied meanwhile is freed with nothing moved, and the heads of those
    still sparse after it move, and lease as before."""
    index, state, keep = _mostly_settled(tmp_path, monkeypatch)
    monkeypatch.setattr(head_store, "SETTLE_S", 10.0)
    heads = {mid: index.head(mid) for mid in keep}
    assert None not in heads.values()
    t = time.monotonic()
    assert index.compact_heads(now=t) == 0 and index.compact_heads(now=t + 9.9) == 0
    assert {mid: index.head(mid) for mid in keep} == heads, "all still read where they were"
    disk = index.heads.disk_bytes()
    segment = {m: int(index.store.segment[index.store.get(m) & HANDLE_MASK]) for m in keep}
    older = sorted({segment[m] for m in keep} - {index.heads.current.number})
    drained = [m for m in keep if segment[m] in older[: len(older) // 2]]
    index.forget(packed_mhs(drained))  # the drain goes on: the older segments' last heads settle
    assert index.heads.disk_bytes() < disk, "segments emptied and freed, none moved"
    stay = [m for m in keep if m not in drained]
    before = {mid: index.head(mid) for mid in stay}
    moved = index.compact_heads(now=t + 10)
    assert 0 < moved <= len(stay), moved
    assert {mid: index.head(mid) for mid in stay} == before
    again = listed(index.pick(state, state.buckets_of("c"), 1000, now=2))
    assert sorted(p[0] for p in again) == sorted(stay), "each once, none lost"
    index.close()


def test_heads_read_through_gaps_are_the_heads_read_apart(tmp_path: Path) -> None:
    """A compaction reads heads through the gaps between them (`COMPACT_SPAN`), in
    `pread`s capped at 1 MB each: whatever the span, each token gets its own row's head,
    in the order asked, over a segment several times the cap."""
    warehouse = str(tmp_path / "wh")
    fill(warehouse, "jobs", buffer_rows([i % 500 for i in range(30_000)]))
    index = TopicIndex(warehouse, topic_conf(), str(tmp_path / "heads"))
    index.load()
    store = index.store
    assert index.heads.disk_bytes() > 3 << 20, "a run through it all would pass the cap"
    tokens = store.tokens_at(store.stored()).tolist()
    rng = random.Random(7)
    for n in (1, 50, 5_000, len(tokens)):
        wanted = np.array(rng.sample(tokens, n))
        apart = store.heads(wanted, 0)
        assert len(apart) == n
        for span in (head_store.SPAN_PER_HEAD, head_store.COMPACT_SPAN, 1 << 30):
            assert store.heads(wanted, span) == apart, (n, span)
        columns = (store.sort_key, store.segment, store.position, store.segments)
        joined = read_joined_heads(wanted.tobytes(), *columns, head_store.SPAN_PER_HEAD)
        assert list(Heads(*joined)) == apart, "joined, as a lease reads them"
        data, placed = store.separated_heads(wanted)
        starts = [0, *placed[:-1].tolist()]
        separated = [data[a : b - 1] for a, b in zip(starts, placed.tolist(), strict=True)]
        assert separated == [h for _, h in apart], "separated, as a compaction reads them"
        assert data[placed[-1] - 1 :] == b"\0"
    index.close()


class _SettleAfter:
    """The index's lock, which runs `then` once after its `n`th release: the event loop
    settling messages between two of a compaction's holds of the lock."""

    def __init__(self, lock: threading.Lock, n: int, then: Callable[[], None]) -> None:
        self.lock, self.left, self.then = lock, n, then

    def __enter__(self) -> None:
        self.lock.acquire()

    def __exit__(self, *_: object) -> None:
        self.lock.release()
        self.left -= 1
        if self.left == 0:
            self.then()


@pytest.mark.parametrize("when", ["between reads", "during the write"])
def test_a_message_settled_while_its_head_moves_is_dropped_and_frees_its_heads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """Compaction reads heads a slice per hold of the index's lock and writes them with
    the lock free: a message forgotten meanwhile (the event loop settled it) is not
    read or not moved, a copy written counts as unused, and once the rest are
    forgotten too no segment but the current one is left."""
    monkeypatch.setattr(index_module, "COMPACT_READ", 1)
    index, state, keep = _mostly_settled(tmp_path, monkeypatch)
    gone = keep[::2]
    if when == "between reads":
        # After the first read, every message not read yet settles: their segments are
        # freed, and a read of one of them would fail.
        read: list[int] = []
        heads_of = index.store.separated_heads

        def reading(tokens: np.ndarray) -> tuple[bytes, np.ndarray]:
            read.extend(tokens.tolist())
            return heads_of(tokens)

        def settle_the_rest() -> None:
            gone[:] = [m for m in keep if index.rows[m] not in read]
            index.forget(packed_mhs(gone))

        monkeypatch.setattr(index.store, "separated_heads", reading)
        # Its holds of the lock: the segments, the order, then a read each.
        monkeypatch.setattr(index, "lock", _SettleAfter(index.lock, 3, settle_the_rest))
    else:
        write = index.heads.write_joined

        def write_while_settling(joined: bytes, ends: np.ndarray) -> tuple:
            written = write(joined, ends)
            index.forget(packed_mhs(gone))
            return written

        monkeypatch.setattr(index.heads, "write_joined", write_while_settling)
    moved = index.compact_heads()
    stay = [m for m in keep if m not in gone]
    assert 0 < moved <= len(stay) and gone[0] not in index.rows, moved
    monkeypatch.undo()
    again = listed(index.pick(state, state.buckets_of("c"), 1000, now=2))
    assert sorted(p[0] for p in again) == stay, "the rest lease, each once"
    index.forget(packed_mhs(stay))
    assert index.heads.segments == {index.heads.current}, "every other segment freed"
    assert index.store.segments == {}, "no row names a segment"
    index.close()


def test_a_followers_runs_hold_what_is_pending_not_every_message_it_saw(
    tmp_path: Path,
) -> None:
    """A follower never picks: the messages the leader leased and acked leave its index
    by `forget` alone, and new rows are merged into its runs. The merges drop the tokens
    of the forgotten, in runs and heaps (a trickle of rows goes to the heaps): the
    order stays the size of what is pending, round after round, and a follower made
    leader has no history of settled messages to walk first."""
    warehouse = str(tmp_path)
    fill(warehouse, "jobs", buffer_rows(list(range(400)), prefix="r0-"))
    index = TopicIndex(warehouse, topic_conf())
    index.load()
    sizes = [400, 8, 400, 8, 400, 400]  # 8: two rows a bucket, pushed on its heap
    for r in range(1, len(sizes)):
        index.forget(packed_mhs([f"r{r - 1}-{i}" for i in range(sizes[r - 1])]))
        fill(warehouse, "jobs", buffer_rows(list(range(sizes[r])), prefix=f"r{r}-"))
        assert index.refresh() == sizes[r]
        if sizes[r] == 400:  # merged: what the merge left is what is pending
            assert len(index.order) == len(index.store.table) == 400, f"round {r}"
    state = TopicState(4, 5)
    state.touch("c", 0)
    picks = listed(index.pick(state, state.buckets_of("c"), 1000, now=0))
    assert sorted(m for m, _, _ in picks) == sorted(f"r5-{i}" for i in range(400))
    index.close()


def test_a_node_holds_what_is_pending_after_a_backlog_drains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """6,000 rows read, 5,500 of them settled and forgotten: the rows left are
    renumbered from handle 0 (once no more are left than a shrink renumbers), so the
    columns and the id table shrink to them, and whatever was leased, re-keyed or
    pending leases as before, with its own head, as do rows read afterwards."""
    monkeypatch.setattr(row_store_module, "SHRINK_MIN", 1000)
    warehouse = str(tmp_path)
    fill(warehouse, "jobs", buffer_rows([i % 997 for i in range(6000)], prefix="m"))
    index = TopicIndex(warehouse, topic_conf())
    index.load()
    assert len(index.store.batch) >= 6000
    state = TopicState(4, 5)
    state.touch("c", 0)
    leased = listed(index.pick(state, state.buckets_of("c"), 5500, now=0))
    state.lease("c", 0, 10**9, leased)
    index.release(state, packed(leased))
    assert state.ack("c", 0, [m for m, _, _ in leased[:5490]]) == {}
    _, again, _ = state.nack("c", 0, [m for m, _, _ in leased[5490:]], sort_key=0)
    index.push(state, again)  # re-keyed, on a heap
    index.forget(state.trim(state.seq))
    monkeypatch.setattr(row_store_module, "SHRINK_MAX_ROWS", 509)
    index.shrink()
    assert len(index.store.batch) >= 6000, "more rows left than a shrink renumbers"
    monkeypatch.setattr(row_store_module, "SHRINK_MAX_ROWS", 510)
    big = weakref.ref(index.store.batch), weakref.ref(index.store.table.ids)
    index.shrink()
    index.release_columns()  # as the thread that follows the tables does after a shrink
    assert [r() for r in big] == [None, None], "the old columns the pick held are freed"
    assert len(index.rows) == 510
    assert len(index.store.batch) == 1024 and len(index.store.table.ids) == 1024
    assert len(index.store.table.slots) == 1024
    fill(warehouse, "jobs", buffer_rows([0, 0], prefix="late"))
    assert index.refresh() == 2
    picked, taken = index.pick_with_heads(state, state.buckets_of("c"), 1000, now=0)
    picks = listed(picked)
    acked = {m for m, _, _ in leased[:5490]}
    pending = [f"m{i}" for i in range(6000) if f"m{i}" not in acked]
    assert sorted(m for m, _, _ in picks) == sorted([*pending, "late0", "late1"])
    assert [k for _, _, k in picks] == sorted(k for _, _, k in picks)
    assert [m for m, _, _ in picks[:12]].count("late0") == 1, "at key 0, with the re-keyed"
    assert [json.loads(h + b"}")["id"] for _, h in taken] == [m for m, _, _ in picks]
    index.close()


def test_the_id_column_narrows_once_its_longest_ids_are_settled(tmp_path: Path) -> None:
    """One long id widens every row's id in the column; once it settles and its row is
    forgotten, the thread that follows the tables narrows the column back, and every
    message pending still leases, in order, with its own head."""
    warehouse = str(tmp_path)
    long_id = "a-message-id-of-thirty-nine-bytes-long-"
    fill(warehouse, "jobs", buffer_rows([3, 1, 2], prefix="m"))
    fill(warehouse, "jobs", buffer_rows([0], prefix=long_id))
    index = TopicIndex(warehouse, topic_conf())
    index.load()
    assert index.store.table.ids.dtype.itemsize == 40
    state = TopicState(4, 5)
    state.touch("c", 0)
    row = index.row(f"{long_id}0")
    assert row is not None and state.cancel(0, f"{long_id}0", row.bucket, 0) is None
    index.forget(state.trim(state.seq))
    index.narrow_ids()
    assert index.store.table.ids.dtype.itemsize == 8
    picked, taken = index.pick_with_heads(state, state.buckets_of("c"), 10, now=0)
    picks = listed(picked)
    assert [(m, k) for m, _, k in picks] == [("m1", 1), ("m2", 2), ("m0", 3)]
    assert [json.loads(h + b"}")["id"] for _, h in taken] == ["m1", "m2", "m0"]
    assert index.row(f"{long_id}0") is None and index.row("m") is None
    index.close()


def _id(n: int, short: bool = False) -> str:
    """Ids of every shape the id table stores apart: short ones, ones that widen its
    column, ones past its widest (kept whole, the column holding a digest), ones ending
    in a NUL byte (which the column's padding would hide), and non-ASCII ones. `short`:
    none kept whole, as most topics' ids (the compiled core then looks them up)."""
    if short:
        return [f"m{n}", f"message-{n:04}", f"é{n}"][n % 3]
    return [f"m{n}", f"message-{n:04}", "x" * 70 + str(n), f"n{n}\0", f"é{n}"][n % 5]


def _taken(mids: list[str], model: dict[str, int]) -> list[int]:
    """What `IdTable.take` answers for `mids` over a table holding `model`: each stored
    id's handle the first time, AGAIN after, ABSENT for one not stored."""
    from dejaq.broker.storage.id_table import ABSENT, AGAIN

    seen: set[str] = set()
    answers = []
    for mid in mids:
        answers.append(AGAIN if mid in seen and mid in model else model.get(mid, ABSENT))
        seen.add(mid)
    return answers


def _words(mid: str) -> int:
    """The 8-byte words of column an id needs: a digest's one if kept whole."""
    raw = mid.encode()
    return 1 if len(raw) > 64 or raw.endswith(b"\0") else max(1, -(-len(raw) // 8))


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["store", "forget", "rebuild while forgetting", "narrow"]),
            st.lists(st.integers(0, 60), max_size=25),
        ),
        max_size=30,
    ),
    short=st.booleans(),
    by_mh=st.booleans(),
)
def test_the_id_table_finds_what_a_dict_would(
    steps: list[tuple[str, list[int]]], short: bool, by_mh: bool
) -> None:
    """Stored and forgotten ids, handles reused as the row store reuses them, in a table
    that starts at 4 slots: collisions, deleted slots and rebuilds at every size, and
    rebuilds outside the lock (`make_room`) while the event loop forgets ids, by id or
    by message handle. Probes, by id and by message handle, include ids that were never
    stored, and ids that share a stored one's first bytes. The column is never narrower
    than the ids stored need, and after a narrow (once the widest ids are gone) no
    wider."""
    import numpy as np

    from dejaq.broker.state.handles import packed
    from dejaq.broker.storage import id_table

    small, id_table.MIN_SLOTS = id_table.MIN_SLOTS, 4
    try:
        free: list[int] = []
        size = 0
        table = id_table.IdTable()
        model: dict[str, int] = {}

        def forget(mids: list[str]) -> None:
            assert table.find(mids)[0].tolist() == [model.get(m, -1) for m in mids]
            taken = table.take_mh(packed(mids)) if by_mh else table.take(mids)
            assert taken.tolist() == _taken(mids, model)
            for mid in dict.fromkeys(mids):
                if mid in model:
                    free.append(model.pop(mid))

        for op, numbers in steps:
            mids = [_id(n, short) for n in numbers]
            if op == "store":
                new = [m for m in dict.fromkeys(mids) if m not in model]
                handles = []
                for mid in new:
                    h = free.pop() if free else size
                    size = max(size, h + 1)
                    model[mid] = h
                    handles.append(h)
                if len(table.ids) < size:
                    table.grow(size)
                table.insert(np.array(handles, np.int64), table.encode(new))
            elif op == "forget":
                forget(mids)
            else:
                built = table._built

                def forgetting(
                    ids: np.ndarray,
                    handles: np.ndarray,
                    more: int,
                    mids: list[str] = mids,
                    built=built,
                ) -> np.ndarray:
                    forget(mids)  # as the event loop would, between the lock's two holds
                    return built(ids, handles, more)

                table._built = forgetting  # type: ignore[method-assign]
                if op == "narrow":  # to what the ids stored as it starts need
                    need = id_table.STEP * max([1, *map(_words, model)])
                    width = table.ids.dtype.itemsize
                    table.narrow(threading.Lock())
                    assert table.ids.dtype.itemsize == min(width, need)
                else:
                    # The fewest inserts that call for a rebuild: it doubles the table.
                    room = 3 * len(table.slots) // 4 - table.live - table.deleted + 1
                    table.make_room(room if len(table.slots) < 4096 else 0, threading.Lock())
                del table._built
            words = {m: _words(m) for m in model}
            assert table.words.tolist() == [
                sum(1 for w in words.values() if w == n) for n in range(len(table.words))
            ]
            assert table.ids.dtype.itemsize >= id_table.STEP * max([1, *words.values()])
            assert len(table.checks) == len(table.ids)
            assert len(table) == len(model)
            probe = [_id(n, short) for n in range(61)] + ["m", "x" * 70, "n1", "n1\0", "message-00"]
            assert [table.get(m) for m in probe] == [model.get(m) for m in probe]
            assert table.find(probe)[0].tolist() == [model.get(m, -1) for m in probe]
            assert table.find_mh(packed(probe))[0].tolist() == [model.get(m, -1) for m in probe]
            stored = np.array(sorted(model.values()), np.int64)
            assert table.mids(stored) == sorted(model, key=model.__getitem__)
            named = table.arrow_ids(table.find_mh(packed(probe))[0])
            assert named.to_pylist() == [m if m in model else None for m in probe]
            assert 4 * (table.live + table.deleted) <= 3 * len(table.slots)
    finally:
        id_table.MIN_SLOTS = small


@settings(max_examples=20, deadline=None)
@given(
    stored=st.integers(1, 5000),
    forgotten=st.integers(0, 5000),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_id_table_forgets_and_finds_a_trims_worth_of_ids_as_a_dict_would(
    stored: int, forgotten: int, seed: int
) -> None:
    """A trim forgets thousands of ids in one call, and a look-up can name as many, which
    the compiled core walks a chunk at a time: across the chunks' edges, with ids named
    twice, stored, deleted and never stored, in any order, packed, as strs or by message
    handle, each is taken and found where a dict says, and the widths' tally follows."""
    import random

    import numpy as np
    from dejaq_core import PackedIds

    from dejaq.broker.state.handles import packed
    from dejaq.broker.storage import id_table

    mids = [f"bench-{seed % 97}-{n}" for n in range(stored + 2100)]  # past two chunks
    table = id_table.IdTable()
    table.grow(stored)
    table.insert(np.arange(stored), table.encode(mids[:stored]))
    shuffled = random.Random(seed).sample(range(stored), stored)
    gone = [mids[n] for n in shuffled[:forgotten]]
    model = {m: h for h, m in enumerate(mids[:stored])}
    # Some named twice, some never stored, in any order.
    named = gone + gone[: forgotten // 3] + mids[stored : stored + 50]
    named = random.Random(seed + 2).sample(named, len(named))
    how = [PackedIds.pack, packed, list][seed % 3]
    taken = table.take_mh(how(named)) if how is packed else table.take(how(named))
    assert taken.tolist() == _taken(named, model)
    for m in gone:
        del model[m]
    assert len(table) == len(model)
    assert table.words.tolist() == [sum(1 for m in model if _words(m) == n) for n in range(9)]
    probe = random.Random(seed + 1).sample(mids, len(mids))
    want = [model.get(m, -1) for m in probe]
    assert table.find(probe)[0].tolist() == want
    assert table.find(PackedIds.pack(probe))[0].tolist() == want
    assert table.find_mh(packed(probe))[0].tolist() == want


def test_an_id_table_placed_a_large_batch_at_a_time_finds_every_id() -> None:
    """An insert or a rebuild of HASH_FREE_MIN (16,384) rows or more hashes their ids
    with the GIL released, over a copy of the column and of the ids kept whole: every
    id, of every shape, is found where it was stored, by id and by message handle."""
    import numpy as np

    from dejaq.broker.state.handles import packed
    from dejaq.broker.storage import id_table

    n = 60_000
    mids = [_id(i) for i in range(n)]
    table = id_table.IdTable()
    table.grow(n)
    first = 20_000  # one insert, then a rebuild of its rows to make room for the rest
    table.insert(np.arange(first), table.encode(mids[:first]))
    slots = len(table.slots)
    table.make_room(n - first, threading.Lock())
    assert len(table.slots) > slots, "rebuilt"
    table.insert(np.arange(first, n), table.encode(mids[first:]))
    assert table.find(mids)[0].tolist() == list(range(n))
    assert table.find_mh(packed(mids))[0].tolist() == list(range(n))
    assert table.find([f"{m}-" for m in mids[:100]])[0].tolist() == [-1] * 100


def test_a_look_up_by_message_handle_is_confirmed_by_the_rows_check_word() -> None:
    """A look-up by message handle confirms a slot by the row's check (64 bits of its
    mh, `IdTable.checks`), not by hashing its id again: after a grow, a rebuild and a
    renumber, ids of every shape (long ones kept whole among them) are found by mh, and
    deleted ones are not. A row whose check word is written wrong by hand is not found
    by mh (nor taken), while a look-up by id, which compares the id's bytes, still finds
    it: the check is what confirms. A rebuild writes each row's check again."""
    import numpy as np

    from dejaq.broker.state.handles import packed
    from dejaq.broker.storage import id_table

    n = 3000
    mids = [_id(i) for i in range(n)]
    table = id_table.IdTable()
    table.grow(100)
    table.insert(np.arange(100), table.encode(mids[:100]))
    table.grow(n)  # the checks grow with the ids
    assert len(table.checks) == len(table.ids) == n
    slots = len(table.slots)
    table.make_room(n - 100, threading.Lock())
    assert len(table.slots) > slots, "rebuilt"
    table.insert(np.arange(100, n), table.encode(mids[100:]))
    want = list(range(n))
    assert table.find_mh(packed(mids))[0].tolist() == want

    gone = mids[::7]
    assert (table.take_mh(packed(gone)) >= 0).all()
    model = {m: h for h, m in enumerate(mids) if m not in set(gone)}
    assert table.find_mh(packed(mids))[0].tolist() == [model.get(m, -1) for m in mids]
    long = [m for m in model if m.startswith("x" * 70) or m.endswith("\0")]
    assert long and table.find_mh(packed(long))[0].tolist() == [model[m] for m in long]

    stored = np.array(sorted(model.values()), np.int64)
    table.renumber(stored, len(stored) + 10)
    assert len(table.checks) == len(stored) + 10
    kept = sorted(model, key=model.__getitem__)
    assert table.find_mh(packed(kept))[0].tolist() == list(range(len(kept)))
    assert table.find_mh(packed(gone))[0].tolist() == [-1] * len(gone)

    wrong = [kept[5], next(m for m in kept if m.startswith("x" * 70))]
    at = [kept.index(m) for m in wrong]
    table.checks[at] ^= np.uint64(1)
    assert table.find_mh(packed(wrong))[0].tolist() == [-1, -1]
    assert table.find(wrong)[0].tolist() == at, "by id, the id's bytes confirm"
    assert table.take_mh(packed(wrong)).tolist() == [id_table.ABSENT] * 2
    table.make_room(3 * len(table.slots) // 4, threading.Lock())  # a rebuild
    assert table.find_mh(packed(wrong))[0].tolist() == at
    assert table.find_mh(packed(kept))[0].tolist() == list(range(len(kept)))


def test_a_duty_command_without_a_majority_fails_saying_why(tmp_path: Path) -> None:
    """One node of three up: no leader. A replicated call from a duty thread fails with
    NotCommitted, PySyncObj's reason in words: a leader change is a line in the log, not
    a traceback of a bare code."""
    import asyncio

    from dejaq.broker.state.raft import NotCommitted, committed

    nodes = _raft_nodes(tmp_path)

    def register() -> str:
        try:
            committed(nodes[0].state.register, "127.0.0.1:1", "http://127.0.0.1:2", timeout=0.5)
        except NotCommitted as e:
            return str(e)
        return "committed"

    async def scenario() -> str:
        nodes[0].attach(asyncio.get_running_loop())
        return await asyncio.to_thread(register)

    try:
        said = asyncio.run(scenario())
    finally:
        for node in nodes:
            node.destroy()
    assert said == "Raft command not committed within 0.5 s (no leader, or no majority)"


def test_a_duty_waiting_for_a_command_gives_up_as_its_node_stops(tmp_path: Path) -> None:
    """A node stops (SIGTERM) while a duty thread waits for a command that cannot commit
    (here one node of three up: no leader). Raft ticks no more once the server ended,
    so the wait would run out its whole timeout before the node could exit: `committed`
    ends it with Halted soon after the node's stop event is set."""
    import asyncio

    from dejaq.broker.state.raft import Halted, committed

    nodes = _raft_nodes(tmp_path)
    halted = threading.Event()

    def register() -> tuple[str, float]:
        began = time.monotonic()
        try:
            committed(
                nodes[0].state.register, "127.0.0.1:1", "http://x:2", timeout=60, halted=halted
            )
        except Halted as e:
            return str(e), time.monotonic() - began
        return "committed", time.monotonic() - began

    async def scenario() -> tuple[str, float]:
        loop = asyncio.get_running_loop()
        nodes[0].attach(loop)
        loop.call_later(0.3, halted.set)  # the stop comes while the command waits
        return await asyncio.to_thread(register)

    try:
        said, took = asyncio.run(scenario())
    finally:
        for node in nodes:
            node.destroy()
    assert said == "Raft command not waited for: this node is stopping", said
    assert took < 10, f"{took:.2f} s: it should end at the stop, not the 60 s timeout"


@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.floats(0, 60)), max_size=40))
def test_the_lease_latency_histogram_reads_as_prometheus_clients_would(
    seen: list[tuple[str, float]],
) -> None:
    """`dejaq_lease_seconds` is counted by the broker's own collector (cheaper to observe
    once a lease); a scrape reads what prometheus_client's Histogram of the same buckets
    gives (but its creation times), bounds included in the bucket at them."""
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    latency = LeaseLatency(ours)
    reference = Histogram(
        "dejaq_lease_seconds",
        "Lease latency on the leader, from the messages picked to the answer: the lease "
        "command's Raft commit included, a long poll's wait for messages not",
        ["topic"],
        buckets=LeaseLatency.BOUNDS,
        registry=theirs,
    )
    for topic, seconds in [*seen, *((t, b) for t in "ab" for b in LeaseLatency.BOUNDS)]:
        latency.labels(topic).observe(seconds)
        reference.labels(topic).observe(seconds)
    expected = [x for x in generate_latest(theirs).decode().splitlines() if "_created" not in x]
    assert generate_latest(ours).decode().splitlines() == expected


def test_the_lease_latency_leaves_out_a_long_polls_wait_for_messages(tmp_path: Path) -> None:
    """A long poll that waits half a second and more for its messages (written to the
    buffer meanwhile) is observed in `dejaq_lease_seconds` for its commit and answer
    only: the wait says nothing of the broker's speed."""
    import asyncio

    warehouse = str(tmp_path / "warehouse")

    async def scenario(broker: Any) -> tuple[float, float, list[str]]:
        sample = broker.metrics.registry.get_sample_value
        labels = {"topic": "jobs"}
        assert len(json.loads(await broker.lease("jobs", "w", 3, 60_000, 0))) == 3
        began = time.monotonic()
        poll = asyncio.create_task(broker.lease("jobs", "w", 3, 60_000, 20_000))
        await asyncio.sleep(0.5)  # the wait to leave out, not a synchronisation
        assert not poll.done(), "nothing to lease yet"
        fill(warehouse, "jobs", buffer_rows([1], lambda i: 0, "n"))
        leased = json.loads(await poll)
        waited = time.monotonic() - began
        assert sample("dejaq_lease_seconds_count", labels) == 2
        return waited, sample("dejaq_lease_seconds_sum", labels), [m["id"] for m in leased]

    waited, observed, leased = on_one_node(tmp_path, scenario)
    assert leased == ["n0"]
    assert waited >= 0.5
    assert observed < 0.25, f"{observed:.3f} s observed for two leases, one waiting {waited:.2f} s"


def test_a_settling_request_by_ids_commits_their_receipts(tmp_path: Path) -> None:
    """Raft carries integers on the ack path whichever way the worker names its
    messages: the leader turns ids into their leases' receipts (the commits are
    recorded on their way to the real Raft). Refusals are still told by id, those made
    before any command (settled, never leased) as those the command made."""

    sent: list[tuple[str, tuple]] = []

    async def scenario(broker: Any) -> tuple[list, list, list]:
        commit = broker.raft.commit

        async def recorded(topic: str, op: str, *args: Any) -> Any:
            sent.append((op, args))
            return await commit(topic, op, *args)

        broker.raft.commit = recorded
        leased = json.loads(await broker.lease("jobs", "w", 3, 30_000, 0))
        receipt = {m["id"]: m["receipt"] for m in leased}
        extended, _ = await broker.extend("jobs", "w", ["m1", "m0"], 60_000)
        acked = await broker.settle("jobs", "ack", "w", ["m1", "m0", "nope", "m1"])
        nacked = await broker.nack("jobs", "w", ["m2", "m0"], 0, None)
        ops = [(op, args[2:]) for op, args in sent if op not in ("lease", "configure")]
        assert ops[0] == ("extend", ([], 60_000, [receipt["m1"], receipt["m0"]]))
        assert ops[1] == ("ack", ([], [receipt["m1"], receipt["m0"]])), "m1 named twice: once"
        # An acked message's lease record holds it until its trim: its receipt is sent.
        assert ops[2][1][0] == [] and ops[2][1][-1] == [receipt["m2"], receipt["m0"]]
        return (
            [extended.ok, extended.refused],
            [acked.ok, acked.refused],
            [
                nacked.ok,
                nacked.refused,
            ],
        )

    extended, acked, nacked = on_one_node(tmp_path, scenario)
    assert extended == [2, {}]
    assert acked == [2, {"nope": Refusal.NOT_LEASED}]
    assert nacked == [1, {"m0": Refusal.SETTLED}]


def test_a_stop_waits_for_its_duties_once_all_together_not_once_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Duties caught in a step the stop cannot cut short (a warehouse that does not
    answer: two threads standing in for duties blocked in a read, since a real object
    store cannot be made to hang here) hold a stop for DUTY_STOP_WAIT_S in all, not that
    long each; the warning names them."""
    from dejaq.broker import service

    monkeypatch.setattr(service, "DUTY_STOP_WAIT_S", 1.5)
    answers = threading.Event()
    stopping: list[float] = []

    async def scenario(broker: Any) -> None:
        for name in ("stuck_retention", "stuck_checkpoint"):
            t = threading.Thread(target=answers.wait, args=(60,), name=name, daemon=True)
            t.start()
            broker._threads.append(t)
        stopping.append(time.monotonic())

    try:
        with caplog.at_level(logging.WARNING, "dejaq.broker"):
            on_one_node(tmp_path, scenario)
        took = time.monotonic() - stopping[0]
    finally:
        answers.set()
    said = [r.getMessage() for r in caplog.records if "into the stop" in r.getMessage()]
    assert said == [
        "duties still running 1.5 s into the stop, left to end with the process: "
        "stuck_retention, stuck_checkpoint"
    ], said
    assert 1.5 <= took < 2.7, f"{took:.2f} s: one wait of 1.5 s for both, not 1.5 s each"
