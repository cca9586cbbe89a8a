"""Leasing: lease the lowest sort keys, then ack, nack, extend or reject them.

Every change is Raft-committed before the 2xx. A batch settles the messages it can; if
any was refused (not leased, expired, another consumer's, already settled) the answer
is 409 with the reason per message id (or receipt).

A settling request names its messages by the receipts their lease gave (the fast way:
every node finds a receipt's message in the lease's own record) or by id.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field, TypeAdapter, model_validator

from dejaq.broker.api.dependencies import LeaderBroker
from dejaq.broker.api.replayed_body import client_watch
from dejaq.broker.api.responses import ExtendResult, NackResult, SettleResult
from dejaq.broker.api.routers._common import (
    Body,
    ConsumerId,
    Ids,
    LeaseMs,
    Priority,
    Receipts,
    RequestId,
    TopicName,
    problems,
)
from dejaq.broker.service import Settled

router = APIRouter(tags=["leases"])

WaitMs = Annotated[int, Field(ge=0, le=30_000, description="long-poll up to 30 s")]
# A follower reads a forwarded lease's wait as the leader will (2500.0 and "2500" too).
WAIT_MS: TypeAdapter[int] = TypeAdapter(WaitMs)


class LeaseRequest(Body):
    consumer_id: ConsumerId
    max_messages: Annotated[int, Field(ge=1, le=1000)] = 1
    lease_ms: LeaseMs | None = Field(default=None, description="default: broker.lease_ms")
    wait_ms: WaitMs = 0
    request_id: RequestId | None = Field(
        default=None,
        description="a token the client makes for this request (1-64 printable ASCII "
        "characters, no space; a uuid4's hex, say) and sends again with it if the answer "
        "is lost: while it is the consumer's last lease's, the request is answered with "
        "what that lease still holds (the same receipts and deliveries; messages acked, "
        "nacked, rejected or expired since left out), and nothing more is leased",
    )


class LeasedMessage(BaseModel):
    id: str
    bucket: int
    sort_key: int
    priority: int | None
    deliver_at: int | None = Field(description="epoch ms")
    key: str | None = Field(description="base64")
    payload: str | None = Field(description="base64; null for a record without a value")
    deliveries: int
    lease_deadline: int = Field(description="epoch ms")
    receipt: int = Field(
        description="names this delivery in an ack, nack, extend or reject, as `receipts`"
    )


class Leased(BaseModel):
    messages: list[LeasedMessage]


class Settle(Body):
    consumer_id: ConsumerId
    receipts: Receipts | None = Field(
        default=None, description="the leased messages' receipts (the faster way)"
    )
    ids: Ids | None = Field(default=None, description="or the messages' ids")

    @model_validator(mode="after")
    def _one_way(self) -> Settle:
        if (self.ids is None) == (self.receipts is None):
            raise ValueError("give either receipts or ids")
        return self

    def named(self) -> tuple[list[str] | list[int], bool]:
        """The messages named, and whether by receipt."""
        if self.receipts is not None:
            return self.receipts, True
        assert self.ids is not None
        return self.ids, False


class Nack(Settle):
    delay_ms: Annotated[int, Field(ge=0, le=7 * 24 * 3600 * 1000)] = 0
    priority: Priority | None = None


class Extend(Settle):
    lease_ms: LeaseMs | None = None


def _settled(result: Settled, verb: str) -> dict:
    return {"settled": result.settled_or_409(verb)}


@router.post("/topics/{topic}/leases", response_model=Leased, responses=problems(404, 422, 503))
async def lease(topic: TopicName, body: LeaseRequest, broker: LeaderBroker, request: Request):
    """Lease up to `max_messages` of the lowest deliverable sort keys of your buckets.

    Sent again with the same `request_id` after a lost answer, it is answered with what
    the first attempt leased, rather than leasing more while those wait out their lease.
    Messages whose stored JSON the node's disk fails are read again from the buffer
    while the poll waits; a 503 "messages unreadable on this node" if `wait_ms` passes
    first."""
    lease_ms = body.lease_ms or broker.conf.lease_ms
    with client_watch(request.receive) as gone:
        messages = await broker.lease(
            topic,
            body.consumer_id,
            body.max_messages,
            lease_ms,
            body.wait_ms,
            gone,
            body.request_id,
        )
    # Serialised by the broker: the hot path skips response-model validation.
    return Response(b'{"messages": %s}' % messages, media_type="application/json")


@router.post(
    "/topics/{topic}/acks", response_model=SettleResult, responses=problems(404, 409, 422, 503)
)
async def ack(topic: TopicName, body: Settle, broker: LeaderBroker):
    """Done: never delivered again."""
    result = await broker.settle(topic, "ack", body.consumer_id, *body.named())
    return _settled(result, "acked")


@router.post(
    "/topics/{topic}/nacks", response_model=NackResult, responses=problems(404, 409, 422, 503)
)
async def nack(topic: TopicName, body: Nack, broker: LeaderBroker):
    """Give back for redelivery, optionally after `delay_ms` or with a new priority."""
    named, receipts = body.named()
    result = await broker.nack(
        topic, body.consumer_id, named, body.delay_ms, body.priority, receipts
    )
    return {**_settled(result, "nacked"), "dead": result.dead}


@router.post(
    "/topics/{topic}/extensions",
    response_model=ExtendResult,
    responses=problems(404, 409, 422, 503),
)
async def extend(topic: TopicName, body: Extend, broker: LeaderBroker):
    """Push the lease deadline to now + `lease_ms`."""
    lease_ms = body.lease_ms or broker.conf.lease_ms
    named, receipts = body.named()
    result, deadline = await broker.extend(topic, body.consumer_id, named, lease_ms, receipts)
    return {**_settled(result, "extended"), "lease_deadline": deadline}


@router.post(
    "/topics/{topic}/rejections",
    response_model=SettleResult,
    responses=problems(404, 409, 422, 503),
)
async def reject(topic: TopicName, body: Settle, broker: LeaderBroker):
    """Poison: straight to the dead letters, no more deliveries."""
    result = await broker.settle(topic, "reject", body.consumer_id, *body.named())
    return _settled(result, "rejected")
