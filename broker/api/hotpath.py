"""The two hottest routes (lease, ack) answered without FastAPI's per-request machinery.

Routing, dependency injection and pydantic validation cost more CPU than leasing a
message does. This ASGI middleware answers a lease or ack on the leader when the request
is plainly valid (same limits as the models in `broker.routers`); anything else (a
follower, a new leader not yet `leading`, an unknown topic, a body needing coercion or
giving a validation error) goes to FastAPI untouched, body replayed, so errors,
forwarding and waiting for a new leader keep one implementation.

Bodies are parsed by orjson: a lease or ack body in ~0.3 µs, where `json.loads` takes
~2 µs, twice per message at batch 1. What orjson refuses and `json` would take (UTF-16,
NaN, a lone surrogate) goes to FastAPI, which answers it as it always did; so does an
integer past 64 bits, which orjson reads as a float.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson
from dejaq_core import Bodies

from dejaq.broker.api.dependencies import problem
from dejaq.broker.api.replayed_body import client_watch, read_body, replay
from dejaq.broker.api.routers._common import MAX_RECEIPT, MAX_REQUEST_ID
from dejaq.broker.service import Broker, Problem

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_ROUTE = re.compile(r"/v1/topics/([^/]+)/(leases|acks)")
_JSON = [(b"content-type", b"application/json")]
MAX_LEASE_MS = 12 * 3600 * 1000

# A lease's body parsed, checked as `LeaseRequest` checks it without coercion: its
# (consumer, max_messages, lease_ms, wait_ms), else None (`_lease_args` adds the
# request id, which the core knows nothing of). An ack's as `Settle`: its (consumer,
# ids or receipts, whether receipts), else None. In the compiled core (the same checks
# cost ~0.5 µs a request in Python).
_BODIES = Bodies(MAX_LEASE_MS, MAX_RECEIPT)
_ack_args = _BODIES.ack
_REQUEST_ID = re.compile(rf"[\x21-\x7e]{{1,{MAX_REQUEST_ID}}}")  # as `RequestId` takes it


class HotPath:
    """ASGI front of the app: lease and ack on the leader, straight to the broker."""

    def __init__(self, app: ASGIApp, broker: Broker) -> None:
        self.app, self.broker = app, broker

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        route = _ROUTE.fullmatch(scope["path"])
        raft = self.broker.raft
        if (
            route is None
            or route[1] not in self.broker.topics
            or raft is None
            or not raft.leading()
            or not _is_json(scope)
        ):
            return await self.app(scope, receive, send)
        body = await read_body(receive)
        parsed = _parsed(body)
        topic = route[1]
        try:
            if route[2] == "leases":
                args = _lease_args(parsed)
                if args is not None:
                    consumer, n, lease_ms, wait_ms, request = args
                    lease_ms = lease_ms or self.broker.conf.lease_ms
                    with client_watch(receive) as gone:
                        messages = await self.broker.lease(
                            topic, consumer, n, lease_ms, wait_ms, gone, request
                        )
                    return await _send(send, 200, b'{"messages": %s}' % messages)
            else:
                args = _ack_args(parsed)
                if args is not None:
                    result = await self.broker.settle(topic, "ack", *args)
                    settled = result.settled_or_409("acked")
                    return await _send(send, 200, b'{"settled":%d}' % settled)
        except Problem as e:
            response = problem(e.status, e.title, e.detail, **e.extra)
            return await response(scope, receive, send)
        await self.app(scope, replay(body, receive), send)


def _lease_args(
    parsed: Any,
) -> tuple[str, int, int | None, int, str | None] | None:
    """(consumer, max_messages, lease_ms, wait_ms, request_id) of a plainly valid lease
    body, else None: the request id checked here, the rest by the core (`Bodies.lease`),
    given the body without it."""
    request = None
    if type(parsed) is dict and "request_id" in parsed:
        parsed = dict(parsed)
        request = parsed.pop("request_id")
        if request is not None and (
            type(request) is not str or _REQUEST_ID.fullmatch(request) is None
        ):
            return None
    args = _BODIES.lease(parsed)
    return None if args is None else (*args, request)


def _parsed(body: bytes) -> Any:
    """The body as `json.loads` reads it, or None where orjson refuses it (FastAPI then
    reads and answers it). Where both read a body they agree, but for integers past 64
    bits, which orjson reads as floats: no valid lease or ack holds one."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


def _is_json(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"application/json"
    return False


async def _send(send: Send, status: int, body: bytes) -> None:
    headers = [*_JSON, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
