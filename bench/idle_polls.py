"""What waiting workers cost a broker's leader while their topic has nothing to lease.

    .venv/bin/python bench/idle_polls.py [--polls 200] [--seconds 10]

A worker with nothing to do holds a long poll open at the leader. A long poll waits for
its topic's next change (rows indexed, a lease ended), or until the first time alone
makes something leasable: its timeline's next message due, or the end of its first
nack delay. A 3-node cluster (real `dejaq broker` processes) serves three topics with
nothing to lease: an empty priority one, an empty timeline one, and one whose only
message was nacked with an hour's delay. The leader's CPU (user + system time of its
process, from /proc) is measured over the same window four times: with no poll (the
baseline: an idle node), then with P polls on each topic in turn. Prints one JSON
object: each phase's share of a core, each poll phase's cost beyond the baseline, and
the timeline and delayed phases' ratios to the priority one's (a poll that waits for
its topic's changes alone).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
# This file is in bench/: keep its folder off the path (bench/broker.py shadows the package).
sys.path[:1] = [str(ROOT), str(ROOT / "tests")]

from test_broker import buffer_rows, fill  # noqa: E402

from bench.machine import machine  # noqa: E402
from dejaq.jobs import cluster  # noqa: E402
from dejaq.jobs.cluster import Node  # noqa: E402

TOPICS = {"priority": "jobs", "timeline": "timers", "delayed": "delayed"}
WAIT_MS = 20_000
TICKS = os.sysconf("SC_CLK_TCK")


def write_conf(tmp: Path) -> Path:
    conf = tmp / "dejaq.yaml"
    conf.write_text(
        f"warehouse: {tmp / 'warehouse'}\n"
        "kafka: {bootstrap: '127.0.0.1:9'}\n"
        "topics:\n"
        "  - {name: jobs, kind: priority, source: [jobs-in], buckets: 16}\n"
        "  - {name: timers, kind: timeline, source: [timers-in], buckets: 16}\n"
        "  - {name: delayed, kind: priority, source: [delayed-in], buckets: 16}\n"
    )
    return conf


def leader(nodes: list[Node]) -> Node:
    """The node that says it leads, once one does."""
    deadline = time.monotonic() + 60
    with httpx.Client(timeout=2) as client:
        while time.monotonic() < deadline:
            for node in nodes:
                try:
                    answer = client.get(f"{node.url}/v1/cluster")
                except httpx.HTTPError:
                    continue
                if answer.status_code == 200 and answer.json()["role"] == "leader":
                    return node
            time.sleep(0.2)  # polling a cluster for its leader
    raise TimeoutError("no leader within 60 s")


def delay_one(node: Node, warehouse: str) -> None:
    """Land one message in the delayed topic, lease it and nack it with an hour's delay;
    its consumer leaves, so that the polls' consumers share every bucket."""
    fill(warehouse, TOPICS["delayed"], buffer_rows([1], prefix="d"))
    url = f"{node.url}/v1/topics/{TOPICS['delayed']}"
    with httpx.Client(timeout=30) as client:
        body = {"consumer_id": "setup", "max_messages": 1, "wait_ms": 20_000}
        leased = client.post(f"{url}/leases", json=body).raise_for_status().json()["messages"]
        if not leased:
            raise RuntimeError("the delayed topic's message was not leased within 20 s")
        nack = {"consumer_id": "setup", "ids": [leased[0]["id"]], "delay_ms": 3_600_000}
        client.post(f"{url}/nacks", json=nack).raise_for_status()
        client.delete(f"{url}/consumers/setup").raise_for_status()


def cpu_seconds(pid: int) -> float:
    """User and system time the process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


async def poll_until(client: httpx.AsyncClient, url: str, consumer: str, end: float) -> None:
    """Long polls one after the other until `end`, as an idle worker makes them."""
    body = {"consumer_id": consumer, "max_messages": 10, "wait_ms": WAIT_MS}
    while time.monotonic() < end:
        answer = await client.post(url, json=body)
        answer.raise_for_status()
        if answer.json()["messages"]:
            raise AssertionError(f"{url} leased a message: its topic should be empty")


async def phase(node: Node, topic: str | None, polls: int, warm_s: float, seconds: float) -> dict:
    """The leader's CPU over `seconds`, after `warm_s` for the polls' consumers to join."""
    limits = httpx.Limits(max_connections=polls + 1, max_keepalive_connections=polls + 1)
    timeout = httpx.Timeout(WAIT_MS / 1000 + 30)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        tasks = []
        if topic is not None:
            url = f"{node.url}/v1/topics/{topic}/leases"
            end = time.monotonic() + warm_s + seconds
            tasks = [
                asyncio.create_task(poll_until(client, url, f"idle-{topic}-{i}", end))
                for i in range(polls)
            ]
        await asyncio.sleep(warm_s)  # the consumers join: left out of the window
        began, cpu = time.monotonic(), cpu_seconds(node.proc.pid)
        await asyncio.sleep(seconds)  # the window measured
        share = (cpu_seconds(node.proc.pid) - cpu) / (time.monotonic() - began)
        if failed := [t.exception() for t in tasks if t.done() and t.exception()]:
            raise failed[0]
        # Each poll waits out its last WAIT_MS: left by closing the client.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "topic": topic,
        "polls": polls if topic else 0,
        "core_share": round(share, 4),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--polls", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warm", type=float, default=3.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dejaq-idle-") as tmp:
        conf = write_conf(Path(tmp))
        nodes = cluster.up(3, Path(tmp) / "raft", str(conf))
        try:
            lead = leader(nodes)
            delay_one(lead, str(Path(tmp) / "warehouse"))
            idle = asyncio.run(phase(lead, None, 0, args.warm, args.seconds))
            polled = {
                kind: asyncio.run(phase(lead, topic, args.polls, args.warm, args.seconds))
                for kind, topic in TOPICS.items()
            }
        finally:
            for node in nodes:
                cluster.stop_node(node)
    beyond = {k: max(0.0, p["core_share"] - idle["core_share"]) for k, p in polled.items()}
    waiting = beyond["priority"]
    report = {
        "benchmark": "idle_polls",
        "date": dt.date.today().isoformat(),
        "machine": machine(),
        "parameters": {"polls": args.polls, "seconds": args.seconds, "wait_ms": WAIT_MS},
        "phases": [idle, *polled.values()],
        "leader_core_share_beyond_idle": {k: round(v, 4) for k, v in beyond.items()},
        "vs_priority": {
            k: round(beyond[k] / waiting, 3) if waiting else None for k in ("timeline", "delayed")
        },
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
