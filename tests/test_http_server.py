"""The broker's HTTP server: one write per response, and responses intact on real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from conftest import wait_until

from dejaq.broker.api import http_server
from dejaq.broker.api.http_server import SETTINGS, GatheringTransport
from dejaq.jobs.children import wait_for_port
from dejaq.jobs.ports import free_port


async def app(scope, receive, send) -> None:
    """/fixed: a head and a body; /stream: three body chunks over three loop passes;
    /close: a body, then the connection closes; /length: the request body's length. Each
    reads the request's whole body first, but /refuse: a 413 before reading any."""
    if scope["type"] != "http":
        return
    if scope["path"] == "/refuse":
        await send({"type": "http.response.start", "status": 413, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return
    received = 0
    while True:
        message = await receive()
        received += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    path = scope["path"]
    headers = [(b"content-type", b"text/plain")]
    if path == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for part in (b"one,", b"two,", b"three"):
            await asyncio.sleep(0)
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    body = b"%d" % received if path == "/length" else path.encode() * 1000
    headers.append((b"content-length", b"%d" % len(body)))
    if path == "/close":
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """A real uvicorn on the broker's settings, in a thread of this process."""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", **SETTINGS)
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    wait_for_port(port, timeout=30, what="uvicorn")
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(10)
    assert not thread.is_alive()


def test_responses_arrive_whole_on_one_keep_alive_connection(server: str) -> None:
    with httpx.Client(base_url=server) as client:
        for _ in range(50):
            answer = client.get("/fixed")
            assert answer.status_code == 200
            assert answer.content == b"/fixed" * 1000
        streamed = client.get("/stream")
        assert streamed.content == b"one,two,three"
        assert streamed.headers["transfer-encoding"] == "chunked"
        assert client.get("/fixed").content == b"/fixed" * 1000  # still usable after it


def test_pipelined_requests_are_answered_in_order(server: str) -> None:
    host, port = server.removeprefix("http://").split(":")
    request = b"GET /fixed HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request * 3 + b"GET /close HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):  # the server closes after /close
            data += chunk
    assert data.count(b"HTTP/1.1 200 OK") == 4
    assert data.endswith(b"/close" * 1000)


class Recorder:
    """Stands in for the socket's transport only to count its writes: TCP keeps no write
    boundaries a real peer could observe."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> str:
        return f"real:{name}"


def test_writes_of_one_loop_pass_go_out_as_one() -> None:
    async def scenario() -> Recorder:
        inner = Recorder()
        t = GatheringTransport(inner, asyncio.get_running_loop())  # type: ignore[arg-type]
        t.write(b"HTTP/1.1 200 OK\r\n\r\n")
        t.writelines([b"body", b"!"])
        assert inner.writes == []  # nothing sent mid-pass
        await asyncio.sleep(0)
        assert inner.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody!"]
        t.write(b"last")
        t.close()  # what was gathered goes out before the close
        assert inner.writes[-1] == b"last" and inner.closed
        assert t.get_extra_info("peername") == "real:peername"
        return inner

    inner = asyncio.run(scenario())
    assert len(inner.writes) == 2


def _closed_within(s: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing `s`, if it closed it within `seconds`."""
    s.settimeout(seconds)
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except TimeoutError:
        return None
    return data


def test_a_request_head_late_or_without_end_closes_its_connection(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection that sends no head, or half of one, is closed once the head is late;
    one sending headers without end gets a 431 at the size limit. A head that came in
    time leaves its kept-alive connection to the idle timeout, as before."""
    monkeypatch.setattr(http_server, "HEAD_TIMEOUT_S", 0.5)
    host, port = server.removeprefix("http://").split(":")
    address = (host, int(port))
    with socket.create_connection(address) as silent:
        assert _closed_within(silent, 10) == b"", "no head"
    with socket.create_connection(address) as half:
        half.sendall(b"GET /fixed HTTP/1.1\r\nHost: x\r\n")
        assert _closed_within(half, 10) == b"", "half a head"
    with socket.create_connection(address) as endless:
        filler = b"x-filler: " + b"y" * 1000 + b"\r\n"
        with contextlib.suppress(OSError):  # closed while it still sends
            endless.sendall(b"GET /fixed HTTP/1.1\r\nHost: x\r\n" + filler * 100)
        answer = _closed_within(endless, 10)
        assert answer is not None and answer.startswith(b"HTTP/1.1 431 "), answer
    with socket.create_connection(address) as kept:
        kept.sendall(b"GET /fixed HTTP/1.1\r\nHost: x\r\n\r\n")
        head = b""
        while b"/fixed" * 1000 not in head:
            head += kept.recv(65536)
        assert uvicorn.Config(app, **SETTINGS).timeout_keep_alive > 1.5, "the server's idle"
        assert _closed_within(kept, 1.5) is None, "closed while idle, before its timeout"
        kept.sendall(b"GET /fixed HTTP/1.1\r\nHost: x\r\n\r\n")
        assert kept.recv(65536).startswith(b"HTTP/1.1 200 OK")


def test_a_body_that_stops_short_closes_its_connection_one_that_keeps_coming_does_not(
    server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body that stops arriving short of its length is cut once idle for BODY_IDLE_S;
    one arriving slowly, each part within that, is read whole and answered."""
    monkeypatch.setattr(http_server, "BODY_IDLE_S", 2.0)
    host, port = server.removeprefix("http://").split(":")
    address = (host, int(port))
    head = b"POST /length HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n"
    with socket.create_connection(address) as short:
        short.sendall(head + b"12345")
        assert _closed_within(short, 10) == b"", "a body stopped at half its length"
    with socket.create_connection(address) as slow:
        slow.sendall(head)
        for part in (b"12", b"34", b"56", b"78", b"90"):  # 1.2 s in all, 0.3 s apart
            # Each within BODY_IDLE_S of the last, the whole more than half of it.
            assert _closed_within(slow, 0.3) is None, "cut while its body still came"
            slow.sendall(part)
        answer = b""
        while not answer.endswith(b"\r\n\r\n10"):
            chunk = slow.recv(65536)
            assert chunk, answer
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200 OK"), answer


def test_a_body_answered_before_it_was_read_is_discarded_only_so_far(server: str) -> None:
    """A body the app refused unread (a 413) is read on and discarded, keeping the
    connection for the next request; one that goes on past DISCARD_MAX_BYTES closes it,
    rather than have the server read for as long as the client sends."""
    host, port = server.removeprefix("http://").split(":")
    address = (host, int(port))
    small = 100 * 1024
    with socket.create_connection(address) as kept:
        kept.sendall(b"POST /refuse HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % small)
        kept.sendall(b"x" * small)
        kept.sendall(b"GET /fixed HTTP/1.1\r\nHost: x\r\n\r\n")
        answers = b""
        while b"/fixed" * 1000 not in answers:
            chunk = kept.recv(65536)
            assert chunk, answers
            answers += chunk
        assert answers.startswith(b"HTTP/1.1 413 "), answers[:100]
    big = 64 * 1024 * 1024
    sent = 0
    with socket.create_connection(address) as endless:
        endless.sendall(b"POST /refuse HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % big)
        assert endless.recv(65536).startswith(b"HTTP/1.1 413 ")
        endless.settimeout(10)
        with contextlib.suppress(OSError):  # reset once closed
            while sent < big:
                sent += endless.send(b"x" * 65536)
    assert sent < 16 * http_server.DISCARD_MAX_BYTES, f"{sent} bytes read and discarded"


@contextlib.contextmanager
def _capped(cap: int) -> Iterator[str]:
    """A real uvicorn on the broker's settings, capped at `cap` connections."""
    port = free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, lifespan="off", limit_concurrency=cap, **SETTINGS
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    wait_for_port(port, timeout=30, what="uvicorn")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(10)
    assert not thread.is_alive()


def test_a_connection_served_within_the_cap_stays_served_past_it(monkeypatch) -> None:
    """Idle connections past the cap must not turn away a worker already served (its
    acks delayed past its leases); a request on a connection opened past it gets the 503
    that applied nothing, a probe's still answers, and once the crowd has gone a new
    connection is served again."""
    monkeypatch.setattr(http_server, "PROBE_ROOM", 2)
    with _capped(2) as url, httpx.Client(base_url=url) as kept:
        assert kept.get("/fixed").status_code == 200  # opened within the cap
        host, port = url.removeprefix("http://").split(":")
        crowd = [socket.create_connection((host, int(port)), timeout=10) for _ in range(2)]
        try:
            with httpx.Client(base_url=url) as late:
                # Over the cap, within its probe room: served by a probe's path only.
                answer = late.get("/fixed")
                assert answer.status_code == 503, answer.text
                assert answer.headers[http_server.NOT_APPLIED] == "connections"
                assert answer.json()["title"] == "node full"
                assert late.get("/healthz").status_code == 200
            assert kept.get("/fixed").status_code == 200
        finally:
            for sock in crowd:
                sock.close()
        with httpx.Client(base_url=url) as later:
            wait_until(
                lambda: later.get("/fixed").status_code == 200,
                timeout=10,
                what="a new connection served once the crowd's closes landed",
            )
