"""Queue operations on a real 3-node broker: redrive, pause and resume, purge, the lease rate
limit and retry backoff, through HTTP (and the `dejaq redrive` command)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import drop_first_answer, wait_until
from test_broker import buffer_rows, fill
from test_broker_cluster import PROBLEM, follower, leader_of, start, stop

from dejaq.client import Client
from dejaq.conf.tables import Table, ensure_table, scan
from dejaq.jobs import operations
from dejaq.jobs.cli import main
from dejaq.jobs.operations import connect
from dejaq.jobs.ports import free_port

RATE = 20
TWO = lambda i: i % 2  # noqa: E731 (buckets of the 2-bucket topics)
DEJAQ = [sys.executable, "-m", "dejaq.jobs.cli"]
REDRIVE = [*DEJAQ, "redrive"]
EARLIER = "redriven by an earlier attempt of this command, whose answer was lost"


@pytest.fixture(scope="module")
def ops(tmp_path_factory, kafka_bootstrap: str, kafka_source: str) -> Iterator[tuple]:
    tmp_path = tmp_path_factory.mktemp("ops")
    conf = tmp_path / "dejaq.yaml"
    src = kafka_source
    conf.write_text(
        f"warehouse: {tmp_path / 'warehouse'}\n"
        f"kafka: {{bootstrap: '{kafka_bootstrap}'}}\n"
        "broker: {heartbeat_timeout_ms: 5000, lease_ms: 60000}\n"
        "topics:\n"
        f"  - {{name: dl, kind: priority, source: [{src}], buckets: 2}}\n"
        f"  - {{name: ps, kind: priority, source: [{src}], buckets: 2}}\n"
        f"  - {{name: pg, kind: priority, source: [{src}], buckets: 2}}\n"
        f"  - {{name: cl, kind: priority, source: [{src}], buckets: 2}}\n"
        f"  - {{name: rd, kind: priority, source: [{src}], buckets: 2}}\n"
        f"  - {{name: rl, kind: priority, source: [{src}], buckets: 4, max_lease_rate: {RATE}}}\n"
        f"  - {{name: bo, kind: priority, source: [{src}], buckets: 1,"
        " retry_backoff_ms: 60000}\n"
    )
    nodes = start(tmp_path, conf)
    with httpx.Client(timeout=40) as client:
        try:
            yield nodes, client, str(tmp_path / "warehouse")
        finally:
            stop(nodes)


def lease(client: httpx.Client, url: str, consumer: str, n: int = 10, wait_ms: int = 3000):
    body = {"consumer_id": consumer, "max_messages": n, "wait_ms": wait_ms}
    got = client.post(f"{url}/leases", json=body)
    assert got.status_code == 200, got.text
    return got.json()["messages"]


def events(warehouse: str, table: Table, topic: str) -> list[dict]:
    return scan(ensure_table(warehouse, table, topic), table).to_pylist()


def test_a_redriven_dead_letter_is_leasable_again_with_deliveries_reset(ops) -> None:
    nodes, client, warehouse = ops
    fill(warehouse, "dl", buffer_rows([5, 6, 7], TWO, "d"))
    url = f"{follower(nodes, client).url}/v1/topics/dl"
    ids = [m["id"] for m in lease(client, url, "w")]
    assert sorted(ids) == ["d0", "d1", "d2"]
    assert client.post(f"{url}/rejections", json={"consumer_id": "w", "ids": ids}).is_success
    # Checkpointed into dead_letter/dl: the nodes have forgotten the rows since.
    wait_until(lambda: len(events(warehouse, Table.DEAD_LETTER, "dl")) == 3, what="dead letters")
    first = client.get(f"{url}/dead-letters", params={"limit": 2}).json()
    rest = client.get(f"{url}/dead-letters", params={"after": first["next"]}).json()
    listed = [r["message_id"] for r in first["rows"] + rest["rows"]]
    assert sorted(listed) == ["d0", "d1", "d2"] and rest["next"] is None
    assert client.get(f"{url}/quarantine").json() == {"rows": [], "next": None}
    bad = client.get(f"{url}/dead-letters", params={"after": "x"})
    assert bad.status_code == 422 and bad.headers["content-type"] == PROBLEM
    redrive = f"{url}/dead-letters/redrive"
    got = client.post(redrive, json={"ids": ["d0", "nope"], "priority": 1})
    assert got.json() == {"redriven": 1, "skipped": {"nope": "not_dead"}}, got.text
    [msg] = lease(client, url, "w")
    assert (msg["id"], msg["deliveries"], msg["priority"]) == ("d0", 1, 1)
    again = client.post(redrive, json={"ids": ["d0"]})
    assert again.json() == {"redriven": 0, "skipped": {"d0": "already_redriven"}}

    other = follower(nodes, client, 1).url
    cli = subprocess.run(
        [*REDRIVE, "--topic", "dl", "--all", "--broker", other],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (cli.returncode, cli.stdout) == (0, "redriven 2\n"), cli.stderr
    named = [*REDRIVE, "--topic", "dl", "--id", "d1", "--id", "nope", "--broker", other]
    cli = subprocess.run(named, capture_output=True, text=True, timeout=60)
    assert (cli.returncode, cli.stdout) == (1, "redriven 0\n"), "nothing named was redriven"
    assert cli.stderr.splitlines() == [
        'error: "d1" not redriven: already_redriven',
        'error: "nope" not redriven: not_dead',
    ]
    rest = lease(client, url, "w")
    assert sorted((m["id"], m["deliveries"], m["priority"]) for m in rest) == [
        ("d1", 1, 6),
        ("d2", 1, 7),
    ]
    acked = client.post(f"{url}/acks", json={"consumer_id": "w", "ids": ["d0", "d1", "d2"]})
    assert acked.json() == {"settled": 3}
    assert client.post(redrive, json={"all": True}).json() == {"redriven": 0, "skipped": {}}

    def ledger() -> list[tuple]:
        rows = events(warehouse, Table.LEDGER, "dl")
        return sorted((r["message_id"], r["event"], r["sort_key"]) for r in rows)

    wait_until(lambda: len(ledger()) == 9, what="the ledger to hold every event")
    assert [e for e in ledger() if e[1] == "redriven"] == [
        ("d0", "redriven", 1),
        ("d1", "redriven", 6),
        ("d2", "redriven", 7),
    ]
    assert client.get(f"{url}/messages/d0").json()["status"] == "acked"


def test_a_redrive_whose_answer_was_lost_is_redriven_not_an_error(
    ops, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The command's first redrive reaches the broker, but the connection drops before
    its answer (injected in the client's transport, after the real request: the rest is
    real). Its retry finds the message already redriven: that attempt's doing."""
    nodes, client, warehouse = ops
    fill(warehouse, "rd", buffer_rows([3], TWO, "lost"))
    url = f"{leader_of(nodes, client).url}/v1/topics/rd"
    [msg] = lease(client, url, "w")
    rejected = client.post(f"{url}/rejections", json={"consumer_id": "w", "ids": [msg["id"]]})
    assert rejected.is_success, rejected.text
    dropped: list[list[str]] = []

    def dropping(*args: Any, **kwargs: Any) -> Client:
        c = connect(*args, **kwargs)
        dropped.append(drop_first_answer(c, "/redrive"))
        return c

    monkeypatch.setattr(operations, "connect", dropping)
    command = ["redrive", "--topic", "rd", "--id", msg["id"], "--broker", nodes[0].url]
    assert main(command) == 0
    out, err = capsys.readouterr()
    assert any(dropped) and out == "redriven 0\n"
    assert err == f'"{msg["id"]}" {EARLIER}\n'
    assert client.get(f"{url}/messages/{msg['id']}").json()["status"] == "pending"


def test_a_command_given_a_wrong_broker_address_fails_at_once() -> None:
    """The command's probe of the node fails it: the client's retries, meant to ride
    out a node's restart, would end in "no node served it in time" after its deadline."""
    nowhere = f"http://127.0.0.1:{free_port()}"
    cli = subprocess.run(
        [*DEJAQ, "pause", "--topic", "dl", "--broker", nowhere],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == 1
    assert cli.stderr == f"error: no broker node answers at {nowhere} (ConnectError)\n"


def test_redrive_takes_one_target_and_the_topics_own_sort_key(ops) -> None:
    nodes, client, _ = ops
    url = f"{leader_of(nodes, client).url}/v1/topics/dl/dead-letters/redrive"
    for body, field in (
        ({}, "ids"),
        ({"ids": ["a"], "all": True}, "ids"),
        ({"all": True, "deliver_at": 5}, "priority"),
        ({"ids": []}, "ids"),
    ):
        got = client.post(url, json=body)
        assert got.status_code == 422 and got.headers["content-type"] == PROBLEM, got.text
        assert field in got.text, (body, got.text)
    unknown = client.post(url.replace("/dl/", "/nope/"), json={"all": True})
    assert unknown.status_code == 404


def test_pause_on_one_node_stops_leasing_on_every_node_while_acks_work(ops) -> None:
    nodes, client, warehouse = ops
    fill(warehouse, "ps", buffer_rows([1, 2, 3], TWO, "p"))
    a, b = follower(nodes, client, 0), follower(nodes, client, 1)
    held = lease(client, f"{a.url}/v1/topics/ps", "w", n=1)
    assert [m["id"] for m in held] == ["p0"]
    assert client.post(f"{b.url}/v1/topics/ps/pause").json() == {"paused": True}
    for node in nodes:
        url = f"{node.url}/v1/topics/ps"
        started = time.monotonic()
        assert lease(client, url, "w", wait_ms=300) == []
        assert time.monotonic() - started >= 0.25, "a long-poll waits out its time"
        assert client.get(url).json()["paused"] is True
    acked = client.post(f"{a.url}/v1/topics/ps/acks", json={"consumer_id": "w", "ids": ["p0"]})
    assert acked.json() == {"settled": 1}
    assert client.post(f"{a.url}/v1/topics/ps/resume").json() == {"paused": False}
    rest = lease(client, f"{b.url}/v1/topics/ps", "w")
    assert sorted(m["id"] for m in rest) == ["p1", "p2"]
    assert client.get(f"{b.url}/v1/topics/ps").json()["paused"] is False


def test_purge_needs_the_topic_name_and_leaves_leased_messages(ops) -> None:
    nodes, client, warehouse = ops
    fill(warehouse, "pg", buffer_rows([1, 2, 3, 4, 5], TWO, "g"))
    url = f"{follower(nodes, client).url}/v1/topics/pg"
    [held] = lease(client, url, "w", n=1)
    for body in ({}, {"confirm": "jobs"}):
        refused = client.post(f"{url}/purge", json=body)
        assert refused.status_code == 422 and refused.headers["content-type"] == PROBLEM
        assert "confirm" in refused.text, refused.text
    assert lease(client, url, "w", n=1, wait_ms=0), "nothing was purged"
    purged = client.post(f"{url}/purge", json={"confirm": "pg"})
    assert purged.json() == {"cancelled": 3}, purged.text
    assert lease(client, url, "w", wait_ms=300) == []
    assert client.get(f"{url}/messages/g4").json()["status"] == "cancelled"
    acked = client.post(f"{url}/acks", json={"consumer_id": "w", "ids": [held["id"]]})
    assert acked.json() == {"settled": 1}, "a leased message is left to its consumer"
    stats = client.get(url).json()
    assert (stats["pending"], stats["cancelled"], stats["acked"]) == (0, 3, 1)


def test_pause_resume_and_purge_from_the_command_line(ops) -> None:
    nodes, client, warehouse = ops
    fill(warehouse, "cl", buffer_rows([1, 2], TWO, "c"))
    url = follower(nodes, client).url

    def dejaq(*args: str) -> subprocess.CompletedProcess:
        cmd = [*DEJAQ, *args[:1], "--topic", "cl", "--broker", url, *args[1:]]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    paused = dejaq("pause")
    assert (paused.returncode, paused.stdout) == (0, "cl: paused\n"), paused.stderr
    assert client.get(f"{url}/v1/topics/cl").json()["paused"] is True
    resumed = dejaq("resume")
    assert (resumed.returncode, resumed.stdout) == (0, "cl: leasing\n"), resumed.stderr
    wrong = dejaq("purge", "--confirm", "pg")
    assert wrong.returncode == 1 and "confirm" in wrong.stderr, wrong.stderr
    purged = dejaq("purge", "--confirm", "cl")
    assert (purged.returncode, purged.stdout) == (0, "cancelled 2\n"), purged.stderr
    assert lease(client, f"{url}/v1/topics/cl", "w", wait_ms=300) == []


def test_the_rate_limit_holds_across_consumers_on_two_nodes(ops) -> None:
    """Two consumers on two nodes lease for 2.5 s (the workload), and on until each was
    served and the burst was granted (60 s at most, for a broker that serves neither):
    the messages granted in all never exceed the rate over the time taken, plus a burst.
    A slower machine only takes longer, which loosens that bound."""
    nodes, _, warehouse = ops
    fill(warehouse, "rl", buffer_rows(list(range(500)), prefix="r"))
    consumers = {f"c{i}": node.url for i, node in enumerate(nodes[:2])}
    granted: dict[str, list[int]] = {me: [] for me in consumers}
    acks: list[tuple[int, Any, int]] = []  # status, settled (or the problem), ids sent
    failures: list[Exception] = []
    stop_at, give_up = time.monotonic() + 2.5, time.monotonic() + 60

    def more() -> bool:
        served = all(granted.values()) and sum(map(sum, granted.values())) >= RATE
        return time.monotonic() < (give_up if not served else stop_at)

    def work(node_url: str, me: str) -> None:
        try:
            with httpx.Client(timeout=20) as c:
                while more():
                    msgs = lease(c, f"{node_url}/v1/topics/rl", me, n=10, wait_ms=200)
                    if msgs:
                        ids = [m["id"] for m in msgs]
                        body = {"consumer_id": me, "ids": ids}
                        acked = c.post(f"{node_url}/v1/topics/rl/acks", json=body)
                        answer = acked.json().get("settled") if acked.is_success else acked.text
                        acks.append((acked.status_code, answer, len(ids)))
                        granted[me].append(len(msgs))
        except Exception as e:  # the test's own thread reports it
            failures.append(e)

    workers = [threading.Thread(target=work, args=(url, me)) for me, url in consumers.items()]
    started = time.monotonic()
    for t in workers:
        t.start()
    for t in workers:
        t.join(90)
    elapsed = time.monotonic() - started
    assert not any(t.is_alive() for t in workers), "a worker still runs after its deadline"
    assert failures == [], failures
    total = sum(map(sum, granted.values()))
    assert total <= RATE * elapsed + RATE, (total, elapsed)
    assert total >= RATE, "a burst at least, then the rate"
    assert all(granted.values()), f"both consumers were served: {granted}"
    assert len(acks) == sum(map(len, granted.values()))
    assert [a for a in acks if a[:2] != (200, a[2])] == [], "each ack settles what it names"


def test_a_nack_without_delay_waits_out_the_retry_backoff(ops) -> None:
    nodes, client, warehouse = ops
    fill(warehouse, "bo", buffer_rows([1], prefix="b", bucket_of=lambda i: 0))
    url = f"{leader_of(nodes, client).url}/v1/topics/bo"
    [msg] = lease(client, url, "w")
    nack = client.post(f"{url}/nacks", json={"consumer_id": "w", "ids": [msg["id"]]})
    assert nack.json() == {"settled": 1, "dead": []}
    assert client.get(f"{url}/messages/b0").json()["status"] == "delayed"
    assert lease(client, url, "w", wait_ms=300) == []
