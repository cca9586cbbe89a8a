"""What the shipped worker costs its own process per message: `dejaq.client.Worker`
leasing, handling (a handler that does nothing) and acking by receipt.

    .venv/bin/python bench/worker_client.py [--batch1 4000] [--batch100 200000] [--rounds 3]

A worker's every lease and ack is one HTTP request, so at small batches what the client
spends per request bounds it, and it shares the worker's machine with the handler. The
server here answers leases and acks from a counter (uvicorn on the broker's settings, in
its own process), so the figure is the worker's own CPU (`time.process_time` of this
process), not a broker's. The client's connections (`dejaq.client.connections`: a
request written whole, the answer framed by httptools) against the baseline in the same
run: the same Worker over the standard library's `http.client`, what the client used
before (`StdlibConnections`: its connections kept alive, but reused without the client's
idle check, a `poll` a request, so the baseline is if anything cheaper than it was).
Each is run R times per batch size, alternated; medians, and the ratio of the client's
to the baseline's. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import http.client
import itertools
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# This file is in bench/: keep its folder off the path (bench/broker.py shadows the package).
sys.path[:1] = [str(ROOT)]

from bench.machine import machine  # noqa: E402
from dejaq.client import Client, Worker  # noqa: E402
from dejaq.client.connections import (  # noqa: E402
    USER_AGENT,
    Connections,
    Lost,
    Node,
    NotSent,
    Response,
)
from dejaq.jobs.ports import free_port  # noqa: E402

TOPIC = "jobs"
PAYLOAD = base64.b64encode(b"x" * 16).decode()


def canned_app():
    """Leases answered with the messages asked for, each with a receipt; acks by
    receipt or by id answered with their count. No state, no Raft."""
    counter = itertools.count()

    async def app(scope, receive, send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body) if body else {}
        if scope["path"].endswith("/leases"):
            deadline = int(time.time() * 1000) + 30_000
            answer: dict[str, Any] = {
                "messages": [
                    {
                        "id": f"{TOPIC}-{n}",
                        "receipt": n,
                        "bucket": 0,
                        "sort_key": 1,
                        "priority": 1,
                        "deliver_at": None,
                        "key": None,
                        "payload": PAYLOAD,
                        "deliveries": 1,
                        "lease_deadline": deadline,
                    }
                    for n in itertools.islice(counter, request["max_messages"])
                ]
            }
        elif scope["path"].endswith("/acks"):
            answer = {"settled": len(request.get("receipts") or request.get("ids") or [])}
        else:  # the worker's heartbeat and leave
            answer = {"consumer_id": request.get("consumer_id", "w"), "buckets": [], "released": 0}
        data = json.dumps(answer).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    return app


def serve(port: int) -> None:
    import uvicorn

    from dejaq.broker.api.http_server import SETTINGS

    uvicorn.run(canned_app(), host="127.0.0.1", port=port, lifespan="off", **SETTINGS)


class StdlibConnections(Connections):
    """The baseline: the same pool of kept-alive connections, each request and answer
    through `http.client` (its head and body written apart, headers parsed by `email`).
    Its reads wait `timeout` each, not bounded by `until`: it measures CPU against a
    local node that answers at once."""

    def __init__(self) -> None:
        super().__init__({}, True)
        self._stdlib: list[http.client.HTTPConnection] = []
        self._stdlib_lock = threading.Lock()

    def request(
        self,
        node: Node,
        method: str,
        path: str,
        body: Any = None,
        *,
        timeout: float,
        connect_timeout: float,
        until: float,
    ) -> Response:
        with self._stdlib_lock:
            conn = self._stdlib.pop() if self._stdlib else None
        if conn is None:
            conn = http.client.HTTPConnection(node.host, node.port, timeout=connect_timeout)
            try:
                conn.connect()
            except OSError as e:
                raise NotSent(str(e)) from e
        headers = {"user-agent": USER_AGENT}
        data = None
        if body is not None:
            data = json.dumps(body, separators=(",", ":")).encode()
            headers["content-type"] = "application/json"
        try:
            conn.sock.settimeout(timeout)
            conn.request(method, node.prefix + path, data, headers)
            answer = conn.getresponse()
            content = answer.read()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise Lost(str(e)) from e
        response = Response(
            answer.status,
            answer.reason,
            {name.lower(): value for name, value in answer.getheaders()},
            content,
        )
        with self._stdlib_lock:
            self._stdlib.append(conn)
        return response

    def close(self) -> None:
        with self._stdlib_lock:
            for conn in self._stdlib:
                conn.close()
            self._stdlib.clear()
        super().close()


def worker_cpu(url: str, connections: str, batch: int, messages: int) -> dict[str, float]:
    """One Worker (this thread) until `messages` are acked: its process's CPU and wall
    time per message."""
    client = Client([url])
    if connections == "stdlib":
        client._http = StdlibConnections()
    acked = [0]
    worker: Worker

    def on_ack(m) -> None:
        acked[0] += 1
        if acked[0] >= messages:
            worker.stop()

    worker = Worker(client, TOPIC, lambda m: None, consumer_id="w", batch=batch, on_ack=on_ack)
    cpu, wall = time.process_time(), time.perf_counter()
    worker.run()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    client.close()
    per = {"cpu_us": 1e6 * cpu / acked[0], "wall_us": 1e6 * wall / acked[0]}
    return {k: round(v, 1) for k, v in per.items()} | {"acked": acked[0]}


def wait_for_port(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the canned server on port {port} did not start") from None
            time.sleep(0.05)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch1", type=int, default=4000, help="messages at batch 1")
    ap.add_argument("--batch100", type=int, default=200_000, help="messages at batch 100")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve)
        return 0
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    try:
        wait_for_port(port)
        url = f"http://127.0.0.1:{port}"
        runs: dict[str, dict[str, list[dict[str, float]]]] = {}
        for _ in range(args.rounds):
            for batch, n in ((1, args.batch1), (100, args.batch100)):
                for name in ("client", "stdlib"):
                    got = worker_cpu(url, name, batch, n)
                    runs.setdefault(f"batch_{batch}", {}).setdefault(name, []).append(got)
    finally:
        server.terminate()
        server.wait(30)
    median = {
        phase: {
            name: {k: round(statistics.median(r[k] for r in rs), 1) for k in ("cpu_us", "wall_us")}
            for name, rs in by_name.items()
        }
        for phase, by_name in runs.items()
    }
    print(
        json.dumps(
            {
                "benchmark": "the shipped Worker's own CPU per message, lease + ack by receipt",
                "cpu_us_per_msg": {
                    p: {n: m["cpu_us"] for n, m in v.items()} for p, v in median.items()
                },
                "wall_us_per_msg": {
                    p: {n: m["wall_us"] for n, m in v.items()} for p, v in median.items()
                },
                "client_vs_stdlib_cpu": {
                    p: round(v["client"]["cpu_us"] / v["stdlib"]["cpu_us"], 3)
                    for p, v in median.items()
                },
                "runs": runs,
                "parameters": {k: v for k, v in vars(args).items() if k != "serve"}
                | {"payload_bytes": 16, "handler": "does nothing"},
                "machine": machine(),
                "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
