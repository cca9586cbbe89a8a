"""Keep-alive HTTP/1.1 connections to the broker's nodes, on the standard library alone.

A worker's every lease and ack is one small request answered in milliseconds, so what
the client spends per request bounds a worker at small batches. `http.client` takes
about a quarter of httpx's CPU for the same request (httpx's request, auth, redirect
and cookie layers run on every call), and needs no package. What a pool adds is kept
here: a connection per call in flight, reused afterwards unless the node closed it.
"""

from __future__ import annotations

import http.client
import json
import select
import ssl
import threading
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

USER_AGENT = "dejaq-client"
IDLE_PER_NODE = 16  # connections kept open per node between calls


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
        self._headers = {"user-agent": USER_AGENT, **headers}
        self._verify = verify
        self._tls: ssl.SSLContext | None = None  # made when an https node is first used
        self._idle: dict[Node, list[http.client.HTTPConnection]] = {}
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
    ) -> Response:
        """One request and its whole answer; `body` is sent as JSON. Raises `NotSent` or
        `Lost` when no answer came."""
        headers = dict(self._headers)
        data = None
        if body is not None:
            data = json.dumps(body, separators=(",", ":")).encode()
            headers["content-type"] = "application/json"
        conn = self._checkout(node, connect_timeout)
        try:
            conn.sock.settimeout(timeout)
            conn.request(method, node.prefix + path, data, headers)
            answer = conn.getresponse()
            content = answer.read()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise Lost(f"{type(e).__name__}: {e}") from e
        except BaseException:  # an interrupt mid-answer: the rest of it would come next
            conn.close()
            raise
        response = Response(
            answer.status,
            answer.reason,
            {name.lower(): value for name, value in answer.getheaders()},
            content,
        )
        if answer.will_close:
            conn.close()
        else:
            self._checkin(node, conn)
        return response

    def _checkout(self, node: Node, connect_timeout: float) -> http.client.HTTPConnection:
        """An idle connection to `node` the node has not closed meanwhile, or a new one."""
        while True:
            with self._lock:
                idle = self._idle.get(node)
                conn = idle.pop() if idle else None
            if conn is None:
                return self._connect(node, connect_timeout)
            if _still_open(conn):
                return conn
            conn.close()

    def _connect(self, node: Node, connect_timeout: float) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection
        if node.tls:
            if self._tls is None:
                self._tls = tls_context(self._verify)
            conn = http.client.HTTPSConnection(
                node.host, node.port, timeout=connect_timeout, context=self._tls
            )
        else:
            conn = http.client.HTTPConnection(node.host, node.port, timeout=connect_timeout)
        try:
            conn.connect()
        except OSError as e:  # refused, unreachable, timed out, a certificate refused
            conn.close()
            raise NotSent(f"{type(e).__name__}: {e}") from e
        return conn

    def _checkin(self, node: Node, conn: http.client.HTTPConnection) -> None:
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


def _still_open(conn: http.client.HTTPConnection) -> bool:
    """Whether an idle connection can carry a request: a node that closed it (an idle
    timeout, a restart) has made it readable (end of stream), as nothing else is due on
    it. Sent on such a connection, a request could not be told from one lost in flight."""
    sock = conn.sock
    if sock is None:
        return False
    try:
        if hasattr(select, "poll"):  # any descriptor number; select() stops at 1024
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            return not poller.poll(0)
        return not select.select([sock], [], [], 0)[0]
    except (OSError, ValueError):
        return False
