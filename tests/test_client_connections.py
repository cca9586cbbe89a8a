"""The client's HTTP connections against real HTTP servers standing in for nodes.

Each server here is a real HTTP/1.1 server on a socket, scripted to answer as a node does
in a moment real brokers reach only now and then (a 503 naming a new leader, a node
closing an idle connection, an answer lost after the request was read). The client's
calls against real clusters are in `test_client.py`.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import ssl
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dejaq.client import Client, Forbidden, ProblemError, Unauthorized, Unavailable, Worker
from dejaq.client.connections import HEAD_MAX_BYTES
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


def test_a_broker_that_refuses_a_leases_request_id_is_leased_from_without_it() -> None:
    """A broker of a version from before request ids refuses the field as FastAPI does
    (422, extra_forbidden; a stand-in, as no such broker is installed here): the lease
    is sent again without it, and so is every lease after."""

    def older(path: str, body: dict) -> tuple[int, dict, dict[str, str]]:
        if "request_id" in body:
            refused = [{"loc": ["body", "request_id"], "msg": "Extra inputs are not permitted"}]
            return 422, {"title": "invalid request", "errors": refused}, {}
        return 200, {"messages": []}, {}

    with stands(older) as (a,), Client([a.url]) as c:
        assert c.lease("jobs", "w") == [] and c.lease("jobs", "w") == []
    assert ["request_id" in body for _, body in a.requests] == [True, False, False]


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


def test_a_worker_runs_where_sighup_does_not_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows has no SIGHUP: a worker in the main thread stops on the signals there are
    and gives their handlers back."""
    monkeypatch.delattr(signal, "SIGHUP")
    before = signal.getsignal(signal.SIGTERM)

    def stops(path: str, body: dict) -> tuple[int, dict, dict[str, str]]:
        worker.stop()
        return no_messages(path, body)

    with stands(stops) as (node,), Client([node.url]) as c:
        worker = Worker(c, "jobs", lambda m: None, wait_ms=0)
        worker.run()
        assert [path for path, _ in node.requests] == ["/v1/topics/jobs/leases"]
    assert signal.getsignal(signal.SIGTERM) is before


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


def test_a_starting_node_s_503_sends_any_call_to_the_next_node() -> None:
    """A node loading its indexes answers 503 marked as applying nothing
    (`dejaq-not-applied`): a produce without an id, which a plain 503 would fail (it
    may have been forwarded and applied), goes on to the next node."""

    def starting(path: str, body: dict) -> tuple[int, dict, dict[str, str]]:
        return 503, {"title": "node starting"}, {"retry-after": "1", "dejaq-not-applied": "1"}

    def plain_503(path: str, body: dict) -> tuple[int, dict, dict[str, str]]:
        return 503, {"title": "no Raft leader"}, {"retry-after": "1"}

    with stands(starting, produced) as (loading, up), Client([loading.url, up.url]) as c:
        assert c.produce("jobs", b"x") == "m1"
        assert c.node == up.url
    assert (len(loading.requests), len(up.requests)) == (1, 1)
    with (
        stands(plain_503, produced) as (failing, up),
        Client([failing.url, up.url]) as c,
        pytest.raises(ProblemError),
    ):
        c.produce("jobs", b"x")
    assert (len(failing.requests), len(up.requests)) == (1, 0)


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


def test_a_key_goes_in_clear_only_to_loopback_unless_allowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over http:// beyond this machine the key would cross the network in clear: such a
    node is refused before anything is sent, whether the key is given or in the
    environment, unless the caller allows it. Loopback and https:// are not."""
    for beyond in ("10.0.0.1:1", "http://b1.example.com:8441", "http://[2001:db8::1]:1"):
        with pytest.raises(ValueError, match=re.escape(beyond)):
            Client([beyond], token="dq_x_y")
    monkeypatch.setenv("DEJAQ_TOKEN", "dq_x_y")
    with pytest.raises(ValueError, match=r"10\.0\.0\.1:1.*in clear"):
        Client(["127.0.0.1:1", "10.0.0.1:1"])
    for near in ("https://10.0.0.1:1", "127.0.0.1:1", "http://127.5.6.7:1", "localhost:1"):
        Client([near]).close()
    Client(["http://[::1]:1", "http://LOCALHOST:1"]).close()
    Client(["10.0.0.1:1"], insecure_http=True).close()
    monkeypatch.delenv("DEJAQ_TOKEN")
    Client(["10.0.0.1:1"]).close()  # no key to give away


def refusing(status: int) -> Script:
    """A node whose copy of the key file does not (yet) give the key what it asks."""

    def script(path: str, body: dict) -> tuple[int, dict, dict[str, str]]:
        return status, {"title": "unauthorized" if status == 401 else "forbidden"}, {}

    return script


@pytest.mark.parametrize("status", [401, 403])
def test_a_key_one_node_refuses_is_asked_of_the_others(status: int) -> None:
    """Each node reads its own copy of the key file, copied to it after each change: one
    that refuses a key may be behind the others. A call goes on to the next node, a
    produce without an id too (a refused call was not applied), and sticks to it."""

    def current_node(path: str, body: dict) -> tuple[int, dict, dict[str, str]]:
        return 200, {"messages": [], "ids": ["m1"]}, {}

    with stands(refusing(status), current_node) as (behind, current):
        with Client([behind.url, current.url], token="dq_k") as c:
            assert c.lease("jobs", "w") == []
            assert c.node == current.url
            assert c.produce("jobs", b"x") == "m1"
        assert len(behind.requests) == 1 and len(current.requests) == 2


def test_a_key_refused_by_one_node_waits_for_another_in_an_election() -> None:
    """A node that refused the key is not the last word while another answers 503 (an
    election): that one is asked again, and takes the key."""
    answers = iter([(503, {"title": "no leader"}, {"retry-after": "0.1"})])

    def electing(path: str, body: dict) -> tuple[int, dict, dict[str, str]]:
        return next(answers, (200, {"messages": []}, {}))

    with stands(refusing(401), electing) as (behind, current):
        with Client([behind.url, current.url], token="dq_k") as c:
            assert c.lease("jobs", "w") == []
        assert len(behind.requests) == 1 and len(current.requests) == 2


@pytest.mark.parametrize("status", [401, 403])
def test_a_key_every_node_refuses_raises_once_each_was_asked(status: int) -> None:
    """Each node is asked once, behind ones that cannot answer too, and the last
    refusal is raised; a single node's at once."""
    error = Unauthorized if status == 401 else Forbidden
    gone = f"http://127.0.0.1:{free_port()}"
    with stands(refusing(status), refusing(status)) as (a, b):
        with Client([a.url, gone, b.url], token="dq_k") as c, pytest.raises(error) as raised:
            c.lease("jobs", "w")
        assert raised.value.status == status
        assert len(a.requests) == 1 and len(b.requests) == 1
        with Client([a.url, gone], token="dq_k") as c, pytest.raises(error):
            c.lease("jobs", "w")
        assert len(a.requests) == 2, "the node that cannot answer is passed over, not asked"
        with Client([b.url], token="dq_k") as c, pytest.raises(error):
            c.lease("jobs", "w")
        assert len(b.requests) == 2


def test_a_redirect_is_not_followed() -> None:
    """The key goes to the nodes the caller named and nowhere else: a node's redirect is
    an error answer, not a request to where it points."""

    def redirects(path: str, body: dict) -> tuple[int, dict, dict[str, str]]:
        return 307, {"title": "elsewhere"}, {"location": f"{elsewhere.url}{path}"}

    with (
        stands(redirects, no_messages) as (node, elsewhere),
        Client([node.url], token="dq_x_y") as c,
        pytest.raises(ProblemError) as raised,
    ):
        c.lease("jobs", "w")
    assert raised.value.status == 307
    assert len(node.requests) == 1 and elsewhere.requests == []


# --- answers as bytes: how the client frames them ---------------------------------------

LEASED = {
    "id": "m1",
    "receipt": 7,
    "bucket": 0,
    "sort_key": 3,
    "priority": 3,
    "deliver_at": None,
    "key": None,
    "payload": "eA==",
    "deliveries": 1,
    "lease_deadline": 1,
}
LEASE_BODY = json.dumps({"messages": [LEASED]}).encode()


def answer(body: bytes = LEASE_BODY, *headers: str, status: str = "200 OK") -> bytes:
    """An HTTP/1.1 answer's bytes, with a content-length unless `headers` frame it."""
    framed = any(h.lower().startswith(("content-length", "transfer-encoding")) for h in headers)
    lines = [f"HTTP/1.1 {status}", "content-type: application/json", *headers]
    if not framed:
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class FakeNode(ABC):
    """A node's stand-in on a raw socket: each connection is handed to `_handle` on its
    own thread, until `close`. Counts connections."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:  # closed: the test is over
                return
            self.connections += 1
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    @abstractmethod
    def _handle(self, conn: socket.socket) -> None: ...

    def close(self) -> None:
        self.server.close()


class Wire(FakeNode):
    """Answers each request (read whole) with the next scripted bytes, sent in the
    pieces given, and closes the connection after those marked so. Counts requests."""

    def __init__(self, script: list[tuple[list[bytes], bool]]) -> None:
        self.script = iter(script)
        self.requests: list[bytes] = []
        super().__init__()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while True:
                while b"\r\n\r\n" not in data:
                    more = conn.recv(65536)
                    if not more:
                        return
                    data += more
                head, _, data = data.partition(b"\r\n\r\n")
                length = re.search(rb"content-length: (\d+)", head, re.IGNORECASE)
                need = int(length[1]) if length else 0
                while len(data) < need:
                    more = conn.recv(65536)
                    if not more:
                        return
                    data += more
                self.requests.append(head + b"\r\n\r\n" + data[:need])
                data = data[need:]
                pieces, close = next(self.script)
                for piece in pieces:
                    conn.sendall(piece)
                if close:
                    return


@contextmanager
def wired(*scripts: list[tuple[list[bytes], bool]]) -> Iterator[list[Wire]]:
    nodes = [Wire(s) for s in scripts]
    try:
        yield nodes
    finally:
        for node in nodes:
            node.close()


def test_a_chunked_answer_in_pieces_is_read_whole_and_the_connection_kept() -> None:
    """Framed by chunks (as a proxy may), and arriving a few bytes at a time."""
    body = LEASE_BODY
    chunked = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (10, body[:10], len(body) - 10, body[10:])
    whole = answer(chunked, "transfer-encoding: chunked")
    pieces = [whole[i : i + 7] for i in range(0, len(whole), 7)]
    with wired([(pieces, False), ([answer()], False)]) as (node,), Client([node.url]) as c:
        for _ in range(2):
            (m,) = c.lease("jobs", "w")
            assert (m.id, m.receipt, m.payload) == ("m1", 7, b"x")
        assert node.connections == 1 and len(node.requests) == 2


def test_an_answer_ended_by_closing_is_read_whole_and_not_reused() -> None:
    """Neither a length nor chunks: the body is what came before the node closed."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n"
    with wired([([head, LEASE_BODY], True), ([answer()], False)]) as (node,):
        with Client([node.url]) as c:
            assert [m.id for m in c.lease("jobs", "w")] == ["m1"]
            assert [m.id for m in c.lease("jobs", "w")] == ["m1"]
        assert node.connections == 2


def test_an_interim_answer_is_passed_over() -> None:
    interim = b"HTTP/1.1 100 Continue\r\n\r\n"
    with wired([([interim, answer()], False)]) as (node,), Client([node.url]) as c:
        assert [m.id for m in c.lease("jobs", "w")] == ["m1"]


def test_an_answer_cut_short_or_past_the_head_limit_is_lost_and_asked_elsewhere() -> None:
    """A lease may be asked again: the client does so on the next node. The node that
    cut its answer, or sent headers without end, is not asked on that connection again."""
    cut = answer()[:-5]
    endless = b"HTTP/1.1 200 OK\r\n" + b"x-filler: " + b"y" * (HEAD_MAX_BYTES + 1) + b"\r\n\r\n"
    for broken in (cut, endless):
        script = [([broken], True)]
        with wired(script, [([answer()], False)]) as (bad, good), Client([bad.url, good.url]) as c:
            assert [m.id for m in c.lease("jobs", "w")] == ["m1"]
            assert len(bad.requests) == 1 and len(good.requests) == 1


def test_bytes_after_an_answer_leave_it_whole_and_the_connection_unused() -> None:
    """Nothing is due after an answer: a connection that has more is not used again."""
    extra = answer() + b"HTTP/1.1 200 OK\r\n"
    with wired([([extra], False), ([answer()], False)]) as (node,), Client([node.url]) as c:
        assert [m.id for m in c.lease("jobs", "w")] == ["m1"]
        assert [m.id for m in c.lease("jobs", "w")] == ["m1"]
        assert node.connections == 2


class Trickle(FakeNode):
    """Reads a request, sends an answer's head announcing a long body, then one byte of
    it every `gap_s`, for ever: never silent for as long as one read waits, never done."""

    def __init__(self, gap_s: float) -> None:
        self.gap_s = gap_s
        self.stop = threading.Event()
        super().__init__()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                more = conn.recv(65536)
                if not more:
                    return
                data += more
            try:
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n{")
                while not self.stop.wait(self.gap_s):
                    conn.sendall(b" ")
            except OSError:  # the client gave up on it
                return

    def close(self) -> None:
        self.stop.set()
        super().close()


def test_a_node_trickling_its_answer_fails_the_call_by_its_deadline() -> None:
    """`deadline` bounds a call however a node paces its answer: a byte every little
    while (under `stall_s`, under `timeout`) restarts no wait."""
    node = Trickle(gap_s=1.9)
    outcomes: list[tuple[str, BaseException | None, float]] = []

    def call() -> None:
        with Client([node.url], stall_s=2.0, timeout=10.0, deadline=3.0) as c:
            calls = {"lease": lambda: c.lease("jobs", "w"), "stats": lambda: c.topic_stats("jobs")}
            for name, do in calls.items():
                began = time.monotonic()
                try:
                    do()
                    error = None
                except Unavailable as e:
                    error = e
                outcomes.append((name, error, time.monotonic() - began))

    caller = threading.Thread(target=call, daemon=True)
    try:
        caller.start()
        caller.join(15)
        assert not caller.is_alive(), f"calls still waiting after 15 s: {outcomes}"
    finally:
        node.close()
    assert [name for name, _, _ in outcomes] == ["lease", "stats"]
    for name, error, took in outcomes:
        assert isinstance(error, Unavailable), (name, error)
        assert "no node served it in time" in str(error), (name, error)
        assert took >= 3.0, f"{name} gave up {took:.2f} s in, before its deadline"


def test_a_request_goes_out_whole_with_its_headers() -> None:
    """One write: the request line, the host, the client's headers, the JSON body."""
    with wired([([answer()], False)]) as (node,), Client([node.url], token="dq_k") as c:
        c.lease("jobs", "w", max_messages=5)
        (request,) = node.requests
    head, _, body = request.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0] == "POST /v1/topics/jobs/leases HTTP/1.1"
    headers = dict(line.split(": ", 1) for line in lines[1:])
    port = node.url.rsplit(":", 1)[1]
    assert headers["host"] == f"127.0.0.1:{port}"
    assert headers["authorization"] == "Bearer dq_k"
    assert headers["content-length"] == str(len(body))
    assert json.loads(body)["max_messages"] == 5


def test_a_token_that_would_split_a_header_is_refused_at_once() -> None:
    for bad in ("dq_k\r\nx-injected: 1", "dq_k\n", "dq\0k"):
        with pytest.raises(ValueError, match="header"):
            Client(["http://127.0.0.1:1"], token=bad)
