"""Who may call what: API keys as bearer tokens, a role per route, on the route's topic.

An ASGI layer in front of the whole app (the lease and ack fast path included), so no
route can be reached around it: a route missing from `ROUTES` needs a valid key and no
role, and a test holds every route of the OpenAPI to an entry here. Health, readiness
and the API's own docs stay open; `/metrics` needs `monitor` unless configured open.
The topic-less `monitor` routes show a key the per-topic parts of its own topics only
(`monitored`).

A follower authorizes a request once and forwards it with a tag only the cluster's
nodes can make (an HMAC, under a key stretched from the Raft password as slowly as
Raft's own, of the follower's HTTP address, the time, a nonce, and the request's
method, path, query and body); a tag seen on the wire costs a password guess as much
as Raft's traffic does. The leader reads a forward's body only if its tag is well
formed and timely, and at most `max_body` of it, so a caller without a key cannot make
a node hold a body of any size. The leader takes a
forward with a valid tag, and from nobody else, whatever headers a client sends. A tag
seen on the wire opens no other request, and not that one again: the leader takes each
nonce once, within `FORWARD_TTL_MS` of its time (the nodes' clocks agree within it).
The tag alone proves the sender a node: a node that has just started forwards before
its address is in the replicated state, and must not be refused for it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from functools import lru_cache
from typing import Any
from urllib.parse import quote

from dejaq.broker.api.keys import Key, KeyRing
from dejaq.broker.api.replayed_body import read_body, replay

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]

KEY = "dejaq.key"  # the scope's entry for the caller's key, once authorized
FORWARDED = "x-dejaq-forwarded"
_FORWARDED = FORWARDED.encode()
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/docs", "/openapi.json"})
OPEN_PREFIX = "/docs-assets/"
METRICS = "/metrics"
BEARER = "bearer"
FORWARD_TTL_MS = 60_000
FORWARD_ROUNDS = 100_000  # PBKDF2's, as PySyncObj's for the Raft traffic's key
# A tag's time: ASCII digits, few enough for int() (not "1²", nor 5,000 digits).
_EPOCH_MS = re.compile(r"[0-9]{1,15}")

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


# Path parameters that may hold "/" (message ids come from producers, consumer ids from
# workers): their routes take the rest of the path (`{message_id:path}`), and so does
# their pattern here, so a request is matched to the route that serves it.
SLASHED = frozenset({"message_id", "consumer_id"})


def _compile(path: str) -> re.Pattern[str]:
    def group(m: re.Match[str]) -> str:
        return f"(?P<{m[1]}>{'.*' if m[1] in SLASHED else '[^/]+'})"

    return re.compile(re.sub(r"\{(\w+)\}", group, path))


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


def forward_tag(
    password: str,
    sender: str,
    method: str,
    target: str,
    body: bytes,
    at_ms: int | None = None,
    nonce: str | None = None,
) -> str:
    """What a node sends as `FORWARDED` when it passes a request (`method`, `target`: its
    path and query, `body`) on to the leader: `sender at_ms nonce mac`, now and a fresh
    nonce unless given."""
    at_ms = int(time.time() * 1000) if at_ms is None else at_ms
    nonce = secrets.token_hex(12) if nonce is None else nonce
    signed = f"dejaq-forward {sender} {at_ms} {nonce} {method} {target} "
    signed += hashlib.sha256(body).hexdigest()
    mac = hmac.new(forward_key(password), signed.encode(), hashlib.sha256)
    return f"{sender} {at_ms} {nonce} {mac.hexdigest()}"


@lru_cache(maxsize=4)
def forward_key(password: str) -> bytes:
    """The forwards' HMAC key: PBKDF2 of the password, as many rounds as PySyncObj
    stretches it for Raft's traffic, under a salt of its own, once per process."""
    return hashlib.pbkdf2_hmac("sha256", password.encode(), b"dejaq-forward", FORWARD_ROUNDS)


def target_of(scope: Scope) -> bytes:
    """A request's path and query as they came on the wire, still percent-encoded: what
    a follower forwards and a forward's tag signs. The decoded path would be decoded
    again where it arrives, naming another route or message than the one authorized."""
    raw: bytes | None = scope.get("raw_path")
    if raw is None:
        raw = quote(scope["path"]).encode("ascii")
    query: bytes = scope.get("query_string", b"")
    return raw + b"?" + query if query else raw


class Guard:
    """The ASGI app in front of the broker's: authenticates, then authorizes by role."""

    def __init__(
        self,
        app: ASGIApp,
        keys: KeyRing,
        password: str | None,
        max_body: int,
        metrics_open: bool = False,
    ) -> None:
        """`password`: the Raft password, under which nodes tag their forwards;
        `max_body`: the largest body a route takes."""
        self.app, self.keys, self.password = app, keys, password
        self.metrics_open, self.max_body = metrics_open, max_body
        # The nonces of the forwards taken, each kept until its tag could no longer pass.
        self._nonces: set[str] = set()
        self._expiries: deque[tuple[float, str]] = deque()

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
            body = await read_body(receive, self.max_body) if self._timely(forwarded) else b""
            if body is None:
                return await _refuse(send, 413, "request too large", f"over {self.max_body} bytes")
            target = target_of(scope).decode("latin-1")
            if self._from_node(forwarded, scope["method"], target, body):
                # Authorized where it arrived; a body cut short by its sender fails the tag.
                return await self.app(scope, replay(body, receive), send)
            return await _refuse(
                send,
                401,
                "not a cluster node",
                "forwarded requests are taken from nodes only, each once, within "
                f"{FORWARD_TTL_MS // 1000} s of its tag",
            )
        role, topic = required(scope["method"], path)
        needs = f"; this call needs {_grant(role, topic)}" if role is not None else ""
        scheme, _, token = (authorization or b"").decode("latin-1").partition(" ")
        if scheme.lower() != BEARER or not token.strip():  # auth schemes ignore case
            return await _refuse(
                send, 401, "API key required", f"send 'Authorization: Bearer <key>'{needs}"
            )
        key = self.keys.authenticate(token.strip())
        if key is None and self.keys.error is not None:
            detail = "this node cannot read its key file (its log and /readyz say why)"
            return await _refuse(send, 503, "API keys unavailable", detail)
        if key is None:
            return await _refuse(send, 401, "invalid API key", f"unknown or revoked key{needs}")
        if role is not None and not key.allows(role, topic):
            detail = f"this key lacks {_grant(role, topic)}"
            return await _refuse(send, 403, "role required", detail)
        scope[KEY] = key
        return await self.app(scope, receive, send)

    def _timely(self, forwarded: bytes) -> bool:
        """Whether a forward's tag is well formed and within `FORWARD_TTL_MS` of now:
        checked before its body is read."""
        parts = forwarded.decode("latin-1").split(" ")
        if self.password is None or len(parts) != 4 or not _EPOCH_MS.fullmatch(parts[1]):
            return False
        return abs(time.time() * 1000 - int(parts[1])) <= FORWARD_TTL_MS

    def _from_node(self, forwarded: bytes, method: str, target: str, body: bytes) -> bool:
        """Whether a node tagged this very request, lately, and it was not taken before."""
        if not self._timely(forwarded):
            return False
        sender, at, nonce, _ = forwarded.decode("latin-1").split(" ")
        expected = forward_tag(self.password, sender, method, target, body, int(at), nonce)
        if not hmac.compare_digest(expected.encode("latin-1"), forwarded):
            return False
        return self._first(nonce)

    def _first(self, nonce: str) -> bool:
        """Note a forward's nonce; False if taken before (a replay). Nonces are kept while
        their tag could pass the time check: twice the TTL, for clocks either way."""
        now = time.monotonic()
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:
            self._nonces.discard(expiries.popleft()[1])
        if nonce in self._nonces:
            return False
        self._nonces.add(nonce)
        expiries.append((now + 2 * FORWARD_TTL_MS / 1000, nonce))
        return True


def monitored(scope: Scope) -> Callable[[str], bool]:
    """Which topics a topic-less `monitor` route (`/metrics`, `/v1/cluster`) shows the
    caller: those its key's `monitor` grants name. Every topic where no key was asked
    (keys off, `/metrics` configured open)."""
    key: Key | None = scope.get(KEY)
    if key is None:
        return lambda topic: True
    return lambda topic: key.allows("monitor", topic)


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
