"""Who may call what: API keys as bearer tokens, a role per route, on the route's topic.

An ASGI layer in front of the whole app (the lease and ack fast path included), so no
route can be reached around it: a route missing from `ROUTES` needs a valid key and no
role, and a test holds every route of the OpenAPI to an entry here. Health, readiness
and the API's own docs stay open; `/metrics` needs `monitor` unless configured open.

A follower authorizes a request once and forwards it with a tag only the cluster's
nodes can make (an HMAC under the Raft password of the follower's HTTP address); the
leader takes a forward with a valid tag, and from nobody else, whatever headers a client
sends. The tag alone proves the sender a node: a node that has just started forwards
before its address is in the replicated state, and must not be refused for it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from dejaq.broker.api.keys import KeyRing

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]

FORWARDED = "x-dejaq-forwarded"
_FORWARDED = FORWARDED.encode()
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/docs", "/openapi.json"})
OPEN_PREFIX = "/docs-assets/"
METRICS = "/metrics"
BEARER = "bearer"

# (method, path, role): the role a key needs on the path's {topic}, or on any topic for
# topic-less paths; None: any valid key (the list of topics' names).
ROUTES: tuple[tuple[str, str, str | None], ...] = (
    ("GET", "/v1/topics", None),
    ("GET", "/v1/topics/{topic}", "read"),
    ("POST", "/v1/topics/{topic}/messages", "produce"),
    ("POST", "/v1/topics/{topic}/messages/batch", "produce"),
    ("GET", "/v1/topics/{topic}/messages/{message_id}", "read"),
    ("DELETE", "/v1/topics/{topic}/messages/{message_id}", "operate"),
    ("PATCH", "/v1/topics/{topic}/messages/{message_id}", "operate"),
    ("POST", "/v1/topics/{topic}/leases", "consume"),
    ("POST", "/v1/topics/{topic}/acks", "consume"),
    ("POST", "/v1/topics/{topic}/nacks", "consume"),
    ("POST", "/v1/topics/{topic}/extensions", "consume"),
    ("POST", "/v1/topics/{topic}/rejections", "consume"),
    ("POST", "/v1/topics/{topic}/consumers/{consumer_id}/heartbeat", "consume"),
    ("DELETE", "/v1/topics/{topic}/consumers/{consumer_id}", "consume"),
    ("POST", "/v1/topics/{topic}/schedules", "operate"),
    ("GET", "/v1/topics/{topic}/schedules", "operate"),
    ("GET", "/v1/topics/{topic}/schedules/{schedule_id}", "operate"),
    ("DELETE", "/v1/topics/{topic}/schedules/{schedule_id}", "operate"),
    ("POST", "/v1/topics/{topic}/pause", "operate"),
    ("POST", "/v1/topics/{topic}/resume", "operate"),
    ("POST", "/v1/topics/{topic}/purge", "operate"),
    ("POST", "/v1/topics/{topic}/dead-letters/redrive", "operate"),
    ("GET", "/v1/topics/{topic}/dead-letters", "read"),
    ("GET", "/v1/topics/{topic}/quarantine", "read"),
    ("GET", "/v1/cluster", "monitor"),
    ("GET", METRICS, "monitor"),
)


def _compile(path: str) -> re.Pattern[str]:
    pattern = re.sub(r"\{(\w+)\}", lambda m: f"(?P<{m[1]}>[^/]+)", path)
    return re.compile(pattern)


_BY_METHOD: dict[str, list[tuple[re.Pattern[str], str | None]]] = {}
for _method, _path, _role in ROUTES:
    _BY_METHOD.setdefault(_method, []).append((_compile(_path), _role))


def required(method: str, path: str) -> tuple[str | None, str | None]:
    """(role, topic) a request needs; (None, None) for a path no route has."""
    for pattern, role in _BY_METHOD.get(method, ()):
        match = pattern.fullmatch(path)
        if match is not None:
            return role, match.groupdict().get("topic")
    return None, None


def forward_tag(password: str, sender: str) -> str:
    """What a node sends as `FORWARDED` when it passes a request on to the leader."""
    mac = hmac.new(password.encode(), f"dejaq-forward {sender}".encode(), hashlib.sha256)
    return f"{sender} {mac.hexdigest()}"


class Guard:
    """The ASGI app in front of the broker's: authenticates, then authorizes by role."""

    def __init__(
        self,
        app: ASGIApp,
        keys: KeyRing,
        password: str | None,
        metrics_open: bool = False,
    ) -> None:
        """`password`: the Raft password, under which nodes tag their forwards."""
        self.app, self.keys, self.password = app, keys, password
        self.metrics_open = metrics_open

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path: str = scope["path"]
        if path in OPEN_PATHS or path.startswith(OPEN_PREFIX):
            return await self.app(scope, receive, send)
        if path == METRICS and self.metrics_open:
            return await self.app(scope, receive, send)
        authorization = forwarded = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value
            elif name == _FORWARDED:
                forwarded = value
        if forwarded is not None:
            if self._from_node(forwarded):
                return await self.app(scope, receive, send)  # authorized where it arrived
            return await _refuse(
                send, 401, "not a cluster node", "forwarded requests are taken from nodes only"
            )
        role, topic = required(scope["method"], path)
        needs = f"; this call needs {_grant(role, topic)}" if role is not None else ""
        scheme, _, token = (authorization or b"").decode("latin-1").partition(" ")
        if scheme.lower() != BEARER or not token.strip():  # auth schemes ignore case
            return await _refuse(
                send, 401, "API key required", f"send 'Authorization: Bearer <key>'{needs}"
            )
        key = self.keys.authenticate(token.strip())
        if key is None:
            return await _refuse(send, 401, "invalid API key", f"unknown or revoked key{needs}")
        if role is not None and not key.allows(role, topic):
            detail = f"this key lacks {_grant(role, topic)}"
            return await _refuse(send, 403, "role required", detail)
        return await self.app(scope, receive, send)

    def _from_node(self, forwarded: bytes) -> bool:
        sender, _, _ = forwarded.decode("latin-1").partition(" ")
        if self.password is None or not sender:
            return False
        expected = forward_tag(self.password, sender).encode("latin-1")
        return hmac.compare_digest(expected, forwarded)


def _grant(role: str, topic: str | None) -> str:
    """`role 'consume' on topic 'orders'`: what a 401 or 403 says is missing."""
    return f"role '{role}'" + (f" on topic '{topic}'" if topic is not None else "")


async def _refuse(send: Any, status: int, title: str, detail: str) -> None:
    body = json.dumps(
        {"type": "about:blank", "title": title, "status": status, "detail": detail}
    ).encode()
    headers = [
        (b"content-type", b"application/problem+json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="dejaq"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
