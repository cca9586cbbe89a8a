"""Broker throughput: 3 nodes, N pre-ingested messages, C workers doing lease + ack.

    .venv/bin/python bench/broker.py [--messages N] [--buckets B] [--procs P] [--runs R]
        [--systems S,...] [--interleave SLICES]

Prints one JSON object: msgs/s and p50/p99 lease and ack latency for each phase of
PHASES (batch 1 with 8 and with 64 workers, batch 100 with 8), the parameters and the
machine. Batch 1 is bound by latency with few workers (each waits out a Raft commit per
request) and by CPU with many, when group commit shares each Raft round among them.

Each phase runs R times (3), DejaQ and every baseline in turn (one system up at a
time), and each figure is the run with the median msgs/s (`msgs_per_s_runs` lists them
all): this VM's speed drifts by a third over minutes, and one run of each would compare
moments, not systems. Runs alternate the order (`SYSTEMS`, then it reversed), which
keeps DejaQ acking by receipt and the Raft floor, the pair the goals compare, side by
side in every run, each first in turn. `paired_vs_floor` gives, for each DejaQ system
(and each floor carrying DejaQ's commands), each run's msgs/s over the floor's in the
same run and their median: where the machine's speed moves between runs, it shows as
the spread of those ratios, which the ratio of two medians hides; the further a system
runs from the floor in a run, the more of the drift its ratios carry.

The same DejaQ with its workers acking by the receipts their leases gave instead of by
id (`receipts`, `acking_by_receipt`) runs beside it, and `receipts_vs_results` is its
ratio. So does the same DejaQ driven by the shipped client (`worker`, `worker_client`): a
`dejaq.client.Worker` per worker, each a thread with its own `Client`, a handler that
does nothing, acking by receipt (a lease's quick handlers' acks together), with
`worker_vs_receipts`: what the shipped client costs over the minimal one. The same
DejaQ secured (`secured`: TLS on every node's HTTP and API keys on, each client sending
its key over TLS) runs beside it, and `secured_vs_results` is its ratio: what security
costs. So does the same DejaQ with its warehouse on an
S3-compatible server (`s3`: `dejaq s3`, S3Proxy over a local folder; the nodes' Raft and
head stores stay on disk), with `s3_vs_results`, and the requests its nodes send the
store (the server's own counts by S3 operation): idle, per node and second, over
IDLE_SECONDS before the phases (once the nodes' start-up reads are done), and per phase
under load. The baselines run in the
same run, with the same clients and phases. HTTP alone:
uvicorn as the broker runs it, answering lease and ack from a counter with no Raft,
state or index. The Raft floor: the same on 3 nodes, each lease and ack first committing
one tiny command through the broker's own Raft layer. No broker on this stack can beat
the first, nor one that replicates each request before answering the second. The
Raft floor carrying DejaQ's commands: the same again, each command holding what DejaQ's
lease and ack must replicate (a lease's picks, an ack's ids; or each id as an integer
handle; or, `picks`, an ack's receipts as the workers acking by receipt send them and
the leader commits them), applied as nothing: what any state design of DejaQ's can
reach at best with those commands (`receipts_vs_floor_carrying_picks`: how near the
`receipts` system comes to its own).
Messages are written straight into the Delta buffer (as the ingest job would), so the
numbers are the broker's alone. Workers talk to the leader (a follower would forward
each request: one more hop) over keep-alive HTTP/1.1 with a minimal client on uvloop,
so the client's own cost stays small next to the broker's; it shares the cores with
the brokers, and its CPU per message is reported (`client_cpu_us_per_msg`). So is the
leader's Raft log growth per message (`raft_entries_per_msg`, from its commit index):
group commit puts many requests in one entry, and each entry costs every node its
transport, so two systems can differ there only by how their requests fall together.
Each phase also reports the CPU per message of every process it ran on, nodes and
clients (`cpu_us_per_msg`, "all" their sum). Where they all share too few cores, the
rate follows that sum: `receipts_vs_floor_by_cpu` is the ratio it predicts against the
floor, and the per-node figures say which process a gap to the measured one is in.

`--interleave SLICES` then compares the pair once more with both clusters up, each
phase cut into SLICES slices that alternate between the two (`interleaved`): runs seconds
apart instead of minutes, with what each cluster's idling takes from the other reported
beside them (`interleaved_receipts_vs_floor`). `--runs 0` runs that comparison alone.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import multiprocessing as mp
import os
import re
import secrets
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from hashlib import blake2b
from pathlib import Path
from statistics import median, median_low

ROOT = Path(__file__).resolve().parent.parent
# This file is bench/broker.py: keep its folder off the path, or it shadows the package.
sys.path[:1] = [str(ROOT), str(ROOT / "tests")]

from bench.machine import machine  # noqa: E402

_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)


class Http(asyncio.Protocol):
    """Just enough HTTP/1.1 for JSON POSTs on one keep-alive connection.

    A protocol parsing each response from the bytes as they arrive: with asyncio's
    streams (a coroutine per header line) the clients, which share the 2 cores with the
    brokers, used about as much CPU per batch-1 message as the leader did.
    """

    def __init__(self, host: str, port: int, access: Access | None = None) -> None:
        self.host, self.port, self.access = host, port, access
        self.buffer = bytearray()
        self.status = self.length = 0
        self.waiter: asyncio.Future | None = None
        self.head = f"Host: {host}\r\nContent-Type: application/json\r\n"
        if access is not None:
            self.head += f"Authorization: Bearer {access.token}\r\n"

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        tls = None
        if self.access is not None:
            tls = ssl.create_default_context(cafile=self.access.ca)
        self.transport, _ = await loop.create_connection(
            lambda: self, self.host, self.port, ssl=tls
        )

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if not self.length:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buffer[:end])
            length = _CONTENT_LENGTH.search(head)
            self.status, self.length = int(head.split(None, 2)[1]), int(length[1]) if length else 0
            del self.buffer[: end + 4]
        if len(self.buffer) >= self.length and self.waiter is not None:
            body = bytes(self.buffer[: self.length])
            del self.buffer[: self.length]
            self.waiter.set_result((self.status, body))
            self.waiter, self.length = None, 0

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc or ConnectionError("the server closed the connection"))

    async def post(self, path: str, body: dict) -> tuple[int, dict]:
        data = json.dumps(body).encode()
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(
            f"POST {path} HTTP/1.1\r\n{self.head}Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        status, payload = await self.waiter
        return status, json.loads(payload)


async def _worker(
    addr: str,
    topic: str,
    me: str,
    batch: int,
    stop_at: float,
    out: dict,
    acked,
    access: Access | None,
    by_receipt: bool,
) -> None:
    host, port = addr.rsplit(":", 1)
    http = Http(host, int(port), access)
    await http.connect()
    lease_path, ack_path = f"/v1/topics/{topic}/leases", f"/v1/topics/{topic}/acks"
    while time.monotonic() < stop_at:
        t0 = time.perf_counter()
        status, got = await http.post(
            lease_path, {"consumer_id": me, "max_messages": batch, "wait_ms": 100}
        )
        t1 = time.perf_counter()
        messages = got.get("messages", []) if status == 200 else []
        if not messages:
            if status != 200:
                out["errors"] += 1
            if acked.value >= out["target"]:
                return
            continue
        out["lease"].append(t1 - t0)
        named = (
            {"receipts": [m["receipt"] for m in messages]}
            if by_receipt
            else {"ids": [m["id"] for m in messages]}
        )
        status, _ = await http.post(ack_path, {"consumer_id": me, **named})
        out["ack"].append(time.perf_counter() - t1)
        if status == 200:
            out["done"] += len(messages)
            with acked.get_lock():
                acked.value += len(messages)
                if acked.value >= out["target"]:
                    return
        else:
            out["errors"] += 1


def _worker_threads(
    addr: str, topic: str, names: list[str], batch: int, secs: float, out: dict, acked
) -> None:
    """The phase as users run it: a `dejaq.client.Worker` per name, each a thread with its
    own `Client`, a handler that does nothing, acks by receipt (quick handlers' acks
    together). Each lease and ack request is timed in its `Client`."""
    from dejaq.client import Client, Worker

    class Timed(Client):
        def lease(self, *args, **kwargs):
            t0 = time.perf_counter()
            got = super().lease(*args, **kwargs)
            if got:
                out["lease"].append(time.perf_counter() - t0)
            return got

        def ack(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return super().ack(*args, **kwargs)
            finally:
                out["ack"].append(time.perf_counter() - t0)

    # Messages each worker's acks settled, counted by its own thread without a lock, and
    # added to the phase's count (shared with the other client process) every PUBLISH_S:
    # a lock per message would be the harness's cost, charged to the Worker.
    settled = [[0] for _ in names]

    def counter(cell: list[int]):
        def on_ack(m) -> None:
            cell[0] += 1

        return on_ack

    workers = [
        Worker(
            Timed([f"http://{addr}"]),
            topic,
            lambda m: None,
            consumer_id=name,
            batch=batch,
            lease_ms=30_000,
            wait_ms=100,
            on_ack=counter(cell),
        )
        for name, cell in zip(names, settled, strict=True)
    ]
    threads = [threading.Thread(target=w.run, name=w.consumer_id) for w in workers]
    for t in threads:
        t.start()
    stop_at = time.monotonic() + secs
    published = 0
    while time.monotonic() < stop_at:
        done = sum(cell[0] for cell in settled)
        if done > published:
            with acked.get_lock():
                acked.value += done - published
            published = done
        if acked.value >= out["target"]:
            break
        time.sleep(PUBLISH_S)
    for w in workers:
        w.stop()
    for t in threads:
        t.join(30)
    out["done"] = sum(cell[0] for cell in settled)
    out["errors"] = sum(w.counts.lost for w in workers)


def _proc(
    addr: str,
    topic: str,
    names: list[str],
    batch: int,
    target: int,
    secs: float,
    q,
    acked,
    access: Access | None,
    by_receipt: bool,
    worker: bool,
):
    out = {"lease": [], "ack": [], "done": 0, "errors": 0, "target": target}

    async def main() -> None:
        stop_at = time.monotonic() + secs
        await asyncio.gather(
            *(
                _worker(addr, topic, n, batch, stop_at, out, acked, access, by_receipt)
                for n in names
            )
        )

    import uvloop

    started, cpu = time.perf_counter(), time.process_time()
    if worker:
        _worker_threads(addr, topic, names, batch, secs, out, acked)
    else:
        uvloop.run(main())
    out["elapsed"] = time.perf_counter() - started
    out["cpu"] = time.process_time() - cpu
    q.put(out)


def canned_app(raft=None, carry: str | None = None):
    """The baselines' ASGI app: lease and ack answered from a counter, in the broker's JSON.

    With a `RaftNode`, each lease and ack first commits one command through it, a node
    that does not lead answers 503, and GET /role says which it is. The command is a
    consumer's heartbeat (the smallest change of state), or with `carry` what DejaQ's
    commands must hold, which every node then applies as nothing (`carried`): "ids"
    carries a lease's picks (ids, buckets, sort keys, packed) and an ack's ids as DejaQ does,
    "handles" each id as an 8-byte deterministic hash, packed, as integer handles would,
    "picks" a lease's picks and an ack's receipts as DejaQ's commands do when its workers
    ack by receipt (and the lease answers a receipt per message for them to).
    """
    counter = itertools.count()
    payload = base64.b64encode(b"x" * 16).decode()

    async def app(scope, receive, send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        status, answer, ids = 200, None, []
        if scope["path"] == "/role":
            leads = raft is not None and raft.is_leader()
            answer = {"leader": leads, "commit_index": raft.commit_index() if raft else 0}
        else:
            request = json.loads(body)
            if scope["path"].endswith("/leases"):
                topic = scope["path"].split("/")[3]  # ids shaped as the DejaQ run's
                ids = [f"{topic}-{next(counter)}" for _ in range(request["max_messages"])]
            if raft is not None:
                if raft.is_leader():
                    now = int(time.time() * 1000)
                    consumer = request["consumer_id"]
                    if carry is None:
                        await raft.commit("floor", "touch", consumer, now)
                    else:
                        named = ids or request.get("ids") or request["receipts"]
                        data = carried(carry, named, lease=bool(ids))
                        await raft.commit("floor", "purge", now, CARRY_UPTO, (consumer, data))
                else:
                    status, answer = 503, {"title": "not the leader"}
        if answer is None and ids:
            deadline = int(time.time() * 1000) + 30_000
            answer = {
                "messages": [
                    {
                        "id": mid,
                        "bucket": 0,
                        "sort_key": 1,
                        "priority": 1,
                        "deliver_at": None,
                        "key": None,
                        "payload": payload,
                        "deliveries": 1,
                        "lease_deadline": deadline,
                    }
                    for mid in ids
                ]
            }
            if carry == "picks":  # its workers ack by receipt, as DejaQ's `receipts` do
                for i, message in enumerate(answer["messages"]):
                    message["receipt"] = i
        elif answer is None:
            answer = {"settled": len(request.get("ids") or request["receipts"])}
        data = json.dumps(answer).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    return app


# A purge made from a view older than any state (`TopicState.purge`): every node refuses
# it at once, unread, so the command's cost is its replication alone.
CARRY_UPTO = -1


_acked_leases = itertools.count(1)


def carried(carry: str, ids: list[str], lease: bool) -> object:
    """What a lease (picks) or an ack (ids) of DejaQ's must replicate, as `carry` says.

    Ids: a lease's come with their buckets and sort keys packed, as DejaQ's picks do
    (`leases.Picks`). Handles: a lease's come with its picks (an index would hold each
    row's), packed the same way; an ack's are made from the ids it names, as the leader
    would have to (an 8-byte deterministic hash each). Picks: DejaQ's own commands when
    its workers ack by receipt, a lease's message handles packed (16 bytes each) as its
    index packs them, and an ack's receipts the range the leader commits for a whole
    lease's (`leases.consecutive`).
    """
    if carry == "ids" and not lease:
        return ids
    if carry == "picks" and not lease:
        from dejaq.broker.state.leases import POSITION_BITS

        first = next(_acked_leases) << POSITION_BITS
        return range(first, first + len(ids))
    if not lease:
        return b"".join(blake2b(mid.encode(), digest_size=8).digest() for mid in ids)
    n = len(ids)
    buckets, keys = array("H", [i % 16 for i in range(n)]), array("q", range(n))
    if sys.byteorder == "big":
        buckets.byteswap()
        keys.byteswap()
    if carry == "picks":
        from dejaq.broker.state.handles import packed

        named = packed(ids)
    else:
        named = ids if carry == "ids" else array("q", range(n)).tobytes()
    return named, buckets.tobytes(), keys.tobytes()


def serve(app, port: int, raft=None) -> None:
    """uvicorn on the broker's settings (`broker.http_server`), Raft ticking on its loop."""
    import uvicorn
    import uvloop

    from dejaq.broker.api.http_server import SETTINGS

    async def main() -> None:
        if raft is not None:
            raft.attach(asyncio.get_running_loop())
        config = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", **SETTINGS)
        await uvicorn.Server(config).serve()

    uvloop.run(main())


class _NoIndex:
    """The floor's Raft listener: there is no index to tell."""

    def pending(self, topic, state, handles) -> None: ...
    def gone(self, topic, handles) -> None: ...
    def reset(self, states) -> None: ...


def raft_floor_server(spec: str) -> None:
    """One node of the Raft floor: the broker's HTTP and Raft, and nothing else.

    Lease and ack each commit one command through the broker's own `RaftNode`: group
    commit, PySyncObj on the event loop, AES-GCM. What replication costs before any
    index, lease or message of DejaQ's; with `carry`, what replicating DejaQ's commands
    costs before any of its state.
    """
    from dejaq.broker.state.raft import RaftNode
    from dejaq.conf.settings import BrokerConfig, TopicConfig

    me, http_port, raft_addrs, data_dir, carry = json.loads(spec)
    topic = TopicConfig(name="floor", kind="priority", source=["floor"], buckets=16)
    broker = BrokerConfig(raft_password=os.environ["DEJAQ_BROKER_RAFT_PASSWORD"])
    peers = [a for i, a in enumerate(raft_addrs) if i != me]
    raft = RaftNode(raft_addrs[me], peers, [topic], broker, Path(data_dir), _NoIndex())
    serve(canned_app(raft, carry), http_port, raft)


PHASES = ((1, 8), (1, 64), (100, 8))  # (batch, workers)
PUBLISH_S = 0.005  # how often the Worker phase's client processes share their counts
# Systems in the order a run runs them (the next run reverses it): DejaQ acking by
# receipt beside the Raft floor, the pair the goals compare, so that the machine's
# drift over the minutes a run takes falls on both alike.
DEJAQ_SYSTEMS = ("dejaq", "worker", "secured", "s3", "receipts")
SYSTEMS = (*DEJAQ_SYSTEMS, "floor", "ids", "handles", "picks", "http")
QUIET_CORES = 0.05  # a cluster has settled after a slice within this of its idle CPU
IDLE_WINDOW_S = 5  # over which each cluster's idle CPU is measured
IDLE_SECONDS = 20  # the S3 system's idle window, once its nodes are up and filled
IDLE_SETTLE_S = 10  # before it: the leader's first retention runs, the last index loads


def phase_topics(args: argparse.Namespace, run: int) -> list[tuple[str, int, int, int]]:
    """(topic, batch, workers, messages) of each phase in run `run`: a topic each, so none
    starts drained."""
    return [
        (
            f"{batch}c{workers}r{run}",
            batch,
            workers,
            args.messages if batch > 1 else args.messages_batch1,
        )
        for batch, workers in PHASES
    ]


@contextmanager
def http_ceiling() -> Iterator[tuple[str, dict[str, int]]]:
    """`ceiling_server`, what HTTP alone costs on this machine: (address, pids)."""
    from dejaq.jobs.children import wait_for_port
    from dejaq.jobs.ports import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--ceiling-server", str(port)])
    try:
        wait_for_port(port, 30, server, "the HTTP-only server")
        yield f"127.0.0.1:{port}", {"leader": server.pid}
    finally:
        server.terminate()
        server.wait(10)


@contextmanager
def raft_floor(data_dir: Path, carry: str | None = None) -> Iterator[tuple[str, dict[str, int]]]:
    """3 `raft_floor_server`s: (their leader's address, pids)."""
    from dejaq.jobs.children import wait_for_port
    from dejaq.jobs.ports import free_port

    http = [free_port() for _ in range(3)]
    raft = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    servers = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--raft-floor-server",
                json.dumps([i, http[i], raft, d, carry]),
            ]
        )
        for i, d in enumerate(str(data_dir / f"floor{i}") for i in range(3))
    ]
    try:
        for port, server in zip(http, servers, strict=True):
            wait_for_port(port, 30, server, "a Raft floor node")
        leader = _floor_leader(http)
        others = [s.pid for i, s in enumerate(servers) if i != leader]
        pids = {"leader": servers[leader].pid, "follower_1": others[0], "follower_2": others[1]}
        yield f"127.0.0.1:{http[leader]}", pids
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            server.wait(10)


@dataclass(frozen=True)
class Access:
    """A secured broker: the CA its certificates chain to, and a key with `consume`."""

    ca: str
    token: str


@dataclass(frozen=True)
class Store:
    """The S3 server a system's warehouse is on: its settings, and its data folder (where
    its request counts are read)."""

    env: dict[str, str]
    data_dir: Path

    def requests(self) -> dict[str, int]:
        from dejaq.jobs import embedded_s3

        return embedded_s3.requests(self.data_dir)


@contextmanager
def s3_server(tmp_path: Path) -> Iterator[Store]:
    """`dejaq s3` for the `s3` system; this process reaches it as a job would."""
    from dejaq.conf.settings import load_settings
    from dejaq.conf.storage import export
    from dejaq.jobs import children, embedded_s3, ports

    proc, env = embedded_s3.start(ports.free_port(), tmp_path / "s3")
    os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})
    export(load_settings(env=env))
    try:
        yield Store(env, tmp_path / "s3")
    finally:
        children.stop(proc)


def per_second(before: dict[str, int], after: dict[str, int], seconds: float) -> dict:
    from dejaq.jobs.embedded_s3 import requests_between

    made = requests_between(before, after)
    return {"requests": made, "per_s": round(sum(made.values()) / seconds, 2)}


@contextmanager
def dejaq(
    args: argparse.Namespace,
    tmp_path: Path,
    run: int,
    name: str,
    store: Store | None = None,
    slices: int = 1,
) -> Iterator[tuple[str, dict, dict, Access | None]]:
    """A 3-node broker over the topics of run `run`, filled as the ingest job would:
    (leader's address, pids, set-up seconds, how to reach it). With `slices`, the topics
    of the `slices` - 1 runs after it too, left empty (`fill_topic` fills them). `name`
    "secured": TLS on its HTTP and API keys on, the clients sending a key over TLS.
    `store`: the warehouse in its bucket."""

    from dejaq.broker.api.keys import add_key
    from dejaq.jobs import cluster
    from dejaq.jobs.certificates import new_authority

    secure = name == "secured"
    tmp_path = tmp_path / name
    warehouse = warehouse_of(tmp_path, run, store)
    storage = ""
    if store:
        endpoint = store.env["DEJAQ_STORAGE_ENDPOINT"]
        storage = f"storage: {{endpoint: '{endpoint}', path_style: true}}\n"
    conf = tmp_path / f"dejaq-{run}.yaml"
    topics = [t for r in range(run, run + slices) for t, _, _, _ in phase_topics(args, r)]
    security, access, headers, verify = "", None, {}, True
    if secure:
        ca = new_authority(tmp_path / "pki")
        node = ca.issue(tmp_path / "pki", "node", ["127.0.0.1"])
        keys = tmp_path / "keys.json"
        token = add_key(keys, f"bench-{run}", ["consume", "monitor"], ["*"])
        security = (
            f", keys_file: {keys}, tls: {{cert: {node.cert}, key: {node.key}, ca: {ca.cert}}}"
        )
        access, headers = Access(str(ca.cert), token), {"authorization": f"Bearer {token}"}
        verify = ssl.create_default_context(cafile=str(ca.cert))
    tmp_path.mkdir(parents=True, exist_ok=True)
    conf.write_text(
        f"warehouse: {warehouse}\n"
        f"{storage}"
        "kafka: {bootstrap: '127.0.0.1:9'}\n"
        f"broker: {{lease_ms: 30000, heartbeat_timeout_ms: 30000{security}}}\n"
        "topics:\n"
        + "".join(
            f"  - {{name: b{t}, kind: priority, source: [{t}-in], buckets: {args.buckets}}}\n"
            for t in topics
        )
    )
    t0 = time.perf_counter()
    for topic, _, _, n in phase_topics(args, run):
        fill_topic(args, warehouse, f"b{topic}", n)
    fill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    nodes = cluster.up(3, tmp_path / f"raft-{run}", str(conf))
    up_s = time.perf_counter() - t0
    try:
        leader = leader_of(nodes, headers, verify)
        followers = [n for n in nodes if n.http != leader]
        pids = {
            "leader": next(n.proc.pid for n in nodes if n.http == leader),
            "follower_1": followers[0].proc.pid,
            "follower_2": followers[1].proc.pid,
        }
        seconds = {"fill_delta": round(fill_s, 1), "cluster_up": round(up_s, 1)}
        yield leader, pids, seconds, access
    finally:
        for node in nodes:
            cluster.stop_node(node)


def warehouse_of(tmp_path: Path, run: int, store: Store | None) -> str:
    """Where `dejaq` keeps the buffer of a system (`tmp_path`, its own folder) in run `run`."""
    return f"s3://dejaq/bench-{run}" if store else str(tmp_path / "warehouse")


def fill_topic(args: argparse.Namespace, warehouse: str, topic: str, n: int) -> None:
    """Land `n` messages in a topic's buffer as the ingest job would, 50,000 a commit."""
    from test_broker import buffer_rows, fill

    for start in range(0, n, 50_000):
        keys = [(i * 7919) % 65536 for i in range(start, min(n, start + 50_000))]
        fill(
            warehouse,
            topic,
            buffer_rows(keys, lambda i: i % args.buckets, f"{topic}-{start}-", noted=False),
        )


def wait_indexed(addr: str, topic: str, n: int, timeout: float = 120) -> None:
    """Until every node's index holds a topic's `n` messages."""
    import httpx

    nodes = httpx.get(f"http://{addr}/v1/cluster").json()["nodes"].values()
    deadline = time.monotonic() + timeout
    while True:
        views = [httpx.get(f"http://{node}/v1/cluster").json()["topics"] for node in nodes]
        if all(view.get(topic, {}).get("indexed") == n for view in views):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{topic}'s {n} messages not indexed on every node in {timeout} s")
        time.sleep(0.1)


def leader_of(nodes: list, headers: dict, verify: object, timeout: float = 30) -> str:
    """The HTTP address of the nodes' leader, once they agree on one that is among them:
    `cluster up` returns when every node is ready, and an election can still follow."""
    import httpx

    addresses = {n.http for n in nodes}
    deadline = time.monotonic() + timeout
    while True:
        views = [
            httpx.get(f"{n.url}/v1/cluster", headers=headers, verify=verify).json() for n in nodes
        ]
        leaders = {v.get("leader_http") for v in views}
        if len(leaders) == 1 and (leader := leaders.pop()) in addresses:
            return leader
        if time.monotonic() > deadline:
            raise RuntimeError(f"no leader the {len(nodes)} nodes agree on after {timeout} s")
        time.sleep(0.1)


def _medians(runs: list[dict]) -> list[dict]:
    """Per phase, in PHASES order, the run with the median msgs/s, and every run's."""
    out = []
    for batch, workers in PHASES:
        mine = [r for r in runs if (r["batch"], r["workers"]) == (batch, workers)]
        median = sorted(mine, key=lambda r: r["msgs_per_s"])[(len(mine) - 1) // 2]
        out.append({**median, "msgs_per_s_runs": [r["msgs_per_s"] for r in mine]})
    return out


def _ratios(phases: list[dict], baseline: list[dict]) -> dict[str, float]:
    return {
        r["phase"]: round(r["msgs_per_s"] / b["msgs_per_s"], 3)
        for r, b in zip(phases, baseline, strict=True)
    }


def _paired(runs: list[dict], floor: list[dict]) -> dict[str, dict]:
    """Per phase: each run's msgs/s over the floor's in the same run, and their median."""
    theirs = {(r["run"], r["phase"]): r["msgs_per_s"] for r in floor}
    ratios: dict[str, list[float]] = {}
    for r in runs:
        if (key := (r["run"], r["phase"])) in theirs:
            ratios.setdefault(r["phase"], []).append(round(r["msgs_per_s"] / theirs[key], 3))
    return {phase: {"median": median_low(rs), "runs": rs} for phase, rs in ratios.items()}


def _cpu_ratios(phases: list[dict], baseline: list[dict]) -> dict[str, float]:
    """The baseline's CPU per message (all processes) over each phase's: the throughput
    ratio that CPU alone predicts where nodes and clients share the cores."""
    return {
        r["phase"]: round(b["cpu_us_per_msg"]["all"] / r["cpu_us_per_msg"]["all"], 3)
        for r, b in zip(phases, baseline, strict=True)
    }


def _floor_leader(ports: list[int], timeout: float = 30) -> int:
    """Which of the Raft floor's nodes leads, once one does."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for i, port in enumerate(ports):
            if httpx.get(f"http://127.0.0.1:{port}/role").json()["leader"]:
                return i
        time.sleep(0.1)
    raise TimeoutError(f"the Raft floor elected no leader within {timeout:.0f} s")


def _pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(p * len(values)))] * 1000, 2)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_phase(
    addr: str,
    topic: str,
    batch: int,
    n: int,
    workers: int,
    procs: int,
    secs: float,
    pids,
    access: Access | None = None,
    by_receipt: bool = False,
    worker: bool = False,
    view: str = "/v1/cluster",
):
    q: mp.Queue = mp.Queue()
    acked = mp.Value("q", 0)
    names = [f"{topic}-w{i}" for i in range(workers)]
    ps = [
        mp.Process(
            target=_proc,
            args=(
                addr,
                topic,
                names[i::procs],
                batch,
                n,
                secs,
                q,
                acked,
                access,
                by_receipt,
                worker,
            ),
        )
        for i in range(procs)
    ]
    cpu_before = {role: cpu_seconds(pid) for role, pid in pids.items()}
    entries_before = commit_index(addr, view, access)
    started = time.perf_counter()
    for p in ps:
        p.start()
    results = [q.get() for _ in ps]
    for p in ps:
        p.join()
    elapsed = time.perf_counter() - started
    spent = {role: cpu_seconds(pid) - cpu_before[role] for role, pid in pids.items()}
    cpu = {role: round(seconds, 1) for role, seconds in spent.items()}
    entries = commit_index(addr, view, access) - entries_before
    lease = [x for r in results for x in r["lease"]]
    ack = [x for r in results for x in r["ack"]]
    done = sum(r["done"] for r in results)
    per_msg = {role: seconds / max(done, 1) * 1e6 for role, seconds in spent.items()}
    per_msg["clients"] = sum(r["cpu"] for r in results) / max(done, 1) * 1e6
    per_msg["all"] = sum(per_msg.values())
    return {
        "phase": f"batch_{batch}_workers_{workers}",
        "batch": batch,
        "workers": workers,
        "messages_acked": done,
        "seconds": round(elapsed, 2),
        "msgs_per_s": round(done / elapsed),
        "lease_p50_ms": _pct(lease, 0.5),
        "lease_p99_ms": _pct(lease, 0.99),
        "ack_p50_ms": _pct(ack, 0.5),
        "ack_p99_ms": _pct(ack, 0.99),
        "errors": sum(r["errors"] for r in results),
        "broker_cpu_seconds": cpu,
        "leader_cpu_us_per_msg": round(cpu["leader"] / max(done, 1) * 1e6, 1),
        "client_cpu_us_per_msg": round(per_msg["clients"], 1),
        "raft_entries_per_msg": round(entries / max(done, 1), 4),
        "cpu_us_per_msg": {role: round(us, 1) for role, us in per_msg.items()},
    }


def commit_index(addr: str, view: str, access: Access | None) -> int:
    """The Raft commit index of the leader at `addr`, from `view` (DejaQ's /v1/cluster,
    the baselines' /role; 0 without Raft): entries per message say how many requests
    each Raft round trip served."""
    import httpx

    if access is None:
        return httpx.get(f"http://{addr}{view}").json()["commit_index"]
    tls = ssl.create_default_context(cafile=access.ca)
    auth = {"authorization": f"Bearer {access.token}"}
    return httpx.get(f"https://{addr}{view}", headers=auth, verify=tls).json()["commit_index"]


def cluster_cpu(pids: dict[str, int]) -> float:
    """User + system CPU seconds of a cluster's processes so far."""
    return sum(cpu_seconds(pid) for pid in pids.values())


def cpu_rate(pids: dict[str, int], seconds: float) -> float:
    """The processes' CPU over the next `seconds`, in cores."""
    before, t0 = cluster_cpu(pids), time.perf_counter()
    time.sleep(seconds)
    return (cluster_cpu(pids) - before) / (time.perf_counter() - t0)


def settle(pids: dict[str, int], idle: float, timeout: float = 30) -> tuple[float, float]:
    """Wait until a cluster that ran a slice is done with what the slice left it (trims,
    checkpoints): its CPU over a short window within QUIET_CORES of its idle rate.
    Returns the seconds waited and the CPU seconds spent meanwhile beyond idle."""
    t0, cpu0 = time.monotonic(), cluster_cpu(pids)
    while cpu_rate(pids, 0.25) > idle + QUIET_CORES:
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"a cluster still busy {timeout} s after its slice")
    waited = time.monotonic() - t0
    spent = cluster_cpu(pids) - cpu0 - idle * waited
    return round(waited, 2), round(max(spent, 0.0), 2)


@dataclass(frozen=True)
class Side:
    """One of the two clusters the interleaved comparison runs."""

    addr: str
    prefix: str  # of its topics' names
    pids: dict[str, int]
    view: str  # where its leader tells its commit index


def interleaved(args: argparse.Namespace, tmp: Path) -> dict:
    """DejaQ acking by receipt against the Raft floor, both clusters up and each phase
    run in `args.interleave` slices that alternate between the two, each slice's first
    system alternating too: adjacent runs of seconds, where the runs above put a whole
    system (its start and its three phases) between the two. A slice's messages land in
    DejaQ's buffer just before it (`fill_topic`, then the nodes index them), so that the
    messages pending are those of one run, as above, not of every slice.

    The cluster not running a slice idles beside it: each cluster's idle CPU is measured
    first (`idle_cores`), and after each slice the bench waits until the cluster that ran
    it has settled (`settle`; what it spent meanwhile is `after_cpu_seconds`), so what
    one takes from the other is its idle cost, reported per slice
    (`resting_cpu_percent`, of one core). (Stopping the resting cluster instead
    would drop its Raft connections after PySyncObj's 3.5 s timeout and start
    elections.) Per phase: each slice's msgs/s over the floor's, their median, and every
    slice's figures."""
    out: list[dict] = []
    folder = "interleaved"  # DejaQ's, under `tmp`
    with (
        dejaq(args, tmp, 0, folder, slices=args.interleave) as (dejaq_addr, dejaq_pids, *_),
        raft_floor(tmp / "floor-interleaved") as (floor_addr, floor_pids),
    ):
        sides = {
            "receipts": Side(dejaq_addr, "b", dejaq_pids, "/v1/cluster"),
            "floor": Side(floor_addr, "f", floor_pids, "/role"),
        }
        warehouse = warehouse_of(tmp / folder, 0, None)
        time.sleep(IDLE_SETTLE_S)  # the leader's first retention runs, the last index loads
        idle = {name: cpu_rate(side.pids, IDLE_WINDOW_S) for name, side in sides.items()}
        for k, (batch, workers) in enumerate(PHASES):
            slices: dict[str, list[dict]] = {"receipts": [], "floor": []}
            for s in range(args.interleave):
                topic, _, _, n = phase_topics(args, s)[k]
                if s > 0:  # landed now, so that only this slice's messages are pending
                    fill_topic(args, warehouse, "b" + topic, n)
                    wait_indexed(dejaq_addr, "b" + topic, n)
                    settle(dejaq_pids, idle["receipts"])
                for name in ("receipts", "floor")[:: 1 if s % 2 == 0 else -1]:
                    side = sides[name]
                    resting = sides["floor" if name == "receipts" else "receipts"].pids
                    rest_before = cluster_cpu(resting)
                    result = run_phase(
                        side.addr,
                        side.prefix + topic,
                        batch,
                        n,
                        workers,
                        args.procs,
                        args.seconds,
                        side.pids,
                        by_receipt=name == "receipts",
                        view=side.view,
                    )
                    rested = cluster_cpu(resting) - rest_before
                    result["resting_cpu_percent"] = round(100 * rested / result["seconds"], 1)
                    result["settle_seconds"], result["after_cpu_seconds"] = settle(
                        side.pids, idle[name]
                    )
                    slices[name].append(result)
                    print(
                        f"interleaved {result['phase']} slice {s + 1}/{args.interleave}"
                        f" {name}: {result['msgs_per_s']} msgs/s, {result['errors']} errors",
                        file=sys.stderr,
                    )
                    if not result["messages_acked"]:
                        raise RuntimeError(
                            f"{name} acked nothing in slice {s + 1} of {result['phase']}"
                            f" ({result['errors']} errors)"
                        )
            out.append(_interleaved_phase(slices["receipts"], slices["floor"]))
    idle_cores = {name: round(cores, 3) for name, cores in idle.items()}
    return {"phases": out, "idle_cores": idle_cores}


def _interleaved_phase(mine: list[dict], floor: list[dict]) -> dict:
    """One phase's slices, DejaQ's by receipt and the floor's, side by side."""
    ratios = [round(r["msgs_per_s"] / f["msgs_per_s"], 3) for r, f in zip(mine, floor, strict=True)]
    return {
        "phase": mine[0]["phase"],
        "median": round(median(ratios), 3),
        "slices": ratios,
        "receipts_msgs_per_s": [r["msgs_per_s"] for r in mine],
        "floor_msgs_per_s": [f["msgs_per_s"] for f in floor],
        "receipts_lease_p99_ms": [r["lease_p99_ms"] for r in mine],
        "receipts_lease_p99_ms_median": round(median(r["lease_p99_ms"] for r in mine), 2),
        "clients_cpu_receipts_vs_floor": [
            round(r["client_cpu_us_per_msg"] / f["client_cpu_us_per_msg"], 2)
            for r, f in zip(mine, floor, strict=True)
        ],
        "resting_cpu_percent": {
            "floor_during_receipts": [r["resting_cpu_percent"] for r in mine],
            "dejaq_during_floor": [f["resting_cpu_percent"] for f in floor],
        },
        "after_cpu_seconds": {
            "receipts": [r["after_cpu_seconds"] for r in mine],
            "floor": [f["after_cpu_seconds"] for f in floor],
        },
        "errors": sum(r["errors"] for r in mine + floor),
        "receipts_cpu_us_per_msg": [r["cpu_us_per_msg"] for r in mine],
        "floor_cpu_us_per_msg": [f["cpu_us_per_msg"] for f in floor],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=200_000, help="for batch 100")
    ap.add_argument("--messages-batch1", type=int, default=20_000)
    ap.add_argument("--buckets", type=int, default=64, help="per topic, >= workers")
    ap.add_argument("--procs", type=int, default=2, help="client processes")
    ap.add_argument("--seconds", type=float, default=30, help="cap per phase")
    ap.add_argument("--runs", type=int, default=3, help="of each phase, systems interleaved")
    ap.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help="which to run, of: dejaq, receipts (DejaQ, its workers acking by receipt), "
        "worker (DejaQ, driven by `dejaq.client.Worker`s), "
        "secured (TLS and API keys on), s3 (the warehouse on "
        "`dejaq s3`), floor, ids, handles, picks, http (default: all)",
    )
    ap.add_argument(
        "--interleave",
        type=int,
        default=0,
        metavar="SLICES",
        help="then compare receipts and floor with both up, each phase in SLICES "
        "alternating slices (default: 0, none)",
    )
    ap.add_argument("--ceiling-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    ap.add_argument("--raft-floor-server", metavar="SPEC", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.buckets < max(w for _, w in PHASES):
        ap.error(f"--buckets must be at least {max(w for _, w in PHASES)}: one per worker")
    if args.ceiling_server:
        serve(canned_app(), args.ceiling_server)
        return 0
    if args.raft_floor_server:
        raft_floor_server(args.raft_floor_server)
        return 0

    os.environ.setdefault("DEJAQ_BROKER_RAFT_PASSWORD", secrets.token_hex(16))
    systems = [s.strip() for s in args.systems.split(",")]
    if unknown := set(systems) - set(SYSTEMS):
        ap.error(f"--systems: unknown {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    runs: dict[str, list[dict]] = {k: [] for k in SYSTEMS}
    setup: list[dict] = []

    def phases(
        name: str,
        addr: str,
        prefix: str,
        pids: dict[str, int],
        run: int,
        access=None,
        only: str | None = None,
    ) -> None:
        for topic, batch, workers, n in phase_topics(args, run):
            if only is not None and topic != only:
                continue
            runs[name].append(
                {"run": run}
                | run_phase(
                    addr,
                    prefix + topic,
                    batch,
                    n,
                    workers,
                    args.procs,
                    args.seconds,
                    pids,
                    access,
                    by_receipt=name in ("receipts", "picks"),
                    worker=name == "worker",
                    view="/v1/cluster" if name in DEJAQ_SYSTEMS else "/role",
                )
            )

    requests: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="dejaq-bench-") as tmp, ExitStack() as servers:
        store = None
        if "s3" in systems and args.runs > 0:
            store = servers.enter_context(s3_server(Path(tmp)))

        def dejaq_system(name: str, run: int) -> None:
            on = store if name == "s3" else None
            with dejaq(args, Path(tmp), run, name, on) as (leader, pids, seconds, access):
                setup.append({name: seconds})
                if on is None:
                    phases(name, leader, "b", pids, run, access)
                    return
                time.sleep(IDLE_SETTLE_S)
                before, t0 = on.requests(), time.monotonic()
                time.sleep(IDLE_SECONDS)  # the measured window: nodes up, nothing to do
                idle = per_second(before, on.requests(), time.monotonic() - t0)
                idle["per_node_per_s"] = round(idle["per_s"] / 3, 2)
                loaded = {}
                for topic, batch, workers, _ in phase_topics(args, run):
                    before, t0 = on.requests(), time.monotonic()
                    phases(name, leader, "b", pids, run, access, only=topic)
                    loaded[f"batch_{batch}_workers_{workers}"] = per_second(
                        before, on.requests(), time.monotonic() - t0
                    )
                requests.append({"run": run, "idle": idle, "under_load": loaded})

        def baseline(name: str, run: int) -> None:
            if name == "http":
                with http_ceiling() as (http_addr, http_pids):
                    phases(name, http_addr, "c", http_pids, run)
                return
            carry = None if name == "floor" else name
            with raft_floor(Path(tmp) / f"floor-{name}-{run}", carry) as (leader, pids):
                phases(name, leader, "f", pids, run)

        for run in range(args.runs):  # one system up at a time, in turn
            for name in SYSTEMS[:: 1 if run % 2 == 0 else -1]:
                if name in systems:
                    (dejaq_system if name in DEJAQ_SYSTEMS else baseline)(name, run)
        side_by_side = interleaved(args, Path(tmp)) if args.interleave > 0 else None
    medians = {k: _medians(v) if v else [] for k, v in runs.items()}
    results, secured, on_s3 = medians["dejaq"], medians["secured"], medians["s3"]
    by_receipt, by_worker = medians["receipts"], medians["worker"]
    floor, ids, handles, picks, baseline = (
        medians[k] for k in ("floor", "ids", "handles", "picks", "http")
    )

    def ratios(mine: list[dict], theirs: list[dict]) -> dict[str, float] | None:
        return _ratios(mine, theirs) if mine and theirs else None

    paired = {
        key: _paired(runs[name], runs["floor"])
        for name, key in (
            ("dejaq", "results"),
            ("receipts", "acking_by_receipt"),
            ("worker", "worker_client"),
            ("secured", "secured_tls_and_keys"),
            ("s3", "s3_warehouse"),
            ("ids", "floor_carrying_ids"),
            ("handles", "floor_carrying_handles"),
            ("picks", "floor_carrying_picks"),
        )
        if runs[name] and runs["floor"]
    }

    print(
        json.dumps(
            {
                "benchmark": "broker lease+ack, 3 nodes",
                "results": results,
                "acking_by_receipt": by_receipt,
                "receipts_vs_results": ratios(by_receipt, results),
                "receipts_vs_floor": ratios(by_receipt, floor),
                "receipts_vs_floor_by_cpu": _cpu_ratios(by_receipt, floor)
                if by_receipt and floor
                else None,
                "paired_vs_floor": paired or None,
                "interleaved_receipts_vs_floor": side_by_side,
                "worker_client": by_worker,
                "worker_vs_receipts": ratios(by_worker, by_receipt),
                "worker_vs_floor": ratios(by_worker, floor),
                "secured_tls_and_keys": secured,
                "secured_vs_results": ratios(secured, results),
                "s3_warehouse": on_s3,
                "s3_vs_results": ratios(on_s3, results),
                "s3_requests": requests,
                "baseline_http_only": baseline,
                "vs_baseline": ratios(results, baseline),
                "floor_http_and_raft": floor,
                "vs_floor": ratios(results, floor),
                "floor_vs_baseline": ratios(floor, baseline),
                "floor_carrying_ids": ids,
                "floor_carrying_handles": handles,
                "vs_floor_carrying_ids": ratios(results, ids),
                "carrying_ids_vs_floor": ratios(ids, floor),
                "carrying_handles_vs_floor": ratios(handles, floor),
                "floor_carrying_picks": picks,
                "receipts_vs_floor_carrying_picks": ratios(by_receipt, picks),
                "carrying_picks_vs_floor": ratios(picks, floor),
                "parameters": {
                    "nodes": 3,
                    "phases": [{"batch": b, "workers": w} for b, w in PHASES],
                    "client_processes": args.procs,
                    "messages_batch1": args.messages_batch1,
                    "messages_batch100": args.messages,
                    "buckets": args.buckets,
                    "payload_bytes": 16,
                    "seconds_cap": args.seconds,
                    "runs": args.runs,
                    "interleaved_slices": args.interleave,
                    "systems": systems,
                    "date": time.strftime("%Y-%m-%d"),
                    "target": "leader",
                },
                "setup_seconds": setup,
                "machine": machine(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
