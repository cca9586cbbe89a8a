"""Who may do what, on real nodes: TLS on every node's HTTP, API keys as bearer tokens,
a role per route on the route's topic, forwards taken from cluster nodes only."""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from http import client as http_client
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import wait_until
from hypothesis import given
from hypothesis import strategies as st
from test_broker import buffer_rows, fill
from test_broker_cluster import leader_of

from dejaq.broker.api.access import (
    FORWARD_TTL_MS,
    FORWARDED,
    ROUTES,
    Guard,
    forward_tag,
    required,
)
from dejaq.broker.api.keys import (
    Grant,
    Key,
    KeyFileError,
    KeyRing,
    add_key,
    read_keys,
    revoke_key,
    split_token,
)
from dejaq.broker.api.starting import NODE_STARTING
from dejaq.client import Client, Forbidden, NotFound, Unauthorized, Unavailable, Worker
from dejaq.conf.settings import TOPIC_NAME
from dejaq.jobs import children, cluster
from dejaq.jobs.certificates import new_authority
from dejaq.jobs.ports import free_port

ROLES = ("produce", "consume", "operate", "read", "monitor")
PARAMS = {"topic": "jobs", "message_id": "a1", "consumer_id": "c1", "schedule_id": "s1"}


def write_secure_conf(tmp: Path, bootstrap: str, source: str) -> tuple[Path, Path, Path]:
    """A configuration with TLS and keys on; returns (conf, CA file, keys file)."""
    ca = new_authority(tmp / "pki")
    node = ca.issue(tmp / "pki", "node", ["127.0.0.1", "localhost"])
    keys = tmp / "keys.json"
    conf = tmp / "dejaq.yaml"
    conf.write_text(
        f"warehouse: {tmp / 'warehouse'}\n"
        f"kafka: {{bootstrap: '{bootstrap}'}}\n"
        "broker:\n"
        "  lease_ms: 5000\n"
        f"  keys_file: {keys}\n"
        f"  tls: {{cert: {node.cert}, key: {node.key}, ca: {ca.cert}}}\n"
        "topics:\n"
        f"  - {{name: jobs, kind: priority, source: [{source}], buckets: 4}}\n"
        f"  - {{name: other, kind: priority, source: [{source}], buckets: 4}}\n"
        f"  - {{name: orders.x, kind: cron, source: [unused-{source}], buckets: 2}}\n"
    )
    return conf, ca.cert, keys


@pytest.fixture(scope="module")
def secure(tmp_path_factory, kafka_bootstrap: str, kafka_source: str) -> Iterator[dict]:
    tmp: Path = tmp_path_factory.mktemp("access")
    conf, ca, keys_file = write_secure_conf(tmp, kafka_bootstrap, kafka_source)
    keys = {role: add_key(keys_file, role, [role], ["jobs"]) for role in ROLES}
    keys["all"] = add_key(keys_file, "all", list(ROLES), ["*"])
    fill(str(tmp / "warehouse"), "jobs", buffer_rows(list(range(20)), prefix="a"))
    os.environ.setdefault("DEJAQ_BROKER_RAFT_PASSWORD", secrets.token_hex(8))
    logs = tmp / "logs"
    logs.mkdir()
    nodes = cluster.plan(3, tmp / "raft")
    env = dict(os.environ)
    new = cluster.fresh(nodes)  # once: a node started first may have made its dir
    for node in nodes:
        node.scheme, node.ca = "https", str(ca)
        with (logs / f"{node.node_id}.log").open("w") as log:
            node.proc = subprocess.Popen(
                cluster.node_command(node, nodes, str(conf), new),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
    try:
        cluster.wait_ready(nodes)
        verify = ssl.create_default_context(cafile=str(ca))
        with httpx.Client(timeout=30, verify=verify) as http:
            yield {
                "nodes": nodes,
                "keys": keys,
                "keys_file": keys_file,
                "ca": ca,
                "http": http,
                "logs": logs,
                "tmp": tmp,
            }
    finally:
        for node in nodes:
            cluster.stop_node(node)


def key_id(key: str) -> str:
    parts = split_token(key)
    assert parts is not None
    return parts[0]


def secret_of(key: str) -> str:
    parts = split_token(key)
    assert parts is not None
    return parts[1]


def monitor_client(secure: dict) -> httpx.Client:
    """A client with the `monitor` key, to find the leader by."""
    verify = ssl.create_default_context(cafile=str(secure["ca"]))
    return httpx.Client(verify=verify, headers=bearer(secure["keys"]["monitor"]))


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def operations(http: httpx.Client, url: str) -> list[tuple[str, str]]:
    spec = http.get(f"{url}/openapi.json").json()
    return [(m.upper(), p) for p, ops in spec["paths"].items() for m in ops]


def test_every_route_declares_and_enforces_its_role(secure) -> None:
    """Each operation of the OpenAPI, with no key, a wrong key, a key of every other role
    and the right one: 401, 401, 403, and never 401/403 with the right one."""
    http, nodes, keys = secure["http"], secure["nodes"], secure["keys"]
    url = nodes[0].url
    spec = http.get(f"{url}/openapi.json").json()
    assert spec["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
    table = {(m, p): r for m, p, r in ROUTES}
    ops = operations(http, url)
    assert {(m, p) for m, p in ops if p not in ("/healthz", "/readyz")} == set(table)
    for method, path in ops:
        target = url + path.format(**PARAMS)
        role = table.get((method, path))
        if path in ("/healthz", "/readyz"):
            assert http.request(method, target).status_code == 200
            continue
        assert spec["paths"][path][method.lower()]["security"] == [{"apiKey": []}]
        answers = {
            "none": http.request(method, target),
            "wrong": http.request(method, target, headers=bearer("dq_0000_nope")),
            "garbage": http.request(method, target, headers=bearer("not a key at all")),
        }
        for name, answer in answers.items():
            assert answer.status_code == 401, (method, path, name, answer.text)
            problem = answer.json()
            assert answer.headers["content-type"] == "application/problem+json"
            assert answer.headers["www-authenticate"].startswith("Bearer")
            if role is not None:
                assert f"role '{role}'" in problem["detail"]
        for other in ROLES:
            answer = http.request(method, target, headers=bearer(keys[other]))
            if role is None or other == role:
                assert answer.status_code not in (401, 403), (method, path, other, answer.text)
            else:
                assert answer.status_code == 403, (method, path, other, answer.text)
                assert f"role '{role}'" in answer.json()["detail"]


def test_a_role_holds_on_its_topics_only(secure) -> None:
    http, url, keys = secure["http"], secure["nodes"][0].url, secure["keys"]
    body = {"consumer_id": "c", "max_messages": 1}
    refused = http.post(f"{url}/v1/topics/other/leases", json=body, headers=bearer(keys["consume"]))
    assert refused.status_code == 403
    assert "role 'consume' on topic 'other'" in refused.json()["detail"]
    allowed = http.post(f"{url}/v1/topics/other/leases", json=body, headers=bearer(keys["all"]))
    assert allowed.status_code == 200
    lower = {"authorization": f"bearer {keys['all']}"}  # the scheme's case does not matter
    assert http.post(f"{url}/v1/topics/other/leases", json=body, headers=lower).status_code == 200


def test_a_monitor_key_sees_its_own_topics_only(secure) -> None:
    """`/v1/cluster` and `/metrics` show the per-topic parts of the topics a key monitors;
    Raft's and the process's to any monitor key."""
    http, url, keys = secure["http"], secure["nodes"][0].url, secure["keys"]
    every = {"jobs", "other", "orders.x"}
    for key, topics in ((keys["monitor"], {"jobs"}), (keys["all"], every)):
        view = http.get(f"{url}/v1/cluster", headers=bearer(key))
        assert view.status_code == 200, view.text
        assert set(view.json()["topics"]) == topics
        assert view.json()["role"] and len(view.json()["nodes"]) == 3
        scrape = http.get(f"{url}/metrics", headers=bearer(key))
        assert scrape.status_code == 200, scrape.text
        assert set(re.findall(r'topic="([^"]*)"', scrape.text)) == topics
        assert "dejaq_raft_term " in scrape.text and "process_resident_memory_bytes" in scrape.text


def test_a_follower_forwards_over_tls_and_a_forged_forward_is_refused(secure) -> None:
    http, nodes, keys = secure["http"], secure["nodes"], secure["keys"]
    verify = ssl.create_default_context(cafile=str(secure["ca"]))
    with httpx.Client(verify=verify, headers=bearer(keys["monitor"])) as monitor:
        leader = wait_until(lambda: leader_of(nodes, monitor), what="a leader")
    follower = next(n for n in nodes if n is not leader)
    body = {"consumer_id": "fw", "max_messages": 2}
    via = http.post(
        f"{follower.url}/v1/topics/jobs/leases", json=body, headers=bearer(keys["consume"])
    )
    assert via.status_code == 200 and len(via.json()["messages"]) == 2
    lease = f"{leader.url}/v1/topics/jobs/leases"
    content = json.dumps(body).encode()
    path = "/v1/topics/jobs/leases"
    guessed = forward_tag("guess", follower.http, "POST", path, content, key_id(keys["all"]))
    for forged in ("1", f"{follower.http} 1 2 - 0 {'0' * 64} {'0' * 64}", guessed):
        answer = http.post(lease, content=content, headers={"x-dejaq-forwarded": forged})
        assert answer.status_code == 401, forged
        assert answer.json()["title"] == "not a cluster node"
    # A key does not make a forged forward acceptable either.
    answer = http.post(lease, json=body, headers={**bearer(keys["all"]), "x-dejaq-forwarded": "1"})
    assert answer.status_code == 401


def test_a_forward_tag_seen_on_the_wire_opens_nothing_else(secure) -> None:
    """A tag is the node's word for one request: a copy of it is refused for that request
    again, for another route (a consume key's lease is no purge), and once stale."""
    http, nodes, keys = secure["http"], secure["nodes"], secure["keys"]
    verify = ssl.create_default_context(cafile=str(secure["ca"]))
    with httpx.Client(verify=verify, headers=bearer(keys["monitor"])) as monitor:
        leader = wait_until(lambda: leader_of(nodes, monitor), what="a leader")
    follower = next(n for n in nodes if n is not leader)
    password = os.environ["DEJAQ_BROKER_RAFT_PASSWORD"]  # the cluster's, as a node has it
    content = json.dumps({"consumer_id": "tagged", "max_messages": 1}).encode()
    path = "/v1/topics/jobs/leases"
    consume = key_id(keys["consume"])
    tag = forward_tag(password, follower.http, "POST", path, content, consume)

    def send(route: str, tag: str) -> httpx.Response:
        headers = {FORWARDED: tag, "content-type": "application/json"}
        return http.post(f"{leader.url}{route}", content=content, headers=headers)

    assert send(path, tag).status_code == 200, "a node's tag, fresh"
    assert send(path, tag).status_code == 401, "the same tag again"
    other = forward_tag(password, follower.http, "POST", path, content, consume)
    assert send("/v1/topics/jobs/purge", other).status_code == 401, "another route"
    stale = int(time.time() * 1000) - FORWARD_TTL_MS - 1000
    old = forward_tag(password, follower.http, "POST", path, content, consume, at_ms=stale)
    assert send(path, old).status_code == 401, "a stale tag"
    assert send(path, other).status_code == 200, "its own request, once"


def test_a_forged_forward_is_answered_before_its_body_is_sent(secure) -> None:
    """A caller with no key announces a 16 MiB body behind a forward tag of the right
    time, and sends none of it: the node answers at once, having read no body (reading
    it would wait for bytes that never come), whether the tag has the form of another
    version or was not made with the Raft password. A follower's own forward of a body
    still goes through."""
    nodes, keys = secure["nodes"], secure["keys"]
    verify = ssl.create_default_context(cafile=str(secure["ca"]))
    node = nodes[0]
    host, port = node.http.split(":")
    path = "/v1/topics/jobs/messages/batch"
    size = 16 * 1024 * 1024

    def answer(tag: str) -> tuple[int, str]:
        conn = http_client.HTTPSConnection(host, int(port), context=verify, timeout=10)
        try:
            conn.putrequest("POST", path)
            for name, value in (
                (FORWARDED, tag),
                ("content-type", "application/json"),
                ("content-length", str(size)),
            ):
                conn.putheader(name, value)
            conn.endheaders()  # the head alone: not a byte of the body
            got = conn.getresponse()
            return got.status, got.read().decode()
        finally:
            conn.close()

    now = int(time.time() * 1000)
    unsigned = f"{node.http} {now} n {key_id(keys['all'])} {size} {'0' * 64} {'0' * 64}"
    assert answer(f"evil {now} n 00")[0] == 503, "a tag of another version's form"
    status, body = answer(unsigned)
    assert status == 401 and json.loads(body)["title"] == "not a cluster node", body

    with monitor_client(secure) as monitor:
        leader = wait_until(lambda: leader_of(nodes, monitor), what="a leader")
    follower = next(n for n in nodes if n is not leader)
    fill(str(secure["tmp"] / "warehouse"), "other", buffer_rows(list(range(8)), prefix="o"))
    with Client([follower.url], token=keys["all"], verify=str(secure["ca"])) as via:
        leased = wait_until(lambda: via.lease("other", "forwarded", 8), 20, "a forwarded lease")
        acked = via.ack("other", "forwarded", receipts=[m.receipt for m in leased])
        assert acked.settled == len(leased)


def test_the_leader_holds_a_forward_to_the_key_its_tag_names(secure) -> None:
    """A node's tag names the key it let the caller in with: the leader takes it only for
    a key of its own file with the role the call needs, and from a node that let its
    caller in without a key (one without a key file) not at all."""
    http, nodes, keys = secure["http"], secure["nodes"], secure["keys"]
    with monitor_client(secure) as monitor:
        leader = wait_until(lambda: leader_of(nodes, monitor), what="a leader")
    password = os.environ["DEJAQ_BROKER_RAFT_PASSWORD"]
    path = "/v1/topics/jobs/purge"
    content = json.dumps({"confirm": "jobs"}).encode()

    def purge(key: str | None) -> httpx.Response:
        tag = forward_tag(password, "127.0.0.1:1", "POST", path, content, key)
        headers = {FORWARDED: tag, "content-type": "application/json"}
        return http.post(f"{leader.url}{path}", content=content, headers=headers)

    keyless = purge(None)
    assert keyless.status_code == 401, keyless.text
    assert "127.0.0.1:1, a node without API keys" in keyless.json()["detail"]
    reader = purge(key_id(keys["read"]))
    assert reader.status_code == 403 and "role 'operate'" in reader.json()["detail"]
    unknown = purge("0123456789ab")
    assert unknown.status_code == 401 and "key file lacks" in unknown.json()["detail"]
    described = http.get(f"{leader.url}/v1/topics/jobs", headers=bearer(keys["read"]))
    assert described.json()["pending"] > 0, "nothing purged"


def test_a_node_without_keys_opens_no_leader_only_call_to_callers_without_one(
    tmp_path: Path, kafka_bootstrap: str, kafka_source: str
) -> None:
    """Of three nodes on loopback, one is started without the key file (so it starts,
    and lets anyone in): a purge sent through it without a key is refused by the leader,
    which has keys, naming that node; with a key through a node with keys, it is done."""
    conf, ca, keys_file = write_secure_conf(tmp_path, kafka_bootstrap, kafka_source)
    operator = add_key(keys_file, "ops", ["operate", "read", "monitor"], ["*"])
    keyless_conf = tmp_path / "keyless.yaml"
    keyless_conf.write_text(re.sub(r"(?m)^  keys_file: .*\n", "", conf.read_text()))
    assert "keys_file" not in keyless_conf.read_text()
    fill(str(tmp_path / "warehouse"), "jobs", buffer_rows(list(range(8)), prefix="k"))
    nodes = cluster.plan(3, tmp_path / "raft")
    env = {**os.environ, "DEJAQ_BROKER_RAFT_PASSWORD": secrets.token_hex(8)}
    verify = ssl.create_default_context(cafile=str(ca))
    ops = bearer(operator)
    try:
        with (
            httpx.Client(timeout=30, verify=verify) as http,
            httpx.Client(timeout=30, verify=verify, headers=ops) as operating,
        ):
            # The keyed nodes first: they elect a leader, whose log the late one lacks.
            for node, node_conf in zip(nodes, (conf, conf, keyless_conf), strict=True):
                node.scheme, node.ca = "https", str(ca)
                node.proc = subprocess.Popen(
                    cluster.node_command(node, nodes, str(node_conf)),
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                if node is nodes[1]:
                    cluster.wait_ready(nodes[:2])
            cluster.wait_ready(nodes)
            leader = wait_until(lambda: leader_of(nodes, operating), what="a leader")
            keyless = nodes[2]
            assert leader is not keyless
            stats = f"{leader.url}/v1/topics/jobs"
            wait_until(lambda: operating.get(stats).json()["pending"] == 8, 20, "indexed")

            confirm = {"confirm": "jobs"}
            refused = http.post(f"{keyless.url}/v1/topics/jobs/purge", json=confirm)
            assert refused.status_code == 401, refused.text
            assert f"{keyless.http}, a node without API keys" in refused.json()["detail"]
            assert operating.get(stats).json()["pending"] == 8

            keyed = next(n for n in nodes if n is not leader and n is not keyless)
            done = operating.post(f"{keyed.url}/v1/topics/jobs/purge", json=confirm)
            assert done.status_code == 200 and done.json()["cancelled"] == 8, done.text
    finally:
        for node in nodes:
            cluster.stop_node(node)


def test_a_forwards_tag_is_checked_before_its_body_is_read_and_holds_the_body(
    tmp_path: Path,
) -> None:
    """A caller with no key sends a forward's header and a body without end: a tag of
    another form, stale, or not made with the Raft password is refused before a byte
    of the body is read, as is a node's tag claiming more than a route takes; a node's
    tag has its body read no further than the length it names, and a body other than
    the one it signs is refused. The key check is driven as the HTTP server drives it
    (ASGI), as a body without end cannot be sent here."""
    pulled = 0
    reached: list[bytes] = []

    async def endless() -> dict:
        nonlocal pulled
        pulled += 1
        assert pulled < 10_000, "the body was read on and on"
        return {"type": "http.request", "body": b"x" * 100, "more_body": True}

    async def app(scope: dict, receive: Any, send: Any) -> None:
        reached.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    keys_file = tmp_path / "keys.json"
    consume = key_id(add_key(keys_file, "c", ["consume"], ["jobs"]))
    guard = Guard(app, KeyRing(keys_file), "the raft password", max_body=1_000)
    path = "/v1/topics/jobs/leases"

    def status(tag: str, receive: Any = endless) -> int:
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "method": "POST",
            "path": path,
            "query_string": b"",
            "headers": [(FORWARDED.encode(), tag.encode())],
        }
        asyncio.run(guard(scope, receive, send))
        return sent[0]["status"]

    def tag(body: bytes, password: str = "the raft password", at_ms: int | None = None) -> str:
        return forward_tag(password, "n2", "POST", path, body, consume, at_ms)

    now = int(time.time() * 1000)
    stale = now - FORWARD_TTL_MS - 1000
    forged = {
        "1": 401,
        f"evil {now} n 00": 503,  # the form of another version
        tag(b"x" * 10**9, password="a guess"): 401,
        tag(b"", at_ms=stale): 401,
        tag(b"x" * 2_000): 413,  # a node's, over the largest body a route takes
    }
    for forged_tag, refused in forged.items():
        assert (status(forged_tag), pulled) == (refused, 0), forged_tag
    assert status(tag(b"x" * 300)) == 401, "a body longer than its tag says"
    assert pulled == 4, "300 bytes of 100-byte chunks, and the one past them"
    assert reached == []

    async def once() -> dict:
        return {"type": "http.request", "body": b'{"consumer_id": "c"}', "more_body": False}

    assert status(tag(b'{"consumer_id": "d"}'), once) == 401, "another body than it signs"
    assert status(tag(b'{"consumer_id": "c"}'), once) == 200
    assert reached == [b'{"consumer_id": "c"}']


def test_a_follower_forwards_the_path_it_was_sent_still_encoded(secure) -> None:
    """A forward names the route and message the follower authorized: a double-encoded
    `/` reaches no other route (a `read` grant on `orders.*` opens no schedules, which
    need `operate`), and a `%` in an id is no escape where the leader reads it."""
    http, nodes, keys = secure["http"], secure["nodes"], secure["keys"]
    verify = ssl.create_default_context(cafile=str(secure["ca"]))
    with httpx.Client(verify=verify, headers=bearer(keys["monitor"])) as monitor:
        leader = wait_until(lambda: leader_of(nodes, monitor), what="a leader")
    follower = next(n for n in nodes if n is not leader)
    reader = add_key(secure["keys_file"], "orders-reader", ["read"], ["orders.*"])
    schedules = f"{follower.url}/v1/topics/orders.x/schedules"
    refused = wait_until(
        lambda: (r := http.get(schedules, headers=bearer(reader))).status_code == 403 and r,
        10,
        "the new key on the follower",
    )
    assert "role 'operate'" in refused.json()["detail"]
    smuggled = http.get(f"{follower.url}/v1/topics/orders.x%252Fschedules", headers=bearer(reader))
    assert smuggled.status_code == 422, smuggled.text  # no topic has that name
    assert "schedules" not in smuggled.text

    fill(str(secure["tmp"] / "warehouse"), "jobs", buffer_rows([60_000], prefix="x%41"))
    fill(str(secure["tmp"] / "warehouse"), "jobs", buffer_rows([60_000], prefix="xA"))
    urls = {"follower": [follower.url], "leader": [leader.url]}
    with (
        Client(urls["follower"], token=keys["all"], verify=str(secure["ca"])) as via,
        Client(urls["leader"], token=keys["all"], verify=str(secure["ca"])) as direct,
    ):

        def status(message_id: str) -> str | None:
            try:
                return direct.peek("jobs", message_id).status
            except NotFound:
                return None

        wait_until(lambda: status("x%410") and status("xA0"), 10, "both messages buffered")
        via.cancel("jobs", "x%410")
        assert (status("x%410"), via.peek("jobs", "x%410").status) == ("cancelled", "cancelled")
        assert status("xA0") != "cancelled"
        for dots in (".", ".."):  # ids, sent as %2E: no folder of the path
            with pytest.raises(NotFound):
                via.peek("jobs", dots)

    # `..` segments, sent as they are: authorized as a message of orders.x, they must not
    # become the cluster's view (a `monitor` route) on the way to the leader.
    host, port = follower.url.removeprefix("https://").split(":")
    raw = http_client.HTTPSConnection(host, int(port), context=verify, timeout=10)
    try:
        path = "/v1/topics/orders.x/messages/../../../cluster"
        raw.request("GET", path, headers=bearer(reader))
        answer = raw.getresponse()
        body = answer.read().decode()
        assert answer.status == 400 and "percent-encode" in body, (answer.status, body)
    finally:
        raw.close()


def test_a_client_that_does_not_trust_the_ca_is_refused(secure, tmp_path: Path) -> None:
    other = new_authority(tmp_path / "other")
    urls = [n.url for n in secure["nodes"]]
    untrusting = Client(urls, token=secure["keys"]["read"], verify=str(other.cert), deadline=2)
    with untrusting as c, pytest.raises(Unavailable, match="CERTIFICATE_VERIFY_FAILED"):
        c.topic_stats("jobs")
    with Client(urls, token=secure["keys"]["read"], verify=str(secure["ca"])) as c:
        assert c.topic_stats("jobs").name == "jobs"


def test_the_worker_client_with_a_key_and_typed_refusals(secure) -> None:
    urls, keys = [n.url for n in secure["nodes"]], secure["keys"]
    ca = str(secure["ca"])
    anonymous = Client(urls, verify=ca, deadline=5)
    with anonymous, pytest.raises(Unauthorized, match="role 'read' on topic 'jobs'"):
        anonymous.topic_stats("jobs")
    reader = Client(urls, token=keys["read"], verify=ca)
    with reader, pytest.raises(Forbidden, match="role 'consume'"):
        reader.lease("jobs", "w", 1)
    handled: list[str] = []
    with Client(urls, token=keys["consume"], verify=ca) as client:
        worker = Worker(
            client,
            "jobs",
            lambda m: handled.append(m.id),
            batch=5,
            wait_ms=200,
            on_ack=lambda m: len(handled) >= 3 and worker.stop(),
        )
        worker.run()
    assert len(handled) >= 3 and worker.counts.acked >= 3


def test_a_revoked_key_stops_working_on_every_node_within_seconds(secure) -> None:
    http, nodes, keys_file = secure["http"], secure["nodes"], secure["keys_file"]
    key = add_key(keys_file, "short-lived", ["read"], ["jobs"])

    def status(node: cluster.Node) -> int:
        return http.get(f"{node.url}/v1/topics/jobs", headers=bearer(key)).status_code

    wait_until(lambda: all(status(n) == 200 for n in nodes), 10, "the new key on every node")
    revoke_key(keys_file, "short-lived")
    wait_until(lambda: all(status(n) == 401 for n in nodes), 10, "the key refused everywhere")


def test_no_key_or_secret_reaches_a_log(secure) -> None:
    """Runs after the others in this module: every key they sent, refused or not."""
    logs = "".join(p.read_text() for p in secure["logs"].iterdir())
    assert "broker n1" in logs  # the logs are the nodes' own
    stored = secure["keys_file"].read_text()
    for key in secure["keys"].values():
        secret = secret_of(key)
        assert len(secret) == 43 and secret not in logs
        assert secret not in stored  # only hashes are kept
    assert oct(secure["keys_file"].stat().st_mode & 0o777) == "0o600"


@given(
    topic=st.from_regex(TOPIC_NAME, fullmatch=True),
    other=st.from_regex(r"[\x21-\x2e\x30-\x7e]{1,40}", fullmatch=True),
    slashed=st.from_regex(r"[\x21-\x7e]{1,40}", fullmatch=True),
)
def test_each_route_needs_its_role_on_its_own_topic(topic: str, other: str, slashed: str) -> None:
    """Whatever the topic's name and the ids in the path (message and consumer ids may
    hold "/"), a route is matched to its own role and topic, never to another route's."""
    for method, path, role in ROUTES:
        params = {"message_id": slashed, "consumer_id": slashed, "schedule_id": other}
        concrete = path.format(topic=topic, **params)
        assert required(method, concrete) == (role, topic if "{topic}" in path else None)


def test_a_grant_holds_on_its_globs_only() -> None:
    (key,) = [k for k in [_key(("consume", ("orders.*", "jobs")), ("read", ("*",)))]]
    assert key.allows("consume", "orders.eu") and key.allows("consume", "jobs")
    assert not key.allows("consume", "orders") and not key.allows("consume", "jobs2")
    assert key.allows("read", "anything") and not key.allows("operate", "jobs")
    assert key.allows("consume", None) and not key.allows("monitor", None)


def _key(*grants: tuple[str, tuple[str, ...]]) -> Key:
    return Key("id", "name", "0" * 64, tuple(Grant(r, t) for r, t in grants), 0)


# --- keys, the file and the CLI --------------------------------------------------------------


def dejaq(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dejaq.jobs.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_keys_cli_adds_lists_and_revokes(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    added = dejaq(
        "keys", "add", "w1", "--role", "consume", "--topic", "orders*", "--keys-file", str(path)
    )
    assert added.returncode == 0, added.stderr
    key = added.stdout.strip()
    assert re.fullmatch(r"dq_[0-9a-f]{12}_[A-Za-z0-9_-]{43}", key)
    assert "shown once" in added.stderr
    assert "every node must read this same file" in added.stderr  # it writes this host's only
    (stored,) = read_keys(path).values()
    assert stored.allows("consume", "orders.eu") and not stored.allows("consume", "jobs")
    assert not stored.allows("operate", "orders")
    listed = dejaq("keys", "list", "--keys-file", str(path))
    assert (
        listed.returncode == 0 and "w1" in listed.stdout and "consume on orders*" in listed.stdout
    )
    assert secret_of(key) not in listed.stdout + path.read_text()
    again = dejaq("keys", "add", "w1", "--role", "read", "--keys-file", str(path))
    assert again.returncode == 2 and "exists" in again.stderr
    bad = dejaq("keys", "add", "w2", "--keys-file", str(path))
    assert bad.returncode == 2 and "roles" in bad.stderr
    revoked = dejaq("keys", "revoke", "w1", "--keys-file", str(path))
    assert revoked.returncode == 0
    assert "every node must read this same file" in revoked.stderr
    assert "old copy still take it" in revoked.stderr
    assert read_keys(path) == {}
    gone = dejaq("keys", "revoke", "w1", "--keys-file", str(path))
    assert gone.returncode == 2 and "no key named" in gone.stderr


def stored_key(**fields: object) -> str:
    """A key file of one key as `dejaq keys add` writes it, `fields` changed."""
    key = {"id": "x", "name": "n", "sha256": "0" * 64, "created_at": 1}
    key["grants"] = [{"role": "read", "topics": ["*"]}]
    return json.dumps({"format": 1, "keys": [{**key, **fields}]})


@pytest.mark.parametrize(
    "text",
    [
        json.dumps({"keys": [{"id": "x"}]}),
        json.dumps({"keys": {}}),
        "[]",
        stored_key(created_at="2026-12-01"),
        stored_key(created_at=True),
        stored_key().replace('"created_at": 1', '"created_at": 1e400'),
        stored_key(name=["n"]),
        stored_key(sha256="é" * 64),
        stored_key(grants=[{"role": "read", "topics": "*"}]),
        stored_key(grants=[{"role": "read", "topics": [1]}]),
        stored_key(grants=["read"]),
        "[" * 100_000 + "]" * 100_000,
    ],
)
def test_a_malformed_key_file_is_refused_with_its_path(tmp_path: Path, text: str) -> None:
    """Whatever is wrong in it, the error a node takes as "hold no keys"."""
    path = tmp_path / "keys.json"
    path.write_text(stored_key())
    assert list(read_keys(path)) == ["x"]
    path.write_text(text)
    with pytest.raises(KeyFileError, match=str(path)):
        read_keys(path)


def test_a_node_beyond_loopback_without_keys_refuses_to_start(tmp_path: Path) -> None:
    conf = tmp_path / "dejaq.yaml"
    conf.write_text(f"warehouse: {tmp_path / 'w'}\ntopics: []\n")
    port = free_port()
    args = ["broker", "--node-id", "x", "--http", f"0.0.0.0:{port}"]
    args += ["--advertise", f"127.0.0.1:{port}", "--raft", f"127.0.0.1:{free_port()}"]
    args += ["--conf-file", str(conf), "--data-dir", str(tmp_path / "d")]
    refused = dejaq(*args)
    assert refused.returncode == 2
    assert "broker.keys_file" in refused.stderr and "broker.insecure" in refused.stderr


def plain_node_with_keys(tmp_path: Path, insecure: bool) -> tuple[list[str], str]:
    """`dejaq broker`'s arguments for a node with API keys and no TLS on 0.0.0.0, and the
    port it listens on."""
    keys = tmp_path / "keys.json"
    add_key(keys, "ops", ["monitor"], ["*"])
    conf = tmp_path / "dejaq.yaml"
    flags = f"keys_file: '{keys}', insecure: {str(insecure).lower()}"
    conf.write_text(f"warehouse: {tmp_path / 'w'}\nbroker: {{{flags}}}\ntopics: []\n")
    port = free_port()
    args = ["broker", "--node-id", "plain", "--http", f"0.0.0.0:{port}"]
    args += ["--advertise", f"127.0.0.1:{port}", "--raft", f"127.0.0.1:{free_port()}"]
    return [*args, "--conf-file", str(conf), "--data-dir", str(tmp_path / "d")], str(port)


def test_a_node_beyond_loopback_with_keys_but_no_tls_refuses_to_start(tmp_path: Path) -> None:
    """Its bearer keys would cross the network in clear."""
    args, _ = plain_node_with_keys(tmp_path, insecure=False)
    refused = dejaq(*args)
    assert refused.returncode == 2
    assert "in clear" in refused.stderr and "broker.tls.cert" in refused.stderr
    assert "broker.insecure" in refused.stderr
    assert not (tmp_path / "d").exists()


def started_node(args: list[str], port: int) -> subprocess.Popen:
    """A broker node run as `dejaq <args>`, once it serves on `port` (its /readyz,
    plain HTTP, no longer says it is starting: its /healthz answers while its indexes
    load, and every other call 503 until then); its stderr kept for the test to read."""
    node = subprocess.Popen(
        [sys.executable, "-m", "dejaq.jobs.cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )

    def healthy() -> bool:
        assert node.poll() is None, node.stderr.read() if node.stderr else ""
        try:
            ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1)
        except httpx.HTTPError:
            return False
        return ready.status_code == 200 or ready.json().get("title") != NODE_STARTING

    try:
        wait_until(healthy, 60, f"the node on port {port}")
    except BaseException:
        children.stop(node)
        raise
    return node


def keyed_node(tmp_path: Path, flags: str) -> tuple[list[str], int]:
    """`dejaq broker`'s arguments for one node on loopback with the keys of
    `tmp_path / "keys.json"` and `flags` in its `broker` section; the port it listens on."""
    conf = tmp_path / "dejaq.yaml"
    flags = f"keys_file: '{tmp_path / 'keys.json'}', {flags}"
    conf.write_text(f"warehouse: {tmp_path / 'w'}\nbroker: {{{flags}}}\ntopics: []\n")
    port = free_port()
    args = ["broker", "--node-id", "k", "--http", f"127.0.0.1:{port}"]
    args += ["--raft", f"127.0.0.1:{free_port()}", "--conf-file", str(conf)]
    return [*args, "--data-dir", str(tmp_path / "d")], port


def saved_half_way(revoked: dict) -> tuple[str, str]:
    """The file cut short, as an editor saving part of it leaves it; what the node says."""
    text = json.dumps(revoked)
    return text[: len(text) // 2], "key file"


def a_field_of_another_type(revoked: dict) -> tuple[str, str]:
    """Valid JSON, a key's time written as a date."""
    revoked["keys"][0]["created_at"] = "2026-12-01"
    return json.dumps(revoked), "'created_at' is str, not int"


@pytest.mark.parametrize(
    ("broken", "metrics_open"), [(saved_half_way, True), (a_field_of_another_type, False)]
)
def test_a_node_that_cannot_read_its_changed_key_file_refuses_every_key_and_says_so(
    tmp_path: Path, broken: Callable[[dict], tuple[str, str]], metrics_open: bool
) -> None:
    """A hand edit gone wrong must not leave a key the edit revokes working: the node
    holds no keys until it can read the file, answers 503 (a client tries another node),
    is not ready, and logs it once. With `/metrics` open a metric shows it; where a scrape
    needs a key, the scrape fails with 503 meanwhile (a key it cannot check shows nothing)."""
    keys = tmp_path / "keys.json"
    key = add_key(keys, "ops", ["monitor", "read"], ["*"])
    gone = add_key(keys, "gone", ["read"], ["*"])
    revoked = json.loads(keys.read_text())
    revoked["keys"] = [k for k in revoked["keys"] if k["name"] != "gone"]
    fixed = json.dumps(revoked)
    edited, why = broken(revoked)
    args, port = keyed_node(tmp_path, f"metrics_open: {str(metrics_open).lower()}")
    url = f"http://127.0.0.1:{port}"
    node = started_node(args, port)

    def keyed(token: str) -> int:
        return httpx.get(f"{url}/v1/topics", headers=bearer(token), timeout=5).status_code

    def ready() -> httpx.Response:
        return httpx.get(f"{url}/readyz", timeout=5)

    def scrape() -> httpx.Response:
        return httpx.get(f"{url}/metrics", headers={} if metrics_open else bearer(key), timeout=5)

    def unreadable() -> str:
        text = scrape().text
        (line,) = [x for x in text.splitlines() if x.startswith("dejaq_keys_file_unreadable ")]
        return line.split()[1]

    try:
        wait_until(lambda: ready().status_code == 200, 60, "the node ready")
        assert (keyed(key), keyed(gone)) == (200, 200)
        keys.write_text(edited)  # revokes `gone`, and cannot be read
        wait_until(lambda: keyed(gone) == 503, 10, "every keyed call refused")
        assert keyed(key) == 503
        assert httpx.get(f"{url}/v1/topics", timeout=5).status_code == 401  # no key at all
        not_ready = ready()
        assert not_ready.status_code == 503
        assert str(keys) in not_ready.json()["detail"] and why in not_ready.json()["detail"]
        if metrics_open:
            wait_until(lambda: unreadable() == "1.0", 10, "the metric saying so")
        else:
            refused = scrape()
            assert refused.status_code == 503
            assert refused.json()["title"] == "API keys unavailable"
        keys.write_text(fixed)
        wait_until(lambda: keyed(key) == 200, 10, "the key taken again")
        assert keyed(gone) == 401
        assert ready().status_code == 200
        wait_until(lambda: unreadable() == "0.0", 10, "the metric cleared")
    finally:
        children.stop(node)
    assert node.stderr is not None
    err = node.stderr.read()
    assert err.count("every call with a key is refused") == 1, err
    assert "read again: its keys are in force" in err


def test_a_forward_tag_whose_time_is_not_ascii_digits_is_refused_as_any_bad_tag(
    tmp_path: Path,
) -> None:
    """`1²` is a digit to `str.isdigit` and none to `int`; a 5,000-digit number is past
    what `int` reads. Neither, as a tag's time or length, may fail the node's key check
    (a 500, logged), keyless."""
    add_key(tmp_path / "keys.json", "ops", ["monitor"], ["*"])
    args, port = keyed_node(tmp_path, "raft_password: the-raft-password")
    node = started_node(args, port)
    url = f"http://127.0.0.1:{port}/v1/topics/jobs/leases"
    try:
        for bad in ("1\N{SUPERSCRIPT TWO}".encode("latin-1"), b"9" * 5000):
            for tag in (b"x %s n - 2 d m" % bad, b"x 1 n - %s d m" % bad):
                answer = httpx.post(url, content=b"{}", headers={FORWARDED: tag})
                assert answer.status_code == 401, answer.text
                assert answer.json()["title"] == "not a cluster node"
    finally:
        children.stop(node)
    assert node.stderr is not None
    err = node.stderr.read()
    assert "Traceback" not in err, err


def test_a_key_change_keeps_the_files_mode_owner_and_group(tmp_path: Path) -> None:
    """The nodes may read the file as another user or through its group. The owner and
    group are another's only where the test runs as root (as CI does); elsewhere the
    mode alone is put to the test."""
    path = tmp_path / "keys.json"
    add_key(path, "a", ["read"], ["*"])
    assert path.stat().st_mode & 0o777 == 0o600  # a first file: owner-only
    path.chmod(0o640)
    if os.geteuid() == 0:
        os.chown(path, 1, 1)  # as if the nodes' user and group
    before = path.stat()
    add_key(path, "b", ["read"], ["*"])
    revoke_key(path, "a")
    after = path.stat()
    assert (after.st_mode, after.st_uid, after.st_gid) == (
        before.st_mode,
        before.st_uid,
        before.st_gid,
    )
    assert [k.name for k in read_keys(path).values()] == ["b"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to act as another user")
def test_a_key_change_that_cannot_keep_the_files_owner_is_refused() -> None:
    """Written as another user, the nodes reading the file as its owner could not."""
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o777)
        path = Path(tmp) / "keys.json"
        add_key(path, "a", ["read"], ["*"])
        path.chmod(0o666)
        (Path(tmp) / "keys.json.lock").chmod(0o666)
        before = path.read_text()
        pid = os.fork()
        if pid == 0:  # the child, as nobody: 3 if refused as it should be
            code = 1
            try:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
                add_key(path, "b", ["read"], ["*"])
            except KeyFileError as e:
                code = 3 if "uid 0, gid 0" in str(e) and "owner" in str(e) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 3
        assert path.read_text() == before and path.stat().st_uid == 0
        assert [p.name for p in Path(tmp).iterdir() if p.name.startswith(".")] == []


def test_a_plain_node_with_keys_told_it_is_meant_so_starts_with_a_warning(
    tmp_path: Path,
) -> None:
    """`insecure`: something in front of it (a TLS-terminating proxy) encrypts."""
    args, port = plain_node_with_keys(tmp_path, insecure=True)
    node = started_node(args, port)
    try:
        keyless = httpx.get(f"http://127.0.0.1:{port}/v1/cluster", timeout=5)
        assert keyless.status_code == 401  # its keys are still asked for
    finally:
        children.stop(node)  # SIGTERM by its PID, SIGKILL if it does not go
    assert node.stderr is not None
    assert "warning" in (err := node.stderr.read()) and "in clear" in err, err


def test_a_node_on_every_interface_refuses_to_start_without_an_address_to_give(
    tmp_path: Path,
) -> None:
    """0.0.0.0 names no host: registered, it would send each forward back to the
    forwarding node. Nor does a wildcard Raft address, by which peers know a node."""
    conf = tmp_path / "dejaq.yaml"
    conf.write_text(f"warehouse: {tmp_path / 'w'}\nbroker: {{insecure: true}}\ntopics: []\n")
    base = ["broker", "--node-id", "x", "--conf-file", str(conf)]
    base += ["--data-dir", str(tmp_path / "d")]
    http, raft = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    for addresses, flag in (
        (["--http", "0.0.0.0:8001", "--raft", raft], "--advertise HOST:PORT"),
        (["--http", "[::]:8001", "--raft", raft], "--advertise HOST:PORT"),
        (["--http", "0.0.0.0:8001", "--advertise", "0.0.0.0:8001", "--raft", raft], "--advertise"),
        (["--http", http, "--raft", "0.0.0.0:8101"], "--raft 0.0.0.0:8101"),
    ):
        refused = dejaq(*base, *addresses)
        assert refused.returncode == 2, addresses
        assert flag in refused.stderr and "host" in refused.stderr, refused.stderr
    assert not (tmp_path / "d").exists()  # refused before it made anything


def test_an_insecure_node_beyond_loopback_starts_when_told_so(tmp_path: Path) -> None:
    """On every interface, it registers the address it is told to give, not 0.0.0.0."""
    port = free_port()
    conf = tmp_path / "dejaq.yaml"
    conf.write_text(
        f"warehouse: {tmp_path / 'w'}\n"
        f"broker: {{insecure: true, advertise: 'localhost:{port}'}}\ntopics: []\n"
    )
    args = ["--http", f"0.0.0.0:{port}", "--raft", f"127.0.0.1:{free_port()}"]
    args += ["--conf-file", str(conf), "--data-dir", str(tmp_path / "d")]
    node = started_node(["broker", "--node-id", "open", *args], port)
    try:
        topics = httpx.get(f"http://127.0.0.1:{port}/v1/topics", timeout=5)
        assert topics.status_code == 200  # open: no key asked for

        def registered() -> object:
            return httpx.get(f"http://127.0.0.1:{port}/v1/cluster", timeout=5).json()["nodes"]

        nodes = wait_until(registered, 60, "the node's registered address")
        assert list(nodes.values()) == [f"localhost:{port}"]
    finally:
        children.stop(node)  # SIGTERM by its PID, SIGKILL if it does not go
