"""Release end to end: real Delta buffer and ledger in, real Kafka out, real processes killed."""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pytest
from conftest import Named, buffer_names, run_to_end, wait_until
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic
from kafka.consumer.fetcher import ConsumerRecord
from kafka.errors import KafkaTimeoutError, MessageSizeTooLargeError
from kafka.producer.future import FutureProduceResult, FutureRecordMetadata

from dejaq.conf import jvm
from dejaq.conf.settings import ConfigError, Settings, load_settings
from dejaq.conf.tables import (
    BUFFER_SCHEMA,
    LEDGER_SCHEMA,
    KindChanged,
    LedgerEvent,
    Table,
    ensure_table,
    scan,
)
from dejaq.jobs import embedded_kafka
from dejaq.jobs.children import stop
from dejaq.jobs.ports import free_port
from dejaq.jobs.release import summary
from dejaq.jobs.stopping import stop_between_batches
from dejaq.pipelines import pending, release
from dejaq.pipelines.ingest import IngestJob
from dejaq.pipelines.pending import Message, PendingSet
from dejaq.pipelines.release import (
    STATS_KEPT,
    EventWatermark,
    ReleaseJob,
    Releaser,
    in_partition_order,
)
from dejaq.pipelines.retention import retain
from dejaq.pipelines.session import detect_connectors
from dejaq.pipelines.timed_sender import TimedSender

if TYPE_CHECKING:
    from dejaq.broker.state.leases import TopicState

DEJAQ = [sys.executable, "-m", "dejaq.jobs.cli"]
ROOT = Path(__file__).resolve().parent.parent


def write_conf(
    tmp_path: Path,
    bootstrap: str,
    kind: str,
    output: str,
    delivery: str = "release",
    source: str = "in",
    **extra,
) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    conf = tmp_path / "dejaq.yaml"
    options = "".join(f", {k}: {v}" for k, v in extra.items())
    conf.write_text(
        f"warehouse: {tmp_path / 'warehouse'}\n"
        f"kafka: {{bootstrap: '{bootstrap}'}}\n"
        f"topics:\n  - {{name: jobs, kind: {kind}, source: [{source}], buckets: 4,"
        f" delivery: {delivery}, output: {output}{options}}}\n"
    )
    return conf


def settings_for(tmp_path: Path, bootstrap: str, kind: str, output: str, **extra) -> Settings:
    return load_settings(write_conf(tmp_path, bootstrap, kind, output, **extra), env={})


def _ts(ms: int | None) -> dt.datetime | None:
    if ms is None:
        return None
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC)


def add_buffer(
    settings: Settings,
    kind: str,
    sort_keys: list[int],
    first_offset: int = 0,
    keys: int = 5,
    payload_bytes: int | None = None,
    trace: Callable[[int], bytes | None] = lambda o: f"t{o}".encode(),
    bare: frozenset[int] = frozenset(),
    more_headers: tuple[tuple[str, bytes], ...] = (),
) -> list[str]:
    """Append buffer rows as ingest would write them; return their ids in offset order.
    `payload_bytes`: payloads of that size; `trace`: the "trace" header's value; `bare`:
    the offsets whose records have neither key nor value; `more_headers`: every
    record's headers after "trace"."""
    now = dt.datetime.now(dt.UTC)
    n = len(sort_keys)
    offsets = range(first_offset, first_offset + n)
    ids = [f"in-0-{o}" for o in offsets]
    rows = {
        "message_id": ids,
        "bucket": [o % 4 for o in offsets],
        "sort_key": sort_keys,
        "priority": sort_keys if kind == "priority" else [None] * n,
        "deliver_at": [_ts(k) for k in sort_keys] if kind == "timeline" else [None] * n,
        "event_time": [_ts(k) for k in sort_keys] if kind == "event_time" else [None] * n,
        "key": [None if o in bare else f"k{o % keys}".encode() for o in offsets],
        "payload": [
            None
            if o in bare
            else f"payload-{o}".encode()
            if payload_bytes is None
            else b"x" * payload_bytes
            for o in offsets
        ],
        "headers": [
            [{"key": k, "value": v} for k, v in (("trace", trace(o)), *more_headers)]
            for o in offsets
        ],
        "source_topic": ["in"] * n,
        "source_partition": [0] * n,
        "source_offset": list(offsets),
        "produced_at": [now] * n,
        "ingested_at": [now] * n,
    }
    path = ensure_table(settings.warehouse, Table.BUFFER, "jobs")
    write_deltalake(path, pa.table(rows, schema=BUFFER_SCHEMA), mode="append")
    return ids


def add_ledger(settings: Settings, events: list[tuple[str, str, int | None]]) -> None:
    path = ensure_table(settings.warehouse, Table.LEDGER, "jobs")
    now = dt.datetime.now(dt.UTC)
    rows = {
        "message_id": [e[0] for e in events],
        "bucket": [0] * len(events),
        "event": [e[1] for e in events],
        "sort_key": [e[2] for e in events],
        "deliveries": [0] * len(events),
        "at": [now] * len(events),
    }
    write_deltalake(path, pa.table(rows, schema=LEDGER_SCHEMA), mode="append")


def ledger_released(settings: Settings) -> list[str]:
    path = ensure_table(settings.warehouse, Table.LEDGER, "jobs")
    t = scan(path, Table.LEDGER, ["message_id", "event"])
    return [
        mid
        for mid, event in zip(
            t.column("message_id").to_pylist(), t.column("event").to_pylist(), strict=True
        )
        if event == LedgerEvent.RELEASED
    ]


class Output:
    """Everything on an output topic, read by assigned partitions from the start."""

    def __init__(self, bootstrap: str, topic: str, partitions: int) -> None:
        self.consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
        self.consumer.assign([TopicPartition(topic, p) for p in range(partitions)])
        self.consumer.seek_to_beginning()
        self.records: list[ConsumerRecord] = []

    def poll(self) -> int:
        for batch in self.consumer.poll(timeout_ms=200).values():
            self.records += batch
        return len(self.records)

    def wait_for(self, n: int, timeout: float = 60) -> list[ConsumerRecord]:
        wait_until(lambda: self.poll() >= n, timeout=timeout, what=f"{n} output records")
        return self.records

    def to_end(self) -> list[ConsumerRecord]:
        """Everything on the topic up to its end offsets as they are now."""
        parts = list(self.consumer.assignment())
        ends = self.consumer.end_offsets(parts)

        def at_end() -> bool:
            self.poll()
            return all(self.consumer.position(p) >= ends[p] for p in parts)

        wait_until(at_end, what="the output read to its end")
        return self.records

    def close(self) -> None:
        self.consumer.close()


def header(r: ConsumerRecord, name: str) -> bytes:
    values = [v for k, v in r.headers if k == name]
    assert len(values) == 1, (name, r.headers)
    return values[0]


def ids(records: list[ConsumerRecord]) -> list[str]:
    return [header(r, "dejaq-id").decode() for r in records]


def by_partition(records: list[ConsumerRecord]) -> dict[int, list[ConsumerRecord]]:
    parts: dict[int, list[ConsumerRecord]] = defaultdict(list)
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        parts[r.partition].append(r)
    return parts


def run_until(
    releaser: Releaser, done: Callable[[], bool], timeout: float = 60, first: int = 0
) -> None:
    """Drive batches the way the streaming query does, from batch id `first`, until `done`."""
    batch = iter(range(first, 1_000_000))

    def step() -> bool:
        releaser.run_batch(next(batch))
        return done()

    wait_until(step, timeout=timeout, what="release batches")


def refused_without_take_over(s: Settings, conf: Path) -> None:
    """The release refuses the topic, as a job and as `dejaq release` (exit 2)."""
    with pytest.raises(ConfigError, match=r"delivered by the lease broker.*--take-over"):
        Releaser(s, s.topic("jobs"))
    result = subprocess.run(
        [*DEJAQ, "release", "--topic", "jobs", "--conf-file", str(conf), "--once"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "stop the brokers" in result.stderr, result.stderr
    assert "Nack delays and retry backoffs" in result.stderr, result.stderr


def test_a_topic_the_broker_delivered_is_released_only_when_taken_over(
    kafka_bootstrap, topic_factory, tmp_path, caplog
):
    """A topic switched from delivery: lease: its ledger holds the brokers' checkpoints,
    and their Raft state what the ledger does not yet. The release refuses it, before
    Spark starts, until told it takes over; then it releases, and owns the topic until
    the brokers checkpoint it again. A reschedule the brokers checkpointed is carried;
    nack delays and retry backoffs are not: the refusal and the take-over's log say so."""
    from dejaq.broker.state.leases import TopicState
    from dejaq.broker.storage.ledger_writer import checkpoint

    out = topic_factory(partitions=1)
    conf = write_conf(tmp_path, kafka_bootstrap, "priority", out)
    s = load_settings(conf, env={})
    written = add_buffer(s, "priority", [3, 1, 2])
    state = TopicState(4, 5)
    state.lease("w", 0, 1000, [(written[0], 0, 3)])
    assert state.ack("w", 1, [written[0]]) == {}
    assert state.reschedule(written[2], 0, state.seq, 2, 2) is None  # ahead of written[1]
    checkpoint(s.warehouse, "jobs", state.events, buffer_names(s.warehouse))
    refused_without_take_over(s, conf)
    with caplog.at_level("WARNING", logger="dejaq.release"):
        releaser = Releaser(s, s.topic("jobs"), take_over=True)
    assert "taken over from the lease broker; Nack delays and retry backoffs" in caplog.text
    output = Output(kafka_bootstrap, out, 1)
    try:
        run_until(releaser, lambda: not len(releaser.pending) and releaser.idle)
        released = ids(output.wait_for(2))
    finally:
        releaser.finish()
        output.close()
    assert released == [written[2], written[1]], "the acked one is not; at the keys in force"
    Releaser(s, s.topic("jobs")).finish()  # taken over: its topic, no flag needed
    # Handed back to the brokers, whose checkpoints move their tag on: taken over again.
    state.lease("w", 2, 1000, [("again-0", 0, 9)])
    assert state.ack("w", 3, ["again-0"]) == {}
    checkpoint(s.warehouse, "jobs", state.events, Named([*written, "again-0"]).names)
    with pytest.raises(ConfigError, match="--take-over"):
        Releaser(s, s.topic("jobs"))


def brokers_checkpoint(
    s: Settings,
    state: TopicState,
    named: Named,
    history: tuple[str, int],
    rounds: int = 1,
) -> int:
    """`rounds` brokers' checkpoints of one acked message each, written by the ledger
    writer under Raft history `history`, as a leader of that history writes them, naming
    the messages by `named` (noting each new one) as its index would; return the last
    seq written."""
    from dejaq.broker.storage.ledger_writer import checkpoint

    upto = history[1]
    for _ in range(rounds):
        mid = f"leased-{uuid.uuid4().hex[:8]}"
        named.note([mid])
        state.lease("w", 0, 1000, [(mid, 0, 1)])
        assert state.ack("w", 1, [mid]) == {}
        upto = checkpoint(s.warehouse, "jobs", state.events, named.names, history)
    return upto


def taken_over(
    s: Settings, bootstrap: str, out: str, n: int, timeout: float = 60
) -> list[ConsumerRecord]:
    """Take the topic over from the brokers and release until nothing is pending: the
    first `n` records on the output topic."""
    releaser = Releaser(s, s.topic("jobs"), take_over=True)
    output = Output(bootstrap, out, 1)
    try:
        run_until(releaser, lambda: not len(releaser.pending) and releaser.idle, timeout)
        return output.wait_for(n)
    finally:
        releaser.finish()
        output.close()


def on_brokers(
    tmp_path: Path, s: Settings, kind: str, scenario: Callable[[Any], Awaitable[object]]
) -> None:
    """Run `scenario` on a one-node lease broker of topic "jobs" over `s`'s warehouse (in
    process: `test_broker.run_node`), "w" a member; once the broker's checkpoints have
    written and trimmed every event of it, stop the broker."""
    from test_broker import run_node

    from dejaq.broker.service import now_ms
    from dejaq.conf.settings import TopicConfig

    topic = TopicConfig(name="jobs", kind=kind, source=["in"], buckets=4)
    brokers = Settings(warehouse=s.warehouse, topics=[topic])

    async def checkpointed(broker: Any) -> None:
        await broker.raft.commit("jobs", "touch", "w", now_ms())
        await scenario(broker)
        deadline = time.monotonic() + 30
        while len(broker.state("jobs").events):
            assert time.monotonic() < deadline, "the broker's events were never trimmed"
            await asyncio.sleep(0.05)

    run_node(brokers, f"127.0.0.1:{free_port()}", tmp_path / "broker", checkpointed)


def test_a_take_over_releases_a_timeline_message_at_the_deliver_at_the_brokers_gave_it(
    kafka_bootstrap, topic_factory, tmp_path
):
    """A pending timeline message rescheduled later on the brokers, its reschedule
    checkpointed, then the brokers stopped and the topic taken over: the release holds
    it back until its new deliver_at, not its buffer row's, and releases it then."""
    out = topic_factory(partitions=1)
    s = load_settings(write_conf(tmp_path, kafka_bootstrap, "timeline", out), env={})
    start = int(time.time() * 1000)
    later, new_key = add_buffer(s, "timeline", [start + 4000, start + 4500])
    (due,) = add_buffer(s, "timeline", [start - 1000], first_offset=2)
    rescheduled = start + 12_000

    async def scenario(broker: Any) -> None:
        leased = json.loads(await broker.lease("jobs", "w", 1, 30_000, 0))
        assert [m["id"] for m in leased] == [due]
        assert (await broker.settle("jobs", "ack", "w", [due])).ok == 1
        await broker.reschedule("jobs", later, None, rescheduled)

    on_brokers(tmp_path, s, "timeline", scenario)
    records = taken_over(s, kafka_bootstrap, out, 2, timeout=90)
    assert ids(records) == [new_key, later], "the rescheduled one goes last"
    at = {header(r, "dejaq-id").decode(): r for r in records}
    assert int(header(at[later], "dejaq-deliver-at")) == rescheduled
    assert at[later].timestamp >= rescheduled, "released before its new deliver_at"
    assert at[new_key].timestamp < rescheduled


def test_a_take_over_after_a_retention_run_past_the_new_keys_reads_them_from_the_rows(
    kafka_bootstrap, topic_factory, tmp_path
):
    """As above, with a retention run between the brokers' stop and the take-over whose
    cutoff passes the reschedules of two pending timeline messages but not the second
    reschedule of one of them: the run removes the acked message, gives the two rows
    their new deliver_at, and its watermark passes those reschedules. The release,
    which reads the ledger from the watermark on, holds each back until the key in
    force (the later reschedule's for the second), never its buffer row's first one."""
    from dejaq.broker.service import now_ms

    out = topic_factory(partitions=1)
    s = load_settings(write_conf(tmp_path, kafka_bootstrap, "timeline", out), env={})
    start = int(time.time() * 1000)
    later, new_key, twice = add_buffer(s, "timeline", [start + 4000, start + 4500, start + 5000])
    (due,) = add_buffer(s, "timeline", [start - 1000], first_offset=3)
    keys = {later: start + 12_000, twice: start + 10_000}
    cutoff: list[int] = []

    async def scenario(broker: Any) -> None:
        leased = json.loads(await broker.lease("jobs", "w", 1, 30_000, 0))
        assert [m["id"] for m in leased] == [due]
        assert (await broker.settle("jobs", "ack", "w", [due])).ok == 1
        await broker.reschedule("jobs", later, None, keys[later])
        await broker.reschedule("jobs", twice, None, start + 8000)
        cutoff.append(now_ms() + 1)
        while now_ms() < cutoff[0]:  # the next reschedule is stamped past the cutoff
            await asyncio.sleep(0.001)
        await broker.reschedule("jobs", twice, None, keys[twice])

    on_brokers(tmp_path, s, "timeline", scenario)
    buffer = ensure_table(s.warehouse, Table.BUFFER, "jobs")
    run = retain(buffer, ensure_table(s.warehouse, Table.LEDGER, "jobs"), 0, cutoff[0])
    assert run is not None and run.watermark_ms == cutoff[0], "past both reschedules"
    assert (run.removed, run.rekeyed) == (1, 2)
    rows = scan(buffer, Table.BUFFER).to_pylist()
    assert {r["message_id"]: (r["sort_key"], r["deliver_at"]) for r in rows} == {
        later: (keys[later], _ts(keys[later])),
        new_key: (start + 4500, _ts(start + 4500)),
        twice: (start + 8000, _ts(start + 8000)),
    }
    records = taken_over(s, kafka_bootstrap, out, 3, timeout=90)
    assert ids(records) == [new_key, twice, later]
    for r in records[1:]:
        key = keys[header(r, "dejaq-id").decode()]
        assert int(header(r, "dejaq-deliver-at")) == key
        assert r.timestamp >= key, "released before its deliver_at"


def test_a_take_over_releases_a_message_nacked_with_a_priority_at_that_priority(
    kafka_bootstrap, topic_factory, tmp_path
):
    """A priority topic's message nacked with a new priority on the brokers, checkpointed,
    the brokers stopped and the topic taken over: the release order follows the nack's
    priority, not the buffer row's."""
    out = topic_factory(partitions=1)
    s = load_settings(write_conf(tmp_path, kafka_bootstrap, "priority", out), env={})
    first, second, third = add_buffer(s, "priority", [1, 2, 3])

    async def scenario(broker: Any) -> None:
        leased = json.loads(await broker.lease("jobs", "w", 1, 30_000, 0))
        assert [m["id"] for m in leased] == [first]
        assert (await broker.nack("jobs", "w", [first], 0, 5)).ok == 1

    on_brokers(tmp_path, s, "priority", scenario)
    records = taken_over(s, kafka_bootstrap, out, 3)
    assert ids(records) == [second, third, first]
    assert [int(header(r, "dejaq-priority")) for r in records] == [2, 3, 5]


def test_a_take_over_counts_the_brokers_checkpoints_of_every_raft_history(
    kafka_bootstrap, topic_factory, tmp_path
):
    """Brokers started afresh over the warehouse checkpoint under a Raft history of
    their own, and the tags of a take-over by a new history begin anew: a ledger whose
    brokers' checkpoints are all under a later history is refused until taken over,
    and so is one a new history checkpointed since the last take-over. Enough
    checkpoints for a Delta checkpoint of the ledger, whose tags the start reads too."""
    from dejaq.broker.state.leases import TopicState

    out = topic_factory(partitions=1)
    conf = write_conf(tmp_path, kafka_bootstrap, "priority", out)
    s = load_settings(conf, env={})
    state, named = TopicState(4, 5), Named()
    written = brokers_checkpoint(s, state, named, ("later", 0), rounds=9)
    ledger = ensure_table(s.warehouse, Table.LEDGER, "jobs")
    last = json.loads(Path(ledger, "_delta_log", "_last_checkpoint").read_text())
    assert last["version"] == DeltaTable(ledger).version(), "the tags only in a Delta checkpoint"
    refused_without_take_over(s, conf)
    Releaser(s, s.topic("jobs"), take_over=True).finish()
    Releaser(s, s.topic("jobs")).finish()  # taken over: its topic, no flag needed
    # Handed back to brokers that begin a new history past what the ledger holds.
    brokers_checkpoint(s, state, named, ("newer", written))
    with pytest.raises(ConfigError, match="--take-over"):
        Releaser(s, s.topic("jobs"))
    Releaser(s, s.topic("jobs"), take_over=True).finish()
    Releaser(s, s.topic("jobs")).finish()


def test_a_take_over_noted_before_histories_were_told_apart_still_holds(
    kafka_bootstrap, topic_factory, tmp_path
):
    """A ledger taken over when only the brokers' first Raft history's tag was noted
    (one app transaction, its version that tag) is still this job's: no flag needed,
    until the brokers checkpoint it again, here under a new history begun past it."""
    from dejaq.broker.state.leases import TopicState

    out = topic_factory(partitions=1)
    s = settings_for(tmp_path, kafka_bootstrap, "priority", out)
    state, named = TopicState(4, 5), Named()
    tag = brokers_checkpoint(s, state, named, ("", 0))
    ledger = DeltaTable(ensure_table(s.warehouse, Table.LEDGER, "jobs"))
    mark = CommitProperties(app_transactions=[Transaction("dejaq-release-jobs:taken-over", tag)])
    ledger.create_write_transaction(
        [], mode="append", schema=ledger.schema(), commit_properties=mark
    )
    Releaser(s, s.topic("jobs")).finish()
    brokers_checkpoint(s, state, named, ("newer", tag))
    with pytest.raises(ConfigError, match="--take-over"):
        Releaser(s, s.topic("jobs"))


def test_a_timeline_reconfigured_as_priority_is_refused_while_its_rows_are_pending(
    kafka_bootstrap, topic_factory, tmp_path
):
    """A timeline's deliver_at (epoch ms) read as a priority is due at once: the release
    of a topic reconfigured so refuses it, before Spark starts, naming both kinds and the
    way out, and nothing goes out early. Set back, the timeline releases as before."""
    out = topic_factory(partitions=1)
    timeline = settings_for(tmp_path, kafka_bootstrap, "timeline", out)
    due = int(time.time() * 1000) + 3_600_000
    add_buffer(timeline, "timeline", [due, due + 1, due + 2])
    Releaser(timeline, timeline.topic("jobs")).finish()  # the timeline's release ran
    conf = write_conf(tmp_path, kafka_bootstrap, "priority", out)
    result = subprocess.run(
        [*DEJAQ, "release", "--topic", "jobs", "--conf-file", str(conf), "--once"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert (
        "topic 'jobs' is configured as kind priority, but its buffer holds 3 rows written as "
        "kind timeline" in result.stderr
    ), result.stderr
    assert "Set kind back to timeline" in result.stderr
    with pytest.raises(KindChanged):
        Releaser(load_settings(conf, env={}), load_settings(conf, env={}).topic("jobs"))
    output = Output(kafka_bootstrap, out, 1)
    try:
        assert output.to_end() == [], "released early"
    finally:
        output.close()
    assert ledger_released(timeline) == []
    releaser = Releaser(timeline, timeline.topic("jobs"))
    try:
        assert releaser.run_batch(0).released == 0 and len(releaser.pending) == 3
    finally:
        releaser.finish()


def test_a_lease_topic_is_refused(kafka_bootstrap, tmp_path):
    conf = write_conf(tmp_path, kafka_bootstrap, "priority", "out", delivery="lease")
    with pytest.raises(ConfigError, match="delivery: lease: the lease broker delivers it"):
        Releaser(load_settings(conf, env={}), load_settings(conf, env={}).topic("jobs"))
    result = subprocess.run(
        [*DEJAQ, "release", "--topic", "jobs", "--conf-file", str(conf)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "releasing it too would deliver its messages twice" in result.stderr


@settings(
    max_examples=5,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(offsets=st.lists(st.integers(min_value=-500, max_value=1500), min_size=1, max_size=25))
def test_timeline_is_never_early_and_in_order_per_partition(
    offsets, kafka_bootstrap, topic_factory, tmp_path
):
    out = topic_factory(partitions=3)
    s = settings_for(tmp_path / uuid.uuid4().hex, kafka_bootstrap, "timeline", out)
    start = int(time.time() * 1000)
    due = [start + o for o in offsets]
    written = add_buffer(s, "timeline", due)
    releaser = Releaser(s, s.topic("jobs"))
    output = Output(kafka_bootstrap, out, 3)
    try:
        run_until(releaser, lambda: not len(releaser.pending) and releaser.idle)
        records = output.wait_for(len(due))
    finally:
        releaser.finish()
        output.close()
    assert sorted(ids(records)) == sorted(written)
    for r in records:
        assert r.timestamp >= int(header(r, "dejaq-deliver-at")), "written before deliver_at"
    for part in by_partition(records).values():
        order = [(int(header(r, "dejaq-deliver-at")), int(r.offset)) for r in part]
        assert [o[0] for o in order] == sorted(o[0] for o in order)
    assert sorted(ledger_released(s)) == sorted(written)


def test_priority_lowest_first_under_a_per_trigger_cap(kafka_bootstrap, topic_factory, tmp_path):
    out = topic_factory(partitions=3)
    s = settings_for(tmp_path, kafka_bootstrap, "priority", out, max_per_trigger=50)
    priorities = [(i * 37) % 200 + 10 for i in range(120)]  # all different
    written = add_buffer(s, "priority", priorities)
    releaser = Releaser(s, s.topic("jobs"))
    output = Output(kafka_bootstrap, out, 3)
    try:
        first = releaser.run_batch(0)
        urgent = add_buffer(s, "priority", [0] * 10, first_offset=1000)
        second = releaser.run_batch(1)
        run_until(releaser, lambda: not len(releaser.pending) and releaser.idle)
        records = output.wait_for(130)
    finally:
        releaser.finish()
        output.close()
    assert (first.released, second.released) == (50, 50)
    assert all(s.released <= 50 for s in releaser.stats)
    # Batch 0: the 50 lowest, in order. Then the urgent ones overtake, then the rest in order.
    lowest = set(sorted(written, key=lambda mid: priorities[written.index(mid)])[:50])
    priority = dict(zip(written, priorities, strict=True)) | dict.fromkeys(urgent, 0)
    rank = {mid: (mid not in lowest, p, mid) for mid, p in priority.items()}
    for part in by_partition(records).values():
        got = ids(part)
        assert got == sorted(got, key=rank.__getitem__)
    assert {int(header(r, "dejaq-priority")) for r in records} == set(priority.values())
    # Output keeps key and payload; same key, same partition; source coordinates in headers.
    r = next(r for r in records if header(r, "dejaq-id") == b"in-0-7")
    assert (r.key, r.value, header(r, "trace")) == (b"k2", b"payload-7", b"t7")
    assert header(r, "dejaq-source") == b"in/0/7"
    partitions_of_key = defaultdict(set)
    for r in records:
        partitions_of_key[r.key].add(r.partition)
    assert all(len(p) == 1 for p in partitions_of_key.values())
    assert len(ledger_released(s)) == 130


def test_cancelled_never_released_and_rescheduled_uses_the_new_key(
    kafka_bootstrap, topic_factory, tmp_path
):
    out = topic_factory(partitions=1)
    s = settings_for(tmp_path, kafka_bootstrap, "priority", out)
    written = add_buffer(s, "priority", [100 + i for i in range(20)])
    cancelled, rescheduled = written[3], written[15]
    add_ledger(
        s,
        [
            (cancelled, LedgerEvent.CANCELLED, None),
            (rescheduled, LedgerEvent.RESCHEDULED, 1),
        ],
    )
    releaser = Releaser(s, s.topic("jobs"))
    output = Output(kafka_bootstrap, out, 1)
    try:
        releaser.run_batch(0)
        records = output.wait_for(19)
        releaser.run_batch(1)
        assert output.poll() == 19, "nothing released twice"
    finally:
        releaser.finish()
        output.close()
    assert cancelled not in ids(records)
    assert ids(records)[0] == rescheduled
    assert header(records[0], "dejaq-priority") == b"1"
    assert sorted(ledger_released(s)) == sorted(set(written) - {cancelled})


def test_max_rate_caps_a_trigger_at_one_second_of_tokens(kafka_bootstrap, topic_factory, tmp_path):
    out = topic_factory(partitions=1)
    s = settings_for(tmp_path, kafka_bootstrap, "priority", out, max_rate=20)
    add_buffer(s, "priority", list(range(100)))
    releaser = Releaser(s, s.topic("jobs"))
    output = Output(kafka_bootstrap, out, 1)
    try:
        first, second = releaser.run_batch(0), releaser.run_batch(1)
        records = output.wait_for(20)
    finally:
        releaser.finish()
        output.close()
    assert first.released == 20, "a full bucket: one second's worth"
    refilled = 20 * (second.started_ms - first.started_ms) / 1000  # tokens since the first
    assert second.released <= refilled + 1, "then only what the rate refilled"
    assert [int(header(r, "dejaq-priority")) for r in records[:20]] == list(range(20))


@pytest.mark.parametrize("kind", ["priority", "timeline", "event_time"])
def test_a_rate_spent_is_not_idle_while_messages_are_due(
    kafka_bootstrap, topic_factory, tmp_path, kind
):
    """With max_rate, a trigger can take nothing while messages are due: `--once` stops
    at the first idle batch, which must not come before they are all released."""
    out = topic_factory(partitions=1)
    s = settings_for(tmp_path, kafka_bootstrap, kind, out, max_rate=2, allowed_lateness_ms=100)
    base = int(time.time() * 1000) - 60_000 if kind == "timeline" else 1000
    due = add_buffer(s, kind, [base + k for k in range(6)])
    # Due too but in event time: ahead by more than the lateness, it holds the watermark.
    last = add_buffer(s, kind, [base + 10_000], first_offset=6)
    if kind != "event_time":
        due += last
    releaser = Releaser(s, s.topic("jobs"))
    try:
        run_until(releaser, lambda: releaser.idle)
    finally:
        releaser.finish()
    assert sorted(ledger_released(s)) == sorted(due)


def test_event_time_sorts_within_the_lateness_bound_and_writes_late_ones(
    kafka_bootstrap, topic_factory, tmp_path
):
    out = topic_factory(partitions=1)
    s = settings_for(tmp_path, kafka_bootstrap, "event_time", out, allowed_lateness_ms=100)
    releaser = Releaser(s, s.topic("jobs"))
    output = Output(kafka_bootstrap, out, 1)
    # Waves of events, each shuffled within less than the allowed lateness.
    waves = [[1000 + (i * 7) % 90 + w * 60 for i in range(30)] for w in range(5)]
    try:
        offset = 0
        for batch, wave in enumerate(waves):
            add_buffer(s, "event_time", wave, first_offset=offset)
            offset += len(wave)
            releaser.run_batch(batch)
        late = add_buffer(s, "event_time", [1001], first_offset=offset)
        stats = releaser.run_batch(len(waves))
        top = max(max(w) for w in waves)
        held = sum(1 for w in waves for t in w if t > top - 100)
        records = output.wait_for(offset + 1 - held)
        assert len(releaser.pending) == held, "events within the lateness bound are held"
    finally:
        releaser.finish()
        output.close()
    times = [int(header(r, "dejaq-event-time")) for r in records]
    assert ids(records)[-1] == late[0] and stats.late == 1, "late: written at once, counted"
    assert times[:-1] == sorted(times[:-1]), "on time: in event-time order"
    assert max(times[:-1]) <= top - 100


def test_a_start_says_its_progress_reading_the_buffer(tmp_path, monkeypatch, caplog):
    """A start takes the whole buffer's pending rows in before it releases anything,
    seconds a hundred thousand rows: it says so, and its progress, a slice at a time
    (two rows here, thousands in production). Nothing is sent, so no Kafka runs."""
    monkeypatch.setattr(pending, "ROWS_AT_A_TIME", 2)
    monkeypatch.setattr(release, "ROWS_AT_A_TIME", 2)
    s = settings_for(tmp_path, "127.0.0.1:9", "priority", "out")
    add_buffer(s, "priority", [5, 4, 3, 2, 1])
    releaser = Releaser(s, s.topic("jobs"))
    with caplog.at_level("INFO", logger="dejaq.release"):
        releaser.refresh()
        releaser.refresh()  # later reads say nothing
    first, *lines = [r.getMessage().split(", ")[0] for r in caplog.records]
    assert first == "release jobs: reading the buffer's pending rows"
    assert all(re.fullmatch(r"release jobs: \d of 5 buffer rows read", line) for line in lines)
    done = [int(line.split()[2]) for line in lines]
    assert len(done) >= 2 and done[-1] == 5, "a line per slice, the last at the end"
    # The last line is at the end, however few rows the last slice held.
    assert all(b - a >= 2 for a, b in itertools.pairwise(done[:-1])), "a slice apart"
    assert done == sorted(set(done)), "each line further on"
    assert len(releaser.pending) == 5


def test_the_summary_at_exit_counts_every_batch_not_only_those_kept(
    kafka_bootstrap, topic_factory, tmp_path
):
    """A job runs far more batches than it keeps stats of: what it released and what
    came late in its first batches still count in the line it prints at exit."""
    out = topic_factory(partitions=1)
    s = settings_for(tmp_path, kafka_bootstrap, "event_time", out, allowed_lateness_ms=100)
    releaser = Releaser(s, s.topic("jobs"))
    output = Output(kafka_bootstrap, out, 1)
    try:
        first = add_buffer(s, "event_time", [1000 + i for i in range(20)] + [2000])
        assert releaser.run_batch(0).released == 20
        add_buffer(s, "event_time", [1500], first_offset=100)
        assert releaser.run_batch(1).late == 1
        idle = range(2, STATS_KEPT + 2)
        assert sum(releaser.run_batch(b).released for b in idle) == 0
        add_buffer(s, "event_time", [3000], first_offset=200)
        assert releaser.run_batch(idle.stop).released == 1, "2000, passed by 3000's watermark"
        output.wait_for(len(first) + 1)
    finally:
        releaser.finish()
        output.close()
    assert releaser.stats[0].batch_id > 1, "the first batches' stats are no longer kept"
    assert summary("jobs", releaser) == (
        f"release jobs: {STATS_KEPT + 3} batches, released 22, late 1, pending 1, "
        "settled removed from the buffer 0"
    )


def test_an_event_time_far_ahead_of_the_clock_leaves_the_watermark_alone(
    kafka_bootstrap, topic_factory, tmp_path
):
    """A row stored with an event time years ahead (a producer's clock or unit slip the
    ingest did not judge) is held, and the events around it still go out in order."""
    out = topic_factory(partitions=1)
    s = settings_for(tmp_path, kafka_bootstrap, "event_time", out, allowed_lateness_ms=1000)
    output = Output(kafka_bootstrap, out, 1)
    now = int(time.time() * 1000)
    waves = [
        [now + 300, now + 100, now + 200],
        [now + 10 * 365 * 86_400_000],
        [now + 2000, now + 1500, now + 1800],
        [now + 1900, now + 1600, now + 4000],
    ]
    releaser = Releaser(s, s.topic("jobs"))
    try:
        offset, stats = 0, []
        for batch, wave in enumerate(waves):
            add_buffer(s, "event_time", wave, first_offset=offset)
            offset += len(wave)
            stats.append(releaser.run_batch(batch))
        records = output.wait_for(8)
        held = len(releaser.pending)
    finally:
        releaser.finish()
    restarted = Releaser(s, s.topic("jobs"))
    try:
        add_buffer(s, "event_time", [now + 5000, now + 4500], first_offset=offset)
        stats.append(restarted.run_batch(len(waves)))
        records = output.wait_for(9)
    finally:
        restarted.finish()
        output.close()
    times = [int(header(r, "dejaq-event-time")) - now for r in records]
    assert times == [100, 200, 300, 1500, 1600, 1800, 1900, 2000, 4000]
    assert [x.late for x in stats] == [0] * 5
    assert held == 2, "the far one and now + 4000, within the lateness of the newest"


def event_rows(times: list[int], first_offset: int) -> pa.Table:
    """Buffer rows of these event times, as the release's pending set reads them."""
    offsets = range(first_offset, first_offset + len(times))
    return pa.table(
        {
            "message_id": [f"in-0-{o}" for o in offsets],
            "bucket": [0] * len(times),
            "sort_key": times,
            "key": [None] * len(times),
            "payload": [b"x"] * len(times),
            "headers": [[] for _ in times],
            "source_topic": ["in"] * len(times),
            "source_partition": [0] * len(times),
            "source_offset": list(offsets),
        }
    )


@settings(max_examples=300, deadline=None)
@given(
    lateness=st.integers(min_value=0, max_value=300),
    timeout=st.one_of(st.none(), st.integers(min_value=1, max_value=2000)),
    steps=st.lists(
        st.tuples(
            st.integers(min_value=0, max_value=3000),  # clock advance before the trigger
            st.lists(st.integers(min_value=0, max_value=2000), max_size=6),  # events read
        ),
        min_size=1,
        max_size=25,
    ),
)
def test_an_idle_timeout_releases_all_it_read_in_order_and_never_early(
    lateness: int, timeout: int | None, steps: list[tuple[int, list[int]]]
) -> None:
    """Triggers as the release runs them: read, follow the watermark, take up to it.
    The rule, kept here apart: an event may go once the largest event time read minus
    the lateness reaches it, or once a largest event time that reaches it stood unmoved
    for the idle timeout; and it goes then, in event-time order with those beside it."""
    pending, mark = PendingSet(), EventWatermark(lateness, timeout)
    now, offset, read, released = 0, 0, [], []
    top: int | None = None
    moved = allowed = None
    last_value: int | None = None
    for advance, times in [*steps, (timeout or 0, [])]:
        now += advance
        pending.add_buffer_rows(event_rows(times, offset))
        offset += len(times)
        read += times
        mark.follow(pending.max_sort_key, now)
        if times and (top is None or max(times) > top):
            top, moved = max(times), now
        if top is not None:
            bounds = [top - lateness]
            if timeout is not None and now - moved >= timeout:
                bounds.append(top)
            allowed = max(bounds) if allowed is None else max(allowed, *bounds)
        value = mark.value
        assert value == allowed
        assert last_value is None or value >= last_value, "the watermark never goes back"
        last_value = value
        taken = [m.sort_key for m in pending.take(10_000, up_to=value)]
        assert taken == sorted(taken), "released together: in event-time order"
        assert all(t <= allowed for t in taken), "never before the rule lets it go"
        nxt = pending.next_sort_key()
        assert nxt is None or allowed is None or nxt > allowed, "held past the rule"
        released += taken
    held = [m.sort_key for m in pending.take(10_000)]
    assert sorted(released + held) == sorted(read), "nothing lost, nothing twice"
    if timeout is not None:
        assert not held, "idle after the last read: all released"


@pytest.mark.parametrize("idle_timeout_ms", [None, 60_000])
def test_an_event_time_input_gone_quiet_lets_its_last_events_out_after_the_idle_timeout(
    kafka_bootstrap, topic_factory, tmp_path, monkeypatch, idle_timeout_ms
):
    """No further input: with idle_timeout_ms, the events within the lateness of the newest
    go out once that long has passed by the job's clock, in event-time order, and one
    read after at or below the newest is late; without it they stay held."""
    clock = [0]
    monkeypatch.setattr(release, "_monotonic_ms", lambda: clock[0])
    out = topic_factory(partitions=1)
    extra = {} if idle_timeout_ms is None else {"idle_timeout_ms": idle_timeout_ms}
    s = settings_for(tmp_path, kafka_bootstrap, "event_time", out, allowed_lateness_ms=100, **extra)
    releaser = Releaser(s, s.topic("jobs"))
    output = Output(kafka_bootstrap, out, 1)
    try:
        add_buffer(s, "event_time", [1000, 1150, 1100, 1190, 1120])
        assert releaser.run_batch(0).released == 1, "1000, below 1190 - 100"
        clock[0] = 59_999
        assert releaser.run_batch(1).released == 0, "not before the idle timeout"
        clock[0] = 10 * 3600 * 1000 if idle_timeout_ms is None else 60_000
        stats = releaser.run_batch(2)
        if idle_timeout_ms is None:
            assert stats.released == 0 and len(releaser.pending) == 4, "held for ever"
            assert len(output.to_end()) == 1
            return
        assert stats.released == 4 and not len(releaser.pending)
        late = add_buffer(s, "event_time", [1170], first_offset=5)
        stats = releaser.run_batch(3)
        assert (stats.released, stats.late) == (1, 1), "below the idle watermark: late"
        add_buffer(s, "event_time", [1250], first_offset=6)
        assert releaser.run_batch(4).released == 0, "a newer event waits its lateness again"
        records = output.wait_for(6)
    finally:
        releaser.finish()
        output.close()
    times = [int(header(r, "dejaq-event-time")) for r in records]
    assert times == [1000, 1100, 1120, 1150, 1190, 1170]
    assert ids(records)[-1] == late[0]


def test_the_idle_timeout_runs_on_the_jobs_own_clock(kafka_bootstrap, topic_factory, tmp_path):
    """The real clock: the held events come out once the timeout has passed, not before."""
    out = topic_factory(partitions=1)
    s = settings_for(
        tmp_path, kafka_bootstrap, "event_time", out, allowed_lateness_ms=100, idle_timeout_ms=500
    )
    releaser = Releaser(s, s.topic("jobs"))
    output = Output(kafka_bootstrap, out, 1)
    try:
        add_buffer(s, "event_time", [1150, 1100, 1190])
        started = time.monotonic()
        run_until(releaser, lambda: not len(releaser.pending), timeout=30)
        waited = time.monotonic() - started
        records = output.wait_for(3)
    finally:
        releaser.finish()
        output.close()
    assert waited >= 0.5
    assert [int(header(r, "dejaq-event-time")) for r in records] == [1100, 1150, 1190]


def test_the_streaming_job_releases_as_due(spark, kafka_bootstrap, topic_factory, tmp_path):
    out = topic_factory(partitions=2)
    s = settings_for(tmp_path, kafka_bootstrap, "timeline", out, release_interval_ms=100)
    now = int(time.time() * 1000)
    written = add_buffer(s, "timeline", [now - 1000 + i * 40 for i in range(60)])
    job = ReleaseJob(spark, s, s.topic("jobs"))
    output = Output(kafka_bootstrap, out, 2)
    query = job.start()
    try:
        records = output.wait_for(60, timeout=90)
    finally:
        stop_between_batches(query)
        job.releaser.finish()
        output.close()
    assert query.exception() is None
    assert sorted(ids(records)) == sorted(written)
    assert all(r.timestamp >= int(header(r, "dejaq-deliver-at")) for r in records)
    assert sorted(ledger_released(s)) == sorted(written), "a clean stop records every send"


def test_ingested_records_come_out_with_their_envelope(
    spark, kafka_bootstrap, topic_factory, tmp_path
):
    source, out = topic_factory(partitions=2), topic_factory(partitions=2)
    conf = tmp_path / "dejaq.yaml"
    conf.write_text(
        f"warehouse: {tmp_path / 'warehouse'}\n"
        f"kafka: {{bootstrap: '{kafka_bootstrap}'}}\n"
        f"topics:\n  - {{name: jobs, kind: timeline, source: [{source}], buckets: 4,"
        f" delivery: release, output: {out}}}\n"
    )
    s = load_settings(conf, env={})
    now = int(time.time() * 1000)
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    for i in range(30):
        headers = [("dejaq-deliver-at", str(now - 500 + i * 50).encode()), ("trace", b"x")]
        producer.send(source, key=f"k{i}".encode(), value=f"v{i}".encode(), headers=headers)
    producer.flush()
    producer.close()
    run_to_end(IngestJob(spark, s, s.topic("jobs"), detect_connectors(spark)).start(once=True))

    releaser = Releaser(s, s.topic("jobs"))
    output = Output(kafka_bootstrap, out, 2)
    try:
        run_until(releaser, lambda: not len(releaser.pending) and releaser.idle)
        records = output.wait_for(30)
    finally:
        releaser.finish()
        output.close()
    for r in records:
        topic, partition, offset = header(r, "dejaq-source").decode().rsplit("/", 2)
        assert (
            topic == source and header(r, "dejaq-id") == f"{source}-{partition}-{offset}".encode()
        )
        assert r.timestamp >= int(header(r, "dejaq-deliver-at"))
        assert (r.value, header(r, "trace")) == (b"v" + r.key[1:], b"x")
    assert len(set(ids(records))) == 30


@pytest.mark.slow
@pytest.mark.parametrize("connectors", ["jvm", "python"])
def test_kill_9_then_restart_loses_nothing_and_repeats_only_the_cut_batch(
    spark, kafka_bootstrap, topic_factory, tmp_path, connectors
):
    """The buffer is written by that path's ingest, from Kafka; the release job reads it
    with delta-rs and produces with one ordered producer on either path."""
    source, out = topic_factory(partitions=3), topic_factory(partitions=3)
    conf = write_conf(tmp_path, kafka_bootstrap, "priority", out, source=source, max_per_trigger=20)
    s = load_settings(conf, env={})
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    for i in range(600):
        priority = str((i * 13) % 500).encode()
        producer.send(source, key=f"k{i % 5}".encode(), headers=[("dejaq-priority", priority)])
    producer.flush()
    producer.close()
    ingest = IngestJob(spark, s, s.topic("jobs"), detect_connectors(spark, connectors))
    run_to_end(ingest.start(once=True))
    buffer = scan(ensure_table(s.warehouse, Table.BUFFER, "jobs"), Table.BUFFER)
    written = buffer.column("message_id").to_pylist()
    assert len(written) == 600
    env = {
        **os.environ,
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "DEJAQ_SPARK_CONNECTORS": connectors,
    }
    proc = subprocess.Popen(
        [*DEJAQ, "release", "--topic", "jobs", "--conf-file", str(conf)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    output = Output(kafka_bootstrap, out, 3)
    try:
        try:
            output.wait_for(100, timeout=120)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.communicate(timeout=60)
        recorded = set(ledger_released(s))
        assert len(recorded) < len(written), "killed mid-stream"

        spark_submit = str(Path(sys.executable).parent / "spark-submit")
        jars = ["--jars", ",".join(map(str, jvm.jars(jvm.SPARK)))] if connectors == "jvm" else []
        result = subprocess.run(
            [
                spark_submit,
                *jars,
                "jobs/release.py",
                "--topic",
                "jobs",
                "--conf-file",
                str(conf),
                "--once",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
            env=env,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        records = output.wait_for(len(written))
        output.poll()
    finally:
        output.close()
    seen = Counter(ids(records))
    assert set(seen) == set(written), "nothing lost"
    repeated = {mid for mid, n in seen.items() if n > 1}
    assert all(n <= 2 for n in seen.values())
    assert not repeated & recorded, "a message the ledger has is never written again"
    assert len(repeated) <= 20, "duplicates only from the one batch cut by the kill"
    assert sorted(ledger_released(s)) == sorted(written)


def test_a_null_header_value_leaves_empty_and_holds_nothing_back(
    kafka_bootstrap, topic_factory, tmp_path
):
    """Kafka allows a header with a null value, and the ingest keeps it; kafka-python
    refuses to send one, which would stop the release at that message for good."""
    out = topic_factory(partitions=1)
    s = settings_for(tmp_path, kafka_bootstrap, "priority", out)
    written = add_buffer(s, "priority", [1, 2, 3], trace=lambda o: None if o == 0 else b"t")
    releaser = Releaser(s, s.topic("jobs"))
    output = Output(kafka_bootstrap, out, 1)
    try:
        assert releaser.run_batch(0).released == 3
        records = output.wait_for(3)
    finally:
        releaser.finish()
        output.close()
    assert ids(records) == written
    assert [header(r, "trace") for r in records] == [b"", b"t", b"t"]
    assert sorted(ledger_released(s)) == sorted(written)


@pytest.mark.parametrize("kind", ["priority", "timeline", "event_time"])
def test_a_record_keeps_its_own_headers_and_leaves_with_the_envelope_in_force(
    kafka_bootstrap, topic_factory, tmp_path, kind
):
    """The release writes the envelope as released (`dejaq-id`, the sort key in force,
    `dejaq-source`) in place of the input's envelope headers and `dejaq-source`; every
    other header leaves as it came, in its order, whatever its name begins with."""
    out = topic_factory(partitions=1)
    lateness = {"allowed_lateness_ms": 0} if kind == "event_time" else {}
    s = settings_for(tmp_path, kafka_bootstrap, kind, out, **lateness)
    base = int(time.time() * 1000) - 60_000 if kind != "priority" else 0
    stale = (
        ("dejaq-trace", b"a"),
        ("dejaq-priority", b"9"),
        ("dejaq-deliver-at", b"1"),
        ("Dejaq-Tenant", b"b"),
        ("dejaq-event-time", b"1"),
        ("dejaq-id", b"other"),
        ("dejaq-source", b"elsewhere/0/0"),
        ("dejaq-", b"c"),
    )
    written = add_buffer(s, kind, [base + 1, base + 2], more_headers=stale)
    releaser = Releaser(s, s.topic("jobs"))
    output = Output(kafka_bootstrap, out, 1)
    try:
        run_until(releaser, lambda: len(ledger_released(s)) == len(written))
        records = output.to_end()
    finally:
        releaser.finish()
        output.close()
    sort_key = {"priority": "dejaq-priority", "timeline": "dejaq-deliver-at"}.get(
        kind, "dejaq-event-time"
    )
    assert [r.headers for r in records] == [
        [
            ("trace", f"t{n}".encode()),
            ("dejaq-trace", b"a"),
            ("Dejaq-Tenant", b"b"),
            ("dejaq-", b"c"),
            ("dejaq-id", mid.encode()),
            (sort_key, str(base + 1 + n).encode()),
            ("dejaq-source", f"in/0/{n}".encode()),
        ]
        for n, mid in enumerate(written)
    ]


@pytest.mark.parametrize("kind", ["priority", "timeline"])
def test_a_record_of_headers_only_leaves_with_an_empty_value(
    kafka_bootstrap, topic_factory, tmp_path, kind
):
    """Kafka allows a record without key and value, and the ingest keeps it; kafka-python
    refuses to send one, which would stop the release at that message for good."""
    out = topic_factory(partitions=1)
    s = settings_for(tmp_path, kafka_bootstrap, kind, out)
    base = int(time.time() * 1000) - 60_000 if kind == "timeline" else 0
    written = add_buffer(s, kind, [base + k for k in (1, 2, 3)], bare=frozenset({1}))
    releaser = Releaser(s, s.topic("jobs"))
    output = Output(kafka_bootstrap, out, 1)
    try:
        run_until(releaser, lambda: len(ledger_released(s)) == 3)
        records = output.wait_for(3)
    finally:
        releaser.finish()
        output.close()
    assert ids(records) == written
    assert [(r.key, r.value) for r in records] == [
        (b"k0", b"payload-0"),
        (None, b""),
        (b"k2", b"payload-2"),
    ]
    assert sorted(ledger_released(s)) == sorted(written)


@given(
    sends=st.lists(st.tuples(st.integers(0, 2), st.booleans()), max_size=30),
)
def test_a_send_counts_as_released_only_behind_no_failure_of_its_partition(sends) -> None:
    """A failed batch lets the idempotent producer send the ones queued behind it: those
    acknowledged are sent again after the failed ones, or the partition keeps them ahead."""
    partitions = [p for p, _ in sends]
    released = in_partition_order(partitions, [ok for _, ok in sends])
    for n, (partition, ok) in enumerate(sends):
        behind_a_failure = any(not o for p, o in sends[:n] if p == partition)
        assert released[n] == (ok and not behind_a_failure), (n, sends)


class StandInProducer:
    """A stand-in for the release's KafkaProducer, since a real Kafka cannot be made to
    fail one batch while it acknowledges a later one of the same partition. It hands out
    kafka-python's own futures, on the partition `partition_of` the record's key, and the
    test answers each (`sent`, in send order); it writes nothing anywhere."""

    def __init__(self, partition_of: Callable[[bytes | None], int] = lambda _: 0) -> None:
        self.partition_of = partition_of
        self.sent: list[FutureProduceResult] = []

    def send(
        self,
        topic: str,
        key: bytes | None = None,
        value: bytes | None = None,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> FutureRecordMetadata:
        produced = FutureProduceResult(TopicPartition(topic, self.partition_of(key)))
        self.sent.append(produced)
        return FutureRecordMetadata(produced, 0, -1, None, 0, 0, 0)

    def flush(self, timeout: float | None = None) -> None:
        """Answers come from the test alone."""

    def close(self, timeout: float | None = None) -> None:
        """Nothing to release."""


def answer(produced: FutureProduceResult, ok: bool, offset: int = 0) -> None:
    """Kafka's answer to a send: acknowledged at `offset`, or failed as a batch that
    timed out."""
    if ok:
        produced.success((offset, -1, None))
    else:
        produced.failure(KafkaTimeoutError("batch expired"))


@settings(max_examples=50, deadline=None)
@given(
    sends=st.lists(st.tuples(st.integers(0, 2), st.booleans()), min_size=1, max_size=12),
    data=st.data(),
)
def test_the_timed_sender_takes_an_ack_only_behind_no_failure_of_its_partition(sends, data) -> None:
    """Whatever order Kafka answers in, the timeline's sender hands the ledger an
    acknowledged message only once every earlier send of its partition was acknowledged.
    One acknowledged behind a failure (the idempotent producer sends on past a batch it
    drops) comes back with the failed ones, in order, to be sent again after them."""
    messages = [
        Message(f"m{n}", 0, n, str(p).encode(), b"", [], "in", 0, n)
        for n, (p, _) in enumerate(sends)
    ]
    answers = data.draw(st.permutations(range(len(sends))))
    producer = StandInProducer(lambda key: int(key or b"0"))
    sender = TimedSender(producer, "out", lambda m: (m.key, m.payload, []), 5.0)  # type: ignore[arg-type]
    sender.schedule(messages)
    wait_until(lambda: len(producer.sent) == len(sends), what="every message sent")
    answered: set[int] = set()
    taken: list[int] = []
    for n in answers:
        answer(producer.sent[n], sends[n][1], n)
        answered.add(n)
        for m in sender.take_acked():
            k = m.source_offset
            earlier = [i for i in range(k) if sends[i][0] == sends[k][0]]
            assert all(sends[i][1] and i in answered for i in earlier), (k, sends, answers)
            taken.append(k)
    assert sender.stop() == []
    taken += [m.source_offset for m in sender.take_acked()]
    in_order = [
        ok and all(o for p, o in sends[:n] if p == partition)
        for n, (partition, ok) in enumerate(sends)
    ]
    assert sorted(taken) == [n for n, w in enumerate(in_order) if w]
    assert [m.source_offset for m in sender.failed] == [n for n, w in enumerate(in_order) if not w]


@pytest.mark.parametrize("error", [KafkaTimeoutError, MessageSizeTooLargeError])
def test_a_timeline_ack_behind_a_failed_send_is_sent_again_after_it(
    kafka_bootstrap, topic_factory, tmp_path, error
):
    """Three due timeline messages of one partition: Kafka acknowledges the first and the
    third and fails the second. The ledger records only the first; the second and third
    reach the output again, in order: after a restart when the error stops the job, or
    at once, one at a time, after a refusal."""
    out = topic_factory(partitions=1)
    s = settings_for(tmp_path, kafka_bootstrap, "timeline", out)
    base = int(time.time() * 1000) - 60_000
    written = add_buffer(s, "timeline", [base + k for k in (1, 2, 3)])
    stand_in = StandInProducer()
    releaser = Releaser(s, s.topic("jobs"))
    releaser._producer = stand_in  # type: ignore[assignment]
    output = Output(kafka_bootstrap, out, 1)
    try:
        releaser.run_batch(0)
        wait_until(lambda: len(stand_in.sent) == 3, what="the three messages sent")
        answer(stand_in.sent[0], True, 0)
        answer(stand_in.sent[2], True, 1)
        releaser.run_batch(1)
        assert ledger_released(s) == written[:1], "the third waits for the second's answer"
        stand_in.sent[1].failure(error("failed"))
        if error is KafkaTimeoutError:
            with pytest.raises(RuntimeError, match="failed"):
                releaser.run_batch(2)
            assert ledger_released(s) == written[:1], "the job stops with the third unreleased"
            releaser.finish()
            releaser = Releaser(s, s.topic("jobs"))
            run_until(releaser, lambda: not len(releaser.pending) and releaser.idle, first=3)
        else:
            releaser.run_batch(2)
        records = output.to_end()
    finally:
        releaser.finish()
        output.close()
    assert ids(records) == written[1:], "the failed one and the one behind it, in order"
    assert sorted(ledger_released(s)) == sorted(written)


def read_dead_letters(settings: Settings) -> list[dict]:
    path = ensure_table(settings.warehouse, Table.DEAD_LETTER, "jobs")
    return scan(path, Table.DEAD_LETTER).to_pylist()


@pytest.mark.parametrize("kind", ["priority", "timeline"])
def test_a_record_kafka_refuses_is_dead_lettered_and_the_rest_flow(kafka_bootstrap, tmp_path, kind):
    """Kafka refuses one record for good (larger than its topic takes), and with it every
    record the idempotent producer held: sent again, it would stop the release there
    each time. It goes to the dead letters whole, with the reason, and the ledger says
    it is dead; the messages before and after it are released once each, in order."""
    out = f"small-{uuid.uuid4().hex[:10]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    admin.create_topics([NewTopic(out, 1, 1, topic_configs={"max.message.bytes": "10000"})])
    s = settings_for(tmp_path, kafka_bootstrap, kind, out)
    base = int(time.time() * 1000) - 60_000 if kind == "timeline" else 0
    before = add_buffer(s, kind, [base + k for k in (1, 2, 3)])
    # Past the producer's batch size (16 KB), so sent in a batch of its own.
    big = add_buffer(s, kind, [base + 4], first_offset=3, payload_bytes=20_000)
    after = add_buffer(s, kind, [base + k for k in (5, 6)], first_offset=4)
    output = Output(kafka_bootstrap, out, 1)
    releaser = Releaser(s, s.topic("jobs"))
    try:
        run_until(releaser, lambda: len(ledger_released(s)) == 5 and bool(read_dead_letters(s)))
        releaser.finish()
        records = output.to_end()
    finally:
        releaser.finish()
        output.close()
        admin.delete_topics([out])
        admin.close()
    assert ids(records) == before + after
    assert sorted(ledger_released(s)) == sorted(before + after)
    [letter] = read_dead_letters(s)
    assert (letter["message_id"], letter["reason"]) == (
        big[0],
        "kafka_refused: MessageSizeTooLargeError",
    )
    assert letter["payload"] == b"x" * 20_000
    ledger = scan(ensure_table(s.warehouse, Table.LEDGER, "jobs"), Table.LEDGER)
    assert [r["message_id"] for r in ledger.to_pylist() if r["event"] == LedgerEvent.DEAD] == big


def test_a_checkpoint_made_anew_releases_on_from_batch_zero(
    kafka_bootstrap, topic_factory, tmp_path
):
    """The job's Spark checkpoint is deleted: batches count from 0 again, below the
    ledger's last. Taken for replays, nothing would be released for as many batches as
    the job had run; they release what is pending, and nothing twice."""
    out = topic_factory(partitions=1)
    s = settings_for(tmp_path, kafka_bootstrap, "priority", out, max_per_trigger=2)
    first = add_buffer(s, "priority", [1, 2, 3, 4, 5])
    output = Output(kafka_bootstrap, out, 1)
    try:
        before = Releaser(s, s.topic("jobs"))
        try:
            run_until(before, lambda: not len(before.pending), first=0)
        finally:
            before.finish()
        assert before._last_batch is not None and before._last_batch >= 2
        later = add_buffer(s, "priority", [6, 7], first_offset=5)
        anew = Releaser(s, s.topic("jobs"))
        try:
            stats = anew.run_batch(0)
        finally:
            anew.finish()
        records = output.to_end()
    finally:
        output.close()
    assert (stats.replay, stats.released) == (False, 2)
    assert ids(records) == first + later, "each once, in order"
    assert sorted(ledger_released(s)) == sorted(first + later)


@pytest.fixture
def own_kafka(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """A Kafka of the test's own (bootstrap, its JVM), to stop with SIGSTOP: the run's
    shared one serves the other tests."""
    port = free_port()
    proc = embedded_kafka.start(port, tmp_path / "kafka")
    try:
        yield f"127.0.0.1:{port}", proc
    finally:
        os.kill(proc.pid, signal.SIGCONT)  # a stopped JVM would not act on the SIGTERM
        stop(proc, timeout=20)


class Job(threading.Thread):
    """A release job on the driver, as `dejaq release` runs one: batches until all is
    released or a batch raises (`error`), then `finish`."""

    def __init__(self, releaser: Releaser) -> None:
        super().__init__(name="release-job", daemon=True)
        self.releaser = releaser
        self.batch = 0  # the next batch's id
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            while len(self.releaser.pending) or not self.releaser.idle:
                self.releaser.run_batch(self.batch)
                self.batch += 1
        except Exception as e:
            self.error = e
        finally:
            self.releaser.finish()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["priority", "timeline"])
def test_kafka_gone_past_the_delivery_timeout_ends_the_job_and_a_restart_loses_nothing(
    own_kafka, tmp_path, monkeypatch, kind
):
    """Kafka stops answering mid-release (its JVM SIGSTOPped) for longer than the
    producer's delivery timeout, then answers again: kafka-python's idempotent producer
    may then never finish a flush. The job's waits are bounded: it fails with an error
    and its close returns, and a restart releases every message, repeating only ones
    the ledger did not record."""
    bootstrap, kafka = own_kafka
    # Minutes in production, seconds here: the outage only has to outlast them.
    monkeypatch.setattr(release, "DELIVERY_TIMEOUT_MS", 6000)
    monkeypatch.setattr(release, "REQUEST_TIMEOUT_MS", 2000)
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic("out", 3, 1)])
    admin.close()
    s = settings_for(tmp_path, bootstrap, kind, "out", max_per_trigger=300)
    base = int(time.time() * 1000) - 600_000 if kind == "timeline" else 0
    written = add_buffer(s, kind, [base + k for k in range(6000)], payload_bytes=1000)
    output = Output(bootstrap, "out", 3)
    job = Job(Releaser(s, s.topic("jobs")))
    try:
        job.start()
        output.wait_for(600, timeout=120)
        os.kill(kafka.pid, signal.SIGSTOP)
        try:
            time.sleep(2 * release.send_wait_s())  # the outage itself, not a wait for a state
        finally:
            os.kill(kafka.pid, signal.SIGCONT)
        job.join(release.send_wait_s() + release.CLOSE_TIMEOUT_S + 60)
        assert not job.is_alive(), "the job ends, its close included"
        assert isinstance(job.error, RuntimeError), job.error
        assert "sending to Kafka topic out failed" in str(job.error)
        recorded = set(ledger_released(s))
        assert len(recorded) < len(written), "the job failed mid-release"

        again = Releaser(s, s.topic("jobs"))
        try:
            run_until(
                again, lambda: not len(again.pending) and again.idle, timeout=180, first=job.batch
            )
        finally:
            again.finish()
        records = output.to_end()
    finally:
        output.close()
    seen = Counter(ids(records))
    assert set(seen) == set(written), "nothing lost"
    assert not {mid for mid, n in seen.items() if n > 1} & recorded, "the ledger's not again"
    assert sorted(ledger_released(s)) == sorted(written)


def test_a_timed_send_kafka_never_answers_stops_the_sender_with_an_error() -> None:
    """A producer stuck for good (kafka-python's idempotent one after a long outage:
    made here by a stand-in whose sends the test never answers, as a real one cannot be
    made stuck on demand) would leave the timeline job running and releasing nothing.
    Past its wait, an unanswered send is the sender's error, the job's end, and the
    message is among the failed, to be sent again by the next start."""
    producer = StandInProducer()
    sender = TimedSender(producer, "out", lambda m: (m.key, m.payload, []), 0.2)  # type: ignore[arg-type]
    due = Message("m0", 0, 0, b"k", b"", [], "in", 0, 0)
    sender.schedule([due])
    wait_until(lambda: len(producer.sent) == 1, what="the message sent")
    assert isinstance(wait_until(lambda: sender.error, what="the error"), KafkaTimeoutError)
    assert "has not answered a send to out" in str(sender.error)
    assert sender.stop() == []
    assert sender.take_acked() == [] and sender.failed == [due]
