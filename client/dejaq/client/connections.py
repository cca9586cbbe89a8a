"""Keep-alive HTTP/1.1 connections to the broker's nodes: requests written whole, answers
framed by httptools.

A worker's every lease and ack is one small request answered in milliseconds, so what
the client spends per request bounds a worker at small batches. `http.client` writes a
request's head and body in two system calls and parses every answer's headers with the
`email` package; here a request is one `sendall` and its answer is framed by httptools
(the C parser uvicorn uses), and a Worker spends about half the CPU per message it spent
over `http.client` at batch 1 (`bench/worker_client.py`). What a pool adds is kept here:
a connection per call in flight, reused afterwards unless either side closed it.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import re
import select
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httptools

USER_AGENT = "dejaq-client"
IDLE_PER_NODE = 16  # connections kept open per node between calls
READ_BYTES = 64 * 1024  # one `recv`: a lease's answer of 100 small messages in one or two
HEAD_MAX_BYTES = 64 * 1024  # an answer's status line and headers: the broker's are ~200
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # a header name (RFC 9110's token)
# Methods whose requests carry a body: without one they say so (content-length 0), as
# `http.client` does, or some servers wait for one.
_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})


class NotSent(Exception):
    """The request did not leave: no connection (refused, unreachable, timed out, TLS
    refused). Sending it elsewhere is safe."""


class Lost(Exception):
    """The request was sent, or may have been, and no whole answer came: it may have been
    applied."""


@dataclass
class Response:
    """A whole answer: status, headers (names in lower case) and body."""

    status_code: int
    reason_phrase: str
    headers: dict[str, str] = field(repr=False)
    content: bytes = field(repr=False)

    @property
    def is_success(self) -> bool:
        return 200 <= self.status_code < 300

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.content)


@dataclass(frozen=True)
class Node:
    """Where a node's base URL points: scheme, host, port and path prefix."""

    tls: bool
    host: str
    port: int
    prefix: str

    @classmethod
    def parse(cls, url: str) -> Node:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r}: a node is http(s)://host[:port][/prefix]")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)  # a port that is no number raises here
        return cls(tls, parts.hostname, port, parts.path.rstrip("/"))

    @functools.cached_property
    def loopback(self) -> bool:
        """Whether only this machine is reached: `localhost`, 127.0.0.0/8 or ::1. No name
        is resolved, as what a name resolves to may change after the check."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    @functools.cached_property
    def host_header(self) -> str:
        """The `host` a request names: the port only if not the scheme's own."""
        host = f"[{self.host}]" if ":" in self.host else self.host.encode("idna").decode()
        return host if self.port == (443 if self.tls else 80) else f"{host}:{self.port}"


def tls_context(verify: bool | str | ssl.SSLContext) -> ssl.SSLContext:
    """How `https://` nodes are checked: the system's CAs (True), a CA file, a context of
    the caller's, or not at all (False)."""
    if isinstance(verify, ssl.SSLContext):
        return verify
    if isinstance(verify, str):
        return ssl.create_default_context(cafile=verify)
    context = ssl.create_default_context()
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


class Connections:
    """Open connections by node, each used by one call at a time. Thread-safe."""

    def __init__(self, headers: dict[str, str], verify: bool | str | ssl.SSLContext) -> None:
        fixed = {"user-agent": USER_AGENT, **headers}
        for name, value in fixed.items():  # a token pasted with its newline, or worse
            if not _is_token(name) or any(c in value for c in "\r\n\0"):
                raise ValueError(f"header {name!r}: not a valid HTTP header")
        # The headers every request carries, as they go out.
        self._fixed = "".join(f"{name}: {value}\r\n" for name, value in fixed.items())
        self._verify = verify
        self._tls: ssl.SSLContext | None = None  # made when an https node is first used
        self._idle: dict[Node, list[Connection]] = {}
        self._lock = threading.Lock()
        self._closed = False

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
        """One request and its whole answer; `body` is sent as JSON. `timeout` bounds each
        wait for the node's next bytes (an answer that keeps flowing is not cut), `until`
        (monotonic) the whole exchange, however the node paces them. Raises `NotSent` or
        `Lost` when no answer came."""
        target = node.prefix + path
        if not target.isprintable() or " " in target or not target.isascii():
            raise ValueError(f"{target!r}: not a request target (quote it)")
        head = f"{method} {target} HTTP/1.1\r\nhost: {node.host_header}\r\n{self._fixed}"
        if body is not None:
            data = json.dumps(body, separators=(",", ":")).encode()
            head += f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n"
            request = head.encode("latin-1") + data
        else:
            head += "content-length: 0\r\n\r\n" if method in _WITH_BODY else "\r\n"
            request = head.encode("latin-1")
        conn = self._checkout(node, connect_timeout)
        try:
            response, reusable = conn.exchange(request, timeout, until)
        except (OSError, httptools.HttpParserError, _Malformed) as e:
            conn.close()
            raise Lost(f"{type(e).__name__}: {e}") from e
        except BaseException:  # an interrupt mid-answer: the rest of it would come next
            conn.close()
            raise
        if reusable:
            self._checkin(node, conn)
        else:
            conn.close()
        return response

    def _checkout(self, node: Node, connect_timeout: float) -> Connection:
        """An idle connection to `node` the node has not closed meanwhile, or a new one."""
        while True:
            with self._lock:
                idle = self._idle.get(node)
                conn = idle.pop() if idle else None
            if conn is None:
                return self._connect(node, connect_timeout)
            if _still_open(conn.sock):
                return conn
            conn.close()

    def _connect(self, node: Node, connect_timeout: float) -> Connection:
        try:
            sock = socket.create_connection((node.host, node.port), connect_timeout)
        except OSError as e:  # refused, unreachable, timed out
            raise NotSent(f"{type(e).__name__}: {e}") from e
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if node.tls:
            if self._tls is None:
                self._tls = tls_context(self._verify)
            try:
                sock = self._tls.wrap_socket(sock, server_hostname=node.host)
            except OSError as e:  # the handshake refused or timed out, a certificate refused
                sock.close()
                raise NotSent(f"{type(e).__name__}: {e}") from e
        return Connection(sock)

    def _checkin(self, node: Node, conn: Connection) -> None:
        with self._lock:
            idle = self._idle.setdefault(node, [])
            if not self._closed and len(idle) < IDLE_PER_NODE:
                idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        """Close the idle connections; those of calls in flight close as they end."""
        with self._lock:
            self._closed = True
            idle = [c for conns in self._idle.values() for c in conns]
            self._idle.clear()
        for conn in idle:
            conn.close()


class _Malformed(Exception):
    """An answer that is not one: headers past HEAD_MAX_BYTES, or cut off by the node."""


class Connection:
    """One connection to a node: a request is written whole, and its answer read until
    httptools has parsed it whole. The parser's callbacks below fill the answer in."""

    __slots__ = (
        "_answer",
        "_body",
        "_head_bytes",
        "_headed",
        "_headers",
        "_keep",
        "_more",
        "_parser",
        "_reason",
        "sock",
    )

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._parser: httptools.HttpResponseParser | None = None
        self._answer: Response | None = None
        self._keep = False  # the answer lets the connection carry another request
        self._more = False  # bytes came after the answer: the connection is not reused
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._reason = ""
        self._head_bytes = 0
        self._headed = False

    def exchange(self, request: bytes, timeout: float, until: float) -> tuple[Response, bool]:
        """Send `request`, read its answer: (the answer, whether the connection can carry
        another request). Each read waits `timeout`, and no later than `until`: a node
        sending a byte now and then would otherwise hold the call for ever."""
        sock = self.sock
        sock.settimeout(_wait(timeout, until))
        sock.sendall(request)
        parser = self._parser = httptools.HttpResponseParser(self)
        self._answer, self._more = None, False
        while self._answer is None:
            sock.settimeout(_wait(timeout, until))
            data = sock.recv(READ_BYTES)
            if not data:
                return self._ended(parser), False
            parser.feed_data(data)
        return self._answer, self._keep and not self._more

    def _ended(self, parser: httptools.HttpResponseParser) -> Response:
        """The node closed the connection before the answer was whole: an answer with
        neither a length nor chunks ends so (its body is what came); any other is cut."""
        headers = self._headers
        if (
            not self._headed
            or "content-length" in headers
            or "chunked" in headers.get("transfer-encoding", "").lower()
        ):
            raise _Malformed("the node closed the connection mid-answer")
        return Response(parser.get_status_code(), self._reason, headers, b"".join(self._body))

    # httptools' callbacks, in the order it calls them

    def on_message_begin(self) -> None:
        if self._answer is not None:
            self._more = True
            return
        self._headers, self._body, self._reason = {}, [], ""
        self._head_bytes, self._headed = 0, False

    def on_status(self, reason: bytes) -> None:
        self._reason += reason.decode("latin-1")

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._answer is not None:
            return
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > HEAD_MAX_BYTES:
            raise _Malformed(f"the answer's headers pass {HEAD_MAX_BYTES} bytes")
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self._headed = True

    def on_body(self, body: bytes) -> None:
        if self._answer is None:
            self._body.append(body)

    def on_message_complete(self) -> None:
        assert self._parser is not None
        status = self._parser.get_status_code()
        if self._answer is None and not 100 <= status < 200:  # not an interim answer
            self._answer = Response(status, self._reason, self._headers, b"".join(self._body))
            # Asked now: once the message is done the parser is set for the next one.
            self._keep = self._parser.should_keep_alive()

    def close(self) -> None:
        self.sock.close()


def _wait(timeout: float, until: float) -> float:
    """`timeout`, or the seconds left until `until` (monotonic) if fewer; TimeoutError
    once none are."""
    left = until - time.monotonic()
    if left <= 0:
        raise TimeoutError("no whole answer by the call's deadline")
    return min(timeout, left)


def _is_token(name: str) -> bool:
    """An HTTP header name: visible ASCII, no separators."""
    return _TOKEN.fullmatch(name) is not None


def _still_open(sock: socket.socket) -> bool:
    """Whether an idle connection can carry a request: a node that closed it (an idle
    timeout, a restart) has made it readable (end of stream), as nothing else is due on
    it. Sent on such a connection, a request could not be told from one lost in flight."""
    try:
        if hasattr(select, "poll"):  # any descriptor number; select() stops at 1024
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            return not poller.poll(0)
        return not select.select([sock], [], [], 0)[0]
    except (OSError, ValueError):
        return False
