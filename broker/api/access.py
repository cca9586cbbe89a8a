"""Who may call what: API keys as bearer tokens, a role per route, on the route's topic.

An ASGI layer in front of the whole app (the lease and ack fast path included), so no
route can be reached around it: a route missing from `ROUTES` needs a valid key and no
role, and a test holds every route of the OpenAPI to an entry here. Health, readiness
and the API's own docs stay open; `/metrics` needs `monitor` unless configured open.
The topic-less `monitor` routes show a key the per-topic parts of its own topics only
(`monitored`).

A follower authenticates a request and forwards it with a tag only the cluster's nodes
can make (an HMAC, under a key stretched from the Raft password as slowly as Raft's own,
of the follower's HTTP address, the time, a nonce, the id of the key it let the caller
in with, and the request's method, path, query, body length and body SHA-256); a tag
seen on the wire costs a password guess as much as Raft's traffic does. The leader
checks a tag before it reads a byte of the body, then reads no more than the length the
tag names and holds the body to its digest, so a caller without a key cannot make a
node read or hash a body. The leader takes a forward with a valid tag, and from nobody
else, whatever headers a client sends; it checks the key the tag names against its own
key file, with the route's role on its topic, and refuses a forward from a node that
let its caller in without a key (a node without a key file). A tag seen on the wire
opens no other request, and not that one again: the leader takes each nonce once,
within `FORWARD_TTL_MS` of its time (the nodes' clocks agree within it). The tag alone
proves the sender a node: a node that has just started forwards before its address is
in the replicated state, and must not be refused for it.
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
from dataclasses import dataclass
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
# A tag's time and length: ASCII digits, few enough for int() (not "1²", nor 5,000 digits).
_DIGITS = re.compile(r"[0-9]{1,15}")
# A forward's key field where the sending node let its caller in without a key.
NO_KEY = "-"
NOT_A_NODE = "not a cluster node"

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
    key: str | None = None,
    at_ms: int | None = None,
    nonce: str | None = None,
) -> str:
    """What a node sends as `FORWARDED` when it passes a request (`method`, `target`: its
    path and query, `body`) on to the leader, let in with the key of id `key` (None: no
    key): `sender at_ms nonce key length sha256 mac`, now and a fresh nonce unless
    given. The length and digest let the leader check the tag before reading the body."""
    at_ms = int(time.time() * 1000) if at_ms is None else at_ms
    nonce = secrets.token_hex(12) if nonce is None else nonce
    fields = (sender, str(at_ms), nonce, key or NO_KEY, str(len(body)), _sha256(body))
    return " ".join((*fields, _mac(password, fields, method, target)))


def _sha256(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _mac(password: str, fields: tuple[str, ...], method: str, target: str) -> str:
    """The HMAC of a tag's fields with the request's method and target."""
    signed = " ".join(("dejaq-forward", *fields, method, target))
    return hmac.new(forward_key(password), signed.encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Tag:
    """A forward's tag as sent: what it claims, not yet checked."""

    sender: str
    at_ms: int
    nonce: str
    key: str
    length: int
    digest: str
    mac: str

    @classmethod
    def parse(cls, forwarded: bytes) -> Tag | None:
        """The tag's fields, or None if it is not of `forward_tag`'s form."""
        parts = forwarded.decode("latin-1").split(" ")
        if len(parts) != 7 or not (_DIGITS.fullmatch(parts[1]) and _DIGITS.fullmatch(parts[4])):
            return None
        sender, at, nonce, key, length, digest, mac = parts
        return cls(sender, int(at), nonce, key, int(length), digest, mac)

    def signed_by(self, password: str, method: str, target: str) -> bool:
        """Whether a holder of `password` made this tag for `method` `target`."""
        fields = (self.sender, str(self.at_ms), self.nonce, self.key, str(self.length))
        expected = _mac(password, (*fields, self.digest), method, target)
        return hmac.compare_digest(expected, self.mac)


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
            return await self._forwarded(scope, receive, send, forwarded)
        role, topic = required(scope["method"], path)
        needs = f"; this call needs {_grant(role, topic)}" if role is not None else ""
        scheme, _, token = (authorization or b"").decode("latin-1").partition(" ")
        if scheme.lower() != BEARER or not token.strip():  # auth schemes ignore case
            return await _refuse(
                send, 401, "API key required", f"send 'Authorization: Bearer <key>'{needs}"
            )
        key = self.keys.authenticate(token.strip())
        if key is None and self.keys.error is not None:
            return await _refuse(send, 503, "API keys unavailable", _UNREADABLE)
        if key is None:
            return await _refuse(send, 401, "invalid API key", f"unknown or revoked key{needs}")
        if role is not None and not key.allows(role, topic):
            detail = f"this key lacks {_grant(role, topic)}"
            return await _refuse(send, 403, "role required", detail)
        scope[KEY] = key
        return await self.app(scope, receive, send)

    async def _forwarded(self, scope: Scope, receive: Any, send: Any, forwarded: bytes) -> None:
        """A forward: its tag checked, and the key it names, before a byte of its body is
        read; then the body, no longer than the tag says, held to the tag's digest."""
        tag = Tag.parse(forwarded)
        if tag is None and len(forwarded.split(b" ")) == 4:
            detail = (
                "the forwarding node tags forwards in the form of another DejaQ version: "
                "nodes of one cluster forward to each other when they run the same version"
            )
            return await _refuse(send, 503, "forward from another version", detail)
        method, path = scope["method"], scope["path"]
        target = target_of(scope).decode("latin-1")
        if (
            tag is None
            or self.password is None
            or abs(time.time() * 1000 - tag.at_ms) > FORWARD_TTL_MS
            or not tag.signed_by(self.password, method, target)
        ):
            return await _refuse(send, 401, NOT_A_NODE, _FROM_NODES)
        role, topic = required(method, path)
        if tag.key == NO_KEY:
            detail = (
                f"forwarded by {tag.sender}, a node without API keys (broker.keys_file), "
                "which lets in callers without a key: give it the cluster's key file"
            )
            return await _refuse(send, 401, "API key required", detail)
        key: Key | None = self.keys.get(tag.key)
        if key is None and self.keys.error is not None:
            return await _refuse(send, 503, "API keys unavailable", _UNREADABLE)
        if key is None:
            detail = f"{tag.sender} let in key {tag.key}, which this node's key file lacks"
            return await _refuse(send, 401, "invalid API key", detail)
        if role is not None and not key.allows(role, topic):
            detail = f"this key lacks {_grant(role, topic)}"
            return await _refuse(send, 403, "role required", detail)
        if not self._first(tag.nonce):
            return await _refuse(send, 401, NOT_A_NODE, _FROM_NODES)
        if tag.length > self.max_body:
            return await _refuse(send, 413, "request too large", f"over {self.max_body} bytes")
        body = await read_body(receive, tag.length)
        # A body cut short, or other than the one the tag signs (the tag copied onto it).
        if body is None or len(body) != tag.length or _sha256(body) != tag.digest:
            return await _refuse(send, 401, NOT_A_NODE, "the body is not the one its tag signs")
        scope[KEY] = key
        return await self.app(scope, replay(body, receive), send)

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


_UNREADABLE = "this node cannot read its key file (its log and /readyz say why)"
_FROM_NODES = (
    "forwarded requests are taken from nodes only, each once, within "
    f"{FORWARD_TTL_MS // 1000} s of its tag"
)


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
