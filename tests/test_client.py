"""The Python client and worker against real 3-node broker clusters (real HTTP, Raft, Delta)."""

from __future__ import annotations

import collections
import itertools
import logging
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import Lines, drop_first_answer, wait_until
from hypothesis import given
from hypothesis import strategies as st
from test_broker import buffer_rows, fill
from test_broker_cluster import leader_of, start, stop, write_conf

from dejaq.client import (
    Backoff,
    Client,
    Conflict,
    InvalidRequest,
    Message,
    NewMessage,
    NotFound,
    PayloadTooLarge,
    Worker,
)
from dejaq.client.worker import MIN_POLL_S
from dejaq.jobs import cluster
from dejaq.jobs.cluster import Node
from dejaq.jobs.ports import free_port


class Transient(Exception):
    """A failure worth retrying."""


class Permanent(Exception):
    """A message no retry will handle."""


@pytest.fixture(scope="module")
def three(tmp_path_factory, kafka_bootstrap: str, kafka_source: str) -> Iterator[tuple]:
    """A 3-node cluster for the tests that do not kill nodes; each uses its own topic."""
    tmp_path = tmp_path_factory.mktemp("client")
    conf = write_conf(tmp_path, kafka_bootstrap, kafka_source, 3000)
    cron_topic = f"  - {{name: sched, kind: cron, source: [unused-{kafka_source}], buckets: 2}}\n"
    topics = "".join(
        f"  - {{name: {name}, kind: priority, source: [{kafka_source}], buckets: 2}}\n"
        for name in ("acks", "poison", "idle", "trim", "retried", "reworked")
    )
    conf.write_text(conf.read_text() + cron_topic + topics)
    nodes = start(tmp_path, conf)
    try:
        yield nodes, str(tmp_path / "warehouse")
    finally:
        stop(nodes)


def urls(nodes: list[Node]) -> list[str]:
    return [n.url for n in nodes]


def test_client_models_have_the_routes_fields() -> None:
    """The client's dataclasses mirror the routes' response models: a field the broker
    adds or renames fails here, not in a worker."""
    import dataclasses

    from dejaq.broker.api import responses
    from dejaq.broker.api.routers.leases import LeasedMessage
    from dejaq.broker.api.routers.messages import Peeked
    from dejaq.broker.api.routers.schedules import ScheduleOut
    from dejaq.client import models

    pairs = [(models.Message, LeasedMessage), (models.Peeked, Peeked)]
    pairs.append((models.Schedule, ScheduleOut))
    shared = [
        name
        for name, value in vars(responses).items()
        if isinstance(value, type) and value.__module__ == responses.__name__
    ]
    assert len(shared) == 15, shared
    pairs += [(getattr(models, n), getattr(responses, n)) for n in shared]
    for mine, theirs in pairs:
        fields = {f.name for f in dataclasses.fields(mine) if f.init}
        assert fields == set(theirs.model_fields), mine.__name__


def test_decode_makes_nested_models_from_json() -> None:
    """Unions with None, bytes from base64, lists and dicts, dataclasses in dataclasses:
    each type's decoder is built once and serves every object after."""
    from dejaq.client import models

    message = {
        "id": "m1",
        "bucket": 2,
        "sort_key": 7,
        "priority": None,
        "deliver_at": None,
        "key": None,
        "payload": "cGF5bG9hZA==",
        "deliveries": 1,
        "lease_deadline": 99,
        "receipt": 1025,
        "added_by_a_newer_broker": True,
    }
    tombstone = {**message, "id": "m3", "payload": None}
    got = models.decode(list[Message], [message, {**message, "id": "m2", "key": "aw=="}, tombstone])
    assert [(m.id, m.key, m.payload, m.receipt) for m in got] == [
        ("m1", None, b"payload", 1025),
        ("m2", b"k", b"payload", 1025),
        ("m3", None, None, 1025),
    ]
    bucket = {"bucket": 0, "consumer_id": None, "pending": 1, "leased": 0}
    bucket |= {"deliverable_now": 1, "oldest_age_ms": None}
    counts = {"pending": 1, "delayed": 0, "leased": 0, "deliverable_now": 1, "acked": 3}
    counts |= {"dead": 0, "cancelled": 0, "oldest_age_ms": 5, "consumers": ["c"]}
    stats = {"name": "t", "kind": "priority", "buckets": 1, "paused": False, **counts}
    decoded = models.decode(models.TopicStats, {**stats, "per_bucket": [bucket]})
    assert decoded.per_bucket == [models.BucketStats(**bucket)] and decoded.consumers == ["c"]
    skipped = {"redriven": 1, "skipped": {"m9": "not_dead"}}
    assert models.decode(models.Redriven, skipped) == models.Redriven(1, {"m9": "not_dead"})


def test_the_client_is_its_own_small_distribution(tmp_path: Path) -> None:
    """`pip install ./client` in a bare venv: the client and httptools come, nothing
    else, and importing the client and the worker loads no Spark, NumPy, pyarrow or
    pydantic."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    source = tmp_path / "client"  # pip builds in the tree: not in the checkout's
    shutil.copytree(Path(__file__).resolve().parents[1] / "client", source)
    pip = [py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, str(source)], check=True)
    listed = subprocess.run(
        [py, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True, check=True
    ).stdout.lower()
    installed = {line.split("==")[0] for line in listed.split()}
    assert installed - {"pip", "setuptools", "wheel"} == {"dejaq-client", "httptools"}
    for heavy in ("pyspark", "numpy", "pyarrow", "pandas", "pydantic", "deltalake", "fastapi"):
        assert heavy not in installed, heavy
    code = (
        "import sys; from dejaq.client import Client, Worker, Backoff; "
        "c = Client(['127.0.0.1:1'], deadline=0.5); print(sorted(sys.modules))"
    )
    out = subprocess.run([py, "-c", code], capture_output=True, text=True, check=True).stdout
    for server in ("pyspark", "numpy", "pyarrow", "pydantic", "dejaq.broker"):
        assert f"'{server}'" not in out, server


@given(base=st.integers(1, 10_000), cap=st.integers(1, 10**7), n=st.integers(1, 200))
def test_backoff_doubles_per_delivery_up_to_the_cap(base: int, cap: int, n: int) -> None:
    b = Backoff(base_ms=base, max_ms=cap)
    assert b.delay_ms(1) == min(base, cap)
    assert b.delay_ms(n + 1) == min(cap, 2 * b.delay_ms(n)) or b.delay_ms(n) == cap
    assert b.delay_ms(n) <= b.delay_ms(n + 1) <= cap


def test_typed_calls_and_typed_errors(three, kafka_source: str) -> None:
    nodes, warehouse = three
    fill(warehouse, "jobs", buffer_rows([30, 10, 20, 40], bucket_of=lambda i: 0, prefix="c"))
    dead = f"127.0.0.1:{free_port()}"  # nothing listens: the client moves on
    with Client([dead, *urls(nodes)], deadline=20) as c:
        assert {t.name: t.kind for t in c.topics()}["later"] == "timeline"
        # every node was ready, so registered; this one may still be applying the others'
        view = wait_until(lambda: next((v for v in [c.cluster()] if len(v.nodes) == 3), None))
        assert view.role in ("leader", "follower")
        assert sorted(view.nodes.values()) == sorted(n.http for n in nodes)
        assert c.node != f"http://{dead}"
        assert c.heartbeat("jobs", "w").buckets == [0, 1, 2, 3]

        got = c.lease("jobs", "w", max_messages=2, lease_ms=60_000, wait_ms=5000)
        assert [(m.id, m.priority, m.deliveries) for m in got] == [("c1", 10, 1), ("c2", 20, 1)]
        assert got[0].payload == b"payload-c1" and got[0].key == b"k1"
        assert got[0].held_until > time.monotonic() + 50
        ext = c.extend("jobs", "w", ["c1", "c2"], lease_ms=120_000)
        assert ext.settled == 2 and ext.lease_deadline > got[0].lease_deadline
        assert c.ack("jobs", "w", ["c1"]).settled == 1
        wait_until(lambda: c.cluster().commit_index > view.commit_index, what="commits seen")
        with pytest.raises(Conflict) as again:
            c.ack("jobs", "w", ["c1", "c9"])
        assert again.value.status == 409 and again.value.settled == 0
        assert again.value.refused == {"c1": "already_settled", "c9": "not_leased"}
        assert not again.value.maybe_applied

        assert c.nack("jobs", "w", ["c2"], delay_ms=0, priority=5).settled == 1
        [back] = c.lease("jobs", "w", lease_ms=60_000, wait_ms=5000)
        assert (back.id, back.priority, back.deliveries) == ("c2", 5, 2), "new priority, +1"
        assert c.extend("jobs", "w", receipts=[back.receipt], lease_ms=90_000).settled == 1
        assert c.reject("jobs", "w", receipts=[back.receipt]).settled == 1
        with pytest.raises(Conflict) as stale:  # the first delivery's receipt, nacked since
            c.ack("jobs", "w", receipts=[got[1].receipt, back.receipt])
        assert stale.value.refused == {
            str(got[1].receipt): "not_leased",
            str(back.receipt): "already_settled",
        }
        with pytest.raises(ValueError, match="ids or by receipts"):
            c.ack("jobs", "w", ["c2"], receipts=[back.receipt])
        assert c.peek("jobs", "c2").status == "dead"

        pending = c.peek("jobs", "c0")
        assert (pending.status, pending.payload, pending.priority) == ("pending", b"payload-c0", 30)
        c.reschedule("jobs", "c0", priority=1)
        assert c.peek("jobs", "c0").sort_key == 1
        c.cancel("jobs", "c3")
        assert c.peek("jobs", "c3").status == "cancelled"
        with pytest.raises(Conflict) as cancelled:
            c.cancel("jobs", "c3")
        assert cancelled.value.reason == "already_settled"

        assert c.produce("jobs", b"\x00\xff", priority=7, key="k", id="my-1") == "my-1"
        ids = c.produce_batch("jobs", [NewMessage(b"a", priority=1), NewMessage(b"b", priority=2)])
        assert len(ids) == 2 and all(i.startswith(f"{kafka_source}-0-") for i in ids)

        stats = c.topic_stats("jobs")
        assert (stats.acked, stats.dead, stats.cancelled) == (1, 1, 1)
        assert stats.consumers == ["w"] and len(stats.per_bucket) == 4
        assert c.leave("jobs", "w").released == 0

        with pytest.raises(NotFound) as missing:
            c.lease("nope", "w")
        assert missing.value.status == 404
        with pytest.raises(NotFound):
            c.peek("jobs", "never-buffered")
        with pytest.raises(InvalidRequest) as invalid:
            c.lease("jobs", "w", max_messages=1001)
        assert ["body", "max_messages"] in [e["loc"] for e in invalid.value.errors]
        with pytest.raises(InvalidRequest) as unsorted:
            c.produce("jobs", b"x")
        assert unsorted.value.title == "missing priority"
        with pytest.raises(PayloadTooLarge):
            c.produce("jobs", b"x" * 1001, priority=1)


def test_operations_and_schedules(three) -> None:
    nodes, warehouse = three
    fill(warehouse, "fresh", buffer_rows([1, 2, 3], bucket_of=lambda i: 0, prefix="o"))
    with Client(urls(nodes)) as c:
        assert c.pause("fresh").paused is True
        assert c.lease("fresh", "w", wait_ms=200) == [] and c.topic_stats("fresh").paused
        assert c.resume("fresh").paused is False
        [dead] = c.lease("fresh", "w", lease_ms=60_000, wait_ms=5000)
        assert (dead.id, dead.deliveries) == ("o0", 1)
        c.reject("fresh", "w", [dead.id])
        redriven = c.redrive("fresh", ["o0", "nope"], priority=9)
        assert (redriven.redriven, redriven.skipped) == (1, {"nope": "not_dead"})
        assert c.redrive("fresh", every=True).redriven == 0, "once per death"
        with pytest.raises(InvalidRequest):
            c.redrive("fresh", ["o0"], every=True)
        [again] = c.lease("fresh", "w", lease_ms=60_000, wait_ms=5000)
        assert (again.id, again.deliveries, again.priority) == ("o1", 1, 2), "o0 sorts by 9 now"

        with pytest.raises(InvalidRequest) as unconfirmed:
            c.purge("fresh", "jobs")
        assert ["body", "confirm"] in [e["loc"] for e in unconfirmed.value.errors]
        assert c.purge("fresh", "fresh").cancelled == 2, "o2 and o0; o1 is leased"

        made = c.create_schedule(
            "sched",
            "30 2 1 1 *",
            b"\x00report",
            key="r",
            time_zone="Europe/Berlin",
            headers={"trace": "t1"},
            end=4_070_908_800_000,
            schedule_id="nightly",
        )
        assert (made.id, made.payload, made.key, made.headers) == (
            "nightly",
            b"\x00report",
            "r",
            {"trace": "t1"},
        )
        assert made.next_at is not None and made.end == 4_070_908_800_000
        generated = c.create_schedule("sched", "0 0 1 1 *", b"")
        assert len(generated.id) == 32 and generated.time_zone == "UTC"
        assert c.schedule("sched", "nightly") == made
        assert [s.id for s in c.schedules("sched")] == sorted(["nightly", generated.id])
        c.delete_schedule("sched", "nightly")
        with pytest.raises(NotFound):
            c.schedule("sched", "nightly")
        assert [s.id for s in c.schedules("sched")] == [generated.id]
        with pytest.raises(InvalidRequest) as bad:
            c.create_schedule("sched", "61 * * * *", b"")
        assert ["body", "cron"] in [e["loc"] for e in bad.value.errors]


def run_workers(workers: list[Worker]) -> list[threading.Thread]:
    threads = [threading.Thread(target=w.run, name=w.consumer_id) for w in workers]
    for t in threads:
        t.start()
    return threads


def test_workers_survive_a_leader_kill(tmp_path, kafka_bootstrap, kafka_source) -> None:
    """Every message handled and acked exactly once across a kill -9 of the leader; a
    handler's exception redelivers with deliveries + 1, a permanent one dead-letters."""
    total = 600
    permanent = {f"f{i}" for i in range(0, total, 40)}
    transient = {f"f{i}" for i in range(3, total, 7)} - permanent
    expected = {f"f{i}" for i in range(total)} - permanent
    conf = write_conf(tmp_path, kafka_bootstrap, kafka_source, heartbeat_ms=3000)
    rows = buffer_rows([i % 50 for i in range(total)], lambda i: i % 8, "f")
    fill(str(tmp_path / "warehouse"), "fo", rows)
    nodes = start(tmp_path, conf)
    lock = threading.Lock()
    seen: set[str] = set()
    calls: dict[str, list[tuple[int, float]]] = collections.defaultdict(list)
    acks: list[str] = []
    # Handlers started once a quarter is acked wait for the kill: however fast the
    # workers run beside it, the kill lands mid-run, with messages in hand.
    killed_leader = threading.Event()

    def handler(m: Message) -> None:
        with lock:
            first = m.id not in seen
            seen.add(m.id)
            calls[m.id].append((m.deliveries, time.monotonic()))
        if len(acks) >= total // 4:
            killed_leader.wait(30)
        if m.id in permanent:
            raise Permanent(m.id)
        if m.id in transient and first:
            raise Transient(m.id)

    def acked(m: Message) -> None:
        with lock:
            acks.append(m.id)

    with httpx.Client() as http:
        leader = wait_until(lambda: leader_of(nodes, http), what="a leader")
    # The leader first: its kill leaves the clients facing a dead node, not a 503.
    order = [leader.url, *(n.url for n in nodes if n is not leader)]
    clients = [Client(order, deadline=30) for _ in range(3)]
    workers = [
        Worker(
            c,
            "fo",
            handler,
            consumer_id=f"w{i}",
            batch=5,
            lease_ms=10_000,
            wait_ms=500,
            backoff=Backoff(base_ms=50, max_ms=200),
            reject_on=(Permanent,),
            heartbeat_s=0.5,
            on_ack=acked,
        )
        for i, c in enumerate(clients)
    ]
    threads = run_workers(workers)
    try:
        wait_until(lambda: len(acks) >= total // 4, timeout=60, what="a quarter acked")
        cluster.stop_node(leader, kill=True)
        killed = time.monotonic()
        killed_leader.set()
        assert len(acks) < len(expected), "killed mid-run"
        wait_until(lambda: set(acks) >= expected, timeout=60, what="every message acked")
        assert {clients[0].peek("fo", m).status for m in permanent} == {"dead"}
        for w in workers:
            w.stop()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "each worker returns once stopped"
        assert clients[0].topic_stats("fo").consumers == [], "each worker left"
        assert all(c.node != leader.url for c in clients), "each client moved on"
    finally:
        killed_leader.set()
        for w in workers:
            w.stop()
        stop(nodes)
        for c in clients:
            c.close()
    assert [m for m, n in collections.Counter(acks).items() if n > 1] == [], "acked twice"
    assert set(acks) == expected
    assert sum(w.counts.rejected for w in workers) == len(permanent)
    exactly_next = 0
    for mid in transient:
        (first, _), (second, at) = calls[mid][:2]
        assert second > first, mid
        if at < killed:  # no lease answer can have been lost to the kill in between
            assert second == first + 1, mid
            exactly_next += 1
    assert exactly_next > 0


WORKER_SCRIPT = """
import logging, sys, time
from dejaq.client import Client, Worker

logging.basicConfig(level=logging.INFO, stream=sys.stderr)


def handler(m):
    print("started", m.id, flush=True)
    deadline = time.monotonic() + 30
    while not worker.stopping and time.monotonic() < deadline:
        time.sleep(0.01)


worker = Worker(
    Client(sys.argv[1].split(",")), "rb", handler, consumer_id="sub", batch=3,
    lease_ms=5000, wait_ms=1000, heartbeat_s=0.5,
    on_ack=lambda m: print("acked", m.id, flush=True),
)
worker.run()
"""


def test_sigterm_finishes_the_message_in_hand_and_leaves(three, tmp_path: Path) -> None:
    nodes, warehouse = three
    fill(warehouse, "rb", buffer_rows([1, 2, 3], bucket_of=lambda i: 0, prefix="s"))
    script = tmp_path / "worker.py"
    script.write_text(WORKER_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), ",".join(urls(nodes))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    out = Lines(proc.stdout)
    try:
        started = out.next(60, "the worker's first message")
        assert started.split() == ["started", "s0"], started or proc.stderr.read()
        with Client(urls(nodes)) as c:
            assert set(c.heartbeat("rb", "other").buckets) < {0, 1, 2, 3}, "sub has some"
            proc.terminate()
            assert proc.wait(30) == 0
            assert out.rest().split() == ["acked", "s0"]
            assert "left rb, 2 leases released" in proc.stderr.read()
            assert c.peek("rb", "s0").status == "acked"
            assert c.topic_stats("rb").consumers == ["other"]
            assert c.heartbeat("rb", "other").buckets == [0, 1, 2, 3], "sub's buckets too"
            rest = c.lease("rb", "other", max_messages=10, wait_ms=5000)
            assert [(m.id, m.deliveries) for m in rest] == [("s1", 1), ("s2", 1)], (
                "released by the leave, not counted as a delivery"
            )
            c.ack("rb", "other", ["s1", "s2"])
            c.leave("rb", "other")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_handler_longer_than_the_lease_keeps_it(three) -> None:
    nodes, warehouse = three
    fill(warehouse, "hot", buffer_rows([1], bucket_of=lambda i: 0, prefix="long"))
    started, release = threading.Event(), threading.Event()
    handled: list[Message] = []
    acked: list[str] = []

    def handler(m: Message) -> None:
        handled.append(m)
        started.set()
        assert release.wait(30)

    with Client(urls(nodes)) as c:
        worker = Worker(
            c,
            "hot",
            handler,
            consumer_id="slow",
            lease_ms=1000,
            wait_ms=500,
            heartbeat_s=0.3,
            on_ack=lambda m: acked.append(m.id),
        )
        [thread] = run_workers([worker])
        try:
            assert started.wait(30)
            first = handled[0].lease_deadline

            def held_past_first_deadline() -> bool:
                peeked = c.peek("hot", "long0")
                assert (peeked.status, peeked.deliveries) == ("leased", 1)
                return time.time() * 1000 > first + 1000 and peeked.lease_deadline > first + 1000

            wait_until(held_past_first_deadline, timeout=20, what="the lease extended")
        finally:
            release.set()
            wait_until(lambda: acked, timeout=20, what="the ack")
            worker.stop()
            thread.join(30)
        assert acked == ["long0"] and len(handled) == 1
        assert c.peek("hot", "long0").status == "acked"
        assert worker.counts.lost == 0


def test_a_hung_handler_does_not_pin_the_rest_of_its_batch(three) -> None:
    """Past `max_wait_s` the unstarted messages of a batch are no longer kept: their
    leases lapse while the handler before them hangs, and the worker does not start them
    when it returns; it leases them again, one delivery later."""
    nodes, warehouse = three
    fill(warehouse, "hot", buffer_rows([1, 2, 3], bucket_of=lambda i: 0, prefix="hang"))
    release = threading.Event()
    handled: list[tuple[str, int]] = []
    acked: list[str] = []

    def handler(m: Message) -> None:
        handled.append((m.id, m.deliveries))
        if m.id == "hang0":
            assert release.wait(60)

    with Client(urls(nodes)) as c:
        worker = Worker(
            c,
            "hot",
            handler,
            consumer_id="hung",
            batch=3,
            lease_ms=2000,
            wait_ms=500,
            heartbeat_s=0.3,
            max_wait_s=1.0,
            on_ack=lambda m: acked.append(m.id),
        )
        [thread] = run_workers([worker])
        try:
            wait_until(lambda: handled, timeout=30, what="the first handler")

            def lapsed() -> bool:
                return all(c.peek("hot", f"hang{i}").status != "leased" for i in (1, 2))

            wait_until(lapsed, timeout=30, what="the waiting leases to lapse")
            assert c.peek("hot", "hang0").status == "leased", "the hung one is kept"
            release.set()
            wait_until(lambda: len(acked) == 3, timeout=30, what="all three acked")
        finally:
            release.set()
            worker.stop()
            thread.join(30)
        assert handled == [("hang0", 1), ("hang1", 2), ("hang2", 2)]
        assert worker.counts.lost == 2 and worker.counts.acked == 3
    with pytest.raises(ValueError, match="max_wait_s"):
        Worker(c, "hot", handler, max_wait_s=0)


def test_a_message_whose_turn_comes_late_is_extended_as_it_starts_or_left(three) -> None:
    """Past `max_wait_s` the keeper no longer extends a waiting message: when its turn
    comes with half its lease gone it is extended first, and one whose lease is lost
    meanwhile is not started here."""
    nodes, warehouse = three
    fill(warehouse, "hot", buffer_rows([1, 2], bucket_of=lambda i: 0, prefix="turn"))
    with Client(urls(nodes)) as c:
        worker = Worker(c, "hot", lambda m: None, consumer_id="late", lease_ms=4000)
        kept, lost = c.lease("hot", "late", max_messages=2, lease_ms=4000, wait_ms=5000)
        first_deadline = kept.lease_deadline
        kept.held_until = lost.held_until = time.monotonic() + 0.5  # half and more gone
        c.cancel("hot", lost.id)  # its lease ends: settled by an operator
        lost.held_until = time.monotonic() - 1  # and the worker's view of it lapsed
        assert worker._renewed(kept)
        assert c.peek("hot", kept.id).lease_deadline > first_deadline, "extended"
        assert not worker._renewed(lost)
        c.ack("hot", "late", receipts=[kept.receipt])
        c.leave("hot", "late")


class AckCounting(Client):
    """A client that counts its ack requests and the messages each names."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.acks: list[int] = []

    def ack(self, topic, consumer_id, ids=None, *, receipts=None):
        self.acks.append(len(list(receipts if receipts is not None else ids)))
        return super().ack(topic, consumer_id, ids, receipts=receipts)


def test_quick_handlers_acks_go_together_and_a_refused_one_is_told_apart(three) -> None:
    """Each ack request waits out a Raft commit: a worker whose handlers are quick sends
    its acks many to a request. One settled meanwhile by another call is refused in its
    request, counted lost and not reported acked; the others are acked. With
    `ack_linger_s=0`, each ack goes alone."""
    nodes, warehouse = three
    fill(warehouse, "acks", buffer_rows(list(range(30)), bucket_of=lambda i: 0, prefix="q"))
    acked: list[str] = []
    with AckCounting(urls(nodes)) as counting, Client(urls(nodes)) as other:

        def handler(m: Message) -> None:
            if m.id == "q5":  # settled by another call before the worker's ack
                other.ack("acks", "quick", receipts=[m.receipt])

        worker = Worker(
            counting,
            "acks",
            handler,
            consumer_id="quick",
            batch=10,
            wait_ms=300,
            on_ack=lambda m: acked.append(m.id),
        )
        [thread] = run_workers([worker])
        try:
            wait_until(lambda: len(acked) + worker.counts.lost >= 30, what="30 settled")
        finally:
            worker.stop()
            thread.join(30)
        assert sorted(acked) == sorted(f"q{i}" for i in range(30) if i != 5)
        assert (worker.counts.acked, worker.counts.lost) == (29, 1)
        assert sum(counting.acks) == 30 and len(counting.acks) < 30, counting.acks
        assert max(counting.acks) > 1, counting.acks
        assert counting.topic_stats("acks").acked == 30

        fill(warehouse, "acks", buffer_rows(list(range(5)), bucket_of=lambda i: 0, prefix="z"))
        counting.acks.clear()
        alone = Worker(
            counting,
            "acks",
            lambda m: None,
            consumer_id="alone",
            batch=10,
            wait_ms=300,
            on_ack=lambda m: acked.append(m.id),
            ack_linger_s=0,
        )
        [thread] = run_workers([alone])
        try:
            wait_until(lambda: alone.counts.acked >= 5, what="5 more acked")
        finally:
            alone.stop()
            thread.join(30)
        assert counting.acks == [1] * 5


def test_a_failure_on_the_last_delivery_says_it_was_dead_lettered(
    three, caplog: pytest.LogCaptureFixture
) -> None:
    nodes, warehouse = three
    fill(warehouse, "ord", buffer_rows([1], bucket_of=lambda i: 0, prefix="doomed"))
    tries: list[int] = []

    def handler(m: Message) -> None:
        tries.append(m.deliveries)
        raise Transient("never works")

    with Client(urls(nodes)) as c, caplog.at_level(logging.WARNING, "dejaq.worker"):
        worker = Worker(c, "ord", handler, wait_ms=200, backoff=Backoff(base_ms=10, max_ms=20))
        [thread] = run_workers([worker])
        try:
            wait_until(lambda: worker.counts.dead == 1, timeout=30, what="the last delivery")
        finally:
            worker.stop()
            thread.join(30)
        assert tries == [1, 2, 3, 4, 5], "max_deliveries is 5"
        assert c.peek("ord", "doomed0").status == "dead"
    said = [r.getMessage() for r in caplog.records if "doomed0 failed" in r.getMessage()]
    assert len(said) == 5
    assert all("again in" in line for line in said[:4])
    assert "out of deliveries: dead-lettered" in said[4] and "again" not in said[4]


def test_a_nack_whose_answer_was_lost_counts_as_nacked_not_lost(three) -> None:
    """The first nack reaches the broker, but the connection drops before its answer
    (injected in the client's transport, after the real request: the rest is real). Its
    retry is refused as not leased: the first nack's doing, not a lost message."""
    nodes, warehouse = three
    fill(warehouse, "ord", buffer_rows([1], bucket_of=lambda i: 0, prefix="unanswered"))
    tries: list[int] = []

    def handler(m: Message) -> None:
        if m.id.startswith("unanswered"):
            tries.append(m.deliveries)
            if m.deliveries == 1:
                raise Transient("fails once")

    with Client(urls(nodes)) as c:
        dropped = drop_first_answer(c, "/nacks")
        worker = Worker(c, "ord", handler, wait_ms=200, backoff=Backoff(base_ms=10, max_ms=20))
        [thread] = run_workers([worker])
        try:
            wait_until(lambda: tries == [1, 2], timeout=30, what="the message again, once")
            wait_until(lambda: worker.counts.acked >= 1, timeout=30, what="its ack")
        finally:
            worker.stop()
            thread.join(30)
    assert dropped, "the first nack's answer was dropped"
    assert worker.counts.nacked >= 1 and worker.counts.lost == 0


def test_a_lease_whose_answer_was_lost_is_answered_again_not_leased_anew(three) -> None:
    """The first lease reaches the broker, but the connection drops before its answer
    (injected in the client's transport, after the real request: the rest is real). The
    client sends the same request again: it is answered with what that lease holds, the
    same receipts and one delivery, and nothing more is leased; the next call leases
    anew."""
    nodes, warehouse = three
    fill(warehouse, "retried", buffer_rows([1, 2, 3, 4], bucket_of=lambda i: 0, prefix="r"))
    lost: list = []
    lost_at: list[float] = []
    with Client(urls(nodes)) as c:
        dropped = drop_first_answer(c, "/leases", lambda _: lost_at.append(time.monotonic()), lost)
        got = c.lease("retried", "w", max_messages=2, lease_ms=60_000, wait_ms=5000)
        assert dropped, "the first lease's answer was dropped"
        unseen = lost[0].json()["messages"]
        assert [m["id"] for m in unseen] == ["r0", "r1"]
        assert [(m.id, m.receipt, m.deliveries) for m in got] == [
            (m["id"], m["receipt"], 1) for m in unseen
        ]
        assert all(m.held_until - 60 < lost_at[0] for m in got), "held from the first attempt"
        assert c.topic_stats("retried").leased == 2, "the retry leased nothing more"
        assert c.ack("retried", "w", receipts=[m.receipt for m in got]).settled == 2
        rest = c.lease("retried", "w", max_messages=4, lease_ms=60_000, wait_ms=5000)
        assert [(m.id, m.deliveries) for m in rest] == [("r2", 1), ("r3", 1)]


def test_a_worker_whose_lease_answer_was_lost_handles_those_messages_first_time(three) -> None:
    """The worker's first lease answer is lost (as above): its retry hands it the same
    messages, each handled once, on its first delivery, and acked."""
    nodes, warehouse = three
    fill(warehouse, "reworked", buffer_rows([1, 2, 3], bucket_of=lambda i: 0, prefix="w"))
    calls: list[tuple[str, int]] = []
    acked: list[Message] = []
    with Client(urls(nodes)) as c:
        dropped = drop_first_answer(c, "/leases")
        worker = Worker(
            c,
            "reworked",
            lambda m: calls.append((m.id, m.deliveries)),
            batch=3,
            lease_ms=60_000,
            wait_ms=1000,
            on_ack=acked.append,
        )
        [thread] = run_workers([worker])
        try:
            wait_until(lambda: len(acked) == 3, timeout=30, what="the three acked")
        finally:
            worker.stop()
            thread.join(30)
    assert dropped, "the first lease's answer was dropped"
    assert sorted(calls) == [("w0", 1), ("w1", 1), ("w2", 1)]
    assert (worker.counts.acked, worker.counts.lost) == (3, 0)


def test_a_lease_sent_again_to_a_new_leader_is_answered_by_the_lost_attempt(
    tmp_path, kafka_bootstrap, kafka_source
) -> None:
    """The first lease commits, then its leader is killed before the client reads the
    answer (the loss injected in the client's transport, after the real request: the
    rest is real). The retry reaches the new leader, which knows the request's id from
    the lease command: the same messages, receipts and deliveries, which acks settle."""
    conf = write_conf(tmp_path, kafka_bootstrap, kafka_source, heartbeat_ms=30_000)
    fill(str(tmp_path / "warehouse"), "fo", buffer_rows([1, 2, 3, 4], lambda i: 0, "k"))
    nodes = start(tmp_path, conf)
    try:
        with httpx.Client() as http:
            leader = wait_until(lambda: leader_of(nodes, http), what="a leader")
        lost: list = []

        def kill_leader(body: dict) -> None:
            cluster.stop_node(leader, kill=True)

        order = [leader.url, *(n.url for n in nodes if n is not leader)]
        with Client(order, deadline=60) as c:
            dropped = drop_first_answer(c, "/leases", kill_leader, lost)
            got = c.lease("fo", "w", max_messages=2, lease_ms=60_000, wait_ms=5000)
            assert dropped and c.node != leader.url, "answered by another node"
            unseen = lost[0].json()["messages"]
            assert [m["id"] for m in unseen] == ["k0", "k1"]
            assert [(m.id, m.receipt, m.deliveries) for m in got] == [
                (m["id"], m["receipt"], 1) for m in unseen
            ]
            assert c.ack("fo", "w", receipts=[m.receipt for m in got]).settled == 2
            assert c.topic_stats("fo").leased == 0, "the retry leased nothing more"
    finally:
        stop(nodes)


def test_a_handler_that_ends_the_process_counts_the_delivery(three) -> None:
    """A handler that raises SystemExit (CLI code reused) ends `run()`, and the worker's
    leave gives back its unstarted leases uncounted: the message in the handler is
    nacked first, so a supervisor restarting the worker takes it to `max_deliveries`
    (5) and the dead letters, not first in its bucket for ever; the others are acked."""
    nodes, warehouse = three
    fill(warehouse, "poison", buffer_rows([1, 2, 3, 4], bucket_of=lambda i: 0, prefix="exit"))
    tries: list[int] = []
    acked: list[str] = []
    running: list[Worker] = []
    exits: list[int] = []
    done, lock = threading.Event(), threading.Lock()

    def handler(m: Message) -> None:
        if m.id == "exit0":
            tries.append(m.deliveries)
            raise SystemExit(3)

    def supervise() -> None:
        """Runs a fresh worker, with a consumer id of its own, whenever one ends."""
        while True:
            with lock:
                if done.is_set():
                    return
                worker = Worker(
                    c,
                    "poison",
                    handler,
                    batch=4,
                    wait_ms=200,
                    backoff=Backoff(base_ms=10, max_ms=20),
                    on_ack=lambda m: acked.append(m.id),
                )
                running.append(worker)
            try:
                worker.run()
            except SystemExit as e:
                exits.append(int(str(e.code)))

    with Client(urls(nodes)) as c:
        supervisor = threading.Thread(target=supervise)
        supervisor.start()
        try:

            def dead() -> bool:
                try:
                    return c.peek("poison", "exit0").status == "dead"
                except NotFound:  # not indexed yet
                    return False

            wait_until(dead, timeout=60, what="the message that ends its worker dead-lettered")
            wait_until(lambda: len(acked) == 3, timeout=30, what="the others acked")
        finally:
            with lock:
                done.set()
                for worker in running:
                    worker.stop()
            supervisor.join(30)
        assert not supervisor.is_alive()
        assert tries == [1, 2, 3, 4, 5] and exits == [3] * 5
        assert sorted(acked) == ["exit1", "exit2", "exit3"]
        assert sum(w.counts.dead for w in running) == 1


class LeaseTiming(Client):
    """A client that notes when each lease request was made."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.leases: list[float] = []

    def lease(self, *args, **kwargs):
        self.leases.append(time.monotonic())
        return super().lease(*args, **kwargs)


def test_a_worker_without_a_long_poll_asks_an_idle_topic_ten_times_a_second(three) -> None:
    """With `wait_ms=0` the broker answers an idle topic's lease at once, empty: the
    worker asks again only `MIN_POLL_S` after the last, not in a loop of ~1000 a
    second, and a stop in that pause ends the worker, with no lease after the one
    under way."""
    nodes, _ = three
    with LeaseTiming(urls(nodes)) as c:
        worker = Worker(c, "idle", lambda m: None, wait_ms=0)
        [thread] = run_workers([worker])
        try:
            wait_until(lambda: len(c.leases) >= 6, timeout=30, what="6 leases")
        finally:
            worker.stop()
            asked = len(c.leases)
            thread.join(30)
        assert not thread.is_alive(), "the worker still runs 30 s after its stop"
        assert len(c.leases) <= asked + 1, "leases went on after the stop"
        gaps = [b - a for a, b in itertools.pairwise(c.leases)]
        assert min(gaps) >= MIN_POLL_S * 0.9, gaps


def test_an_ack_whose_retry_comes_after_the_trim_counts_as_acked(three) -> None:
    """The first ack reaches the broker and its answer is lost; its retry comes once the
    checkpoint's trim dropped the lease's record, and is refused `not_leased`. The
    message's status says acked: the worker counts its own ack and reports it."""
    nodes, warehouse = three
    fill(warehouse, "trim", buffer_rows([1], bucket_of=lambda i: 0, prefix="trimmed"))
    acked: list[Message] = []
    consumer = "after-trim"

    def not_leased(receipts: list[int]) -> bool:
        """What a retry of the ack is told now, asked the same way."""
        try:
            other.ack("trim", consumer, receipts=receipts)
        except Conflict as e:
            return set(e.refused.values()) == {"not_leased"}
        pytest.fail("the ack was applied twice")

    def until_trimmed(body: dict) -> None:
        wait_until(lambda: not_leased(body["receipts"]), timeout=60, what="the trim")

    with Client(urls(nodes)) as c, Client(urls(nodes)) as other:
        dropped = drop_first_answer(c, "/acks", until_trimmed)
        worker = Worker(
            c, "trim", lambda m: None, consumer_id=consumer, wait_ms=200, on_ack=acked.append
        )
        [thread] = run_workers([worker])
        try:
            wait_until(lambda: acked or worker.counts.lost, timeout=90, what="the ack settled")
        finally:
            worker.stop()
            thread.join(30)
        assert dropped, "the first ack's answer was dropped"
        assert [m.id for m in acked] == ["trimmed0"]
        assert (worker.counts.acked, worker.counts.lost) == (1, 0)
        assert c.peek("trim", "trimmed0").status == "acked"
