"""What the broker's answers decode to: plain dataclasses, so the client needs no pydantic.

The fields mirror the broker's response bodies (a test compares them with its OpenAPI
schemas); `bytes` fields arrive base64-encoded. Keys the client does not know are
ignored, so a newer broker's extra fields do not break an older client.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

T = TypeVar("T")


def decode(cls: type[T], data: Any) -> T:
    """`data` (parsed JSON) as an instance of the dataclass `cls`, nested ones included."""
    return _decoder(cls)(data)


@functools.cache
def _decoder(tp: Any) -> Callable[[Any], Any]:
    """A function from parsed JSON to `tp`, built once per type: resolving the
    annotations (strings here) and unions for every object cost a worker ~0.35 ms a
    leased message. A field taken as it comes is not passed through a function."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = _decoder(next(a for a in get_args(tp) if a is not type(None)))
        if inner is _as_is:
            return _as_is
        return lambda data: None if data is None else inner(data)
    if origin is list:
        item = _decoder(get_args(tp)[0])
        return lambda data: [item(d) for d in data]
    if origin is dict:
        value = _decoder(get_args(tp)[1])
        return lambda data: {k: value(v) for k, v in data.items()}
    if tp is bytes:
        return binascii.a2b_base64  # what `base64.b64decode` calls, without its Python layer
    if dataclasses.is_dataclass(tp):
        return _dataclass_decoder(tp)
    return _as_is


def _dataclass_decoder(tp: type[T]) -> Callable[[dict[str, Any]], T]:
    """An object's fields as `tp`'s: copied whole when all are known (a leased message's,
    the usual case), the few that need it converted."""
    hints = get_type_hints(tp)
    fields = [(f.name, _decoder(hints[f.name])) for f in dataclasses.fields(tp) if f.init]
    known = frozenset(name for name, _ in fields)
    converted = [(name, f) for name, f in fields if f is not _as_is]

    def decode_dataclass(data: dict[str, Any]) -> T:
        kw = dict(data) if known.issuperset(data) else {k: data[k] for k in known & data.keys()}
        for name, f in converted:
            if name in kw:
                kw[name] = f(kw[name])
        return tp(**kw)

    return decode_dataclass


def _as_is(data: Any) -> Any:
    return data


# --- leasing ---------------------------------------------------------------------------------


@dataclass
class Message:
    """A leased message, key and payload decoded."""

    id: str
    bucket: int
    sort_key: int
    priority: int | None
    deliver_at: int | None  # epoch ms
    key: bytes | None
    payload: bytes | None  # None: a record without a value (a Kafka tombstone)
    deliveries: int
    lease_deadline: int  # epoch ms, the broker's clock
    # Names this delivery in an ack, nack, extend or reject (`receipts=`): the broker
    # finds it in the lease's record, faster than by id. None from a broker without them.
    receipt: int | None = None
    # time.monotonic() before which the lease surely holds: the request's send time plus
    # lease_ms, so neither clock skew nor the answer's trip stretches it (without a
    # lease_ms: the broker's deadline read on the local clock). A request sent again may
    # be answered with its first attempt's lease: then the first attempt's send time.
    held_until: float = field(default=0.0, init=False)


@dataclass(frozen=True)
class SettleResult:
    settled: int


@dataclass(frozen=True)
class NackResult:
    settled: int
    dead: list[str] = field(default_factory=list)  # out of deliveries: dead-lettered


@dataclass(frozen=True)
class ExtendResult:
    settled: int
    lease_deadline: int  # epoch ms, the broker's clock


@dataclass(frozen=True)
class Heartbeat:
    consumer_id: str
    buckets: list[int]


@dataclass(frozen=True)
class Left:
    consumer_id: str
    released: int


# --- messages --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Peeked:
    """A settled message that reached the ledger has only `id` and `status`."""

    id: str
    status: str
    bucket: int | None = None
    sort_key: int | None = None
    priority: int | None = None
    deliver_at: int | None = None
    key: bytes | None = None
    payload: bytes | None = None
    deliveries: int | None = None
    lease_deadline: int | None = None
    consumer_id: str | None = None


@dataclass(frozen=True)
class NewMessage:
    """A message to produce: the payload is raw bytes, the key a UTF-8 string."""

    payload: bytes
    key: str | None = None
    priority: int | None = None
    deliver_at: int | None = None
    id: str | None = None
    headers: dict[str, str] | None = None

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"payload": base64.b64encode(self.payload).decode("ascii")}
        for name in ("key", "priority", "deliver_at", "id", "headers"):
            value = getattr(self, name)
            if value is not None:
                body[name] = value
        return body


@dataclass(frozen=True)
class Schedule:
    """A cron topic's schedule, payload decoded; times in epoch ms."""

    id: str
    cron: str
    time_zone: str
    key: str | None
    payload: bytes
    headers: dict[str, str]
    end: int | None
    created_at: int  # occurrences strictly after it
    materialised_until: int  # every occurrence up to it is on the topic's Kafka input
    next_at: int | None  # the next occurrence, none once ended


# --- topics, operations, cluster -------------------------------------------------------------


@dataclass(frozen=True)
class TopicSummary:
    name: str
    kind: str
    buckets: int
    sources: list[str]


@dataclass(frozen=True)
class BucketStats:
    bucket: int
    consumer_id: str | None
    pending: int
    leased: int
    deliverable_now: int
    oldest_age_ms: int | None


@dataclass(frozen=True)
class TopicStats:
    name: str
    kind: str
    buckets: int
    paused: bool
    pending: int
    delayed: int
    leased: int
    deliverable_now: int
    acked: int
    dead: int
    cancelled: int
    oldest_age_ms: int | None
    consumers: list[str]
    per_bucket: list[BucketStats]


@dataclass(frozen=True)
class Paused:
    paused: bool


@dataclass(frozen=True)
class Purged:
    cancelled: int


@dataclass(frozen=True)
class Redriven:
    redriven: int
    # ids given but left as they were, and why: already_redriven, already_settled, not_dead
    skipped: dict[str, str]
    # An earlier attempt of this call, whose answer was lost, may have been applied: an
    # id skipped as already_redriven is then most likely that attempt's doing.
    maybe_applied: bool = field(default=False, init=False)


@dataclass(frozen=True)
class RetentionView:
    at_ms: int  # when the run started, epoch ms
    seconds: float
    removed: int  # settled messages removed from the buffer
    watermark_ms: int  # every message settled before it is gone


@dataclass(frozen=True)
class LedgerLag:
    events: int  # settled events in Raft not yet in the ledger
    oldest_ms: int | None
    unwritten_dead_letters: int
    checkpoint_failures: int
    failing: str | None  # checkpoints failing for minutes: since when, why


@dataclass(frozen=True)
class NodeTopic:
    indexed: int
    buffer_rows: int
    settled_rows: int
    head_store_bytes: int = 0
    last_retention: RetentionView | None = None
    ledger_lag: LedgerLag | None = None


@dataclass(frozen=True)
class Cluster:
    node_id: str
    role: str
    term: int
    leader: str | None
    leader_http: str | None
    nodes: dict[str, str]
    commit_index: int = 0  # the last Raft log index this node knows committed
    resident_bytes: int = 0
    topics: dict[str, NodeTopic] = field(default_factory=dict)
