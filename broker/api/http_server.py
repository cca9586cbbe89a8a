"""The HTTP server the broker runs: uvicorn on uvloop and httptools, one write per response.

uvicorn writes a response's head and body to the socket separately: two `send` calls,
two TCP segments, and two reads on the client for every lease and ack. At batch 1 those
two syscalls were a sixth of the leader's CPU (py-spy of a live 3-node run, 64
workers). Here each connection's writes are gathered while the event loop runs its
ready callbacks and sent as one at the end of that pass: a response goes out whole,
and nothing waits for a later event. Checked against the pinned uvicorn, whose
protocol class it extends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

UVICORN_VERSION = "0.54.0"
if uvicorn.__version__ != UVICORN_VERSION:
    raise ImportError(
        f"broker.http_server extends uvicorn {UVICORN_VERSION}'s httptools protocol; "
        f"found {uvicorn.__version__}: check it against that release, then the pin"
    )


class GatheringTransport:
    """A transport whose writes within one event-loop pass reach the socket as one.

    Everything but writing and closing is the wrapped transport's own (flow control,
    addresses, `is_closing`). `close` and `write_eof` send what is gathered first, as a
    transport sends its buffer before closing; `abort` drops it, as a transport does.
    """

    __slots__ = ("_loop", "_pending", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self._flush)
        self._pending.append(data)

    def _flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def writelines(self, chunks: list[bytes]) -> None:
        for data in chunks:
            self.write(data)

    def write_eof(self) -> None:
        self._flush()
        self._transport.write_eof()

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


# How long a request's head (request line and headers) may take to arrive, from the
# connection's opening or the request's first byte; and how large it may be. uvicorn
# bounds neither (its idle timer starts after a first answer): a connection that never
# finishes its head, or one sending headers without end, would be held for ever.
HEAD_TIMEOUT_S = 5.0
HEAD_MAX_BYTES = 64 * 1024
# How long a request's body may go without a byte arriving while the server reads it
# (as nginx's `client_body_timeout`): a body that stops short of its length would hold
# its connection, and the request's task, for ever. A slow body that keeps coming, or
# one the app is not reading yet, is not cut.
BODY_IDLE_S = 30.0
# How much of a body answered before it was read whole (a 413) the server reads on and
# discards, keeping the connection for the client's next request; past it, the
# connection is closed rather than read for as long as the client sends.
DISCARD_MAX_BYTES = 1024 * 1024
_HEAD_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"content-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\n"
    b"content-length: %d\r\n\r\n%s"
)


# The header of a 503 that applied nothing (a node starting, a node full): the client
# sends the request to another node, whatever the request (`dejaq.client.api`).
NOT_APPLIED = "dejaq-not-applied"
# Requests answered beyond the connection cap: the probes and the metrics, so a node that
# holds its most long polls is neither restarted as dead nor left unwatched.
PROBES = frozenset({b"/healthz", b"/readyz", b"/metrics"})
# Connections held beyond the cap for those; a connection past them is answered 503 and
# closed as it opens, so idle connections cannot take the node's last file descriptors.
PROBE_ROOM = 64
FULL_WARNING_EVERY_S = 60.0
_log = logging.getLogger("dejaq.broker.http")
_full_warned_at = -FULL_WARNING_EVERY_S


def _full(cap: int) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The headers and body of the 503 for a request beyond the connection cap."""
    body = json.dumps(
        {
            "type": "about:blank",
            "title": "node full",
            "status": 503,
            "detail": f"this node holds its most HTTP connections ({cap}): retry shortly, "
            "or ask another node",
        }
    ).encode()
    headers = [
        (b"content-type", b"application/problem+json"),
        (b"content-length", b"%d" % len(body)),
        (b"retry-after", b"1"),
        (NOT_APPLIED.encode(), b"connections"),
        (b"connection", b"close"),
    ]
    return headers, body


def _warn_full(cap: int) -> None:
    """Log that the cap refuses requests, at most every FULL_WARNING_EVERY_S: once per
    request would flood the log just when the node is busiest."""
    global _full_warned_at
    now = time.monotonic()
    if now - _full_warned_at >= FULL_WARNING_EVERY_S:
        _full_warned_at = now
        _log.warning(
            "%d HTTP connections open: requests beyond them answered 503 (README: "
            "Operations, connections)",
            cap,
        )


class HeadTooLarge(Exception):
    """A request's head passed HEAD_MAX_BYTES: answered 431, the connection closed."""


class GatheringHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol over a `GatheringTransport`, with a request's head
    bounded in time and size, and its body in idle time, and the server's connections
    capped by uvicorn's `limit_concurrency`.

    A connection opened within the cap is served for as long as it stays open: a burst of
    new or idle ones must not turn away the workers already served, whose acks a 503
    would delay past their leases. A request on a connection opened past the cap gets a
    503 that applied nothing (and the connection closes), unless the node is back within
    the cap or it is a probe's, answered up to PROBE_ROOM connections further; past those
    a connection gets the 503 as it opens. (uvicorn's own check would answer the probes
    503 too.)

    A request notes when its head began and when its body last moved, and one timer per
    connection looks at both: a timer armed and cancelled per request would cost each
    lease and ack more than the look does."""

    _head_since: float | None = None  # loop time a head began, None between heads
    _head_bytes = 0
    _body_at: float | None = None  # loop time its body last moved, None unless arriving
    _discarded = 0  # bytes of the body arriving after its answer (`DISCARD_MAX_BYTES`)
    _look_due: asyncio.TimerHandle | None = None
    _admitted = True  # opened within the connection cap

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_connections: int | None = self.limit_concurrency
        self.limit_concurrency = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        gathering: Any = GatheringTransport(transport, self.loop)
        super().connection_made(gathering)
        cap = self.max_connections
        self._admitted = cap is None or len(self.connections) <= cap
        if cap is not None and len(self.connections) > cap + PROBE_ROOM:
            _warn_full(cap)
            headers, body = _full(cap)
            head = b"".join(b"%s: %s\r\n" % h for h in headers)
            gathering.write(b"HTTP/1.1 503 Service Unavailable\r\n%s\r\n%s" % (head, body))
            gathering.close()
            return
        self._head_since = self.loop.time()
        self._look_due = self.loop.call_later(HEAD_TIMEOUT_S, self._look)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._look_due is not None:
            self._look_due.cancel()
            self._look_due = None
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = self._discarded = 0
        self._head_since = self.loop.time()

    def on_url(self, url: bytes) -> None:
        self._head_bytes += len(url)
        if self._head_bytes > HEAD_MAX_BYTES:
            raise HeadTooLarge(f"a request's head passed {HEAD_MAX_BYTES} bytes")
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > HEAD_MAX_BYTES:
            raise HeadTooLarge(f"a request's head passed {HEAD_MAX_BYTES} bytes")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_since = None
        self._body_at = self.loop.time()
        cap = self.max_connections
        if (
            cap is None
            or self._admitted
            or len(self.connections) <= cap
            or self.url.split(b"?")[0] in PROBES
        ):
            return super().on_headers_complete()
        _warn_full(cap)
        app, self.app = self.app, _FullApp(cap)
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def on_body(self, body: bytes) -> None:
        self._body_at = self.loop.time()
        if self.cycle.response_complete:
            self._discarded += len(body)
            if self._discarded > DISCARD_MAX_BYTES and not self.transport.is_closing():
                self.transport.close()
            return
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._body_at = None
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request it cannot parse; 431 for a head too large."""
        if self._head_bytes <= HEAD_MAX_BYTES:
            return super().send_400_response(msg)
        text = f"A request's head is limited to {HEAD_MAX_BYTES} bytes.".encode()
        self.transport.write(_HEAD_TOO_LARGE % (len(text), text))
        self.transport.close()

    def _look(self) -> None:
        """Close the connection if a head has been arriving for HEAD_TIMEOUT_S, or a body
        has not moved for BODY_IDLE_S, else look again when either could be late."""
        now = self.loop.time()
        head, body = self._head_since, self._body_at
        if body is not None and self.flow.read_paused:  # the app is not reading it yet
            body = self._body_at = now
        if (head is not None and now - head >= HEAD_TIMEOUT_S) or (
            body is not None and now - body >= BODY_IDLE_S
        ):
            self._look_due = None
            if not self.transport.is_closing():
                self.transport.close()
            return
        wait = HEAD_TIMEOUT_S if head is None else head + HEAD_TIMEOUT_S - now
        if body is not None:
            wait = min(wait, body + BODY_IDLE_S - now)
        self._look_due = self.loop.call_later(wait, self._look)


class Server(uvicorn.Server):
    """uvicorn's server, leaving SIGTERM and SIGINT to its caller. uvicorn's own handlers
    raise the signal again once the server has shut down, which ends the process before
    the caller stops what runs beside the server (a node's Raft and duties); the caller
    sets `should_exit` on a signal instead (`jobs.broker`)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class _FullApp:
    """The ASGI app of a request beyond the connection cap: its 503, the body unread."""

    def __init__(self, cap: int) -> None:
        self.cap = cap

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        headers, body = _full(self.cap)
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})


# uvicorn's settings for the broker, and for the benchmark's baselines, like for like.
SETTINGS: dict[str, Any] = {
    "loop": "uvloop",
    "http": GatheringHttpToolsProtocol,
    "log_level": "warning",
    "access_log": False,
}
