"""The broker as it runs: 3 real processes, real Raft, real HTTP, real Delta and Kafka."""

from __future__ import annotations

import asyncio
import base64
import http.client
import itertools
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import Lines, wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition
from kafka.admin import ConfigResource, ConfigResourceType, NewTopic
from test_broker import backlog_rows, buffer_rows, fill

from dejaq.broker.api.http_server import PROBE_ROOM
from dejaq.broker.api.routers.topics import TopicStats
from dejaq.broker.service import Outgoing, Problem, Producer
from dejaq.client import Client, NotFound, Worker
from dejaq.client.models import Left
from dejaq.conf.settings import KafkaConfig, TopicConfig, load_settings
from dejaq.conf.tables import BROKER_APP_ID, Table, ensure_buffer, ensure_table, scan
from dejaq.jobs import cluster
from dejaq.jobs.broker import connection_cap
from dejaq.jobs.children import stop as stop_child
from dejaq.jobs.cluster import Node
from dejaq.jobs.ports import free_port
from dejaq.jobs.status import print_nodes

PROBLEM = "application/problem+json"


def write_conf(
    tmp_path: Path,
    bootstrap: str,
    source: str,
    heartbeat_ms: int = 1500,
    warehouse: str | None = None,
    storage: str = "",
) -> Path:
    """`storage`: the YAML of a `storage:` section, for an `s3://` warehouse."""
    conf = tmp_path / "dejaq.yaml"
    conf.write_text(
        f"warehouse: {warehouse or tmp_path / 'warehouse'}\n"
        f"{storage}"
        f"kafka: {{bootstrap: '{bootstrap}'}}\n"
        f"broker: {{heartbeat_timeout_ms: {heartbeat_ms}, max_payload_bytes: 1000,"
        " lease_ms: 2000}\n"
        "topics:\n"
        f"  - {{name: jobs, kind: priority, source: [{source}], buckets: 4}}\n"
        f"  - {{name: fresh, kind: priority, source: [{source}], buckets: 2}}\n"
        f"  - {{name: later, kind: timeline, source: [{source}], buckets: 2}}\n"
        f"  - {{name: rb, kind: priority, source: [{source}], buckets: 4}}\n"
        f"  - {{name: fo, kind: priority, source: [{source}], buckets: 8}}\n"
        f"  - {{name: ord, kind: priority, source: [{source}], buckets: 4}}\n"
        f"  - {{name: hot, kind: priority, source: [{source}], buckets: 2}}\n"
        f"  - {{name: left, kind: priority, source: [{source}], buckets: 2}}\n"
        f"  - {{name: slash, kind: priority, source: [{source}], buckets: 2}}\n"
        f"  - {{name: long, kind: priority, source: [{source}], buckets: 2}}\n"
        f"  - {{name: poll, kind: priority, source: [{source}], buckets: 2}}\n"
        f"  - {{name: moved, kind: priority, source: [{source}], buckets: 2}}\n"
    )
    return conf


def start(tmp_path: Path, conf: Path, n: int = 3) -> list[Node]:
    os.environ.setdefault("DEJAQ_BROKER_RAFT_PASSWORD", secrets.token_hex(8))
    return cluster.up(n, tmp_path / "raft", str(conf))


def start_logged(
    nodes: list[Node], cluster_nodes: list[Node], conf: Path, env: dict, tmp_path: Path
) -> list[Path]:
    """Start `nodes` as members of `cluster_nodes`, each one's output (its start and stop
    lines, its log) in <tmp>/<node id>.log."""
    logs = []
    new = cluster.fresh(cluster_nodes)  # once: a node started first may have made its dir
    for node in nodes:
        path = tmp_path / f"{node.node_id}.log"
        with path.open("w") as log:
            node.proc = subprocess.Popen(
                cluster.node_command(node, cluster_nodes, str(conf), new),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        logs.append(path)
    return logs


def stop(nodes: list[Node]) -> None:
    for node in nodes:
        cluster.stop_node(node)


def leader_of(nodes: list[Node], client: httpx.Client) -> Node | None:
    for node in nodes:
        if node.proc is None or node.proc.poll() is not None:
            continue
        try:
            answer = client.get(f"{node.url}/v1/cluster", timeout=1)
        except httpx.HTTPError:
            continue
        if answer.status_code == 200 and answer.json()["role"] == "leader":
            return node  # a node still loading its indexes answers 503
    return None


@pytest.fixture(scope="module")
def three(tmp_path_factory, kafka_bootstrap: str, kafka_source: str) -> Iterator[tuple]:
    """A 3-node cluster shared by the tests that do not kill nodes; each uses its own topic."""
    tmp_path = tmp_path_factory.mktemp("broker")
    conf = write_conf(tmp_path, kafka_bootstrap, kafka_source)
    warehouse = str(tmp_path / "warehouse")
    nodes = start(tmp_path, conf)
    with httpx.Client(timeout=40) as client:
        try:
            yield nodes, client, warehouse
        finally:
            stop(nodes)


def follower(nodes: list[Node], client: httpx.Client, skip: int = 0) -> Node:
    leader = leader_of(nodes, client)
    return [n for n in nodes if n is not leader][skip]


def test_any_node_takes_any_request_and_acks_are_final(three) -> None:
    nodes, client, warehouse = three
    fill(warehouse, "jobs", buffer_rows([30, 10, 20, 40], bucket_of=lambda i: 0))
    a, b = follower(nodes, client, 0), follower(nodes, client, 1)
    body = {"consumer_id": "w1", "max_messages": 2, "wait_ms": 3000}
    got = client.post(f"{a.url}/v1/topics/jobs/leases", json=body)
    assert got.status_code == 200, got.text
    msgs = got.json()["messages"]
    assert [m["priority"] for m in msgs] == [10, 20]
    assert base64.b64decode(msgs[0]["payload"]) == b"payload-m1"
    assert msgs[0]["deliveries"] == 1 and msgs[0]["lease_deadline"] > time.time() * 1000
    ids = [m["id"] for m in msgs]
    acked = client.post(f"{b.url}/v1/topics/jobs/acks", json={"consumer_id": "w1", "ids": ids})
    assert acked.json() == {"settled": 2}
    again = client.post(f"{a.url}/v1/topics/jobs/acks", json={"consumer_id": "w1", "ids": ids})
    assert again.status_code == 409 and again.headers["content-type"] == PROBLEM
    assert again.json()["refused"] == dict.fromkeys(ids, "already_settled")
    peek = client.get(f"{b.url}/v1/topics/jobs/messages/{ids[0]}").json()
    assert peek["status"] in ("acked", "settled")
    rest = client.post(f"{b.url}/v1/topics/jobs/leases", json={**body, "max_messages": 10})
    assert [m["priority"] for m in rest.json()["messages"]] == [30, 40], "acked never again"
    held = client.get(f"{a.url}/v1/topics/jobs/messages/{rest.json()['messages'][0]['id']}")
    assert (held.json()["status"], held.json()["deliveries"]) == ("leased", 1), "the lease's"
    described = client.get(f"{a.url}/v1/topics/jobs")
    stats = described.json()
    assert set(stats) == set(TopicStats.model_fields), "the route skips response validation"
    TopicStats.model_validate(stats)
    assert stats["acked"] == 2 and stats["leased"] == 2 and stats["pending"] == 0


def lease_all(client: httpx.Client, url: str, consumer: str) -> dict[str, int]:
    got = client.post(f"{url}/leases", json={"consumer_id": consumer, "max_messages": 100})
    assert got.status_code == 200, got.text
    return {m["id"]: m["deliveries"] for m in got.json()["messages"]}


def test_expiry_nack_extend_reject_cancel_reschedule(three) -> None:
    nodes, client, warehouse = three
    url = f"{leader_of(nodes, client).url}/v1/topics/later"
    now = int(time.time() * 1000)
    fill(
        warehouse,
        "later",
        buffer_rows(
            [now - 3, now - 2, now - 1, now + 3_600_000],
            prefix="t",
            bucket_of=lambda i: 0,
            timeline=True,
        ),
    )
    got = client.post(
        f"{url}/leases",
        json={"consumer_id": "w", "max_messages": 10, "wait_ms": 3000, "lease_ms": 300},
    )
    ids = [m["id"] for m in got.json()["messages"]]
    assert ids == ["t0", "t1", "t2"], "the future one is not deliverable yet"
    ext = client.post(
        f"{url}/extensions", json={"consumer_id": "w", "ids": ["t0"], "lease_ms": 60_000}
    )
    assert ext.status_code == 200
    assert client.post(f"{url}/rejections", json={"consumer_id": "w", "ids": ["t1"]}).is_success
    nack = client.post(f"{url}/nacks", json={"consumer_id": "w", "ids": ["t0"], "delay_ms": 0})
    assert nack.json() == {"settled": 1, "dead": []}
    assert lease_all(client, url, "w") == {"t0": 2}, "nacked: at once, deliveries + 1"
    # t2's lease (300 ms) expires: it comes back with deliveries 2.
    assert wait_until(lambda: lease_all(client, url, "w"), timeout=10, what="expiry") == {"t2": 2}
    cancelled = client.delete(f"{url}/messages/t3")
    assert cancelled.status_code == 204 and "content-type" not in cancelled.headers, "no body"
    assert client.get(f"{url}/messages/t3").json()["status"] in ("cancelled", "settled")
    assert client.patch(f"{url}/messages/t3", json={"deliver_at": now}).status_code == 409
    assert client.patch(f"{url}/messages/t0", json={"priority": 3}).status_code == 422
    assert client.get(f"{url}/messages/nope").status_code == 404


def test_new_keys_reach_the_ledger_and_every_node_keeps_them_past_the_trim(three) -> None:
    """A reschedule (sent to a follower) and a nack's priority reach the ledger as
    `rescheduled` rows; once every node has trimmed them, each still has the messages
    pending at their new keys, and the leader leases them in that order."""
    nodes, client, warehouse = three
    fill(warehouse, "moved", buffer_rows([1, 2, 3], prefix="k", bucket_of=lambda i: 0))
    url = f"{leader_of(nodes, client).url}/v1/topics/moved"
    with Client([follower(nodes, client).url]) as c:

        def buffered() -> bool:
            try:
                return c.peek("moved", "k0").status == "pending"
            except NotFound:
                return False

        wait_until(buffered, 10, "k0 buffered")
        c.reschedule("moved", "k0", priority=9)
    body = {"consumer_id": "w", "max_messages": 1, "wait_ms": 3000}
    leased = client.post(f"{url}/leases", json=body).json()["messages"]
    assert [m["id"] for m in leased] == ["k1"], "k0 goes after k1 and k2 now"
    nack = {"consumer_id": "w", "ids": ["k1"], "priority": 7}
    assert client.post(f"{url}/nacks", json=nack).json() == {"settled": 1, "dead": []}

    def ledger() -> list[tuple]:
        rows = scan(ensure_table(warehouse, Table.LEDGER, "moved"), Table.LEDGER)
        return [(r["message_id"], r["event"], r["sort_key"]) for r in rows.to_pylist()]

    wanted = [("k0", "rescheduled", 9), ("k1", "rescheduled", 7)]
    wait_until(lambda: ledger() == wanted, 30, "the new keys in the ledger")

    def trimmed(node: Node) -> bool:
        info = cluster_info(client, node)
        return info is not None and info["topics"]["moved"]["ledger_lag"]["events"] == 0

    for node in nodes:
        wait_until(lambda node=node: trimmed(node), 30, f"{node.node_id}'s trim")
        with Client([node.url]) as c:
            peeked = [c.peek("moved", m) for m in ("k0", "k1")]
        assert [(p.status, p.priority) for p in peeked] == [("pending", 9), ("pending", 7)]
    body["max_messages"] = 10
    leased = client.post(f"{url}/leases", json=body).json()["messages"]
    assert [(m["id"], m["sort_key"]) for m in leased] == [("k2", 3), ("k1", 7), ("k0", 9)]


def test_ids_holding_a_slash_name_their_message_and_consumer(three) -> None:
    """A producer's message id and a worker's consumer id may hold "/": each names its
    own message or consumer in a URL, on any node (peek, reschedule, cancel, heartbeat,
    leave), never a 404 as if unknown."""
    nodes, client, warehouse = three
    fill(warehouse, "slash", buffer_rows([5, 6], prefix="a/b/", bucket_of=lambda i: 0))
    with Client([follower(nodes, client).url]) as c:

        def buffered() -> bool:
            try:
                return c.peek("slash", "a/b/1").status == "pending"
            except NotFound:
                return False

        wait_until(buffered, 10, "a/b/1 buffered")
        c.reschedule("slash", "a/b/1", priority=1)
        assert c.peek("slash", "a/b/1").priority == 1
        c.cancel("slash", "a/b/0")
        assert c.peek("slash", "a/b/0").status == "cancelled"
        with pytest.raises(NotFound, match="a/b/2"):
            c.peek("slash", "a/b/2")
        joined = c.heartbeat("slash", "svc/1")
        assert joined.consumer_id == "svc/1" and joined.buckets == [0, 1]
        assert [m.id for m in c.lease("slash", "svc/1", 5)] == ["a/b/1"]
        assert c.leave("slash", "svc/1") == Left(consumer_id="svc/1", released=1)


def test_a_topic_describes_itself_after_a_message_of_a_long_id_is_cancelled(three) -> None:
    """An id past the id column's width is kept whole apart, the column holding its
    digest; once its cancel is checkpointed that copy is gone, and the description of
    the topic, which walks the bucket the message's entry stays in, counts the rest."""
    nodes, client, warehouse = three
    long_id = "L" * 999 + "0"
    for prefix, key in (("short", 5), ("L" * 999, 6), ("mid", 7)):
        fill(warehouse, "long", buffer_rows([key], prefix=prefix, bucket_of=lambda i: 0))
    url = f"{leader_of(nodes, client).url}/v1/topics/long"

    def pending(mid: str) -> bool:
        return client.get(f"{url}/messages/{mid}").json().get("status") == "pending"

    wait_until(lambda: all(map(pending, ["short0", long_id, "mid0"])), 10, "the rows indexed")
    assert client.delete(f"{url}/messages/{long_id}").status_code == 204
    # Checkpointed: only the ledger's fact is left of it, the index holds no row.
    wait_until(
        lambda: client.get(f"{url}/messages/{long_id}").json()["bucket"] is None,
        20,
        "the cancel checkpointed",
    )
    described = client.get(url)
    assert described.status_code == 200, described.text
    assert described.json()["pending"] == 2


def test_a_followers_long_poll_waits_as_long_as_the_leader_reads_its_wait(three) -> None:
    """`wait_ms` as the leader's validation takes it (2500.0, "2500", 2.5e3 are all
    2500, and a key escaped in JSON is the same key): past the 2 s a follower gives a
    stalled leader, the poll is answered."""
    nodes, client, _ = three
    url = f"{follower(nodes, client).url}/v1/topics/poll/leases"
    waits = [("wait_ms", "2500.0"), ("wait_ms", '"2500"'), ("wait_ms", "2.5e3")]
    for key, wait in [*waits, ("\\u0077ait_ms", "2500")]:
        began = time.monotonic()
        got = client.post(
            url,
            content=f'{{"consumer_id": "p", "{key}": {wait}}}'.encode(),
            headers={"content-type": "application/json"},
        )
        assert got.status_code == 200, (wait, got.text)
        assert got.json() == {"messages": []} and time.monotonic() - began >= 2.5


def test_a_follower_forwards_a_path_or_query_with_characters_http_clients_encode(three) -> None:
    """A raw `"`, `{`, `}` or backtick in a path, or `"` in a query, reach the leader
    percent-encoded, naming the same message; only `.` and `..` segments, which HTTP
    clients drop, are refused."""
    nodes, client, warehouse = three
    fill(warehouse, "slash", buffer_rows([5], prefix='q"{`}', bucket_of=lambda i: 0))
    host, port = follower(nodes, client).url.removeprefix("http://").rsplit(":", 1)

    def get(target: str) -> tuple[int, dict]:
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            conn.request("GET", target)  # sent as written, not encoded as httpx would
            answer = conn.getresponse()
            return answer.status, json.loads(answer.read())
        finally:
            conn.close()

    leader = f"{leader_of(nodes, client).url}/v1/topics/slash/messages/q%22%7B%60%7D0"
    wait_until(lambda: client.get(leader).status_code == 200, 10, "the message indexed")
    status, body = get('/v1/topics/slash/messages/q"{`}0?x="')
    assert status == 200, body
    assert body["id"] == 'q"{`}0' and body["status"] == "pending"
    status, body = get("/v1/topics/slash/messages/a/../q0")
    assert status == 400 and body["title"] == "invalid path"


_examples = itertools.count()


def post_retrying(client: httpx.Client, url: str, body: dict) -> httpx.Response:
    """POST as a client should: a 503 (a Raft election longer than the broker waits
    out) is tried again, within a deadline."""

    def served() -> httpx.Response | None:
        answer = client.post(url, json=body)
        return None if answer.status_code == 503 else answer

    return wait_until(served, timeout=20, what=f"{url} served by a leader")


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(keys=st.lists(st.integers(0, 65535), min_size=1, max_size=30), n=st.integers(1, 8))
def test_leases_follow_sort_key_order_over_http(three, keys: list[int], n: int) -> None:
    """One consumer, every bucket: lease + ack in batches of n yields the keys sorted."""
    nodes, client, warehouse = three
    fill(warehouse, "ord", buffer_rows(keys, prefix=f"o{next(_examples)}-"))
    url = f"{follower(nodes, client).url}/v1/topics/ord"
    seen: list[int] = []
    while len(seen) < len(keys):
        body = {"consumer_id": "o", "max_messages": n, "wait_ms": 5000, "lease_ms": 60_000}
        msgs = post_retrying(client, f"{url}/leases", body).json()["messages"]
        assert msgs, "every message arrives"
        assert len(msgs) == min(n, len(keys) - len(seen))
        seen += [m["priority"] for m in msgs]
        ack = post_retrying(
            client, f"{url}/acks", {"consumer_id": "o", "ids": [m["id"] for m in msgs]}
        )
        assert ack.status_code == 200, ack.text
    assert seen == sorted(keys)


def test_new_buffer_rows_become_leasable(three) -> None:
    """A row the ingest commits after a consumer joined is leased to its waiting lease
    calls (how soon is for bench/ to measure)."""
    nodes, client, warehouse = three
    url = f"{leader_of(nodes, client).url}/v1/topics/fresh/leases"
    first = client.post(url, json={"consumer_id": "f", "max_messages": 1})
    assert first.json()["messages"] == [], first.text
    fill(warehouse, "fresh", buffer_rows([1], prefix="new"))

    def leased() -> list[str]:
        got = client.post(url, json={"consumer_id": "f", "max_messages": 1, "wait_ms": 5000})
        assert got.status_code == 200, got.text
        return [m["id"] for m in got.json()["messages"]]

    assert wait_until(leased, timeout=60, what="the new row leased") == ["new0"]


def test_buckets_rebalance_on_join_leave_and_timeout(three) -> None:
    nodes, client, _ = three
    url = f"{follower(nodes, client).url}/v1/topics/rb/consumers"

    def beat(c: str) -> list[int]:
        r = client.post(f"{url}/{c}/heartbeat")
        assert r.status_code == 200, r.text
        return r.json()["buckets"]

    assert beat("a") == [0, 1, 2, 3]
    b = beat("b")
    a = beat("a")
    assert len(a) == len(b) == 2 and not set(a) & set(b), "disjoint, balanced"
    assert client.delete(f"{url}/b").json()["released"] == 0
    assert beat("a") == [0, 1, 2, 3]
    beat("b")
    # a stops heart-beating: after heartbeat_timeout_ms (1.5 s) b gets every bucket.
    wait_until(lambda: beat("b") == [0, 1, 2, 3], timeout=10, what="timeout rebalance")


def test_a_long_poll_whose_client_left_leases_it_nothing(three) -> None:
    """A worker that closes its connection during a long poll (killed, or cut by a
    proxy's idle timeout) is leased nothing after: not by the leader's fast path, its
    FastAPI route (a body needing coercion), nor a follower's forward. The messages
    landing meanwhile go to a live worker at their first delivery, not to nobody for a
    lease's length (2 s here) and then a delivery closer to dead."""
    nodes, client, warehouse = three
    leader = leader_of(nodes, client)
    assert leader is not None
    cases = [(leader, 1, "fast"), (leader, "1", "route"), (follower(nodes, client), 1, "forward")]
    for node, n, case in cases:
        _poll_and_leave(client, node, {"consumer_id": case, "max_messages": n, "wait_ms": 20_000})
        fill(warehouse, "left", buffer_rows([1, 2], prefix=f"{case}-"))
        got = _lease_until(client, f"{node.url}/v1/topics/left", "live", 2)
        assert got == {f"{case}-0": 1, f"{case}-1": 1}, case


def _poll_and_leave(client: httpx.Client, node: Node, lease: dict) -> None:
    """Start a long poll on `node`, wait for its consumer to join, and disconnect."""
    url = f"{node.url}/v1/topics/left"
    body = json.dumps(lease).encode()
    host, port = node.http.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as poll:
        poll.sendall(
            b"POST /v1/topics/left/leases HTTP/1.1\r\nhost: x\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )
        wait_until(
            lambda: lease["consumer_id"] in client.get(url).json()["consumers"],
            timeout=10,
            what="the poll's consumer joined",
        )


def _lease_until(client: httpx.Client, url: str, consumer: str, n: int) -> dict[str, int]:
    """Lease (and ack) until `n` messages came: id → deliveries."""
    got: dict[str, int] = {}

    def leased_all() -> bool:
        for mid, deliveries in lease_all(client, url, consumer).items():
            got[mid] = deliveries
            acked = client.post(f"{url}/acks", json={"consumer_id": consumer, "ids": [mid]})
            assert acked.is_success, acked.text
        return len(got) >= n

    wait_until(leased_all, timeout=20, what=f"{n} messages leased by {consumer}")
    return got


def test_a_topic_reading_its_envelope_from_the_payload_takes_it_there_over_http() -> None:
    """A topic whose priority and id come from the payload's JSON (`json_fields`): a
    request giving them beside it is refused, as the ingest would ignore them; one
    without them is produced, and answered with the id it is stored under."""
    from dejaq.broker.api.routers.messages import NewMessage, _envelope
    from dejaq.broker.service import Problem
    from dejaq.conf.settings import JsonFields, TopicConfig

    cfg = TopicConfig(
        name="j",
        kind="priority",
        source=["j-in"],
        json_fields=JsonFields(priority="p", id="order.ref"),
    )
    payload = base64.b64encode(b'{"p": 3, "order": {"ref": "A-17"}}').decode()
    for extra, title in (({"priority": 3}, "priority is in the payload"), ({"id": "x"}, "id is")):
        with pytest.raises(Problem) as refused:
            _envelope(NewMessage(payload=payload, **extra), cfg, 10_000)
        assert refused.value.status == 422 and title in refused.value.title
    out = _envelope(NewMessage(payload=payload, headers={"a": "b"}), cfg, 10_000)
    assert out.headers == [("a", b"b"), ("dejaq-id", b"A-17")]
    bare = base64.b64encode(b'{"p": 3}').decode()
    assert _envelope(NewMessage(payload=bare), cfg, 10_000).headers == [], "its default id"
    odd = base64.b64encode(b'{"p": 3, "order": {"ref": 1.5}}').decode()
    with pytest.raises(Problem, match="give a string or an integer"):
        _envelope(NewMessage(payload=odd), cfg, 10_000)
    empty = base64.b64encode(b'{"p": 3, "order": {"ref": ""}}').decode()
    with pytest.raises(Problem, match="is empty"):  # the ingest quarantines it
        _envelope(NewMessage(payload=empty), cfg, 10_000)
    listed = cfg.model_copy(update={"json_fields": JsonFields(priority="p", id="refs[1]")})
    both = base64.b64encode(b'{"p": 3, "refs": ["r0", 17]}').decode()
    assert _envelope(NewMessage(payload=both), listed, 10_000).headers == [("dejaq-id", b"17")]


def test_bad_input_gets_problem_details(three, kafka_bootstrap: str, kafka_source: str) -> None:
    nodes, client, _ = three
    base = f"{follower(nodes, client).url}/v1/topics"
    lease = {"consumer_id": "x"}
    cases = [
        (client.post(f"{base}/nope/leases", json=lease), 404),
        (client.get(f"{base}/nope"), 404),
        (client.post(f"{base}/jobs/messages", json={"payload": "", "priority": 70000}), 422),
        (
            client.post(
                f"{base}/later/messages", json={"payload": "", "deliver_at": 1_700_000_000}
            ),
            422,
        ),
        (client.post(f"{base}/jobs/messages", json={"payload": ""}), 422),
        (client.post(f"{base}/jobs/messages", json={"payload": "%%", "priority": 1}), 422),
        (
            client.post(
                f"{base}/jobs/leases",
                content=b"{not json",
                headers={"content-type": "application/json"},
            ),
            422,
        ),
        (client.post(f"{base}/jobs/leases", json={**lease, "max_messages": 1001}), 422),
        (client.post(f"{base}/jobs/leases", json={**lease, "wait_ms": 30_001}), 422),
        (client.post(f"{base}/jobs/acks", json={"consumer_id": "x", "ids": []}), 422),
        (
            client.post(
                f"{base}/jobs/messages",
                json={"payload": base64.b64encode(b"x" * 1001).decode(), "priority": 1},
            ),
            413,
        ),
        (client.post(f"{base}/jobs/messages", json={"payload": "A" * 5000, "priority": 1}), 413),
    ]
    for response, status in cases:
        assert response.status_code == status, response.text
        assert response.headers["content-type"] == PROBLEM
        assert response.json()["status"] == status

    json_ = {"content-type": "application/json"}

    def post(path: str, body: dict) -> httpx.Response:  # "\ud800" as JSON escapes it
        return client.post(f"{base}/{path}", content=json.dumps(body).encode(), headers=json_)

    lone = {"payload": "", "headers": {"a": "\ud800"}}
    cursor = base64.urlsafe_b64encode(b"[" * 2000).decode()
    now = int(time.time() * 1000)
    named = [
        (post("jobs/messages", {**lone, "priority": 1}), "header 'a'"),
        (post("jobs/messages/batch", {"messages": [{**lone, "priority": 1}]}), "header 'a'"),
        (post("jobs/schedules", {**lone, "cron": "* * * * *"}), "header 'a'"),
        (client.get(f"{base}/jobs/dead-letters", params={"after": cursor}), "not a cursor"),
        (client.get(f"{base}/jobs/quarantine", params={"after": cursor}), "not a cursor"),
        (
            post("later/messages", {"payload": "", "deliver_at": now, "priority": 1}),
            "topic later is a timeline topic: it takes deliver_at",
        ),
        (
            post("jobs/messages", {"payload": "", "priority": 1, "deliver_at": now}),
            "topic jobs is a priority topic: it takes priority",
        ),
    ]
    for kind in (None, "text/plain"):
        unread = client.post(
            f"{base}/jobs/leases",
            content=b'{"consumer_id": "x"}',
            headers={"content-type": kind} if kind else {},
        )
        named.append((unread, "the body must be JSON, with content-type application/json"))
    for response, named_in_detail in named:
        assert response.status_code == 422, response.text
        assert response.headers["content-type"] == PROBLEM
        assert named_in_detail in response.json()["detail"]


def test_a_body_larger_than_its_route_takes_is_refused_as_it_comes(three) -> None:
    """On every node, a chunked body (no Content-Length to check) and an announced one
    get a 413 once past their route's limit, however valid their JSON: a produce's (one
    payload of max_payload_bytes, 1000 here, in base64 with room), a lease's (64 KiB)."""
    nodes, client, _ = three
    leader = leader_of(nodes, client)
    json_ = {"content-type": "application/json"}

    def chunked(head: bytes, size: int) -> Iterator[bytes]:
        yield head
        for _ in range(size // 16_384):
            yield b" " * 16_384
        yield b"}"

    for node in (leader, follower(nodes, client)):
        assert node is not None
        base = f"{node.url}/v1/topics"
        produce = b'{"payload": "aGk=", "priority": 1'
        lease = b'{"consumer_id": "big", "max_messages": 1'
        answers = [
            client.post(f"{base}/jobs/messages", content=chunked(produce, 300_000), headers=json_),
            client.post(f"{base}/hot/leases", content=chunked(lease, 300_000), headers=json_),
            client.post(f"{base}/hot/leases", content=lease + b" " * 70_000 + b"}", headers=json_),
        ]
        for answer in answers:
            assert answer.status_code == 413, (node.url, answer.text)
            assert answer.json()["title"] == "request too large"
        assert "chunked" in answers[0].request.headers["transfer-encoding"]
        small = client.post(f"{base}/hot/leases", content=lease + b" " * 1000 + b"}", headers=json_)
        assert small.status_code == 200, small.text


def test_produce_over_http_lands_in_kafka(three, kafka_bootstrap: str, kafka_source: str) -> None:
    nodes, client, _ = three
    base = f"{follower(nodes, client).url}/v1/topics/jobs/messages"
    one = client.post(base, json={"payload": "aGk=", "priority": 7, "key": "k", "id": "my-1"})
    assert one.status_code == 201 and one.json() == {"ids": ["my-1"]}
    batch = client.post(
        f"{base}/batch",
        json={"messages": [{"payload": "YQ==", "priority": 1}, {"payload": "Yg==", "priority": 2}]},
    )
    assert batch.status_code == 201
    assert all(i.startswith(f"{kafka_source}-0-") for i in batch.json()["ids"])
    consumer = KafkaConsumer(bootstrap_servers=kafka_bootstrap, consumer_timeout_ms=5000)
    consumer.assign([TopicPartition(kafka_source, 0)])
    consumer.seek_to_beginning()
    records = [r for _, r in zip(range(3), consumer, strict=False)]
    consumer.close()
    assert [r.value for r in records] == [b"hi", b"a", b"b"]
    assert dict(records[0].headers) == {"dejaq-priority": b"7", "dejaq-id": b"my-1"}
    assert records[0].key == b"k"


def _records_in(bootstrap: str, topic: str, partitions: int) -> int:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap)
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        return sum(consumer.end_offsets(tps).values())
    finally:
        consumer.close()


def _small_topic(bootstrap: str, max_message_bytes: int) -> str:
    """A one-partition Kafka topic taking records up to `max_message_bytes`."""
    name = f"small-{secrets.token_hex(5)}"
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    config = {"max.message.bytes": str(max_message_bytes)}
    admin.create_topics([NewTopic(name, 1, 1, topic_configs=config)])
    admin.close()
    return name


def test_a_record_too_large_for_its_kafka_topic_fails_no_other_request(
    kafka_bootstrap: str, topic_factory
) -> None:
    """A record over its Kafka topic's max.message.bytes is refused with a 413 naming
    the limit and never sent: Kafka refusing it would fail every record the shared
    idempotent producer held, a batch to another topic at the same time too."""
    small, other = _small_topic(kafka_bootstrap, 100_000), topic_factory()
    producer = Producer(KafkaConfig(bootstrap=kafka_bootstrap))
    fits = Outgoing(b"k", b"", [("dejaq-id", b"fits")])
    fits.payload = b"f" * (100_000 - fits.record_bytes() - 2)  # its length's varint: 2 more
    assert fits.record_bytes() == 100_000  # at the limit, overhead counted
    big = Outgoing(b"k", fits.payload + b"y", fits.headers)

    async def rounds() -> list[list[list[str] | BaseException]]:
        answers = []
        for _ in range(3):
            batch = [Outgoing(f"k{i}".encode(), b"x" * 2000, []) for i in range(1000)]
            answers.append(
                await asyncio.gather(
                    producer.send(other, batch), producer.send(small, [big]), return_exceptions=True
                )
            )
        answers.append([await producer.send(small, [fits])])
        return answers

    try:
        answers = asyncio.run(rounds())
    finally:
        producer.close()
    for landed, refused in answers[:3]:
        assert isinstance(landed, list) and len(landed) == 1000, landed
        assert isinstance(refused, Problem) and refused.status == 413, refused
        assert "takes at most 100000" in refused.detail and refused.extra["limit"] == 100_000
    assert answers[3] == [["fits"]]
    assert _records_in(kafka_bootstrap, other, 3) == 3000
    assert _records_in(kafka_bootstrap, small, 1) == 1  # the one that fits, only


def test_a_limit_lowered_meanwhile_fails_others_only_retryably(
    kafka_bootstrap: str, topic_factory
) -> None:
    """The producer knows a topic's limit from a while ago; lowered meanwhile, Kafka
    refuses a record and the producer fails every record it held with it: the request
    whose record it was gets a 413 naming the new limit, another a 503 to retry (or its
    201, if none of its records was held then), and the next too-large one is refused
    before it is sent."""
    small, other = _small_topic(kafka_bootstrap, 100_000), topic_factory()
    producer = Producer(KafkaConfig(bootstrap=kafka_bootstrap))
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    big = Outgoing(b"k", b"y" * 50_000, [])

    async def scenario() -> list[list[str] | BaseException]:
        await producer.send(small, [Outgoing(b"k", b"w", [])])  # the limit, as it was
        resource = ConfigResource(ConfigResourceType.TOPIC, small, {"max.message.bytes": "5000"})
        await asyncio.to_thread(admin.alter_configs, [resource])
        batch = [Outgoing(f"k{i}".encode(), b"x" * 2000, []) for i in range(1000)]
        answers = await asyncio.gather(
            producer.send(other, batch), producer.send(small, [big]), return_exceptions=True
        )
        sent_before = _records_in(kafka_bootstrap, small, 1)
        again = await asyncio.gather(producer.send(small, [big]), return_exceptions=True)
        assert _records_in(kafka_bootstrap, small, 1) == sent_before
        return [*answers, *again]

    try:
        landed, refused, again = asyncio.run(scenario())
    finally:
        producer.close()
        admin.close()
    assert isinstance(refused, Problem) and refused.status == 413, refused
    assert "takes at most 5000" in refused.detail
    assert isinstance(again, Problem) and again.status == 413 and "none" in again.detail
    if isinstance(landed, Problem):
        assert landed.status == 503 and "failed on another record" in landed.detail, landed
    else:
        assert isinstance(landed, list) and len(landed) == 1000
        assert _records_in(kafka_bootstrap, other, 3) == 1000


def test_produces_beyond_the_cap_are_refused_at_once_while_kafka_hangs() -> None:
    """Kafka here is a socket that takes connections and never answers, as a stopped
    Kafka does, so every produce hangs until its deadline: they run on the producer's
    own threads (asyncio's default ones, which every other endpoint's blocking work
    uses, stay free), those beyond the cap are refused at once with a 503 and a
    Retry-After, and the held ones end in a 503 saying the outcome is unknown, within
    the client's 10 s an attempt."""
    default_threads = min(32, (os.cpu_count() or 1) + 4)
    cap = default_threads + 2
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(cap * 4)
        producer = Producer(KafkaConfig(bootstrap=f"127.0.0.1:{silent.getsockname()[1]}"), cap)
        one = [Outgoing(b"k", b"x", [("dejaq-id", b"m")])]

        async def scenario() -> None:
            began = time.monotonic()
            held = [asyncio.create_task(producer.send("t", one)) for _ in range(cap)]
            while producer._in_flight < cap:
                assert time.monotonic() - began < 5, "the produces never all started"
                await asyncio.sleep(0.01)
            with pytest.raises(Problem) as refused:
                await producer.send("t", one)
            # At once: refused while every held produce is still in flight, none having
            # freed a slot to wait for.
            assert producer._in_flight == cap and not any(t.done() for t in held)
            assert refused.value.status == 503 and refused.value.extra == {"retry_after": 1}
            await asyncio.to_thread(time.monotonic)
            # asyncio's own threads ran that while every produce still hung on Kafka.
            assert producer._in_flight == cap, "asyncio's threads are held by produces"
            # Each ends at the producer's own deadline; 60 s only catches a hang.
            answers = await asyncio.wait_for(asyncio.gather(*held, return_exceptions=True), 60)
            for answer in answers:
                assert isinstance(answer, Problem) and answer.status == 503, answer
                assert "outcome is unknown" in answer.detail

        try:
            asyncio.run(scenario())
        finally:
            producer.close()


def test_health_readiness_metrics_and_openapi(three) -> None:
    nodes, client, _ = three
    for node in nodes:
        assert client.get(f"{node.url}/healthz").json() == {"status": "ok"}
        assert client.get(f"{node.url}/readyz").status_code == 200
        # ready means clients can find it: its own view lists its HTTP address
        view = client.get(f"{node.url}/v1/cluster").json()["nodes"]
        assert view[node.raft] == node.http
    leader = leader_of(nodes, client)
    text = client.get(f"{leader.url}/metrics").text
    for name in (
        "dejaq_leased_messages_total",
        "dejaq_acked_messages_total",
        "dejaq_lease_seconds_bucket",
        'dejaq_raft_role{role="leader"} 1.0',
        "dejaq_raft_term",
        "dejaq_index_messages",
        "dejaq_head_store_bytes",
        "dejaq_event_loop_lag_seconds_bucket",
        'python_gc_collections_total{generation="2"}',
        'dejaq_ledger_lag_seconds{topic="jobs"}',
        'dejaq_ledger_unwritten_events{topic="jobs"}',
        'dejaq_dead_letters_unwritten{topic="jobs"}',
        "dejaq_raft_log_entries",
    ):
        assert name in text
    info = client.get(f"{leader.url}/v1/cluster").json()
    assert info["topics"]["jobs"]["ledger_lag"]["checkpoint_failures"] == 0
    spec = client.get(f"{leader.url}/openapi.json").json()
    assert "/v1/topics/{topic}/leases" in spec["paths"]
    problem_schema = {"schema": {"$ref": "#/components/schemas/ProblemDetail"}}
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            answers = operation["responses"]
            for code, answer in answers.items():  # as sent (`test_bad_input_gets_...`)
                if code >= "400":
                    assert answer["content"] == {PROBLEM: problem_schema}, (path, method, code)
            if "requestBody" in operation:
                assert {"400", "413", "422"} <= set(answers), (path, method)
    assert "200" in spec["paths"]["/v1/topics/{topic}/schedules"]["post"]["responses"]
    assert "409" in spec["paths"]["/v1/topics/{topic}/dead-letters/redrive"]["post"]["responses"]
    page = client.get(f"{leader.url}/docs")
    assert page.status_code == 200
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert assets and all(a.startswith("/docs-assets/") for a in assets), assets
    for asset in assets:
        assert client.get(f"{leader.url}{asset}").status_code == 200, asset


def test_docs_render_in_a_browser_with_no_network_beyond_the_node(three) -> None:
    """Swagger UI from the node's own files: a real Chromium renders the operations
    (this machine reaches no CDN, so a page that needed one would stay blank)."""
    nodes, _, _ = three
    chromium = shutil.which("chromium")
    assert chromium is not None, "the set-up step installs Debian's chromium"
    dom = subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--virtual-time-budget=15000",
            "--dump-dom",
            f"{nodes[0].url}/docs",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "swagger-ui" in dom
    assert "/v1/topics/{topic}/leases" in dom, "the operations rendered"


def test_hot_path_answers_as_the_routes_do(three) -> None:
    """On the leader, lease and ack bodies the hot path finds plainly valid skip FastAPI;
    the rest go to the routes. A +json media type always goes to the routes: the same
    request both ways must get the same answer (status, media type, body)."""
    nodes, client, _ = three
    base = f"{leader_of(nodes, client).url}/v1/topics"
    w = {"consumer_id": "w"}
    cases = [
        ("hot/leases", w),  # nothing to lease: 200 and no messages
        ("hot/leases", {**w, "max_messages": 0}),
        ("hot/leases", {**w, "wait_ms": 30_001}),
        ("hot/leases", {**w, "lease_ms": 0}),
        ("hot/leases", {**w, "extra": 1}),
        ("hot/leases", {"consumer_id": "w x"}),
        ("hot/leases", []),
        ("hot/leases", {**w, "request_id": "0123456789abcdef"}),
        ("hot/leases", {**w, "request_id": None}),
        ("hot/leases", {**w, "request_id": "x" * 65}),
        ("hot/leases", {**w, "request_id": "a b"}),
        ("hot/leases", {**w, "request_id": 7}),
        ("hot/leases", {**w, "request_id": ""}),
        ("nope/leases", w),
        ("hot/acks", {**w, "ids": ["never-leased"]}),  # 409, reason per id
        ("hot/acks", {**w, "ids": ["\ud800"]}),  # a lone surrogate: not a string to pydantic
        ("hot/acks", {**w, "ids": []}),
        ("hot/acks", {**w, "ids": ["x" * 1001]}),
        ("hot/acks", w),
        ("nope/acks", {**w, "ids": ["a"]}),
    ]
    for path, body in cases:
        content = json.dumps(body).encode()
        answers = [
            client.post(f"{base}/{path}", content=content, headers={"content-type": media})
            for media in ("application/json", "application/vnd.dejaq+json")
        ]
        hot, routed = ((a.status_code, a.headers["content-type"], a.json()) for a in answers)
        assert hot == routed, (path, body)
        assert hot[0] < 500 and (hot[0] < 400 or hot[1] == PROBLEM), (path, body, hot)
    for bad in ("x" * 65, "a b", 7, ""):
        got = client.post(f"{base}/hot/leases", json={**w, "request_id": bad})
        assert got.status_code == 422 and "request_id" in got.text, (bad, got.text)


def test_nodes_run_without_pandas(three) -> None:
    """pyarrow imports pandas on its first array-like check, tens of MB per node of a
    library the broker never calls: a node refuses it. Checked once the nodes have
    leased, acked and served every route above (Linux: the maps of the node's PID)."""
    nodes, _, _ = three
    for node in nodes:
        maps = Path(f"/proc/{node.proc.pid}/maps").read_text()
        assert "/pyarrow/" in maps
        assert "/pandas/" not in maps


def cluster_info(client: httpx.Client, node: Node) -> dict | None:
    """`node`'s view; None while it does not answer, or loads its indexes (a 503)."""
    try:
        answer = client.get(f"{node.url}/v1/cluster", timeout=5)
    except httpx.HTTPError:
        return None
    return answer.json() if answer.status_code == 200 else None


def test_a_follower_stalled_past_the_election_timeout_does_not_depose_the_leader(
    three,
) -> None:
    """Raft shares the event loop with HTTP. After a stall the loop runs its timers before
    it reads sockets, and a Raft tick checks the election deadline first: the follower must
    read the heartbeats that arrived meanwhile before that check, not start an election."""
    nodes, client, _ = three
    leader = wait_until(lambda: leader_of(nodes, client), what="a leader")
    stalled = follower(nodes, client)
    term = cluster_info(client, leader)["term"]
    wait_until(
        lambda: (cluster_info(client, stalled) or {}).get("term") == term, what="the same term"
    )
    os.kill(stalled.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(2.0)  # the stall itself: longer than the longest election timeout, 1.5 s
    finally:
        os.kill(stalled.proc.pid, signal.SIGCONT)
    # An election would start in the first tick after the stall, before HTTP is read.
    info = wait_until(lambda: cluster_info(client, stalled), what="the follower answering")
    assert (info["term"], info["role"]) == (term, "follower")
    assert cluster_info(client, leader)["role"] == "leader"


# --- failover and restart: a cluster of their own --------------------------------------------


class Workers:
    """Lease + ack loops against every node in turn, recording what they saw."""

    def __init__(self, nodes: list[Node], n: int, batch: int, topic: str = "fo") -> None:
        self.nodes, self.batch, self.topic = nodes, batch, topic
        self.acked: set[str] = set()
        self.redelivered_after_ack: list[str] = []
        self.errors = 0
        self.last_success = 0.0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(n)]

    def _run(self, i: int) -> None:
        with httpx.Client(timeout=5) as client:
            k = i
            while not self.stop.is_set():
                node = self.nodes[k % len(self.nodes)]
                k += 1
                try:
                    self._once(client, node.url, f"w{i}")
                except (httpx.HTTPError, ValueError):
                    with self.lock:
                        self.errors += 1

    def _once(self, client: httpx.Client, url: str, me: str) -> None:
        got = client.post(
            f"{url}/v1/topics/{self.topic}/leases",
            json={"consumer_id": me, "max_messages": self.batch, "wait_ms": 200},
        )
        if got.status_code != 200:
            raise ValueError(got.status_code)
        ids = [m["id"] for m in got.json()["messages"]]
        with self.lock:
            self.redelivered_after_ack += [m for m in ids if m in self.acked]
        if not ids:
            return
        done = client.post(
            f"{url}/v1/topics/{self.topic}/acks", json={"consumer_id": me, "ids": ids}
        )
        ok = ids if done.status_code == 200 else []
        if done.status_code == 409:
            refused = done.json()["refused"]
            ok = [m for m in ids if m not in refused or refused[m] == "already_settled"]
        with self.lock:
            self.acked.update(ok)
            if ok:
                self.last_success = time.monotonic()

    def __enter__(self) -> Workers:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)
        live = [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]
        with httpx.Client(timeout=10) as client:
            for i in range(len(self.threads)):
                client.delete(f"{live[0].url}/v1/topics/{self.topic}/consumers/w{i}")


def acked(client: httpx.Client, nodes: list[Node]) -> int:
    leader = leader_of(nodes, client)
    return client.get(f"{leader.url}/v1/topics/fo").json()["acked"] if leader else -1


@pytest.mark.parametrize("store", ["local", "s3"])
def test_kill_9_leader_under_load_then_full_restart(
    store: str, request: pytest.FixtureRequest, tmp_path, kafka_bootstrap, kafka_source
):
    """`s3`: the warehouse on the S3 server, the nodes' Raft and head stores on disk."""
    warehouse, storage = str(tmp_path / "warehouse"), ""
    if store == "s3":
        s3 = request.getfixturevalue("s3_env")
        warehouse = f"s3://dejaq/{tmp_path.name}"
        storage = f"storage: {{endpoint: '{s3['DEJAQ_STORAGE_ENDPOINT']}', path_style: true}}\n"
    conf = write_conf(
        tmp_path, kafka_bootstrap, kafka_source, 3000, warehouse=warehouse, storage=storage
    )
    total = 3000
    fill(warehouse, "fo", buffer_rows([i % 100 for i in range(total)], lambda i: i % 8, "f"))
    nodes = start(tmp_path, conf)
    try:
        with httpx.Client(timeout=10) as client, Workers(nodes, n=3, batch=10) as w:
            wait_until(lambda: len(w.acked) >= 500, timeout=60, what="load")
            victim = leader_of(nodes, client)
            cluster.stop_node(victim, kill=True)
            killed = time.monotonic()
            survivor = next(n for n in nodes if n is not victim)
            probe = client.post(f"{survivor.url}/v1/topics/jobs/consumers/probe/heartbeat")
            assert probe.status_code == 200, f"a node waits out the election: {probe.text}"
            wait_until(lambda: w.last_success > killed, timeout=60, what="workers served again")
            survivors = [n for n in nodes if n is not victim]
            wait_until(lambda: leader_of(survivors, client), timeout=60, what="a new leader")
            # An ack committed just before the kill may have lost its answer: ask the cluster.
            wait_until(lambda: acked(client, nodes) == total, timeout=90, what="all acked")
        assert w.redelivered_after_ack == [], "an acked message is never delivered again"

        # Full restart: Raft journals and the ledger keep everything.
        leased, acked_after = restart_then_lease(nodes, conf, warehouse, "fo")
        assert leased == ["after0", "after1"]
        assert acked_after == total
    finally:
        stop(nodes)


def test_a_stopped_leader_is_failed_over_before_it_wakes(
    tmp_path, kafka_bootstrap, kafka_source
) -> None:
    """A SIGSTOPped leader still accepts connections: requests sent or forwarded to it
    must give up on it within about an election timeout, not wait for it to wake."""
    conf = write_conf(tmp_path, kafka_bootstrap, kafka_source, heartbeat_ms=5000)
    warehouse = str(tmp_path / "warehouse")
    fill(warehouse, "fo", buffer_rows(list(range(2000)), lambda i: i % 8, "f"))
    nodes = start(tmp_path, conf)
    try:
        with httpx.Client(timeout=30) as http:
            leader = wait_until(lambda: leader_of(nodes, http), what="a leader")
            others = [n for n in nodes if n is not leader]
            acked: list[float] = []
            worker = Worker(
                Client([n.url for n in [leader, *others]]),
                "fo",
                lambda m: None,
                batch=5,
                lease_ms=10_000,
                on_ack=lambda m: acked.append(time.monotonic()),
            )
            runner = threading.Thread(target=worker.run)
            runner.start()
            try:
                wait_until(lambda: len(acked) >= 20, what="the worker under way")
                os.kill(leader.proc.pid, signal.SIGSTOP)
                stopped = time.monotonic()
                try:
                    # The leader wakes only after this answers: a forward waiting for it
                    # would run into the client's own 30 s and raise.
                    forwarded = http.post(
                        f"{others[0].url}/v1/topics/fo/leases",
                        json={"consumer_id": "probe", "max_messages": 1},
                    )
                    # Leases go on while the old leader is still stopped.
                    wait_until(
                        lambda: acked[-1] > stopped + 0.5, timeout=8, what="leases elsewhere"
                    )
                finally:
                    os.kill(leader.proc.pid, signal.SIGCONT)
            finally:
                worker.stop()
                runner.join(30)
        assert forwarded.status_code in (200, 503), forwarded.text
    finally:
        stop(nodes)


def test_a_leader_cut_off_from_its_followers_steps_down_within_seconds(tmp_path) -> None:
    """Both followers stopped: the others' majority would elect another leader within an
    election timeout, and none of the old one's writes commits. Within seconds it no
    longer says it leads nor answers ready; the followers resumed, the cluster has a
    leader again and every node is ready."""
    conf = write_conf(tmp_path, "127.0.0.1:9", "in")
    nodes = start(tmp_path, conf)
    try:
        with httpx.Client(timeout=5) as http:
            leader = wait_until(lambda: leader_of(nodes, http), what="a leader")
            others = [n for n in nodes if n is not leader]
            assert http.get(f"{leader.url}/readyz").status_code == 200
            for node in others:
                os.kill(node.proc.pid, signal.SIGSTOP)
            try:
                wait_until(
                    lambda: http.get(f"{leader.url}/readyz").status_code == 503,
                    timeout=8,
                    what="the cut-off leader unready",
                )
                readyz = http.get(f"{leader.url}/readyz").json()
                role = cluster_info(http, leader)["role"]
            finally:
                for node in others:
                    os.kill(node.proc.pid, signal.SIGCONT)
            wait_until(lambda: leader_of(nodes, http), what="a leader again")
            wait_until(lambda: cluster.ready(nodes), what="every node ready again")
        assert role != "leader"
        assert readyz["detail"] == "no Raft leader", readyz
    finally:
        stop(nodes)


def restart_then_lease(
    nodes: list[Node], conf: Path, warehouse: str, topic: str
) -> tuple[list[str], int]:
    """Stop every node, append two rows ("after0", "after1"), start them all again; the
    ids one lease then gets, sorted, and the topic's acked count."""
    stop(nodes)
    fill(warehouse, topic, buffer_rows([5, 6], prefix="after"))
    for node in nodes:
        cluster.start_node(node, nodes, str(conf), dict(os.environ))
    cluster.wait_ready(nodes)
    with httpx.Client(timeout=10) as client:
        url = f"{nodes[0].url}/v1/topics/{topic}"
        body = {"consumer_id": "late", "max_messages": 1000, "wait_ms": 2000}
        got = client.post(f"{url}/leases", json=body).json()["messages"]
        return sorted(m["id"] for m in got), client.get(url).json()["acked"]


def test_pipelined_entries_reach_each_follower_once(tmp_path, kafka_bootstrap, kafka_source):
    """Under load several Raft entries are in flight to a follower at once. The follower's
    answer to an older one must not rewind the leader's next index for it, or the leader
    sends entries again and the follower truncates ones it has applied (PySyncObj logs
    that as a possible divergence). 8 workers at batch 1, the case that most pipelines."""
    conf = write_conf(tmp_path, kafka_bootstrap, kafka_source, heartbeat_ms=3000)
    total = 4000
    fill(str(tmp_path / "warehouse"), "fo", buffer_rows(list(range(total)), lambda i: i % 8))
    env = {**os.environ, "DEJAQ_BROKER_RAFT_PASSWORD": secrets.token_hex(8)}
    nodes = cluster.plan(3, tmp_path / "raft")
    logs = start_logged(nodes, nodes, conf, env, tmp_path)
    try:
        cluster.wait_ready(nodes)
        with httpx.Client(timeout=10) as client, Workers(nodes, n=8, batch=1) as w:
            wait_until(lambda: acked(client, nodes) == total, timeout=120, what="all acked")
        assert w.redelivered_after_ack == []
        assert len(w.acked) == total
    finally:
        stop(nodes)
    for path in logs:
        assert "truncating already-applied" not in path.read_text(), path.read_text()[-2000:]


def test_a_topic_added_in_a_rolling_restart_keeps_its_leases_and_acks_on_every_node(
    tmp_path,
) -> None:
    """n1 and n2 serve topic `fresh`; n3's file lacks it (a rolling restart adding it,
    n3 not restarted yet). n3 keeps the state of `fresh`'s leases and acks all the same,
    in the snapshot it takes after Raft's minute: restarted with `fresh` in its file and
    made leader, it leases neither an acked message nor a leased one again."""
    conf = write_conf(tmp_path, "127.0.0.1:9", "in", heartbeat_ms=600_000)
    lacking = tmp_path / "lacking.yaml"
    lines = conf.read_text().splitlines(keepends=True)
    lacking.write_text("".join(line for line in lines if "name: fresh" not in line))
    fill(str(tmp_path / "warehouse"), "fresh", buffer_rows(list(range(6)), lambda i: 0))
    env = {**os.environ, "DEJAQ_BROKER_RAFT_PASSWORD": secrets.token_hex(8)}
    nodes = cluster.plan(3, tmp_path / "raft")
    a, b, c = nodes
    try:
        for node in (a, b):
            cluster.start_node(node, nodes, str(conf), env, new_cluster=True)
        cluster.wait_ready([a, b])
        cluster.start_node(c, nodes, str(lacking), env)
        cluster.wait_ready(nodes)
        with httpx.Client(timeout=30) as client:
            url = f"{a.url}/v1/topics/fresh"
            body = {"consumer_id": "w", "max_messages": 4, "wait_ms": 3000, "lease_ms": 600_000}
            got = client.post(f"{url}/leases", json=body)
            assert [m["id"] for m in got.json()["messages"]] == ["m0", "m1", "m2", "m3"]
            ack = {"consumer_id": "w", "ids": ["m0", "m1"]}
            assert client.post(f"{url}/acks", json=ack).json() == {"settled": 2}
            # Each node snapshots its state a minute after it started (PySyncObj's
            # logCompactionMinTime), and replays only the journal after it on a restart.
            wait_until((c.data_dir / "raft.dump").exists, timeout=120, what="n3's snapshot")
            cluster.stop_node(c)
            cluster.start_node(c, nodes, str(conf), env)
            cluster.wait_ready(nodes)
            cluster.stop_node(a)

            def n3_leads() -> bool:
                """n3 leads, or n2, leading, is stopped until n3 stands for election."""
                leader = leader_of([b, c], client)
                if leader is b:
                    term = cluster_info(client, b)["term"]
                    os.kill(b.proc.pid, signal.SIGSTOP)
                    try:
                        wait_until(
                            lambda: (cluster_info(client, c) or {}).get("term", 0) > term,
                            what="n3 standing for election",
                        )
                    finally:
                        os.kill(b.proc.pid, signal.SIGCONT)
                return leader is c

            wait_until(n3_leads, timeout=60, what="n3 leading")
            url = f"{c.url}/v1/topics/fresh"
            got = client.post(f"{url}/leases", json={**body, "max_messages": 10})
            assert got.status_code == 200, got.text
            assert [m["id"] for m in got.json()["messages"]] == ["m4", "m5"]
            held = client.get(f"{url}/messages/m2").json()
            assert (held["status"], held["deliveries"]) == ("leased", 1), held
            assert client.get(f"{url}/messages/m0").json()["status"] in ("acked", "settled")
    finally:
        stop(nodes)


# --- the commands ----------------------------------------------------------------------------


def test_multi_node_broker_refuses_to_start_without_a_raft_password(tmp_path) -> None:
    conf = write_conf(tmp_path, "127.0.0.1:9", "in")
    env = {k: v for k, v in os.environ.items() if k != "DEJAQ_BROKER_RAFT_PASSWORD"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "dejaq.jobs.cli",
            "broker",
            "--node-id",
            "a",
            "--http",
            "127.0.0.1:1",
            "--raft",
            "127.0.0.1:2",
            "--peers",
            "127.0.0.1:3,127.0.0.1:4",
            "--conf-file",
            str(conf),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "broker.raft_password" in result.stderr


def test_a_broker_whose_raft_port_is_taken_exits_with_the_reason(tmp_path) -> None:
    conf = write_conf(tmp_path, "127.0.0.1:9", "in")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        raft = f"127.0.0.1:{taken.getsockname()[1]}"
        node = Node("a", f"127.0.0.1:{free_port()}", raft, tmp_path / "a")
        result = subprocess.run(
            cluster.node_command(node, [node], str(conf)),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2, result.stderr
    assert f"cannot listen on the Raft address {raft}" in result.stderr


def exit_at_start(tmp_path: Path, conf: Path) -> tuple[int, str]:
    """Start node "a" alone on `conf`, which it is expected to refuse: its exit code and
    what it wrote to stderr."""
    node = Node("a", f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}", tmp_path / "a")
    log = tmp_path / "a.log"
    with log.open("w") as err:
        proc = node.proc = subprocess.Popen(
            cluster.node_command(node, [node], str(conf)), stdout=subprocess.DEVNULL, stderr=err
        )
    try:
        wait_until(lambda: proc.poll() is not None, timeout=60, what="the node to exit")
    finally:
        stop([node])
    return proc.returncode, log.read_text()


FILES = 512  # the open-file limit, soft and hard, of the node below


def _few_files() -> None:
    """In the child before it runs: a limit the node cannot raise."""
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (FILES, FILES))


@pytest.mark.parametrize(
    "wanted", [None, 40, 10 * FILES], ids=["files", "max_connections", "beyond_files"]
)
def test_a_node_past_its_connection_cap_answers_503_and_keeps_its_files_and_probes(
    tmp_path, wanted: int | None
) -> None:
    """More long polls than the open-file limit allows: a node that took them all could
    open no Delta log, Raft file or probe's connection. It serves up to its cap, answers
    the rest a 503 that applied nothing (the client asks another node), and its probes,
    files and Raft keep working. `broker.max_connections` lowers the cap."""
    conf = write_conf(tmp_path, "127.0.0.1:9", "in")
    if wanted is not None:
        text = conf.read_text().replace(
            "lease_ms: 2000", f"lease_ms: 2000, max_connections: {wanted}"
        )
        conf.write_text(text)
    node = Node("a", f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}", tmp_path / "a")
    with (tmp_path / "a.log").open("w") as err:
        proc = node.proc = subprocess.Popen(
            cluster.node_command(node, [node], str(conf)),
            stdout=err,
            stderr=err,
            preexec_fn=_few_files,
        )
    cap, polls = connection_cap(FILES, PROBE_ROOM, wanted), FILES + 100
    assert cap == min(wanted or FILES, connection_cap(FILES, PROBE_ROOM)), "never raised"
    host, port = node.http.split(":")
    socks: list[socket.socket] = []
    try:
        wait_until(lambda: cluster.ready([node]), timeout=90, what="the node ready")
        said = (tmp_path / "a.log").read_text()
        assert f"HTTP connections up to {cap}" in said, said
        beyond = f"warning: broker.max_connections is {wanted}, but the open-file limit"
        assert (beyond in said) == (wanted is not None and wanted > cap), said
        for i in range(polls):
            body = json.dumps({"consumer_id": f"w{i}", "max_messages": 1, "wait_ms": 30_000})
            sock = socket.create_connection((host, int(port)), timeout=10)
            sock.sendall(
                b"POST /v1/topics/jobs/leases HTTP/1.1\r\nhost: a\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (len(body), body.encode())
            )
            sock.setblocking(False)
            socks.append(sock)
        answers: dict[socket.socket, bytes] = {}

        def read() -> int:
            for sock in socks:
                try:
                    answers[sock] = answers.get(sock, b"") + sock.recv(4096)
                except BlockingIOError:
                    pass
                except ConnectionResetError:  # accepted and dropped: no answer
                    answers[sock] = answers.get(sock, b"") + b"(reset)"
            return len(answers)

        wait_until(lambda: read() >= polls - cap, timeout=60, what="the excess answered")
        assert polls - cap <= len(answers) < polls, "the polls within the cap wait"
        for answer in answers.values():
            assert answer.startswith(b"HTTP/1.1 503 "), answer[:200]
            assert b"dejaq-not-applied: connections" in answer and b"node full" in answer
        with httpx.Client(timeout=10) as client:
            assert client.get(f"{node.url}/healthz").status_code == 200
            readyz = client.get(f"{node.url}/readyz")
            assert readyz.status_code == 200, readyz.text
            # Room left for its own files beyond the probes' (the kernel stops at FILES).
            assert len(os.listdir(f"/proc/{proc.pid}/fd")) < FILES - PROBE_ROOM
            for sock in socks:
                sock.close()
            socks.clear()

            def leased() -> bool:
                body = {"consumer_id": "after", "max_messages": 1}
                return client.post(f"{node.url}/v1/topics/jobs/leases", json=body).is_success

            wait_until(leased, timeout=60, what="a lease once the polls are gone")
        assert proc.poll() is None, (tmp_path / "a.log").read_text()
    finally:
        for sock in socks:
            sock.close()
        stop([node])


def test_a_broker_refuses_a_topic_whose_buffer_holds_another_kinds_rows(tmp_path) -> None:
    """A timeline's pending deliver_at times (epoch ms) read as priorities would be leased
    at once: a node whose configuration made the topic a priority one exits at start,
    naming the topic, both kinds and the way out, before it serves a lease."""
    warehouse = str(tmp_path / "warehouse")
    ensure_buffer(warehouse, TopicConfig(name="later", kind="timeline", source=["in"]))
    due = int(time.time() * 1000) + 3_600_000
    fill(warehouse, "later", buffer_rows([due, due + 1], timeline=True))
    conf = tmp_path / "dejaq.yaml"
    conf.write_text(
        f"warehouse: {warehouse}\n"
        "kafka: {bootstrap: '127.0.0.1:9'}\n"
        "topics:\n  - {name: later, kind: priority, source: [in], buckets: 4}\n"
    )
    code, said = exit_at_start(tmp_path, conf)
    assert code == 2, said
    assert (
        "topic 'later' is configured as kind priority, but its buffer holds 2 rows written as "
        "kind timeline" in said
    ), said
    assert "Set kind back to timeline" in said


def test_a_node_whose_pending_messages_do_not_fit_its_disk_reserve_says_so_at_start(
    tmp_path,
) -> None:
    """A node keeps `disk_reserve_bytes` free for its Raft journal; one whose disk is
    within it cannot index its pending messages at start: it exits 1, naming the folder
    and the setting, not with a traceback. A reserve above the disk's free space stands
    in for a full disk."""
    warehouse = str(tmp_path / "warehouse")
    fill(warehouse, "jobs", buffer_rows([1, 2]))
    beyond = shutil.disk_usage(tmp_path).free + (1 << 40)
    conf = tmp_path / "dejaq.yaml"
    conf.write_text(
        f"warehouse: {warehouse}\n"
        "kafka: {bootstrap: '127.0.0.1:9'}\n"
        f"broker: {{disk_reserve_bytes: {beyond}}}\n"
        "topics:\n  - {name: jobs, kind: priority, source: [in], buckets: 4}\n"
    )
    code, said = exit_at_start(tmp_path, conf)
    assert code == 1, said
    assert "error: node a cannot index its pending messages:" in said, said
    assert "broker.disk_reserve_bytes" in said and "Traceback" not in said, said


BACKLOG_ROWS, BACKLOG_BUCKETS = 300_000, 8
LOADING = re.compile(rf"indexes loading: jobs (\d+)/{BACKLOG_BUCKETS} buckets, (\d+) rows")


@pytest.fixture(scope="module")
def backlog(tmp_path_factory) -> Path:
    """The configuration of one topic whose buffer holds a backlog a node takes seconds
    to load: the nodes of the tests that use it only read it (nothing is leased)."""
    tmp = tmp_path_factory.mktemp("backlog")
    warehouse = str(tmp / "warehouse")
    fill(warehouse, "jobs", backlog_rows(BACKLOG_ROWS, BACKLOG_BUCKETS))
    conf = tmp / "dejaq.yaml"
    conf.write_text(
        f"warehouse: {warehouse}\n"
        "kafka: {bootstrap: '127.0.0.1:9'}\n"
        f"topics:\n  - {{name: jobs, kind: priority, source: [in], buckets: {BACKLOG_BUCKETS}}}\n"
    )
    return conf


def start_on_backlog(tmp_path: Path, conf: Path) -> tuple[Node, Path]:
    """A one-node cluster started on `backlog`: the node and its log (stderr)."""
    env = {**os.environ, "DEJAQ_BROKER_RAFT_PASSWORD": secrets.token_hex(8)}
    nodes = cluster.plan(1, tmp_path / "raft")
    (log,) = start_logged(nodes, nodes, conf, env, tmp_path)
    return nodes[0], log


def loading_seen(client: httpx.Client, node: Node) -> tuple[int, int] | None:
    """The load's progress (buckets done, rows), if `node` answers that it loads; its
    liveness answers 200 meanwhile, and any other call a 503 saying so."""
    assert node.proc.poll() is None, f"the node exited with code {node.proc.returncode}"
    try:
        ready = client.get(f"{node.url}/readyz")
    except httpx.TransportError:  # not listening yet
        return None
    loading = LOADING.search(ready.json().get("detail", "")) if ready.status_code == 503 else None
    if loading is None:
        return None
    assert client.get(f"{node.url}/healthz").status_code == 200
    other = client.get(f"{node.url}/v1/topics/jobs")
    # The load may end between the two requests: Raft then starts, the node still
    # starting; or it is ready, and serves.
    if other.status_code != 200:
        assert other.status_code == 503 and other.headers["content-type"] == PROBLEM, other.text
        assert other.json()["title"] == "node starting", other.text
        assert other.headers["dejaq-not-applied"] == "starting", "the client may ask elsewhere"
        detail = other.json()["detail"]
        assert "indexes loading: jobs" in detail or "Raft starting" in detail, other.text
    return int(loading[1]), int(loading[2])


def test_a_node_loading_a_backlog_answers_liveness_and_its_progress_until_ready(
    tmp_path, backlog: Path
) -> None:
    """A node loads its indexes (the whole buffer) before it joins Raft: over a large
    backlog that takes minutes. It serves HTTP meanwhile: `/healthz` answers 200, so a
    liveness probe does not kill it again and again; `/readyz` 503 with the load's
    progress, every other call 503; its log says how the load goes. Then it serves."""
    node, log = start_on_backlog(tmp_path, backlog)
    seen: list[tuple[int, int]] = []
    try:
        with httpx.Client(timeout=10) as client:

            def ready() -> bool:
                progress = loading_seen(client, node)
                if progress is not None:
                    seen.append(progress)
                    return False
                return cluster.ready([node])

            wait_until(ready, timeout=180, what="the node to load, then be ready")
            stats = client.get(f"{node.url}/v1/topics/jobs").json()
    finally:
        stop([node])
    assert seen, "the node answered nothing while it loaded"
    assert any(0 < buckets < BACKLOG_BUCKETS for buckets, _ in seen), seen
    assert seen == sorted(seen) and seen[-1][1] > 0, seen
    assert stats["pending"] == BACKLOG_ROWS, stats
    said = log.read_text()
    assert "loading the index of jobs" in said, said
    assert f"indexed jobs: {BACKLOG_ROWS} pending messages" in said, said


def test_status_shows_a_node_loading_its_indexes_as_starting_with_its_progress(
    tmp_path, backlog: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`status --broker` on a node that loads its indexes: every call but the probes
    answers 503 "node starting" (no cluster view), and /readyz says how far. Status
    shows the node starting, with that progress, not unreachable; a node not ready
    fails status (exit 1) as any other."""
    node, _ = start_on_backlog(tmp_path, backlog)
    host = node.url.partition("://")[2]
    try:
        with httpx.Client(timeout=10) as client:

            def shown_starting() -> tuple[bool, str] | None:
                if loading_seen(client, node) is None:
                    return None
                ok = print_nodes(node.url, "jobs", None, None)
                said = capsys.readouterr().out
                return (ok, said) if "STARTING" in said else None

            ok, said = wait_until(shown_starting, timeout=120, what="the node shown starting")
    finally:
        stop([node])
    assert ok is False, said
    assert re.search(
        rf"^  {re.escape(host)} +STARTING: indexes loading: jobs \d+/{BACKLOG_BUCKETS} "
        r"buckets, \d+ rows; ask another node for the others$",
        said,
        re.MULTILINE,
    ), said
    assert "unreachable" not in said, said


SIGNALS = pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])


def stopped_by(node: Node, log: Path, sig: signal.Signals) -> tuple[float, str]:
    """Send `node` the signal and wait for it to exit 0: how long that took, and what
    it said. Its last line says the node stopped (`Broker.stop` returned), naming the
    signal."""
    node.proc.send_signal(sig)
    began = time.monotonic()
    ended = node.proc.wait(timeout=30)
    took = time.monotonic() - began
    said = log.read_text()
    assert ended == 0 and "Traceback" not in said, said
    assert said.splitlines()[-1] == f"broker {node.node_id}: stopped on {sig.name}", said
    return took, said


@SIGNALS
def test_a_node_stopped_while_it_loads_ends_promptly(
    tmp_path, backlog: Path, sig: signal.Signals
) -> None:
    """SIGTERM or Ctrl-C while the indexes load (an orchestrator giving up on a start)
    ends the node within seconds, exit 0, as either does once it serves: the load stops
    between two slices of rows, then the node stops."""
    node, log = start_on_backlog(tmp_path, backlog)
    try:
        with httpx.Client(timeout=10) as client:
            wait_until(lambda: loading_seen(client, node), timeout=120, what="the load")
        took, said = stopped_by(node, log, sig)
    finally:
        stop([node])
    assert took < 5, f"{took:.1f} s to end"
    assert "indexed jobs" not in said, said


@SIGNALS
def test_a_serving_node_stopped_by_a_signal_stops_raft_and_exits_0(
    tmp_path, sig: signal.Signals
) -> None:
    """SIGTERM (systemd, Kubernetes, `kill`) or Ctrl-C ends a serving node as a stop:
    the HTTP server stops taking requests, a long poll waiting on it answers at once
    with no messages (not an error at the stop's end), the node stops its duties, Raft
    and head stores, and the process exits 0, within seconds."""
    conf = write_conf(tmp_path, "127.0.0.1:9", "in")
    env = {**os.environ, "DEJAQ_BROKER_RAFT_PASSWORD": secrets.token_hex(8)}
    nodes = cluster.plan(1, tmp_path / "raft")
    (log,) = start_logged(nodes, nodes, conf, env, tmp_path)
    (node,) = nodes
    polled: list[httpx.Response] = []
    body = {"consumer_id": "waiting", "max_messages": 1, "wait_ms": 30_000}
    poll = threading.Thread(
        target=lambda: polled.append(
            httpx.post(f"{node.url}/v1/topics/jobs/leases", json=body, timeout=60)
        )
    )
    try:
        cluster.wait_ready(nodes)
        poll.start()
        wait_until(
            lambda: "waiting" in httpx.get(f"{node.url}/v1/topics/jobs").json()["consumers"],
            what="the long poll waiting",
        )
        took, _ = stopped_by(node, log, sig)
        poll.join(30)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{node.url}/healthz", timeout=5)
    finally:
        stop(nodes)
    assert took < 5, f"{took:.1f} s to end"
    (answer,) = polled
    assert answer.status_code == 200 and answer.json()["messages"] == [], answer.text


def test_a_peer_on_the_old_wire_format_is_refused_and_named(
    tmp_path, kafka_bootstrap: str, kafka_source: str
) -> None:
    """Raft messages are AES-GCM; a peer still on PySyncObj's Fernet (a DejaQ broker from
    before) cannot talk to the others. They log why, and nothing it sends is applied: the
    two current nodes are a majority and serve, the old one never learns of a leader."""
    from pysyncobj import SyncObj, SyncObjConf

    conf = write_conf(tmp_path, kafka_bootstrap, kafka_source)
    password = secrets.token_hex(8)
    env = {**os.environ, "DEJAQ_BROKER_RAFT_PASSWORD": password}
    new = cluster.plan(2, tmp_path / "raft")
    # 127.0.0.2 sorts after 127.0.0.1, and in PySyncObj the higher address dials: the old
    # peer sends the first message of each connection, in its format.
    old = Node("old", "127.0.0.2:1", f"127.0.0.2:{free_port()}", tmp_path / "old")
    logs = start_logged(new, [*new, old], conf, env, tmp_path)
    peer = SyncObj(old.raft, [n.raft for n in new], SyncObjConf(password=password))
    try:
        cluster.wait_ready(new)
        wait_until(
            lambda: any("Fernet wire format" in p.read_text() for p in logs),
            what="a current node naming the old wire format",
        )
        fill(str(tmp_path / "warehouse"), "hot", buffer_rows([5, 6], prefix="w"))
        with httpx.Client(timeout=40) as client:
            url = f"{leader_of(new, client).url}/v1/topics/hot"
            body = {"consumer_id": "c", "max_messages": 2, "wait_ms": 5000}
            leased = client.post(f"{url}/leases", json=body).json()["messages"]
            ids = [m["id"] for m in leased]
            assert len(ids) == 2
            acked = client.post(f"{url}/acks", json={"consumer_id": "c", "ids": ids})
            assert acked.json() == {"settled": 2}
        status = peer.getStatus()
        assert status["leader"] is None and status["log_len"] == 1, status
    finally:
        peer.destroy_synchronous()
        stop(new)


CLUSTER_UP = [sys.executable, "-m", "dejaq.jobs.cli", "cluster", "up"]


def ports(n: int) -> list[str]:
    """`cluster up`'s port options: runs of `n` free ports for HTTP and for Raft."""

    def base(avoid: range = range(0)) -> int:
        while True:
            first = free_port()
            run = range(first, first + n)
            if not set(run) & set(avoid) and not cluster.taken(
                cluster.plan(n, Path(), first, first)
            ):
                return first

    http = base()
    return ["--http-port", str(http), "--raft-port", str(base(range(http, http + n)))]


def cluster_up(
    tmp_path: Path,
    conf: Path,
    options: list[str],
    nodes: int = 3,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen, list[str]]:
    """`dejaq cluster up` (`env` added to this process's); the process and the lines it
    printed up to "stops"."""
    proc = subprocess.Popen(
        [
            *CLUSTER_UP,
            "--nodes",
            str(nodes),
            "--data-dir",
            str(tmp_path / "c"),
            "--conf-file",
            str(conf),
            *options,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdout is not None
    try:
        up = Lines(proc.stdout).until(lambda line: "stops the cluster" in line, 180, "up")
    except (AssertionError, pytest.fail.Exception):
        stop_child(proc, timeout=60)  # it stops the nodes it started
        pytest.fail(f"`dejaq cluster up` did not come up: {proc.stderr.read()}")
    return proc, up


def test_cluster_up_on_fixed_ports_prints_a_client_line_and_stops_on_sighup(tmp_path) -> None:
    conf = write_conf(tmp_path, "127.0.0.1:9", "in")
    options = ports(3)
    http = int(options[1])
    proc, lines = cluster_up(tmp_path, conf, options)
    try:
        urls = [f"http://127.0.0.1:{http + i}" for i in range(3)]
        assert [line.split()[1] for line in lines[:3]] == urls
        assert lines[3] == f"workers: Client({urls!r})"
        taken = subprocess.run(
            [*CLUSTER_UP, "--nodes", "3", "--data-dir", str(tmp_path / "d"), *options],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert taken.returncode == 2
        assert f"already in use: 127.0.0.1:{http}" in taken.stderr
        proc.send_signal(signal.SIGHUP)  # the terminal closed
        assert proc.wait(30) == 0
        for url in urls:
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"{url}/healthz", timeout=2)
        # Again on the same data, other HTTP ports (a node's Raft address is its identity):
        # the cluster names its nodes as they are now.
        proc, lines = cluster_up(tmp_path, conf, [*ports(3)[:2], *options[2:]])
        now = {line.split()[1].removeprefix("http://") for line in lines[:3]}
        info = httpx.get(f"http://{sorted(now)[0]}/v1/cluster", timeout=10).json()
        assert set(info["nodes"].values()) == now
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


def test_cluster_up_registers_each_node_at_its_own_address_whatever_advertise_says(
    tmp_path,
) -> None:
    """`broker.advertise` (here from the environment, as a one-node setup leaves it) names
    one node: had every node registered it, the others would forward their leader-only
    calls to that one address."""
    conf = write_conf(tmp_path, "127.0.0.1:9", "in")
    advertise = {"DEJAQ_BROKER_ADVERTISE": "127.0.0.1:8001"}
    proc, lines = cluster_up(tmp_path, conf, ports(3), env=advertise)
    try:
        # "n1: http://HOST:PORT  (raft HOST:PORT)": the cluster lists its nodes by Raft address
        own = {
            line.rsplit("(raft ", 1)[1].rstrip(")"): line.split()[1].removeprefix("http://")
            for line in lines[:3]
        }
        assert len(set(own.values())) == 3
        for address in own.values():
            info = httpx.get(f"http://{address}/v1/cluster", timeout=10).json()
            assert info["nodes"] == own
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_cluster_up_shares_the_configured_raft_password_else_a_fresh_one(tmp_path) -> None:
    conf = write_conf(tmp_path, "127.0.0.1:9", "in")
    environ = {k: v for k, v in os.environ.items() if k != "DEJAQ_BROKER_RAFT_PASSWORD"}

    def nodes_password(environ: dict[str, str]) -> str | None:
        """The Raft password the nodes of `cluster up` load, started in `environ`."""
        return load_settings(str(conf), cluster.node_env(str(conf), environ)).broker.raft_password

    fresh = nodes_password(environ)
    assert fresh and fresh != nodes_password(environ)  # one per cluster, not a fixed one
    assert nodes_password({**environ, "DEJAQ_BROKER_RAFT_PASSWORD": "given"}) == "given"
    conf.write_text(
        conf.read_text().replace("lease_ms: 2000", "lease_ms: 2000, raft_password: set")
    )
    assert nodes_password(environ) == "set"


def test_cluster_up_prints_addresses_and_stops_on_sigterm(tmp_path) -> None:
    conf = write_conf(tmp_path, "127.0.0.1:9", "in")
    proc, (line, *_) = cluster_up(tmp_path, conf, ports(1), nodes=1)
    try:
        assert line.startswith("n1: http://127.0.0.1:"), line
        url = line.split()[1]
        assert httpx.get(f"{url}/readyz", timeout=5).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/healthz", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cluster_up_fails_when_a_broker_dies(tmp_path) -> None:
    conf = write_conf(tmp_path, "127.0.0.1:9", "in")
    proc, (line, *_) = cluster_up(tmp_path, conf, ports(1), nodes=1)
    try:
        assert line.startswith("n1: http://127.0.0.1:")
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert len(children) == 1, "one broker process"
        os.kill(int(children[0]), signal.SIGKILL)
        assert proc.wait(30) == 1
        assert "a broker exited (n1 exit -9)" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cluster_up_killed_hard_takes_its_nodes_with_it(tmp_path) -> None:
    """A `cluster up` killed by SIGKILL (or the OOM killer) cannot stop its nodes; they
    go with it rather than stay on as a leader nobody runs."""
    conf = write_conf(tmp_path, "127.0.0.1:9", "in")
    proc, (line, *_) = cluster_up(tmp_path, conf, ports(1), nodes=1)
    [child] = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    stat = Path(f"/proc/{child}/stat")

    def gone() -> bool:  # exited: reaped, or a zombie its new parent has not reaped yet
        return not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"

    try:
        proc.kill()
        proc.wait(30)
        wait_until(gone, timeout=30, what="the node to exit")
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{line.split()[1]}/healthz", timeout=2)
    finally:
        if not gone():
            os.kill(int(child), signal.SIGKILL)


def test_a_forwarded_lease_is_relayed_as_it_arrives_not_after_the_client_gave_up() -> None:
    """A lease answer of large payloads takes 3 s to come from the leader over a slow
    link: relayed whole, the client would hear nothing for longer than its 2 s stall
    timeout, give up and lease again, each lease costing its messages a delivery. The follower
    is the node's real forwarding handler; the leader is a stand-in that sends its
    answer slowly (a slow link between hosts cannot be made here otherwise)."""
    import asyncio

    import uvicorn
    from fastapi import FastAPI

    from dejaq.broker.api.app import _forward
    from dejaq.broker.api.dependencies import ForwardToLeader

    payload = base64.b64encode(b"x" * (6 << 20))  # 8 MB of JSON, in 24 chunks
    message = {
        "id": "m0",
        "bucket": 0,
        "sort_key": 1,
        "priority": 1,
        "deliver_at": None,
        "key": None,
        "payload": "PAYLOAD",
        "deliveries": 1,
        "lease_deadline": int(time.time() * 1000) + 60_000,
        "receipt": 1,
    }
    head, tail = json.dumps({"messages": [message]}).encode().split(b"PAYLOAD")
    leases: list[float] = []

    async def leader(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        while (await receive()).get("more_body"):
            pass
        leases.append(time.monotonic())
        size = len(head) + len(payload) + len(tail)
        start = {"type": "http.response.start", "status": 200}
        start["headers"] = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % size),
        ]
        await send(start)
        await send({"type": "http.response.body", "body": head, "more_body": True})
        step = len(payload) // 24 + 1
        for i in range(0, len(payload), step):
            await asyncio.sleep(0.125)
            await send(
                {"type": "http.response.body", "body": payload[i : i + step], "more_body": True}
            )
        await send({"type": "http.response.body", "body": tail})

    leader_port, follower_port = free_port(), free_port()

    class Raft:
        def leader_http(self) -> str:
            return f"127.0.0.1:{leader_port}"

    follower = FastAPI()
    follower.state.broker = type("Broker", (), {"raft": Raft()})()
    follower.state.scheme, follower.state.forward_tag = "http", None
    follower.add_exception_handler(ForwardToLeader, _forward)

    @follower.post("/v1/topics/{topic}/leases")
    async def lease(topic: str) -> None:
        raise ForwardToLeader()

    servers = []
    for app, port in ((leader, leader_port), (follower, follower_port)):
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append((server, thread))
    try:
        wait_until(lambda: all(s.started for s, _ in servers), what="both servers")

        async def relayed() -> list:
            async with httpx.AsyncClient(timeout=40) as http:
                follower.state.http = http
                client = Client([f"127.0.0.1:{follower_port}"], deadline=8)
                return await asyncio.to_thread(client.lease, "jobs", "w", 1)

        got = asyncio.run(relayed())
    finally:
        for server, thread in servers:
            server.should_exit = True
            thread.join(timeout=10)
    assert [m.id for m in got] == ["m0"] and len(got[0].payload) == 6 << 20
    assert len(leases) == 1, "leased once: the client did not give up and lease again"


def solo_conf(tmp_path: Path) -> tuple[Path, str]:
    """A configuration of one topic, "jobs", its buffer filled: (its file, the warehouse)."""
    warehouse = str(tmp_path / "warehouse")
    ensure_buffer(warehouse, TopicConfig(name="jobs", kind="priority", source=["in"]))
    fill(warehouse, "jobs", buffer_rows(list(range(20_000)), bucket_of=lambda i: i % 2))
    conf = tmp_path / "dejaq.yaml"
    conf.write_text(
        f"warehouse: {warehouse}\n"
        "kafka: {bootstrap: '127.0.0.1:9'}\n"
        "topics:\n  - {name: jobs, kind: priority, source: [in], buckets: 2}\n"
    )
    return conf, warehouse


def solo(tmp_path: Path, name: str, conf: Path) -> tuple[Node, dict[str, str]]:
    """A one-node cluster of its own (data dir, Raft password) over `conf`'s warehouse,
    started, not waited for: (its node, its environment, to restart it with)."""
    [node] = cluster.plan(1, tmp_path / name)
    env = {**os.environ, "DEJAQ_BROKER_RAFT_PASSWORD": secrets.token_hex(8)}
    cluster.start_node(node, [node], str(conf), env, new_cluster=True)
    return node, env


def ledger_tags(warehouse: str) -> dict[str, int]:
    """The ledger's app transactions (`ledger_writer.app_id`) and their latest versions."""
    from dejaq.conf.tables import Table, ensure_table

    tags: dict[str, int] = {}
    log = Path(ensure_table(warehouse, Table.LEDGER, "jobs")) / "_delta_log"
    for commit in sorted(log.glob("*.json")):
        for line in commit.read_text().splitlines():
            txn = json.loads(line).get("txn")
            if txn is not None:
                tags[txn["appId"]] = txn["version"]
    return tags


def contested(client: httpx.Client, node: Node) -> str | None:
    """The node's /readyz detail once it says another cluster writes the ledger."""
    try:
        got = client.get(f"{node.url}/readyz")
    except httpx.HTTPError:  # not listening yet
        return None
    if got.status_code == 503 and "another broker cluster writes the ledger" in got.text:
        return got.text
    return None


def test_a_second_cluster_over_one_warehouse_leaves_the_topic_to_the_first(tmp_path) -> None:
    """A second cluster started over a live one's warehouse (another Raft password) finds
    the ledger tagged by a history whose tag keeps moving: it turns unready naming the
    topic and what to do, refuses leases, and writes nothing to the ledger, while the
    first goes on checkpointing. Restarted once the first is stopped, it takes the
    ledger over under a new history and serves."""
    conf, warehouse = solo_conf(tmp_path)
    a, _ = solo(tmp_path, "a", conf)
    b: Node | None = None
    try:
        cluster.wait_ready([a])
        with httpx.Client(timeout=10) as client, Workers([a], 1, 5, "jobs"):
            wait_until(
                lambda: ledger_tags(warehouse).get(BROKER_APP_ID), what="the first's checkpoints"
            )
            b, b_env = solo(tmp_path, "b", conf)
            with Workers([b], 1, 5, "jobs"):
                said = wait_until(lambda: contested(client, b), timeout=60, what="b contested")
            assert f"of jobs: its tag {BROKER_APP_ID} moved" in said, said
            assert "Stop one of the clusters" in said, said
            lease = client.post(
                f"{b.url}/v1/topics/jobs/leases", json={"consumer_id": "x", "max_messages": 1}
            )
            assert lease.status_code == 503 and "another broker cluster" in lease.text
            metrics = client.get(f"{b.url}/metrics").text
            assert 'dejaq_ledger_contested{topic="jobs"} 1.0' in metrics
            before = ledger_tags(warehouse)[BROKER_APP_ID]
            # Messages for the first to settle, however far it got with the others.
            fill(warehouse, "jobs", buffer_rows(list(range(200)), lambda i: i % 2, "more"))
            wait_until(lambda: ledger_tags(warehouse)[BROKER_APP_ID] > before, what="a checkpoint")
            assert set(ledger_tags(warehouse)) == {BROKER_APP_ID}, "only the first wrote the ledger"
            assert client.get(f"{a.url}/readyz").status_code == 200
        stop([a])
        stop([b])
        fill(warehouse, "jobs", buffer_rows(list(range(200)), lambda i: i % 2, "late"))
        cluster.start_node(b, [b], str(conf), b_env)
        cluster.wait_ready([b])
        with Workers([b], 1, 5, "jobs"):
            wait_until(lambda: len(ledger_tags(warehouse)) == 2, what="b's new history")
    finally:
        stop([a] if b is None else [a, b])
