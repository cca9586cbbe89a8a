"""The client's HTTP connections against real HTTP servers standing in for nodes.

Each server here is a real HTTP/1.1 server on a socket, scripted to answer as a node does
in a moment real brokers reach only now and then (a 503 naming a new leader, a node
closing an idle connection, an answer lost after the request was read). The client's
calls against real clusters are in `test_client.py`.
"""

from __future__ import annotations

import json
import ssl
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dejaq.client import Client, Unavailable
from dejaq.jobs.certificates import new_authority
from dejaq.jobs.ports import free_port

# (status, JSON body, headers), or None to close the connection without answering.
Script = Callable[[str, dict], tuple[int, dict, dict[str, str]] | None]


class Stand(ThreadingHTTPServer):
    """A node's stand-in: answers POSTs by `script`, counts connections and requests."""

    daemon_threads = True

    def __init__(
        self, script: Script, keep_alive: bool = True, tls: ssl.SSLContext | None = None
    ) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        if tls is not None:
            self.socket = tls.wrap_socket(self.socket, server_side=True)
        self.script, self.keep_alive, self.tls = script, keep_alive, tls
        self.connections = 0
        self.requests: list[tuple[str, dict]] = []
        self.closed = threading.Event()  # a connection was closed by this side

    def shutdown_request(self, request: object) -> None:
        """`closed` is set once the socket is closed, not when the handler finishes:
        a client told of it before then could still find the connection open."""
        super().shutdown_request(request)
        self.closed.set()

    @property
    def url(self) -> str:
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Stand

    def setup(self) -> None:
        super().setup()
        self.server.connections += 1

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.server.requests.append((self.path, body))
        answer = self.server.script(self.path, body)
        if answer is None:
            self.close_connection = True
            return
        status, payload, headers = answer
        data = json.dumps(payload).encode()
        self.send_response(status)
        for name, value in {"content-type": "application/json", **headers}.items():
            self.send_header(name, value)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        # Closed after the answer without saying so, as a node's idle timeout does.
        self.close_connection = not self.server.keep_alive

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def stands(
    *scripts: Script, keep_alive: bool = True, tls: ssl.SSLContext | None = None
) -> Iterator[list[Stand]]:
    servers = [Stand(s, keep_alive, tls) for s in scripts]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for t in threads:
        t.start()
    try:
        yield servers
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()
        for t in threads:
            t.join(10)


def no_messages(path: str, body: dict) -> tuple[int, dict, dict[str, str]]:
    return 200, {"messages": []}, {}


def produced(path: str, body: dict) -> tuple[int, dict, dict[str, str]]:
    return 200, {"ids": ["m1"]}, {}


def test_a_503_with_retry_after_0_is_asked_again_on_the_same_node() -> None:
    """A node that gave up on a stalled leader answers 503 with Retry-After 0: it knows
    the new leader, or is it. Asked again it serves; the next node may be the stalled
    one (here it would refuse the lease)."""
    answers = iter([(503, {"title": "leader unreachable"}, {"retry-after": "0"})])

    def first_503(path: str, body: dict) -> tuple[int, dict, dict[str, str]]:
        return next(answers, (200, {"messages": []}, {}))

    def refuses(path: str, body: dict) -> tuple[int, dict, dict[str, str]]:
        return 500, {"title": "not this node"}, {}

    with stands(first_503, refuses) as (a, b), Client([a.url, b.url]) as c:
        assert c.lease("jobs", "w") == []
    assert len(a.requests) == 2 and b.requests == []


def test_calls_share_one_kept_alive_connection() -> None:
    with stands(no_messages) as (node,), Client([node.url]) as c:
        for _ in range(20):
            assert c.lease("jobs", "w") == []
        assert len(node.requests) == 20
        assert node.connections == 1


def test_calls_over_tls_share_one_connection_and_an_unknown_ca_is_refused(
    tmp_path: Path,
) -> None:
    """Kept alive over TLS too: what a TLS 1.3 node sends after its handshake (session
    tickets) must not make an idle connection look closed."""
    ca = new_authority(tmp_path / "ca")
    issued = ca.issue(tmp_path, "node", ["127.0.0.1"])
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(issued.cert, issued.key)
    with stands(no_messages, tls=tls) as (node,):
        with Client([node.url], verify=str(ca.cert)) as c:
            for _ in range(20):
                assert c.lease("jobs", "w") == []
        assert len(node.requests) == 20
        assert node.connections == 1
        stranger = new_authority(tmp_path / "other")
        untrusting = Client([node.url], verify=str(stranger.cert), deadline=0.5)
        with untrusting, pytest.raises(Unavailable, match="CERTIFICATE_VERIFY_FAILED"):
            untrusting.lease("jobs", "w")
        assert len(node.requests) == 20


def test_a_connection_the_node_closed_while_idle_is_not_used_again() -> None:
    """A node closes idle connections (its keep-alive timeout, a restart). A produce
    without an id cannot be sent twice, so sending it on such a connection, and
    losing it, would fail the call: the client opens a new connection instead."""
    with stands(produced, keep_alive=False) as (node,), Client([node.url]) as c:
        assert c.produce("jobs", b"one") == "m1"
        assert node.closed.wait(10), "the node closed the connection"
        assert c.produce("jobs", b"two") == "m1"
        assert [body["payload"] for _, body in node.requests] == ["b25l", "dHdv"]
        assert node.connections == 2


def test_a_node_that_refuses_connections_is_passed_over() -> None:
    """Nothing was sent to a node that refused the connection: even a call that cannot
    be sent twice goes on to the next node."""
    with stands(produced) as (up,), Client([f"127.0.0.1:{free_port()}", up.url]) as c:
        assert c.produce("jobs", b"x") == "m1"
        assert c.node == up.url
    assert len(up.requests) == 1


def test_an_answer_lost_after_the_request_was_read() -> None:
    """The node read the request and closed without answering: it may have been applied.
    A produce without an id is not sent again (it raises); one a retry cannot repeat
    (a lease) is sent again on a new connection."""
    lost = iter([None])

    def once_lost(path: str, body: dict) -> tuple[int, dict, dict[str, str]] | None:
        return next(lost, (200, {"messages": [], "ids": ["m1"]}, {}))

    with stands(once_lost) as (node,), Client([node.url]) as c:
        with pytest.raises(Unavailable, match="not safe to retry"):
            c.produce("jobs", b"x")
        assert len(node.requests) == 1
        assert c.lease("jobs", "w") == []
        assert len(node.requests) == 2


def test_a_node_url_that_is_not_http_is_refused_at_once() -> None:
    for bad in ("ftp://127.0.0.1:1", "http://127.0.0.1:port", "http://:8001"):
        with pytest.raises(ValueError):
            Client([bad])
