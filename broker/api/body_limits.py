"""Request bodies bounded as they arrive, for every route, before any layer reads one.

FastAPI reads and parses a body before a route's dependencies run, and the lease and ack
fast path reads it before FastAPI does: a limit checked there comes after the memory is
spent, and a chunked body, which has no Content-Length, would pass any check of that
header. Here a body announced larger than its route takes is refused unread; a chunked
one is read, counted as it comes, only up to that limit, then handed on as the server
would have (a body framed by its Content-Length cannot grow past it, and goes on as it
is). What a 413 leaves unread the server discards, keeping the connection, up to 1 MiB
(`http_server.DISCARD_MAX_BYTES`); then it closes it.

The limits: a produce or a schedule, one payload of the topic's `max_payload_bytes` in
base64 with room for the rest; a produce batch, `MAX_BATCH_BODY` or that if larger;
a request naming messages by id (acks, nacks, extensions, rejections, a redrive),
`IDS_BODY`; any other, `SMALL_BODY`.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from dejaq.broker.api.dependencies import problem
from dejaq.broker.api.replayed_body import read_body, replay
from dejaq.broker.service import Broker

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_BATCH_BODY = 16 * 1024 * 1024
# 1000 ids of up to 1000 characters, each as JSON may escape it.
IDS_BODY = 16 * 1024 * 1024
SMALL_BODY = 64 * 1024  # the least of every limit: a body within it passes unexamined
_SIZED = re.compile(
    r"/v1/topics/([^/]+)/"
    r"(messages|messages/batch|schedules|acks|nacks|extensions|rejections|dead-letters/redrive)"
)


def payload_body(max_payload_bytes: int) -> int:
    """The largest body carrying one payload: in base64, with room for the rest."""
    return max_payload_bytes * 4 // 3 + 64 * 1024


def largest_body(max_payload_bytes: int) -> int:
    """The largest body any route takes, for the node's `max_payload_bytes`."""
    return max(MAX_BATCH_BODY, IDS_BODY, payload_body(max_payload_bytes))


def body_limit(broker: Broker, method: str, path: str) -> int:
    """The largest body the route of `method` `path` takes."""
    route = _SIZED.fullmatch(path) if method == "POST" else None
    if route is None:
        return SMALL_BODY
    topic, what = route[1], route[2]
    if what in ("messages", "schedules", "messages/batch"):
        cfg = broker.topics.get(topic)
        most = broker.conf.max_payload_bytes
        one = payload_body(most if cfg is None else min(cfg.max_payload_bytes, most))
        return max(MAX_BATCH_BODY, one) if what == "messages/batch" else one
    return IDS_BODY


class BodyLimits:
    """ASGI front of the app: 413 for a body larger than its route takes."""

    def __init__(self, app: ASGIApp, broker: Broker) -> None:
        self.app, self.broker = app, broker

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = _content_length(scope)
        if length is not None and length <= SMALL_BODY:  # within every route's limit
            return await self.app(scope, receive, send)
        limit = body_limit(self.broker, scope["method"], scope["path"])
        if length is None:
            body = await read_body(receive, limit)
            if body is None:
                detail = f"more than {limit} bytes; the limit is {limit}"
                return await _refuse(scope, receive, send, detail)
            return await self.app(scope, replay(body, receive), send)
        if length > limit:
            return await _refuse(scope, receive, send, f"{length} bytes; the limit is {limit}")
        return await self.app(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    """The body's announced length; None if not announced (chunked) or not a number."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


async def _refuse(scope: Scope, receive: Receive, send: Send, detail: str) -> None:
    await problem(413, "request too large", detail)(scope, receive, send)
