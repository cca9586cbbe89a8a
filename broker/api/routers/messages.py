"""Messages: produce over HTTP (through Kafka), peek, cancel, reschedule."""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterator
from typing import Annotated

from fastapi import APIRouter, Response
from pydantic import BaseModel, Field

from dejaq.broker.api.dependencies import AnyBroker, AnyProducer, LeaderBroker
from dejaq.broker.api.routers._common import (
    Body,
    EpochMs,
    Headers,
    MessageId,
    Priority,
    TopicName,
    Utf8,
    problems,
)
from dejaq.broker.service import Broker, Outgoing, Problem, Producer
from dejaq.conf.settings import JsonFields, TopicConfig, TopicKind

router = APIRouter(tags=["messages"])


class NewMessage(Body):
    payload: str = Field(description="base64", max_length=200 * 1024 * 1024)
    key: Utf8 | None = Field(default=None, max_length=10_000, description="bucket key, UTF-8")
    priority: Priority | None = None
    deliver_at: EpochMs | None = None
    id: MessageId | None = Field(default=None, description="idempotency id (dejaq-id)")
    headers: Headers | None = None


class Batch(Body):
    messages: Annotated[list[NewMessage], Field(min_length=1, max_length=1000)]


class Produced(BaseModel):
    ids: list[str]


class Reschedule(Body):
    priority: Priority | None = None
    deliver_at: EpochMs | None = None


class Peeked(BaseModel):
    """A settled message that reached the ledger has only `id` and `status`."""

    id: str
    status: str = Field(description="pending, delayed, leased, acked, dead, cancelled")
    bucket: int | None = None
    sort_key: int | None = None
    priority: int | None = None
    deliver_at: int | None = None
    key: str | None = None
    payload: str | None = None
    deliveries: int | None = None
    lease_deadline: int | None = None
    consumer_id: str | None = None


def decode_payload(b64: str, max_bytes: int) -> bytes:
    """A request's base64 payload: 422 unless base64, 413 over `max_bytes`."""
    try:
        payload = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):  # not base64, or not even ASCII
        raise Problem(422, "invalid payload", "payload must be base64") from None
    if len(payload) > max_bytes:
        raise Problem(413, "payload too large", f"{len(payload)} bytes; the limit is {max_bytes}")
    return payload


def own_headers(headers: dict[str, str] | None) -> list[tuple[str, bytes]]:
    """A request's headers; the `dejaq-` ones are the envelope's, which the broker sets."""
    return [(k, v.encode()) for k, v in (headers or {}).items() if not k.startswith("dejaq-")]


def _envelope(m: NewMessage, cfg: TopicConfig, max_bytes: int) -> Outgoing:
    payload = decode_payload(m.payload, max_bytes)
    headers = own_headers(m.headers)
    mapped = cfg.json_fields or JsonFields()
    for name, field in (("priority", mapped.priority), ("deliver_at", mapped.deliver_at)):
        if field is not None and getattr(m, name) is not None:
            raise Problem(
                422,
                f"{name} is in the payload",
                f"topic {cfg.name} reads {name} from the payload's JSON field {field!r} "
                "(json_fields): set it there, not in the request",
            )
    # The field a topic's kind sorts by; the other would be dropped (the ingest reads
    # the header of its own kind only): refused rather than silently lost.
    sorted_by = {TopicKind.PRIORITY: "priority", TopicKind.TIMELINE: "deliver_at"}
    own = sorted_by.get(cfg.kind.sorted_as)
    for name in ("priority", "deliver_at"):
        if name != own and getattr(m, name) is not None:
            takes = f"takes {own}" if own else "takes neither priority nor deliver_at"
            raise Problem(
                422, f"{name} does not apply", f"topic {cfg.name} is a {cfg.kind} topic: it {takes}"
            )
    if own == "priority" and mapped.priority is None:
        if m.priority is None:
            raise Problem(422, "missing priority", f"topic {cfg.name} is a {cfg.kind} topic")
        headers.append(("dejaq-priority", str(m.priority).encode()))
    elif own == "deliver_at" and mapped.deliver_at is None:
        if m.deliver_at is None:
            raise Problem(422, "missing deliver_at", f"topic {cfg.name} is a {cfg.kind} topic")
        headers.append(("dejaq-deliver-at", str(m.deliver_at).encode()))
    if mapped.id is not None:
        if m.id is not None:
            raise Problem(
                422,
                "id is in the payload",
                f"topic {cfg.name} reads message ids from the payload's JSON field "
                f"{mapped.id!r} (json_fields): set it there, not in the request",
            )
        # Not read by the ingest, which takes the field: so the answer names the id
        # the message is stored under.
        if (found := payload_id(payload, mapped.id)) is not None:
            headers.append(("dejaq-id", found.encode()))
    elif m.id is not None:
        headers.append(("dejaq-id", m.id.encode()))
    return Outgoing(None if m.key is None else m.key.encode(), payload, headers)


class _Fields(tuple):
    """A JSON object's fields in order, duplicates kept: the ingest reads the first."""


_NOTHING = object()
_JSON_KINDS = {_Fields: "an object", list: "an array", float: "a number", bool: "a boolean"}


def payload_id(payload: bytes, path: str) -> str | None:
    """The id at the JSON `path` (`order.ref`, `refs[0]`) of a payload, as the ingest's
    `get_json_object` reads a string or an integer; None where it reads nothing (the
    message gets its default id). 422 where it holds another value, or an empty
    string: the answer could not name the id the ingest gives it."""
    try:
        value = json.loads(payload.decode(), object_pairs_hook=_Fields)
    except ValueError:  # not UTF-8 or not JSON, which the ingest reads no field of
        return None
    except RecursionError:
        raise Problem(
            422, "invalid payload", f"the payload nests too deep to read its {path!r}"
        ) from None
    steps = re.findall(r"([^.\[\]]*)(?:\[(\d+)\])?", path)
    walk = [(name, int(i) if i else None) for name, i in steps if name or i]
    value = next(_matches(value, walk), _NOTHING)
    if value is _NOTHING:
        return None
    if value is None:  # an array's null element, which the ingest reads as this text
        return "null"
    if value == "":  # the ingest quarantines it: no id an API call could name
        raise Problem(422, "invalid id", f"the payload's {path!r} is empty: give an id")
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:  # a lone surrogate: the ingest reads no id, as here
            return None
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise Problem(
        422,
        "invalid id",
        f"the payload's {path!r} holds {_JSON_KINDS[type(value)]}: give a string or an integer",
    )


def _matches(value: object, steps: list[tuple[str, int | None]]) -> Iterator[object]:
    """The values at `steps` (name, then index) in document order, as `get_json_object`
    walks them: every field of a duplicated name in turn, a null field matching
    nothing, a null array element matching as null."""
    if not steps:
        yield value
        return
    (name, index), rest = steps[0], steps[1:]
    if not name:
        found = [value]
    elif isinstance(value, _Fields):
        found = [v for k, v in value if k == name and v is not None]
    else:
        return
    for field in found:
        if index is None:
            yield from _matches(field, rest)
        elif isinstance(field, list) and index < len(field):
            yield from _matches(field[index], rest)


async def _produce(topic: str, items: list[NewMessage], broker: Broker, producer: Producer):
    cfg = broker.topic(topic)
    max_bytes = min(cfg.max_payload_bytes, broker.conf.max_payload_bytes)
    outgoing = [_envelope(m, cfg, max_bytes) for m in items]
    return Produced(ids=await producer.send(cfg.source[0], outgoing))


@router.post(
    "/topics/{topic}/messages",
    response_model=Produced,
    status_code=201,
    responses=problems(404, 413, 422, 503),
)
async def produce(
    topic: TopicName,
    body: NewMessage,
    broker: AnyBroker,
    producer: AnyProducer,
) -> Produced:
    """Produce one message to the topic's Kafka input; returns once Kafka has it."""
    return await _produce(topic, [body], broker, producer)


@router.post(
    "/topics/{topic}/messages/batch",
    response_model=Produced,
    status_code=201,
    responses=problems(404, 413, 422, 503),
)
async def produce_batch(
    topic: TopicName,
    body: Batch,
    broker: AnyBroker,
    producer: AnyProducer,
) -> Produced:
    """Produce up to 1000 messages; returns once Kafka has all of them."""
    return await _produce(topic, body.messages, broker, producer)


@router.get(
    "/topics/{topic}/messages/{message_id:path}",
    response_model=Peeked,
    responses=problems(404, 503),
)
async def peek(topic: TopicName, message_id: str, broker: LeaderBroker) -> dict:
    """A message's status (pending, delayed, leased, acked, dead, cancelled) and payload."""
    return await broker.peek(topic, message_id)


@router.delete(
    "/topics/{topic}/messages/{message_id:path}",
    status_code=204,
    response_class=Response,  # no body, so no content-type
    responses=problems(404, 409, 503),
)
async def cancel(topic: TopicName, message_id: str, broker: LeaderBroker) -> None:
    """Cancel a pending or leased message: it is never delivered (again)."""
    await broker.cancel(topic, message_id)


@router.patch(
    "/topics/{topic}/messages/{message_id:path}",
    status_code=204,
    response_class=Response,  # no body, so no content-type
    responses=problems(404, 409, 422, 503),
)
async def reschedule(
    topic: TopicName, message_id: str, body: Reschedule, broker: LeaderBroker
) -> None:
    """A pending message's new priority (priority topics) or deliver_at (timeline topics)."""
    await broker.reschedule(topic, message_id, body.priority, body.deliver_at)
